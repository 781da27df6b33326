"""In-process checks of the share server's HTTP contract (docs/protocol.md sections 6-8).

Each refusal must come back as the documented problem JSON and leave the store unchanged; each
success is checked against an independent computation (dense S from the protocol's hash, exact
integer arithmetic mod 2^64), never against the server's own code path.
"""

from __future__ import annotations

import base64
import os
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from dpsketch.protocol import sketch
from dpsketch.protocol.messages import (
    AGGREGATE_MEDIA_TYPE,
    INCLUSION_HASH_HEADER,
    REPORT_IDS_MEDIA_TYPE,
    SHARES_MEDIA_TYPE,
    decode_aggregate,
    encode_batch,
    inclusion_hash,
)
from dpsketch.protocol.study import Study, design
from services.app import create_app
from services.settings import Settings

OP = "operator-token-0123456789"
AN = "analyst-token-0123456789"
D = 3
K = 8
S = 2


def make_study(**overrides) -> Study:
    kwargs = dict(name="unit", columns=["a", "b", "c"], label=None, servers=["s1", "s2"],
                  expected_reports=200, k=K, s=S, min_reports=100)
    kwargs.update(overrides)
    return design(**kwargs)[0]


def settings_for(db: Path, **kw) -> Settings:
    return Settings(server_id="s1", db_path=db, operator_token=OP, analyst_token=AN, **kw)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def random_shares(m: int, d: int = D) -> np.ndarray:
    return np.frombuffer(os.urandom(8 * m * d), dtype="<u8").reshape(m, d).copy()


def new_ids(m: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(m)]


def expected_aggregate(study: Study, ids: list[bytes], shares: np.ndarray) -> np.ndarray:
    """S X mod 2^64 from the dense S of the protocol module, in exact Python integers."""
    dense = sketch.dense_matrix(study.seed_bytes, ids, study.k, study.s)
    signs = np.rint(dense * np.sqrt(study.s)).astype(int).astype(object)
    total = signs.dot(shares.astype(object)) % (1 << 64)
    return total.astype(np.uint64)


class Server:
    """A TestClient plus helpers; the same db can be reopened to simulate a restart."""

    def __init__(self, db: Path, **kw):
        self.app = create_app(settings_for(db, **kw))
        self.client = TestClient(self.app, raise_server_exceptions=True)
        self.client.__enter__()

    def close(self):
        self.client.__exit__(None, None, None)

    def provision(self, study: Study):
        return self.client.put(f"/v1/studies/{study.study_id}", content=study.canonical(),
                               headers={**bearer(OP), "Content-Type": "application/json"})

    def upload(self, study: Study, rid: bytes, share: np.ndarray):
        body = {"report_id": rid.hex(), "share": base64.b64encode(share.astype("<u8").tobytes()).decode()}
        return self.client.post(f"/v1/studies/{study.study_id}/reports", json=body)

    def batch(self, study: Study, ids: list[bytes], shares: np.ndarray, content_type=SHARES_MEDIA_TYPE):
        return self.client.post(f"/v1/studies/{study.study_id}/batches", content=encode_batch(ids, shares),
                                headers={"Content-Type": content_type})

    def count(self, study: Study) -> int:
        r = self.client.get(f"/v1/studies/{study.study_id}")
        assert r.status_code == 200
        return r.json()["report_count"]

    def held_ids(self, study: Study) -> bytes:
        r = self.client.get(f"/v1/studies/{study.study_id}/report-ids", headers=bearer(AN))
        assert r.status_code == 200 and r.headers["content-type"] == REPORT_IDS_MEDIA_TYPE
        return r.content

    def commit(self, study: Study, ids: list[bytes], content_type=REPORT_IDS_MEDIA_TYPE, token=AN):
        return self.client.post(f"/v1/studies/{study.study_id}/commit", content=b"".join(sorted(ids)),
                                headers={**bearer(token), "Content-Type": content_type})

    def aggregate(self, study: Study, token=AN):
        return self.client.get(f"/v1/studies/{study.study_id}/aggregate", headers=bearer(token))


@pytest.fixture
def server(tmp_path: Path):
    srv = Server(tmp_path / "s1.sqlite3")
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def study(server: Server) -> Study:
    st = make_study()
    assert server.provision(st).status_code == 201
    return st


def assert_problem(response, status: int, slug: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["type"] == f"urn:dpsketch:problem:{slug}"
    assert body["status"] == status
    assert isinstance(body["title"], str) and body["title"]
    assert isinstance(body["detail"], str) and body["detail"]
    return body


# --- meta --------------------------------------------------------------------------------------


def test_health_info_and_unknown_paths(server: Server):
    assert server.client.get("/healthz").json() == {"status": "ok"}
    info = server.client.get("/v1/info").json()
    assert info["server_id"] == "s1" and info["protocol"] == "dpsketch/1"
    assert_problem(server.client.get("/nope"), 404, "not-found")
    r = server.client.delete("/v1/studies")
    assert_problem(r, 405, "method-not-allowed")
    assert "GET" in r.headers["allow"]


def test_openapi_describes_json_and_binary_bodies(server: Server):
    doc = server.client.get("/openapi.json").json()
    paths = doc["paths"]
    assert SHARES_MEDIA_TYPE in paths["/v1/studies/{study_id}/batches"]["post"]["requestBody"]["content"]
    assert REPORT_IDS_MEDIA_TYPE in paths["/v1/studies/{study_id}/commit"]["post"]["requestBody"]["content"]
    put = paths["/v1/studies/{study_id}"]["put"]
    assert "columns" in put["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert "application/problem+json" in put["responses"]["422"]["content"]
    agg = paths["/v1/studies/{study_id}/aggregate"]["get"]["responses"]["200"]
    assert AGGREGATE_MEDIA_TYPE in agg["content"]


# --- provisioning ------------------------------------------------------------------------------


def test_provisioning_rules(server: Server):
    st = make_study()
    path = f"/v1/studies/{st.study_id}"
    body = st.canonical()
    assert_problem(server.client.put(path, content=body), 401, "unauthorized")
    r = server.client.put(path, content=body, headers=bearer("wrong"))
    assert_problem(r, 401, "unauthorized")
    assert r.headers["www-authenticate"] == "Bearer"
    assert_problem(server.client.put(path, content=body, headers=bearer(AN)), 403, "forbidden")
    assert_problem(server.client.put(path, content=b"{not json", headers=bearer(OP)), 400, "malformed-body")
    bad = st.model_dump(mode="json") | {"k": 7}  # s = 2 does not divide 7
    assert_problem(server.client.put(path, json=bad, headers=bearer(OP)), 422, "invalid-study")
    assert_problem(server.client.put(path, json=[1, 2], headers=bearer(OP)), 422, "invalid-study")
    other = make_study(name="other")
    body422 = assert_problem(server.client.put(path, content=other.canonical(), headers=bearer(OP)),
                             422, "invalid-study")
    assert other.study_id in body422["detail"]
    foreign = make_study(servers=["s2", "s3"])
    assert_problem(server.client.put(f"/v1/studies/{foreign.study_id}", content=foreign.canonical(),
                                     headers=bearer(OP)), 422, "invalid-study")
    import re

    infinite = re.sub(rb'"lambda_star":[0-9.e+-]+', b'"lambda_star":1e999', body)
    assert infinite != body
    assert_problem(server.client.put(path, content=infinite, headers=bearer(OP)), 422, "invalid-study")
    huge = make_study(k=8192, s=1, expected_reports=10**7, min_reports=10**7)
    assert_problem(server.client.put(f"/v1/studies/{huge.study_id}", content=huge.canonical(),
                                     headers=bearer(OP)), 422, "invalid-study")
    assert server.client.get("/v1/studies").json() == []
    r = server.provision(st)
    assert r.status_code == 201
    info = r.json()
    assert info["study_id"] == st.study_id and info["status"] == "open" and info["report_count"] == 0
    assert info["server_id"] == "s1" and info["commit"] is None
    assert Study.model_validate(info["study"]) == st
    assert server.provision(st).status_code == 200
    assert [i["study_id"] for i in server.client.get("/v1/studies").json()] == [st.study_id]
    assert_problem(server.client.get("/v1/studies/" + "0" * 64), 404, "unknown-study")


# --- uploads -----------------------------------------------------------------------------------


def test_single_upload_duplicate_and_conflict(server: Server, study: Study):
    rid, share = os.urandom(16), random_shares(1)[0]
    assert server.upload(study, rid, share).json() == {"accepted": 1, "duplicates": 0, "report_count": 1}
    assert server.upload(study, rid, share).json() == {"accepted": 0, "duplicates": 1, "report_count": 1}
    other = share.copy()
    other[0] ^= np.uint64(1)
    body = assert_problem(server.upload(study, rid, other), 409, "report-conflict")
    assert rid.hex() in body["detail"]
    assert server.count(study) == 1
    assert server.held_ids(study) == rid


@pytest.mark.parametrize("payload,status,slug", [
    (b'{"report_id": ', 400, "malformed-body"),
    (b'{"report_id": "zz", "share": "AAAAAAAAAAA="}', 422, "invalid-request"),
    (b'{"report_id": "' + b"a" * 32 + b'", "share": "AAAA"}', 422, "invalid-request"),  # 3 bytes
    (b'{"report_id": "' + b"a" * 32 + b'", "share": "@@@@"}', 422, "invalid-request"),  # not base64
    (b'{"report_id": "' + b"A" * 32 + b'", "share": "' + base64.b64encode(bytes(24)) + b'"}',
     422, "invalid-request"),  # upper-case hex
    (b'{"report_id": "' + b"a" * 32 + b'", "share": "' + base64.b64encode(bytes(16)) + b'"}',
     422, "invalid-request"),  # 2 values for d = 3
    (b'{"report_id": "' + b"a" * 32 + b'", "share": "' + base64.b64encode(bytes(24)) + b'", "x": 1}',
     422, "invalid-request"),
    (b"[]", 422, "invalid-request"),
    (b"", 422, "invalid-request"),
])
def test_single_upload_refusals(server: Server, study: Study, payload, status, slug):
    r = server.client.post(f"/v1/studies/{study.study_id}/reports", content=payload,
                           headers={"Content-Type": "application/json"})
    assert_problem(r, status, slug)
    assert server.count(study) == 0


def test_upload_to_unknown_study(server: Server, study: Study):
    r = server.client.post("/v1/studies/" + "f" * 64 + "/reports",
                           json={"report_id": "a" * 32, "share": base64.b64encode(bytes(24)).decode()})
    assert_problem(r, 404, "unknown-study")
    assert_problem(server.batch(make_study(name="x"), new_ids(1), random_shares(1)), 404, "unknown-study")


def test_batch_upload_refusals_leave_store_unchanged(server: Server, study: Study):
    ids, shares = new_ids(5), random_shares(5)
    assert server.batch(study, ids, shares).json() == {"accepted": 5, "duplicates": 0, "report_count": 5}
    before = server.held_ids(study)
    path = f"/v1/studies/{study.study_id}/batches"
    body = encode_batch(new_ids(2), random_shares(2))
    assert_problem(server.client.post(path, content=body, headers={"Content-Type": "application/json"}),
                   415, "unsupported-media-type")
    assert_problem(server.client.post(path, content=body), 415, "unsupported-media-type")
    assert_problem(server.client.post(path, content=body[:-1], headers={"Content-Type": SHARES_MEDIA_TYPE}),
                   400, "malformed-body")
    assert_problem(server.client.post(path, content=b"", headers={"Content-Type": SHARES_MEDIA_TYPE}),
                   400, "malformed-body")
    # a batch naming a held id with different bytes is refused whole: its new rows are not stored
    mixed_ids = new_ids(3) + [ids[2]]
    mixed = np.vstack([random_shares(3), shares[2:3] ^ np.uint64(5)])
    assert_problem(server.batch(study, mixed_ids, mixed), 409, "report-conflict")
    # a conflict inside one batch (same id twice, different bytes) likewise
    twin = os.urandom(16)
    assert_problem(server.batch(study, [twin, twin], random_shares(2)), 409, "report-conflict")
    assert server.count(study) == 5
    assert server.held_ids(study) == before


def test_batch_duplicates_counted_once(server: Server, study: Study):
    ids, shares = new_ids(4), random_shares(4)
    r = server.batch(study, ids + [ids[0]], np.vstack([shares, shares[:1]]))
    assert r.json() == {"accepted": 4, "duplicates": 1, "report_count": 4}
    r = server.batch(study, ids[1:] + new_ids(1), np.vstack([shares[1:], random_shares(1)]))
    assert r.json() == {"accepted": 1, "duplicates": 3, "report_count": 5}
    assert server.upload(study, ids[3], shares[3]).json()["duplicates"] == 1
    assert server.count(study) == 5


def test_oversized_bodies_are_refused_before_reading(tmp_path: Path):
    srv = Server(tmp_path / "small.sqlite3", max_body_bytes=4096)
    try:
        st = make_study()
        assert srv.provision(st).status_code == 201
        ids, shares = new_ids(200), random_shares(200)  # 200 * 40 bytes > 4096
        assert_problem(srv.batch(st, ids, shares), 413, "payload-too-large")

        def chunks():  # no Content-Length: the server must count streamed bytes
            body = encode_batch(ids, shares)
            for i in range(0, len(body), 1000):
                yield body[i:i + 1000]

        r = srv.client.post(f"/v1/studies/{st.study_id}/batches", content=chunks(),
                            headers={"Content-Type": SHARES_MEDIA_TYPE})
        assert_problem(r, 413, "payload-too-large")
        r = srv.client.post(f"/v1/studies/{st.study_id}/reports", content=b"{" + b" " * 5000 + b"}",
                            headers={"Content-Type": "application/json"})
        assert_problem(r, 413, "payload-too-large")
        assert srv.count(st) == 0
    finally:
        srv.close()


def test_capacity_exceeded(tmp_path: Path):
    srv = Server(tmp_path / "cap.sqlite3")
    try:
        st = make_study(max_reports=150)
        srv.provision(st)
        ids, shares = new_ids(150), random_shares(150)
        assert srv.batch(st, ids[:140], shares[:140]).status_code == 200
        assert_problem(srv.batch(st, new_ids(11), random_shares(11)), 409, "capacity-exceeded")
        # duplicates do not count against capacity
        r = srv.batch(st, ids[130:150], shares[130:150])
        assert r.json() == {"accepted": 10, "duplicates": 10, "report_count": 150}
        assert_problem(srv.upload(st, os.urandom(16), random_shares(1)[0]), 409, "capacity-exceeded")
        assert srv.count(st) == 150
    finally:
        srv.close()


# --- tokens ------------------------------------------------------------------------------------


def test_analyst_endpoints_need_the_analyst_token(server: Server, study: Study):
    base = f"/v1/studies/{study.study_id}"
    for method, path in (("GET", "/report-ids"), ("POST", "/commit"), ("GET", "/aggregate")):
        kw = {"headers": {"Content-Type": REPORT_IDS_MEDIA_TYPE}, "content": b""} if method == "POST" else {}
        r = server.client.request(method, base + path, **kw)
        assert_problem(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
        h = dict(kw.get("headers", {}))
        r = server.client.request(method, base + path, **kw | {"headers": h | bearer("nope")})
        assert_problem(r, 401, "unauthorized")
        r = server.client.request(method, base + path, **kw | {"headers": h | {"Authorization": "Basic " + AN}})
        assert_problem(r, 401, "unauthorized")
        r = server.client.request(method, base + path, **kw | {"headers": h | bearer(OP)})
        assert_problem(r, 403, "forbidden")
    assert server.count(study) == 0
    assert server.client.get(f"/v1/studies/{study.study_id}").json()["status"] == "open"


# --- commit and aggregate ----------------------------------------------------------------------


def test_commit_refusals(server: Server, study: Study):
    ids, shares = new_ids(120), random_shares(120)
    server.batch(study, ids, shares)
    path = f"/v1/studies/{study.study_id}/commit"
    assert_problem(server.aggregate(study), 409, "study-open")
    assert_problem(server.commit(study, ids, content_type="application/json"), 415, "unsupported-media-type")
    r = server.client.post(path, content=b"".join(sorted(ids))[:-3],
                           headers={**bearer(AN), "Content-Type": REPORT_IDS_MEDIA_TYPE})
    assert_problem(r, 400, "malformed-body")
    r = server.client.post(path, content=b"".join(sorted(ids, reverse=True)),
                           headers={**bearer(AN), "Content-Type": REPORT_IDS_MEDIA_TYPE})
    assert_problem(r, 422, "invalid-request")
    body = assert_problem(server.commit(study, ids + new_ids(2)), 422, "unknown-reports")
    assert "2 of the 122" in body["detail"]
    assert_problem(server.commit(study, ids[:99]), 422, "certificate-refused")  # min_reports = 100
    assert_problem(server.commit(study, []), 422, "certificate-refused")
    assert_problem(server.commit(make_study(name="nope"), ids), 404, "unknown-study")
    assert server.client.get(f"/v1/studies/{study.study_id}").json()["status"] == "open"
    assert_problem(server.aggregate(study), 409, "study-open")


def test_certificate_refuses_a_bad_spectrum(server: Server, study: Study):
    """Enough reports, but none in sketch row 0: lambda_min(S S^T) = 0 < lambda_star."""
    ids = []
    while len(ids) < 130:
        rid = os.urandom(16)
        if sketch.bucket_and_sign(study.seed_bytes, rid, study.k, study.s, 0)[0] != 0:
            ids.append(rid)
    server.batch(study, ids, random_shares(len(ids)))
    body = assert_problem(server.commit(study, ids), 422, "certificate-refused")
    assert body["lambda_min"] == pytest.approx(0.0, abs=1e-9)
    assert "lambda_min" in body["detail"]
    assert_problem(server.aggregate(study), 409, "study-open")


@pytest.mark.parametrize("excluded", [0, 10, 150])  # none, few (subtract), most (from scratch)
def test_commit_releases_the_exact_sketch_once(server: Server, study: Study, excluded: int):
    n_in = 120
    ids, shares = new_ids(n_in + excluded), random_shares(n_in + excluded)
    for start in range(0, len(ids), 37):  # several batches and a few single uploads
        server.batch(study, ids[start:start + 37], shares[start:start + 37])
    server.upload(study, ids[0], shares[0])  # a duplicate changes nothing
    included = ids[:n_in]
    r = server.commit(study, included)
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["n_reports"] == n_in
    assert result["inclusion_hash"] == inclusion_hash(sorted(included))
    assert result["margin"] == pytest.approx(result["lambda_min"] - study.t - study.lambda_star)
    assert result["margin"] >= 0 and result["lambda_star"] == study.lambda_star
    # the certificate itself, recomputed from the dense S over exactly the included reports
    dense = sketch.dense_matrix(study.seed_bytes, included, study.k, study.s)
    assert result["lambda_min"] == pytest.approx(np.linalg.eigvalsh(dense @ dense.T)[0], rel=1e-9, abs=1e-9)

    first = server.aggregate(study)
    assert first.status_code == 200 and first.headers["content-type"] == AGGREGATE_MEDIA_TYPE
    assert first.headers[INCLUSION_HASH_HEADER] == result["inclusion_hash"]
    got = decode_aggregate(first.content, study.k, study.d)
    assert np.array_equal(got, expected_aggregate(study, included, shares[:n_in]))
    assert server.aggregate(study).content == first.content

    assert server.commit(study, included).json() == result  # same set: same answer
    assert_problem(server.commit(study, ids[1:n_in + 1]), 409, "inclusion-conflict")
    assert_problem(server.upload(study, os.urandom(16), random_shares(1)[0]), 409, "study-closed")
    assert_problem(server.batch(study, new_ids(2), random_shares(2)), 409, "study-closed")
    info = server.client.get(f"/v1/studies/{study.study_id}").json()
    assert info["status"] == "committed" and info["commit"] == result
    assert info["report_count"] == n_in + excluded
    assert server.aggregate(study).content == first.content


def test_restart_rebuilds_totals(tmp_path: Path):
    db = tmp_path / "restart.sqlite3"
    srv = Server(db)
    st = make_study()
    srv.provision(st)
    ids, shares = new_ids(130), random_shares(130)
    srv.batch(st, ids[:100], shares[:100])
    srv.close()
    srv = Server(db, warm_start=False)  # lazy rebuild on first use
    try:
        assert srv.count(st) == 100
        assert srv.batch(st, ids[90:], shares[90:]).json() == {"accepted": 30, "duplicates": 10, "report_count": 130}
        r = srv.commit(st, ids[5:])
        assert r.status_code == 200, r.text
        got = decode_aggregate(srv.aggregate(st).content, st.k, st.d)
        assert np.array_equal(got, expected_aggregate(st, ids[5:], shares[5:]))
    finally:
        srv.close()
    srv = Server(db)
    try:  # the commit and the released bytes survive a restart too
        assert srv.client.get(f"/v1/studies/{st.study_id}").json()["status"] == "committed"
        assert srv.commit(st, ids[5:]).status_code == 200
        assert np.array_equal(decode_aggregate(srv.aggregate(st).content, st.k, st.d),
                              expected_aggregate(st, ids[5:], shares[5:]))
    finally:
        srv.close()


# --- an unavailable store ----------------------------------------------------------------------


def test_locked_database_answers_503_and_stores_nothing(tmp_path: Path):
    db = tmp_path / "locked.sqlite3"
    srv = Server(db, busy_timeout_s=0.2)
    try:
        st = make_study()
        srv.provision(st)
        srv.batch(st, new_ids(3), random_shares(3))
        other = sqlite3.connect(str(db), isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        r = srv.batch(st, new_ids(4), random_shares(4))
        body = assert_problem(r, 503, "unavailable")
        assert r.headers["retry-after"] == "1" and "locked" in body["detail"]
        assert_problem(srv.upload(st, os.urandom(16), random_shares(1)[0]), 503, "unavailable")
        assert srv.count(st) == 3
        other.execute("ROLLBACK")
        other.close()
        assert srv.batch(st, new_ids(4), random_shares(4)).json()["report_count"] == 7
        assert len(srv.held_ids(st)) == 7 * 16
    finally:
        srv.close()


def test_full_disk_answers_503_and_stores_nothing(tmp_path: Path):
    db = tmp_path / "full.sqlite3"
    srv = Server(db)
    try:
        st = make_study(columns=[f"c{i}" for i in range(64)])
        srv.provision(st)
        ids, shares = new_ids(10), random_shares(10, 64)
        srv.batch(st, ids, shares)
        writer = srv.app.state.store.writer.conn
        pages = writer.execute("PRAGMA page_count").fetchone()[0]
        writer.execute(f"PRAGMA max_page_count = {pages}")  # SQLITE_FULL on the next new page
        big_ids, big = new_ids(1500), random_shares(1500, 64)
        r = srv.batch(st, big_ids, big)
        body = assert_problem(r, 503, "unavailable")
        assert "full" in body["detail"] and r.headers["retry-after"]
        assert srv.count(st) == 10
        writer.execute("PRAGMA max_page_count = 1073741823")
        assert srv.batch(st, big_ids, big).json() == {"accepted": 1500, "duplicates": 0, "report_count": 1510}
        assert srv.batch(st, ids, shares).json()["duplicates"] == 10
    finally:
        srv.close()


# --- the fast sketch product -------------------------------------------------------------------


@pytest.mark.parametrize("m,d,k,s", [(1, 1, 1, 1), (500, 7, 12, 3), (2000, 32, 400, 4), (5, 2, 8, 8)])
def test_fast_accumulate_matches_the_reference(m, d, k, s):
    seed = os.urandom(32)
    ids = new_ids(m)
    shares = random_shares(m, d)
    rows, signs = sketch.hash_report_ids(seed, ids, k, s)
    # reference: np.add.at per block, with explicit wrapping negation
    ref = np.zeros((k, d), dtype=np.uint64)
    neg = (0 - shares).astype(np.uint64)
    for block in range(s):
        np.add.at(ref, rows[:, block], np.where((signs[:, block] > 0)[:, None], shares, neg))
    fast = np.zeros((k, d), dtype=np.uint64)
    sketch.accumulate(fast, rows, signs, shares)
    assert np.array_equal(ref, fast)
    for block in range(s):
        h = m // 2
        np.add.at(ref, rows[:h, block], np.where((signs[:h, block] > 0)[:, None], neg[:h], shares[:h]))
    sketch.subtract(fast, rows[: m // 2], signs[: m // 2], shares[: m // 2])
    assert np.array_equal(ref, fast)


# --- group commit: several requests in one transaction -------------------------------------------


def test_one_group_keeps_requests_independent(server: Server, study: Study):
    """Requests queued behind a busy writer run as one transaction; each is still judged on its
    own against what the requests before it stored (duplicate, conflict, capacity)."""
    import threading

    from services.writer import CallJob

    store = server.app.state.store
    record = store.record(study.study_id)
    gate = threading.Event()
    blocker = store.writer.submit(CallJob(lambda conn: (gate.wait(10), None)))
    x, y, z = os.urandom(16), os.urandom(16), os.urandom(16)
    sx, sy, sz = random_shares(3)
    other = sx ^ np.uint64(1)
    jobs = [
        ([x, y], np.vstack([sx, sy])),  # new, new
        ([y, z], np.vstack([sy, sz])),  # duplicate of the request before, new
        ([z], other[None, :]),  # conflicts with the request before: refused alone
        ([x, x], np.vstack([sx, sx])),  # duplicates
    ]
    futures = [store.submit_upload(record, ids, shares) for ids, shares in jobs]
    gone = store.submit_upload(record, new_ids(1), random_shares(1))
    assert gone.cancel()  # its client disconnected before the writer got to it
    gate.set()
    blocker.result(10)
    assert futures[0].result(10).model_dump() == {"accepted": 2, "duplicates": 0, "report_count": 2}
    assert futures[1].result(10).model_dump() == {"accepted": 1, "duplicates": 1, "report_count": 3}
    with pytest.raises(Exception) as info:
        futures[2].result(10)
    assert getattr(info.value, "slug", None) == "report-conflict"
    assert futures[3].result(10).model_dump() == {"accepted": 0, "duplicates": 2, "report_count": 3}
    assert server.count(study) == 3
    assert server.held_ids(study) == b"".join(sorted([x, y, z]))
    state = record.state
    assert np.array_equal(state.aggregate, expected_aggregate(study, [x, y, z], np.vstack([sx, sy, sz])))


# --- nothing a client sends gets a 500 ---------------------------------------------------------


def test_no_request_gets_a_server_error(server: Server, study: Study):
    """A small deterministic fuzz over every route: odd bodies, media types and tokens."""
    server.batch(study, new_ids(3), random_shares(3))
    sid = study.study_id
    paths = ["/healthz", "/v1/info", "/v1/studies", f"/v1/studies/{sid}", f"/v1/studies/{sid}/reports",
             f"/v1/studies/{sid}/batches", f"/v1/studies/{sid}/report-ids", f"/v1/studies/{sid}/commit",
             f"/v1/studies/{sid}/aggregate", "/v1/studies/%00", "/v1/studies/" + "a" * 5000 + "/commit"]
    bodies = [b"", b"null", b"{}", b"[]", b"\xff\xfe\x00", b'{"report_id": null}', b"1e999", b'"x"' * 10,
              study.canonical(), study.canonical().replace(b'"k":8', b'"k":1e999'),
              study.canonical().replace(b'"lambda_star":', b'"lambda_star":1e999,"x":'),
              study.canonical().replace(b'"sigma":', b'"sigma":-0.0,"y":'), os.urandom(16 * 7), os.urandom(40)]
    types = [None, "application/json", SHARES_MEDIA_TYPE, REPORT_IDS_MEDIA_TYPE, "text/plain; charset=utf-8",
             "application/json; charset=latin-1", "multipart/form-data; boundary=x"]
    tokens = [None, OP, AN, "x" * 300]
    rng = np.random.default_rng(7)
    for method in ("GET", "PUT", "POST", "DELETE", "PATCH"):
        for path in paths:
            for _ in range(6):
                body = bodies[rng.integers(len(bodies))]
                ctype = types[rng.integers(len(types))]
                token = tokens[rng.integers(len(tokens))]
                headers = {}
                if ctype:
                    headers["Content-Type"] = ctype
                if token:
                    headers["Authorization"] = f"Bearer {token}"
                r = server.client.request(method, path, content=body, headers=headers)
                assert r.status_code < 500, (method, path, body[:40], ctype, r.text)
                if r.status_code >= 400:
                    assert r.headers["content-type"].startswith("application/problem+json"), (method, path)
                    assert r.json()["type"].startswith("urn:dpsketch:problem:")


# --- id set algebra used by commit -------------------------------------------------------------


def test_idsets_compare_is_exact():
    from services.idsets import compare

    held = new_ids(500)
    included = sorted(held[100:] + new_ids(3))
    found, position, excluded = compare(b"".join(held), b"".join(included))
    held_set = set(held)
    assert found.tolist() == [rid in held_set for rid in included]
    assert all(held[p] == rid for p, rid, f in zip(position.tolist(), included, found.tolist()) if f)
    assert sorted(held[i] for i in excluded.tolist()) == sorted(held[:100])
    # same first 8 bytes, different last 8: never confused; shared prefixes in held -> exact path
    a, b = b"\x01" * 8 + b"\x00" * 8, b"\x01" * 8 + b"\xff" * 8
    found, _, excluded = compare(a, b)
    assert found.tolist() == [False] and excluded.tolist() == [0]
    assert compare(a + b, a) is None
    found, _, excluded = compare(b"", a)
    assert found.tolist() == [False] and excluded.tolist() == []


def test_commit_with_ids_sharing_a_prefix(server: Server, study: Study):
    """Crafted ids with a common 64-bit prefix take the exact path and give the same answers."""
    prefix = os.urandom(8)
    ids = [prefix + os.urandom(8) for _ in range(110)] + new_ids(20)
    shares = random_shares(len(ids))
    server.batch(study, ids, shares)
    assert_problem(server.commit(study, ids[:105] + [prefix + b"\x00" * 8]), 422, "unknown-reports")
    r = server.commit(study, ids[5:])
    assert r.status_code == 200, r.text
    got = decode_aggregate(server.aggregate(study).content, study.k, study.d)
    assert np.array_equal(got, expected_aggregate(study, ids[5:], shares[5:]))
