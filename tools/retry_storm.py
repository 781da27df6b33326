"""A retry storm over real HTTP (issue 46): clients re-sending reports a share server already
holds, while other clients send fresh ones.

Every client that lost an acknowledgement (a timeout, a dropped connection, a proxy's 502) sends
the same bytes again; after an outage every client does, at once. The server must answer each
re-send 2xx with the report counted as a duplicate (docs/protocol.md section 8), store nothing
twice, and keep taking the fresh uploads of everyone else. One implementation for both users:
``tests/test_retry_storm.py`` (seconds, asserting the answers and the count) and
``benchmarks/retry_storm.py`` (10^6 stored, 10 s, the rates and latencies).

The driver is :class:`tools.loadtest.RawConnection` (plain HTTP/1.1 on asyncio streams, one
keep-alive connection a client, one request in flight each): on a 2-core machine an httpx driver
spends more CPU per request than the server, and would set the pace of both phases.

A run has three phases of fresh uploads by ``fresh_clients`` clients: calm (only them), storm
(them plus ``storm_clients`` re-senders) and calm again, so a machine whose load drifts weighs
on the calm rate from both sides of the storm (``rounds``: the storm in parts, each between two
calm parts). The figure is the ratio of the fresh clients' rate during the storm to their calm
rate, measured in the same run. The server holds a re-send's answer while fresh uploads arrive
(services/resend_gate.py), so the storm's clients, one request in flight each, slow down.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from dpsketch.tools.loadtest import RawConnection, _host_port, cpu_seconds, status_kib

if TYPE_CHECKING:
    from dpsketch.protocol.study import Study

_TRANSPORT_ERRORS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError)


@dataclass
class Reports:
    """Reports bound for one server (position 0 of the study): ids, proofs, shares, row-aligned."""

    ids: list[bytes]
    proofs: np.ndarray
    shares: np.ndarray

    @classmethod
    def random(cls, study: "Study", n: int, rng: np.random.Generator) -> "Reports":
        from dpsketch.protocol import binding

        shares = rng.integers(0, np.iinfo(np.uint64).max, size=(n, study.width), dtype=np.uint64, endpoint=True)
        ids, proofs = binding.bind_for_server(study.study_id, study.n_servers, 0, binding.CONTENT_SHARE, shares)
        return cls(ids, proofs, shares)

    def single_body(self, i: int) -> bytes:
        """The single-upload JSON body of report ``i`` (as the SDK sends it)."""
        from dpsketch.protocol.messages import Report

        return Report.of(self.ids[i], self.proofs[i], self.shares[i]).model_dump_json().encode()

    def batch_body(self, rows: np.ndarray | slice) -> bytes:
        from dpsketch.protocol import messages

        ids = self.ids[rows] if isinstance(rows, slice) else [self.ids[i] for i in rows]
        return messages.encode_batch(ids, self.proofs[rows], self.shares[rows])


def store_base(url: str, study: "Study", token: str | None, base: Reports, batch_rows: int = 5000,
               clients: int = 16) -> float:
    """Upload ``base`` as share batches of ``batch_rows`` from ``clients`` connections at once
    (each batch must be accepted whole); seconds. Small batches make many stored batch rows:
    what a study filled by single uploads holds, where finding a re-sent report's batch by
    reading every batch header was slowest (issue 46)."""
    from dpsketch.protocol import messages

    headers = {"Content-Type": messages.SHARES_MEDIA_TYPE, **({"Authorization": f"Bearer {token}"} if token else {})}
    path = f"/v1/studies/{study.study_id}/batches"
    starts = list(range(0, len(base.ids), batch_rows))[::-1]
    host, port = _host_port(url)

    async def client() -> None:
        conn = RawConnection(host, port)
        try:
            while starts:
                start = starts.pop()
                part = slice(start, start + batch_rows)
                status, _, content = await conn.post(path, headers, base.batch_body(part))
                if status != 200 or json.loads(content)["accepted"] != len(base.ids[part]):
                    raise RuntimeError(f"base batch at {start} not stored whole: {status} {content[:200]!r}")
        finally:
            await conn.close()

    async def every() -> None:
        await asyncio.gather(*(client() for _ in range(clients)))

    t0 = time.perf_counter()
    asyncio.run(every())
    return time.perf_counter() - t0


@dataclass
class Phase:
    """What one phase saw. Latencies in seconds from a request's send to its whole answer."""

    name: str
    seconds: float = 0.0
    #: from the start to the last fresh client's last answer: the fresh rate's denominator (a
    #: storm's phase lasts until its last held re-send is answered, after the fresh clients stopped)
    fresh_seconds: float = 0.0
    fresh_latencies: list[float] = field(default_factory=list)
    resend_latencies: list[float] = field(default_factory=list)
    resent_records: int = 0           # records acknowledged as duplicates
    statuses: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # non-2xx, transport errors, wrong counts
    fresh_acked: list[bytes] = field(default_factory=list)
    #: CPU seconds the server process used in the phase (None: not measured); per request
    #: answered it is what a request costs the server whatever else runs on the machine
    server_cpu_s: float | None = None

    @classmethod
    def pooled(cls, name: str, phases: list["Phase"]) -> "Phase":
        """Several phases of one kind (interleaved rounds) as one."""
        out = cls(name)
        for p in phases:
            out.seconds += p.seconds
            out.fresh_seconds += p.fresh_seconds
            out.fresh_latencies += p.fresh_latencies
            out.resend_latencies += p.resend_latencies
            out.resent_records += p.resent_records
            for status, count in p.statuses.items():
                out.statuses[status] = out.statuses.get(status, 0) + count
            out.problems += p.problems
            out.fresh_acked += p.fresh_acked
            if p.server_cpu_s is not None:
                out.server_cpu_s = (out.server_cpu_s or 0.0) + p.server_cpu_s
        return out

    @property
    def requests(self) -> int:
        return len(self.fresh_acked) + len(self.resend_latencies)

    @property
    def server_cpu_ms_per_request(self) -> float | None:
        if self.server_cpu_s is None or not self.requests:
            return None
        return self.server_cpu_s / self.requests * 1e3

    @property
    def fresh_rate(self) -> float:
        return len(self.fresh_acked) / self.fresh_seconds if self.fresh_seconds else 0.0

    def figures(self) -> dict[str, Any]:
        def ms(values: list[float], q: float) -> float | None:
            v = sorted(values)
            return round(v[min(len(v) - 1, int(q * len(v)))] * 1e3, 2) if v else None

        return {"phase": self.name, "seconds": round(self.seconds, 2), "fresh_acked": len(self.fresh_acked),
                "fresh_per_s": round(self.fresh_rate), "fresh_p50_ms": ms(self.fresh_latencies, 0.5),
                "fresh_p99_ms": ms(self.fresh_latencies, 0.99), "resend_requests": len(self.resend_latencies),
                "resend_requests_per_s": round(len(self.resend_latencies) / self.seconds) if self.seconds else 0,
                "resent_records": self.resent_records, "resend_p50_ms": ms(self.resend_latencies, 0.5),
                "resend_p99_ms": ms(self.resend_latencies, 0.99), "statuses": dict(sorted(self.statuses.items())),
                "server_cpu_ms_per_request": (None if self.server_cpu_ms_per_request is None
                                              else round(self.server_cpu_ms_per_request, 3)),
                "problems": len(self.problems), "first_problems": self.problems[:5]}


class Fresh:
    """Fresh single reports, bound as they are needed (chunks of ``chunk``)."""

    def __init__(self, study: "Study", rng: np.random.Generator, chunk: int = 2048):
        self.study, self.rng, self.chunk = study, rng, chunk
        self.pending: list[tuple[bytes, bytes]] = []
        self.made = 0

    def next(self) -> tuple[bytes, bytes]:
        if not self.pending:
            reports = Reports.random(self.study, self.chunk, self.rng)
            self.pending = [(reports.ids[i], reports.single_body(i)) for i in range(self.chunk)][::-1]
            self.made += self.chunk
        return self.pending.pop()


async def _exchange(conn: RawConnection, path: str, headers: dict, body: bytes, phase: Phase) -> tuple[float, dict] | None:
    """POST once; (latency, answer JSON) for a 200, None (recorded as a problem) otherwise."""
    t0 = time.perf_counter()
    try:
        status, _, content = await conn.post(path, headers, body)
    except _TRANSPORT_ERRORS as exc:
        phase.problems.append(f"transport {type(exc).__name__}: {exc}")
        return None
    latency = time.perf_counter() - t0
    phase.statuses[status] = phase.statuses.get(status, 0) + 1
    if status != 200:
        phase.problems.append(f"{status}: {content[:200]!r}")
        return None
    return latency, json.loads(content)


async def run_phase(url: str, study: "Study", token: str | None, name: str, seconds: float, fresh: Fresh,
                    fresh_clients: int, resend_bodies: list[tuple[int, bytes, str]] = (),
                    storm_clients: int = 0, seed: int = 0) -> Phase:
    """``fresh_clients`` clients posting fresh single reports and ``storm_clients`` posting
    re-sends drawn at random from ``resend_bodies`` ((records, body, content type): bodies the
    server already holds every record of), each back to back, for ``seconds``."""
    host, port = _host_port(url)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    reports_path = f"/v1/studies/{study.study_id}/reports"
    batches_path = f"/v1/studies/{study.study_id}/batches"
    phase = Phase(name)
    pick = random.Random(seed)
    conns = [RawConnection(host, port) for _ in range(fresh_clients + storm_clients)]
    start = time.monotonic()
    stop_at = start + seconds

    async def fresh_client(conn: RawConnection) -> None:
        headers = {"Content-Type": "application/json", **auth}
        try:
            await fresh_loop(conn, headers)
        finally:
            phase.fresh_seconds = max(phase.fresh_seconds, time.monotonic() - start)

    async def fresh_loop(conn: RawConnection, headers: dict) -> None:
        while time.monotonic() < stop_at:
            rid, body = fresh.next()
            got = await _exchange(conn, reports_path, headers, body, phase)
            if got is None:
                continue
            latency, answer = got
            if (answer["accepted"], answer["duplicates"]) != (1, 0):
                phase.problems.append(f"fresh report {rid.hex()} answered {answer}")
                continue
            phase.fresh_latencies.append(latency)
            phase.fresh_acked.append(rid)

    async def storm_client(conn: RawConnection) -> None:
        while time.monotonic() < stop_at:
            records, body, content_type = resend_bodies[pick.randrange(len(resend_bodies))]
            single = content_type == "application/json"
            got = await _exchange(conn, reports_path if single else batches_path,
                                  {"Content-Type": content_type, **auth}, body, phase)
            if got is None:
                continue
            latency, answer = got
            if (answer["accepted"], answer["duplicates"]) != (0, records):
                phase.problems.append(f"a re-send of {records} stored records answered {answer}")
                continue
            phase.resend_latencies.append(latency)
            phase.resent_records += records

    try:
        await asyncio.gather(*(fresh_client(c) for c in conns[:fresh_clients]),
                             *(storm_client(c) for c in conns[fresh_clients:]))
    finally:
        phase.seconds = time.monotonic() - start
        for conn in conns:
            await conn.close()
    return phase


def resend_pool(base: Reports, singles: int, batches: int, batch_rows: int, rng: np.random.Generator
                ) -> list[tuple[int, bytes, str]]:
    """Re-sends of stored reports: ``singles`` single-report JSON bodies and ``batches`` share
    batches of ``batch_rows`` stored reports each, all drawn at random from ``base``."""
    from dpsketch.protocol import messages

    n = len(base.ids)
    pool = [(1, base.single_body(int(i)), "application/json") for i in rng.choice(n, size=min(singles, n), replace=False)]
    for _ in range(batches):
        rows = np.sort(rng.choice(n, size=batch_rows, replace=False))
        pool.append((batch_rows, base.batch_body(rows), messages.SHARES_MEDIA_TYPE))
    return pool


def held(url: str, study: "Study", operator_token: str) -> int:
    r = httpx.get(f"{url}/v1/studies/{study.study_id}", headers={"Authorization": f"Bearer {operator_token}"},
                  timeout=60)
    r.raise_for_status()
    return int(r.json()["report_count"])


def held_ids(url: str, study: "Study", analyst_token: str) -> set[bytes]:
    from dpsketch.protocol import messages

    r = httpx.get(f"{url}/v1/studies/{study.study_id}/report-ids",
                  headers={"Authorization": f"Bearer {analyst_token}"}, timeout=120)
    r.raise_for_status()
    return set(messages.decode_report_ids(r.content))


def storm(url: str, study: "Study", token: str | None, base: Reports, *, seconds: float, calm_seconds: float,
          fresh_clients: int = 8, storm_clients: int = 64, resend_batch_rows: int = 8,
          crowd_seconds: float = 0.0, seed: int = 0, server_pid: int | None = None, rounds: int = 1
          ) -> dict[str, Any]:
    """Calm, storm, calm (module docstring) against a server holding ``base``; the phases and
    the ratio of the fresh rate in the storm to the calm rate (both calm phases pooled).
    ``crowd_seconds``: then as many clients as in the storm, every one sending fresh reports
    (the control: the server's rate at the storm's concurrency when nothing is a re-send).
    ``server_pid``: the server's process, to measure its CPU per request answered in each phase.
    ``rounds``: the storm in that many parts, each between two calm parts (calm, storm, calm,
    ..., calm; the calm time shared among them), pooled: on a machine whose load drifts (other
    work), calm and storm are then measured under the same drift."""
    rng = np.random.default_rng(seed)
    fresh = Fresh(study, rng)
    pool = resend_pool(base, 4096, 512 if resend_batch_rows else 0, resend_batch_rows, rng)

    rss_mib: dict[str, float] = {}

    async def measured(*args) -> Phase:
        cpu0 = cpu_seconds(server_pid) if server_pid else None
        phase = await run_phase(url, study, token, *args)
        if cpu0 is not None:
            phase.server_cpu_s = cpu_seconds(server_pid) - cpu0
            # the server's resident memory after each phase, and its peak so far
            rss_mib[f"after {phase.name}"] = round(status_kib("VmRSS", server_pid) / 1024, 1)
            rss_mib[f"peak after {phase.name}"] = round(status_kib("VmHWM", server_pid) / 1024, 1)
        return phase

    async def phases() -> list[Phase]:
        if server_pid:
            rss_mib["start"] = round(status_kib("VmRSS", server_pid) / 1024, 1)
        calm_part = calm_seconds / (rounds + 1)
        before = await measured("calm before", calm_part, fresh, fresh_clients)
        storms, calms = [], []
        for r in range(rounds):
            storms.append(await measured("storm", seconds / rounds, fresh, fresh_clients, pool, storm_clients,
                                         seed + r))
            calms.append(await measured("calm after", calm_part, fresh, fresh_clients))
        during = storms[0] if rounds == 1 else Phase.pooled("storm", storms)
        after = calms[0] if rounds == 1 else Phase.pooled("calm after", calms)
        crowd = (await measured("fresh crowd", crowd_seconds, fresh, fresh_clients + storm_clients)
                 if crowd_seconds else None)
        return [before, during, after, crowd]

    before, during, after, crowd = asyncio.run(phases())
    calm_rate = (len(before.fresh_acked) + len(after.fresh_acked)) / (before.fresh_seconds + after.fresh_seconds)
    calm_lat = sorted(before.fresh_latencies + after.fresh_latencies)
    storm_fresh = sorted(during.fresh_latencies)
    storm_resend = sorted(during.resend_latencies)
    storm_requests = len(during.fresh_acked) + len(during.resend_latencies)

    def median_ms(v: list[float]) -> float | None:
        return round(v[len(v) // 2] * 1e3, 2) if v else None

    crowd_rate = crowd.fresh_rate if crowd else None
    calm_cpu = (before.server_cpu_s + after.server_cpu_s
                if before.server_cpu_s is not None and after.server_cpu_s is not None else None)
    return {
        "phases": [p for p in (before, during, after, crowd) if p is not None],
        "fresh_clients": fresh_clients, "storm_clients": storm_clients, "resend_batch_rows": resend_batch_rows,
        "calm_fresh_per_s": round(calm_rate), "storm_fresh_per_s": round(during.fresh_rate),
        "storm_over_calm": round(during.fresh_rate / calm_rate, 3) if calm_rate else None,
        # fresh uploads answered per CPU second of the server, in the storm against calm: the
        # share of the server's work fresh uploads keep, whatever else runs on the machine (the
        # rates above move with the CPU the machine's other work leaves the server and the
        # clients; this does not). Near 1: re-sends cost the server next to nothing; a fair
        # share of the server among all clients makes it about their share of the requests
        "storm_over_calm_per_server_cpu": (
            round((len(during.fresh_acked) / during.server_cpu_s)
                  / ((len(before.fresh_acked) + len(after.fresh_acked)) / calm_cpu), 3)
            if calm_cpu and during.server_cpu_s and before.fresh_acked else None),
        # the fresh uploads' part of every upload request answered in the storm (a fair share
        # among the clients: fresh_clients / (fresh_clients + storm_clients))
        "storm_fresh_share": round(len(during.fresh_acked) / during.requests, 3) if during.requests else None,
        # every upload request answered in the storm (fresh and re-sent) against the calm fresh
        # rate: what a re-send request costs the server against a fresh one
        "storm_requests_per_s": round(storm_requests / during.seconds) if during.seconds else 0,
        "storm_requests_over_calm": round(storm_requests / during.seconds / calm_rate, 3) if calm_rate else None,
        # a fresh client's answers a second against a re-sending client's, in the storm: 1 is a
        # fair share of the server between them, below 1 the re-sends crowd fresh uploads out
        # the storm's request rate against the same number of clients all sending fresh reports
        "crowd_fresh_per_s": round(crowd_rate) if crowd else None,
        "storm_requests_over_crowd": (round(storm_requests / during.seconds / crowd_rate, 3)
                                      if crowd_rate else None),
        "fresh_share_per_client": (round((len(during.fresh_acked) / fresh_clients)
                                         / (len(during.resend_latencies) / storm_clients), 3)
                                   if during.resend_latencies and fresh_clients else None),
        "calm_fresh_p50_ms": median_ms(calm_lat), "storm_fresh_p50_ms": median_ms(storm_fresh),
        "storm_resend_p50_ms": median_ms(storm_resend),
        "storm_resend_max_ms": round(storm_resend[-1] * 1e3, 1) if storm_resend else None,
        "server_rss_mib": rss_mib or None,
        "resend_over_fresh_latency": (round(storm_resend[len(storm_resend) // 2] / storm_fresh[len(storm_fresh) // 2], 3)
                                      if storm_resend and storm_fresh else None),
        # the server's CPU per request answered, in the storm against the fresh crowd (same
        # number of clients): what a re-send costs the server against a fresh upload, measured
        # apart from the machine's other load (which moves the rates above)
        "storm_cpu_per_request_over_crowd": (
            round(during.server_cpu_ms_per_request / crowd.server_cpu_ms_per_request, 3)
            if crowd and during.server_cpu_ms_per_request and crowd.server_cpu_ms_per_request else None),
        "fresh_acked": [rid for p in (before, during, after, crowd) if p for rid in p.fresh_acked],
        "problems": [m for p in (before, during, after, crowd) if p for m in p.problems],
    }


def gate_figures(url: str, operator_token: str) -> dict[str, float]:
    """The server's held re-send answers (services/resend_gate.py), from its /metrics: held
    now, the most held at once, held in all, answered at once past a cap."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {operator_token}"}, timeout=30)
    r.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name in ("dpsketch_resends_held", "dpsketch_resends_held_peak"):
                out[sample.name.removeprefix("dpsketch_")] = sample.value
            elif sample.name == "dpsketch_resend_answers_total":
                out["resend_answers_" + sample.labels["outcome"]] = sample.value
    return out


def start_server(workdir, env: dict[str, str] | None = None, d: int = 4, max_reports: int = 10**8):
    """One share server (open to uploads with a token, no population budget) with a study of
    ``d`` columns provisioned and the server warmed: (process, spec, study, upload token)."""
    import secrets

    from dpsketch.protocol.study import design
    from dpsketch.tools.cluster import ServerSpec, share_server
    from dpsketch.tools.loadtest import _provisioned_and_warm

    spec = ServerSpec(server_id="s1", operator_token="op-" + secrets.token_hex(12),
                      analyst_token="an-" + secrets.token_hex(12), db_path=workdir / "s1.sqlite3")
    base_env = {"DPSKETCH_POPULATION_EPSILON": "none", "DPSKETCH_POPULATION_FLOOR_EPSILON": "none"}
    proc = share_server(spec, workdir, {**base_env, **(env or {})}).start(timeout=60)
    try:
        study = design(name="retry-storm", columns=[f"x{i}" for i in range(d)], label=None, servers=["s1", "s2"],
                       expected_reports=10**4, k=8, s=2, min_reports=500, max_reports=max_reports)[0]
        token = _provisioned_and_warm(proc.url, spec, study, d, proc.proc.pid)
    except BaseException:
        proc.stop()
        raise
    return proc, spec, study, token


def load_average() -> float:
    return round(os.getloadavg()[0], 2)
