"""Batch proofs' wire records and study flag (docs/protocol.md section 4d): the generator
reproduces conformance/batch_validity.json, records round-trip, every malformed record is
refused with its documented problem, and a study's batch_proofs member keeps old ids and adds
exactly the tail charge of docs/validity.md section 15. Seeds and keys are fixed (no flakes)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from dpsketch.protocol import batch_records as br
from dpsketch.protocol import batch_validity, field, privacy, problems, validity, wraparound
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.study import Study, design

ROOT = Path(__file__).resolve().parents[1]
VECTORS = json.loads((ROOT / "conformance" / "batch_validity.json").read_text())
#: the vectors from noisy ring vectors (type batch_proof) and from raw rows (type batch_rows)
PROOF_VECTORS = [v for v in VECTORS["vectors"] if v["type"] == "batch_proof"]
ROWS_VECTORS = [v for v in VECTORS["vectors"] if v["type"] == "batch_rows"]
SEED = "ab" * 32


def _dec(a) -> list:
    return [str(int(v)) for v in np.asarray(a, dtype=np.uint64).ravel()]


def _study(servers=("s0", "s1", "s2"), **kw):
    return design(name="batch", columns=["x1", "x2", "x3", "y"], label="y", servers=list(servers),
                  expected_reports=10_000, seed=SEED, validity=True, batch_proofs=True, **kw)[0]


@pytest.fixture(scope="module")
def batch():
    """A proved batch of 3 rows at 3 servers, the leader in the middle, and its records."""
    study = _study()
    plan = batch_validity.study_plan(study, 3)
    rows = np.array([[3, -4, 0, 1], [0, 0, 0, 0], [10, 2, -7, 5]], dtype=np.int64)
    proved = batch_validity.prove(plan, rows, Keystream.from_key(b"\x01" * 32), leader=1)
    return study, plan, proved, br.records(plan, proved)


# --- the vectors ----------------------------------------------------------------------------------

def test_rows_vectors_are_batches_the_servers_accept():
    """The batch_rows vectors (raw rows and one client key to every record, what the TypeScript
    client reproduces): every record is received at its server with the vector's batch id, the
    row ids are the batch id's, the records are report.prepare_proof_batch's for the key, the
    second has a padding row, and the servers' verifier shares decide the batch true (and false
    with the leader's last proof element changed)."""
    from dpsketch.protocol import report

    assert [v["id"] for v in ROWS_VECTORS] == ["rows-two-servers", "rows-three-servers-padding"]
    assert ROWS_VECTORS[1]["plan"]["rows"] > ROWS_VECTORS[1]["plan"]["m"]
    for vec in ROWS_VECTORS:
        study = Study.model_validate(vec["study"])
        assert study.study_id == vec["study_id"]
        rows = np.array(vec["rows"], dtype=np.float64)
        again = report.prepare_proof_batch(study, rows, Keystream.from_key(bytes.fromhex(vec["client_key"])),
                                           vec["leader"])
        assert [(mt, b.hex()) for mt, b in again.records] == [(r["media_type"], r["record"]) for r in vec["records"]]
        bid = bytes.fromhex(vec["batch_id"])
        assert [r.tobytes().hex() for r in batch_validity.row_ids(bid, len(rows))] == vec["row_ids"]
        query_seed = hashlib.sha256(b"rows-vector-query").digest()
        messages = []
        for r in vec["records"]:
            rec, plan, got = br.receive(study, r["position"], r["media_type"], bytes.fromhex(r["record"]))
            assert got.batch_id == bid
            messages.append((got.batch_id, batch_validity.verifier_share(plan, got, query_seed)))
            if r["position"] == vec["leader"]:
                proof = got.proof.copy()
                proof[-1] = field.add(proof[-1], np.uint64(1))
                forged = batch_validity.ServerBatch(got.position, got.inputs, proof, got.wrap_seed, got.batch_id)
                forged_share = batch_validity.verifier_share(plan, forged, query_seed)
        assert batch_validity.decide(plan, messages)
        tampered = [(b, forged_share if j == vec["leader"] else v) for j, (b, v) in enumerate(messages)]
        assert not batch_validity.decide(plan, tampered)


def test_generator_reproduces_the_vectors():
    """What scripts/make_batch_vectors.py --check compares (in this process): the file is what the
    core and the records give now."""
    spec = importlib.util.spec_from_file_location("make_batch_vectors", ROOT / "scripts" / "make_batch_vectors.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    stored = (ROOT / "conformance" / "batch_validity.json").read_text()
    assert gen.render() == stored, "conformance/batch_validity.json is out of date: run scripts/make_batch_vectors.py"


def test_vectors_hold_what_the_document_promises():
    """Each vector's record bytes decode at their server to its fields, the decision is true and the
    tampered one false, and the record header's layout is the byte table's."""
    assert [v["plan"]["n_servers"] for v in PROOF_VECTORS] == [2, 3]
    for vec in PROOF_VECTORS:
        study = Study.model_validate(vec["study"])
        assert study.study_id == vec["study_id"] and study.batch_proofs
        assert vec["decision"] is True and vec["tampered_decision"] is False
        header = bytes.fromhex(vec["record_header"])
        plan = vec["plan"]
        assert header == struct.pack("<IIQIQIII", plan["m"], plan["w"], plan["r2"], plan["reps"], plan["threshold"],
                                     plan["n_servers"], plan["shift"], vec["leader"])
        assert header[:36] == bytes.fromhex(vec["plan_header"])
        # the input shares add up to the prefix then the wrap digits; the coordinate shares to
        # 2^shift times the rows in grid units (mod p)
        total = np.zeros(plan["input_len"], dtype=np.uint64)
        coords = np.zeros((plan["m"], plan["w"]), dtype=np.uint64)
        for srv in vec["servers"]:
            total = field.add(total, np.array([int(v) for v in srv["input_share"]], dtype=np.uint64))
            coords = field.add(coords, np.array([[int(v) for v in r] for r in srv["coordinate_shares"]],
                                                dtype=np.uint64))
        assert _dec(total) == vec["prefix"] + vec["wrap_input"]
        assert [[(int(v) + field.P // 2) % field.P - field.P // 2 for v in r] for r in coords] == [
            [u << plan["shift"] for u in r] for r in vec["units"]]
        for srv in vec["servers"]:
            body = bytes.fromhex(srv["record"])
            rec, _ = br.decode(study, srv["position"], srv["media_type"], body)
            assert body[:40] == header and [p.hex() for p in rec.parts] == vec["parts"]
            assert rec.digits_part.hex() == vec["digits_part"]
            if srv["position"] != vec["leader"]:  # a helper's shares: its seed's expansion (section 4d)
                nonce = hashlib.sha256(b"dpsketch/batch-share/1").digest()[:12]
                both = field.expand(np.frombuffer(rec.seed, dtype=np.uint8).reshape(1, 32),
                                    plan["input_len"] + plan["proof_len"], nonce)[0]
                assert _dec(both) == srv["input_share"] + srv["proof_share"]
            if srv["position"] == vec["leader"]:
                assert srv["media_type"] == br.LEADER_MEDIA_TYPE and len(body) == plan["leader_length"]
                assert [str(int(v)) for v in rec.inputs] == vec["leader_inputs"]
                assert [str(int(v)) for v in rec.proof] == vec["leader_proof"]
            else:
                assert srv["media_type"] == br.HELPER_MEDIA_TYPE and len(body) == plan["helper_length"]
                assert rec.seed.hex() == vec["helper_seeds"][str(srv["position"])]


# --- records --------------------------------------------------------------------------------------

def test_decode_of_encode_is_the_record_and_receive_gives_one_batch_id(batch):
    study, plan, proved, recs = batch
    ids = set()
    for position, (media_type, body) in enumerate(recs):
        want = br.record(plan, proved, position)
        rec, got_plan = br.decode(study, position, media_type, body)
        assert rec == want and br.encode(rec) == body and got_plan is plan
        assert rec.is_leader == (position == 1)
        ids.add(br.receive(study, position, media_type, body)[2].batch_id)
    assert len(ids) == 1
    # a record is not equal to another server's
    assert br.record(plan, proved, 0) != br.record(plan, proved, 2)
    assert br.record(plan, proved, 1) != br.record(plan, proved, 0)


def _refused(study, position, media_type, body, slug, match):
    with pytest.raises(br.BatchRecordError, match=match) as err:
        br.receive(study, position, media_type, body)
    assert err.value.slug == slug
    assert err.value.problem().status == problems.CATALOGUE[slug][0]


def _with_header(body: bytes, **fields) -> bytes:
    names = ["m", "w", "r2", "reps", "threshold", "n_servers", "shift", "leader"]
    values = dict(zip(names, struct.unpack_from("<IIQIQIII", body)))
    values.update(fields)
    return struct.pack("<IIQIQIII", *(values[n] for n in names)) + body[40:]


def test_every_malformed_record_is_refused_with_its_problem(batch):
    study, plan, proved, recs = batch
    lead_type, lead = recs[1]
    help_type, helper = recs[0]
    c = plan.circuit
    # the media type and the study's flag: 415
    _refused(study, 1, "application/x-dpsketch-shares", lead, "unsupported-media-type", "not a batch record")
    plain = study.model_copy(update={"batch_proofs": False})
    _refused(plain, 1, lead_type, lead, "unsupported-media-type", "does not take batch proofs")
    _refused(plain, 0, help_type, helper, "unsupported-media-type", "does not take batch proofs")
    # truncated anywhere, or extended: 400
    for cut in (0, 39, 40, 40 + 32 * 4 - 1, len(lead) - 1):
        _refused(study, 1, lead_type, lead[:cut], "malformed-body", "header|at least|bytes")
    _refused(study, 1, lead_type, lead + b"\0" * 8, "malformed-body", "is [0-9]+ bytes")
    _refused(study, 0, help_type, helper[:-1], "malformed-body", "helper's record is")
    _refused(study, 0, help_type, helper + b"\0", "malformed-body", "helper's record is")
    # a value >= p in the input share and in the proof share
    for index in (0, c.input_len):
        at = 40 + 32 * 4 + 32 + 8 * index  # header, 3 parts and the digits part, the blind
        for value in (field.P, 2 ** 64 - 1):
            forged = lead[:at] + struct.pack("<Q", value) + lead[at + 8:]
            _refused(study, 1, lead_type, forged, "malformed-body", f"element {index} of")
    # a header that is not the study's plan for its m
    _refused(study, 1, lead_type, _with_header(lead, n_servers=2), "malformed-body", "names N = 2")
    _refused(study, 1, lead_type, _with_header(lead, w=5), "malformed-body", r"\(w, R\^2, shift\)")
    _refused(study, 1, lead_type, _with_header(lead, r2=c.r2 + 1), "malformed-body", r"\(w, R\^2, shift\)")
    _refused(study, 1, lead_type, _with_header(lead, shift=plan.shift + 1), "malformed-body", r"\(w, R\^2, shift\)")
    _refused(study, 1, lead_type, _with_header(lead, reps=64), "malformed-body", "r = 128")
    _refused(study, 1, lead_type, _with_header(lead, threshold=c.threshold + 1), "malformed-body", "T = ")
    _refused(study, 0, help_type, _with_header(helper, threshold=c.threshold - 1), "malformed-body", "T = ")
    # another m: refused by the plan's T for that m, with that T by the exact length (m = 2), and
    # by the lower bound of w + 5 elements a row before any circuit is built (m = 50,000)
    _refused(study, 1, lead_type, _with_header(lead, m=2), "malformed-body", "T = ")
    t2 = batch_validity.study_plan(study, 2).circuit.threshold
    _refused(study, 1, lead_type, _with_header(lead, m=2, threshold=t2), "malformed-body", "is [0-9]+ bytes")
    _refused(study, 1, lead_type, _with_header(lead, m=4), "malformed-body", "T = ")
    built = batch_validity.batch_plan.cache_info().misses
    _refused(study, 1, lead_type, _with_header(lead, m=50_000), "malformed-body", "at least")
    assert batch_validity.batch_plan.cache_info().misses == built  # no circuit of 50,000 rows was built
    _refused(study, 0, help_type, _with_header(helper, m=4), "malformed-body", "T = ")
    # m out of the study's bounds: 0, above max_reports, above MAX_BATCH_ROWS
    for m in (0, study.max_reports + 1, br.MAX_BATCH_ROWS + 1, 2 ** 32 - 1):
        _refused(study, 1, lead_type, _with_header(lead, m=m), "malformed-body", "rows")
        _refused(study, 0, help_type, _with_header(helper, m=m), "malformed-body", "rows")
    # the leader's position against the media type and the server
    _refused(study, 1, lead_type, _with_header(lead, leader=0), "malformed-body", "names leader 0")
    _refused(study, 0, lead_type, lead, "malformed-body", "names leader 1")  # sent to another server
    _refused(study, 1, help_type, helper, "malformed-body", "as the leader")
    _refused(study, 0, help_type, _with_header(helper, leader=0), "malformed-body", "as the leader")
    _refused(study, 0, help_type, _with_header(helper, leader=3), "malformed-body", "positions are 0..2")
    # well formed but not what the payload gives: 422 binding-refused
    _refused(study, 2, help_type, helper, "binding-refused", "part for server 2")  # server 0's seed at 2
    changed = bytearray(lead)
    changed[-1 - 8 * c.proof_len] ^= 1  # the last input element (a wrap digit): the digits part
    _refused(study, 1, lead_type, bytes(changed), "binding-refused", "digits part")
    changed = bytearray(lead)
    changed[40 + 32 * 4 + 32] ^= 1  # the first input element: the leader's part
    _refused(study, 1, lead_type, bytes(changed), "binding-refused", "part for server 1")
    changed = bytearray(lead)
    changed[40 + 32 * 4] ^= 1  # the blind: both of the leader's parts
    _refused(study, 1, lead_type, bytes(changed), "binding-refused", "digits part|part for server 1")
    changed = bytearray(helper)
    changed[40] ^= 1  # server 0's part
    _refused(study, 0, help_type, bytes(changed), "binding-refused", "part for server 0")
    # a changed proof share is not refused here (nothing commits to it: its proof fails at decide)
    changed = bytearray(lead)
    changed[-8] ^= 1
    br.receive(study, 1, lead_type, bytes(changed))


def test_a_sealed_record_s_clear_id_must_be_the_batch_id(batch):
    study, plan, proved, recs = batch
    got = br.receive(study, 0, *recs[0])[2]
    br.check_sealed_id(got.batch_id, got)
    with pytest.raises(br.BatchRecordError) as err:
        br.check_sealed_id(bytes(16), got)
    assert err.value.slug == "binding-refused"


# --- the study flag -------------------------------------------------------------------------------

def test_batch_proofs_only_where_the_core_has_them():
    base = dict(name="b", columns=["x1", "x2", "y"], label="y", servers=["s0", "s1"], expected_reports=10_000,
                seed=SEED)
    assert design(**base, validity=True, batch_proofs=True, kind="l1")[0].batch_proofs
    for kw, match in ((dict(validity=False), "needs validity"), (dict(validity=True, kind="gram"), "not gram"),
                      (dict(validity=True, parties=[{"name": "a", "columns": ["x1"]},
                                                    {"name": "b", "columns": ["x2", "y"]}]), "without parties")):
        with pytest.raises(ValueError, match=match):
            design(**base, batch_proofs=True, **kw)


def test_study_ids_unchanged_and_the_member_is_hashed():
    """Without batch_proofs a study's JSON has no such member (every id and vector of before stays:
    conformance/study_ids.json is checked by test_conformance); with it the id differs."""
    plain = design(name="b", columns=["x1", "y"], label="y", servers=["s0", "s1"], expected_reports=10_000,
                   seed=SEED, validity=True)[0]
    assert "batch_proofs" not in plain.model_dump(mode="json")
    flagged = plain.model_copy(update={"batch_proofs": True})
    flagged = Study.model_validate(flagged.model_dump(mode="json"))
    assert flagged.model_dump(mode="json")["batch_proofs"] is True and flagged.study_id != plain.study_id
    for doc in ("study_ids.json", "validity.json"):
        text = (ROOT / "conformance" / doc).read_text()
        assert "batch_proofs" not in text


@pytest.mark.parametrize("epsilon,max_reports", [(1.0, 10 ** 6), (4.0, 10 ** 5), (0.5, 20_000)])
def test_tail_charge_is_the_validity_term_doubled(epsilon, max_reports):
    """docs/validity.md section 15: a batch-proof study's tail delta counts max_reports 2^-96 more
    conditioned mass than the same study without (the validity term doubled), through the same
    (e^epsilon + 1) mp / (1 - mp); 9.4e-23 more at max_reports = 10^6 and epsilon = 1."""
    assert wraparound.REFUSAL_LOG2 == validity.REFUSAL_LOG2 == -96
    plain = design(name="b", columns=["x1", "x2", "y"], label="y", servers=["s0", "s1"], expected_reports=10_000,
                   seed=SEED, validity=True, epsilon=epsilon, max_reports=max_reports)[0]
    flagged = Study.model_validate({**plain.model_dump(mode="json"), "batch_proofs": True})
    term = max_reports * 2.0 ** -96
    # recover mp from the plain study's charge, then the flagged one is exactly mp + term
    mp = plain.tail_delta / (math.exp(epsilon) + 1.0 + plain.tail_delta)
    assert flagged.tail_delta == pytest.approx(privacy.truncation_delta(epsilon, mp + term), rel=1e-12)
    assert flagged.tail_delta - plain.tail_delta == pytest.approx((math.exp(epsilon) + 1.0) * term, rel=1e-6)
    if epsilon == 1.0 and max_reports == 10 ** 6:
        assert f"{(math.exp(epsilon) + 1.0) * term:.2g}" == "4.7e-23"  # this term; with the rows' term 9.4e-23
        assert (math.exp(epsilon) + 1.0) * 2 * term == pytest.approx(9.4e-23, rel=0.01)


def test_read_header_judges_m_before_any_circuit_is_built(batch):
    """A server reads m (for the upload token's quota) without building the batch's circuit: a
    helper's 200-byte record claiming the most rows allowed builds nothing."""
    study, plan, proved, recs = batch
    built = batch_validity.batch_plan.cache_info().misses
    header = br.read_header(study, 0, recs[0][0], _with_header(recs[0][1], m=br.max_rows(study)))
    assert (header.m, header.leader, header.leading) == (br.max_rows(study), 1, False)
    assert batch_validity.batch_plan.cache_info().misses == built


def test_the_leaders_part_hides_the_rows_from_the_helpers():
    """At the floor (sigma = 0, no client noise) a helper of a two-server batch knows its own share,
    hence the leader's share of any guess of the rows (share = prefix - its own). The leader's part
    hashes the leader's share after a 32-byte blind only the leader receives: with the blind the
    part confirms the true rows (it binds), without it no guess is confirmed, the true rows
    included (before the blind, the helper confirmed them; docs/protocol.md section 4d)."""
    study = design(name="floor", columns=["x1", "x2", "x3", "y"], label="y", servers=["s0", "s1"],
                   expected_reports=10_000, seed=SEED, validity=True, batch_proofs=True, epsilon=4.0)[0]
    assert study.sigma == 0
    plan = batch_validity.study_plan(study, 2)
    c = plan.circuit
    rows = np.array([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=np.int64) * 100  # low-entropy rows
    proved = batch_validity.prove(plan, rows, Keystream.from_key(b"\x02" * 32), leader=0)
    mine = batch_validity._helper_shares(plan, proved.seeds[1])[:c.input_len]  # the helper's own share

    def confirms(guess, blind) -> bool:
        leader_share = np.empty(c.input_len, dtype=np.uint64)
        leader_share[:c.at_wrap] = field.sub(c.prefix(np.asarray(guess, dtype=np.int64)), mine[:c.at_wrap])
        return batch_validity.share_part(plan, 0, leader_share, blind) == proved.parts[0]

    assert confirms(rows, proved.blind)  # the leader's part binds its share
    assert not confirms(rows[::-1], proved.blind)
    # what the helper can try: every blind it could know (none, its own seed, zeros)
    for blind in (bytes(32), proved.seeds[1], b"\xff" * 32):
        assert not confirms(rows, blind)
    # the records: only the leader's carries the blind
    recs = br.records(plan, proved)
    assert proved.blind in recs[0][1] and proved.blind not in recs[1][1]

def test_a_records_batch_id_is_read_from_its_header_and_parts_alone():
    """batch_id_of (what a server judges a record's quota by, before receive) gives the vectors'
    batch ids from every server's record, and from a record cut right after its digits part."""
    for vec in PROOF_VECTORS:
        n = vec["plan"]["n_servers"]
        for srv in vec["servers"]:
            body = bytes.fromhex(srv["record"])
            assert br.batch_id_of(body, n).hex() == vec["batch_id"]
            assert br.batch_id_of(body[:br.HEADER_BYTES + 32 * (n + 1)], n).hex() == vec["batch_id"]
        with pytest.raises(ValueError):
            br.batch_id_of(body[:br.HEADER_BYTES + 32 * (n + 1) - 1], n)
