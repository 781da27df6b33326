"""A real Prometheus server for the scrape tests (tests/test_metrics.py, tests/test_compose.py).

Debian's ``prometheus``, installed when missing by scripts/ensure-prometheus.sh (root and
apt-get; skipped with the reason otherwise), run as a child process with its own config, storage
directory and loopback port, and stopped at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from dpsketch.tools.cluster import terminate

from envguard import unavailable

ROOT = Path(__file__).resolve().parents[1]


def prometheus_binary() -> str:
    """The prometheus binary (installing Debian's package if missing); skipped (failed under CI) if impossible."""
    found = shutil.which("prometheus")
    if found is None and os.geteuid() != 0:
        unavailable("no prometheus binary, and not root: cannot install Debian's prometheus")
    if found is None and shutil.which("apt-get") is None:
        unavailable("no prometheus binary and no apt-get to install it")
    out = subprocess.run(["bash", str(ROOT / "scripts" / "ensure-prometheus.sh")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def scrape_job(name: str, target: str, token: str, *, labels: dict[str, str] | None = None,
               scheme: str = "http", ca_file: Path | None = None) -> str:
    """One scrape_configs entry (1 s interval) with a bearer token."""
    extra = ""
    if scheme == "https":
        extra = f"\n    scheme: https\n    tls_config:\n      ca_file: {ca_file}"
    label_text = ", ".join(f"{k}: {v}" for k, v in (labels or {}).items())
    return f"""
  - job_name: {name}
    scrape_interval: 1s
    scrape_timeout: 1s{extra}
    authorization:
      type: Bearer
      credentials: {token}
    static_configs:
      - targets: ["{target}"]
        labels: {{{label_text}}}"""


@contextmanager
def running_prometheus(binary: str, jobs: list[str], workdir: Path) -> Iterator[Callable[[str], list[dict]]]:
    """Run prometheus with these scrape jobs; yield ``query(promql) -> result list``."""
    config = workdir / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:" + "".join(jobs) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)

    def query(promql: str) -> list[dict]:
        r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": promql}, timeout=5)
        r.raise_for_status()
        return r.json()["data"]["result"]

    try:
        yield query
    finally:
        terminate(proc)
        log.close()


def wait_for(query: Callable[[str], list[dict]], done: Callable[[Callable], bool], timeout: float = 30) -> None:
    """Poll until ``done(query)`` is true (connection errors while prometheus starts are retried)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if done(query):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
