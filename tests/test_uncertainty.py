"""Intervals that account for the release's noise (analyzer/uncertainty.py, docs/accuracy.md
"Intervals").

The noise law of each release kind is checked against simulated releases (the gram kind's
layout, the sketch kind's three terms with the real hash), then the intervals' coverage over 200
releases of the same data (the randomness is the mechanism's only: noise, and for the sketch kind
fresh report ids and secret signs), with the releases drawn in law from fixed numpy seeds
(benchmarks/intervals.py; the product's own noise comes from a CSPRNG). Every coverage claim is
paired with a width check: an interval that is always too wide fails.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from dpsketch.analyzer import uncertainty as U
from dpsketch.analyzer.estimators import robust_solve
from dpsketch.analyzer.release import GramSumRelease, HistogramRelease, SketchRelease
from benchmarks import intervals as B
from dpsketch.protocol import features
from dpsketch.protocol.study import design

REPS = 200
SEED = 0
#: The three linear cases asserted on (docs/accuracy.md, "Intervals", has more).
CASES = {
    "gram": ("gram", 20_000, 1.0, None),
    "sketch-signed": ("sketch", 30_000, 4.0, True),
    "sketch-unsigned": ("sketch", 30_000, 4.0, False),
}


@functools.lru_cache(maxsize=None)
def linear_case(name: str) -> B.LinearCase:
    kind, n, epsilon, sign = CASES[name]
    return B.linear_case(kind, n, epsilon, REPS, SEED, secret_sign=sign)


def upper_to_matrix(vec: np.ndarray, p: int) -> np.ndarray:
    iu, ju = U.upper_pairs(p)
    m = np.zeros((p, p))
    m[iu, ju] = vec
    m[ju, iu] = vec
    return m


# --- the laws ------------------------------------------------------------------------------------


def gram_study(columns, n=5_000, kind="gram"):
    study, _ = design(name="u", columns=columns, label="y", servers=["s1", "s2"], expected_reports=n,
                      kind=kind, seed="7a" * 32)
    return study


def test_gram_law_reads_the_release_layout_and_its_variances_match_simulation():
    """M_hat over [x1, 1, y]: the Gram entries, the row sum and the exact count in the right cells;
    the variances V (diagonal, row sum), V / 2 (off-diagonal Gram: the sqrt(2) of u undone) and 0
    (the count) agree with 4,000 releases drawn in law."""
    rng = np.random.default_rng(3)
    n = 5_000
    rows = B.simulation.clip_rows(rng.normal(0, 0.3, size=(n, 3)), 1.0)
    study = gram_study(["x1", "x2", "y"], n)
    phi = features.gram_features(rows).sum(axis=0)
    cols = ["x1", U.CONSTANT, "y"]
    m_hat, law = U.moment_law(GramSumRelease(study=study, values=phi, n_reports=n), cols)
    exact = np.column_stack([rows[:, 0], np.ones(n), rows[:, 2]])
    np.testing.assert_allclose(m_hat, exact.T @ exact, rtol=1e-12)
    assert m_hat[1, 1] == n
    v = study.sigma ** 2 * n + study.n_servers * study.server_sigma ** 2
    np.testing.assert_allclose(law.entry_variance(), [[v, v, v / 2], [v, 0, v], [v / 2, v, v]], rtol=1e-12)
    draws = np.array([U.moment_law(B.gram_release(study, phi, n, rng), cols)[0] - m_hat for _ in range(4_000)])
    emp = draws.var(axis=0)
    emp[1, 1] = max(emp[1, 1], 0.0)
    assert emp[1, 1] == 0.0
    mask = law.entry_variance() > 0
    ratio = emp[mask] / law.entry_variance()[mask]
    assert np.all((ratio > 0.9) & (ratio < 1.1)), ratio
    # upper-triangle entries are independent
    iu, ju = U.upper_pairs(3)
    corr = np.corrcoef(draws[:, iu, ju][:, [0, 2, 4, 5]].T)
    assert np.max(np.abs(corr - np.eye(4))) < 0.06


def test_moments_release_has_no_constant_but_a_constant_column_is_ordinary():
    rng = np.random.default_rng(4)
    n = 2_000
    rows = np.column_stack([rng.uniform(-0.3, 0.3, n), np.full(n, 0.5), rng.uniform(-0.3, 0.3, n)])
    study = gram_study(["x1", "c", "y"], n, kind="moments")
    release = GramSumRelease(study=study, values=features.moment_features(rows).sum(axis=0), n_reports=n)
    with pytest.raises(KeyError, match="row sum"):
        U.moment_law(release, ["x1", U.CONSTANT, "y"])
    m_hat, law = U.moment_law(release, ["x1", "c", "y"])
    np.testing.assert_allclose(m_hat, rows.T @ rows, rtol=1e-12)
    v = study.sigma ** 2 * n + study.n_servers * study.server_sigma ** 2
    np.testing.assert_allclose(np.diag(law.entry_variance()), v)
    np.testing.assert_allclose(law.entry_variance()[0, 1], v / 2)


@pytest.mark.parametrize("name", ["sketch-signed", "sketch-unsigned"])
def test_sketch_law_matches_simulated_releases_with_the_real_hash(name):
    """Cov(dM) of 200 simulated releases (fresh ids hashed by the protocol, secret signs, client
    and server noise) against the law at the true M: every entry's variance, random directions,
    and zero mean. Dropping the distortion term 1/k K(M, M) must fail the same check (the test can
    tell the terms apart)."""
    case = linear_case(name)
    dms = np.array(case.deviations)
    law = case.law_at_truth
    var = law.entry_variance()
    iu, ju = U.upper_pairs(law.p)
    ratio = dms.var(axis=0, ddof=1)[iu, ju] / var[iu, ju]
    assert 0.85 < ratio.mean() < 1.15 and np.all((ratio > 0.7) & (ratio < 1.35)), ratio
    rng = np.random.default_rng(11)
    dir_ratios = []
    for _ in range(20):
        a = rng.normal(size=(law.p, law.p))
        a = a + a.T
        dir_ratios.append(np.einsum("rab,ab->r", dms, a).var(ddof=1) / law.bilinear(a, a))
    assert 0.85 < np.mean(dir_ratios) < 1.15 and np.all((np.array(dir_ratios) > 0.7) & (np.array(dir_ratios) < 1.35))
    z = dms.mean(axis=0)[iu, ju] / np.sqrt(var[iu, ju] / len(dms))
    assert np.max(np.abs(z)) < 4.0, z
    no_distortion = U.SketchLaw(moments=law.moments, k=10 ** 12, beta=law.beta, gamma=law.gamma)
    assert np.mean(dms.var(axis=0, ddof=1)[iu, ju] / no_distortion.entry_variance()[iu, ju]) > 2.0


@pytest.mark.parametrize("which", ["additive", "sketch"])
def test_product_covariance_and_bilinear_agree_with_the_entrywise_covariance(which):
    rng = np.random.default_rng(5)
    p = 4
    if which == "additive":
        v = rng.uniform(0.5, 2.0, size=(p, p))
        law = U.AdditiveLaw(variance=v + v.T)
    else:
        x = rng.normal(size=(50, p))
        law = U.SketchLaw(moments=x.T @ x, k=30, beta=0.7, gamma=3.0)
    full = law.covariance(*np.ix_(range(p), range(p), range(p), range(p)))  # (a, b, c, e)
    w = rng.normal(size=p)
    np.testing.assert_allclose(law.product_covariance(w), np.einsum("abce,b,e->ac", full, w, w), rtol=1e-10)
    a1, a2 = rng.normal(size=(2, p, p))
    a1, a2 = a1 + a1.T, a2 + a2.T
    np.testing.assert_allclose(law.bilinear(a1, a2), np.einsum("ab,abce,ce->", a1, full, a2), rtol=1e-10)
    iu, ju = U.upper_pairs(p)
    np.testing.assert_allclose(law.upper_covariance(), full[iu, ju][:, iu, ju], rtol=1e-12)
    draws = law.sample(rng, 20_000)
    np.testing.assert_allclose(np.cov(draws[:, iu, ju].T), law.upper_covariance(),
                               atol=0.05 * np.max(np.abs(law.upper_covariance())))


# --- coverage of the non-private coefficient ----------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_least_squares_intervals_cover_the_non_private_coefficient(name):
    """95 % intervals over 200 releases of the same data cover plain least squares on the same
    clipped rows (intercept through the constant) 90-99 % of the time for every coefficient, and
    the mean se is within 25 % of the estimates' actual spread (so an interval that is merely wide
    fails). The default ridge is reported: its variance is right (same check) but its shrinkage
    bias is not in the interval."""
    case = linear_case(name)
    ls, ridge = case.least_squares, case.ridge
    print(f"\n{ls.row()}\n{ridge.row()}")
    assert ls.reps == REPS
    assert np.all((ls.coverage >= 0.90) & (ls.coverage <= 0.99)), ls.coverage
    assert np.all((ls.se_over_sd > 0.8) & (ls.se_over_sd < 1.25)), ls.se_over_sd
    assert np.all((ridge.se_over_sd > 0.8) & (ridge.se_over_sd < 1.25)), ridge.se_over_sd


def test_total_interval_covers_the_generating_coefficients_with_fresh_data():
    """Fresh rows each replicate from a known linear model (nothing clipped), a gram release: the
    interval with se^2 = noise + sampling covers the true coefficients 90-99 %; neither part alone
    does (each is needed), and the total se matches the spread."""
    case = B.sampling_case(20_000, 1.0, REPS, SEED)
    print(f"\n{case.total.row()}\n{case.noise_only.row()}\n{case.sampling_only.row()}\n"
          f"sampling / noise variance: {case.sampling_over_noise:.2f}")
    assert np.all((case.total.coverage >= 0.90) & (case.total.coverage <= 0.99)), case.total.coverage
    assert np.all((case.total.se_over_sd > 0.8) & (case.total.se_over_sd < 1.25))
    assert case.noise_only.coverage.min() < 0.9
    assert case.sampling_only.coverage.min() < 0.9


def test_logistic_delta_method_se_matches_the_spread_over_releases():
    """LogisticRegression (Gaussian calibration, default alpha) on a gram release, as a function of
    the moments: the numerical-Jacobian delta-method se is within a factor 1.3 of the empirical sd
    over 200 releases, and its 95 % interval covers the same fit on the exact moments 90-99 %."""
    run = B.logistic_case(20_000, 1.0, REPS, SEED)
    print(f"\n{run.row()}")
    assert np.all((run.se_over_sd > 1 / 1.3) & (run.se_over_sd < 1.3)), run.se_over_sd
    assert np.all((run.coverage >= 0.90) & (run.coverage <= 0.99)), run.coverage


# --- the pieces ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gram", "sketch-signed"])
def test_numerical_delta_method_agrees_with_the_analytic_linear_fit(name):
    """delta_covariance of the least-squares solve equals linear_fit_covariance (first order: no
    small-sample factor) to the finite-difference error."""
    case = linear_case(name)
    m_hat = case.moments + case.deviations[0]
    law = case.law_at_truth if name == "gram" else U.SketchLaw(
        moments=m_hat, k=case.law_at_truth.k, beta=case.law_at_truth.beta, gamma=case.law_at_truth.gamma)
    x_idx, y_idx = [0, 1, 2, 3], 4

    def fn(m):
        return np.linalg.solve(m[np.ix_(x_idx, x_idx)], m[x_idx, y_idx])

    theta = fn(m_hat)
    analytic = U.linear_fit_covariance(m_hat, law, x_idx, y_idx, theta, small_sample=False)
    numeric = U.delta_covariance(fn, m_hat, law)
    np.testing.assert_allclose(numeric, analytic, rtol=2e-3, atol=1e-6 * np.max(np.abs(analytic)))


def test_penalty_and_floor_enter_the_linear_fit_covariance_as_the_estimator_uses_them():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(200, 3))
    m = np.column_stack([x, x @ [1.0, 2.0, 0.0] + rng.normal(size=200)])
    m = m.T @ m
    law = U.AdditiveLaw(variance=np.full((4, 4), 2.0))
    pen = np.array([5.0, 5.0, 0.0])
    theta, _ = robust_solve(m[:3, :3] + np.diag(pen), m[:3, 3], 0.0)
    cov = U.linear_fit_covariance(m, law, [0, 1, 2], 3, theta, penalty=pen)
    h = np.linalg.inv(m[:3, :3] + np.diag(pen))
    w = np.r_[-theta, 1.0]
    np.testing.assert_allclose(cov, h @ law.product_covariance(w)[:3, :3] @ h, rtol=1e-10)
    # a floor above every eigenvalue: H^-1 = I / floor
    big = 10 * np.max(np.linalg.eigvalsh(m[:3, :3]))
    cov_floor = U.linear_fit_covariance(m, law, [0, 1, 2], 3, theta, floor=big)
    np.testing.assert_allclose(cov_floor, law.product_covariance(w)[:3, :3] / big ** 2, rtol=1e-10)


def test_sketch_small_sample_factor_and_t_quantile():
    x = np.random.default_rng(9).normal(size=(40, 5))
    law = U.SketchLaw(moments=x.T @ x, k=8, beta=1.0, gamma=8.0)
    assert U.small_sample_factor(law, 4) == pytest.approx(8 / 3)
    assert U.small_sample_factor(law, 7) == math.inf
    assert U.small_sample_factor(U.AdditiveLaw(variance=np.eye(5)), 4) == 1.0
    assert U.interval_dof(law, 4) == 4.0 and U.interval_dof(U.AdditiveLaw(variance=np.eye(2)), 1) is None
    cov = U.linear_fit_covariance(x.T @ x + np.eye(5), law, [0, 1, 2, 3], 4, np.zeros(4))
    first = U.linear_fit_covariance(x.T @ x + np.eye(5), law, [0, 1, 2, 3], 4, np.zeros(4), small_sample=False)
    np.testing.assert_allclose(cov, first * 8 / 3)
    seven = U.linear_fit_covariance(np.eye(9) + 1.0, U.SketchLaw(moments=np.eye(9), k=8, beta=1.0, gamma=8.0),
                                    list(range(7)), 8, np.zeros(7))
    assert np.all(np.isinf(seven)) and np.all(np.isinf(U.intervals(np.zeros(7), seven)[2]))
    assert U.quantile(0.95) == pytest.approx(1.959964, abs=1e-6)
    assert U.quantile(0.95, 4.0) == pytest.approx(2.776445, abs=1e-6)
    se, lo, hi = U.intervals(np.array([1.0, 2.0]), np.diag([4.0, 0.25]), 0.95)
    np.testing.assert_allclose(se, [2.0, 0.5])
    np.testing.assert_allclose(hi - lo, 2 * 1.959964 * se, rtol=1e-6)


def test_sampling_covariance_is_the_classical_ols_covariance():
    rng = np.random.default_rng(10)
    n = 500
    x = np.column_stack([rng.normal(size=(n, 2)), np.ones(n)])
    y = x @ [1.0, -1.0, 0.5] + rng.normal(0, 0.3, n)
    a = np.column_stack([x, y])
    m = a.T @ a
    theta = np.linalg.solve(m[:3, :3], m[:3, 3])
    resid = y - x @ theta
    classical = resid @ resid / (n - 3) * np.linalg.inv(x.T @ x)
    np.testing.assert_allclose(U.sampling_covariance(m, [0, 1, 2], 3, theta, n), classical, rtol=1e-8)


def test_refusals():
    study = gram_study(["x1", "x2", "y"], 1_000)
    release = GramSumRelease(study=study, values=np.zeros(study.width), n_reports=1_000)
    with pytest.raises(KeyError, match="nope"):
        U.moment_law(release, ["x1", "nope"])
    with pytest.raises(ValueError, match="distinct"):
        U.moment_law(release, ["x1", "x1"])
    hist, _ = design(name="h", columns=[], label=None, servers=["s1", "s2"], expected_reports=1_000,
                     kind="histogram", histogram={"axes": [{"column": "a", "edges": [0.0, 1.0]}]}, seed="7a" * 32)
    with pytest.raises(TypeError, match="histogram"):
        U.moment_law(HistogramRelease(study=hist, values=np.zeros(hist.width), n_reports=1_000), ["a"])
    one, _ = design(name="s", columns=["x", "y"], label="y", servers=["s1", "s2"], expected_reports=1_000,
                    k=1, seed="7a" * 32)
    with pytest.raises(ValueError, match="k = 1"):
        U.moment_law(SketchRelease(study=one, sketch=np.zeros((1, 2)), n_reports=1_000), ["x", "y"])
    exact = B.simulation.exact_gram(np.eye(2), ["x", "y"])
    m_hat, law = U.moment_law(exact, ["y", "x"])
    np.testing.assert_array_equal(m_hat, np.eye(2))
    assert not law.entry_variance().any()
    with pytest.raises(TypeError, match="GramRelease"):
        U.moment_law(B.simulation.simulate_central(study, np.zeros((1_000, 3)), np.random.default_rng(0)), ["x1"])
    with pytest.raises(ValueError, match="label"):
        U.linear_fit_covariance(np.eye(3), U.AdditiveLaw(variance=np.eye(3)), [0, 1], 1, np.zeros(2))
