"""A real haproxy in front of replicas of one share server (tests/test_replicas.py).

Debian's ``haproxy``, installed when missing by scripts/ensure-haproxy.sh (root and apt-get;
skipped with the reason otherwise, failed under CI), run as a child process with its own config
and loopback port, and stopped at the end. The config is the one docs/operations.md shows for
the replicated layout: round robin, a readiness check every 500 ms (a replica whose database is
unreachable, or that is gone, leaves the rotation), and a retry on another replica when a
connection to one fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from envguard import unavailable

ROOT = Path(__file__).resolve().parents[1]


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or (os.path.exists("/usr/sbin/haproxy") and "/usr/sbin/haproxy") or None
    if found is None and os.geteuid() != 0:
        unavailable("no haproxy binary, and not root: cannot install Debian's haproxy")
    if found is None and shutil.which("apt-get") is None:
        unavailable("no haproxy binary and no apt-get to install it")
    out = subprocess.run(["bash", str(ROOT / "scripts" / "ensure-haproxy.sh")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def config(port: int, backends: list[tuple[str, int]]) -> str:
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
def running_haproxy(port: int, backends: list[tuple[str, int]], workdir: Path) -> Iterator[str]:
    """haproxy on ``port`` in front of the backends; yields its URL once it answers."""
    binary = haproxy_binary()
    cfg = workdir / "haproxy.cfg"
    cfg.write_text(config(port, backends))
    check = subprocess.run([binary, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    log = open(workdir / "haproxy.log", "ab")
    proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, (workdir / "haproxy.log").read_text()
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "haproxy did not answer"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
