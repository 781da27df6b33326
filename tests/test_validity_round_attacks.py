"""A validity study's verification round attacked over real processes (docs/protocol.md section
6d): three share servers and the analyzer as uvicorn processes on loopback ports, real SQLite
files, every report uploaded as a raw batch body with httpx, the round run by the analyzer's
finalize (or step by step, as an adversary or a crash would have it).

* Invalid reports, each correctly bound to its id so that every server stores it, are refused
  at every server and the release is exactly the sketch of the honest reports alone: a vector
  far outside the bound with a proof made for it (the issue's attack: one coordinate at 40,000
  times the bound), a vector with every coordinate in range but twice the norm, a valid proof
  replayed with another report's shares, shares tampered after proving (re-bound, the old
  proof kept), a proof that holds at N - 1 servers' shares only.
* SIGKILL of a server between any two steps: it comes back with the same commitment, seed and
  decisions, and the analyzer's finalize completes the round; uploads after a server's commit
  are refused (409 uploads-closed).
* A lying analyzer (this test, over HTTP) makes a server drop five honest reports (a wrong sum):
  that server refuses any commit holding them, and the release it can get leaves them out; it
  makes a server accept the invalid reports (minus its own share), but the servers told the
  truth refuse every commit holding them.
* (slow) 10^5 honest rows through the SDK: none refused.
* Two replicas of one server on PostgreSQL: once one answered verify/commit, the other stores no
  more uploads of the study.
* What the analyzer sees of an honest report's verification has the same law for two different
  rows (chi-square on the top bits of every coordinate of each server's verifier share and of
  their sum, over 2 x 1,500 reports).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import pytest
from scipy import stats

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import prepare
from dpsketch.protocol import report as report_path
from dpsketch.analyzer.release import release_from_ring_sum
from dpsketch.protocol import Study, binding, features, field, flp, messages, ring, sketch
from dpsketch.protocol import validity as V
from dpsketch.protocol.circuits import to_digits
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.verification import QUERY_SEED_HEADER
from test_e2e import direct_sketch, no_floor_module_cluster  # noqa: F401 (a fixture)

COLUMNS = ["x0", "x1", "x2", "y"]


def create(cluster, n: int, name: str) -> Study:
    # min_reports at most 2/3 of n: the analyzer draws the sketch seed and the report ids are
    # fresh, and the crash test releases all 120 of its reports; against min_reports 100,
    # lambda_min / lambda_star of 120 such ids (k = 16) was 1.72 +- 0.16 in 12,000 simulated
    # draws, none below 1 but 1.06 at worst, a long left tail (at k = 8 and 117 ids, 18 of
    # 30,000 fell below 1); against 80: 2.54 +- 0.24, 1.61 at worst in 5000
    with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as an:
        view = an.create_study(name=name, columns=COLUMNS, label="y", expected_reports=n, k=16, s=4,
                               min_reports=min(n * 2 // 3, 100), epsilon_floor=None, validity=True)
    study = Study.model_validate(view["study"])
    assert study.validity == "norm-bound/1" and "Kind: auto chose sketch" in view["explanation"][0]
    return study


def honest(study: Study, n: int, seed: int, full: int = 0):
    """n honest reports (rows of norm <= 1, the SDK's noise): their ring vectors and proofs."""
    rows = np.random.default_rng(seed).normal(0, 0.3, (n, study.d))
    stream = Keystream.from_key(bytes([seed % 256]) * 32)
    encoded = report_path.noisy_encoded(prepare.signed_vectors(rows, study, stream), study, stream)
    return encoded, V.prepare(study, encoded, stream, full=full)


def prove_inputs(study: Study, inputs: np.ndarray, full: int, stream: Keystream,
                 proof: np.ndarray | None = None, block: tuple[int, bytes] | None = None) -> V.Proved:
    """What a malicious client sends for arbitrary input digits: shared and bound as a client
    shares and binds (so every server stores it), proved by the honest prover code on whatever
    it is given, or carrying ``proof`` (one made for other inputs and another id). ``block``
    (party index, pseudonym): one block of a study with parties, bound and proved as that
    party's (tests/test_validity_parties_e2e.py)."""
    plan = V.plan(study) if block is None else V.party_plan(study, block[0])
    c, n = plan.circuit, plan.n_servers
    shares = flp.share_inputs(c, inputs, n, stream)
    helpers = iter(shares.helper_seeds)
    seeds = [None if j == full else next(helpers) for j in range(n)]
    contents = [binding.CONTENT_SHARE if s is None else binding.CONTENT_SEED for s in seeds]
    payloads = [shares.leader_inputs if s is None else s for s in seeds]
    prefixes = None if block is None else binding.block_prefixes(study.study_id, block[0], [block[1]])
    ids, proofs = binding.bind(study.study_id, contents, payloads, prefixes, stream=stream)
    if proof is None:
        proof = flp.prove(c, inputs, flp.joint_rand(c, ids), flp.prove_rand(c, len(ids), stream))
    flp.share_proofs(shares, proof)
    return V.Proved(ids, proofs, full, np.concatenate([shares.leader_inputs, shares.leader_proofs], axis=1), seeds)


def whole_proof(study: Study, proved: V.Proved, i: int) -> np.ndarray:
    """Report i's proof, summed from its shares (what its client made)."""
    plan = V.plan(study)
    total = proved.leader[i:i + 1, plan.input_len:]
    for s in proved.seeds:
        if s is not None:
            total = field.add(total, flp.expand_share(plan.circuit, s[i:i + 1])[1])
    return total


def upload(cluster, study: Study, proved: V.Proved, rows=None) -> None:
    """Each server's raw batch body (the leader's shares, a helper's seeds), over HTTP."""
    take = slice(None) if rows is None else rows
    ids = list(np.array(proved.report_ids, dtype=object)[take])
    for j, url in enumerate(cluster.server_urls):
        if proved.seeds[j] is None:
            body = messages.encode_batch(ids, proved.binding[j][take], proved.leader[take])
            media = messages.SHARES_MEDIA_TYPE
        else:
            body = messages.encode_seed_batch(ids, proved.binding[j][take], proved.seeds[j][take])
            media = messages.SEEDS_MEDIA_TYPE
        r = httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body, timeout=60,
                       headers={"Content-Type": media})
        assert r.status_code == 200, r.text


def invalid_reports(study: Study, honest_proved: V.Proved, honest_encoded: np.ndarray) -> dict[str, V.Proved]:
    """One of each attack, each correctly bound (every server stores it)."""
    plan = V.plan(study)
    c = plan.circuit
    w, q = c.w, c.q
    r = int(c.r2 ** 0.5)
    stream = Keystream.from_key(b"\xa7" * 32)
    zero = to_digits(np.full((1, w), c.half, dtype=np.uint64), c.beta, q)[0]  # u = 0
    out = {}
    # the attack: coordinate 0 at 40,000 times the bound, the norm equation made to hold
    # in F_p by an out-of-range digit and the slack; proved by the prover on those digits
    far = np.zeros((1, c.input_len), dtype=np.uint64)
    far[0, :w * q] = zero
    far[0, 0] = (int(zero[0]) + 40_000 * r) % field.P
    far[0, w * q] = (c.r2 - (40_000 * r) ** 2) % field.P
    out["far outside, forged proof"] = prove_inputs(study, far, 0, stream)
    # every coordinate in range, twice the norm; slack digits in range: the norm equation fails
    big = min(c.half - 1, 2 * r // int(w ** 0.5) + 1)
    twice = np.concatenate([to_digits(np.full((1, w), c.half + big, dtype=np.uint64), c.beta, q)[0],
                            np.zeros(c.slack_digits, dtype=np.uint64)])[None]
    out["twice the norm"] = prove_inputs(study, twice, 1, stream)
    # a valid proof (honest report 0's) replayed with another valid vector's shares
    other = c.encode(V.grid_units(plan, honest_encoded[5:6]) // 2)
    out["replayed proof"] = prove_inputs(study, other, 2, stream, proof=whole_proof(study, honest_proved, 0))
    # shares tampered after proving: one digit of honest report 1 moved within range, shared
    # and re-bound (as the upload needs), the proof kept
    inputs = c.encode(V.grid_units(plan, honest_encoded[1:2]))
    inputs[0, 0] = (int(inputs[0, 0]) + 1) % c.beta
    out["tampered after proving"] = prove_inputs(study, inputs, 0, stream, proof=whole_proof(study, honest_proved, 1))
    # a proof valid at N - 1 servers' shares: a valid report whose leader's proof share (which
    # the id does not bind) is altered in one element
    valid = prove_inputs(study, c.encode(V.grid_units(plan, honest_encoded[7:8])), 1, stream)
    valid.leader[0, plan.input_len + 3] = int(field.add(np.uint64(valid.leader[0, plan.input_len + 3]), np.uint64(1)))
    out["one server's share altered"] = valid
    return out


def honest_and_invalid(cluster, n: int, name: str, seed: int):
    """A validity study holding n honest reports and the invalid ones of :func:`invalid_reports`,
    uploaded to every server: (study, honest ring vectors, honest batch, attacks, their ids)."""
    study = create(cluster, n, name)
    encoded, proved = honest(study, n, seed=seed)
    upload(cluster, study, proved)
    attacks = invalid_reports(study, proved, encoded)
    for bad in attacks.values():
        upload(cluster, study, bad)
    return study, encoded, proved, attacks, {rid for bad in attacks.values() for rid in bad.report_ids}


def released(cluster, study: Study) -> np.ndarray:
    with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as an:
        return np.array(an.sketch(study.study_id)["sketch"])


def expected(study: Study, ids: list[bytes], encoded: np.ndarray) -> np.ndarray:
    return ring.decode(direct_sketch(study, ids, encoded), study.frac_bits) * sketch.scale(study.s)


def test_invalid_reports_are_refused_everywhere_and_the_release_is_as_without_them(no_floor_module_cluster):
    c = no_floor_module_cluster
    n = 300
    study, encoded, proved, attacks, bad_ids = honest_and_invalid(c, n, "attacks", seed=3)
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        assert [s["report_count"] for s in an.progress(study.study_id)["servers"]] == [n + len(attacks)] * 3
        fin = an.finalize(study.study_id)
        progress = an.progress(study.study_id)
    assert fin["state"] == "released" and fin["n_reports"] == n
    v = fin["verification"]
    assert v["decided"] == n + len(attacks) and v["refused"] == len(attacks)
    assert v["refused_by_server"] == {"s1": len(attacks), "s2": len(attacks), "s3": len(attacks)}
    assert progress["verification"] == v
    assert fin["inclusion_hash"] == messages.inclusion_hash(sorted(proved.report_ids))
    assert not bad_ids & set(proved.report_ids)
    # the release is exactly the sketch of the honest reports: as if the invalid ones were absent
    np.testing.assert_array_equal(released(c, study), expected(study, proved.report_ids, encoded))
    # and an invalid report would have moved it: the attack alone is 40,000 bounds away
    far = attacks["far outside, forged proof"]
    coords = field.add(V.coordinate_shares(V.plan(study), far.leader[:, :V.plan(study).input_len]),
                       V.coordinate_shares(V.plan(study), flp.expand_share(V.plan(study).circuit, far.seeds[1])[0]))
    coords = field.add(coords, V.coordinate_shares(V.plan(study), flp.expand_share(V.plan(study).circuit,
                                                                                     far.seeds[2])[0]))
    assert abs(ring.decode(V.to_ring(coords), study.frac_bits)[0, 0]) > 1000 * study.row_bound


def gram_attacks(study: Study, honest_proved: V.Proved, witness: np.ndarray) -> dict[str, V.Proved]:
    """The gram study's attacks (circuit GramNorm), each correctly bound (every server stores
    it) and proved by the honest prover code on whatever it is given."""
    c = V.plan(study).circuit
    h = study.noise_grid.spacing
    stream = Keystream.from_key(b"\xa9" * 32)
    zero_noise = np.zeros((1, c.w), dtype=np.int64)
    honest_inputs = c.encode(witness[:1], zero_noise)
    out = {}
    # the attack: -10,935 added to the x1*y feature only (the product P of columns 1 and 3)
    k = c.d + list(zip(*np.triu_indices(c.d, k=1), strict=True)).index((1, 3))
    x = honest_inputs.copy()
    x[0, c.at_products + k] = field.add(x[0, c.at_products + k], field.encode_int(np.array([round(-10_935 / h)]))[0])
    out["x1*y moved by -10,935"] = prove_inputs(study, x, 0, stream)
    # the Gram diagonal at -115,657 (no row's square is negative)
    x = honest_inputs.copy()
    x[0, c.at_products] = field.encode_int(np.array([round(-115_657 / h)]))[0]
    out["negative square"] = prove_inputs(study, x, 1, stream)
    # the sketch table's row [1000, 0, -40000] with its true products: the row's digits out of
    # range, the row slack made to hold mod p
    r = np.array([[round(1000 / h ** 0.5), 0, round(-40_000 / h ** 0.5), 0]], dtype=object)
    x = honest_inputs.copy()
    x[0, :c.at_products] = to_digits(np.full((1, c.d), c.half_row, dtype=np.uint64), c.beta, c.q_row)[0]
    for i in (0, 2):
        x[0, i * c.q_row] = (int(x[0, i * c.q_row]) + int(r[0, i])) % field.P
    prods = [int(r[0, i]) * int(r[0, j]) % field.P for i, j in zip(*c.pairs, strict=True)]
    x[0, c.at_products:c.at_noise] = np.array(prods, dtype=np.uint64)
    row_slack = (c.r2_row - sum(int(v) ** 2 for v in r[0])) % field.P
    x[0, c.at_row_slack:c.at_slack] = 0
    x[0, c.at_row_slack] = row_slack
    out["row 4 10^4 B, true products"] = prove_inputs(study, x, 1, stream)
    # honest report 0's proof replayed with another valid report's shares
    other = c.encode(witness[5:6] // 2, zero_noise)
    out["replayed proof"] = prove_inputs(study, other, 0, stream, proof=whole_proof(study, honest_proved, 0))
    return out


def test_gram_attacks_are_refused_everywhere_and_the_release_is_as_without_them(no_floor_module_cluster):
    """The issue's gram attacks over real processes: each refused at every server, and the
    release (the analyzer's Gram, sum and count) is exactly that of the honest reports alone."""
    cl = no_floor_module_cluster
    n = 200
    with AnalyzerClient(cl.analyzer.url, cl.api_token) as an:
        view = an.create_study(name="gram-attacks", columns=COLUMNS, label="y", expected_reports=n, kind="gram",
                               min_reports=100, epsilon_floor=None, validity=True)
    study = Study.model_validate(view["study"])
    rows = np.random.default_rng(8).normal(0, 0.3, (n, study.d))
    clipped = report_path.clipped_rows(rows, study)
    stream = Keystream.from_key(b"\x08" * 32)
    encoded = report_path.noisy_encoded(features.client_vectors("gram", clipped), study, stream)
    proved = V.prepare(study, encoded, stream, full=2, rows=clipped)
    upload(cl, study, proved)
    attacks = gram_attacks(study, proved, V.witness_rows(V.plan(study), clipped))
    for bad in attacks.values():
        upload(cl, study, bad)
    with AnalyzerClient(cl.analyzer.url, cl.api_token) as an:
        fin = an.finalize(study.study_id)
        served = np.array(an.sketch(study.study_id)["sketch"]).reshape(-1)
    assert fin["state"] == "released" and fin["n_reports"] == n
    assert fin["verification"]["refused_by_server"] == {"s1": len(attacks), "s2": len(attacks), "s3": len(attacks)}
    total = np.zeros(study.width, dtype=np.uint64)
    for row in encoded:
        total += row  # wraps mod 2^64, as the ring sum
    np.testing.assert_array_equal(served, release_from_ring_sum(study, total[None], n).values)


def _step(url: str, token: str, study: Study, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/studies/{study.study_id}/verify/{path}", timeout=60,
                      headers={"Authorization": f"Bearer {token}", **kw.pop("headers", {})}, **kw)


def query_every_server(urls, tokens, study: Study, plan) -> list:
    """The round's first three steps as an analyzer would run them (commit, reveal, query at
    every server): each server's (ids, verifier shares)."""
    commitments = [_step(u, t, study, "commit").json()["commitment"] for u, t in zip(urls, tokens)]
    contributions = [_step(u, t, study, "reveal", json={"commitments": commitments}).json()["contribution"]
                     for u, t in zip(urls, tokens)]
    return [V.decode_verifiers(_step(u, t, study, "query", json={"contributions": contributions}).content, plan)
            for u, t in zip(urls, tokens)]


def test_a_server_killed_between_any_two_steps_comes_back_with_the_same_round(no_floor_module_cluster):
    c = no_floor_module_cluster
    n = 120
    study = create(c, n, "crash")
    encoded, proved = honest(study, n, seed=4)
    upload(c, study, proved)
    attacks = invalid_reports(study, proved, encoded)
    bad = attacks["one server's share altered"]
    upload(c, study, bad)
    plan = V.plan(study)
    tokens = [s.analyst_token for s in c.specs]
    urls = c.server_urls

    def kill_and_restart(j: int) -> None:
        c.procs[j].kill()
        c.procs[j].start()

    commitments = [_step(u, t, study, "commit").json()["commitment"] for u, t in zip(urls, tokens)]
    # uploads are closed from the commit on, at every server
    late_encoded, late = honest(study, 2, seed=5)
    r = httpx.post(f"{urls[0]}/v1/studies/{study.study_id}/batches", timeout=60,
                   content=messages.encode_batch(late.report_ids, late.binding[0], late.leader),
                   headers={"Content-Type": messages.SHARES_MEDIA_TYPE})
    assert r.status_code == 409 and r.json()["type"].endswith("uploads-closed"), r.text
    kill_and_restart(0)  # between commit and reveal
    assert [_step(u, t, study, "commit").json()["commitment"] for u, t in zip(urls, tokens)] == commitments
    reveal = {"commitments": commitments}
    contributions = [_step(u, t, study, "reveal", json=reveal).json()["contribution"] for u, t in zip(urls, tokens)]
    kill_and_restart(1)  # between reveal and query
    assert [_step(u, t, study, "reveal", json=reveal).json()["contribution"]
            for u, t in zip(urls, tokens)] == contributions
    query = {"contributions": contributions}
    answers = [_step(u, t, study, "query", json=query) for u, t in zip(urls, tokens)]
    seeds = {a.headers[QUERY_SEED_HEADER] for a in answers}
    assert seeds == {V.query_seed(study.study_id, [bytes.fromhex(x) for x in contributions]).hex()}
    # each server kept its answer for its decision (services/verify_cache.py); a SIGKILL keeps it
    kept = [Path(f"{s.db_path}.verify-cache") for s in c.specs]
    assert all(len(list(k.glob(f"{study.study_id}-*.verifiers"))) == 1 for k in kept)
    kill_and_restart(2)  # between query and decide
    assert len(list(kept[2].glob(f"{study.study_id}-*.verifiers"))) == 1
    again = _step(urls[2], tokens[2], study, "query", json=query)
    assert again.content == answers[2].content and again.headers[QUERY_SEED_HEADER] in seeds
    decoded = [V.decode_verifiers(a.content, plan) for a in answers]
    ids = decoded[0][0]

    def others(j: int) -> bytes:
        total = None
        for i, (_ids, shares) in enumerate(decoded):
            if i != j:
                total = shares if total is None else V.add_verifiers(total, shares)
        return V.encode_verifiers(ids, total)

    decide = [_step(u, t, study, "decide", content=others(j),
                    headers={"Content-Type": V.VERIFIERS_MEDIA_TYPE})
              for j, (u, t) in enumerate(zip(urls, tokens))]
    assert all(d.status_code == 200 for d in decide)
    assert {d.content for d in decide} == {messages.encode_report_ids(bad.report_ids)}
    assert not any(list(k.glob(f"{study.study_id}-*")) for k in kept)  # removed once decided
    kill_and_restart(1)  # after decide: the same decision, and a different body is refused
    repeat = _step(urls[1], tokens[1], study, "decide", content=others(1),
                   headers={"Content-Type": V.VERIFIERS_MEDIA_TYPE})
    assert repeat.content == decide[1].content
    lie = _step(urls[1], tokens[1], study, "decide", content=others(0),
                headers={"Content-Type": V.VERIFIERS_MEDIA_TYPE})
    assert lie.status_code == 409 and lie.json()["type"].endswith("verification-conflict")
    # the analyzer (as after its own crash at any of these steps) reruns the whole round: the
    # servers answer the same, and it releases the honest reports
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        fin = an.finalize(study.study_id)
    assert fin["n_reports"] == n and fin["verification"]["query_seed"] in seeds
    assert fin["verification"]["refused_by_server"] == {"s1": 1, "s2": 1, "s3": 1}
    np.testing.assert_array_equal(released(c, study), expected(study, proved.report_ids, encoded))


def decide_with(urls, tokens, study: Study, ids, bodies) -> list[set[bytes]]:
    """Each server's decide step told bodies[j] (what an analyzer, honest or not, sends it):
    the ids each refuses."""
    return [set(messages.split_ids(_step(u, t, study, "decide", content=V.encode_verifiers(ids, bodies[j]),
                                         headers={"Content-Type": V.VERIFIERS_MEDIA_TYPE}).content))
            for j, (u, t) in enumerate(zip(urls, tokens))]


def commit_ids(url: str, token: str, study: Study, included) -> httpx.Response:
    """A commit of exactly these report (or block) ids at one server, as a report-id list."""
    return httpx.post(f"{url}/v1/studies/{study.study_id}/commit", timeout=60,
                      content=messages.encode_report_ids(sorted(included)),
                      headers={"Authorization": f"Bearer {token}", "Content-Type": messages.REPORT_IDS_MEDIA_TYPE})


def _top_bits(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, dtype=np.uint64) >> np.uint64(61)).astype(np.int64)


def _same_law(a: np.ndarray, b: np.ndarray) -> float:
    cats = np.union1d(a, b)
    table = np.array([[np.sum(a == v) for v in cats], [np.sum(b == v) for v in cats]])
    return float(stats.chi2_contingency(table)[1])


def test_the_analyzers_view_of_verifier_messages_has_the_same_law_for_two_rows(no_floor_module_cluster):
    """Two different valid vectors, 1,500 reports each (fresh randomness every time), through the
    real servers' query: each server's verifier share (what the analyzer receives) and their sum
    (what it computes) have the same law for both, coordinate by coordinate (top 3 bits, chi-
    square); v = 0 in the sum, which is all it learns: the proofs hold."""
    c = no_floor_module_cluster
    draws = 1500
    study = create(c, 2 * draws, "law")
    plan = V.plan(study)
    grid = study.noise_grid
    rows = {"a": np.zeros(study.d), "b": np.array([0.6, -0.5, 0.3, 0.4])}
    ids_of = {}
    for label, row in rows.items():
        units = np.repeat(np.round(row / grid.spacing).astype(np.int64)[None], draws, axis=0)
        encoded = (units << plan.shift).view(np.uint64) if plan.shift else units.view(np.uint64)
        stream = Keystream.from_key(label.encode() * 32)
        proved = V.prepare(study, encoded, stream, full=0)
        upload(c, study, proved)
        ids_of[label] = set(proved.report_ids)
    tokens, urls = [s.analyst_token for s in c.specs], c.server_urls
    views = query_every_server(urls, tokens, study, plan)
    ids = [bytes(r) for r in views[0][0]]
    group = np.array([rid in ids_of["a"] for rid in ids])
    total = views[0][1]
    for _ids, shares in views[1:]:
        total = V.add_verifiers(total, shares)
    assert (total[:, 0] == 0).all() and V.decide(plan, views[0][0], total).all()
    p_values = []
    for shares in [s for _i, s in views] + [total]:
        for k in range(1, plan.verifier_len):
            for comp in (0, 1):
                p_values.append(_same_law(_top_bits(shares[group, k, comp]), _top_bits(shares[~group, k, comp])))
    # 4 views x (V - 1) x 2 coordinates = 80 p-values, none below 1e-5 / 80 (Bonferroni: a false
    # alarm in at most 1 run in 10^5; a leak of the row would put these near 0). The law is the
    # same by construction, but the servers' query randomness is fresh every run: with the old
    # 1e-5 per p-value, 35 of 4e6 simulated 2 x 8 tables of 1500 + 1500 fell below it (8.8e-6
    # each), so about 1 run in 1400 failed; below 1.25e-7: 0 of 4e6.
    assert min(p_values) > 1e-5 / len(p_values), (min(p_values), len(p_values))


def test_what_a_lying_analyzer_can_and_cannot_do(no_floor_module_cluster):
    """An analyzer that carries the round's messages dishonestly (here: this test, over HTTP).
    It can make a server drop honest reports: told a wrong sum for five of them, server s2
    refuses them and then any commit that holds them, so the release it can get leaves them out.
    It can make a server accept the invalid reports (told minus its own share, a total of zero,
    which verifies), but the servers told the truth refuse them and refuse any commit that holds
    them: an invalid report reaches no release while one server is told the truth."""
    c = no_floor_module_cluster
    n = 150
    study, encoded, proved, attacks, bad_ids = honest_and_invalid(c, n, "liar", seed=8)
    plan = V.plan(study)
    tokens, urls = [s.analyst_token for s in c.specs], c.server_urls
    views = query_every_server(urls, tokens, study, plan)
    ids = views[0][0]
    position = {bytes(r): i for i, r in enumerate(ids)}
    bodies = []
    for j in range(3):
        total = None
        for i, (_ids, shares) in enumerate(views):
            if i != j:
                total = shares if total is None else V.add_verifiers(total, shares)
        bodies.append(total.copy())
    victims = [position[r] for r in proved.report_ids[10:15]]
    bodies[1][victims, 1, 0] = field.add(bodies[1][victims, 1, 0], np.uint64(1))
    forged = [position[r] for r in bad_ids]
    bodies[2][forged] = field.sub(np.zeros_like(views[2][1][forged]), views[2][1][forged])
    refused = decide_with(urls, tokens, study, ids, bodies)
    assert refused[0] == bad_ids
    assert refused[1] == bad_ids | set(proved.report_ids[10:15])
    assert refused[2] == set()  # told what to decide

    def commit(j: int, included) -> httpx.Response:
        return commit_ids(urls[j], tokens[j], study, included)

    with_invalid = set(proved.report_ids[:10]) | set(proved.report_ids[15:]) | bad_ids
    r = commit(0, with_invalid)
    assert r.status_code == 422 and r.json()["type"].endswith("report-refused") and r.json()["refused"] == 5
    r = commit(1, set(proved.report_ids))
    assert r.status_code == 422 and r.json()["refused"] == 5  # the victims
    # what the lying analyzer can release: the honest reports less its victims, at every server
    kept = set(proved.report_ids[:10]) | set(proved.report_ids[15:])
    answers = [commit(j, kept) for j in range(3)]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    shares = []
    for u, t in zip(urls, tokens):
        r = httpx.get(f"{u}/v1/studies/{study.study_id}/aggregate", headers={"Authorization": f"Bearer {t}"})
        shares.append(messages.decode_aggregate(r.content, study.k, study.width))
    total = shares[0]
    for s in shares[1:]:
        total = field.add(total, s)
    got = ring.decode(V.to_ring(total), study.frac_bits) * sketch.scale(study.s)
    keep = [i for i, r in enumerate(proved.report_ids) if r in kept]
    np.testing.assert_array_equal(got, expected(study, [proved.report_ids[i] for i in keep], encoded[keep]))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::dpsketch.client_sdk.client.DataLimitedWarning")  # rows at the bound, on purpose
def test_honest_reports_through_the_sdk_are_never_refused(no_floor_module_cluster):
    """10^5 honest rows (norms up to the bound) through the SDK's own upload: the round refuses
    none of them (an honest report is outside the predicate with probability <= 2^-96, and its
    client draws that noise again), and the release holds every one."""
    from dpsketch.client_sdk import Client

    c = no_floor_module_cluster
    n = int(os.environ.get("DPSKETCH_HONEST_REPORTS", "100000"))
    study = create(c, n, "honest")
    rows = np.random.default_rng(12).normal(0, 1.0, (n, study.d))
    rows /= np.maximum(1.0, np.linalg.norm(rows, axis=1))[:, None]  # many at the bound itself
    with Client(c.server_urls) as client:
        client.submit_many(study.study_id, rows, batch_size=10_000)
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        fin = an.finalize(study.study_id)
    assert fin["n_reports"] == n
    assert fin["verification"]["decided"] == n and fin["verification"]["refused"] == 0


def test_replicas_refuse_uploads_once_any_of_them_closed_the_study(servers, postgres):
    """Two replicas of server s1 on one PostgreSQL database (docs/operations.md, "Replicas"): after
    replica 1 answered verify/commit, replica 2 (which never saw the request) stores no more of
    the study's reports: its writer takes the closure from the database under the study's row
    lock and refuses the upload (503, then 409 uploads-closed on the retry), and the count stays."""
    from dataclasses import replace

    from conftest import OPEN_UPLOADS
    from dpsketch.protocol.study import design
    from test_e2e import NO_FLOOR_POLICY
    from dpsketch.tools.cluster import free_ports, share_server, start_all

    spec = replace(servers.spec("s1"), db_path=postgres.new_database("s1"))
    (second,) = free_ports(1)
    replicas = [share_server(spec, servers.workdir, {**OPEN_UPLOADS, **NO_FLOOR_POLICY}),
                share_server(replace(spec, port=second), servers.workdir, {**OPEN_UPLOADS, **NO_FLOOR_POLICY})]
    for i, proc in enumerate(replicas):
        proc.name, proc.log_path = f"s1-replica{i + 1}", servers.workdir / f"s1-replica{i + 1}.log"
    servers.started.extend(replicas)
    start_all(replicas)
    try:
        study = design(name="replicas", columns=COLUMNS, label="y", servers=["s1", "s2"], expected_reports=200,
                       k=16, s=4, min_reports=100, epsilon_floor=None, validity=True)[0]
        auth = {"Authorization": f"Bearer {spec.analyst_token}"}
        r = httpx.put(f"{replicas[0].url}/v1/studies/{study.study_id}", json=study.model_dump(mode="json"),
                      headers=auth, timeout=60)
        assert r.status_code in (200, 201), r.text
        encoded, proved = honest(study, 20, seed=9, full=0)

        def send(url: str, rows: slice) -> httpx.Response:
            body = messages.encode_batch(proved.report_ids[rows], proved.binding[0][rows], proved.leader[rows])
            return httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body, timeout=60,
                              headers={"Content-Type": messages.SHARES_MEDIA_TYPE})

        assert send(replicas[1].url, slice(0, 10)).status_code == 200
        assert _step(replicas[0].url, spec.analyst_token, study, "commit").status_code == 200
        first = send(replicas[1].url, slice(10, 20))
        assert first.status_code == 503, first.text  # the group refused whole under the row lock
        again = send(replicas[1].url, slice(10, 20))
        assert again.status_code == 409 and again.json()["type"].endswith("uploads-closed"), again.text
        for proc in replicas:
            info = httpx.get(f"{proc.url}/v1/studies/{study.study_id}", headers=auth, timeout=10).json()
            assert info["report_count"] == 10
    finally:
        postgres.drop_databases()
