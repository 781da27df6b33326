"""A validity study at one share server (TestClient; the same over real processes is
tests/test_validity_e2e.py): what it stores, folds and releases (docs/protocol.md section 4c).

* A leader's batch (explicit F_p input and proof shares, n + P values a report) and a helper's
  (a 32-byte seed a report) are stored as they came, and the running aggregate has 2 w
  columns: the halves of the server's F_p coordinate shares, equal to what the protocol module
  computes from the same payloads.
* A commit releases exactly validity.release_share of the included reports' halves, whether it
  takes the excluded reports out of the running totals or sums the included ones from scratch.
* A checkpoint of the (k, 2 w) state restores exactly (the same totals as a rebuild from the
  stored payloads), and a re-sent batch is a duplicate, a changed one a conflict.
* The storage policy counts the leader's real bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from dpsketch.client_sdk.prepare import prepare_batch
from dpsketch.protocol import field, messages, proved_shares, sketch, validity
from dpsketch.protocol.messages import SEEDS_MEDIA_TYPE, SHARES_MEDIA_TYPE, decode_aggregate
from dpsketch.protocol.study import Study, design
from conftest import BOTH_STORES
from test_server_unit import AN, Server

ROWS = 300


def validity_study(**overrides) -> Study:
    # min_reports 80: a test here commits 120 fresh ids (k = 8, a fresh sketch seed); against
    # min_reports 100 such commits were refused by the certificate in about 6e-4 of simulated
    # draws (18 of 30,000 at 117 ids: test_server_unit.LOW_MIN), against 80 in none of 8000
    kwargs = dict(name="v-unit", columns=["a", "b", "y"], label="y", servers=["s1", "s2"],
                  expected_reports=ROWS, k=8, s=2, min_reports=80, epsilon_floor=None, validity=True)
    kwargs.update(overrides)
    return design(**kwargs)[0]


def batches(study: Study, seed: int = 0, sizes=(100, 100, 100)):
    """Prepared batches, the leader rotating (s1 leads batches 0 and 2, s2 batch 1)."""
    rng = np.random.default_rng(seed)
    return [prepare_batch(study, rng.normal(0, 0.3, (m, study.d)), full=i % 2) for i, m in enumerate(sizes)]


def upload(server: Server, study: Study, batch) -> dict:
    r = server.batch(study, batch.body(0), batch.media_type(0))
    assert r.status_code == 200, r.text
    return r.json()


def running(study: Study, got, include=None) -> np.ndarray:
    """The (k, 2 w) halves server s1 (position 0) should hold over these batches' reports (all, or
    the ids in ``include``), from the protocol module alone."""
    plan = validity.plan(study)
    total = np.zeros((study.k, plan.state_width), dtype=np.uint64)
    for batch in got:
        payload = batch.shares[0] if batch.seeds[0] is None else batch.seeds[0]
        words = validity.aggregand(plan, validity.server_shares(plan, payload, batch.seeds[0] is not None)[0])
        keep = [i for i, rid in enumerate(batch.report_ids) if include is None or rid in include]
        rows, signs = study.hash_report_ids([batch.report_ids[i] for i in keep])
        sketch.accumulate(total, rows, signs, words[keep])
    return total


def decide_alone(server: Server, study: Study, got) -> int:
    """The verification round (docs/protocol.md section 6d) at server s1 (position 0), with this
    test as the analyzer and as server s2: s2's contribution made here, its verifier shares
    computed from its payloads in the prepared batches. How many reports s1 refused."""
    from dpsketch.protocol import verification

    plan = validity.plan(study)
    auth = {"Authorization": f"Bearer {AN}"}
    path = f"/v1/studies/{study.study_id}/verify"
    mine = server.client.post(f"{path}/commit", headers=auth).json()["commitment"]
    theirs = validity.new_contribution()
    commitments = [mine, validity.commitment(study.study_id, 1, theirs).hex()]
    own = server.client.post(f"{path}/reveal", json={"commitments": commitments}, headers=auth).json()
    contributions = [bytes.fromhex(own["contribution"]), theirs]
    answer = server.client.post(f"{path}/query", json={"contributions": [c.hex() for c in contributions]},
                                headers=auth)
    seed = validity.query_seed(study.study_id, contributions)
    assert answer.headers[verification.QUERY_SEED_HEADER] == seed.hex()
    ids, _shares = validity.decode_verifiers(answer.content, plan)
    payload = {rid: (b.shares[1][i] if b.seeds[1] is None else b.seeds[1][i], b.seeds[1] is not None)
               for b in got for i, rid in enumerate(b.report_ids)}
    rows = [payload[bytes(rid)] for rid in ids]
    others = np.empty((len(ids), plan.verifier_len, 2), dtype=np.uint64)
    for seeded in (False, True):
        at = [i for i, (_p, s) in enumerate(rows) if s is seeded]
        if at:
            inputs, proofs = validity.server_shares(plan, np.stack([rows[i][0] for i in at]), seeded)
            others[at] = validity.verifier_shares(plan, seed, ids[at], inputs, proofs)
    decided = server.client.post(f"{path}/decide", content=validity.encode_verifiers(ids, others),
                                 headers={**auth, "Content-Type": validity.VERIFIERS_MEDIA_TYPE})
    assert decided.status_code == 200, decided.text
    return int(decided.headers[verification.REFUSED_HEADER])


@pytest.fixture
def server(store_location):
    srv = Server(store_location("s1"), max_excluded_fraction=0.75)
    try:
        yield srv
    finally:
        srv.close()


def test_leader_and_helper_batches_are_stored_and_folded_as_field_halves(server):
    study = validity_study()
    plan = validity.plan(study)
    assert server.provision(study).status_code == 201
    got = batches(study)
    assert [b.media_type(0) for b in got] == [SHARES_MEDIA_TYPE, SEEDS_MEDIA_TYPE, SHARES_MEDIA_TYPE]
    assert len(got[0].body(0)) == 100 * messages.record_bytes(SHARES_MEDIA_TYPE, plan.leader_width, 2)
    assert len(got[1].body(0)) == 100 * messages.record_bytes(SEEDS_MEDIA_TYPE, plan.leader_width, 2)
    for b in got:
        assert upload(server, study, b)["accepted"] == 100
    assert server.count(study) == ROWS
    totals = server.totals(study)
    assert totals.shape == (study.k, 2 * study.width)
    np.testing.assert_array_equal(totals, running(study, got))
    # what a leader stores is what it received: n + P values a report (the seeds, 32 bytes)
    store = server.app.state.store
    with store._reading() as conn:
        sizes = sorted(len(bytes(s)) // m for m, s in conn.execute("SELECT m, shares FROM batches"))
    assert sizes == [32, 8 * plan.leader_width, 8 * plan.leader_width]
    # re-sent: duplicates; one value of a leader's proof share changed: a conflict, nothing stored
    again = server.batch(study, got[0].body(0), SHARES_MEDIA_TYPE)
    assert again.status_code == 200 and again.json()["duplicates"] == 100
    changed = got[0].shares[0].copy()
    changed[5, plan.input_len + 3] = (int(changed[5, plan.input_len + 3]) + 1) % field.P
    body = messages.encode_batch(got[0].report_ids, got[0].proofs[0], changed)
    r = server.batch(study, body, SHARES_MEDIA_TYPE)
    assert r.status_code == 409 and r.json()["type"].endswith("report-conflict")
    np.testing.assert_array_equal(server.totals(study), running(study, got))


@BOTH_STORES
@pytest.mark.parametrize("kept", [0.9, 0.4], ids=["subtract-excluded", "sum-included"])
def test_commit_releases_exactly_the_field_share_of_the_included_reports(server, kept):
    study = validity_study()
    plan = validity.plan(study)
    assert server.provision(study).status_code == 201
    got = batches(study, seed=1)
    for b in got:
        upload(server, study, b)
    ids = [rid for b in got for rid in b.report_ids]
    include = set(np.random.default_rng(2).permutation(len(ids))[:int(kept * len(ids))].tolist())
    included = [rid for i, rid in enumerate(ids) if i in include]
    assert server.commit(study, included).status_code == 409  # verification-pending: no round yet
    assert decide_alone(server, study, got) == 0
    r = server.commit(study, included)
    assert r.status_code == 200, r.text
    released = decode_aggregate(server.aggregate(study).content, study.k, study.width)
    expected = validity.release_share(plan, running(study, got, set(included)))
    np.testing.assert_array_equal(released, expected)  # no server noise in this study: exact
    assert (released < field.P).all()


@BOTH_STORES
def test_checkpoint_of_the_halves_restores_what_a_rebuild_holds(store_location, monkeypatch):
    from dpsketch.services import checkpoint, state as state_module
    from dpsketch.services.store import Store
    from dpsketch.services.writer import CallJob

    monkeypatch.setattr(checkpoint, "CHECKPOINT_MIN_REPORTS", 100)
    db = store_location("s1")
    a = Server(db)
    study = validity_study()
    a.provision(study)
    got = batches(study, seed=3, sizes=(120, 100, 140, 20))
    for b in got[:3]:
        upload(a, study, b)
    a.app.state.store.writer.submit(CallJob(lambda conn: (None, None))).result()
    record = a.app.state.store.record(study.study_id)
    assert record.state.checkpointed == 360
    upload(a, study, got[3])  # a tail after the checkpoint
    monkeypatch.setattr(Store, "_checkpoint_all", lambda self: None)  # a crash: no shutdown checkpoint
    a.close()
    b = Server(db)
    try:
        store = b.app.state.store
        restored = store.ensure_state(store.record(study.study_id))
        assert (restored.checkpointed, len(restored.ids)) == (360, 380)
        with store._reading() as conn:
            fresh = state_module.load_state(conn, store.record(study.study_id), 1000, store.backend)
        np.testing.assert_array_equal(restored.aggregate, fresh.aggregate)
        np.testing.assert_array_equal(restored.aggregate, running(study, got))
        np.testing.assert_array_equal(restored.gram, fresh.gram)
    finally:
        b.close()


def test_storage_policy_counts_the_leaders_bytes(store_location):
    study = validity_study(expected_reports=10_000)
    plan = validity.plan(study)
    assert study.share_bytes == 8 * plan.leader_width == 8 * proved_shares.upload_width(study)
    assert study.max_storage_bytes == study.max_reports * (16 + 8 * plan.leader_width)
    srv = Server(store_location("s1"), max_study_bytes=study.max_storage_bytes - 1)
    try:
        r = srv.provision(study)
        assert r.status_code == 422 and "max_study_bytes" in r.json()["detail"], r.text
        plain = study.model_copy(update={"validity": None})
        assert plain.max_storage_bytes < study.max_storage_bytes
    finally:
        srv.close()


def test_sealed_leader_and_helper_bodies_split_and_open_at_the_leaders_width():
    """The SDK's sealing of a validity batch (client_sdk/sealing.py): a body sealed at the leader's
    width n + P opens to the records sent, counts its records, and cut in two (what the SDK does
    on 413) seals each half again into bodies that open to the two halves."""
    from cryptography.hazmat.primitives.asymmetric import x25519

    from dpsketch.client_sdk import prepare as sdk_prepare
    from dpsketch.client_sdk import sealing
    from dpsketch.protocol import envelope

    study = validity_study()
    width = proved_shares.upload_width(study)
    batch = batches(study, seed=5, sizes=(9,))[0]  # s1 leads it
    for j in range(2):
        sk = envelope.generate_private_key()
        recipient = envelope.Recipient(study.servers[j], envelope.public_key_of(sk), envelope.CLASSICAL,
                                       envelope.VERSION_4)
        sealed, media_type = sealing.wire(recipient, study, study.study_id, batch.body(j), batch.media_type(j))
        assert media_type == messages.SEALED_MEDIA_TYPE
        assert sdk_prepare.count_records(sealed, media_type, study) == 9
        key = x25519.X25519PrivateKey.from_private_bytes(sk)

        def opened(body: bytes, server: str = study.servers[j], key=key):
            upload = envelope.open_batch(body, width, 2, study.study_id, server, lambda kid: key)
            return list(upload.ids), upload.payloads

        ids, payloads = opened(sealed)
        assert ids == batch.report_ids
        sent = batch.shares[j] if batch.seeds[j] is None else batch.seeds[j]
        np.testing.assert_array_equal(payloads, sent)
        first, second = sealing.split_body(sealed, media_type, study)
        (a, pa), (b, pb) = opened(first), opened(second)
        assert a + b == batch.report_ids and len(a) == 4
        np.testing.assert_array_equal(np.concatenate([pa, pb]), sent)


def test_kept_records_give_back_the_input_and_proof_shares_sent(server):
    """What the verification round reads: a server's kept records (batches.study_payloads) give
    back exactly the input and proof shares the client made for it, leader's and helper's."""
    from dpsketch.services import batches as stored_batches

    study = validity_study()
    assert server.provision(study).status_code == 201
    got = batches(study, seed=6, sizes=(30, 30))  # s1 leads batch 0, helps in batch 1
    for b in got:
        upload(server, study, b)
    store = server.app.state.store
    with store._reading() as conn:
        kept = list(stored_batches.scan(conn, store.record(study.study_id).seq))
    plan = validity.plan(study)
    for chunk, batch in zip(kept, got):
        rows, seeded = stored_batches.study_payloads(chunk, study)
        assert seeded == (batch.seeds[0] is not None)
        inputs, proofs = proved_shares.server_shares(study, rows, seeded)
        sent = batch.share(0)
        np.testing.assert_array_equal(inputs, sent[:, :plan.input_len])
        np.testing.assert_array_equal(proofs, sent[:, plan.input_len:])
