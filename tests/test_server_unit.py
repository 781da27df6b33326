"""In-process checks of the share server's HTTP contract (docs/protocol.md sections 6-8).

Each refusal must come back as the documented problem JSON and leave the store unchanged; each
success is checked against an independent computation (dense S from the protocol's hash, exact
integer arithmetic mod 2^64), never against the server's own code path.

Every record a client sends is bound to its report id (docs/protocol.md section 4a): the helpers
below make records the way a client does for this server (``tests/studies.py`` ``bind_at``,
position = this server's index in ``study.servers``). The studies here carry no server noise
(``epsilon_floor=None``) and the servers run with ``max_floor_epsilon=None``, so a release is
exactly the sum of the included shares; ``test_server_noise_...`` checks a study with noise.

The tests of the store's guarantees (idempotence, conflicts, one atomic commit, the same bytes on
every call and after a restart, 503 when the database cannot answer) run against SQLite and
PostgreSQL (``BOTH_STORES``; conftest.py, tests/pg.py); the rest run on SQLite.
"""

from __future__ import annotations

import base64
import math
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from dpsketch.protocol import sketch
from dpsketch.protocol.messages import (
    AGGREGATE_MEDIA_TYPE,
    INCLUSION_HASH_HEADER,
    REPORT_IDS_MEDIA_TYPE,
    SEALED_MEDIA_TYPE,
    SEEDS_MEDIA_TYPE,
    SHARES_MEDIA_TYPE,
    Report,
    blocks_media_type,
    decode_aggregate,
    encode_batch,
    inclusion_hash,
)
from dpsketch.protocol.study import Study, design
from dpsketch.services.app import create_app
from dpsketch.services.settings import Settings
from conftest import BOTH_STORES
from studies import bind_at

OP = "operator-token-0123456789"
AN = "analyst-token-0123456789"
D = 3
K = 8
S = 2
#: The batch rule's documented default (docs/trust.md): a commit may leave out at most 10% of
#: the reports a server holds.
MAX_EXCLUDED_FRACTION = 0.1


#: min_reports for the tests that commit 117-145 reports: lambda_min of fresh ids (and a fresh
#: sketch seed) at k = 8 has a long left tail, and against make_study's min_reports = 100 the
#: certificate of 117 such ids refused 18 of 30,000 simulated draws (6e-4 a test, about a dozen
#: such tests); against 80: 0 of 8000 (lambda_min / lambda_star 1.18 at worst).
LOW_MIN = 80


def make_study(**overrides) -> Study:
    """A study without server noise unless the caller asks for a floor (``epsilon_floor``)."""
    kwargs = dict(name="unit", columns=["a", "b", "c"], label=None, servers=["s1", "s2"],
                  expected_reports=200, k=K, s=S, min_reports=100, epsilon_floor=None)
    kwargs.update(overrides)
    return design(**kwargs)[0]


def settings_for(db: Path, **kw) -> Settings:
    """The test server's settings: open uploads (tests of other features need no upload tokens),
    no floor required (studies without server noise release exact sums) and no population budget
    (as tests/conftest.py's NO_BUDGET: the tests of other features provision many studies of one
    population); ``kw`` overrides."""
    kw = {"upload_auth": "open", "max_floor_epsilon": None, "population_epsilon": None,
          "population_floor_epsilon": None, **kw}
    return Settings(server_id="s1", db_path=db, operator_token=OP, analyst_token=AN, **kw)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def random_shares(m: int, d: int = D) -> np.ndarray:
    return np.frombuffer(os.urandom(8 * m * d), dtype="<u8").reshape(m, d).copy()


def new_ids(m: int) -> list[bytes]:
    """Random ids: ids no server holds (never uploadable: an id must commit to its shares)."""
    return [os.urandom(16) for _ in range(m)]


@dataclass
class Reports:
    """Records as one server receives them: row i of ``ids``, ``proofs`` and ``shares`` is one
    report, its share bound to its id at that server's position (or deliberately not)."""

    ids: list[bytes]
    proofs: np.ndarray
    shares: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, key) -> "Reports":
        """One record (an int) or several (a slice or a list of ints), as Reports."""
        if isinstance(key, int):
            rows = [key]
        elif isinstance(key, slice):
            rows = list(range(len(self.ids)))[key]
        else:
            rows = list(key)
        return Reports([self.ids[i] for i in rows], self.proofs[rows], self.shares[rows])

    def __add__(self, other: "Reports") -> "Reports":
        return Reports(self.ids + other.ids, np.vstack([self.proofs, other.proofs]),
                       np.vstack([self.shares, other.shares]))

    def body(self) -> bytes:
        """The application/x-dpsketch-shares body."""
        return encode_batch(self.ids, self.proofs, self.shares)

    def report(self, i: int = 0) -> dict:
        """Record i as the single-upload JSON body."""
        return Report.of(self.ids[i], self.proofs[i], self.shares[i]).model_dump()

    def substituted(self, i: int = 0, where: str = "share", byte: int = 0) -> "Reports":
        """Record i with one byte of its share, proof or id changed (the rest as sent)."""
        one = self[i]
        ids, proofs, shares = list(one.ids), one.proofs.copy(), one.shares.copy()
        if where == "share":
            shares.view(np.uint8)[0, byte] ^= 1
        elif where == "proof":
            proofs[0, byte] ^= 1
        else:
            rid = bytearray(ids[0])
            rid[byte] ^= 1
            ids[0] = bytes(rid)
        return Reports(ids, proofs, shares)


def bound(study: Study, m: int, position: int = 0, d: int | None = None) -> Reports:
    """m new reports with random shares, bound for the server at ``position``."""
    shares = random_shares(m, study.width if d is None else d)
    ids, proofs = bind_at(study, position, shares)
    return Reports(ids, proofs, shares)


def expected_aggregate(study: Study, ids: list[bytes], shares: np.ndarray) -> np.ndarray:
    """S X mod 2^64 from the dense S of the protocol module, in exact Python integers."""
    dense = sketch.dense_matrix(study.seed_bytes, ids, study.k, study.s)
    signs = np.rint(dense * np.sqrt(study.s)).astype(int).astype(object)
    total = signs.dot(shares.astype(object)) % (1 << 64)
    return total.astype(np.uint64)


class Server:
    """A TestClient plus helpers; the same db can be reopened to simulate a restart.

    ``Server(db, **settings)`` runs the test settings (``settings_for``); with
    ``policy_defaults=True`` it runs the Settings defaults except for the role tokens."""

    server_id = "s1"

    def __init__(self, db: Path | str, *, policy_defaults: bool = False, **kw):
        """``db``: a SQLite file or a PostgreSQL URL (Settings takes either as db_path)."""
        settings = (Settings(server_id=self.server_id, db_path=db, operator_token=OP, analyst_token=AN, **kw)
                    if policy_defaults else settings_for(db, **kw))
        self.app = create_app(settings)
        self.client = TestClient(self.app, raise_server_exceptions=True)
        self.client.__enter__()

    def close(self):
        self.client.__exit__(None, None, None)

    def position(self, study: Study) -> int:
        return study.servers.index(self.server_id)

    def reports(self, study: Study, m: int, d: int | None = None) -> Reports:
        """m new reports bound for this server."""
        return bound(study, m, self.position(study), d)

    def provision(self, study: Study, token: str = OP):
        return self.client.put(f"/v1/studies/{study.study_id}", content=study.canonical(),
                               headers={**bearer(token), "Content-Type": "application/json"})

    def post_report(self, study: Study, body: dict, token: str | None = None):
        return self.client.post(f"/v1/studies/{study.study_id}/reports", json=body,
                                headers=bearer(token) if token else {})

    def upload(self, study: Study, report: Reports, token: str | None = None):
        """One report through the single-report endpoint."""
        assert len(report) == 1
        return self.post_report(study, report.report(), token)

    def batch(self, study: Study, reports: Reports | bytes, content_type=SHARES_MEDIA_TYPE,
              token: str | None = None):
        body = reports if isinstance(reports, bytes) else reports.body()
        return self.client.post(f"/v1/studies/{study.study_id}/batches", content=body,
                                headers={"Content-Type": content_type, **(bearer(token) if token else {})})

    def count(self, study: Study) -> int:
        r = self.client.get(f"/v1/studies/{study.study_id}")
        assert r.status_code == 200
        return r.json()["report_count"]

    def held_ids(self, study: Study) -> bytes:
        r = self.client.get(f"/v1/studies/{study.study_id}/report-ids", headers=bearer(AN))
        assert r.status_code == 200 and r.headers["content-type"] == REPORT_IDS_MEDIA_TYPE
        return r.content

    def totals(self, study: Study) -> np.ndarray:
        """The running aggregate the server keeps for an open study (what a commit starts from)."""
        store = self.app.state.store
        return store.ensure_state(store.record(study.study_id)).aggregate.copy()

    def commit(self, study: Study, ids: list[bytes], content_type=REPORT_IDS_MEDIA_TYPE, token=AN):
        return self.client.post(f"/v1/studies/{study.study_id}/commit", content=b"".join(sorted(ids)),
                                headers={**bearer(token), "Content-Type": content_type})

    def aggregate(self, study: Study, token=AN):
        return self.client.get(f"/v1/studies/{study.study_id}/aggregate", headers=bearer(token))


@pytest.fixture
def server(store_location):
    srv = Server(store_location("s1"))
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
def study(server: Server) -> Study:
    st = make_study()
    assert st.server_sigma == 0  # the exact-sum checks below need a study without server noise
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
    assert info["server_id"] == "s1" and info["protocol"] == "dpsketch/2"
    assert_problem(server.client.get("/nope"), 404, "not-found")
    r = server.client.delete("/v1/studies")
    assert_problem(r, 405, "method-not-allowed")
    assert "GET" in r.headers["allow"]


def test_openapi_describes_json_and_binary_bodies(server: Server):
    doc = server.client.get("/openapi.json").json()
    paths = doc["paths"]
    batches = paths["/v1/studies/{study_id}/batches"]["post"]["requestBody"]["content"]
    assert {SHARES_MEDIA_TYPE, SEEDS_MEDIA_TYPE, SEALED_MEDIA_TYPE} <= set(batches)
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
    # the analyst token's refusals are the same checks (it may provision, under the same policy)
    assert_problem(server.client.put(path, content=b"{not json", headers=bearer(AN)), 400, "malformed-body")
    assert_problem(server.client.put(path, content=other.canonical(), headers=bearer(AN)), 422, "invalid-study")
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
    # dpsketch/2: the analyst token may provision too (the analyzer needs no operator token);
    # formerly 403 forbidden
    assert server.provision(st, token=AN).status_code == 200
    r = server.provision(other, token=AN)
    assert r.status_code == 201, r.text
    assert Study.model_validate(r.json()["study"]) == other
    assert sorted(i["study_id"] for i in server.client.get("/v1/studies").json()) == sorted(
        [st.study_id, other.study_id])
    # "secret_sign": false reads as absent (docs/protocol.md section 2, "Study id"): refused under the
    # id hashed over the member as sent; under the study's own id (computed without it), provisioned
    from dpsketch.protocol.canonical import content_hash

    unsigned = make_study(name="unsigned", secret_sign=False)
    explicit = unsigned.model_dump(mode="json") | {"secret_sign": False}
    assert "secret_sign" not in unsigned.model_dump(mode="json") and content_hash(explicit) != unsigned.study_id
    assert_problem(server.client.put(f"/v1/studies/{content_hash(explicit)}", json=explicit, headers=bearer(OP)),
                   422, "invalid-study")
    r = server.client.put(f"/v1/studies/{unsigned.study_id}", json=explicit, headers=bearer(OP))
    assert r.status_code == 201 and r.json()["study_id"] == unsigned.study_id
    assert "secret_sign" not in r.json()["study"]


# --- uploads -----------------------------------------------------------------------------------


@BOTH_STORES
def test_single_upload_duplicate_and_substitution(server: Server, study: Study):
    """A retry is a duplicate; a share (or proof, or id) substituted under the id of a held report
    does not hash to that id: 422 binding-refused, nothing stored (formerly 409 report-conflict)."""
    report = server.reports(study, 1)
    rid = report.ids[0]
    assert server.upload(study, report).json() == {"accepted": 1, "duplicates": 0, "report_count": 1}
    assert server.upload(study, report).json() == {"accepted": 0, "duplicates": 1, "report_count": 1}
    totals = server.totals(study)
    assert np.array_equal(totals, expected_aggregate(study, report.ids, report.shares))
    for where, byte in (("share", 0), ("share", 8 * D - 1), ("proof", 0), ("proof", 31)):
        body = assert_problem(server.upload(study, report.substituted(0, where, byte)), 422, "binding-refused")
        assert rid.hex() in body["detail"]
    # a substituted id: not the id of a held report, and not bound either
    assert_problem(server.upload(study, report.substituted(0, "id", 15)), 422, "binding-refused")
    # the same share bound for the other server is refused here too
    ids, proofs = bind_at(study, 1, report.shares)
    assert_problem(server.upload(study, Reports(ids, proofs, report.shares)), 422, "binding-refused")
    assert server.count(study) == 1
    assert server.held_ids(study) == rid
    assert np.array_equal(server.totals(study), totals)


PROOF = base64.b64encode(bytes(32))  # 16 N bytes for N = 2 servers


@pytest.mark.parametrize("payload,status,slug", [
    (b'{"report_id": ', 400, "malformed-body"),
    (b'{"report_id": "zz", "proof": "' + PROOF + b'", "share": "' + base64.b64encode(bytes(24)) + b'"}',
     422, "invalid-request"),
    (b'{"report_id": "' + b"a" * 32 + b'", "proof": "' + PROOF + b'", "share": "AAAA"}',
     422, "invalid-request"),  # 3 bytes
    (b'{"report_id": "' + b"a" * 32 + b'", "proof": "' + PROOF + b'", "share": "@@@@"}',
     422, "invalid-request"),  # not base64
    (b'{"report_id": "' + b"A" * 32 + b'", "proof": "' + PROOF + b'", "share": "'
     + base64.b64encode(bytes(24)) + b'"}', 422, "invalid-request"),  # upper-case hex
    (b'{"report_id": "' + b"a" * 32 + b'", "proof": "' + PROOF + b'", "share": "'
     + base64.b64encode(bytes(16)) + b'"}', 422, "invalid-request"),  # 2 values for d = 3
    (b'{"report_id": "' + b"a" * 32 + b'", "proof": "' + PROOF + b'", "share": "'
     + base64.b64encode(bytes(24)) + b'", "x": 1}', 422, "invalid-request"),
    (b'{"report_id": "' + b"a" * 32 + b'", "share": "' + base64.b64encode(bytes(24)) + b'"}',
     422, "invalid-request"),  # no proof
    (b'{"report_id": "' + b"a" * 32 + b'", "proof": "' + base64.b64encode(bytes(16)) + b'", "share": "'
     + base64.b64encode(bytes(24)) + b'"}', 422, "invalid-request"),  # proof of 1 server
    (b'{"report_id": "' + b"a" * 32 + b'", "proof": "' + base64.b64encode(bytes(48)) + b'", "share": "'
     + base64.b64encode(bytes(24)) + b'"}', 422, "invalid-request"),  # proof of 3 servers
    (b'{"report_id": "' + b"a" * 32 + b'", "proof": "@@@@", "share": "'
     + base64.b64encode(bytes(24)) + b'"}', 422, "invalid-request"),  # proof not base64
    (b'{"report_id": "' + b"a" * 32 + b'", "proof": "' + PROOF + b'", "share": "'
     + base64.b64encode(bytes(24)) + b'"}', 422, "binding-refused"),  # well formed, not bound
    (b"[]", 422, "invalid-request"),
    (b"", 422, "invalid-request"),
])
def test_single_upload_refusals(server: Server, study: Study, payload, status, slug):
    r = server.client.post(f"/v1/studies/{study.study_id}/reports", content=payload,
                           headers={"Content-Type": "application/json"})
    assert_problem(r, status, slug)
    assert server.count(study) == 0


def test_upload_to_unknown_study(server: Server, study: Study):
    x = make_study(name="x")
    assert_problem(server.post_report(x, bound(x, 1).report()), 404, "unknown-study")
    r = server.client.post("/v1/studies/" + "f" * 64 + "/reports",
                           json={"report_id": "a" * 32, "proof": PROOF.decode(),
                                 "share": base64.b64encode(bytes(24)).decode()})
    assert_problem(r, 404, "unknown-study")
    assert_problem(server.batch(x, bound(x, 1)), 404, "unknown-study")


@BOTH_STORES
def test_batch_upload_refusals_leave_store_unchanged(server: Server, study: Study):
    held = server.reports(study, 5)
    assert server.batch(study, held).json() == {"accepted": 5, "duplicates": 0, "report_count": 5}
    before, totals = server.held_ids(study), server.totals(study)
    path = f"/v1/studies/{study.study_id}/batches"
    body = server.reports(study, 2).body()
    assert_problem(server.client.post(path, content=body, headers={"Content-Type": "application/json"}),
                   415, "unsupported-media-type")
    assert_problem(server.client.post(path, content=body), 415, "unsupported-media-type")
    # a party's block batch to a study without parties is the wrong media type too (section 6)
    assert_problem(server.client.post(path, content=body, headers={"Content-Type": blocks_media_type("bank")}),
                   415, "unsupported-media-type")
    assert_problem(server.client.post(path, content=body[:-1], headers={"Content-Type": SHARES_MEDIA_TYPE}),
                   400, "malformed-body")
    assert_problem(server.client.post(path, content=b"", headers={"Content-Type": SHARES_MEDIA_TYPE}),
                   400, "malformed-body")
    # seed batches: 16 + 32 + 32 = 80-byte records (N = 2); a partial record, or seeds that no
    # report id commits to
    assert_problem(server.batch(study, os.urandom(79), SEEDS_MEDIA_TYPE), 400, "malformed-body")
    assert_problem(server.batch(study, os.urandom(2 * 80), SEEDS_MEDIA_TYPE), 422, "binding-refused")
    # a batch with a substituted share under a held id is refused whole (binding-refused, formerly
    # 409 report-conflict): its new, well-bound rows are not stored either
    for where in ("share", "proof"):
        mixed = server.reports(study, 3) + held.substituted(2, where)
        body = assert_problem(server.batch(study, mixed), 422, "binding-refused")
        assert held.ids[2].hex() in body["detail"]
    # the same id twice in one batch, the second copy with other bytes: likewise
    twin = server.reports(study, 1)
    assert_problem(server.batch(study, twin + twin.substituted(0, "share", 5)), 422, "binding-refused")
    # records bound for the other server, or for another study
    assert_problem(server.batch(study, bound(study, 2, position=1)), 422, "binding-refused")
    assert_problem(server.batch(study, bound(make_study(name="elsewhere"), 2, position=0)), 422,
                   "binding-refused")
    assert server.count(study) == 5
    assert server.held_ids(study) == before
    assert np.array_equal(server.totals(study), totals)
    assert np.array_equal(totals, expected_aggregate(study, held.ids, held.shares))


@BOTH_STORES
def test_batch_duplicates_counted_once(server: Server, study: Study):
    rs = server.reports(study, 4)
    r = server.batch(study, rs + rs[0])
    assert r.json() == {"accepted": 4, "duplicates": 1, "report_count": 4}
    r = server.batch(study, rs[1:] + server.reports(study, 1))
    assert r.json() == {"accepted": 1, "duplicates": 3, "report_count": 5}
    assert server.upload(study, rs[3]).json()["duplicates"] == 1
    assert server.count(study) == 5


def test_oversized_bodies_are_refused_before_reading(tmp_path: Path):
    srv = Server(tmp_path / "small.sqlite3", max_body_bytes=4096)
    try:
        st = make_study()
        assert srv.provision(st).status_code == 201
        rs = srv.reports(st, 200)  # 200 * (16 + 32 + 24) bytes > 4096
        assert_problem(srv.batch(st, rs), 413, "payload-too-large")

        def chunks():  # no Content-Length: the server must count streamed bytes
            body = rs.body()
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


def test_commit_bodies_are_bounded_and_the_bitmap_is_compact(tmp_path: Path):
    """A commit body is bounded whatever the study (issue 41): a report-id list by the general
    --max-body-bytes, the compact form (a bit per held id, dpsketch/protocol/inclusion.py) by
    exactly its size over the ids held. With a 4,096-byte limit, 300 reports: their id list
    (4,800 bytes) gets 413, the bitmap (78 bytes) commits; a longer bitmap is refused (413, by
    Content-Length and while streaming), one over another count (409 inclusion-stale), one
    whose set hashes otherwise (422) or with bits past the last id (400); none changes anything."""
    import hashlib

    from dpsketch.protocol import inclusion

    srv = Server(tmp_path / "small.sqlite3", max_body_bytes=4096)
    try:
        st = make_study(max_reports=400)
        assert srv.provision(st).status_code == 201
        rs = srv.reports(st, 300)
        for start in range(0, 300, 50):  # 50 * 72 bytes per batch: under the limit
            assert srv.batch(st, rs[start:start + 50]).status_code == 200
        path = f"/v1/studies/{st.study_id}/commit"
        plain = {**bearer(AN), "Content-Type": REPORT_IDS_MEDIA_TYPE}
        compact = {**bearer(AN), "Content-Type": inclusion.MEDIA_TYPE}
        assert_problem(srv.client.post(path, content=b"".join(sorted(rs.ids)), headers=plain), 413,
                       "payload-too-large")
        held = srv.client.get(f"/v1/studies/{st.study_id}/report-ids", headers=bearer(AN)).content
        assert len(held) == 300 * 16
        keep = sorted(rs.ids)[:290]  # leave out 10 (within the batch rule's 0.1)
        body = inclusion.encode_for(held, b"".join(keep))
        assert len(body) == inclusion.body_bytes(300) == 40 + 38
        too_long = body + bytes(1)
        r = assert_problem(srv.client.post(path, content=too_long, headers=compact), 413, "payload-too-large")
        assert "78 bytes" in r["detail"]

        def chunks():  # no Content-Length: counted as it streams in
            yield too_long[:50]
            yield too_long[50:]

        assert_problem(srv.client.post(path, content=chunks(), headers=compact), 413, "payload-too-large")
        mask, digest = inclusion.decode(body)
        stale = inclusion.encode(mask[:-1], digest)  # made over 299 held ids
        assert_problem(srv.client.post(path, content=stale, headers=compact), 409, "inclusion-stale")
        wrong = inclusion.encode(mask, hashlib.sha256(b"other").digest())
        assert_problem(srv.client.post(path, content=wrong, headers=compact), 422, "invalid-request")
        padded = body[:-1] + bytes([body[-1] | 0x80])  # 300 = 37 * 8 + 4: bit 7 of the last byte
        assert_problem(srv.client.post(path, content=padded, headers=compact), 400, "malformed-body")
        assert srv.client.get(f"/v1/studies/{st.study_id}").json()["status"] == "open"
        r = srv.client.post(path, content=body, headers=compact)
        assert r.status_code == 200, r.text
        assert r.json()["n_reports"] == 290
        assert r.json()["inclusion_hash"] == hashlib.sha256(b"".join(keep)).hexdigest()
        again = srv.client.post(path, content=body, headers=compact)  # idempotent
        assert again.status_code == 200 and again.json() == r.json()
    finally:
        srv.close()


def test_capacity_exceeded(tmp_path: Path):
    srv = Server(tmp_path / "cap.sqlite3")
    try:
        st = make_study(max_reports=150)
        srv.provision(st)
        rs = srv.reports(st, 150)
        assert srv.batch(st, rs[:140]).status_code == 200
        assert_problem(srv.batch(st, srv.reports(st, 11)), 409, "capacity-exceeded")
        # duplicates do not count against capacity
        r = srv.batch(st, rs[130:150])
        assert r.json() == {"accepted": 10, "duplicates": 10, "report_count": 150}
        assert_problem(srv.upload(st, srv.reports(st, 1)), 409, "capacity-exceeded")
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


@BOTH_STORES
def test_commit_refusals(server: Server, study: Study):
    rs = server.reports(study, 120)
    ids = rs.ids
    server.batch(study, rs)
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
    # fewer than min_reports = 100: certificate-refused with n_reports and min_reports (the status
    # the analyzer gives a finalize below min_reports too: docs/protocol.md sections 6, 6a)
    few = assert_problem(server.commit(study, ids[:99]), 422, "certificate-refused")
    assert (few["n_reports"], few["min_reports"]) == (99, study.min_reports) == (99, 100)
    assert_problem(server.commit(study, []), 422, "certificate-refused")
    assert_problem(server.commit(make_study(name="nope"), ids), 404, "unknown-study")
    assert server.client.get(f"/v1/studies/{study.study_id}").json()["status"] == "open"
    assert_problem(server.aggregate(study), 409, "study-open")


def test_commit_leaving_out_too_many_reports_is_refused(server: Server, study: Study):
    """The batch rule (docs/trust.md): an inclusion set may leave out at most
    max_excluded_fraction (default 0.1) of the reports the server holds; beyond, 422
    inclusion-refused and nothing changes, so a commit within the rule still goes through."""
    assert server.client.get("/v1/info").json()["policy"]["max_excluded_fraction"] == MAX_EXCLUDED_FRACTION
    n = 200
    rs = server.reports(study, n)
    assert server.batch(study, rs).status_code == 200
    allowed = math.floor(MAX_EXCLUDED_FRACTION * n)  # 20
    held, totals = server.held_ids(study), server.totals(study)
    for left_out in (allowed + 1, n // 2):
        body = assert_problem(server.commit(study, rs.ids[left_out:]), 422, "inclusion-refused")
        assert (body["excluded"], body["held"], body["allowed"]) == (left_out, n, allowed)
        assert f"leaves out {left_out} of the {n}" in body["detail"]
        info = server.client.get(f"/v1/studies/{study.study_id}").json()
        assert info["status"] == "open" and info["commit"] is None and info["report_count"] == n
        assert_problem(server.aggregate(study), 409, "study-open")
        assert server.held_ids(study) == held
        assert np.array_equal(server.totals(study), totals)
    # nothing was committed: a set within the rule still commits, and releases its exact sketch
    included = rs.ids[allowed:]
    r = server.commit(study, included)
    assert r.status_code == 200, r.text
    assert r.json()["n_reports"] == n - allowed
    got = decode_aggregate(server.aggregate(study).content, study.k, study.width)
    assert np.array_equal(got, expected_aggregate(study, included, rs.shares[allowed:]))


def test_certificate_refuses_a_bad_spectrum(server: Server, study: Study):
    """Enough reports, but none in sketch row 0: lambda_min(S S^T) = 0 < lambda_star."""
    rs = server.reports(study, 0)
    while len(rs) < 130:
        more = server.reports(study, 200)
        keep = [i for i, rid in enumerate(more.ids)
                if sketch.bucket_and_sign(study.seed_bytes, rid, study.k, study.s, 0)[0] != 0]
        rs = rs + more[keep[:130 - len(rs)]]
    server.batch(study, rs)
    body = assert_problem(server.commit(study, rs.ids), 422, "certificate-refused")
    assert body["lambda_min"] == pytest.approx(0.0, abs=1e-9)
    assert "lambda_min" in body["detail"]
    assert_problem(server.aggregate(study), 409, "study-open")


# none, few (subtract the excluded), most (sum the included from scratch). Leaving out most of the
# held reports is outside the default batch rule (at most 10%), so that case runs on a server
# whose operator allows it (max_excluded_fraction = 0.6 >= 150 / 270).
@BOTH_STORES
@pytest.mark.parametrize("excluded,fraction", [(0, None), (10, None), (150, 0.6)])
def test_commit_releases_the_exact_sketch_once(store_location, excluded: int, fraction: float | None):
    server = Server(store_location("s1"),
                    **({"max_excluded_fraction": fraction} if fraction is not None else {}))
    try:
        study = make_study(min_reports=LOW_MIN)  # it commits 117-133 fresh ids: LOW_MIN
        assert study.server_sigma == 0
        assert server.provision(study).status_code == 201
        _commit_releases_the_exact_sketch_once(server, study, excluded)
    finally:
        server.close()


def _commit_releases_the_exact_sketch_once(server: Server, study: Study, excluded: int):
    n_in = 120
    rs = server.reports(study, n_in + excluded)
    ids, shares = rs.ids, rs.shares
    for start in range(0, len(ids), 37):  # several batches and a few single uploads
        server.batch(study, rs[start:start + 37])
    server.upload(study, rs[0])  # a duplicate changes nothing
    included = ids[:n_in]
    r = server.commit(study, included)
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["n_reports"] == n_in
    assert result["inclusion_hash"] == inclusion_hash(sorted(included))
    assert result["margin"] == pytest.approx(result["lambda_min"] - study.t - study.lambda_star)
    assert result["margin"] >= 0 and result["lambda_star"] == study.lambda_star
    assert result["server_sigma"] == 0
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
    assert_problem(server.upload(study, server.reports(study, 1)), 409, "study-closed")
    assert_problem(server.batch(study, server.reports(study, 2)), 409, "study-closed")
    info = server.client.get(f"/v1/studies/{study.study_id}").json()
    assert info["status"] == "committed" and info["commit"] == result
    assert info["report_count"] == n_in + excluded
    assert server.aggregate(study).content == first.content


@BOTH_STORES
def test_server_noise_is_added_once_at_commit(store_location):
    """A study with a floor: the server's release is the exact sketch of the included shares plus
    its own noise, N(0, (server_sigma sqrt(s))^2) per cell of the unscaled k x width aggregate
    (the analyzer's 1/sqrt(s) makes it server_sigma), drawn once: the same bytes on every GET,
    after a repeated commit and after a restart."""
    db = store_location("noise")
    srv = Server(db, max_floor_epsilon=4.0)
    # replace-one, epsilon 1: the report's own noise alone gives a floor of ~1.8, so a floor of
    # 1.5 needs server noise (design() puts server_sigma ~ 3.7 here)
    st = make_study(name="noisy", columns=[f"c{i}" for i in range(32)], expected_reports=1000, k=64,
                    s=2, min_reports=500, epsilon_floor=1.5)
    assert st.server_sigma > 0
    std = st.server_sigma * math.sqrt(st.s)
    try:
        assert srv.provision(st).status_code == 201
        rs = srv.reports(st, 1000)  # lambda_min over 980 of them: ~8.2 +- 0.6, lambda_star 2.9
        assert srv.batch(st, rs).status_code == 200
        included = rs.ids[20:]
        r = srv.commit(st, included)
        assert r.status_code == 200, r.text
        result = r.json()
        assert result["server_sigma"] == st.server_sigma
        first = srv.aggregate(st)
        assert first.status_code == 200
        got = decode_aggregate(first.content, st.k, st.width)
        exact = expected_aggregate(st, included, rs.shares[20:])
        # the noise, read back from the ring (two's complement, 2^-f fixed point)
        noise = (got - exact).view(np.int64).astype(np.float64) * 2.0 ** -st.frac_bits
        cells = st.k * st.width
        assert noise.shape == (st.k, st.width) and cells == 2048
        # Tolerances at about 6 standard errors (two-sided p ~ 2e-9 each) for n = 2048 iid
        # N(0, std^2) cells: the sample std has relative standard error 1/sqrt(2 (n - 1)) = 0.0156
        # (6 SE = 9.4%); the mean has standard error std/sqrt(n); the fraction within one std,
        # p = 0.6827, has standard error sqrt(p (1 - p) / n) = 0.0103 (6 SE = 0.062), which also
        # tells a Gaussian from, e.g., a uniform law of the same std (p = 0.577).
        n = noise.size
        assert abs(noise.std(ddof=1) / std - 1) < 6 / math.sqrt(2 * (n - 1)), (noise.std(ddof=1), std)
        assert abs(noise.mean()) < 6 * std / math.sqrt(n)
        assert abs(np.mean(np.abs(noise) < std) - 0.6827) < 6 * math.sqrt(0.6827 * 0.3173 / n)
        assert np.abs(noise).max() <= 20 * std  # the sampler's tail cut
        # drawn once and stored
        assert srv.aggregate(st).content == first.content
        assert srv.commit(st, included).json() == result
        assert srv.aggregate(st).content == first.content
    finally:
        srv.close()
    srv = Server(db)
    try:
        assert srv.aggregate(st).content == first.content
    finally:
        srv.close()


@BOTH_STORES
def test_restart_rebuilds_totals(store_location):
    db = store_location("restart")
    srv = Server(db)
    st = make_study(min_reports=LOW_MIN)  # it commits 117-133 fresh ids: LOW_MIN
    srv.provision(st)
    rs = srv.reports(st, 130)
    ids, shares = rs.ids, rs.shares
    srv.batch(st, rs[:100])
    srv.close()
    srv = Server(db, warm_start=False)  # lazy rebuild on first use
    try:
        assert srv.count(st) == 100
        assert srv.batch(st, rs[90:]).json() == {"accepted": 30, "duplicates": 10, "report_count": 130}
        _assert_released(srv, st, ids[5:], shares[5:])
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


@BOTH_STORES
def test_a_group_of_uploads_is_stored_as_one_batch_holding_every_byte_sent(store_location):
    """Uploads that reach the writer together are one batch row, their shares written request
    after request with no joined copy (SQLite: into a zero blob by blob I/O once they reach
    IN_PLACE_BYTES, services/backend.py). A part written short, twice or at the wrong place
    would leave zeros or other reports' shares in the file; a small batch takes the bound path.
    The running totals fold the parts one by one too. The writer is held by a call until the
    group is queued."""
    import threading

    from dpsketch.services import db as store_db
    from dpsketch.services.writer import CallJob

    db = store_location("in-place")
    st = make_study(columns=[f"c{i}" for i in range(64)], expected_reports=1000)
    srv = Server(db)
    rs = srv.reports(st, 900)
    width = 8 * st.width
    assert 2 * 300 * width >= store_db.IN_PLACE_BYTES > 100 * width  # both paths are taken
    store = srv.app.state.store
    try:
        assert srv.provision(st).status_code in (200, 201)
        record = store.record(st.study_id)
        assert srv.batch(st, rs[:100]).json()["accepted"] == 100  # a small batch, bound
        gate = threading.Event()
        held = store.writer.submit(CallJob(lambda conn: (gate.wait(30), None)))
        # large requests (one repeating 50 held reports: only its 140 new rows are stored) and
        # small ones between them, which the writer joins with their neighbours
        parts = [rs[100:400], rs[400:405], rs[405:410], rs[410:710], rs[50:100] + rs[710:850], rs[850:855]]
        queued = [store.submit_upload(record, part.ids, part.shares) for part in parts]
        gate.set()
        assert held.result(30) is True
        assert [(f.result(30).accepted, f.result(30).duplicates) for f in queued] == [
            (300, 0), (5, 0), (5, 0), (300, 0), (140, 50), (5, 0)]
        assert srv.batch(st, rs[855:]).json()["accepted"] == 45
        _assert_released(srv, st, rs.ids, rs.shares)  # the running totals, folded a part at a time
    finally:
        srv.close()
    conn, _ = _open_store(db)
    with conn:
        stored = conn.execute("SELECT m, ids, shares FROM batches ORDER BY first").fetchall()
    assert [int(m) for m, _, _ in stored] == [100, 755, 45]  # the group is one row
    sent = {rid: row.astype("<u8").tobytes() for rid, row in zip(rs.ids, rs.shares)}
    seen = []
    for m, ids, shares in stored:
        ids, shares = bytes(ids), bytes(shares)
        assert len(shares) == int(m) * width
        for i in range(int(m)):
            seen.append(ids[16 * i:16 * (i + 1)])
            assert shares[i * width:(i + 1) * width] == sent[seen[-1]]
    assert sorted(seen) == sorted(rs.ids)  # each report once


def _to_a_row_per_report(db: Path | str) -> None:
    """Rewrite a store as servers before batches stored it: a row of ``reports`` per report with
    its share (SQLite: the old table; PostgreSQL: the share column back on ``reports``)."""
    if isinstance(db, str):
        import psycopg

        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("ALTER TABLE reports ADD COLUMN share BYTEA")
            conn.execute("UPDATE reports r SET share = substring(b.shares FROM CAST(r.id - b.first AS integer) * "
                         "(length(b.shares) / b.m) + 1 FOR length(b.shares) / b.m) FROM batches b "
                         "WHERE r.id >= b.first AND r.id < b.first + b.m")
            conn.execute("ALTER TABLE reports ALTER COLUMN share SET NOT NULL")
            conn.execute("DROP TABLE batches")
        return
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE reports (id INTEGER PRIMARY KEY, study INTEGER NOT NULL REFERENCES studies(seq), "
                     "report_id BLOB NOT NULL CHECK (length(report_id) = 16), share BLOB NOT NULL, "
                     "pseudonym BLOB, party INTEGER)")
        for first, seq, m, ids, shares, pseudonyms, party in conn.execute(
                "SELECT first, study, m, ids, shares, pseudonyms, party FROM batches").fetchall():
            w = len(shares) // m
            conn.executemany("INSERT INTO reports VALUES (?, ?, ?, ?, ?, ?)", [
                (first + i, seq, ids[16 * i:16 * (i + 1)], shares[w * i:w * (i + 1)],
                 None if pseudonyms is None else pseudonyms[16 * i:16 * (i + 1)], party) for i in range(m)])
        conn.execute("DROP TABLE batches")


def _open_store(db: Path | str):
    """A direct connection to a test server's store (a SQLite file or a PostgreSQL URL), and the
    placeholder its driver takes."""
    if isinstance(db, str):
        import psycopg

        return psycopg.connect(db), "%s"
    return sqlite3.connect(db), "?"


def _stored_batches(db: Path | str) -> tuple[int, int]:
    """(batches, reports in them) as the database holds them."""
    conn, _ = _open_store(db)
    with conn:
        n, m = conn.execute("SELECT count(*), coalesce(sum(m), 0) FROM batches").fetchone()
    return int(n), int(m)


def _assert_released(srv: "Server", st: Study, ids: list[bytes], shares: np.ndarray) -> None:
    """Commit to ``ids``; the aggregate served is exactly S X of their ``shares``."""
    r = srv.commit(st, ids)
    assert r.status_code == 200, r.text
    got = decode_aggregate(srv.aggregate(st).content, st.k, st.d)
    assert np.array_equal(got, expected_aggregate(st, ids, shares))


@BOTH_STORES
def test_a_store_written_a_row_per_report_is_converted_in_place(store_location):
    db = store_location("rows")
    srv = Server(db)
    st = make_study(min_reports=LOW_MIN)  # it commits 117-133 fresh ids: LOW_MIN
    srv.provision(st)
    rs = srv.reports(st, 140)
    try:
        assert srv.batch(st, rs[:100]).status_code == 200
        for i in range(100, 103):
            assert srv.upload(st, rs[i:i + 1]).status_code == 200
        before = srv.held_ids(st)
    finally:
        srv.close()
    assert _stored_batches(db)[1] == 103
    _to_a_row_per_report(db)
    srv = Server(db, warm_start=False)
    try:
        assert _stored_batches(db) == (103, 103)  # every report a batch of one, none lost
        assert srv.count(st) == 103 and srv.held_ids(st) == before
        # held ids again: duplicates only if the converted shares read back byte for byte
        assert srv.batch(st, rs[95:]).json() == {"accepted": 37, "duplicates": 8, "report_count": 140}
        _assert_released(srv, st, rs.ids[7:], rs.shares[7:])
    finally:
        srv.close()
    if not isinstance(db, str):
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'reports'").fetchone() is None


@BOTH_STORES
def test_a_writer_group_of_seeds_and_full_shares_stores_a_row_of_each(store_location):
    """Two uploads of one study that reach the writer together, one as seeds and one as full
    shares, are one transaction but two batch rows (a row holds one kind, services/batches.py):
    the seeds stay 32 bytes, both read back as the shares they stand for, after a restart too,
    and the release is the exact sum. The writer is held by a call until both are queued."""
    import threading

    from dpsketch.protocol import ring
    from dpsketch.services.writer import CallJob

    db = store_location("mixed")
    srv = Server(db)
    st = make_study(columns=["a", "b", "c", "d", "e", "f"], min_reports=LOW_MIN)  # it commits 145 fresh ids
    assert st.width > 4  # seeds are stored (below that width a seed is not smaller than a share)
    srv.provision(st)
    store = srv.app.state.store
    record = store.record(st.study_id)
    rng = np.random.default_rng(12)
    seeds = rng.integers(0, 256, size=(90, 32), dtype=np.uint8)
    seeded = ring.expand_seeds(seeds, st.width)
    full = rng.integers(0, 2**64, size=(70, st.width), dtype=np.uint64, endpoint=False)
    ids = [os.urandom(16) for _ in range(160)]
    try:
        gate = threading.Event()
        held = store.writer.submit(CallJob(lambda conn: (gate.wait(30), None)))
        first = store.submit_upload(record, ids[:90], seeded, seeds=seeds)
        second = store.submit_upload(record, ids[90:], full)
        gate.set()
        assert held.result(30) is True
        assert first.result(30).accepted == 90 and second.result(30).accepted == 70
        assert srv.count(st) == 160
    finally:
        srv.close()
    rows = _batch_rows(db)
    assert sorted(rows) == [(70, 8 * st.width * 70), (90, 32 * 90)]  # (reports, stored bytes) per row
    srv = Server(db, warm_start=False)  # rebuilt from the stored seeds and shares
    try:
        assert srv.count(st) == 160
        # 5 seeded and 10 full reports excluded: read back and subtracted
        _assert_released(srv, st, ids[5:150], np.concatenate([seeded, full])[5:150])
    finally:
        srv.close()


def test_seeds_of_a_narrow_study_are_stored_expanded(tmp_path: Path):
    """At share width 4 or less a seed (32 bytes) is no smaller than the share: the writer stores
    the share, so no stored record's length can be read both ways."""
    from dpsketch.protocol import ring

    db = tmp_path / "narrow.sqlite3"
    srv = Server(db)
    st = make_study(min_reports=LOW_MIN)  # it commits 117-133 fresh ids: LOW_MIN
    assert st.width <= 4
    srv.provision(st)
    store = srv.app.state.store
    seeds = np.random.default_rng(3).integers(0, 256, size=(120, 32), dtype=np.uint8)
    shares = ring.expand_seeds(seeds, st.width)
    ids = [os.urandom(16) for _ in range(120)]
    try:
        assert store.submit_upload(store.record(st.study_id), ids, shares, seeds=seeds).result(30).accepted == 120
        _assert_released(srv, st, ids[3:], shares[3:])
    finally:
        srv.close()
    assert _batch_rows(db) == [(120, 8 * st.width * 120)]


def _batch_rows(db: Path | str) -> list[tuple[int, int]]:
    """(reports, bytes of shares or seeds) of every batch row."""
    conn, _ = _open_store(db)
    with conn:
        return [(int(m), int(n)) for m, n in conn.execute("SELECT m, length(shares) FROM batches")]


def _set_schema_version(db: Path | str, version: int) -> int:
    """Mark the store as written by a server of another schema version; the version before."""
    conn, mark = _open_store(db)
    with conn:
        (before,) = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        conn.execute(f"UPDATE meta SET value = {mark} WHERE key = 'schema_version'", (str(version),))
    return int(before)


@BOTH_STORES
def test_a_version_2_or_3_store_is_opened_and_marked_4_and_a_newer_one_is_refused(store_location):
    """Schema 3 may store seeds in place of shares, schema 4 a batch proof's record in a batch row
    (services/batches.py): a version 2 or 3 store is read as it is and marked 4, so a server that
    reads only 2 or 3 refuses it afterwards instead of misreading seeds or proof records; a store
    of a version this server does not know is refused, and nothing in it changes."""
    db = store_location("versions")
    srv = Server(db)
    st = make_study()
    srv.provision(st)
    rs = srv.reports(st, 30)
    try:
        assert srv.batch(st, rs).status_code == 200
    finally:
        srv.close()
    for older in (2, 3):
        assert _set_schema_version(db, older) == 4
        srv = Server(db, warm_start=False)
        try:
            assert srv.count(st) == 30
        finally:
            srv.close()
    assert _set_schema_version(db, 5) == 4  # what opening it wrote; now pretend a newer server's
    with pytest.raises(RuntimeError, match="schema version 5; this server reads 4"):
        Server(db, warm_start=False)
    assert _set_schema_version(db, 5) == 5


# --- an unavailable store ----------------------------------------------------------------------


def test_locked_database_answers_503_and_stores_nothing(tmp_path: Path):
    db = tmp_path / "locked.sqlite3"
    srv = Server(db, busy_timeout_s=0.2)
    try:
        st = make_study()
        srv.provision(st)
        srv.batch(st, srv.reports(st, 3))
        other = sqlite3.connect(str(db), isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        r = srv.batch(st, srv.reports(st, 4))
        body = assert_problem(r, 503, "unavailable")
        assert r.headers["retry-after"] == "1" and "locked" in body["detail"]
        assert_problem(srv.upload(st, srv.reports(st, 1)), 503, "unavailable")
        assert srv.count(st) == 3
        other.execute("ROLLBACK")
        other.close()
        assert srv.batch(st, srv.reports(st, 4)).json()["report_count"] == 7
        assert len(srv.held_ids(st)) == 7 * 16
    finally:
        srv.close()


def test_full_disk_answers_503_and_stores_nothing(tmp_path: Path):
    db = tmp_path / "full.sqlite3"
    srv = Server(db)
    try:
        st = make_study(columns=[f"c{i}" for i in range(64)])
        srv.provision(st)
        small = srv.reports(st, 10)
        srv.batch(st, small)
        writer = srv.app.state.store.writer.conn
        pages = writer.execute("PRAGMA page_count").fetchone()[0]
        writer.execute(f"PRAGMA max_page_count = {pages}")  # SQLITE_FULL on the next new page
        big = srv.reports(st, 1500)
        r = srv.batch(st, big)
        body = assert_problem(r, 503, "unavailable")
        assert "full" in body["detail"] and r.headers["retry-after"]
        assert srv.count(st) == 10
        writer.execute("PRAGMA max_page_count = 1073741823")
        assert srv.batch(st, big).json() == {"accepted": 1500, "duplicates": 0, "report_count": 1510}
        assert srv.batch(st, small).json()["duplicates"] == 10
    finally:
        srv.close()


def test_postgres_lock_held_elsewhere_answers_503_and_stores_nothing(postgres):
    """As the locked SQLite file: another session holds a lock the writer needs; the write waits
    busy_timeout_s (PostgreSQL's lock_timeout), answers 503 with Retry-After and stores nothing,
    reads keep working, and the same bytes are accepted once the lock is gone."""
    import psycopg

    url = postgres.new_database("locked")
    srv = Server(url, busy_timeout_s=0.2)
    try:
        st = make_study()
        srv.provision(st)
        srv.batch(st, srv.reports(st, 3))
        other = psycopg.connect(url, autocommit=True)
        other.execute("BEGIN")
        other.execute("LOCK TABLE reports IN EXCLUSIVE MODE")  # blocks writes, not reads
        blocked = srv.reports(st, 4)
        r = srv.batch(st, blocked)
        body = assert_problem(r, 503, "unavailable")
        assert r.headers["retry-after"] == "1" and "locked" in body["detail"]
        assert_problem(srv.upload(st, srv.reports(st, 1)), 503, "unavailable")
        assert srv.count(st) == 3
        assert len(srv.held_ids(st)) == 3 * 16  # reads still work
        other.execute("ROLLBACK")
        other.close()
        assert srv.batch(st, blocked).json() == {"accepted": 4, "duplicates": 0, "report_count": 7}
        assert len(srv.held_ids(st)) == 7 * 16
    finally:
        srv.close()
        postgres.drop_databases()


def test_postgres_down_answers_503_then_recovers(postgres):
    """The database server goes away (stopped) and comes back on the same port: while it is down
    every write and read answers 503 unavailable with Retry-After, readiness (Store.ping) fails,
    nothing is half-stored; afterwards the same server process reconnects by itself and the
    refused reports are accepted as new."""
    from dpsketch.protocol.problems import ProblemError

    url = postgres.new_database("down")
    srv = Server(url)
    store = srv.app.state.store
    try:
        st = make_study()
        srv.provision(st)
        first = srv.reports(st, 5)
        assert srv.batch(st, first).json()["report_count"] == 5
        store.ping()
        up_size = store.size_bytes()  # pg_database_size: what the metrics' dpsketch_store_bytes shows
        assert up_size is not None and up_size > 0
        postgres.pg_ctl("stop")
        try:
            later = srv.reports(st, 6)
            r = srv.batch(st, later)
            assert_problem(r, 503, "unavailable")
            assert int(r.headers["retry-after"]) >= 1
            assert_problem(srv.upload(st, srv.reports(st, 1)), 503, "unavailable")
            r = srv.client.get(f"/v1/studies/{st.study_id}/report-ids", headers=bearer(AN))
            assert_problem(r, 503, "unavailable")
            with pytest.raises(ProblemError) as info:
                store.ping()
            assert info.value.slug == "unavailable"
            assert store.size_bytes() is None  # a scrape during the outage omits the size
        finally:
            postgres.pg_ctl("start")
        store.ping()
        assert srv.batch(st, later).json() == {"accepted": 6, "duplicates": 0, "report_count": 11}
        assert srv.batch(st, first).json()["duplicates"] == 5
        assert len(srv.held_ids(st)) == 11 * 16
        both = first + later  # the running totals hold each report once
        assert np.array_equal(srv.totals(st), expected_aggregate(st, both.ids, both.shares))
    finally:
        srv.close()
        postgres.drop_databases()


def test_replicas_sharing_one_postgres_database_act_as_one_server(postgres):
    """Two server processes of one organisation on one PostgreSQL database (replicas behind a
    load balancer): a study provisioned through one is served by the other; each sees what the
    other stored before it decides (duplicates, conflicts, the totals); a commit happens once,
    whichever replica is asked, and both release the same bytes; uploads after it are refused by
    both. Tokens issued or revoked through one hold at the other."""
    import psycopg

    url = postgres.new_database("two")
    a = Server(url)
    b = None
    try:
        st = make_study(min_reports=LOW_MIN)  # it commits 117-133 fresh ids: LOW_MIN
        a.provision(st)
        rs = a.reports(st, 120)
        assert a.batch(st, rs).json()["report_count"] == 120
        b = Server(url)  # a second process on the same database
        assert b.count(st) == 120 and np.array_equal(b.totals(st), a.totals(st))
        more = a.reports(st, 5)
        assert a.batch(st, more).json()["report_count"] == 125
        again = b.batch(st, more).json()  # b catches up first: these are duplicates, not new
        assert (again["accepted"], again["duplicates"], again["report_count"]) == (0, 5, 125)
        extra = a.reports(st, 7)
        assert b.batch(st, extra).json()["report_count"] == 132
        assert a.count(st) == 132
        assert a.batch(st, extra).json()["duplicates"] == 7  # a caught up before deciding
        assert np.array_equal(a.totals(st), b.totals(st))

        # a study provisioned through b is known to a; a late second PUT through a is idempotent
        st2 = make_study()
        assert b.provision(st2).status_code == 201
        assert a.provision(st2).status_code == 200
        assert a.count(st2) == 0

        every = rs.ids + more.ids + extra.ids
        r = b.commit(st, every)
        assert r.status_code == 200, r.text
        released = b.aggregate(st).content
        assert a.commit(st, every).json() == r.json()  # the same set: the same result, once
        assert_problem(a.commit(st, every[:125]), 409, "inclusion-conflict")  # not a second release
        assert a.aggregate(st).content == released
        assert_problem(a.batch(st, a.reports(st, 3)), 409, "study-closed")
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT count(*) FROM commits").fetchone()[0] == 1
            n, distinct = conn.execute("SELECT count(*), count(DISTINCT report_id) FROM reports").fetchone()
            assert n == distinct == 132

        # upload tokens: issued through a, used through b (quota charged once across both)
        r = a.client.post(f"/v1/studies/{st2.study_id}/upload-tokens", json={"count": 1, "quota": 10},
                          headers=bearer(OP))
        assert r.status_code == 201, r.text
        token, token_id = r.json()["token"], r.json()["token_id"]
        assert_problem(b.batch(st2, b.reports(st2, 2)), 401, "unauthorized")
        assert b.batch(st2, b.reports(st2, 6), token=token).json()["accepted"] == 6
        assert_problem(a.batch(st2, a.reports(st2, 5), token=token), 403, "upload-quota-exceeded")
        assert a.batch(st2, a.reports(st2, 4), token=token).json()["accepted"] == 4
        r = a.client.delete(f"/v1/studies/{st2.study_id}/upload-tokens/{token_id}", headers=bearer(OP))
        assert r.status_code == 200, r.text
        # b still had the token in memory; its writer re-reads it under the study's lock
        assert_problem(b.batch(st2, b.reports(st2, 1), token=token), 403, "upload-quota-exceeded")
        assert a.count(st2) == b.count(st2) == 10
    finally:
        a.close()
        if b is not None:
            b.close()
        postgres.drop_databases()


def test_replicas_racing_on_the_same_reports_and_commits_store_once_and_release_once(postgres):
    """The races a load balancer creates: the same batch sent to both replicas at once (a client
    retry that reached both) is stored once, acknowledged by both; two different inclusion sets
    committed at once through the two replicas release exactly one of them."""
    from concurrent.futures import ThreadPoolExecutor

    url = postgres.new_database("race")
    a, b = Server(url), Server(url)
    try:
        st = make_study()
        a.provision(st)
        batches = [a.reports(st, 60) for _ in range(6)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda pair: pair[0].batch(st, pair[1]),
                                    [(srv, bt) for bt in batches for srv in (a, b)]))
        assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
        for i in range(0, len(answers), 2):  # per batch: stored once, the other answer a duplicate
            pair = sorted((answers[i].json()["accepted"], answers[i + 1].json()["accepted"]))
            assert pair == [0, 60]
        assert a.count(st) == b.count(st) == 360
        every = [rid for bt in batches for rid in bt.ids]
        with ThreadPoolExecutor(2) as pool:
            ra, rb = pool.map(lambda pair: pair[0].commit(st, pair[1]), [(a, every), (b, every[:-30])])
        assert sorted((ra.status_code, rb.status_code)) == [200, 409]
        winner, loser = (ra, rb) if ra.status_code == 200 else (rb, ra)
        assert winner.json()["n_reports"] in (360, 330)  # either set may win (30 of 360 left out is allowed)
        assert loser.json()["type"].endswith(":inclusion-conflict")
        assert a.aggregate(st).content == b.aggregate(st).content
    finally:
        a.close()
        b.close()
        postgres.drop_databases()


@BOTH_STORES
def test_restart_from_a_checkpoint_holds_what_a_full_rebuild_holds(store_location, monkeypatch):
    """Checkpoints (services/checkpoint.py): after a crash, a study's state is its last
    checkpoint plus the reports stored after it, and equals a rebuild from every stored share
    (totals, s S S^T and the index); a checkpoint that does not fit the study is ignored; the
    commit after such a restart releases exactly the sum of the shares."""
    from dpsketch.services import checkpoint, state as state_module
    from dpsketch.services.idsets import join_halves
    from dpsketch.services.store import Store
    from dpsketch.services.writer import CallJob

    monkeypatch.setattr(checkpoint, "CHECKPOINT_MIN_REPORTS", 100)
    db = store_location("s1")
    a = Server(db)
    st = make_study()
    a.provision(st)
    batches = [a.reports(st, 120) for _ in range(3)]
    for b in batches:
        assert a.batch(st, b).status_code == 200
    flush = CallJob(lambda conn: (None, None))  # the writer checkpoints after acknowledging
    a.app.state.store.writer.submit(flush).result()
    record = a.app.state.store.record(st.study_id)
    assert record.state.checkpointed == 360  # at 120, 240 and 360: each >= 1.25 x the last
    tail = a.reports(st, 20)
    assert a.batch(st, tail).status_code == 200  # 380 < 1.25 x 360: no new checkpoint
    a.app.state.store.writer.submit(CallJob(lambda conn: (None, None))).result()
    assert record.state.checkpointed == 360 and len(record.state.ids) == 380
    monkeypatch.setattr(Store, "_checkpoint_all", lambda self: None)  # a crash: no shutdown checkpoint
    a.close()

    def full_rebuild(store: Store):
        with store._reading() as conn:
            return state_module.load_state(conn, store.record(st.study_id), 1000, store.backend)

    b = Server(db)
    try:
        store = b.app.state.store
        restored = store.ensure_state(store.record(st.study_id))
        assert (restored.checkpointed, len(restored.ids)) == (360, 380)  # checkpoint plus a tail
        fresh = full_rebuild(store)
        assert np.array_equal(restored.aggregate, fresh.aggregate)
        assert np.array_equal(restored.gram, fresh.gram)
        assert restored.ids == fresh.ids and restored.last_rowid == fresh.last_rowid
        every = sorted(rid for bt in batches + [tail] for rid in bt.ids)
        hi, lo, rowids = restored.ids.sorted()
        assert join_halves(hi, lo) == b"".join(every) and len(set(rowids.tolist())) == 380
        assert b.batch(st, tail).json()["duplicates"] == 20  # the index knows the tail
    finally:
        b.close()

    # a checkpoint that does not fit is ignored: the state is rebuilt from the shares
    c = Server(db)
    try:
        store = c.app.state.store
        store.ensure_state(store.record(st.study_id))  # the warm start's load is over, not racing ours

        def corrupt(conn):
            conn.execute("UPDATE checkpoints SET ids = ?", (b"\x00" * 16,))
            return None, None

        store.writer.submit(CallJob(corrupt)).result()
        store.record(st.study_id).state = None
        rebuilt = store.ensure_state(store.record(st.study_id))
        assert rebuilt.checkpointed == 0 and len(rebuilt.ids) == 380
        assert np.array_equal(rebuilt.aggregate, full_rebuild(store).aggregate)
        every = [rid for bt in batches + [tail] for rid in bt.ids]
        r = c.commit(st, every)
        assert r.status_code == 200, r.text
        released = decode_aggregate(c.aggregate(st).content, st.k, st.width)
        expected = np.zeros_like(released)
        shares = np.concatenate([bt.shares for bt in batches + [tail]])
        rows, signs = st.hash_report_ids(every)
        sketch.accumulate(expected, rows, signs, shares)
        assert np.array_equal(released, expected)
    finally:
        c.close()


@BOTH_STORES
def test_incremental_checkpoints_append_segments_compact_and_restore_exactly(store_location, monkeypatch):
    """A checkpoint after the first appends only the ids stored since (a segment) and rewrites the
    totals; once the segments outgrow COMPACT_AFTER x the base it is written whole again. After a
    crash at any point the state is the checkpoint (base + segments) plus the tail, equal to a
    rebuild from every share; a segment that does not continue the stored checkpoint (another
    replica moved it) is not written, and the checkpoint stays loadable."""
    from dpsketch.services import checkpoint, state as state_module
    from dpsketch.services.store import Store
    from dpsketch.services.writer import CallJob

    monkeypatch.setattr(checkpoint, "CHECKPOINT_MIN_REPORTS", 100)
    db = store_location("s1")
    a = Server(db)
    st = make_study()
    a.provision(st)
    store = a.app.state.store
    record = store.record(st.study_id)

    def flush():
        store.writer.submit(CallJob(lambda conn: (None, None))).result()

    def parts():
        with store._reading() as conn:
            base = conn.execute("SELECT length(ids) / 16, last_rowid FROM checkpoints WHERE study = ?",
                                (record.seq,)).fetchone()
            segs = [int(n) for (n,) in conn.execute(
                "SELECT length(ids) / 16 FROM checkpoint_segments WHERE study = ? ORDER BY last_rowid",
                (record.seq,)).fetchall()]
        if base is None:
            return 0, segs
        # the base is the first segment row; the totals row, rewritten by every checkpoint, holds no ids
        assert int(base[0]) == 0 and segs, (base, segs)
        return segs[0], segs[1:]

    seen = []
    batches = []
    for _ in range(30):
        batches.append(a.reports(st, 40))
        assert a.batch(st, batches[-1]).status_code == 200
        flush()
        seen.append(parts())
    base, segs = seen[-1]
    assert base + sum(segs) == record.state.checkpointed
    # segments were appended on a base, each only the ids since the one before ...
    assert any(len(s) >= 2 for _, s in seen)
    assert all(sum(s) <= checkpoint.COMPACT_AFTER * b for b, s in seen if b)
    # ... and a compaction wrote it whole again: a larger base with no segments
    bases = [b for b, _ in seen if b]
    assert len(set(bases)) >= 2 and any(not s for b, s in seen if b > bases[0])
    written = 0  # index entries written by all the checkpoints
    for (b0, s0), (b1, s1) in zip([(0, [])] + seen[:-1], seen):
        if (b1, s1) != (b0, s0):
            written += b1 if b1 != b0 else s1[-1]
    assert written < 4 * record.state.checkpointed  # whole each time: about 5 x; incremental: about 2.3 x

    # a stale writer (another replica's view): its segment does not continue the stored checkpoint
    with record.state.lock:
        now = checkpoint.snapshot(record.state)
    stale = checkpoint.Snapshot(now.last_rowid + 10_000, now.count + 1, now.aggregate, now.gram,
                                bytes(16), (1).to_bytes(8, "little"), previous=now.last_rowid - 1,
                                previous_count=now.count)
    outcome = store.writer.submit(CallJob(lambda conn: (checkpoint.write(conn, record.seq, stale), None))).result()
    assert outcome is None and parts() == seen[-1]

    tail = a.reports(st, 25)
    assert a.batch(st, tail).status_code == 200
    flush()
    monkeypatch.setattr(Store, "_checkpoint_all", lambda self: None)  # a crash: no shutdown checkpoint
    held = len(record.state.ids)
    a.close()

    b = Server(db)
    try:
        store = b.app.state.store
        restored = store.ensure_state(store.record(st.study_id))
        assert len(restored.ids) == held and restored.checkpointed == base + sum(segs)
        with store._reading() as conn:
            fresh = state_module.load_state(conn, store.record(st.study_id), 1000, store.backend)
        assert np.array_equal(restored.aggregate, fresh.aggregate)
        assert np.array_equal(restored.gram, fresh.gram)
        assert restored.ids == fresh.ids and restored.last_rowid == fresh.last_rowid
        assert b.batch(st, tail).json()["duplicates"] == 25
        more = b.reports(st, 400)  # grows past 1.25 x: the restored state continues the segments
        assert b.batch(st, more).status_code == 200
        store.writer.submit(CallJob(lambda conn: (None, None))).result()
        again = store.record(st.study_id).state
        assert again.checkpointed == held + 400 and again.checkpoint_rowid == again.last_rowid
        # a checkpoint as servers before issue 46 wrote it (the base in the totals row) still loads
        def legacy(conn):
            seq = record.seq
            first = conn.execute("SELECT last_rowid, ids, rowids FROM checkpoint_segments WHERE study = ? "
                                 "ORDER BY last_rowid LIMIT 1", (seq,)).fetchone()
            conn.execute("UPDATE checkpoints SET ids = ?, rowids = ? WHERE study = ?", (first[1], first[2], seq))
            conn.execute("DELETE FROM checkpoint_segments WHERE study = ? AND last_rowid = ?", (seq, first[0]))
            return None, None
        store.writer.submit(CallJob(legacy)).result()
        store.record(st.study_id).state = None
        old_layout = store.ensure_state(store.record(st.study_id))
        assert old_layout.checkpointed == held + 400 and old_layout.ids == again.ids
        assert np.array_equal(old_layout.aggregate, again.aggregate) and old_layout.last_rowid == again.last_rowid
    finally:
        b.close()


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


@BOTH_STORES
def test_one_group_keeps_requests_independent(server: Server, study: Study):
    """Requests queued behind a busy writer run as one transaction; each is still judged on its
    own against what the requests before it stored (duplicate, conflict, capacity)."""
    import threading

    from dpsketch.services.writer import CallJob

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


def test_large_requests_in_one_group_are_checked_on_their_sorted_ids(server: Server, study: Study):
    """Large requests (a worker sorted their ids: idsets.SortedIds) queued in one group are
    checked against each other on those arrays, not on sets (writer._overlap): a request that
    repeats another's ids with the same bytes is acknowledged as duplicates and stores nothing
    twice, one that repeats an id with other bytes is refused whole, one with an id twice in
    itself counts it once, and the rest are stored whole; the totals are the exact sketch of
    what is held."""
    import threading

    from dpsketch.services import idsets
    from dpsketch.services.writer import CallJob

    store = server.app.state.store
    record = store.record(study.study_id)
    m = 300
    a_ids, b_ids, c_ids = new_ids(m), new_ids(m), new_ids(m)
    a, b, c = random_shares(m), random_shares(m), random_shares(m)
    # d: half of a's reports again, same bytes, and half new
    d_ids, d = a_ids[:150] + new_ids(150), np.vstack([a[:150], random_shares(150)])
    # e: one of b's ids with other bytes (refused whole)
    e_ids, e = new_ids(m - 1) + [b_ids[7]], np.vstack([random_shares(m - 1), b[7:8] ^ np.uint64(1)])
    # f: an id twice in itself, same bytes (counted once)
    f_base = new_ids(m - 1)
    f_ids, f = f_base + [f_base[3]], np.vstack([(fb := random_shares(m - 1)), fb[3:4]])
    jobs = [(a_ids, a), (b_ids, b), (d_ids, d), (e_ids, e), (f_ids, f), (c_ids, c)]

    def sorted_of(ids):
        return idsets.SortedIds(b"".join(ids))

    gate = threading.Event()
    blocker = store.writer.submit(CallJob(lambda conn: (gate.wait(10), None)))
    futures = [store.submit_upload(record, ids, shares, sorted_ids=sorted_of(ids)) for ids, shares in jobs]
    gate.set()
    blocker.result(10)
    got = []
    for future in futures:
        try:
            r = future.result(10)
            got.append((r.accepted, r.duplicates))
        except Exception as exc:  # noqa: BLE001 - the refusal's slug is the answer
            got.append(getattr(exc, "slug", repr(exc)))
    assert got == [(m, 0), (m, 0), (150, 150), "report-conflict", (m - 1, 1), (m, 0)]
    held_ids = a_ids + b_ids + d_ids[150:] + f_base + c_ids
    held_shares = np.vstack([a, b, d[150:], fb, c])
    assert server.count(study) == len(held_ids)
    assert server.held_ids(study) == b"".join(sorted(held_ids))
    assert np.array_equal(record.state.aggregate, expected_aggregate(study, held_ids, held_shares))


def test_a_group_of_single_uploads_is_judged_as_request_by_request(tmp_path, monkeypatch):
    """The writer checks a group of small requests to one study at once when all of them are
    accepted whole (Writer._plan_singles); whatever the group holds, every request gets the
    answer, and the store the reports, that judging them one by one (Writer._plan) gives. Two
    stores take the same groups, one of them with the group check switched off; the groups
    probe each limit: a held id, an id twice in the group, a conflict, the study's capacity
    and an upload token's quota, just inside and just past each."""
    import threading

    from dpsketch.services.writer import CallJob, Writer
    from dpsketch.services.auth import digest_of

    st = make_study(max_reports=110)
    taken = []
    plan_singles = Writer._plan_singles

    def spy(self, group, budget):
        plans = plan_singles(self, group, budget)
        taken.append(plans is not None)
        return plans

    monkeypatch.setattr(Writer, "_plan_singles", spy)
    servers = [Server(tmp_path / "grouped.sqlite3"), Server(tmp_path / "one-by-one.sqlite3")]
    try:
        tokens = []
        for srv in servers:
            assert srv.provision(st).status_code == 201
            r = srv.client.post(f"/v1/studies/{st.study_id}/upload-tokens", json={"count": 1, "quota": 12},
                                headers=bearer(OP))
            assert r.status_code == 201, r.text
            tokens.append(digest_of(r.json()["token"]))
        servers[1].app.state.store.writer._plan_singles = lambda group, budget: None

        def run(group: list[tuple[list[bytes], np.ndarray, bool]]) -> list[list]:
            """The same group through both stores, each behind a blocked writer: the answers."""
            answers = []
            for srv, token in zip(servers, tokens):
                store = srv.app.state.store
                record = store.record(st.study_id)
                gate = threading.Event()
                blocker = store.writer.submit(CallJob(lambda conn, gate=gate: (gate.wait(10), None)))
                futures = [store.submit_upload(record, ids, shares, token=token if tokened else None)
                           for ids, shares, tokened in group]
                gate.set()
                blocker.result(10)
                out = []
                for future in futures:
                    try:
                        out.append(future.result(10).model_dump())
                    except Exception as exc:  # noqa: BLE001 - the refusal's slug is the answer
                        out.append(getattr(exc, "slug", repr(exc)))
                answers.append(out)
            return answers

        def singles(m: int, tokened: bool = False) -> list[tuple[list[bytes], np.ndarray, bool]]:
            return [([rid], share[None, :], tokened) for rid, share in zip(new_ids(m), random_shares(m))]

        held = singles(20)
        groups = {
            "all new": held,
            "a held id, same bytes": singles(3) + [held[4]] + singles(2),
            "a held id, other bytes": singles(2) + [(held[5][0], held[5][1] ^ np.uint64(1), False)],
            "an id twice": (lambda g: g + [g[1]])(singles(4)),
            "two ids a request": [(ids + more, np.vstack([s, t]), False)
                                  for (ids, s, _), (more, t, _) in zip(singles(3), singles(3))],
            "the token's quota exactly": singles(12, tokened=True),
            "past the token's quota": singles(2, tokened=True),
        }
        for name, group in groups.items():
            grouped, one_by_one = run(group)
            assert grouped == one_by_one, name
        room = st.max_reports - servers[0].count(st)
        assert room > 2
        grouped, one_by_one = run(singles(room + 2))  # the study's capacity within the group
        assert grouped == one_by_one
        assert [a if isinstance(a, str) else "ok" for a in grouped] == ["ok"] * room + ["capacity-exceeded"] * 2
        assert servers[0].held_ids(st) == servers[1].held_ids(st)
        assert np.array_equal(servers[0].totals(st), servers[1].totals(st))
        assert servers[0].count(st) == st.max_reports
    finally:
        for srv in servers:
            srv.close()
    # the group check took the clean groups and a group holding a re-send of the same bytes (the
    # stored copy compared in one pass, issue 46), and handed on every other one
    assert taken == [True, True, False, False, True, True, False, False], taken


def test_fast_path_singles_are_bound_as_a_group_and_only_the_unbound_refused(server: Server, study: Study):
    """The fast path hands single reports to the writer before their binding is checked; the
    writer checks a group's at once (Writer._bind_singles). An adversary's records in the group
    (a substituted share, a substituted proof, a held report's id with a forged share) are
    refused alone with writer.Unbound and store nothing; every bound one is stored exactly once
    and the totals are those of the bound ones; a request cancelled before the writer began is
    not stored."""
    import asyncio
    import threading

    from dpsketch.services.writer import CallJob, Unbound

    store = server.app.state.store
    record = store.record(study.study_id)
    held = server.reports(study, 2)
    assert server.batch(study, held).status_code == 200
    good = server.reports(study, 6)
    forged_share = server.reports(study, 1).substituted(0, "share", 5)
    forged_proof = server.reports(study, 1).substituted(0, "proof", 3)
    replay = held[0]
    replay.shares = replay.shares ^ np.uint64(7)  # a held id under another share, proof unchanged
    cancelled = server.reports(study, 1)

    def fields(r: Reports, i: int = 0) -> tuple[bytes, bytes, bytes]:
        return r.ids[i], r.proofs[i].tobytes(), r.shares[i].astype("<u8").tobytes()

    async def run():
        loop = asyncio.get_running_loop()
        gate = threading.Event()
        blocker = store.writer.submit(CallJob(lambda conn: (gate.wait(10), None)))
        order = ([fields(good, 0), fields(forged_share), fields(good, 1), fields(forged_proof)]
                 + [fields(good, i) for i in range(2, 6)] + [fields(replay), fields(held, 1)])
        waiters = [loop.create_future() for _ in order]
        for f, waiter in zip(order, waiters):
            store.submit_single(record, *f, None, waiter)
        gone = store.submit_single(record, *fields(cancelled), None, loop.create_future())
        assert gone.future.cancel()
        gate.set()
        await asyncio.wrap_future(blocker)
        return await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 10)

    outcomes = asyncio.run(run())
    kinds = ["unbound" if isinstance(o, Unbound) else (o.accepted, o.duplicates) for o in outcomes]
    assert kinds == [(1, 0), "unbound", (1, 0), "unbound", (1, 0), (1, 0), (1, 0), (1, 0), "unbound", (0, 1)]
    assert server.count(study) == 8
    stored = held.ids + good.ids
    assert server.held_ids(study) == b"".join(sorted(stored))
    assert np.array_equal(record.state.aggregate,
                          expected_aggregate(study, stored, np.vstack([held.shares, good.shares])))


# --- nothing a client sends gets a 500 ---------------------------------------------------------


@BOTH_STORES
def test_no_request_gets_a_server_error(server: Server, study: Study):
    """A small deterministic fuzz over every route: odd bodies, media types and tokens."""
    server.batch(study, server.reports(study, 3))
    sid = study.study_id
    paths = ["/healthz", "/v1/info", "/v1/studies", f"/v1/studies/{sid}", f"/v1/studies/{sid}/reports",
             f"/v1/studies/{sid}/batches", f"/v1/studies/{sid}/report-ids", f"/v1/studies/{sid}/commit",
             f"/v1/studies/{sid}/aggregate", "/v1/studies/%00", "/v1/studies/" + "a" * 5000 + "/commit",
             f"/v1/studies/{sid}/shares", f"/v1/studies/{sid}/upload-tokens",
             f"/v1/studies/{sid}/upload-tokens/{'0' * 16}"]
    good = server.reports(study, 2)
    bodies = [b"", b"null", b"{}", b"[]", b"\xff\xfe\x00", b'{"report_id": null}', b"1e999", b'"x"' * 10,
              study.canonical(), study.canonical().replace(b'"k":8', b'"k":1e999'),
              study.canonical().replace(b'"lambda_star":', b'"lambda_star":1e999,"x":'),
              study.canonical().replace(b'"sigma":', b'"sigma":-0.0,"y":'), os.urandom(16 * 7), os.urandom(40),
              os.urandom(72 * 2), os.urandom(80 * 2),  # whole share / seed records, bound to nothing
              good.body(), good.substituted(1).body(), Report.of(good.ids[0], good.proofs[0],
                                                                 good.shares[0]).model_dump_json().encode(),
              b'{"count": 0}', b'{"count": 2, "quota": null}', b'{"quota": -1}']
    types = [None, "application/json", SHARES_MEDIA_TYPE, SEEDS_MEDIA_TYPE, SEALED_MEDIA_TYPE,
             REPORT_IDS_MEDIA_TYPE, "text/plain; charset=utf-8", "application/json; charset=latin-1",
             "multipart/form-data; boundary=x"]
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


def kernels_reference(kernel):
    """A stand-in for a kernels.Kernel that is never available (its reference code serves)."""
    from dpsketch.protocol import kernels

    off = kernels.Kernel(kernel.module, kernel.what)
    off.disable()
    return off


@pytest.mark.parametrize("engine", ["reference", "compiled"])
@pytest.mark.parametrize("presorted", [False, True], ids=["writer-sorts", "worker-sorted"])
def test_report_index_is_exact_against_a_dict(presorted, engine, monkeypatch):
    """services/idsets.ReportIndex answers as a dict would through single additions (its recent
    buffer), bulk runs, merges (numpy's or the compiled loop's) and a restore, also where crafted
    ids share a 64-bit prefix; and so it does with batches sorted beforehand (idsets.SortedIds,
    as a server's worker sorts them)."""
    from dpsketch.services import idsets
    from dpsketch.services.idsets import ReportIndex, join_halves

    if engine == "reference":
        monkeypatch.setattr(idsets, "MERGE", kernels_reference(idsets.MERGE))
    else:
        assert idsets.MERGE.warm_up()

    rng = np.random.default_rng(7)
    prefix = os.urandom(8)
    crafted = [prefix + os.urandom(8) for _ in range(300)]  # one shared high half
    near = [prefix[:7] + bytes([prefix[7] ^ 1]) + os.urandom(8)]  # the next high half
    pool = new_ids(20_000) + crafted + near
    order = rng.permutation(len(pool)).tolist()
    pool = [pool[i] for i in order]
    index, reference, rowid, at = ReportIndex(), {}, 1, 0
    sizes = [1, 1, 3, 70, 1500, 1, 64, 65, 600] * 5  # 11525 of the 20301 ids
    for m in sizes:
        part = pool[at:at + m]
        at += m
        given = idsets.SortedIds(b"".join(part)) if presorted else None
        index.add(b"".join(part), list(range(rowid, rowid + len(part))), part, given)
        reference.update(zip(part, range(rowid, rowid + len(part))))
        rowid += len(part)
        probe = part + pool[at:at + 50] + [prefix + os.urandom(8), prefix + b"\x00" * 8]
        probe_sorted = idsets.SortedIds(b"".join(probe)) if presorted else None
        assert index.lookup(b"".join(probe), None, probe_sorted).tolist() == [reference.get(r, -1) for r in probe]
        assert index.any_held(b"".join(probe[len(part):-2]), None, None) == any(r in reference for r in probe[len(part):-2])
        assert len(index) == len(reference)
    assert index._runs or index._recent, "the test must exercise unmerged runs"
    held = list(reference)
    probe = held[::7] + pool[at:]
    assert index.lookup(b"".join(probe)).tolist() == [reference.get(r, -1) for r in probe]
    assert all(index.get(r) == reference[r] for r in held[:500]) and pool[-1] not in index
    # one id at a time (the scalar path of single uploads), crafted ones included
    for rid in crafted + near + [prefix + b"\x00" * 8, prefix + b"\xff" * 8]:
        assert index.get(rid) == reference.get(rid)
        assert index.lookup(rid + held[0]).tolist() == [reference.get(rid, -1), reference[held[0]]]
    # a commit's match: exactly the included ones found, the others excluded (ascending by id)
    included = sorted(held[100:] + pool[at:at + 3])
    hi, lo = idsets.halves(b"".join(included))
    rowid_of, excluded = index.match(hi, lo)
    assert rowid_of.tolist() == [reference.get(r, -1) for r in included]
    assert excluded.tolist() == [reference[r] for r in sorted(held[:100])]
    # sorted() is every id ascending; restore() round-trips it and refuses repeats
    s_hi, s_lo, s_rowid = index.sorted()
    assert join_halves(s_hi, s_lo) == b"".join(sorted(held))
    assert s_rowid.tolist() == [reference[r] for r in sorted(held)]
    again = ReportIndex()
    shuffled = rng.permutation(len(s_hi))
    assert again.restore(s_hi[shuffled], s_lo[shuffled], s_rowid[shuffled]) and again == index
    twice = np.concatenate([s_hi[:5], s_hi[:1]]), np.concatenate([s_lo[:5], s_lo[:1]])
    assert not again.restore(*twice, np.arange(6)) and again == index
    # same first 8 bytes, different last 8: never confused
    a, b = b"\x01" * 8 + b"\x00" * 8, b"\x01" * 8 + b"\xff" * 8
    small = ReportIndex()
    small.add(a, [1], [a])
    assert small.lookup(a + b).tolist() == [1, -1]
    assert ReportIndex().lookup(a).tolist() == [-1]


def test_report_index_filter_answers_most_new_ids_from_one_bit(monkeypatch):
    """The index's prefix filter (services/idsets._Filter) never says "not held" of a held id,
    says "maybe" of at most about 1/16 of new ids at every size as it grows (measured on 20,000
    fresh ids per step), takes 2-8 bytes per held id, and so a batch of new ids is searched in
    the runs only for those few; ids crafted to share held prefixes are still answered exactly
    (they cost searches)."""
    from dpsketch.services import idsets
    from dpsketch.services.idsets import ReportIndex

    rng = np.random.default_rng(11)
    index, rowid, held = ReportIndex(), 1, []
    searched = []
    find = idsets._Run.find
    monkeypatch.setattr(idsets._Run, "find", lambda run, hi, lo: searched.append(len(hi)) or find(run, hi, lo))
    for m in [5000, 20_000, 40_000, 80_000, 120_000]:
        part = rng.bytes(16 * m)
        index.add(part, np.arange(rowid, rowid + m), None, idsets.SortedIds(part))
        held.append(part)
        rowid += m
        n = len(index)
        every = b"".join(held)
        assert bool(np.all(index._filter.maybe(idsets.halves(every)[0]))), "a held id's bit is clear"
        fresh = rng.bytes(16 * 20_000)
        rate = float(np.mean(index._filter.maybe(idsets.halves(fresh)[0])))
        assert rate <= 0.075, (n, rate)  # 1/16 = 0.0625 at worst; 20,000 samples: sd 0.0017
        bits_per_id = 8 * index._filter.bits.nbytes / n
        assert 16 <= bits_per_id <= 64, (n, bits_per_id)
        searched.clear()
        assert not bool(np.any(index.lookup(fresh, None, idsets.SortedIds(fresh)) >= 0))
        runs = 1 + len(index._runs)
        assert sum(searched) <= 0.1 * 20_000 * runs, (searched, runs)
    # ids sharing the high half of held ones (their bits set): searched, and answered exactly
    some = np.frombuffer(held[0], dtype=np.uint8).reshape(-1, 16)[:500]
    crafted = b"".join(bytes(r[:8]) + os.urandom(8) for r in some)
    searched.clear()
    assert index.lookup(crafted).tolist() == [-1] * 500
    assert sum(searched) >= 500
    again = held[0][:16 * 500]
    assert index.lookup(again).tolist() == list(range(1, 501))


@pytest.mark.parametrize("engine", ["reference", "compiled"])
def test_report_index_merge_by_insertion_equals_the_sort(monkeypatch, engine):
    """Runs merge into the same run the stable sort of both gives (ids, rowids and the
    crafted-ties flag): by the compiled merge (services/_index_kernel.py) where it is loaded;
    by numpy otherwise, runs past idsets._INSERT_FROM ids by insertion and a high half held by
    both runs (crafted) by the sort, which still orders those ids by their low half."""
    from dpsketch.services import idsets

    merge = idsets.MERGE
    if engine == "reference":
        monkeypatch.setattr(idsets, "MERGE", kernels_reference(merge))
    else:
        assert merge.warm_up(), "numba should compile the index's merge here"
    rng = np.random.default_rng(5)

    def run(n: int, hi=None) -> idsets._Run:
        hi = rng.integers(0, 2**64, n, dtype=np.uint64) if hi is None else hi
        return idsets._Run(hi, rng.integers(0, 2**64, len(hi), dtype=np.uint64), rng.permutation(10**7)[:len(hi)])

    big, small = run(450_000), run(150_000)
    assert len(big) + len(small) >= idsets._INSERT_FROM
    sorted_ = idsets._concatenated([big, small])
    sorts = []
    concatenated = idsets._concatenated
    monkeypatch.setattr(idsets, "_concatenated", lambda runs: sorts.append(len(runs)) or concatenated(runs))
    merged = idsets._merge([small, big])
    assert sorts == [] and not merged.ties  # inserted (or merged by the loop), not sorted
    for a, b in ((merged.hi, sorted_.hi), (merged.lo, sorted_.lo), (merged.rowid, sorted_.rowid)):
        assert np.array_equal(a, b)
    assert bool(np.all(merged.hi[1:] >= merged.hi[:-1]))
    # crafted: one high half in both runs, different low halves
    shared = small.hi.copy()
    shared[7] = big.hi[1234]
    crafted = run(0, hi=np.sort(shared))
    both = idsets._merge([big, crafted])
    assert sorts == ([2] if engine == "reference" else []) and both.ties and len(both) == len(big) + len(crafted)
    at = np.flatnonzero(both.hi == big.hi[1234])
    assert len(at) == 2 and both.lo[at[0]] < both.lo[at[1]]
    assert idsets.strictly_ascending(both.hi, both.lo)


def test_commit_with_ids_sharing_a_prefix(server: Server):
    """Crafted ids with a common 64-bit prefix take the exact path and give the same answers.

    Such ids cannot come through the API any more (an id is a SHA-256 commitment to the report's
    shares: finding 110 with a common 64-bit prefix is 2^64 work), so they go straight to the
    store, as the writer receives every upload after its binding was checked."""
    study = make_study(min_reports=LOW_MIN)  # it commits 125 fresh ids: LOW_MIN
    assert server.provision(study).status_code == 201
    prefix = os.urandom(8)
    ids = [prefix + os.urandom(8) for _ in range(110)] + new_ids(20)
    shares = random_shares(len(ids))
    store = server.app.state.store
    result = store.submit_upload(store.record(study.study_id), ids, shares).result(30)
    assert result.accepted == len(ids)
    assert_problem(server.commit(study, ids[:105] + [prefix + b"\x00" * 8]), 422, "unknown-reports")
    r = server.commit(study, ids[5:])
    assert r.status_code == 200, r.text
    got = decode_aggregate(server.aggregate(study).content, study.k, study.d)
    assert np.array_equal(got, expected_aggregate(study, ids[5:], shares[5:]))


@pytest.mark.parametrize("warm_start", [True, False])
def test_warm_start_imports_the_privacy_accounting_before_any_study(tmp_path: Path, warm_start: bool):
    """A store that warms up imports what checking a study needs in the background at startup,
    so a fresh server's first provisioning does not wait for it (measured: 1.14 s -> 0.15 s):
    the secret-sign accounting (and scipy's special functions) at once, dp-accounting (and the
    scipy.stats it pulls in: 1.4-2.1 s of CPU)
    only once no request has arrived for WARM_WHEN_IDLE_S, so a server started into work does not
    spend its first seconds on it. One that does not warm up imports nothing until a study needs
    it. In a fresh process, since this one has imported everything long ago; the idle time is
    set to 30 s there, so that requests noted every 50 ms keep it busy however loaded the machine."""
    import subprocess
    import sys

    code = f"""
import sys, threading, time
from dpsketch.services import store as store_module
from dpsketch.services.settings import Settings
from dpsketch.services.store import Store
store_module.WARM_WHEN_IDLE_S = 30.0
store = Store(Settings(server_id="s1", db_path={str(tmp_path / "w.sqlite3")!r}, operator_token="o" * 20,
                       analyst_token="a" * 20, warm_start={warm_start}))
busy_until, deadline = time.monotonic() + 3, time.monotonic() + 60
# requests keep arriving: for 3 s, and (warming up) until the secret-sign accounting is imported
while time.monotonic() < busy_until or ({warm_start} and "dpsketch.protocol.secret_sign" not in sys.modules
                                         and time.monotonic() < deadline):
    store.note_request()
    time.sleep(0.05)
print("dpsketch.protocol.secret_sign" in sys.modules, "dp_accounting" in sys.modules)
store.last_request_at -= 60  # then none for a minute
deadline = time.monotonic() + 60
while any(t.name == "dpsketch-warm" for t in threading.enumerate()) and time.monotonic() < deadline:
    time.sleep(0.05)
print("dp_accounting" in sys.modules, "dp_accounting.pld" in sys.modules)
store.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    busy, idle = out.stdout.splitlines()
    assert busy.split() == [str(warm_start), "False"]  # busy: scipy's optimize only
    assert idle.split() == [str(warm_start)] * 2  # idle: dp-accounting too
