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
"""

from __future__ import annotations

import asyncio
import os
import ssl
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

if TYPE_CHECKING:
    from dpsketch.protocol.study import Study

Request = Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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

    async def sample() -> None:
        while time.monotonic() < stop_at:
            rss.append((time.monotonic() - start, rss_kib(pid)))
            await asyncio.sleep(0.2)

    cpu0 = cpu_seconds(pid) if pid else float("nan")
    try:
        await asyncio.gather(*([sample()] if pid else []), *(client(http) for http in https))
        elapsed = time.monotonic() - start
    finally:
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


def bench_load(seconds: float = 60.0, clients: int = 64, baseline_seconds: float | None = None,
               d: int = 4, workdir: Path | None = None) -> dict[str, Any]:
    """Start one share server, drive single-report uploads for ``seconds`` and the same driver
    against its GET /healthz for ``baseline_seconds`` (default: min(seconds, 10)), half of it
    before the uploads and half after, so a machine whose load drifts (other work on it)
    weighs on both figures alike."""
    import secrets
    import shutil
    import tempfile

    from dpsketch.cluster import ServerSpec, share_server
    from dpsketch.protocol.study import design

    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="dpsketch-load-"))
    wd.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(server_id="s1", operator_token="op-" + secrets.token_hex(12),
                      analyst_token="an-" + secrets.token_hex(12), db_path=wd / "s1.sqlite3")
    proc = share_server(spec, wd).start(timeout=60)
    try:
        study = design(name="load", columns=[f"x{i}" for i in range(d)], label=None, servers=["s1", "s2"],
                       expected_reports=1000, k=8, s=2, min_reports=500, max_reports=10**8)[0]
        r = httpx.put(f"{proc.url}/v1/studies/{study.study_id}", content=study.canonical(),
                      headers={"Authorization": f"Bearer {spec.analyst_token}",
                               "Content-Type": "application/json"})
        r.raise_for_status()
        from services.admin import ServerAdmin

        with ServerAdmin(proc.url, spec.operator_token) as admin:  # one data owner, no quota
            token = admin.issue_upload_tokens(study.study_id, 1, None).token
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
