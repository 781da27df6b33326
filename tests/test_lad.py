"""LADRegression and lad_full (analyzer/analyses/lad.py) and the LAD evaluation harness."""

from __future__ import annotations

import numpy as np
import pytest

from research import lad_evaluation
from dpsketch.analyzer.analyses.lad import GLOB_MIN_ROWS, LADRegression, _lp, l1_objective, lad_full


def _data(n: int, rng: np.random.Generator, p: int = 4):
    x = np.hstack([np.ones((n, 1)), rng.normal(size=(n, p - 1))])
    beta = np.linspace(1.0, -0.5, p)
    return x, x @ beta + rng.standard_t(2, size=n), beta


def test_noise_off_identity_map_equals_full_lp_and_quantreg():
    rng = np.random.default_rng(1)
    x, y, _ = _data(2_000, rng)
    release = np.hstack([x, y[:, None]])  # k = n, the identity map, weights 1, no noise
    model = LADRegression(label="y", noise_correction="calibrate").fit(
        release, np.ones(len(y)), columns=["c", "x1", "x2", "x3", "y"])
    full = lad_full(x, y)
    np.testing.assert_allclose(model.coef_, full, atol=1e-8)
    assert model.feature_names_ == ["c", "x1", "x2", "x3"]
    np.testing.assert_allclose(model.predict(x[:3]), x[:3] @ full)
    import statsmodels.api as sm  # the test extra installs it
    qr = sm.QuantReg(y, x).fit(q=0.5).params
    # QuantReg's IRLS stops near the LP optimum: same objective, coefficients within 1e-3
    np.testing.assert_allclose(full, qr, atol=1e-3)
    assert l1_objective(x, y, full) <= l1_objective(x, y, qr) + 1e-9


def test_globbing_is_exact_and_weights_and_penalty_match_the_primal():
    from scipy.optimize import linprog

    rng = np.random.default_rng(2)
    x, y, _ = _data(GLOB_MIN_ROWS + 20_000, rng)
    np.testing.assert_allclose(l1_objective(x, y, lad_full(x, y)), l1_objective(x, y, _lp(x, y, np.ones(len(y)))),
                               rtol=1e-9)
    n, p = 300, 4
    x, y, _ = _data(n, rng, p)
    w, alpha = rng.uniform(0.5, 2.0, n), 15.0
    beta = LADRegression(label=p, alpha=alpha).fit(np.hstack([x, y[:, None]]), w).coef_
    primal = linprog(np.r_[np.full(2 * p, alpha), w, w], A_eq=np.hstack([x, -x, np.eye(n), -np.eye(n)]),
                     b_eq=y, bounds=(0, None), method="highs")
    obj = np.sum(w * np.abs(y - x @ beta)) + alpha * np.abs(beta).sum()
    assert obj == pytest.approx(primal.fun, rel=1e-9)


def test_lad_beats_least_squares_on_student_t():
    errs_lad, errs_ls = [], []
    for seed in range(5):
        x, y, beta = _data(3_000, np.random.default_rng(10 + seed))
        errs_lad.append(np.linalg.norm(lad_full(x, y) - beta))
        errs_ls.append(np.linalg.norm(np.linalg.lstsq(x, y, rcond=None)[0] - beta))
    assert np.mean(errs_lad) < 0.7 * np.mean(errs_ls), (errs_lad, errs_ls)


@pytest.mark.parametrize("kwargs, fit_args, message", [
    ({"label": "z"}, {"columns": ["a", "y"]}, "not in the release"),
    ({"label": "y"}, {}, "pass columns="),
    ({"label": 5}, {}, "out of range"),
    ({"label": 1, "features": [1]}, {}, "label cannot also be a feature"),
    ({"label": 1, "alpha": -1.0}, {}, "alpha must be"),
    ({"label": 1, "noise_correction": "magic"}, {}, "noise_correction must be"),
    ({"label": 1}, {"weights": np.ones(3)}, "one weight per release row"),
    ({"label": 1}, {"weights": -np.ones(4)}, "non-negative"),
    ({"label": 1, "noise_correction": "calibrate"}, {"sigma": 1.0}, "needs counts="),
    ({"label": 1}, {"sigma": -1.0}, "sigma and server_sigma"),
])
def test_bad_input_raises_value_error(kwargs, fit_args, message):
    release = np.arange(8.0).reshape(4, 2)
    with pytest.raises(ValueError, match=message):
        LADRegression(**kwargs).fit(release, **fit_args)


def test_bad_release_shapes_and_values():
    with pytest.raises(ValueError, match=r"\(k, d\) matrix"):
        LADRegression(label=0).fit(np.ones(5))
    bad = np.ones((4, 3))
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        LADRegression(label=2).fit(bad)
    with pytest.raises(ValueError, match="expected 2 feature columns"):
        LADRegression(label=2).fit(np.random.default_rng(0).normal(size=(6, 3))).predict(np.ones((1, 3)))


def test_harness_quick_case_is_finite_and_the_rounds_beat_the_l1_sketch_and_local_at_1e5():
    """With the default floor and min_reports the l1 study learns about as little as the local
    model at 10^5 (docs/lad.md: both near the zero-slope predictor's 1.54); the Huber rounds learn."""
    recs = lad_evaluation.run_case(100_000, "student_t", [1.0], seed=0,
                                   mechanisms=("nonprivate_lad", "ltm_rounds", "ltm_l1", "local"))
    by = {r["mechanism"]: r for r in recs}
    assert set(by) == {"nonprivate_lad", "ltm_rounds", "ltm_l1", "local"}
    for r in recs:
        assert np.isfinite(r["coef_error"]) and np.isfinite(r["objective_ratio"])
        assert r["objective_ratio"] >= 1.0 - 1e-9
    assert by["nonprivate_lad"]["objective_ratio"] == pytest.approx(1.0)
    assert by["ltm_l1"]["lambda_star"] > 100  # the certificate quantity of the simulated set
    assert by["ltm_l1"]["coef_error"] > 1.0 and by["local"]["coef_error"] > 1.0
    assert by["ltm_rounds"]["coef_error"] < 0.2


def test_recommend_points_to_the_l1_kind():
    """`dpsketch recommend` names the other analyses and where they stand (docs/lad.md)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "recommend", "--d", "6", "-n", "100000",
                          "--no-predict"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--kind l1" in out.stdout and "docs/lad.md" in out.stdout and "docs/logistic.md" in out.stdout
