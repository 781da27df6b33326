"""Validity proofs of a study with parties, in process (docs/validity.md section 13; the same over
real servers: tests/test_validity_parties_e2e.py).

* Each party's blocks are proved with the sketch predicate of its own width and bound B_j: the
  plan's R_j^2 is (B_j / h + the noise allowance of d_j columns)^2, honest blocks at the bound
  pass, a block one allowance further out has no valid digits, and the verifier shares of a
  narrower party are padded with zeros to the study's widest.
* The conformance vector of a study with parties, recomputed as an independent client would:
  pseudonyms and signs with hmac, each block id with hashlib from its block prefix and the
  binding proofs, the digits from the noisy vectors, and the sums of the verifier shares.
* What a malicious party can move (benchmarks/validity_influence.py --kind parties, small): the
  strongest block its predicate accepts (norm R_j h = B_j plus its noise allowance) shifts the
  ridge answer by no more than R_j h / B_j times what an honest block at its bound does, the
  unproved attack hundreds of times more.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from pathlib import Path

import numpy as np
import pytest

from benchmarks import validity_influence as B
from dpsketch.protocol import field, flp, parties, report, ring, validity as V
from dpsketch.protocol.circuits import to_digits
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.study import Study, design

SPEC = [{"name": "bank", "columns": ["x0"]}, {"name": "clinic", "columns": ["x1", "x2", "y"]}]


def _study(**kw) -> Study:
    return design(name="vp", columns=["x0", "x1", "x2", "y"], label="y", servers=["s0", "s1", "s2"],
                  expected_reports=10_000, parties=SPEC, validity=True, **kw)[0]


def test_each_party_is_proved_with_its_own_width_and_bound():
    study = _study(secret_sign=True)
    grid = study.noise_grid
    t = grid.scale(study.sigma)
    plans = V.plans(study)
    assert [p.w for p in plans] == [1, 3]
    for q, plan in zip(study.parties, plans):
        r = q.row_bound / grid.spacing + V.norm_allowance(t, q.width)
        assert plan.bound == math.ceil(r * r) and plan.circuit.w == q.width
    assert V.verifier_len(study) == max(p.verifier_len for p in plans)
    # an individual's blocks are what a server stores of it; the refusal charge counts every block
    assert study.share_bytes == 8 * sum(p.leader_width for p in plans)
    # honest blocks at the bound are inside (every one of 2,000); a block at R_j + 2 allowances is not
    key = parties.new_key()
    ps = parties.pseudonyms(key, study.study_id, [str(i) for i in range(2000)])
    signs = parties.signs(key, study.study_id, ps)
    rows = np.zeros((2000, 3))
    rows[:, 0] = 1.0  # clipped to the clinic's bound: at the bound
    vectors = report.block_vectors(study, "clinic", rows, signs)
    assert np.allclose(np.linalg.norm(vectors, axis=1), study.parties[1].row_bound, rtol=1e-3)
    encoded = report.noisy_encoded(vectors, study, Keystream.from_key(b"\x05" * 32))
    assert V.within(plans[1], V.grid_units(plans[1], encoded)).all()
    far = np.zeros((1, 3), dtype=np.int64)
    far[0, 0] = math.isqrt(plans[1].bound) + 2 * int(V.norm_allowance(t, 3))
    assert not V.within(plans[1], far).all()
    # a proved batch of each party verifies; a bank block's verifier share fills its first V_0 elements
    for index, q in enumerate(study.parties):
        block = report.prepare_blocks(study, q.name, ps[:20], np.full((20, q.width), 0.3), signs=signs[:20],
                                      full=index)
        plan = plans[index]
        ids = np.frombuffer(b"".join(block.report_ids), np.uint8).reshape(-1, 16)
        seed = b"\x09" * 32
        total = None
        for j in range(3):
            seeded = block.seeds[j] is not None
            payload = block.seeds[j] if seeded else block.shares[j]
            x, pr = V.server_shares(plan, payload, seeded)
            part = V.verifier_shares(plan, seed, ids, x, pr)
            total = part if total is None else V.add_verifiers(total, part)
        assert V.decide(plan, ids, total).all()
        # proved with the other party's plan (the bank's width 1 against the clinic's 3) it is not a block
        with pytest.raises(ValueError):
            V.server_shares(plans[1 - index], block.shares[index], False)


def test_the_parties_conformance_vector_as_an_independent_client_checks_it():
    vec = next(v for v in json.loads((Path(__file__).resolve().parents[1] / "conformance" / "validity.json")
                                     .read_text())["vectors"] if v["type"] == "validity_parties_study")
    study = Study.model_validate(vec["study"])
    sid = bytes.fromhex(vec["study_id"])
    key = bytes.fromhex(vec["party_key"])
    for who, p, s in zip(vec["individuals"], vec["pseudonyms"], vec["signs"], strict=True):
        raw = who.encode()
        mac = hmac.new(key, b"dpsketch/individual/1" + sid + len(raw).to_bytes(4, "big") + raw, hashlib.sha256)
        assert mac.digest()[:16].hex() == p
        assert hmac.new(key, b"dpsketch/sign/1" + sid + bytes.fromhex(p), hashlib.sha256).digest()[0] & 1 == s
    n = len(study.servers)
    v_len = vec["verifier_len"]
    assert v_len == max(part["plan"]["verifier_len"] for part in vec["parties"])
    for part in vec["parties"]:
        j_party = part["index"]
        plan = part["plan"]
        # the block prefix: domain, study id, party index, pseudonym
        assert part["block_prefixes"] == [(b"dpsketch/block/2" + sid + bytes((j_party,)) + bytes.fromhex(p)).hex()
                                          for p in vec["pseudonyms"]]
        # the party's bound: R_j = B_j / h + t sqrt(d_j + 2 sqrt(d_j a) + 2 a), a = 96 ln 2
        h = 2.0 ** (plan["grid_shift"] - plan["frac_bits"])
        w = len(study.parties[j_party].columns)
        a = 96 * math.log(2)
        r = part["row_bound"] / h + plan["t"] * math.sqrt(w + 2 * math.sqrt(w * a) + 2 * a)
        assert plan["r2"] == math.ceil(r * r)
        # the noisy vectors in grid units, their digits (u + H in base 4, then the slack's)
        encoded = np.array([int(x) for row in part["encoded"] for x in row], dtype=np.uint64).view(np.int64)
        units = (encoded >> plan["grid_shift"]).reshape(-1, w)
        assert units.tolist() == part["units"]
        digits = to_digits((units + plan["H"]).astype(np.uint64), 4, plan["q"])
        slack = to_digits(np.array([[plan["r2"] - int((units ** 2).sum(axis=1)[i])] for i in range(len(units))],
                                   dtype=np.uint64), 4, plan["slack_digits"])
        assert np.concatenate([digits, slack], axis=1).tolist() == [[int(x) for x in row] for row in part["input"]]
        # every block id from its prefix and the commitments each server's binding proof carries
        for i, bid in enumerate(part["report_ids"]):
            proofs = [bytes.fromhex(part["binding"][j])[i * 16 * n:(i + 1) * 16 * n] for j in range(n)]
            commitments = []
            for j in range(n):
                seeded = str(j) in part["helper_seeds"]
                payload = (bytes.fromhex(part["helper_seeds"][str(j)])[i * 32:(i + 1) * 32] if seeded else
                           np.array([int(x) for x in part["leader"][i][:plan["input_len"]]], dtype="<u8").tobytes())
                commitments.append(hashlib.sha256(b"dpsketch/commit/2" + bytes((j, 2 if seeded else 1))
                                                  + proofs[j][:16] + payload).digest()[:16])
            for j in range(n):  # server j's proof: its salt, then the others' commitments
                assert proofs[j][16:] == b"".join(c for k, c in enumerate(commitments) if k != j)
            block = hashlib.sha256(bytes.fromhex(part["block_prefixes"][i]) + b"".join(commitments)).digest()[:16]
            assert block.hex() == bid
        # the verifier shares: padded with zeros past the party's length, adding up to the sum
        shares = [np.array([[[int(c) for c in e] for e in row] for row in s], dtype=np.uint64)
                  for s in part["verifier_shares"]]
        assert all(s.shape[1] == v_len and not s[:, plan["verifier_len"]:].any() for s in shares)
        assert (flp.reconstruct(shares) == np.array([[[int(c) for c in e] for e in row] for row in part["verifier"]],
                                                    dtype=np.uint64)).all()
        assert all(part["decisions"]) and part["tampered_decisions"] == [False] + part["decisions"][1:]
        # the coordinate shares add up to the noisy vectors
        total = flp.reconstruct([np.array(s, dtype=np.uint64) for s in part["coordinate_shares"]])
        assert (field.decode_int(total) == units << plan["grid_shift"]).all()
        assert (ring.decode(encoded.reshape(-1, w).view(np.uint64), study.frac_bits) != 0).any()


def test_a_malicious_party_moves_the_release_about_as_much_as_an_honest_block_at_its_bound():
    """benchmarks/validity_influence.py --kind parties, small (n = 5,000, d = 6, 3 seeds): the
    strongest block the second party's predicate accepts (norm R_j h, the attack's direction)
    against an honest block of that party at its bound B_j and an honest individual at the
    bound; the unproved attack for scale. (n = 20,000, d = 10, 4 seeds: 0.0200, 0.0088, 0.0076
    and 35.2, docs/validity.md section 13.)"""
    out = B.run_parties(5000, 6, 3)
    shifts = {name: np.asarray(v) for name, v in out["shifts"].items()}
    med = {name: float(np.median(v)) for name, v in shifts.items()}
    # R_j h: B_j plus the noise allowance of the party's 3 columns (the 2^-96 tail of its noise)
    assert out["reach"] == pytest.approx(out["row_bound"] + out["allowance"], rel=1e-6)
    # the strongest valid block moves the fit by what its norm allows: R_j h / B_j times an honest
    # block at the bound, never more. Compared seed by seed (the same sketch, noise and honest
    # rows): the ratio, divided by R_j h / B_j, was 0.62-2.02 over 60 single seeds (median 1.0);
    # the median of 3 seeds above 2.5 is a tail the 60 draws never reached, while unpaired
    # medians of 3 once gave 2.35 (a CI run)
    ratio = out["reach"] / out["row_bound"]
    strongest = shifts["strongest valid block"]
    assert np.median(strongest / (ratio * shifts["honest block at the party's bound"])) < 2.5
    assert np.median(strongest / (ratio * shifts["honest individual at the bound"])) < 2.5
    assert med["attack without proofs"] > 300 * med["strongest valid block"]
