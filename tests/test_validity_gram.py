"""Validity proofs of gram and moments studies (circuits.GramNorm; docs/validity.md section 12):
an honest batch verifies and releases the feature sum a study without proofs would; every way
of moving a Gram release that the issue names is refused."""

import math

import numpy as np
import pytest

from dpsketch.client_sdk import prepare
from dpsketch.protocol import features, field, flp, ring, study as S, validity as V
from dpsketch.protocol.circuits import GramNorm, to_digits
from dpsketch.protocol.keystream import Keystream
from test_validity import _forged

SERVERS = ["a", "b", "c"]


@pytest.fixture(scope="module", params=["gram", "moments"])
def study(request):
    return S.design(name="g", columns=[f"c{i}" for i in range(5)], label="c0", servers=SERVERS,
                    expected_reports=20_000, kind=request.param, validity=True)[0]


def _views(study, payloads):
    """Each server's (input shares, proof shares) from the batch's payloads."""
    plan = V.plan(study)
    return [V.server_shares(plan, p, seeded) for p, seeded in payloads]


def _decide(study, ids, views, seed=b"\x01" * 32):
    plan = V.plan(study)
    return V.decide(plan, ids, flp.reconstruct([V.verifier_shares(plan, seed, ids, x, p) for x, p in views]))


def _batch_views(study, batch):
    return _views(study, [(s, False) if s is not None else (seed, True)
                          for s, seed in zip(batch.shares, batch.seeds, strict=True)])


def test_the_plan_bounds_an_honest_report_and_the_accounting_covers_the_grid(study):
    plan = V.plan(study)
    c = plan.circuit
    assert isinstance(c, GramNorm) and c.w == study.width and c.linear == (study.kind == "gram")
    grid = study.noise_grid
    h = grid.spacing
    assert c.lin ** 2 == c.count_unit == round(1 / h)  # g = sqrt(h): products of witnesses are steps
    # the smallest noise (the strict upper triangle's) has >= 4096 steps; the allowance is the
    # 2^-96 noise tail plus the rounding residuals, a little over 16 sigma at w = 21
    assert grid.scale(study.sigma / math.sqrt(2)) >= V.GRAM_GRID_STEPS
    allowance = math.sqrt(c.r2) * h
    assert V.norm_allowance(study.sigma, c.w) < allowance < 1.1 * V.norm_allowance(study.sigma, c.w)
    assert study.row_bound / math.sqrt(h) < math.sqrt(c.r2_row) < study.row_bound / math.sqrt(h) + 2
    # the discrete argument is made for the sqrt(2) h grid and still covers the study
    arg = study.discrete_argument
    assert arg.covered and arg.spacing == pytest.approx(math.sqrt(2) * h)
    g = study.guarantees()
    assert g["epsilon"] <= study.epsilon + 1e-9 and g["floor_epsilon"] <= study.epsilon_floor + 1e-9


def test_honest_batch_verifies_and_releases_the_features_of_a_study_without_proofs(study):
    rows = np.random.default_rng(3).normal(size=(400, study.d)) * 0.3
    batch = prepare.prepare_batch(study, rows, stream=Keystream.from_key(b"\x07" * 32))
    views = _batch_views(study, batch)
    assert _decide(study, batch.report_ids, views).all()
    plan = V.plan(study)
    coords = flp.reconstruct([V.coordinate_shares(plan, x) for x, _ in views])
    total = V.to_ring(field.total(coords, axis=0))
    release = ring.decode(total, study.frac_bits) * study.release_scale
    want = features.client_vectors(study.kind, rows).sum(axis=0)
    # the release is the features' sum plus 400 reports' noise of sigma per coordinate (in the
    # release's units: the strict upper triangle's sigma / sqrt(2), times sqrt(2))
    z = (release - want) / (study.sigma * math.sqrt(len(rows)))
    assert np.abs(z).max() < 5.5 and 0.6 < z.std() < 1.5


def _honest_inputs(c, m=1):
    r = np.zeros((m, c.d), dtype=np.int64)
    r[:, 0] = int(0.5 * math.sqrt(c.r2_row))
    r[:, 1] = -int(0.3 * math.sqrt(c.r2_row))
    e = np.zeros((m, c.w), dtype=np.int64)
    return r, e


def test_reports_that_move_the_gram_are_refused(study):
    """The issue's attack (one report adding -10,935 to the x1*y feature only), a product that
    no row has, a negative square, a row of twice the bound with its true products, and noise
    over the allowance: each proved by the honest prover code, each refused; the control passes."""
    c = V.plan(study).circuit
    h = study.noise_grid.spacing
    r, e = _honest_inputs(c)
    honest = c.encode(r, e)[0]
    forged = []
    k_x1y = c.d + 1 if c.d > 1 else 0  # the product of columns 0 (the label) and 1, in P's order
    # 0: the attack, carried by the product itself
    x = honest.copy()
    x[c.at_products + k_x1y] = field.encode_int(np.array([int(-10_935 / h)]))[0]
    forged.append(x)
    # 1: a diagonal product negative (Gram diagonal -115,657), the row slack made to balance mod p
    x = honest.copy()
    x[c.at_products] = field.encode_int(np.array([int(-115_657 / h)]))[0]
    forged.append(x)
    # 2: a row of twice the bound with its true products (the row slack cannot be in range)
    r2 = r.copy()
    r2[0, 0] = min(c.half_row - 1, 2 * int(math.sqrt(c.r2_row)))
    digits = np.zeros(c.input_len, dtype=np.uint64)  # by hand: the honest encoder refuses it
    digits[:c.at_products] = to_digits((r2 + c.half_row).astype(np.uint64), c.beta, c.q_row)[0]
    digits[c.at_products:c.at_noise] = field.encode_int(r2[0, c.pairs[0]] * r2[0, c.pairs[1]])
    digits[c.at_noise:c.at_row_slack] = to_digits((e + c.half).astype(np.uint64), c.beta, c.q)[0]
    digits[c.at_slack:] = to_digits(np.array([[c.r2]], dtype=np.uint64), c.beta, c.slack_digits)[0]
    forged.append(digits)
    # 3: noise of the largest in-range value on every coordinate (far over the norm bound)
    x = honest.copy()
    top = to_digits(np.full((1, c.w), 2 * c.half - 1, dtype=np.uint64), c.beta, c.q)[0]
    x[c.at_noise:c.at_row_slack] = top
    forged.append(x)
    # 4: the attack carried by one noise digit out of range (the norm equation made to hold mod p)
    x = honest.copy()
    x[c.at_noise + c.q * (c.w - 1)] = 1 << 40
    forged.append(x)
    ids, views = _forged(study, np.array(forged))
    assert not _decide(study, ids, views).any()
    ids, views = _forged(study, honest[None])
    assert _decide(study, ids, views).all()
