"""Start share servers and the analyzer as real processes on loopback ports.

Used by ``dpsketch demo``, the benchmarks and the tests: every process is a real uvicorn server
with its own SQLite file, started with ``python -m dpsketch.tools.cli ...`` exactly as an operator would
(the test suite forks them from a parent that has imported them instead: :data:`launch`).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx


def popen(argv: list[str], env: dict[str, str], log: IO[bytes]) -> subprocess.Popen:
    """Start ``argv`` as its own process in its own session, its output going to ``log``."""
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


#: How :meth:`ManagedProcess.spawn` starts a process: a ``subprocess.Popen``, or anything with
#: its ``pid``, ``poll``, ``wait``, ``returncode`` and ``send_signal``. The test suite forks its
#: servers from a parent that has imported them (tests/forkstart.py), a tenth of the CPU a start.
launch: Callable[[list[str], dict[str, str], IO[bytes]], Any] = popen

_handed_out: set[int] = set()
_rng = random.SystemRandom()


def _outside_ephemeral_range() -> range:
    """Ports the kernel never picks for ``bind(0)`` or an outgoing connection's local end; under
    pytest-xdist, this worker's own slice of them, so that two workers never pick one port."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return range(0)
    below = range(max(1024, low - 12000), low)
    above = range(high + 1, 65536)
    pool = below if len(below) >= len(above) else above
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and workers.isdigit() and int(workers) > 1:
        return pool[int(worker[2:])::int(workers)]
    return pool


def free_ports(n: int) -> list[int]:
    """n loopback ports that are free now and were never handed out before by this process.

    Two failure modes made a test cluster start with one server twice or not at all: the kernel
    can give the same ephemeral port to two ``bind(0)`` calls once the first socket is closed
    (seen in CI), and an outgoing connection can take a free ephemeral port before the server
    binds it. So ports come from outside the ephemeral range where the kernel tells us that
    range, every socket stays open until all n are chosen, and a port is handed out only once.
    """
    pool = _outside_ephemeral_range()
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        for attempt in range(50 * n + 1000):
            if len(ports) == n:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            try:
                sock.bind(("127.0.0.1", _rng.choice(pool) if pool and attempt < 50 * n else 0))
            except OSError:
                continue
            port = sock.getsockname()[1]
            if port not in _handed_out:
                ports.append(port)
                _handed_out.add(port)
        if len(ports) < n:
            raise RuntimeError(f"could not find {n} free loopback ports")
        return ports
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


@dataclass
class ManagedProcess:
    """A child process serving HTTP on a loopback port."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: Any = None  # a subprocess.Popen, or what ``launch`` returns in its place
    scheme: str = "http"
    ca_file: Path | None = None  # https: verify the health checks against this CA (else system trust)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What an httpx client talking to this process should pass as ``verify``."""
        return ssl.create_default_context(cafile=str(self.ca_file)) if self.ca_file else True

    def spawn(self) -> "ManagedProcess":
        """Start the process without waiting: start several, then :meth:`wait_healthy` each."""
        log = open(self.log_path, "ab")
        try:
            self.proc = launch(self.argv, self.env, log)
        finally:
            log.close()
        return self

    def start(self, timeout: float = 30.0) -> "ManagedProcess":
        """Spawn it and wait until it is healthy; one that never is (it exits, or its health
        check times out) is stopped before the error goes up, not left running unowned."""
        start_all([self], timeout)
        return self

    def wait_healthy(self, timeout: float) -> None:
        """Poll /healthz with one client: a fresh httpx client per poll loads the CA bundle
        (about 30 ms of CPU), which at 20 polls a second competed with the starting processes."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0, verify=self.verify) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with code {self.proc.returncode}; log:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.url + "/healthz").status_code == 200:
                        return
                except httpx.TransportError as exc:
                    cause: BaseException | None = exc
                    while cause is not None and not isinstance(cause, ssl.SSLCertVerificationError):
                        cause = cause.__cause__ or cause.__context__
                    if cause is not None:  # never heals: say so now
                        raise RuntimeError(f"{self.name}: TLS certificate not accepted: {cause}") from exc
                time.sleep(0.05)
        raise TimeoutError(f"{self.name} not healthy after {timeout}s; log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the crash a durable store must survive."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        stop_all([self], timeout)

    def _ask_to_stop(self) -> bool:
        """SIGTERM (once: a second one makes uvicorn skip its graceful shutdown); whether sent."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            return True
        return False

    def _wait_stopped(self, deadline: float) -> None:
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()


def start_all(procs: list[ManagedProcess], timeout: float = 30.0) -> list[ManagedProcess]:
    """Spawn every process, then wait for each: N servers start in the time of one. If one
    cannot be spawned or is not healthy in time, every one spawned here is stopped before the
    error goes up: a caller whose start failed holds nothing to stop, and nothing keeps running
    (a process still starting, or one stuck, would otherwise outlive the demo or test that
    started it, holding its port and files)."""
    spawned: list[ManagedProcess] = []
    try:
        for proc in procs:
            spawned.append(proc.spawn())
        for proc in procs:
            proc.wait_healthy(timeout)
    except BaseException:
        stop_all(spawned)
        raise
    return procs


def stop_all(procs: list[ManagedProcess], timeout: float = 10.0) -> None:
    """SIGTERM every process, then wait for each (SIGKILL after ``timeout``): N processes shut
    down gracefully in the time of the slowest, not of all of them one after another."""
    asked = [proc for proc in procs if proc._ask_to_stop()]
    deadline = time.monotonic() + timeout
    for proc in asked:
        proc._wait_stopped(deadline)


def terminate(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a helper process we started (haproxy, prometheus, an echo server): SIGTERM, then
    SIGKILL if it is still running after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "dpsketch.tools.cli", *args]


def _tls_args(scheme: str, certfile: Path | None, keyfile: Path | None) -> list[str]:
    if scheme == "http":
        if certfile or keyfile:
            raise ValueError("certfile/keyfile given with scheme='http'")
        return []
    if scheme != "https":
        raise ValueError(f"scheme must be 'http' or 'https', not {scheme!r}")
    if not (certfile and keyfile):
        raise ValueError("scheme='https' needs certfile and keyfile")
    return ["--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile)]


@dataclass
class ServerSpec:
    server_id: str
    operator_token: str
    analyst_token: str
    db_path: Path | str  # a SQLite file, or a postgresql:// URL (the server's --db)
    port: int = field(default_factory=free_port)


def share_server(spec: ServerSpec, workdir: Path, extra_env: dict[str, str] | None = None, *,
                 scheme: str = "http", certfile: Path | None = None, keyfile: Path | None = None,
                 ca_file: Path | None = None) -> ManagedProcess:
    """``scheme="https"`` serves TLS with certfile/keyfile; ca_file verifies the health checks."""
    env = dict(os.environ)
    env.update(
        DPSKETCH_OPERATOR_TOKEN=spec.operator_token,
        DPSKETCH_ANALYST_TOKEN=spec.analyst_token,
    )
    env.update(extra_env or {})
    argv = _cli(
        "server",
        "--server-id", spec.server_id,
        "--db", str(spec.db_path),
        "--host", "127.0.0.1",
        "--port", str(spec.port),
        *_tls_args(scheme, certfile, keyfile),
    )
    return ManagedProcess(spec.server_id, argv, env, spec.port, workdir / f"{spec.server_id}.log",
                          scheme=scheme, ca_file=ca_file)


def relay(servers: dict[str, str], workdir: Path, port: int | None = None, *args: str,
          name: str = "relay") -> ManagedProcess:
    """``dpsketch relay`` forwarding to ``servers`` (server id -> URL); ``args``: more flags
    (``--window``, ``--max-entries``). Every device of a local cluster shares 127.0.0.1, so the
    per-address connection cap is lifted."""
    port = port or free_port()
    argv = _cli("relay", *(a for sid, url in servers.items() for a in ("--server", f"{sid}={url}")),
                "--host", "127.0.0.1", "--port", str(port), "--max-connections-per-ip", "0", *args)
    return ManagedProcess(name, argv, dict(os.environ), port, workdir / f"{name}.log")


def analyzer(config_path: Path, db_path: Path, workdir: Path, port: int | None = None,
             extra_env: dict[str, str] | None = None, *, scheme: str = "http",
             certfile: Path | None = None, keyfile: Path | None = None,
             ca_file: Path | None = None) -> ManagedProcess:
    """As :func:`share_server` for TLS; the servers' CA goes in the cluster config's ca_file."""
    port = port or free_port()
    env = dict(os.environ)
    env.update(extra_env or {})
    argv = _cli(
        "analyzer",
        "--config", str(config_path),
        "--db", str(db_path),
        "--host", "127.0.0.1",
        "--port", str(port),
        *_tls_args(scheme, certfile, keyfile),
    )
    return ManagedProcess("analyzer", argv, env, port, workdir / "analyzer.log",
                          scheme=scheme, ca_file=ca_file)
