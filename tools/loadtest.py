"""The load test: ``clients`` concurrent clients uploading single reports to one share server.

One implementation for both users: ``tests/test_faults.py`` (bounded, ``DPSKETCH_LOAD_SECONDS``,
asserting zero errors, every acknowledged report counted once, memory flat) and ``dpsketch bench
load`` (``--seconds 60 --clients 64`` by default), which also drives the same clients against the
server's trivial ``GET /healthz`` for a baseline: the ratio of the two throughputs says how much of
what this driver (httpx, one connection per client, on the same machine) can push through the
same HTTP stack the upload path reaches.

Each client is its own ``httpx.AsyncClient`` with one keep-alive connection and one request in
flight (one shared pool of 64 connections spends its time in pool bookkeeping: measured 5x fewer
requests/s with the server idle). While it runs, the server process's RSS is sampled every 0.2 s
from /proc and its CPU time is read before and after.

``bench_overload`` (``dpsketch bench overload``) is the other driver here: an open loop offering
batches at twice the measured capacity, on raw HTTP/1.1 connections (:class:`RawConnection`),
checking every acknowledged report id against the store afterwards (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

if TYPE_CHECKING:
    from dpsketch.protocol.study import Study
    from dpsketch.tools.cluster import ServerSpec

Request = Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat; 10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_idle(pids: list[int], quiet: float = 0.02, window: float = 1.0, timeout: float = 120.0) -> float:
    """Wait until no process of ``pids`` used more than ``quiet`` CPU seconds in ``window``
    seconds; seconds waited. A started server rebuilds its studies and loads its compiled loops
    and accounting libraries in background threads for a few seconds of CPU (a long-running
    server has done so): what is measured after this is the request's own cost. A thread
    starved by a loaded machine still gets more than ``quiet / window`` of a core (2 % by
    default: a load of 100 on 2 cores), so it is not mistaken for idle."""
    t0 = time.perf_counter()
    before = [cpu_seconds(p) for p in pids]
    while time.perf_counter() - t0 < timeout:
        time.sleep(window)
        after = [cpu_seconds(p) for p in pids]
        if all(a - b <= quiet for a, b in zip(after, before)):
            break
        before = after
    return time.perf_counter() - t0


def status_kib(field: str, pid: int | str = "self") -> int | None:
    """A kB field of /proc/PID/status (VmRSS, VmHWM, ...), or None if the kernel has none."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def rss_kib(pid: int) -> int:
    kib = status_kib("VmRSS", pid)
    if kib is None:
        raise RuntimeError("no VmRSS")
    return kib


@dataclass
class LoadResult:
    seconds: float                   # asked for
    clients: int
    elapsed: float                   # measured, from the first request to the last answer
    latencies: list[float]           # seconds, one per answered request
    errors: list[str]                # transport errors and non-200 answers
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, KiB)
    server_cpu_s: float = float("nan")

    @property
    def requests(self) -> int:
        return len(self.latencies)

    @property
    def throughput(self) -> float:
        return self.requests / self.elapsed if self.elapsed > 0 else 0.0

    def percentile(self, q: float) -> float:
        lat = sorted(self.latencies)
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")

    def rss_halves(self) -> tuple[list[int], list[int]]:
        half = self.seconds / 2
        return [k for t, k in self.rss if t < half], [k for t, k in self.rss if t >= half]

    def memory_flat(self) -> tuple[bool, str]:
        """Second-half RSS within 10% + an allowance of the first half (mean and max). The
        allowance: 16 MiB slack plus 400 bytes per stored report (the per-report index grows by
        about 200 bytes a report; nothing else may)."""
        first, second = self.rss_halves()
        if not first or not second:
            return False, "too few RSS samples"
        allowance = 16 * 1024 + 0.4 * self.requests
        ok = (statistics.mean(second) <= statistics.mean(first) * 1.10 + allowance
              and max(second) <= max(first) * 1.10 + allowance)
        return ok, (f"RSS first half mean {statistics.mean(first) / 1024:.1f} MiB (max "
                    f"{max(first) / 1024:.1f}), second half mean {statistics.mean(second) / 1024:.1f} MiB "
                    f"(max {max(second) / 1024:.1f}), allowance {allowance / 1024:.1f} MiB")

    def figures(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "clients": self.clients, "seconds": round(self.elapsed, 1), "requests": self.requests,
            "errors": len(self.errors), "requests_per_s": round(self.throughput),
            "p50_ms": round(self.percentile(0.50) * 1e3, 1), "p99_ms": round(self.percentile(0.99) * 1e3, 1),
            "server_cpu_s": round(self.server_cpu_s, 1),
        }
        if self.rss:
            flat, _ = self.memory_flat()
            out.update(rss_start_mib=round(self.rss[0][1] / 1024, 1), rss_end_mib=round(self.rss[-1][1] / 1024, 1),
                       rss_max_mib=round(max(k for _, k in self.rss) / 1024, 1), memory_flat=flat)
        if self.errors:
            out["first_errors"] = self.errors[:5]
        return out


async def drive(url: str, request: Request, *, seconds: float, clients: int = 64,
                pid: int | None = None, verify: Any = True) -> LoadResult:
    """``clients`` clients each sending ``request`` back to back for ``seconds``."""
    latencies: list[float] = []
    errors: list[str] = []
    rss: list[tuple[float, int]] = []
    # the clients exist before the clock starts (with one TLS context between them: building one
    # per client costs tens of ms each, which would count against a short run)
    context = verify if isinstance(verify, ssl.SSLContext) else httpx.create_ssl_context(verify=verify)
    https = [httpx.AsyncClient(base_url=url, timeout=30, verify=context) for _ in range(clients)]
    start = time.monotonic()
    stop_at = start + seconds

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at:
            t0 = time.perf_counter()
            try:
                r = await request(http)
            except httpx.HTTPError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:200]}")

    def sample() -> None:
        # a thread of its own, not a coroutine: the event loop, busy with the clients' CPU work
        # (every request bound and encoded here), starved a sampling coroutine for seconds on a
        # loaded machine, and the memory check then had no samples in one half of the run
        while time.monotonic() < stop_at:
            rss.append((time.monotonic() - start, rss_kib(pid)))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True) if pid else None
    cpu0 = cpu_seconds(pid) if pid else float("nan")
    try:
        if sampler is not None:
            sampler.start()
        await asyncio.gather(*(client(http) for http in https))
        elapsed = time.monotonic() - start
    finally:
        if sampler is not None:
            sampler.join()
        for http in https:
            await http.aclose()
    return LoadResult(seconds=seconds, clients=clients, elapsed=elapsed, latencies=latencies,
                      errors=errors, rss=rss,
                      server_cpu_s=cpu_seconds(pid) - cpu0 if pid else float("nan"))


def single_report_upload(study: "Study", token: str | None = None, position: int = 0) -> Request:
    """POST one fresh random report (JSON) per call, as a phone-sized client would: a random
    share bound to its report id for the server at ``position`` (the other servers' commitments
    random, ``binding.bind_for_server``), with the study's upload token if given."""
    from dpsketch.protocol import binding, messages

    path = f"/v1/studies/{study.study_id}/reports"
    headers = {"Authorization": f"Bearer {token}"} if token else None

    def call(http: httpx.AsyncClient) -> Awaitable[httpx.Response]:
        share = np.frombuffer(os.urandom(8 * study.width), dtype="<u8").reshape(1, study.width)
        (rid,), proof = binding.bind_for_server(study.study_id, study.n_servers, position,
                                                binding.CONTENT_SHARE, share)
        body = messages.Report.of(rid, proof[0], share[0]).model_dump()
        return http.post(path, json=body, headers=headers)

    return call


def health(http: httpx.AsyncClient) -> Awaitable[httpx.Response]:
    return http.get("/healthz")


def run_uploads(url: str, study: "Study", *, seconds: float, clients: int = 64, pid: int | None = None,
                token: str | None = None) -> LoadResult:
    return asyncio.run(drive(url, single_report_upload(study, token), seconds=seconds, clients=clients, pid=pid))


def _provisioned_and_warm(url: str, spec: "ServerSpec", study: "Study", d: int, pid: int) -> str:
    """Provision ``study`` on the server and issue one data owner's upload token without a quota
    (tools/server_bench.provision, as the operator), load the server's compiled loops
    (server_bench.warm_server, with a study of ``d`` columns) and wait until process ``pid`` is
    idle (its other background warm-ups done: :func:`wait_idle`), so RSS and rates are taken
    from steady state; the token."""
    from dpsketch.tools.server_bench import provision, warm_server

    token = provision(url, study, spec.operator_token)
    warm_server(url, d, np.random.default_rng(0), spec.operator_token)
    wait_idle([pid])
    return token


def bench_load(seconds: float = 60.0, clients: int = 64, baseline_seconds: float | None = None,
               d: int = 4, workdir: Path | None = None) -> dict[str, Any]:
    """Start one share server, drive single-report uploads for ``seconds`` and the same driver
    against its GET /healthz for ``baseline_seconds`` (default: min(seconds, 10)), half of it
    before the uploads and half after, so a machine whose load drifts (other work on it)
    weighs on both figures alike."""
    import secrets
    import shutil
    import tempfile

    from dpsketch.tools.cluster import ServerSpec, share_server
    from dpsketch.protocol.study import design

    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="dpsketch-load-"))
    wd.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(server_id="s1", operator_token="op-" + secrets.token_hex(12),
                      analyst_token="an-" + secrets.token_hex(12), db_path=wd / "s1.sqlite3")
    proc = share_server(spec, wd).start(timeout=60)
    try:
        study = design(name="load", columns=[f"x{i}" for i in range(d)], label=None, servers=["s1", "s2"],
                       expected_reports=1000, k=8, s=2, min_reports=500, max_reports=10**8)[0]
        token = _provisioned_and_warm(proc.url, spec, study, d, proc.proc.pid)
        half = (baseline_seconds or min(seconds, 10.0)) / 2
        before = asyncio.run(drive(proc.url, health, seconds=half, clients=clients))
        load = run_uploads(proc.url, study, seconds=seconds, clients=clients, pid=proc.proc.pid, token=token)
        held = int(httpx.get(f"{proc.url}/v1/studies/{study.study_id}").json()["report_count"])
        after = asyncio.run(drive(proc.url, health, seconds=half, clients=clients))
        base = LoadResult(seconds=2 * half, clients=clients, elapsed=before.elapsed + after.elapsed,
                          latencies=before.latencies + after.latencies, errors=before.errors + after.errors)
    finally:
        proc.stop()
        if workdir is None:
            shutil.rmtree(wd, ignore_errors=True)
    out = load.figures()
    out.update(d=d, server_report_count=held,
               baseline_healthz_per_s=round(base.throughput), baseline_healthz_p50_ms=round(base.percentile(0.5) * 1e3, 1),
               baseline_errors=len(base.errors),
               ratio_to_healthz=round(load.throughput / base.throughput, 3) if base.throughput else None)
    return out


def summary(fig: dict[str, Any]) -> str:
    text = (f"{fig['clients']} clients for {fig['seconds']} s, single-report uploads: {fig['requests']} "
            f"requests, {fig['errors']} errors, {fig['requests_per_s']} req/s, p50 {fig['p50_ms']} ms, "
            f"p99 {fig['p99_ms']} ms; server RSS {fig.get('rss_start_mib')} -> {fig.get('rss_end_mib')} MiB "
            f"(max {fig.get('rss_max_mib')}, flat: {fig.get('memory_flat')}); server CPU {fig['server_cpu_s']} s")
    if "baseline_healthz_per_s" in fig:
        text += (f"\nbaseline, same driver against GET /healthz: {fig['baseline_healthz_per_s']} req/s "
                 f"(p50 {fig['baseline_healthz_p50_ms']} ms); uploads reach {fig['ratio_to_healthz']:.2f} x of it")
    return text


# --- overload: offered load above capacity (``dpsketch bench overload``) ----------------------


def _bound_batches(study: "Study", count: int, rows: int, seed: int) -> list[tuple[list[bytes], bytes]]:
    """``count`` share batches of ``rows`` fresh random reports each, bound for the study's first
    server as a client binds them: (report ids, body)."""
    from dpsketch.protocol import binding, messages

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        shares = rng.integers(0, np.iinfo(np.uint64).max, size=(rows, study.width), dtype=np.uint64,
                              endpoint=True)
        ids, proofs = binding.bind_for_server(study.study_id, study.n_servers, 0, binding.CONTENT_SHARE, shares)
        out.append((ids, messages.encode_batch(ids, proofs, shares)))
    return out


#: An idle keep-alive connection older than this is not reused by the overload driver.
KEEP_ALIVE_REUSE_S = 2.0


class RawConnection:
    """A minimal HTTP/1.1 client connection on asyncio streams, for the overload driver.

    Why not httpx here: offering twice a server's capacity needs a driver far cheaper per request
    than the server. httpx costs about 1 ms of Python a request and tens of ms per client made
    (its SSL context), so on this 2-core machine an httpx driver, not the server, set the pace and
    the latencies (measured: the driver used 38 s of CPU in a 41 s run). This one writes a
    request and reads one Content-Length-framed answer (every dpsketch answer has one);
    plain HTTP only."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_used = time.monotonic()

    async def post(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {len(body)}\r\n"
                          f"{head}\r\n".encode() + body)
        try:
            await self.writer.drain()
            raw = await self.reader.readuntil(b"\r\n\r\n")
            lines = raw.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            got = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    got[k.strip().lower()] = v.strip()
            content = await self.reader.readexactly(int(got.get("content-length", "0")))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
            await self.close()
            raise
        if got.get("connection", "").lower() == "close":
            await self.close()
        return status, got, content

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


@dataclass
class OverloadRun:
    """What one driven phase saw: answers by status, latencies from the *scheduled* send time
    (so client-side waiting counts: no coordinated omission), acknowledged ids, server RSS."""

    elapsed: float
    sent: int
    statuses: dict[int, int]
    latencies_ok: list[float]
    latencies_all: list[float]
    retry_after: dict[str, int]
    acked: list[bytes]
    transport_errors: list[str]
    rss: list[tuple[float, int]] = field(default_factory=list)
    connections: int = 0  # opened by the driver (open loop: the most requests in flight at once)
    server_cpu_s: float = float("nan")
    driver_cpu_s: float = float("nan")

    def pct(self, values: list[float], q: float) -> float:
        v = sorted(values)
        return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


async def _sample_rss(pid: int | None, rss: list[tuple[float, int]], start: float, done: asyncio.Event) -> None:
    while pid and not done.is_set():
        rss.append((time.monotonic() - start, rss_kib(pid)))
        try:
            await asyncio.wait_for(done.wait(), 0.2)
        except asyncio.TimeoutError:
            pass


async def _post_one(conn: RawConnection, path: str, headers: dict, item: tuple[list[bytes], bytes],
                    at: float, run: OverloadRun) -> None:
    ids, body = item
    try:
        status, got, _ = await conn.post(path, headers, body)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as exc:
        run.transport_errors.append(f"{type(exc).__name__}: {exc}")
        return
    latency = time.monotonic() - at
    run.latencies_all.append(latency)
    run.statuses[status] = run.statuses.get(status, 0) + 1
    if status == 200:
        run.latencies_ok.append(latency)
        run.acked.extend(ids)
    else:
        key = got.get("retry-after", "none")
        run.retry_after[key] = run.retry_after.get(key, 0) + 1


def _host_port(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError("the overload driver speaks plain HTTP only")
    return parts.hostname or "127.0.0.1", parts.port or 80


async def closed_loop(url: str, path: str, headers: dict, batches: list, clients: int, seconds: float,
                      pid: int | None = None) -> OverloadRun:
    """``clients`` clients posting batches back to back for ``seconds`` (or until none is left):
    the capacity the server sustains when every client waits for its answer."""
    run = OverloadRun(0.0, 0, {}, [], [], {}, [], [])
    todo = list(reversed(batches))
    https = [RawConnection(*_host_port(url)) for _ in range(clients)]
    start = time.monotonic()
    done = asyncio.Event()

    async def one(http: RawConnection) -> None:
        while todo and time.monotonic() < start + seconds:
            item = todo.pop()
            run.sent += 1
            await _post_one(http, path, headers, item, time.monotonic(), run)

    sampler = asyncio.create_task(_sample_rss(pid, run.rss, start, done))
    try:
        await asyncio.gather(*(one(h) for h in https))
    finally:
        run.elapsed = time.monotonic() - start
        done.set()
        await sampler
        for h in https:
            await h.close()
    return run


async def open_loop(url: str, path: str, headers: dict, batches: list, rate: float,
                    pid: int | None = None) -> OverloadRun:
    """Send every batch at ``rate`` per second whatever the answers (an open system: arrivals do
    not wait for the server, as millions of independent clients do not); a refused batch is not
    retried here. Each request takes an idle keep-alive connection, or opens a new one when all
    are busy (:class:`RawConnection`)."""
    run = OverloadRun(0.0, 0, {}, [], [], {}, [], [])
    done = asyncio.Event()
    idle: list[RawConnection] = []
    every: list[RawConnection] = []
    host, port = _host_port(url)

    async def send(item: tuple[list[bytes], bytes], at: float) -> None:
        http = None
        while idle:
            http = idle.pop()
            if time.monotonic() - http.last_used < KEEP_ALIVE_REUSE_S:
                break
            # the server may be closing it (uvicorn's keep-alive timeout is 5 s): a request sent
            # on it now would fail for a reason that is this driver's, not the server's
            await http.close()
            http = None
        if http is None:
            http = RawConnection(host, port)
            every.append(http)
        await _post_one(http, path, headers, item, at, run)
        http.last_used = time.monotonic()
        idle.append(http)

    start = time.monotonic()
    sampler = asyncio.create_task(_sample_rss(pid, run.rss, start, done))
    tasks = []
    try:
        for i, item in enumerate(batches):
            at = start + i / rate
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            run.sent += 1
            tasks.append(asyncio.create_task(send(item, at)))
        await asyncio.gather(*tasks)
    finally:
        run.elapsed = time.monotonic() - start
        run.connections = len(every)
        done.set()
        await sampler
        for http in every:
            await http.close()
    return run


def bench_overload(seconds: float = 10.0, factor: float = 2.0, batch_rows: int = 500, d: int = 4,
                   clients: int = 8, capacity_seconds: float = 6.0, admission: bool = True,
                   env: dict[str, str] | None = None, workdir: Path | None = None,
                   rate: float | None = None) -> dict[str, Any]:
    """Offered load ``factor`` x capacity for ``seconds`` against one fresh durable server.

    1. capacity: ``clients`` closed-loop clients post ``batch_rows``-row batches for
       ``capacity_seconds``; acknowledged batches per second is the capacity C;
    2. overload: ``factor`` x C batches per second, open loop, for ``seconds``: accepted
       throughput, p50/p99 latency of acknowledged and of all answers, refusals and their
       Retry-After, server RSS (sampled every 0.2 s from /proc);
    3. loss check: every acknowledged report id must be among the server's report ids
       (GET /report-ids), and the server holds nothing else.

    ``admission=False`` runs the server with the in-flight upload limits off
    (``DPSKETCH_MAX_INFLIGHT_UPLOADS=0``, ``..._BYTES=0``): what happens without them.
    ``rate`` (batches per second) fixes the offered load instead of ``factor`` x this run's
    capacity, so that two runs compare at the same offered load (capacity measured on a shared
    machine scatters by tens of percent between runs)."""
    import secrets
    import shutil
    import tempfile

    from dpsketch.tools.cluster import ServerSpec, share_server
    from dpsketch.protocol.messages import SHARES_MEDIA_TYPE
    from dpsketch.protocol.study import design

    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="dpsketch-overload-"))
    wd.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(server_id="s1", operator_token="op-" + secrets.token_hex(12),
                      analyst_token="an-" + secrets.token_hex(12), db_path=wd / "s1.sqlite3")
    # one driver address stands for many clients: no per-address connection cap
    server_env = {"DPSKETCH_MAX_CONNECTIONS_PER_IP": "0", **(env or {})}
    if not admission:
        server_env.update(DPSKETCH_MAX_INFLIGHT_UPLOADS="0", DPSKETCH_MAX_INFLIGHT_UPLOAD_BYTES="0")
    proc = share_server(spec, wd, server_env).start(timeout=60)
    try:
        study = design(name="overload", columns=[f"x{i}" for i in range(d)], label=None, servers=["s1", "s2"],
                       expected_reports=10**6, k=8, s=2, min_reports=500, max_reports=10**8)[0]
        analyst = {"Authorization": f"Bearer {spec.analyst_token}"}
        token = _provisioned_and_warm(proc.url, spec, study, d, proc.proc.pid)
        path = f"/v1/studies/{study.study_id}/batches"
        headers = {"Content-Type": SHARES_MEDIA_TYPE, "Authorization": f"Bearer {token}"}
        # capacity: enough batches for 400 k rows/s, more than this machine sustains
        warm = _bound_batches(study, int(capacity_seconds * 400_000 / batch_rows), batch_rows, seed=1)
        cap = asyncio.run(closed_loop(proc.url, path, headers, warm, clients, capacity_seconds, proc.proc.pid))
        del warm
        capacity = cap.statuses.get(200, 0) / cap.elapsed
        if rate is None:
            rate = factor * capacity
        batches = _bound_batches(study, max(1, int(rate * seconds)), batch_rows, seed=2)
        index0 = _store_memory(proc.url, spec.operator_token)
        cpu0, own0 = cpu_seconds(proc.proc.pid), time.process_time()
        over = asyncio.run(open_loop(proc.url, path, headers, batches, rate, proc.proc.pid))
        over.server_cpu_s, over.driver_cpu_s = cpu_seconds(proc.proc.pid) - cpu0, time.process_time() - own0
        index_growth = _store_memory(proc.url, spec.operator_token) - index0
        del batches
        r = httpx.get(f"{proc.url}{path.rsplit('/', 1)[0]}/report-ids", headers=analyst, timeout=120)
        r.raise_for_status()
        held = {r.content[i:i + 16] for i in range(0, len(r.content), 16)}
    finally:
        proc.stop()
        if workdir is None:
            shutil.rmtree(wd, ignore_errors=True)
    acked = set(cap.acked) | set(over.acked)
    ok = over.statuses.get(200, 0)
    rss = [k for _, k in over.rss]
    return {
        "admission": admission, "d": d, "batch_rows": batch_rows, "body_kib": round(len(_bound_batches(
            study, 1, batch_rows, 3)[0][1]) / 1024, 1),
        "capacity_batches_per_s": round(capacity, 1), "capacity_rows_per_s": round(capacity * batch_rows),
        "capacity_p99_s": round(cap.pct(cap.latencies_ok, 0.99), 3),
        "factor": round(rate / capacity, 2) if capacity else None, "seconds": seconds,
        "offered_batches_per_s": round(rate, 1), "offered_rows_per_s": round(rate * batch_rows),
        "sent": over.sent, "statuses": {str(k): v for k, v in sorted(over.statuses.items())},
        "transport_errors": len(over.transport_errors), "first_transport_errors": over.transport_errors[:3],
        "retry_after": over.retry_after, "elapsed_s": round(over.elapsed, 1),
        "accepted_batches_per_s": round(ok / over.elapsed, 1),
        "accepted_rows_per_s": round(ok * batch_rows / over.elapsed),
        "accepted_over_capacity": round(ok / over.elapsed / capacity, 2) if capacity else None,
        "p50_ok_s": round(over.pct(over.latencies_ok, 0.5), 3), "p99_ok_s": round(over.pct(over.latencies_ok, 0.99), 3),
        "p99_all_s": round(over.pct(over.latencies_all, 0.99), 3),
        "rss_start_mib": round(rss[0] / 1024, 1) if rss else None,
        "rss_max_mib": round(max(rss) / 1024, 1) if rss else None,
        "rss_end_mib": round(rss[-1] / 1024, 1) if rss else None,
        # the index of the reports stored meanwhile (about 200 bytes a report) is held on purpose
        "store_index_growth_mib": round(index_growth / 2**20, 1),
        "rss_growth_beyond_index_mib": round((max(rss) - rss[0]) / 1024 - index_growth / 2**20, 1) if rss else None,
        "driver_connections": over.connections, "server_cpu_s": round(over.server_cpu_s, 1),
        "driver_cpu_s": round(over.driver_cpu_s, 1),
        "acknowledged_reports": len(acked), "server_held_reports": len(held),
        "lost_reports": len(acked - held), "unacknowledged_but_held": len(held - acked),
    }


def _store_memory(url: str, operator_token: str) -> float:
    """The server's dpsketch_store_memory_bytes (its open studies' totals and report index)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {operator_token}"}, timeout=30)
    r.raise_for_status()
    for family in text_string_to_metric_families(r.text):
        if family.name == "dpsketch_store_memory_bytes":
            return float(family.samples[0].value)
    raise RuntimeError("the server exports no dpsketch_store_memory_bytes")


def overload_summary(fig: dict[str, Any]) -> str:
    return (f"admission limits {'on' if fig['admission'] else 'OFF'}: capacity {fig['capacity_rows_per_s']} rows/s "
            f"({fig['capacity_batches_per_s']} batches of {fig['batch_rows']}/s, d = {fig['d']}); offered "
            f"{fig['factor']} x = {fig['offered_rows_per_s']} rows/s for {fig['seconds']} s; answers "
            f"{fig['statuses']} (+{fig['transport_errors']} transport errors), Retry-After {fig['retry_after']}; "
            f"accepted {fig['accepted_rows_per_s']} rows/s ({fig['accepted_over_capacity']} x capacity); "
            f"latency of acknowledged p50 {fig['p50_ok_s']} s, p99 {fig['p99_ok_s']} s (all answers p99 "
            f"{fig['p99_all_s']} s); server RSS {fig['rss_start_mib']} -> max {fig['rss_max_mib']} -> "
            f"{fig['rss_end_mib']} MiB (of which the index of the reports stored: {fig['store_index_growth_mib']} "
            f"MiB; beyond it: {fig['rss_growth_beyond_index_mib']} MiB); CPU server {fig['server_cpu_s']} s, driver {fig['driver_cpu_s']} s over "
            f"{fig['elapsed_s']} s, {fig['driver_connections']} connections; acknowledged {fig['acknowledged_reports']}, held "
            f"{fig['server_held_reports']}, lost {fig['lost_reports']}")
