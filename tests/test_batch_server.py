"""Share servers take batch proofs (docs/protocol.md sections 4d and 6d, issue 40): three real
share servers (uvicorn processes on loopback ports, real SQLite files), records made by the core
(``batch_validity.prove``, ``batch_records.records``) posted as raw bodies with httpx, and the
verification round driven here through the servers' four verify routes, the verifier shares
summed in this process with ``batch_verifiers`` (the analyzer's side is written elsewhere).

* An honest batch (m = 50, w = 4) is accepted at every server, its rows are held (report ids,
  counts) beside per-report validity records, and the round decides it true everywhere; a forged
  batch (its leader's proof share tampered after proving, which no binding covers) is stored
  everywhere and refused at every server, all 50 rows in the refused set, and a commit holding
  them is refused 422 report-refused. The query's report section holds the per-report records
  only, its batch section both batches. Malformed decisions (an unknown batch, a wrong m or V,
  batch ids descending, a body cut short, a batch's row in the report section) are refused and
  change nothing.
* The same batch again is a duplicate (counted once, its token not charged again); the same
  batch id with other bytes is 409 report-conflict; an upload token's quota counts m rows;
  a study without batch_proofs answers 415; a short body and a wrong N are 400; ``max_reports``
  counts rows (409); a batch after the round began is 409 uploads-closed; nothing is stored on a
  refusal and no answer is a 500.
* A server SIGKILLed after acknowledging a batch comes back holding its rows and the round
  still decides it, and a commit leaving out 5 of its 60 rows releases exactly the sketch of the
  other 55 (totals rebuilt from the stored records, single rows taken out of them); at unit
  level, totals restored from a checkpoint plus a record stored after it are exactly the rows'
  split-word sums; on SQLite and on PostgreSQL, one server whose two peers are simulated here.

Nothing here is random but the round's contributions (the servers' CSPRNG): an honest batch is
accepted at every query point (the proof is complete), a forged one refused except with the
FLP's soundness error (below 2^-100), so no test fails with probability near 10^-4.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import BOTH_STORES, OPEN_UPLOADS, Servers
from dpsketch.protocol import batch_records, batch_validity, batch_verifiers, field, messages, proved_shares, sketch
from dpsketch.protocol import report as report_path
from dpsketch.protocol import validity as V
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.study import Study, design
from dpsketch.protocol.verification import DECIDED_HEADER, REFUSED_HEADER, VERIFIERS_MEDIA_TYPE
from dpsketch.client_sdk import prepare
from dpsketch.tools.cluster import share_server, start_all
from test_e2e import NO_FLOOR_POLICY

SERVERS = ["s1", "s2", "s3"]
M = 50


class Trio:
    """Three real share servers (open uploads, no floor required)."""

    def __init__(self, workdir: Path):
        self.pool = Servers(workdir)
        self.specs = [self.pool.spec(s) for s in SERVERS]
        self.procs = [share_server(spec, workdir, {**OPEN_UPLOADS, **NO_FLOOR_POLICY}) for spec in self.specs]
        self.pool.started.extend(self.procs)
        start_all(self.procs)

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.procs]

    @property
    def analysts(self) -> list[str]:
        return [s.analyst_token for s in self.specs]

    def provision(self, study: Study) -> None:
        for spec, url in zip(self.specs, self.urls):
            r = httpx.put(f"{url}/v1/studies/{study.study_id}", content=study.canonical(), timeout=60,
                          headers={"Authorization": f"Bearer {spec.operator_token}",
                                   "Content-Type": "application/json"})
            assert r.status_code == 201, r.text

    def held(self, j: int, study: Study) -> set[bytes]:
        r = httpx.get(f"{self.urls[j]}/v1/studies/{study.study_id}/report-ids", timeout=30,
                      headers={"Authorization": f"Bearer {self.analysts[j]}"})
        assert r.status_code == 200, r.text
        return set(messages.decode_report_ids(r.content))

    def count(self, j: int, study: Study) -> int:
        r = httpx.get(f"{self.urls[j]}/v1/studies/{study.study_id}", timeout=30,
                      headers={"Authorization": f"Bearer {self.analysts[j]}"})
        return r.json()["report_count"]


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    t = Trio(tmp_path_factory.mktemp("batch-server"))
    try:
        yield t
    finally:
        t.pool.stop_all()


def make_study(name: str, **kw) -> Study:
    args = dict(expected_reports=200, min_reports=50, batch_proofs=True) | kw
    return design(name=name, columns=["x1", "x2", "x3", "y"], label="y", servers=SERVERS,
                  seed=hashlib.sha256(name.encode()).hexdigest(), validity=True, epsilon_floor=None, **args)[0]


def units(study: Study, m: int, seed: int) -> np.ndarray:
    """m rows in grid units inside the study's bound (||u||^2 <= R2)."""
    r2 = batch_validity.study_plan(study, m).circuit.r2
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, study.width))
    x *= 0.9 * np.sqrt(r2) / np.linalg.norm(x, axis=1).max()
    return np.trunc(x).astype(np.int64)


def label_units(study: Study, m: int, label: str) -> np.ndarray:
    return units(study, m, int.from_bytes(hashlib.sha256(label.encode()).digest()[:4], "little"))


def proved(study: Study, m: int, label: str, leader: int) -> tuple[batch_validity.BatchPlan, batch_validity.ProvedBatch]:
    plan = batch_validity.study_plan(study, m)
    key = hashlib.sha256(label.encode()).digest()
    return plan, batch_validity.prove(plan, label_units(study, m, label), Keystream.from_key(key), leader=leader)


def row_ids(plan, batch: batch_validity.ProvedBatch) -> set[bytes]:
    c = plan.circuit
    bid = batch_validity.batch_id(batch_validity.wrap_seed(plan, batch.parts), batch.digits_part)
    return {bytes(r) for r in batch_validity.row_ids(bid, c.m)}


def post(url: str, study: Study, media_type: str, body: bytes, token: str | None = None) -> httpx.Response:
    headers = {"Content-Type": media_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body, headers=headers, timeout=120)


def upload(trio: Trio, study: Study, plan, batch) -> list[httpx.Response]:
    return [post(url, study, media, body) for url, (media, body) in zip(trio.urls, batch_records.records(plan, batch))]


def problem(r: httpx.Response, status: int, slug: str) -> None:
    assert r.status_code == status and r.json()["type"] == f"urn:dpsketch:problem:{slug}", r.text


def per_report(study: Study, n: int, seed: int) -> V.Proved:
    """n honest per-report validity records (the SDK's path), the leader last."""
    rows = np.random.default_rng(seed).normal(0, 0.3, (n, study.d))
    stream = Keystream.from_key(bytes([seed]) * 32)
    encoded = report_path.noisy_encoded(prepare.signed_vectors(rows, study, stream), study, stream)
    return V.prepare(study, encoded, stream, full=2)


def upload_reports(trio: Trio, study: Study, p: V.Proved) -> None:
    for j, url in enumerate(trio.urls):
        if p.seeds[j] is None:
            body = messages.encode_batch(p.report_ids, p.binding[j], p.leader)
            media = messages.SHARES_MEDIA_TYPE
        else:
            body = messages.encode_seed_batch(p.report_ids, p.binding[j], p.seeds[j])
            media = messages.SEEDS_MEDIA_TYPE
        r = post(url, study, media, body)
        assert r.status_code == 200, r.text


def step(trio: Trio, j: int, study: Study, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{trio.urls[j]}/v1/studies/{study.study_id}/verify/{path}", timeout=120,
                      headers={"Authorization": f"Bearer {trio.analysts[j]}", **kw.pop("headers", {})}, **kw)


def query(trio: Trio, study: Study) -> list[httpx.Response]:
    """The round's commit, reveal and query at every server: the query answers."""
    commitments = [step(trio, j, study, "commit").json()["commitment"] for j in range(3)]
    contributions = [step(trio, j, study, "reveal", json={"commitments": commitments}).json()["contribution"]
                     for j in range(3)]
    answers = [step(trio, j, study, "query", json={"contributions": contributions}) for j in range(3)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return answers


def sections(study: Study, body: bytes):
    """(report ids, report shares, batch entries by id) of a query's answer."""
    report, batch = batch_verifiers.split(body, V.verifier_len(study))
    ids, shares = V.decode_verifiers(report, V.verifier_len(study))
    return ids, shares, {e.batch_id: e for e in batch_verifiers.decode(batch, 1 << 20)}


def others(study: Study, decoded: list, j: int) -> bytes:
    """Server j's decision body: the others' report shares and batch shares, summed mod p."""
    ids = decoded[0][0]
    rest = [d for i, d in enumerate(decoded) if i != j]
    total = rest[0][1]
    for d in rest[1:]:
        total = V.add_verifiers(total, d[1])
    entries = []
    for bid, e in rest[0][2].items():
        share = e.share
        for d in rest[1:]:
            share = field.add(share, d[2][bid].share)
        entries.append(batch_verifiers.BatchVerifier(bid, e.m, share))
    return V.encode_verifiers(ids, total) + batch_verifiers.encode(entries)


def decide(trio: Trio, j: int, study: Study, body: bytes) -> httpx.Response:
    return step(trio, j, study, "decide", content=body, headers={"Content-Type": VERIFIERS_MEDIA_TYPE})


def test_an_honest_batch_is_decided_true_and_a_forged_one_refused_everywhere(trio):
    study = make_study("round")
    trio.provision(study)
    reports = per_report(study, 10, seed=7)
    upload_reports(trio, study, reports)
    plan, good = proved(study, M, "honest", leader=0)
    _, bad = proved(study, M, "forged", leader=1)
    bad.leader_proof = field.add(bad.leader_proof, np.uint64(1))  # no binding covers it: stored everywhere
    for batch, rows_before in ((good, 10), (bad, 10 + M)):
        answers = upload(trio, study, plan, batch)
        assert [a.json() for a in answers] == [{"accepted": M, "duplicates": 0, "report_count": rows_before + M}] * 3
    good_rows, bad_rows = row_ids(plan, good), row_ids(plan, bad)
    report_ids = set(reports.report_ids)
    assert all(trio.held(j, study) == report_ids | good_rows | bad_rows for j in range(3))

    answers = query(trio, study)
    assert {a.headers[DECIDED_HEADER] for a in answers} == {str(10 + 2 * M)}
    _, late = proved(study, 5, "late", leader=0)  # the round closed the study to batches too
    late_record = batch_records.records(batch_validity.study_plan(study, 5), late)[0]
    problem(post(trio.urls[0], study, *late_record), 409, "uploads-closed")
    decoded = [sections(study, a.content) for a in answers]
    good_id = batch_validity.batch_id(batch_validity.wrap_seed(plan, good.parts), good.digits_part)
    bad_id = batch_validity.batch_id(batch_validity.wrap_seed(plan, bad.parts), bad.digits_part)
    for ids, _shares, entries in decoded:  # the report section: per-report records only
        assert {bytes(r) for r in ids} == report_ids
        assert set(entries) == {good_id, bad_id} and {e.m for e in entries.values()} == {M}
        assert {e.verifier_len for e in entries.values()} == {plan.circuit.verifier_len}

    # malformed decisions change nothing: an unknown batch, a wrong V, a body cut short
    body = others(study, decoded, 0)
    report_part, _ = batch_verifiers.split(body, V.verifier_len(study))
    entry = decoded[1][2][good_id]
    unknown = report_part + batch_verifiers.encode([batch_verifiers.BatchVerifier(b"\xff" * 16, M, entry.share)])
    problem(decide(trio, 0, study, unknown), 422, "unknown-reports")
    wrong_v = report_part + batch_verifiers.encode([batch_verifiers.BatchVerifier(good_id, M, entry.share[:-1])])
    problem(decide(trio, 0, study, wrong_v), 400, "malformed-body")
    wrong_m = report_part + batch_verifiers.encode([batch_verifiers.BatchVerifier(good_id, M + 1, entry.share)])
    problem(decide(trio, 0, study, wrong_m), 400, "malformed-body")
    problem(decide(trio, 0, study, body[:-8]), 400, "malformed-body")
    first, second = sorted(decoded[1][2].values(), key=lambda e: e.batch_id)
    descending = len(decoded[1][2]).to_bytes(4, "little") + batch_verifiers.encode([second])[4:] \
        + batch_verifiers.encode([first])[4:]
    problem(decide(trio, 0, study, report_part + descending), 400, "malformed-body")
    named = sorted(report_ids | {min(good_rows)})  # a batch's row in the report section: no report
    as_reports = V.encode_verifiers(np.frombuffer(b"".join(named), dtype=np.uint8).reshape(-1, 16),
                                    np.zeros((len(named), V.verifier_len(study), 2), dtype=np.uint64))
    problem(decide(trio, 0, study, as_reports + batch_verifiers.encode([])), 422, "unknown-reports")

    refused = []
    for j in range(3):
        r = decide(trio, j, study, others(study, decoded, j))
        assert r.status_code == 200, r.text
        assert r.headers[DECIDED_HEADER] == str(10 + 2 * M) and r.headers[REFUSED_HEADER] == str(M)
        refused.append(set(messages.decode_report_ids(r.content)))
    assert refused == [bad_rows] * 3  # the forged batch whole, nothing else
    everything = messages.encode_report_ids(sorted(report_ids | good_rows | bad_rows))
    for j in range(3):
        r = httpx.post(f"{trio.urls[j]}/v1/studies/{study.study_id}/commit", content=everything, timeout=60,
                       headers={"Authorization": f"Bearer {trio.analysts[j]}",
                                "Content-Type": messages.REPORT_IDS_MEDIA_TYPE})
        problem(r, 422, "report-refused")
        assert r.json()["refused"] == M and r.json()["undecided"] == 0


def test_duplicates_conflicts_quota_and_malformed_records(trio):
    study = make_study("uploads")
    trio.provision(study)
    leader_url = trio.urls[0]
    op = {"Authorization": f"Bearer {trio.specs[0].operator_token}"}
    r = httpx.post(f"{leader_url}/v1/studies/{study.study_id}/upload-tokens", json={"quota": M + 10}, headers=op,
                   timeout=120)
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    plan, batch = proved(study, M, "quota", leader=0)
    (lead_type, lead), (seed_type, seed_body) = batch_records.records(plan, batch)[:2]
    # refused before anything is stored: malformed, and 415 for a sealed or unknown kind
    problem(post(leader_url, study, lead_type, lead[:30], token), 400, "malformed-body")
    wrong_n = lead[:28] + (2).to_bytes(4, "little") + lead[32:]
    problem(post(leader_url, study, lead_type, wrong_n, token), 400, "malformed-body")
    problem(post(trio.urls[1], study, seed_type, seed_body + b"\x00"), 400, "malformed-body")
    problem(post(leader_url, study, seed_type, lead, token), 400, "malformed-body")  # the role is the leader's
    assert trio.count(0, study) == 0 and trio.count(1, study) == 0
    # the quota counts m rows, judged before the circuit: a batch of more rows than it has left
    _, big = proved(study, M + 20, "too many", leader=0)
    problem(post(leader_url, study, *batch_records.records(batch_validity.study_plan(study, M + 20), big)[0], token),
            403, "upload-quota-exceeded")
    assert trio.count(0, study) == 0
    first = post(leader_url, study, lead_type, lead, token)
    assert first.json() == {"accepted": M, "duplicates": 0, "report_count": M}, first.text
    again = post(leader_url, study, lead_type, lead, token)  # a duplicate: not charged again
    assert again.json() == {"accepted": 0, "duplicates": M, "report_count": M}, again.text
    # the same batch id with other bytes (a proof share changed: the parts do not cover it)
    conflict = lead[:-8] + field.to_wire(field.add(np.frombuffer(lead[-8:], dtype="<u8"), np.uint64(1)))
    problem(post(leader_url, study, lead_type, conflict, token), 409, "report-conflict")
    # a helper's seed record under the same batch id with other bytes: binding-refused (its part)
    r = post(trio.urls[1], study, seed_type, seed_body)
    assert r.json() == {"accepted": M, "duplicates": 0, "report_count": M}, r.text
    forged_seed = seed_body[:-1] + bytes([seed_body[-1] ^ 1])
    problem(post(trio.urls[1], study, seed_type, forged_seed), 422, "binding-refused")
    plan_small, small = proved(study, 10, "fits", leader=0)
    r = post(leader_url, study, *batch_records.records(plan_small, small)[0], token)
    assert r.json() == {"accepted": 10, "duplicates": 0, "report_count": M + 10}, r.text
    _, one_more = proved(study, 1, "over", leader=0)
    problem(post(leader_url, study, *batch_records.records(batch_validity.study_plan(study, 1), one_more)[0],
                 token), 403, "upload-quota-exceeded")
    assert trio.count(0, study) == M + 10 and trio.held(0, study) == row_ids(plan, batch) | row_ids(plan_small, small)
    # a study without batch_proofs: 415 for both record kinds, whatever the body
    plain = make_study("no batches", batch_proofs=False)
    trio.provision(plain)
    for media, body in batch_records.records(plan, batch)[:2]:
        problem(post(leader_url, plain, media, body), 415, "unsupported-media-type")
    assert trio.count(0, plain) == 0
    # max_reports counts rows too: 50 held of 60, a batch of 20 more is refused whole
    small_study = make_study("capacity", max_reports=60, expected_reports=60)
    trio.provision(small_study)
    plan_a, a = proved(small_study, M, "capacity a", leader=0)
    assert post(leader_url, small_study, *batch_records.records(plan_a, a)[0]).status_code == 200
    plan_b, b = proved(small_study, 20, "capacity b", leader=0)
    problem(post(leader_url, small_study, *batch_records.records(plan_b, b)[0]), 409, "capacity-exceeded")
    assert trio.count(0, small_study) == M


def test_a_server_killed_after_acknowledging_a_batch_holds_it_and_decides_it(trio):
    study = make_study("crash")
    trio.provision(study)
    plan, batch = proved(study, M + 10, "crash", leader=2)
    assert all(r.status_code == 200 for r in upload(trio, study, plan, batch))
    rows = row_ids(plan, batch)
    trio.procs[2].kill()  # the leader: its record is the shares, re-received after the restart
    trio.procs[0].kill()
    start_all([trio.procs[2], trio.procs[0]])
    assert all(trio.held(j, study) == rows for j in range(3)) and trio.count(2, study) == M + 10
    decoded = [sections(study, a.content) for a in query(trio, study)]
    assert all(len(d[0]) == 0 and len(d[2]) == 1 for d in decoded)
    trio.procs[1].kill()  # between query and decision: its own shares are recomputed, not kept
    trio.procs[1].start()
    for j in range(3):
        r = decide(trio, j, study, others(study, decoded, j))
        assert r.status_code == 200 and r.headers[REFUSED_HEADER] == "0", r.text
        assert r.headers[DECIDED_HEADER] == str(M + 10) and r.content == b""
    # a commit leaving out single rows (5 of 60, within the batch rule) releases exactly the rest:
    # the restarted servers rebuilt their totals from the records and take the 5 out of them
    ordered = sorted(rows)
    included = [rid for i, rid in enumerate(ordered) if i % 12 != 5]
    aggregates = []
    for j in range(3):
        auth = {"Authorization": f"Bearer {trio.analysts[j]}"}
        r = httpx.post(f"{trio.urls[j]}/v1/studies/{study.study_id}/commit", timeout=60,
                       content=messages.encode_report_ids(included),
                       headers={**auth, "Content-Type": messages.REPORT_IDS_MEDIA_TYPE})
        assert r.status_code == 200 and r.json()["n_reports"] == M + 5, r.text
        r = httpx.get(f"{trio.urls[j]}/v1/studies/{study.study_id}/aggregate", headers=auth, timeout=60)
        aggregates.append(messages.decode_aggregate(r.content, study.k, study.width))
    bid = batch_validity.batch_id(batch_validity.wrap_seed(plan, batch.parts), batch.digits_part)
    index = {bytes(r): i for i, r in enumerate(batch_validity.row_ids(bid, plan.circuit.m))}  # row i's id
    x = label_units(study, M + 10, "crash")[[index[rid] for rid in included]]
    expected = np.zeros((study.k, study.width), dtype=np.uint64)
    cells, signs = study.hash_report_ids(included)
    sketch.accumulate(expected, cells, signs, (x << plan.shift).astype(np.int64).view(np.uint64))
    np.testing.assert_array_equal(proved_shares.reconstruct(study, aggregates), expected)


@BOTH_STORES
def test_one_server_on_either_store_keeps_its_batches_across_a_crash_and_decides_them(servers):
    """One real server (position 0 of three; the other two simulated in this process, their
    verifier shares computed from their records at the round's query seed) on SQLite and on
    PostgreSQL: a batch it leads and one it helps are stored, a duplicate counted once, and after
    a SIGKILL and restart it holds both and decides both true."""
    study = make_study("either store")
    spec = servers.spec("s1")
    proc = servers.start(spec, NO_FLOOR_POLICY)
    r = httpx.put(f"{proc.url}/v1/studies/{study.study_id}", content=study.canonical(), timeout=60,
                  headers={"Authorization": f"Bearer {spec.operator_token}", "Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    made = [proved(study, M, "lead here", leader=0), proved(study, 20, "help here", leader=2)]
    records = [batch_records.records(plan, batch) for plan, batch in made]
    for m, n, rec in zip((M, 20), (M, M + 20), records):  # position 0 leads the first, helps the second
        assert post(proc.url, study, *rec[0]).json() == {"accepted": m, "duplicates": 0, "report_count": n}
    assert post(proc.url, study, *records[0][0]).json() == {"accepted": 0, "duplicates": M, "report_count": M + 20}
    proc.kill()
    proc.start()
    auth = {"Authorization": f"Bearer {spec.analyst_token}"}
    ids = httpx.get(f"{proc.url}/v1/studies/{study.study_id}/report-ids", headers=auth, timeout=30).content
    assert set(messages.decode_report_ids(ids)) == row_ids(*made[0]) | row_ids(*made[1])

    def verify(path: str, **kw) -> httpx.Response:
        return httpx.post(f"{proc.url}/v1/studies/{study.study_id}/verify/{path}", timeout=120,
                          headers={**auth, **kw.pop("headers", {})}, **kw)

    mine = bytes.fromhex(verify("commit").json()["commitment"])
    fake = [hashlib.sha256(bytes([j])).digest() for j in (1, 2)]
    commitments = [mine.hex()] + [V.commitment(study.study_id, j + 1, c).hex() for j, c in enumerate(fake)]
    own = verify("reveal", json={"commitments": commitments}).json()["contribution"]
    answer = verify("query", json={"contributions": [own] + [c.hex() for c in fake]})
    assert answer.status_code == 200, answer.text
    seed = V.query_seed(study.study_id, [bytes.fromhex(own), *fake])
    ids0, shares0, entries = sections(study, answer.content)
    assert len(ids0) == 0 and len(entries) == 2
    sums = []
    for rec in records:
        total = None
        for j in (1, 2):
            _, plan, batch = batch_records.receive(study, j, *rec[j])
            share = batch_validity.verifier_share(plan, batch, seed)
            total = share if total is None else field.add(total, share)
        sums.append(batch_verifiers.BatchVerifier(batch.batch_id, plan.m, total))
    body = V.encode_verifiers(ids0, shares0) + batch_verifiers.encode(sums)
    r = verify("decide", content=body, headers={"Content-Type": VERIFIERS_MEDIA_TYPE})
    assert r.status_code == 200 and r.content == b"", r.text
    assert r.headers[DECIDED_HEADER] == str(M + 20) and r.headers[REFUSED_HEADER] == "0"


def test_totals_from_a_checkpoint_and_batches_stored_after_it_are_the_rows_sums(tmp_path, monkeypatch):
    """Unit level (one in-process server, position 0): a batch's rows folded into the totals at
    upload, through a checkpoint, and from a record stored after the checkpoint (a crash before
    the next) are exactly the split-word sums of the rows' coordinate shares at their sketch
    cells; a full rebuild from the store gives the same."""
    from dpsketch.services import checkpoint, state as state_module
    from dpsketch.services.store import Store
    from dpsketch.services.writer import CallJob
    from test_server_unit import Server

    monkeypatch.setattr(checkpoint, "CHECKPOINT_MIN_REPORTS", 10)
    study = make_study("checkpoint")
    records = [batch_records.records(*proved(study, m, label, leader))[0]  # what position 0 receives
               for m, label, leader in ((M, "cp lead", 0), (20, "cp help", 1))]
    expected = np.zeros((study.k, 2 * study.width), dtype=np.uint64)
    for media, body in records:
        _, plan, batch = batch_records.receive(study, 0, media, body)
        cells, signs = study.hash_report_ids([bytes(r) for r in batch_validity.row_ids(batch.batch_id, plan.m)])
        sketch.accumulate(expected, cells, signs, V.split_words(batch_validity.coordinate_shares(plan, batch)))
    db = tmp_path / "s1.sqlite3"
    a = Server(db)
    assert a.provision(study).status_code == 201
    assert a.batch(study, records[0][1], records[0][0]).status_code == 200
    store = a.app.state.store
    store.writer.submit(CallJob(lambda conn: (None, None))).result()  # the writer checkpoints after acknowledging
    assert store.record(study.study_id).state.checkpointed == M
    monkeypatch.setattr(checkpoint, "save", lambda *args, **kw: False)  # a crash before the next one
    assert a.batch(study, records[1][1], records[1][0]).json() == {"accepted": 20, "duplicates": 0,
                                                                   "report_count": M + 20}
    monkeypatch.setattr(Store, "_checkpoint_all", lambda self: None)
    a.close()
    monkeypatch.undo()
    b = Server(db, warm_start=False)
    try:
        store = b.app.state.store
        record = store.record(study.study_id)
        restored = store.ensure_state(record)
        assert (restored.checkpointed, len(restored.ids)) == (M, M + 20)  # the checkpoint, then a record
        np.testing.assert_array_equal(restored.aggregate, expected)
        with store._reading() as conn:
            fresh = state_module.load_state(conn, record, 1000, store.backend)
        np.testing.assert_array_equal(fresh.aggregate, expected)
        assert np.array_equal(fresh.gram, restored.gram) and fresh.ids == restored.ids
    finally:
        b.close()
