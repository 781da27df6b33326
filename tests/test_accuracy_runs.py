"""The repeated-runs harness of issue 15 (research/accuracy_runs.py) on small n: every variant
runs on shared draws, the design variants change what they say they change."""

from __future__ import annotations

import math

import numpy as np
import pytest

from research import accuracy_runs as ar
from research.experiments import design_study


def test_sketch_variants_run_on_shared_draws():
    out = ar.sketch_run("ridge", 20_000, 1.0, 0, ar.SKETCH_RIDGE, None)
    assert set(out["ratios"]) == set(ar.SKETCH_RIDGE)
    assert all(math.isfinite(v) and v >= 1.0 - 1e-9 for v in out["ratios"].values()), out["ratios"]
    assert out["two_round"]["b"] >= 1.0
    assert out["predicted"]["sketch"] == pytest.approx(10 / (out["k"] - 11))
    pca = ar.sketch_run("pca", 20_000, 1.0, 0, ar.SKETCH_PCA, None)
    assert set(pca["ratios"]) == set(ar.SKETCH_PCA)


def test_lambda97_and_sign_change_only_the_noise():
    study = design_study([f"x{i}" for i in range(10)] + ["y"], "y", 100_000, 1.0, "sketch", ("t",),
                         secret_sign=False)
    lam = ar.proposed_lambda_star(study)
    # privacy.LAMBDA_SAFETY is 0.97 now (n/k >= 90 at min_reports): the variant is today's design
    assert lam == pytest.approx(study.lambda_star, rel=1e-9)
    new = ar.recalibrated(study, 0.9 / 0.97 * lam)  # the design before: more noise
    assert new.sigma > study.sigma and (new.k, new.s, new.seed) == (study.k, study.s, study.seed)
    signed = ar.sign_study(study, 0.101)
    assert signed.sigma ** 2 == pytest.approx(0.101 * study.sigma ** 2)
    assert signed.server_sigma == study.server_sigma
    # the secret sign leaves S diag(t) an OSNAP: on sign-symmetric noise only the data term flips
    rng = np.random.default_rng(1)
    draw = ar.SketchDraw(study, 1000, rng)
    rows = np.zeros((1000, 11))
    rows[:, 0] = 0.5
    a = draw.release(study, rows).sketch
    b = draw.release(study, rows, secret_sign=True).sketch
    np.testing.assert_allclose(a - b, np.asarray(draw.S @ (rows * (1 - draw.t[:, None]))), atol=1e-9)


def test_gram_moments_has_the_gram_sensitivity_of_a_at():
    out = ar.gram_run("ridge", 10_000, 1.0, 0)
    assert out["sensitivity_ratio"] == pytest.approx(math.sqrt(2.0) / math.sqrt(4.5))
    assert set(out["ratios"]) == {"gram", "gram_moments", "central"}


def test_trivial_ratios_are_what_learning_nothing_scores():
    res = ar.trivial_ratios(2_000, 3)
    assert res["ridge_theta_zero"]["mean"] > 3 and res["pca_random_subspace"]["mean"] > 5
    assert res["ridge_theta_zero"]["runs"] == 3


def test_k_sweep_runs_the_signed_design_at_each_k():
    rows = ar.k_sweep(20_000, [20, 40], 1)
    assert [r["k"] for r in rows] == [20, 40] and all(r["secret_sign"] for r in rows)
    assert rows[0]["lambda_star"] > rows[1]["lambda_star"]  # more rows, fewer reports per row
    for r in rows:
        assert math.isfinite(r["predicted_ridge"]) and r["ridge"]["runs"] == 1
        assert r["ridge"]["mean"] >= 1.0 - 1e-9 and r["pca"]["mean"] >= 1.0 - 1e-9
