"""Fault injection against real processes: SIGKILLed servers and analyzer, a server down for part
of an upload, a locked database, a full disk, and a bounded load test.

Every test uses real server processes on loopback ports with real SQLite files; the SIGKILL and
load tests also run with each server on its own database of a real PostgreSQL server
(``BOTH_STORES``, tests/pg.py). The locked-file and full-disk tests are SQLite's; PostgreSQL's
lock and outage tests are in tests/test_server_unit.py. Where the test
must know A + G exactly it captures the SDK's own ``prepare_batch`` output (the shares it sent)
and computes S(A + G) independently of the servers' code. Such exact-release tests use studies
without a floor (``epsilon_floor=None``: no server noise) on servers whose policy accepts them
(``DPSKETCH_MAX_FLOOR_EPSILON=none``); servers take open uploads (``conftest.OPEN_UPLOADS``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

import dpsketch.client_sdk.client as sdk
from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.protocol import ProblemError, Study, messages, ring, sketch
from dpsketch.protocol.study import design
from dpsketch.tools import loadtest, server_bench
from dpsketch.tools.cluster import ManagedProcess, analyzer as analyzer_process, share_server

import studies
from conftest import BOTH_STORES, OPEN_UPLOADS, Cluster
from envguard import unavailable

COLUMNS = ["x0", "x1", "x2", "x3", "y"]
#: Server policy that accepts studies without a floor, whose release is exactly S(A + G).
NO_FLOOR = {"DPSKETCH_MAX_FLOOR_EPSILON": "none"}


def exact_cluster(servers) -> Cluster:
    """Three servers (open uploads) that take floor-less studies, and an analyzer."""
    return Cluster(servers, 3, api_token="analyst-api-token",
                   server_env={f"s{j + 1}": NO_FLOOR for j in range(3)})


# --- helpers ------------------------------------------------------------------------------------


def direct_sketch(study: Study, report_ids: list[bytes], encoded: np.ndarray) -> np.ndarray:
    """S(A+G) in the ring from the spec's bucket/sign function, independently of the servers."""
    b = study.k // study.s
    acc = np.zeros((study.k, study.d), dtype=np.uint64)
    encoded = np.asarray(encoded, dtype=np.uint64)
    negated = np.uint64(0) - encoded  # wraps mod 2^64
    for l in range(study.s):
        rows, neg = [], []
        for rid in report_ids:
            bucket, sign = sketch.bucket_and_sign(study.seed_bytes, rid, study.k, study.s, l)
            rows.append(l * b + bucket)
            neg.append(sign < 0)
        np.add.at(acc, np.array(rows), np.where(np.array(neg)[:, None], negated, encoded))
    return acc


def expected_release(study: Study, ids: list[bytes], encoded: np.ndarray) -> np.ndarray:
    return ring.decode(direct_sketch(study, ids, encoded), study.frac_bits) * sketch.scale(study.s)


class Capture:
    """Records every PreparedBatch the SDK builds (monkeypatched over client_sdk.client.prepare_batch)."""

    def __init__(self, monkeypatch):
        self.batches: list[sdk.PreparedBatch] = []
        real = sdk.prepare_batch

        def recording(study, rows, *args, **kwargs):
            batch = real(study, rows, *args, **kwargs)
            self.batches.append(batch)
            return batch

        monkeypatch.setattr(sdk, "prepare_batch", recording)

    def ids(self) -> list[bytes]:
        return [rid for b in self.batches for rid in b.report_ids]

    def encoded(self) -> dict[bytes, np.ndarray]:
        """report id -> A + G of that report in the ring (the sum of its N shares)."""
        out = {}
        for b in self.batches:
            rows = ring.reconstruct([b.share(j) for j in range(len(b.shares))])
            for i, rid in enumerate(b.report_ids):
                out[rid] = rows[i]
        return out


class AckLog(httpx.HTTPTransport):
    """An httpx transport that records which batches each server acknowledged (200), and when."""

    def __init__(self, study: Study):
        super().__init__()
        self.width, self.n_servers = study.width, study.n_servers
        self.lock = threading.Lock()
        self.acked: dict[int, list[tuple[float, list[bytes]]]] = {}
        self.listeners: list = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith("/batches") and response.status_code == 200:
            ids = messages.decode_upload(request.content, request.headers["content-type"], self.width,
                                         self.n_servers).ids
            with self.lock:
                self.acked.setdefault(request.url.port, []).append((time.monotonic(), ids))
                n = len(self.acked[request.url.port])
            for fn in self.listeners:
                fn(request.url.port, n)
        return response

    def acked_before(self, port: int, t: float) -> set[bytes]:
        with self.lock:
            return {rid for when, ids in self.acked.get(port, []) if when <= t for rid in ids}


def held_ids(url: str, analyst_token: str, study_id: str) -> list[bytes]:
    r = httpx.get(f"{url}/v1/studies/{study_id}/report-ids",
                  headers={"Authorization": f"Bearer {analyst_token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return messages.decode_report_ids(r.content)


def study_info(url: str, study_id: str) -> dict:
    r = httpx.get(f"{url}/v1/studies/{study_id}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def upload(url: str, study: Study, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body, timeout=60,
                      headers={"Content-Type": messages.SHARES_MEDIA_TYPE})


def assert_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["type"] == "urn:dpsketch:problem:unavailable"
    assert int(r.headers["Retry-After"]) >= 1


# --- 1. a share server SIGKILLed in the middle of an SDK bulk upload ---------------------------


@BOTH_STORES
def test_share_server_sigkilled_mid_upload_loses_nothing_acknowledged(servers, monkeypatch):
    c = exact_cluster(servers)
    n, batch_size, kill_after = 40_000, 1_000, 8
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name="kill-server", columns=COLUMNS, label="y", expected_reports=n,
                                  k=40, s=4, min_reports=n, epsilon_floor=None)
    study = Study.model_validate(created["study"])
    assert study.server_sigma == 0
    victim, spec = c.procs[1], c.specs[1]
    capture = Capture(monkeypatch)
    acks = AckLog(study)
    killed_at: list[float] = []
    restarted: list[ManagedProcess] = []

    def kill_and_restart() -> None:
        time.sleep(0.01)  # let the next batch to the victim get in flight
        victim.kill()
        killed_at.append(time.monotonic())
        time.sleep(1.0)  # the SDK is retrying into a refused port meanwhile
        restarted.append(servers.start(spec, NO_FLOOR))  # same spec: same port, same SQLite file

    def on_ack(port: int, count: int) -> None:
        if port == spec.port and count == kill_after:
            threading.Thread(target=kill_and_restart, daemon=True).start()

    acks.listeners.append(on_ack)
    rows = np.random.default_rng(3).normal(0, 0.3, size=(n, len(COLUMNS)))
    with Client(c.server_urls, transport=acks, backoff=0.3) as client:
        try:
            result = client.submit_many(study.study_id, rows, batch_size=batch_size)
            resent = False
        except sdk.IncompleteUpload as exc:  # the SDK gave up (a slow restart under load): finish
            client.resend(study.study_id, exc.pending)  # with exactly the listed bytes, then the rows
            client.submit_many(study.study_id, rows[exc.rows_prepared:], batch_size=batch_size)  # never sent
            result, resent = None, True
    assert victim.proc.returncode == -9 and restarted, "the server was not killed mid-upload"
    new = restarted[0]

    sent = capture.ids()
    assert len(sent) == n
    acked_before_kill = acks.acked_before(spec.port, killed_at[0])
    assert len(acked_before_kill) >= kill_after * batch_size
    stored = held_ids(new.url, spec.analyst_token, study.study_id)
    assert len(stored) == len(set(stored)), "a report is stored twice"
    assert acked_before_kill <= set(stored), "an acknowledged report was lost in the crash"
    assert set(stored) == set(sent)
    assert study_info(new.url, study.study_id)["report_count"] == len(stored) == n
    for spec_j, proc_j in zip(c.specs, c.procs):
        if spec_j is not spec:
            assert sorted(held_ids(proc_j.url, spec_j.analyst_token, study.study_id)) == sorted(sent)
    if result is not None:
        assert result.n_reports == n and len(result) == n
    print(f"\nkill -9 mid-upload: {len(acked_before_kill)} reports acknowledged by {spec.server_id} before "
          f"the kill; {len(stored)} held after restart (of {n} sent){'; completed by resend' if resent else ''}")

    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        fin = an.finalize(study.study_id)
        assert fin["state"] == "released" and fin["n_reports"] == n
        released = np.array(an.sketch(study.study_id)["sketch"])
    enc = capture.encoded()
    np.testing.assert_array_equal(released, expected_release(study, sent, np.stack([enc[r] for r in sent])))


# --- 2. one server down for the whole upload of some reports ------------------------------------


def server_policy(url: str) -> dict:
    r = httpx.get(f"{url}/v1/info", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["policy"]


def upload_with_s3_down(servers, c: Cluster, study: Study, capture: Capture, n1: int, n2: int,
                        batch_size: int) -> tuple[list[bytes], list[bytes], list[sdk.PendingUpload]]:
    """n1 reports reach all three servers; then s3 is down for the whole upload of n2 more (the
    SDK gives up on it; what it cancelled at s1 and s2 is completed there) and comes back without
    them. Returns the ids held everywhere, the ids s3 missed and the uploads pending at s3."""
    rng = np.random.default_rng(8)
    with Client(c.server_urls) as client:
        client.submit_many(study.study_id, rng.normal(0, 0.3, size=(n1, 5)), batch_size=1000)
    first = capture.ids()
    assert len(first) == n1

    with Client(c.server_urls, max_retries=1, backoff=0.05) as client:
        client.study(study.study_id)  # verified at all three servers while they are up
        c.procs[2].kill()  # s3 is down for the whole second upload
        with pytest.raises(sdk.IncompleteUpload) as err:
            client.submit_many(study.study_id, rng.normal(0, 0.3, size=(n2, 5)), batch_size=batch_size)
        assert {f.server_id for f in err.value.failures} == {"s3"}
        second = capture.ids()[n1:]
        missed = [p for p in err.value.pending if p.server_id == "s3"]
        assert set(second) == {rid for p in missed for rid in messages.decode_upload(
            p.body, p.media_type, study.width, study.n_servers).ids}
        # what the run cancelled at s1 and s2 when s3 failed is completed there (s3 still down)
        client.resend(study.study_id, [p for p in err.value.pending if p.server_id != "s3"])
    servers.start(c.specs[2], NO_FLOOR)  # back, without the reports it missed

    counts = [study_info(url, study.study_id)["report_count"] for url in c.server_urls]
    assert counts == [n1 + len(second), n1 + len(second), n1]
    return first, second, missed


def test_reports_missed_by_a_down_server_are_excluded_everywhere(servers, monkeypatch):
    """A few reports (within the servers' batch rule: at most 10% of what s1 and s2 hold) never
    reach s3 and nobody resends them: the release is over the reports every server holds."""
    c = exact_cluster(servers)
    n1, n2 = 3_000, 300
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name="one-down", columns=COLUMNS, label="y", expected_reports=n1,
                                  k=8, s=2, min_reports=n1, epsilon_floor=None)
    study = Study.model_validate(created["study"])
    capture = Capture(monkeypatch)
    first, second, _ = upload_with_s3_down(servers, c, study, capture, n1, n2, batch_size=100)
    fraction = server_policy(c.server_urls[0])["max_excluded_fraction"]
    assert fraction == 0.1  # the default batch rule
    assert 0 < len(second) <= int(fraction * (n1 + len(second)))  # within it: s1, s2 may leave them out

    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        fin = an.finalize(study.study_id)
        released = np.array(an.sketch(study.study_id)["sketch"])
    assert fin["state"] == "released" and fin["n_reports"] == n1
    assert fin["inclusion_hash"] == messages.inclusion_hash(sorted(first))
    for url in c.server_urls:
        assert study_info(url, study.study_id)["commit"]["inclusion_hash"] == fin["inclusion_hash"]
    enc = capture.encoded()
    np.testing.assert_array_equal(released, expected_release(study, first, np.stack([enc[r] for r in first])))
    print(f"\none server down: {n1} reports everywhere, {len(second)} more at s1/s2 only; released over {n1}")


def test_too_many_reports_missed_by_a_down_server_are_refused_until_resent(servers, monkeypatch):
    """s3 misses more than the batch rule lets s1 and s2 leave out: the analyzer refuses
    (422 inclusion-refused) before any server commits, and once the data owner resends what
    IncompleteUpload listed as pending at s3, finalize releases every report, exactly."""
    c = exact_cluster(servers)
    n1, n2 = 3_000, 2_000
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name="one-down-long", columns=COLUMNS, label="y", expected_reports=n1,
                                  k=8, s=2, min_reports=n1, epsilon_floor=None)
    study = Study.model_validate(created["study"])
    capture = Capture(monkeypatch)
    first, second, missed = upload_with_s3_down(servers, c, study, capture, n1, n2, batch_size=500)
    fraction = server_policy(c.server_urls[0])["max_excluded_fraction"]
    assert len(second) > int(fraction * (n1 + len(second)))  # beyond what s1 and s2 may leave out

    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        with pytest.raises(ProblemError) as refused:
            an.finalize(study.study_id)
        assert refused.value.slug == "inclusion-refused" and refused.value.status == 422
        assert "Nothing was committed" in refused.value.detail
        for url in c.server_urls:  # refused before any commit: every server still open
            info = study_info(url, study.study_id)
            assert info["status"] == "open" and info["commit"] is None, info

        with Client(c.server_urls) as client:  # the data owner resends exactly the pending bytes
            client.resend(study.study_id, missed)
        counts = [study_info(url, study.study_id)["report_count"] for url in c.server_urls]
        assert counts == [n1 + len(second)] * 3

        fin = an.finalize(study.study_id)
        released = np.array(an.sketch(study.study_id)["sketch"])
    everything = first + second
    assert fin["state"] == "released" and fin["n_reports"] == n1 + len(second)
    assert fin["inclusion_hash"] == messages.inclusion_hash(sorted(everything))
    for url in c.server_urls:
        assert study_info(url, study.study_id)["commit"]["inclusion_hash"] == fin["inclusion_hash"]
    enc = capture.encoded()
    np.testing.assert_array_equal(released, expected_release(study, everything,
                                                             np.stack([enc[r] for r in everything])))
    print(f"\none server down too long: {len(second)} of {n1 + len(second)} missing at s3, finalize "
          f"refused (inclusion-refused, nothing committed); after the resend released over all")


# --- 3. the analyzer SIGKILLed in the middle of finalization -----------------------------------


class CommitBlackhole:
    """A loopback HTTP/1.1 proxy in front of one share server that, while ``blocking``, drops the
    connection of every ``POST .../commit`` (the analyzer sees the server vanish mid-request) and
    forwards everything else byte for byte. Lets finalize collect ids everywhere, then fail
    after committing at the servers before this one."""

    def __init__(self, upstream_port: int):
        from dpsketch.tools.cluster import free_port

        self.upstream_port = upstream_port
        self.port = free_port()
        self.blocking = True
        self.dropped = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return

        async def pipe_back() -> None:
            try:
                while data := await up_reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        back = asyncio.ensure_future(pipe_back())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                if self.blocking and head.startswith(b"POST ") and b"/commit " in head.split(b"\r\n")[0]:
                    self.dropped += 1
                    break
                up_writer.write(head + body)
                await up_writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            up_writer.close()
            writer.close()
            back.cancel()


def test_analyzer_sigkilled_mid_finalize_resumes_with_the_recorded_set(servers):
    from dpsketch.tools.cluster import start_all

    specs = [servers.spec(f"s{j + 1}") for j in range(3)]
    procs = [share_server(spec, servers.workdir, {**OPEN_UPLOADS, **NO_FLOOR}) for spec in specs]
    servers.started.extend(procs)
    start_all(procs)
    blackhole = CommitBlackhole(specs[2].port)
    urls = [procs[0].url, procs[1].url, blackhole.url]  # the analyzer reaches s3 through the proxy
    config = servers.workdir / "cluster.json"
    config.write_text(json.dumps({"servers": [  # analyst tokens only, as the fixtures configure it
        {"server_id": s.server_id, "url": u, "analyst_token": s.analyst_token}
        for s, u in zip(specs, urls)], "api_token": "tok"}))
    an_db = servers.workdir / "analyzer.sqlite3"
    first_analyzer = analyzer_process(config, an_db, servers.workdir).start()
    servers.started.append(first_analyzer)
    try:
        _kill_analyzer_mid_finalize(servers, specs, procs, blackhole, config, an_db, first_analyzer)
    finally:
        blackhole.close()


def _kill_analyzer_mid_finalize(servers, specs, procs, blackhole, config, an_db, first_analyzer) -> None:
    n, extra = 2_000, 50
    with AnalyzerClient(first_analyzer.url, "tok") as an:
        created = an.create_study(name="kill-analyzer", columns=COLUMNS, label="y", expected_reports=n,
                                  k=8, s=2, min_reports=n, epsilon_floor=None)
    study = Study.model_validate(created["study"])
    assert study.server_sigma == 0  # no server noise: the release is exactly S(A + G)
    rows = np.random.default_rng(1).normal(0, 0.3, size=(n + extra, 5))
    batch = sdk.prepare_batch(study, rows)
    encoded = ring.reconstruct(batch.shares)
    # s1 and s2 will hold `extra` reports s3 lacks at the first finalize: within the batch rule
    assert extra <= int(0.1 * (n + extra))
    core = slice(0, n)
    # the last `extra` reports reach s1 and s2 now and s3 only after the crash: a finalize that
    # recomputed the intersection after the crash would pick a different (larger) set
    for j, proc in enumerate(procs):
        part = slice(0, n + extra) if j < 2 else core
        r = upload(proc.url, study, messages.encode_batch(batch.report_ids[part], batch.proofs[j][part],
                                                          batch.shares[j][part]))
        assert r.status_code == 200, r.text
    outcome: list = []

    def finalize() -> None:
        try:
            with AnalyzerClient(first_analyzer.url, "tok", timeout=60) as an:
                outcome.append(an.finalize(study.study_id))
        except (httpx.TransportError, ProblemError) as exc:
            outcome.append(exc)

    thread = threading.Thread(target=finalize)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (all(study_info(p.url, study.study_id)["status"] == "committed" for p in procs[:2])
                and blackhole.dropped >= 1):
            break
        time.sleep(0.02)
    else:
        pytest.fail(f"the analyzer did not get to commit at s3: {outcome}")
    assert thread.is_alive(), f"finalize ended before the kill: {outcome}"
    assert study_info(procs[2].url, study.study_id)["status"] == "open"
    first_analyzer.kill()  # mid-finalization: committed at 2 of 3 servers, retrying the third
    procs[2].kill()        # and s3 crashes too
    thread.join(30)
    assert outcome and isinstance(outcome[0], httpx.TransportError), outcome

    s3 = servers.start(specs[2], NO_FLOOR)  # same port, same file; the proxy forwards commits again
    blackhole.blocking = False
    part = slice(n, n + extra)
    r = upload(s3.url, study, messages.encode_batch(batch.report_ids[part], batch.proofs[2][part],
                                                    batch.shares[2][part]))
    assert r.status_code == 200, r.text
    urls = [procs[0].url, procs[1].url, s3.url]
    assert [study_info(u, study.study_id)["report_count"] for u in urls] == [n + extra] * 3

    analyzer = analyzer_process(config, an_db, servers.workdir, port=first_analyzer.port).start()
    servers.started.append(analyzer)
    with AnalyzerClient(analyzer.url, "tok") as an:
        fin = an.finalize(study.study_id)
        released = np.array(an.sketch(study.study_id)["sketch"])
    incl = messages.inclusion_hash(sorted(batch.report_ids[core]))
    assert fin["state"] == "released" and fin["n_reports"] == n and fin["inclusion_hash"] == incl
    commits = [study_info(u, study.study_id)["commit"] for u in urls]
    assert [cm["inclusion_hash"] for cm in commits] == [incl] * 3
    assert all(cm["n_reports"] == n for cm in commits)
    log = analyzer.log_path.read_text(errors="replace")
    assert "inclusion-conflict" not in log and "Traceback" not in log
    np.testing.assert_array_equal(released, expected_release(study, batch.report_ids[core], encoded[core]))
    print(f"\nanalyzer killed mid-finalize: committed at s1, s2 before the kill ({blackhole.dropped} commit "
          f"attempts at s3 dropped); after restart all 3 committed {n} reports ({extra} later arrivals "
          f"excluded), hash {incl[:12]}")


# --- 4. database locked, disk full -------------------------------------------------------------

D = 4


def small_study(max_reports: int = 100_000) -> Study:
    return design(name="faults", columns=[f"x{i}" for i in range(D)], label=None, servers=["s1", "s2"],
                  expected_reports=1000, k=8, s=2, min_reports=500, max_reports=max_reports)[0]


def provision(url: str, token: str, study: Study) -> None:
    r = httpx.put(f"{url}/v1/studies/{study.study_id}", content=study.canonical(),
                  headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                  timeout=60)  # not httpx's 5 s: a provision computes the study's check (timed out at load 19)
    assert r.status_code in (200, 201), r.text


def random_batch(study: Study, m: int) -> tuple[list[bytes], np.ndarray, np.ndarray, bytes]:
    """m random shares for server s1 (position 0), bound to their report ids as a client binds
    them: (ids, proofs, shares, body)."""
    shares = np.frombuffer(os.urandom(8 * m * D), dtype="<u8").reshape(m, D).copy()
    ids, proofs = studies.bind_at(study, 0, shares)
    return ids, proofs, shares, messages.encode_batch(ids, proofs, shares)


def stored_reports(db_path: str | Path, study: Study) -> tuple[list[tuple[bytes, bytes]], int]:
    """(id, share bytes) of every report a SQLite file holds for ``study``, in stored order, and
    its ``report_count``; the file must pass SQLite's integrity check."""
    conn = sqlite3.connect(str(db_path), timeout=10)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = conn.execute("SELECT b.m, b.ids, b.shares FROM batches b JOIN studies s ON b.study = s.seq "
                            "WHERE s.study_id = ?", (study.study_id,)).fetchall()
        count = conn.execute("SELECT report_count FROM studies WHERE study_id = ?", (study.study_id,)).fetchone()[0]
    finally:
        conn.close()
    out = []
    for m, ids, shares in rows:
        width = len(shares) // m
        out += [(bytes(ids[16 * i:16 * (i + 1)]), bytes(shares[width * i:width * (i + 1)])) for i in range(m)]
    return out, int(count)


def check_store(db_path: str, study: Study, expected_ids: set[bytes]) -> None:
    reports, count = stored_reports(db_path, study)
    ids = [rid for rid, _ in reports]
    assert len(ids) == len(set(ids)) and set(ids) == expected_ids
    assert count == len(ids)


def test_locked_database_answers_503_then_recovers(servers):
    spec = servers.spec("s1")
    proc = servers.start(spec)
    study = small_study()
    provision(proc.url, spec.operator_token, study)
    ids0, _, _, body0 = random_batch(study, 200)
    assert upload(proc.url, study, body0).status_code == 200

    locker = sqlite3.connect(str(spec.db_path), timeout=10, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    try:
        ids1, proofs1, shares1, body1 = random_batch(study, 300)
        single = messages.Report.of(ids1[0], proofs1[0], shares1[0]).model_dump()
        results: dict[str, httpx.Response] = {}

        def post(name: str, **kwargs) -> None:
            results[name] = httpx.post(f"{proc.url}/v1/studies/{study.study_id}/{name}", timeout=60, **kwargs)

        threads = [threading.Thread(target=post, args=("batches",), kwargs={
                       "content": body1, "headers": {"Content-Type": messages.SHARES_MEDIA_TYPE}}),
                   threading.Thread(target=post, args=("reports",), kwargs={"json": single})]
        start = time.monotonic()
        for t in threads:
            t.start()
        # reads still work while the writer waits (WAL)
        assert study_info(proc.url, study.study_id)["report_count"] == 200
        assert sorted(held_ids(proc.url, spec.analyst_token, study.study_id)) == sorted(ids0)
        for t in threads:
            t.join()
        waited = time.monotonic() - start
        for r in results.values():
            assert_unavailable(r)
        assert "locked" in results["batches"].json()["detail"]
    finally:
        if locker.in_transaction:
            locker.execute("ROLLBACK")
        locker.close()
    print(f"\nlocked database: both uploads answered 503 after {waited:.1f} s")

    # nothing of the refused requests was stored: the same bytes are accepted as new
    r = upload(proc.url, study, body1)
    assert r.status_code == 200 and r.json() == {"accepted": 300, "duplicates": 0, "report_count": 500}
    r = httpx.post(f"{proc.url}/v1/studies/{study.study_id}/reports", json=single)
    assert r.status_code == 200 and r.json() == {"accepted": 0, "duplicates": 1, "report_count": 500}
    proc.stop()
    check_store(str(spec.db_path), study, set(ids0) | set(ids1))
    proc = servers.start(spec)
    assert study_info(proc.url, study.study_id)["report_count"] == 500


def _tmpfs_server(servers, spec, size_mib: int) -> tuple[ManagedProcess, Path]:
    """A share server whose SQLite file lives on a small private tmpfs (its own mount namespace)."""
    if os.geteuid() != 0 and shutil.which("unshare") is None:
        unavailable("mounting a tmpfs needs root or unshare")
    mnt = servers.workdir / "tmpfs"
    mnt.mkdir()
    spec.db_path = mnt / "s1.sqlite3"
    proc = share_server(spec, servers.workdir, OPEN_UPLOADS)
    script = f"mount -t tmpfs -o size={size_mib}m tmpfs {mnt} && exec \"$@\""
    unshare = ["unshare", "-m", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["-r"])
    proc.argv = [*unshare, "sh", "-c", script, "sh", *proc.argv]
    try:
        proc.start()
    except (RuntimeError, TimeoutError) as exc:
        unavailable(f"cannot mount a private tmpfs here: {exc}")
    servers.started.append(proc)
    inside = Path(f"/proc/{proc.proc.pid}/root") / str(mnt).lstrip("/")  # the process's view
    out = subprocess.run(["df", "-k", str(inside)], capture_output=True, text=True)
    assert "tmpfs" in out.stdout, out.stdout
    return proc, inside


def _copy_store(inside: Path, copy: Path) -> str:
    """The tmpfs lives as long as the server's mount namespace: copy the (idle) database and its
    log out while it runs (SQLite itself would resolve the /proc/<pid>/root link into this
    namespace); the copy's path."""
    copy.mkdir()
    for suffix in ("", "-wal"):
        if (inside / f"s1.sqlite3{suffix}").exists():
            shutil.copyfile(inside / f"s1.sqlite3{suffix}", copy / f"s1.sqlite3{suffix}")
    return str(copy / "s1.sqlite3")


def test_full_disk_answers_503_then_recovers(servers):
    spec = servers.spec("s1")
    proc, inside = _tmpfs_server(servers, spec, size_mib=24)
    study = small_study()
    provision(proc.url, spec.operator_token, study)
    ids0, _, _, body0 = random_batch(study, 500)
    assert upload(proc.url, study, body0).status_code == 200

    # SQLite rewinds its log once a checkpoint has copied it and then writes over the log file's
    # blocks, which need no new space: a batch that fits in them is stored durably on a full disk
    # (200, rightly; it happened here). So the batch must be larger than the whole log file: at
    # least its ids and shares (16 + 8 D bytes a report) twice the log's size.
    log_bytes = (inside / "s1.sqlite3-wal").stat().st_size
    m = max(20_000, -(-2 * log_bytes // (16 + 8 * D)))
    ids1, proofs1, shares1, body1 = random_batch(study, m)  # made first: it arrives right after the fill
    filler = inside / "filler"
    with open(filler, "wb", buffering=0) as f:  # fill the disk to the last block
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
    free_before = os.statvfs(inside).f_bavail * os.statvfs(inside).f_frsize
    r = upload(proc.url, study, body1)
    assert r.status_code == 503, (r.status_code, r.text, f"log {log_bytes} bytes, {m} reports; free bytes before {free_before}, after "
                                  f"{os.statvfs(inside).f_bavail * os.statvfs(inside).f_frsize}",
                                  sorted((p.name, p.stat().st_size) for p in inside.iterdir()))
    assert_unavailable(r)
    single = messages.Report.of(ids1[0], proofs1[0], shares1[0]).model_dump()
    statuses = [httpx.post(f"{proc.url}/v1/studies/{study.study_id}/reports", json=single).status_code
                for _ in range(3)]
    assert all(s in (200, 503) for s in statuses), statuses  # a small write may still fit a page
    assert study_info(proc.url, study.study_id)["report_count"] == 500 + (200 in statuses)
    # what was acknowledged on the full disk is in the files (the log), and nothing else is
    check_store(_copy_store(inside, servers.workdir / "full"), study, set(ids0) | ({ids1[0]} if 200 in statuses else set()))
    filler.unlink()  # space again

    r = upload(proc.url, study, body1)
    assert r.status_code == 200, r.text
    assert r.json()["report_count"] == 500 + m and r.json()["accepted"] + r.json()["duplicates"] == m
    check_store(_copy_store(inside, servers.workdir / "copy"), study, set(ids0) | set(ids1))
    print(f"\ndisk full: batch of {m} (log {log_bytes} bytes) answered 503 ({r.status_code} after space "
          f"freed); singles {statuses}")


def test_server_sigkilled_while_writing_large_batches_in_place_keeps_exactly_what_it_acknowledged(servers):
    """Batches whose shares SQLite writes in place (a zero blob, then blob I/O: services/backend.py)
    from three uploaders at once, the server SIGKILLed right after its third acknowledgement with
    the others' batches in flight. After a restart the file must hold every acknowledged report
    with the exact bytes sent, and any other report it holds exactly too: a row whose fill the
    kill cut short would hold zeros. Resending everything then completes the store exactly."""
    from dpsketch.services import db as store_db

    spec = servers.spec("s1")
    proc = servers.start(spec)
    study = small_study(max_reports=300_000)
    provision(proc.url, spec.operator_token, study)
    m = 12_000
    assert m * 8 * D >= store_db.IN_PLACE_BYTES
    plans = [[random_batch(study, m) for _ in range(4)] for _ in range(3)]
    sent = {rid: row.astype("<u8").tobytes() for plan in plans for ids, _, shares, _ in plan
            for rid, row in zip(ids, shares)}
    acked: list[list[bytes]] = []
    lock = threading.Lock()
    third = threading.Event()

    def uploader(plan) -> None:
        for ids, _, _, body in plan:
            try:
                r = upload(proc.url, study, body)
            except httpx.HTTPError:
                return  # the server is gone
            if r.status_code != 200:
                return
            with lock:
                acked.append(ids)
                if len(acked) == 3:
                    third.set()

    threads = [threading.Thread(target=uploader, args=(plan,)) for plan in plans]
    for t in threads:
        t.start()
    assert third.wait(120), "three batches were not acknowledged"
    proc.kill()
    for t in threads:
        t.join(60)
    assert proc.proc.returncode == -9
    acked_ids = {rid for ids in acked for rid in ids}

    def stored_shares() -> dict[bytes, bytes]:
        reports, count = stored_reports(spec.db_path, study)
        held = dict(reports)
        assert len(held) == len(reports) == count  # each report once, and counted
        assert all(len(share) == 8 * D for share in held.values())
        return held

    restarted = servers.start(spec)  # same file; its WAL recovered on open
    held = stored_shares()
    assert acked_ids <= set(held), "an acknowledged report was lost"
    wrong = [rid for rid, share in held.items() if sent.get(rid) != share]
    assert not wrong, f"{len(wrong)} stored reports do not hold the bytes sent"
    assert study_info(restarted.url, study.study_id)["report_count"] == len(held)
    for plan in plans:  # resend all: stored ones come back as duplicates, the rest are stored
        for *_, body in plan:
            r = upload(restarted.url, study, body)
            assert r.status_code == 200, r.text
            assert r.json()["accepted"] + r.json()["duplicates"] == m
    assert stored_shares() == sent
    print(f"\nkill -9 while writing in place: {len(acked)} batches acknowledged before the kill, "
          f"{len(held) // m} held after restart, of 12")


# --- 5. bounded load test ----------------------------------------------------------------------


def run_load(servers, seconds: float, clients: int = 64) -> None:
    """The driver of ``dpsketch bench load`` (tools/loadtest.py), here with assertions."""
    spec = servers.spec("s1")
    proc = servers.start(spec)
    study = small_study(max_reports=10**8)
    provision(proc.url, spec.operator_token, study)
    # the compiled loops loaded first (about 125 MiB of numba, once): RSS measured from steady state
    server_bench.warm_server(proc.url, D, np.random.default_rng(0), spec.operator_token)
    loadtest.wait_idle([proc.proc.pid])  # and its other background warm-ups done
    out = loadtest.run_uploads(proc.url, study, seconds=seconds, clients=clients,
                               pid=proc.proc.pid)
    fig = out.figures()
    count = study_info(proc.url, study.study_id)["report_count"]
    flat, memory = out.memory_flat()
    print(f"\nload: {loadtest.summary(fig)}\n{memory} (the load generator shares the machine)")
    assert out.errors == [], out.errors[:5]
    assert out.requests > 0
    assert count == out.requests  # every acknowledged report counted once
    # memory stays flat: the per-report index grows by ~200 bytes a report, nothing else may
    assert flat, memory


@BOTH_STORES
def test_load_64_concurrent_clients(servers):
    run_load(servers, float(os.environ.get("DPSKETCH_LOAD_SECONDS", "10")))


@pytest.mark.slow
def test_load_soak(servers):
    run_load(servers, float(os.environ.get("DPSKETCH_SOAK_SECONDS", "60")))
