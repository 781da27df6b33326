"""The verification round of a study with parties, seen by the analyzer and attacked by it
(docs/protocol.md section 6d, docs/validity.md section 13), over real processes: three share
servers and the analyzer as uvicorn processes on loopback ports, real SQLite files, every block
uploaded as a raw body with httpx, the round's steps run by this test as an analyzer would (or
as a lying one would).

Blocks are verified as reports are, with their party's circuit and the messages padded to the
widest party's verifier length, so the two properties the issue asks of the round must hold for
blocks too:

* What the analyzer sees of an honest block's verification has the same law for two different
  blocks: each server's verifier share and their sum, coordinate by coordinate (chi-square on the
  top bits over 2 x 1,500 blocks of one party), and the padding carries nothing (zero).
* A lying analyzer can make a server drop honest blocks (told a wrong sum) and one server accept
  an invalid block (told minus its own share), but a server told the truth refuses the invalid
  block and any commit that holds it; what the liar can release at every server is the honest
  individuals less its victims, whole (both parties' blocks), bit for bit.
"""

from __future__ import annotations

import httpx
import numpy as np

from dpsketch.protocol import field, messages, parties, ring, sketch
from dpsketch.protocol import validity as V
from dpsketch.protocol.keystream import Keystream
from test_e2e import no_floor_module_cluster  # noqa: F401 (a fixture)
from test_validity_parties_e2e import create, expected_release, far_block, honest_individuals, upload_blocks, \
    upload_proved
from test_validity_round_attacks import _same_law, _top_bits, commit_ids, decide_with, query_every_server


def _others(views, j: int) -> np.ndarray:
    """What an honest analyzer tells server j: every other server's verifier shares, summed."""
    total = None
    for i, (_ids, shares) in enumerate(views):
        if i != j:
            total = shares.copy() if total is None else V.add_verifiers(total, shares)
    return total


def test_the_analyzers_view_of_block_verification_has_the_same_law_for_two_blocks(no_floor_module_cluster):
    """1,500 blocks of one value and 1,500 of another (the bank's two columns; fresh randomness
    every time) through the real servers' query: each server's verifier share and their sum have
    the same law for both, coordinate by coordinate; every coordinate past the bank's own verifier
    length (the padding to the clinic's) is zero in every message; the sum verifies."""
    c = no_floor_module_cluster
    draws = 1500
    study = create(c, 2 * draws, "vp-law")
    bank = V.party_plan(study, 0)
    width = V.verifier_len(study)
    grid = study.noise_grid
    key = parties.new_key()
    values = {"a": np.zeros(2), "b": np.array([0.6, -0.5])}
    ids_of: dict[str, set[bytes]] = {}
    for label, value in values.items():
        units = np.repeat(np.round(value / grid.spacing).astype(np.int64)[None], draws, axis=0)
        encoded = (units << bank.shift).view(np.uint64) if bank.shift else units.view(np.uint64)
        pseudonyms = parties.pseudonyms(key, study.study_id, [f"{label}{i}" for i in range(draws)])
        proved = V.prepare(study, encoded, Keystream.from_key(label.encode() * 32), 0, party=0,
                           pseudonyms=pseudonyms)
        upload_blocks(c, study, "bank", proved.report_ids, pseudonyms, proved.binding, proved.leader, proved.seeds)
        ids_of[label] = set(proved.report_ids)
    tokens, urls = [s.analyst_token for s in c.specs], c.server_urls
    views = query_every_server(urls, tokens, study, width)
    ids = [bytes(r) for r in views[0][0]]
    assert set(ids) == ids_of["a"] | ids_of["b"]
    group = np.array([rid in ids_of["a"] for rid in ids])
    total = views[0][1]
    for _ids, shares in views[1:]:
        total = V.add_verifiers(total, shares)
    assert V.decide(bank, views[0][0], total[:, :bank.verifier_len]).all()
    assert bank.verifier_len <= width
    p_values = []
    for shares in [s for _i, s in views] + [total]:
        assert (shares[:, bank.verifier_len:] == 0).all()  # the padding: nothing
        for k in range(1, bank.verifier_len):
            for comp in (0, 1):
                p_values.append(_same_law(_top_bits(shares[group, k, comp]), _top_bits(shares[~group, k, comp])))
    # 4 views x (V - 1) x 2 coordinates = 64 p-values, none below 1e-5 / 64 (Bonferroni: a false
    # alarm in at most 1 run in 10^5; a leak of the block would put these near 0). The servers'
    # query randomness is fresh every run: with the old 1e-5 per p-value (8.8e-6 each over 4e6
    # simulated 2 x 8 tables of 1500 + 1500) about 1 run in 1800 failed.
    assert len(p_values) >= 8 and min(p_values) > 1e-5 / len(p_values), (min(p_values), len(p_values))


def test_what_a_lying_analyzer_can_and_cannot_do_with_blocks(no_floor_module_cluster):
    """Honest individuals (both parties' blocks) and one whose bank block is 40,000 times the
    bank's bound with a proof made for it. The liar tells s2 a wrong sum for five honest bank
    blocks and tells s3 minus its own share for the invalid block. s1 (told the truth) refuses
    the invalid block, s2 the invalid block and its five victims, s3 nothing; s1 refuses a commit
    holding the invalid individual, s2 one holding the victims; the liar's release, at every
    server, is the honest individuals less the victims, both blocks of each left out."""
    c = no_floor_module_cluster
    n = 150
    study = create(c, n + 1, "vp-liar")
    ps, _rows, stream, bank, clinic = honest_individuals(c, study, n, 1, seed=21, key=b"\x5a", clinic_full=1)
    forged = far_block(study, ps[n], stream, full=2)
    upload_proved(c, study, "bank", ps[n], forged)
    bad = forged.report_ids[0]

    tokens, urls = [s.analyst_token for s in c.specs], c.server_urls
    views = query_every_server(urls, tokens, study, V.verifier_len(study))
    ids = views[0][0]
    position = {bytes(rid): i for i, rid in enumerate(ids)}
    bodies = [_others(views, j) for j in range(3)]
    victims = bank.report_ids[10:15]
    rows_of = [position[v] for v in victims]
    bodies[1][rows_of, 1, 0] = field.add(bodies[1][rows_of, 1, 0], np.uint64(1))
    bodies[2][position[bad]] = field.sub(np.zeros_like(views[2][1][position[bad]]), views[2][1][position[bad]])
    refused = decide_with(urls, tokens, study, ids, bodies)
    assert refused[0] == {bad}
    assert refused[1] == {bad} | set(victims)
    assert refused[2] == set()  # told what to decide

    def commit(j: int, included) -> httpx.Response:
        return commit_ids(urls[j], tokens[j], study, included)

    everyone = set(bank.report_ids) | set(clinic.report_ids) | {bad}
    r = commit(0, everyone - set(victims) - {clinic.report_ids[i] for i in range(10, 15)})
    assert r.status_code == 422 and r.json()["type"].endswith("report-refused") and r.json()["refused"] == 1, r.text
    r = commit(1, everyone - {bad, clinic.report_ids[n]})
    assert r.status_code == 422 and r.json()["refused"] == 5, r.text  # the victims
    # what the lying analyzer can release: the honest individuals less its victims, whole
    keep = set(ps[:n]) - set(ps[10:15])
    kept = {rid for batch in (bank, clinic) for rid, p in zip(batch.report_ids, batch.pseudonyms) if p in keep}
    answers = [commit(j, kept) for j in range(3)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    total = None
    for u, t in zip(urls, tokens):
        got = httpx.get(f"{u}/v1/studies/{study.study_id}/aggregate", headers={"Authorization": f"Bearer {t}"})
        share = messages.decode_aggregate(got.content, study.k, study.width)
        total = share if total is None else field.add(total, share)
    released = ring.decode(V.to_ring(total), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(released, expected_release(study, {"bank": [bank], "clinic": [clinic]}, keep))
