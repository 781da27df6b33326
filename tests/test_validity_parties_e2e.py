"""A validity study with parties over real processes (docs/protocol.md sections 2d, 4c and 6d;
docs/validity.md section 13): three share servers and the analyzer as uvicorn processes on
loopback ports, real SQLite files.

* Two parties upload proved blocks through the SDK (plaintext and sealed, a signed study): every
  block is proved with its party's bound, the leader turning over the servers batch by batch,
  and the release is exactly the sketch of the joined rows the parties shared, reconstructed in
  this process from the very shares the SDK sent: what the same shares would release without
  proofs; a server SIGKILLed and restarted before the round keeps every block.
* Attacks, each block correctly bound so that every server stores it, uploaded as raw bodies:
  a party's block far outside its bound with a proof made for it, a block whose proof fails
  (a share altered after proving), a valid block replayed under another pseudonym and under
  another party (re-bound, its proof kept), and the same bytes relabelled to another party (422
  binding-refused). Every attacked block is refused at every server, its individual is left out
  whole (the other party's honest block of it too), and the release is bit for bit that of the
  honest individuals alone.
* A party whose refused blocks leave out more individuals than the batch rule allows stops the
  release before any commit (422 inclusion-refused, the refused blocks named).
* Malformed proved block uploads (a value >= p, an input share changed after binding, a block
  seed batch cut short or sent as a leader's record, a leader's record at a helper, a block
  seed batch relabelled to another party or naming none, block seeds to a study with parties
  but no proofs, in the clear and sealed as content 0x04) get their 4xx and store nothing.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.protocol import Study, envelope, field, flp, messages, parties, report, ring, sketch
from dpsketch.protocol import validity as V
from dpsketch.protocol.circuits import to_digits
from dpsketch.protocol.keystream import Keystream
from studies import record_blocks
from test_validity_round_attacks import prove_inputs
from test_e2e import direct_sketch, no_floor_module_cluster  # noqa: F401 (a fixture)

PARTIES = [{"name": "bank", "columns": ["x0", "x1"]}, {"name": "clinic", "columns": ["x2", "y"]}]
COLS = {"bank": slice(0, 2), "clinic": slice(2, 4)}


def create(cluster, n: int, name: str, **extra) -> Study:
    with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as an:
        view = an.create_study(name=name, label="y", expected_reports=n, k=16, s=4, parties=PARTIES,
                               min_reports=min(n - 20, 100), epsilon_floor=None, validity=True, **extra)
    study = Study.model_validate(view["study"])
    assert study.validity == V.PREDICATE and study.parties is not None
    return study


def joined_vectors(study: Study, batch, party: int) -> np.ndarray:
    """A sent block batch's (m, d_j) ring vectors: every server's F_p coordinate shares of it
    added and centred (what the unproved path would have summed from the same shares)."""
    plan = V.party_plan(study, party)
    total = None
    for j in range(study.n_servers):
        coords = V.coordinate_shares(plan, batch.share(j)[:, :plan.input_len])
        total = coords if total is None else field.add(total, coords)
    return V.to_ring(total)


def expected_release(study: Study, batches: dict[str, list], keep: set[bytes] | None = None) -> np.ndarray:
    """S(A + G) of the joined rows (every party's block of an individual side by side), over the
    individuals with every block (or those of ``keep``), hashed by pseudonym, decoded and scaled."""
    rows: dict[bytes, np.ndarray] = {}
    count: dict[bytes, int] = {}
    for name, sent in batches.items():
        index, _ = study.party(name)
        for batch in sent:
            for p, vec in zip(batch.pseudonyms, joined_vectors(study, batch, index)):
                rows.setdefault(p, np.zeros(study.d, dtype=np.uint64))[COLS[name]] = vec
                count[p] = count.get(p, 0) + 1
    ps = sorted(p for p in rows if count[p] == len(batches) and (keep is None or p in keep))
    return ring.decode(direct_sketch(study, ps, np.array([rows[p] for p in ps])), study.frac_bits) * sketch.scale(study.s)


def data(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, 3))
    rows = np.column_stack([x, x @ np.array([0.8, -0.5, 0.3]) + 0.1 * rng.normal(size=n)])
    return 0.95 * rows / np.linalg.norm(rows, axis=1).max()


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_honest_parties_proved_blocks_release_the_sketch_of_their_joined_rows(no_floor_module_cluster, monkeypatch,
                                                                             sealed):
    c = no_floor_module_cluster
    n = 400
    study = create(c, n, f"vp-honest-{sealed}", secret_sign=True)
    assert study.secret_sign
    key = parties.new_key()
    people = [f"person-{i}" for i in range(n)]
    rows = data(n, seed=7 + sealed)
    sent = record_blocks(monkeypatch)
    for name in ("bank", "clinic"):
        with Client(c.server_urls, encrypt=sealed) as client:
            result = client.submit_blocks(study.study_id, name, rows[:, COLS[name]], party_key=key, keys=people,
                                          batch_size=150)
        assert result.n_reports == n
    for name, index in (("bank", 0), ("clinic", 1)):
        plan = V.party_plan(study, index)
        # three batches each, the leader (explicit input and proof shares) turning over the servers
        leaders = [[j for j in range(3) if b.seeds[j] is None] for b in sent[name]]
        assert leaders == [[0], [1], [2]]
        assert all(b.shares[lead[0]].shape[1] == plan.leader_width for b, lead in zip(sent[name], leaders))
    if not sealed:  # a server SIGKILLed and restarted rebuilds its block index from the stored
        # leader's values and seeds (of both parties' widths), and verifies and sums them the same
        c.procs[1].kill()
        c.procs[1].start()
        info = httpx.get(f"{c.server_urls[1]}/v1/studies/{study.study_id}",
                         headers={"Authorization": f"Bearer {c.specs[1].analyst_token}"}, timeout=30).json()
        assert info["report_count"] == n and info["party_counts"] == {"bank": n, "clinic": n}
    before = [decisions(c, j) for j in range(3)]
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        fin = an.finalize(study.study_id)
        served = np.array(an.sketch(study.study_id)["sketch"])
    assert fin["state"] == "released" and fin["n_reports"] == n
    assert fin["verification"]["decided"] == 2 * n and fin["verification"]["refused"] == 0
    # every server decided from its query's kept answer (both parties' circuits in one file),
    # none computed its verifier shares a second time
    after = [decisions(c, j) for j in range(3)]
    assert [(a["cache"] - b["cache"], a["recomputed"] - b["recomputed"]) for a, b in zip(after, before)] == [(1, 0)] * 3
    np.testing.assert_array_equal(served, expected_release(study, sent))  # bit for bit
    # the joined vectors are the signed clipped rows plus the study's noise: a real release
    joined = np.concatenate([ring.decode(joined_vectors(study, b, i), study.frac_bits)
                             for i, name in enumerate(("bank", "clinic")) for b in sent[name]])
    assert joined.std() == pytest.approx(np.sqrt(study.sigma ** 2 + np.mean(rows ** 2)), rel=0.15)


def decisions(c, j: int) -> dict[str, float]:
    """Server j's dpsketch_verify_decisions_total by source, scraped over HTTP."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{c.server_urls[j]}/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {c.specs[j].operator_token}"}).text
    return {s.labels["source"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "dpsketch_verify_decisions" for s in f.samples if s.name.endswith("_total")}


# --- attacks -------------------------------------------------------------------------------------

def prove_block(study: Study, party: int, pseudonym: bytes, inputs: np.ndarray, full: int, stream: Keystream,
                proof: np.ndarray | None = None) -> V.Proved:
    """What a malicious party sends for arbitrary input digits of one block (the round attacks'
    forger, bound and proved as the party's block), or carrying ``proof`` (made for another block)."""
    return prove_inputs(study, inputs, full, stream, proof, block=(party, pseudonym))


def whole_proof(study: Study, party: int, batch, i: int) -> np.ndarray:
    """Block i's proof, summed from its shares (what its party made)."""
    plan = V.party_plan(study, party)
    total = None
    for j in range(study.n_servers):
        if batch.seeds[j] is None:
            part = batch.shares[j][i:i + 1, plan.input_len:]
        else:
            part = flp.expand_share(plan.circuit, batch.seeds[j][i:i + 1])[1]
        total = part if total is None else field.add(total, part)
    return total


def post(url: str, study: Study, media_type: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body, timeout=60,
                      headers={"Content-Type": media_type})


def upload_blocks(cluster, study: Study, name: str, ids, pseudonyms, binding_proofs, leader, seeds) -> None:
    """Each server's raw body of these blocks: the leader's shares, a helper's seeds."""
    for j, url in enumerate(cluster.server_urls):
        if seeds[j] is None:
            body = messages.encode_blocks(list(ids), list(pseudonyms), binding_proofs[j], leader)
        else:
            body = messages.encode_block_seeds(list(ids), list(pseudonyms), binding_proofs[j], seeds[j])
        r = post(url, study, messages.blocks_media_type(name, seeds[j] is not None), body)
        assert r.status_code == 200, r.text


def upload_prepared(cluster, study: Study, batch) -> None:
    upload_blocks(cluster, study, batch.party, batch.report_ids, batch.pseudonyms, batch.proofs,
                  next(s for s in batch.shares if s is not None), batch.seeds)


def upload_proved(cluster, study: Study, name: str, pseudonym: bytes, proved: V.Proved) -> None:
    upload_blocks(cluster, study, name, proved.report_ids, [pseudonym], proved.binding, proved.leader, proved.seeds)


def honest_individuals(cluster, study: Study, n: int, extra: int, seed: int, key: bytes, clinic_full: int):
    """Honest blocks uploaded: the bank's of individuals 0..n-1 (leader server 0), the clinic's of
    all n + extra (leader ``clinic_full``), from one keystream. (pseudonyms, rows, the keystream,
    the bank's and the clinic's prepared batches)."""
    ps = parties.pseudonyms(parties.new_key(), study.study_id, [f"p{i}" for i in range(n + extra)])
    rows = data(n + extra, seed=seed)
    stream = Keystream.from_key(key * 32)
    bank = report.prepare_blocks(study, "bank", ps[:n], rows[:n, COLS["bank"]], stream, full=0)
    clinic = report.prepare_blocks(study, "clinic", ps, rows[:, COLS["clinic"]], stream, full=clinic_full)
    upload_prepared(cluster, study, bank)
    upload_prepared(cluster, study, clinic)
    return ps, rows, stream, bank, clinic


def far_block(study: Study, pseudonym: bytes, stream: Keystream, full: int) -> V.Proved:
    """The issue's attack as a bank block: its first coordinate at 40,000 times the party's bound,
    the norm equation made to hold in F_p by an out-of-range digit and the slack, proved by the
    prover on those digits (so every server stores it; only the round can refuse it)."""
    circ = V.party_plan(study, 0).circuit
    w, q = circ.w, circ.q
    r = int(circ.r2 ** 0.5)
    far = np.zeros((1, circ.input_len), dtype=np.uint64)
    far[0, :w * q] = to_digits(np.full((1, w), circ.half, dtype=np.uint64), circ.beta, q)[0]  # u = 0
    far[0, 0] = (int(far[0, 0]) + 40_000 * r) % field.P
    far[0, w * q] = (circ.r2 - (40_000 * r) ** 2) % field.P
    return prove_block(study, 0, pseudonym, far, full, stream)


def test_a_malicious_partys_blocks_are_refused_everywhere_and_their_individuals_left_out_whole(no_floor_module_cluster):
    c = no_floor_module_cluster
    n = 300
    study = create(c, n, "vp-attacks")
    # honest blocks: the bank's of individuals 0..n-1, the clinic's of all n + 3 (the last three
    # get a bank block only from the attacker below)
    ps, rows, stream, bank, clinic = honest_individuals(c, study, n, 3, seed=11, key=b"\x3c", clinic_full=2)
    plan = V.party_plan(study, 0)
    circ = plan.circuit
    attacks: dict[str, bytes] = {}
    # 1. individual n: the bank's block at 40,000 times its bound, proved for its digits
    forged = far_block(study, ps[n], stream, full=1)
    upload_proved(c, study, "bank", ps[n], forged)
    attacks["far outside its bound"] = forged.report_ids[0]
    # 2. individual n + 1: a valid block whose leader's proof share is altered after proving
    #    (the id does not bind it): the proof holds at two servers' shares only
    units = V.grid_units(plan, ring.encode_on_grid(rows[n + 1:n + 2, COLS["bank"]] * 0.5, study.frac_bits,
                                                   study.noise_grid.shift, study.value_bound).view(np.uint64))
    bad = prove_block(study, 0, ps[n + 1], circ.encode(units), 2, stream)
    bad.leader[0, plan.input_len + 3] = int(field.add(np.uint64(bad.leader[0, plan.input_len + 3]), np.uint64(1)))
    upload_proved(c, study, "bank", ps[n + 1], bad)
    attacks["a bad proof"] = bad.report_ids[0]
    # 3. individual n + 2: honest individual 0's bank block (a valid proof) replayed under another
    #    pseudonym: its shares re-bound to the new pseudonym (as an upload needs), its proof kept
    inputs0 = circ.encode(V.grid_units(plan, joined_vectors(study, bank, 0)[:1]))
    replay = prove_block(study, 0, ps[n + 2], inputs0, 0, stream, proof=whole_proof(study, 0, bank, 0))
    upload_proved(c, study, "bank", ps[n + 2], replay)
    attacks["replayed under another pseudonym"] = replay.report_ids[0]
    # 4. the bank's block of individual 1 (a valid proof) replayed as the clinic's block (the two
    #    parties have the same width) of a fresh individual: re-bound under party 1 and the new
    #    pseudonym, its proof kept; the individual also gets an honest bank block, so it is complete
    extra = parties.pseudonyms(parties.new_key(), study.study_id, ["replayed-into-clinic"])[0]
    inputs1 = V.party_plan(study, 1).circuit.encode(V.grid_units(plan, joined_vectors(study, bank, 0)[1:2]))
    cross = prove_block(study, 1, extra, inputs1, 1, stream, proof=whole_proof(study, 0, bank, 1))
    upload_proved(c, study, "clinic", extra, cross)
    own = report.prepare_blocks(study, "bank", [extra], rows[:1, COLS["bank"]], stream, full=1)
    upload_prepared(c, study, own)
    attacks["replayed under another party"] = cross.report_ids[0]
    # 5. the same bytes relabelled to another party: the block id commits to the party, 422
    body = messages.encode_blocks(bank.report_ids[:5], bank.pseudonyms[:5], bank.proofs[0][:5], bank.shares[0][:5])
    r = post(c.server_urls[0], study, messages.blocks_media_type("clinic"), body)
    assert r.status_code == 422 and r.json()["type"].endswith("binding-refused"), r.text

    attacked = {ps[n], ps[n + 1], ps[n + 2], extra}
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        before = an.progress(study.study_id)
        assert before["parties"]["complete"] == n + 4  # every attacked individual is complete
        fin = an.finalize(study.study_id)
        served = np.array(an.sketch(study.study_id)["sketch"])
    assert fin["state"] == "released" and fin["n_reports"] == n
    v = fin["verification"]
    assert v["decided"] == 2 * (n + 4) and v["refused"] == len(attacks)
    assert v["refused_by_server"] == {"s1": len(attacks), "s2": len(attacks), "s3": len(attacks)}
    # the inclusion set is every block of the n honest individuals: the attacked ones are out
    # whole, their honest clinic (or bank) block included
    honest_ids = sorted(bank.report_ids + clinic.report_ids[:n])
    assert fin["inclusion_hash"] == messages.inclusion_hash(honest_ids)
    keep = set(ps[:n])
    assert not keep & attacked
    np.testing.assert_array_equal(served, expected_release(study, {"bank": [bank], "clinic": [clinic]}, keep))
    # and the far block would have moved it: its first coordinate is 40,000 bounds away
    coords = None
    for j in range(3):
        share = (forged.leader[:, :plan.input_len] if forged.seeds[j] is None
                 else flp.expand_share(circ, forged.seeds[j])[0])
        part = V.coordinate_shares(plan, share)
        coords = part if coords is None else field.add(coords, part)
    assert abs(ring.decode(V.to_ring(coords), study.frac_bits)[0, 0]) > 1000 * study.parties[0].row_bound


def test_malformed_proved_block_uploads_get_4xx_and_change_nothing(no_floor_module_cluster):
    c = no_floor_module_cluster
    study = create(c, 200, "vp-malformed")
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        unproved = Study.model_validate(an.create_study(name="vp-unproved", label="y", expected_reports=200, k=16,
                                                        s=4, parties=PARTIES, epsilon_floor=None)["study"])
    assert unproved.validity is None
    key = parties.new_key()
    ps = parties.pseudonyms(key, study.study_id, [f"m{i}" for i in range(4)])
    block = report.prepare_blocks(study, "bank", ps, data(4, seed=3)[:, :2], full=0)
    seeds = messages.encode_block_seeds(block.report_ids, block.pseudonyms, block.proofs[1], block.seeds[1])
    leader = block.shares[0]
    plan = V.party_plan(study, 0)
    bad = leader.copy()
    bad[1, plan.input_len + 2] = np.uint64(field.P + 5)  # a proof-share value >= p
    tampered = leader.copy()
    tampered[2, 0] = (int(tampered[2, 0]) + 1) % field.P  # an input share changed after binding
    u0, u1 = c.server_urls[0], c.server_urls[1]
    attempts = [
        (u0, messages.blocks_media_type("bank"),
         messages.encode_blocks(block.report_ids, block.pseudonyms, block.proofs[0], bad), 400, "malformed-body"),
        (u0, messages.blocks_media_type("bank"),
         messages.encode_blocks(block.report_ids, block.pseudonyms, block.proofs[0], tampered), 422, "binding-refused"),
        (u1, messages.blocks_media_type("bank", True), seeds[:-5], 400, "malformed-body"),  # cut short
        (u1, messages.blocks_media_type("bank"), seeds, 400, "malformed-body"),  # seeds as a leader's record
        (u1, messages.blocks_media_type("bank"),  # the leader's record at a helper
         messages.encode_blocks(block.report_ids, block.pseudonyms, block.proofs[0], leader), 422, "binding-refused"),
        (u1, messages.blocks_media_type("clinic", True), seeds, 422, "binding-refused"),  # relabelled party
        (u1, messages.BLOCK_SEEDS_MEDIA_TYPE, seeds, 415, "unsupported-media-type"),  # no party named
    ]
    for url, media, body, status, slug in attempts:
        r = httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body, timeout=60,
                       headers={"Content-Type": media})
        assert (r.status_code, r.json()["type"]) == (status, f"urn:dpsketch:problem:{slug}"), (media, r.text)
    # block seeds to a study with parties but no proofs: 415 in the clear, 400 sealed (content 0x04)
    r = httpx.post(f"{u1}/v1/studies/{unproved.study_id}/batches", content=seeds, timeout=60,
                   headers={"Content-Type": messages.blocks_media_type("bank", True)})
    assert r.status_code == 415 and r.json()["type"].endswith("unsupported-media-type"), r.text
    with Client(c.server_urls, encrypt=True) as sealer:
        sealer.study(unproved.study_id)
        recipient = sealer._recipients[unproved.study_id][1]
    sealed = envelope.seal_body(recipient, unproved.study_id, seeds, messages.blocks_media_type("bank", True),
                                2, 3, party=0)
    r = httpx.post(f"{u1}/v1/studies/{unproved.study_id}/batches", content=sealed, timeout=60,
                   headers={"Content-Type": f"{messages.SEALED_MEDIA_TYPE}; party=bank"})
    assert r.status_code == 400 and r.json()["type"].endswith("malformed-body"), r.text
    # nothing was stored anywhere
    for url, s in ((u0, study), (u1, study), (u1, unproved)):
        info = httpx.get(f"{url}/v1/studies/{s.study_id}", timeout=30,
                         headers={"Authorization": f"Bearer {c.specs[0 if url == u0 else 1].analyst_token}"}).json()
        assert info["report_count"] == 0 and info["party_counts"] == {"bank": 0, "clinic": 0}


def test_refused_blocks_beyond_the_batch_rule_stop_the_release_before_any_commit(no_floor_module_cluster):
    """A party whose invalid blocks leave out more individuals than a server's batch rule allows
    (max_excluded_fraction 0.1: 15 of 100) makes the analyzer refuse before any commit (422
    inclusion-refused naming the refused blocks): every server still holds its blocks
    uncommitted. (The round closed the study to uploads: this is the availability cost
    docs/trust.md states, bounded by the party's upload quota.)"""
    c = no_floor_module_cluster
    n, bad_n = 100, 15
    study = create(c, n, "vp-batch-rule")
    key = parties.new_key()
    ps = parties.pseudonyms(key, study.study_id, [f"b{i}" for i in range(n)])
    rows = data(n, seed=19)
    stream = Keystream.from_key(b"\x4d" * 32)
    upload_prepared(c, study, report.prepare_blocks(study, "clinic", ps, rows[:, COLS["clinic"]], stream, full=1))
    upload_prepared(c, study, report.prepare_blocks(study, "bank", ps[bad_n:], rows[bad_n:, COLS["bank"]], stream))
    plan = V.party_plan(study, 0)
    for i in range(bad_n):  # valid digits, the leader's proof share altered after proving
        units = V.grid_units(plan, ring.encode_on_grid(rows[i:i + 1, COLS["bank"]] * 0.5, study.frac_bits,
                                                       study.noise_grid.shift, study.value_bound).view(np.uint64))
        bad = prove_block(study, 0, ps[i], plan.circuit.encode(units), i % 3, stream)
        bad.leader[0, plan.input_len] = int(field.add(np.uint64(bad.leader[0, plan.input_len]), np.uint64(1)))
        upload_proved(c, study, "bank", ps[i], bad)
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        r = httpx.post(f"{c.analyzer.url}/v1/studies/{study.study_id}/finalize", timeout=120,
                       headers={"Authorization": f"Bearer {c.api_token}"})
        assert r.status_code == 422 and r.json()["type"].endswith("inclusion-refused"), r.text
        assert "refused" in r.json()["detail"] and r.json()["excluded"] == bad_n and r.json()["held"] == n
        progress = an.progress(study.study_id)
    assert progress["verification"]["refused"] == bad_n
    for url in c.server_urls:
        assert httpx.get(f"{url}/v1/studies/{study.study_id}", timeout=30).json()["status"] == "open"
