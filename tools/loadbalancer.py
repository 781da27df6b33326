"""An haproxy in front of replicas of one share server, for tests and benchmarks on one host
(docs/operations.md, "Replicas", shows the same configuration for a deployment).

Round robin; a replica leaves the rotation when its ``/readyz`` fails twice (checked every
500 ms: a replica whose database is unreachable, or that is gone); a request whose connection to
a replica fails is retried on another one. The binary is Debian's ``haproxy``
(scripts/ensure-haproxy.sh installs it when missing).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from dpsketch.tools.cluster import terminate

ROOT = Path(__file__).resolve().parents[1]


def ensure_haproxy() -> str:
    """The haproxy binary, installed by scripts/ensure-haproxy.sh if missing (needs root)."""
    found = shutil.which("haproxy") or (Path("/usr/sbin/haproxy").exists() and "/usr/sbin/haproxy") or None
    if found:
        return found
    out = subprocess.run(["bash", str(ROOT / "scripts" / "ensure-haproxy.sh")], capture_output=True,
                         text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"no haproxy: {out.stderr.strip()}")
    return out.stdout.strip().splitlines()[-1]


def config(port: int, backends: list[tuple[str, int]]) -> str:
    """The haproxy configuration: a frontend on loopback ``port`` over the (name, port) replicas."""
    servers = "\n".join(f"    server {name} 127.0.0.1:{p} check inter 500ms fall 2 rise 2"
                        for name, p in backends)
    return f"""global
    maxconn 2048
defaults
    mode http
    timeout connect 2s
    timeout client 120s
    timeout server 120s
    retries 3
    option redispatch 1
frontend share_server
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
{servers}
"""


@contextmanager
def running_haproxy(binary: str, port: int, backends: list[tuple[str, int]], workdir: Path) -> Iterator[str]:
    """haproxy on ``port`` in front of the backends; yields its URL once it answers."""
    cfg = workdir / "haproxy.cfg"
    cfg.write_text(config(port, backends))
    check = subprocess.run([binary, "-c", "-f", str(cfg)], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy refused its configuration: {check.stdout}{check.stderr}")
    log = open(workdir / "haproxy.log", "ab")
    proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {(workdir / 'haproxy.log').read_text()[-2000:]}")
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("haproxy did not answer within 20 s")
            time.sleep(0.1)
        yield url
    finally:
        terminate(proc)
