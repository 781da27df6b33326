"""Metrics, readiness and backpressure of real server processes (docs/operations.md).

Every check here runs against real processes on loopback ports (tests/conftest.py's Cluster):
counters are compared with the exact amounts of a known upload, readiness with a database
directory that is really gone, backpressure with a real flood, and the scrape with a real
Prometheus server (Debian's ``prometheus``, scripts/ensure-prometheus.sh). The figures at twice
capacity are measured by ``dpsketch bench overload``, not here; the flood test only asserts what
must hold under any load: refusals carry Retry-After, answers stay prompt, nothing acknowledged
is lost.
"""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.protocol import messages
from dpsketch.protocol.messages import SHARES_MEDIA_TYPE
from dpsketch.protocol.study import Study
from studies import bound_body

from conftest import Cluster, Servers
from prom import prometheus_binary, running_prometheus, scrape_job, wait_for

BATCHES = "/v1/studies/{study_id}/batches"
#: s2 admits at most this many uploads at once (the flood and the SDK test saturate it)
S2_LIMIT = 4


def scrape(url: str, token: str) -> dict[tuple[str, frozenset], float]:
    """GET /metrics as {(sample name, labels): value}."""
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pool = Servers(tmp_path_factory.mktemp("metrics"))
    try:
        yield Cluster(pool, 2, api_token="analyst-api-token",
                      server_env={"s2": {"DPSKETCH_MAX_INFLIGHT_UPLOADS": str(S2_LIMIT)}})
    finally:
        pool.stop_all()


def new_study(c: Cluster, n: int, name: str) -> dict:
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        return an.create_study(name=name, columns=["a", "b", "c"], expected_reports=n, k=8, s=2,
                               min_reports=n // 2, max_reports=100 * n)


def study_of(c: Cluster, sid: str) -> Study:
    return Study.model_validate(httpx.get(f"{c.server_urls[0]}/v1/studies/{sid}").json()["study"])


def held_ids(url: str, sid: str, analyst_token: str) -> set[bytes]:
    r = httpx.get(f"{url}/v1/studies/{sid}/report-ids", headers={"Authorization": f"Bearer {analyst_token}"})
    assert r.status_code == 200, r.text
    return {r.content[i:i + 16] for i in range(0, len(r.content), 16)}


def test_counters_move_by_exactly_the_known_upload(cluster: Cluster):
    c = cluster
    n, m = 300, 20
    sid = new_study(c, n, "counted")["study_id"]
    study = study_of(c, sid)
    s1, op1 = c.server_urls[0], c.specs[0].operator_token
    before = scrape(s1, op1)
    rng = np.random.default_rng(1)
    with Client(c.server_urls, max_retries=8) as client:
        client.submit_many(sid, rng.uniform(-0.5, 0.5, size=(n, 3)) / 2, batch_size=100)  # 3 batches
    # by hand at s1: m new reports, the same body again (m duplicates), a share substituted under
    # a held id (a conflicting report: refused, binding-refused) and a truncated body (400)
    shares = rng.integers(0, 2**63, size=(m, study.width), dtype=np.uint64)
    ids, body = bound_body(study, 0, shares)
    path = BATCHES.format(study_id=sid)
    post = lambda b: httpx.post(s1 + path, content=b, headers={"Content-Type": SHARES_MEDIA_TYPE})  # noqa: E731
    assert post(body).json()["accepted"] == m
    assert post(body).json()["duplicates"] == m
    conflicting = bytearray(body[:len(body) // m])  # the first record, one share byte changed
    conflicting[-1] ^= 1
    r = post(bytes(conflicting))
    assert r.status_code == 422 and r.json()["type"].endswith(":binding-refused"), r.text
    r = post(body[:-1])
    assert r.status_code == 400 and r.json()["type"].endswith(":malformed-body"), r.text
    # an unknown study: counted by route and type, but it gets no per-study series
    unknown = "f" * 64
    assert httpx.post(s1 + BATCHES.format(study_id=unknown), content=body,
                      headers={"Content-Type": SHARES_MEDIA_TYPE}).status_code == 404
    assert httpx.get(f"{s1}/no/such/path").status_code == 404
    after = scrape(s1, op1)

    assert delta(before, after, "dpsketch_reports_total", study_id=sid, outcome="accepted") == n + m
    assert delta(before, after, "dpsketch_reports_total", study_id=sid, outcome="duplicate") == m
    assert delta(before, after, "dpsketch_upload_requests_total", study_id=sid, outcome="acknowledged") == 3 + 2
    assert delta(before, after, "dpsketch_upload_requests_total", study_id=sid, outcome="binding-refused") == 1
    assert delta(before, after, "dpsketch_upload_requests_total", study_id=sid, outcome="malformed-body") == 1
    # the SDK sends seeds instead of shares only where a seed is smaller (share width above 4):
    # this study's shares are narrower, so s1 got every SDK batch's full shares
    assert study.width <= 4 and messages.record_bytes(messages.SEEDS_MEDIA_TYPE, study.width, study.n_servers) \
        > messages.record_bytes(messages.SHARES_MEDIA_TYPE, study.width, study.n_servers)
    sdk_bytes = 3 * messages.record_bytes(messages.SHARES_MEDIA_TYPE, study.width, study.n_servers) * 100
    assert delta(before, after, "dpsketch_upload_bytes_total", study_id=sid) == sdk_bytes + 2 * len(body)
    assert value(after, "dpsketch_store_reports", study_id=sid, status="open") == n + m
    route = "/v1/studies/{study_id}/batches"
    assert delta(before, after, "dpsketch_http_problems_total", route=route, type="binding-refused") == 1
    assert delta(before, after, "dpsketch_http_problems_total", route=route, type="malformed-body") == 1
    assert delta(before, after, "dpsketch_http_problems_total", route=route, type="unknown-study") == 1
    assert delta(before, after, "dpsketch_http_problems_total", route="unmatched", type="not-found") == 1
    assert delta(before, after, "dpsketch_http_requests_total", route=route, method="POST", status="200") == 5
    # 3 SDK batches + 4 by hand + the unknown study, each observed once by route template
    assert delta(before, after, "dpsketch_http_request_duration_seconds_count", route=route, method="POST") == 8
    assert not any(dict(labels).get("study_id") == unknown for _, labels in after)
    assert value(after, "dpsketch_store_bytes") > 0
    # the WAL's checkpoint thread ran after those commits (0.25 s after the writer's last one)
    ran = lambda samples: value(samples, "dpsketch_wal_checkpoints_total", by="checkpointer")  # noqa: E731
    deadline = time.monotonic() + 10
    while ran(latest := scrape(s1, op1)) <= ran(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ran(latest) > ran(before)
    assert ("dpsketch_wal_checkpoints_total", frozenset({("by", "writer")})) in latest
    assert ("dpsketch_wal_log_pages", frozenset()) in latest
    assert value(after, "dpsketch_open_connections") >= 1  # this scrape's own
    assert value(after, "dpsketch_http_requests_in_flight") == 1  # the scrape itself
    assert value(after, "process_resident_memory_bytes") > 10e6

    # the operator token only: per-study counts of an add/remove study tell membership
    assert httpx.get(f"{s1}/metrics").status_code == 401
    r = httpx.get(f"{s1}/metrics", headers={"Authorization": f"Bearer {c.specs[0].analyst_token}"})
    assert r.status_code == 403 and r.json()["type"].endswith(":forbidden")

    # the analyzer: latency by route and problems by type, behind its API token
    an = c.analyzer.url
    a0 = scrape(an, c.api_token)
    assert httpx.get(f"{an}/v1/studies/{'0' * 64}", headers={"Authorization": f"Bearer {c.api_token}"}
                     ).status_code == 404
    a1 = scrape(an, c.api_token)
    assert delta(a0, a1, "dpsketch_http_problems_total", route="/v1/studies/{study_id}", type="unknown-study") == 1
    assert delta(a0, a1, "dpsketch_http_request_duration_seconds_count", route="/v1/studies/{study_id}",
                 method="GET") == 1
    assert httpx.get(f"{an}/metrics").status_code == 401


def test_readiness_follows_the_database_while_liveness_stays(servers: Servers, tmp_path: Path):
    spec = servers.spec("s1")
    home = tmp_path / "db"
    home.mkdir()
    spec.db_path = home / "s1.sqlite3"
    proc = servers.start(spec)
    assert httpx.get(f"{proc.url}/readyz").json() == {"status": "ready"}
    moved = tmp_path / "db-gone"
    home.rename(moved)  # the database is unreachable (an unmounted volume, a lost disk)
    try:
        r = httpx.get(f"{proc.url}/readyz", timeout=10)
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["type"].endswith(":unavailable") and "database" in body["detail"]
        assert r.headers["retry-after"]
        assert httpx.get(f"{proc.url}/healthz").status_code == 200  # alive: do not restart it
    finally:
        moved.rename(home)
    assert httpx.get(f"{proc.url}/readyz").status_code == 200
    samples = scrape(proc.url, spec.operator_token)
    assert value(samples, "dpsketch_http_requests_total", route="/readyz", method="GET", status="503") == 1


def test_analyzer_readiness(cluster: Cluster):
    assert httpx.get(f"{cluster.analyzer.url}/readyz").json() == {"status": "ready"}
    assert httpx.get(f"{cluster.analyzer.url}/healthz").status_code == 200


@contextmanager
def writer_blocked(db_path: Path):
    """Hold the SQLite write lock from outside the server: its writer waits (up to its 5 s busy
    timeout), so admitted uploads stay in flight until the ``with`` ends."""
    conn = sqlite3.connect(db_path, isolation_level=None, timeout=5)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def test_sdk_waits_for_retry_after_when_a_server_is_saturated(cluster: Cluster):
    c = cluster
    n = 100
    sid = new_study(c, n, "saturated")["study_id"]
    study = study_of(c, sid)
    s2, op2 = c.server_urls[1], c.specs[1].operator_token
    path = BATCHES.format(study_id=sid)
    rng = np.random.default_rng(3)
    holders = [bound_body(study, 1, rng.integers(0, 2**63, size=(5, study.width), dtype=np.uint64))
               for _ in range(S2_LIMIT)]
    answers: list[int] = []
    before = scrape(s2, op2)
    with ThreadPoolExecutor(S2_LIMIT + 1) as pool:
        with writer_blocked(c.specs[1].db_path):
            # S2_LIMIT uploads admitted and waiting for the writer: every slot is taken
            held = [pool.submit(lambda b: httpx.post(s2 + path, content=b, timeout=30,
                                                     headers={"Content-Type": SHARES_MEDIA_TYPE}).status_code,
                                body) for _, body in holders]
            deadline = time.monotonic() + 10
            while httpx.get(f"{s2}/readyz").status_code != 503:
                assert time.monotonic() < deadline, "the uploads never took the admission slots"
                time.sleep(0.05)
            assert "saturated" in httpx.get(f"{s2}/readyz").json()["detail"]
            r = httpx.post(s2 + path, content=holders[0][1], headers={"Content-Type": SHARES_MEDIA_TYPE})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["type"].endswith(":unavailable")
            t0 = time.monotonic()

            def sdk_upload():
                # backoff alone would retry after ~10 ms: only Retry-After makes it wait 1 s a try
                with Client(c.server_urls, backoff=0.01, max_retries=20) as client:
                    return client.submit_many(sid, np.full((n, 3), 0.1), batch_size=n)

            sdk = pool.submit(sdk_upload)
            time.sleep(2.0)  # the lock is released here, well within the writer's 5 s busy timeout
        result = sdk.result(30)
        elapsed = time.monotonic() - t0
        answers = [f.result(30) for f in held]
    assert answers == [200] * S2_LIMIT  # the waiting uploads were stored once the lock went
    assert result.n_reports == n
    assert elapsed >= 1.5  # it waited for the slots, and did not fail
    after = scrape(s2, op2)
    refused = delta(before, after, "dpsketch_upload_requests_total", study_id=sid, outcome="unavailable")
    # one refusal by hand, then one per Retry-After second while the slots were held (~2 s, more
    # on a loaded machine while the writer drains them); without honouring Retry-After it would
    # have been ~20 (every retry refused, then given up)
    assert 2 <= refused <= 8, refused
    assert delta(before, after, "dpsketch_reports_total", study_id=sid, outcome="accepted") == n + 5 * S2_LIMIT
    assert httpx.get(f"{s2}/readyz").status_code == 200


def test_slow_bodies_take_no_admission_slot(cluster: Cluster):
    """Uploads whose bodies trickle in hold no slot (it is taken when the body is complete), so
    more slow clients than slots do not shut a prompt client out."""
    c = cluster
    sid = new_study(c, 100, "slow")["study_id"]
    study = study_of(c, sid)
    s2 = c.server_urls[1]
    path = BATCHES.format(study_id=sid)
    parts = urlsplit(s2)
    stalled = []
    try:
        for _ in range(S2_LIMIT + 2):
            sock = socket.create_connection((parts.hostname, parts.port))
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {SHARES_MEDIA_TYPE}\r\n"
                         f"Content-Length: 100000\r\n\r\n".encode() + b"\0" * 100)
            stalled.append(sock)
        time.sleep(0.3)  # the heads and first bytes have arrived
        ids, body = bound_body(study, 1, np.arange(3 * study.width, dtype=np.uint64).reshape(3, study.width))
        r = httpx.post(s2 + path, content=body, headers={"Content-Type": SHARES_MEDIA_TYPE})
        assert r.status_code == 200, r.text
        assert httpx.get(f"{s2}/readyz").status_code == 200
    finally:
        for sock in stalled:
            sock.close()


async def _flood(url: str, path: str, bodies: list[tuple[list[bytes], bytes]], clients: int):
    """``clients`` clients each posting its share of ``bodies`` back to back, without retrying:
    (latencies, statuses, retry-after headers of refusals, acknowledged ids)."""
    latencies, statuses, retry_after, acked = [], [], [], []
    queue = list(reversed(bodies))

    async def one(http: httpx.AsyncClient) -> None:
        while queue:
            ids, body = queue.pop()
            t0 = time.perf_counter()
            r = await http.post(path, content=body, headers={"Content-Type": SHARES_MEDIA_TYPE})
            latencies.append(time.perf_counter() - t0)
            statuses.append(r.status_code)
            if r.status_code == 200:
                acked.extend(ids)
            else:
                retry_after.append(r.headers.get("retry-after"))

    https = [httpx.AsyncClient(base_url=url, timeout=60) for _ in range(clients)]
    try:
        await asyncio.gather(*(one(h) for h in https))
    finally:
        for h in https:
            await h.aclose()
    return latencies, statuses, retry_after, acked


def test_a_flood_gets_503_with_retry_after_and_loses_nothing(cluster: Cluster):
    c = cluster
    sid = new_study(c, 1000, "flood")["study_id"]
    study = study_of(c, sid)
    s2 = c.server_urls[1]
    rng = np.random.default_rng(7)
    bodies = [bound_body(study, 1, rng.integers(0, 2**63, size=(200, study.width), dtype=np.uint64))
              for _ in range(300)]
    latencies, statuses, retry_after, acked = asyncio.run(
        _flood(s2, BATCHES.format(study_id=sid), bodies, clients=48))
    counts = {s: statuses.count(s) for s in set(statuses)}
    assert set(counts) <= {200, 503}, counts  # nothing else: no 500, no dropped connection
    assert counts.get(503, 0) > 0, counts  # 48 clients against 4 slots: refusals
    assert counts.get(200, 0) > 0, counts
    assert all(v == "1" for v in retry_after)
    p99 = sorted(latencies)[int(0.99 * len(latencies))]
    assert p99 < 5.0, p99  # refusals are immediate and admitted work is bounded
    held = held_ids(s2, sid, c.specs[1].analyst_token)
    assert set(acked) <= held  # every acknowledged report is stored
    assert len(held) == len(acked) == 200 * counts[200]  # and nothing else


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    return prometheus_binary()


def test_a_real_prometheus_scrapes_the_counters(cluster: Cluster, prometheus_bin: str, tmp_path: Path):
    c = cluster
    n = 240
    sid = new_study(c, n, "scraped")["study_id"]
    with Client(c.server_urls, max_retries=8) as client:
        client.submit_many(sid, np.full((n, 3), 0.05), batch_size=80)
    jobs = [scrape_job(f"dpsketch-{spec.server_id}", urlsplit(url).netloc, spec.operator_token,
                       labels={"server_id": spec.server_id})
            for spec, url in zip(c.specs, c.server_urls)]
    jobs.append(scrape_job("dpsketch-analyzer", urlsplit(c.analyzer.url).netloc, c.api_token))
    query_text = f'dpsketch_reports_total{{study_id="{sid}",outcome="accepted"}}'
    seen: dict[str, dict] = {}

    def done(query) -> bool:  # every target scraped after the upload
        seen["got"] = {res["metric"]["server_id"]: float(res["value"][1]) for res in query(query_text)}
        seen["up"] = {res["metric"]["job"]: res["value"][1] for res in query("up")}
        return len(seen["got"]) == 2 and len(seen["up"]) == 3

    with running_prometheus(prometheus_bin, jobs, tmp_path) as query:
        wait_for(query, done)
    assert seen.get("got") == {"s1": n, "s2": n}, seen
    assert seen.get("up") == {"dpsketch-s1": "1", "dpsketch-s2": "1", "dpsketch-analyzer": "1"}, seen
