"""Batch proofs end to end over real processes (docs/protocol.md sections 4d and 6d): the SDK or
the core's own path posting batch records to three real share servers (SQLite), a real analyzer
process creating the study and finalizing it, its verification round deciding each batch whole.

* Honest rows through ``Client.submit_many`` and single rows through ``Client.submit`` in one
  study: every row and report is decided and none refused; the release counts them all.
* An adversary's batches beside honest ones: rows a thousand times the bound with a proof forged
  for them, a batch whose proof share was tampered after proving, and a batch whose helper record
  differs at one server (a proof valid at N - 1 servers: another batch's whole record, stored
  there, or another batch's seed under this batch's parts, refused there at upload). Each is
  refused or left out at every server, and the release is exactly the sketch of the honest batches' rows, reconstructed in this
  process from the records that were sent, as if the adversary had sent nothing.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from dpsketch.client_sdk import Client
from dpsketch.protocol import batch_records, batch_validity, field, report, sketch, validity
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.study import Study
from test_validity_e2e import Pool, create, data, decoded, finalize

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("batch-e2e"))
    try:
        yield p
    finally:
        p.servers.stop_all()


def _post(pool: Pool, study: Study, records: list[tuple[str, bytes]]) -> list[httpx.Response]:
    return [httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body,
                       headers={"Content-Type": media_type}, timeout=120)
            for url, (media_type, body) in zip(pool.urls(3), records)]


def _ring_sketch(study: Study, batches: list[report.ProofBatch]) -> np.ndarray:
    """The ring sketch of the batches' rows, from their records: every server's F_p coordinate
    shares (batch_records.receive, as the server reads them) added and centred, hashed by the
    rows' ids."""
    total = np.zeros((study.k, study.width), dtype=np.uint64)
    for b in batches:
        summed = None
        for j in range(study.n_servers):
            _rec, plan, mine = batch_records.receive(study, j, b.media_type(j), b.body(j))
            coords = batch_validity.coordinate_shares(plan, mine)
            summed = coords if summed is None else field.add(summed, coords)
        rows, signs = study.hash_report_ids(b.report_ids)
        sketch.accumulate(total, rows, signs, validity.to_ring(summed))
    return total


def test_sdk_batches_and_single_reports_are_all_decided_and_released(pool):
    study = create(pool, 3, 2_400, "batch-sdk", batch_proofs=True, min_reports=2_000)
    assert study.batch_proofs
    rows = data(2_405, seed=11)
    with Client(pool.urls(3), journal=False) as client:
        result = client.submit_many(study.study_id, rows[:2_400], batch_size=800)
        assert result.n_reports == 2_400
        for row in rows[2_400:]:
            client.submit(study.study_id, row)
    fin = finalize(pool, 3, study)
    assert fin["n_reports"] == 2_405
    assert fin["verification"]["decided"] == 2_405 and fin["verification"]["refused"] == 0


def _forged_far_outside(study: Study, m: int, rng: np.random.Generator) -> list[tuple[str, bytes]]:
    """Rows of a thousand times the bound, roots of zero: the norm equation fails, the forger
    writes the best wrap digits it has and proves the input it has (prove_prefix, strict=False)."""
    plan = batch_validity.study_plan(study, m)
    c = plan.circuit
    x = rng.integers(-1000, 1000, size=(m, c.w)) * int(np.sqrt(c.r2))
    prefix = c.prefix_of(x, np.zeros((m, c.k - c.w), dtype=np.int64))
    proved = batch_validity.prove_prefix(plan, prefix, Keystream(), leader=1, strict=False)
    return batch_records.records(plan, proved)


def _tampered_proof(b: report.ProofBatch) -> list[tuple[str, bytes]]:
    """The leader's last proof element moved by one after proving (still < p)."""
    records = list(b.records)
    media_type, body = records[b.leader]
    last = int.from_bytes(body[-8:], "little")
    records[b.leader] = (media_type, body[:-8] + ((last + 1) % field.P).to_bytes(8, "little"))
    return records


def test_forged_batches_are_refused_everywhere_and_the_release_is_the_honest_rows(pool):
    study = create(pool, 3, 1_000, "batch-attacks", batch_proofs=True, min_reports=700)
    rng = np.random.default_rng(5)
    honest = [report.prepare_proof_batch(study, data(400, seed=20 + i), leader=i) for i in range(2)]
    for b in honest:
        assert [r.status_code for r in _post(pool, study, b.records)] == [200] * 3

    # 1. far outside the bound, a forged proof: stored (the proof is checked at the round), refused there
    assert [r.status_code for r in _post(pool, study, _forged_far_outside(study, 20, rng))] == [200] * 3
    # 2. a proof share tampered after proving: stored, refused at the round
    victim = report.prepare_proof_batch(study, data(20, seed=30), leader=2)
    assert [r.status_code for r in _post(pool, study, _tampered_proof(victim))] == [200] * 3
    # 3. valid at N - 1 servers: server s2 gets the complete record of another batch, a valid one
    #    it stores; s1 and s3 hold this batch, s2 that one: neither is held everywhere, neither released
    split = report.prepare_proof_batch(study, data(10, seed=31), leader=0)
    other = report.prepare_proof_batch(study, data(10, seed=32), leader=0)
    records = list(split.records)
    records[1] = other.records[1]
    assert [r.status_code for r in _post(pool, study, records)] == [200] * 3
    # 4. the same with only another batch's seed under this batch's parts: refused at upload at s2
    split = report.prepare_proof_batch(study, data(10, seed=33), leader=0)
    other = report.prepare_proof_batch(study, data(10, seed=34), leader=0)
    records = list(split.records)
    records[1] = (records[1][0], records[1][1][:-batch_records.SEED_BYTES] + other.records[1][1][-batch_records.SEED_BYTES:])
    answers = _post(pool, study, records)
    assert [r.status_code for r in answers] == [200, 422, 200]
    assert answers[1].json()["type"].endswith("binding-refused")

    fin = finalize(pool, 3, study)
    assert fin["n_reports"] == 800  # the honest rows, no other
    v = fin["verification"]
    assert v["refused"] == 40  # the forged and the tampered batches' rows, at every server
    assert set(v["refused_by_server"].values()) == {40}
    np.testing.assert_array_equal(np.array(fin["sketch"]["sketch"]), decoded(study, _ring_sketch(study, honest)))
