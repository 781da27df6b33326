"""Central-model regression baselines: calibration, sensitivities and the papers' trends.

Mechanisms (research.baselines): plain SSP, AdaSSP (Wang 2018), DGM-OLS and RMGM-OLS (Wu et al.
2022, papers/004); the evaluation entry point research.evaluation.central_baselines.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest
from scipy.stats import norm

from dpsketch.analyzer import simulation, synthetic
from dpsketch.analyzer.simulation import Target
from research import baselines
from research.evaluation import (
    EXTRA_BASELINES,
    PCA_BASELINES,
    RIDGE_BASELINES,
    central_baselines,
    compare,
)
from dpsketch.protocol import privacy

import studies

EPS, DELTA = 1.0, 1e-6
NOTIONS = ("replace-one", "add-remove")


def gdp_delta(mu: float, epsilon: float) -> float:
    """delta(epsilon) of mu-GDP (Dong, Roth, Su 2019, Corollary 2.13), written out here."""
    return float(norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2))


def ball_point(rng: np.random.Generator, dim: int, radius: float, on_sphere: bool = False) -> np.ndarray:
    v = rng.standard_normal(dim)
    r = radius if on_sphere else radius * rng.uniform() ** 0.05  # mostly near the sphere
    return v * (r / np.linalg.norm(v))


# ---------------------------------------------------------------------------------------------
# calibration


@pytest.mark.parametrize("neighbouring", NOTIONS)
def test_adassp_three_parts_compose_to_exactly_epsilon_delta(neighbouring):
    B = 1.3
    s = baselines.adassp_sigmas(Target(EPS, DELTA, B, neighbouring))
    mus = [s[f"sensitivity_{p}"] / s[f"sigma_{p}"] for p in ("lambda_min", "gram", "xty")]
    # three equal parts
    assert mus[0] == pytest.approx(mus[1], rel=1e-12) and mus[1] == pytest.approx(mus[2], rel=1e-12)
    mu = math.sqrt(sum(m * m for m in mus))
    # the composed mechanism is mu-GDP; mu-GDP gives exactly the target delta at the target epsilon
    assert gdp_delta(mu, EPS) == pytest.approx(DELTA, rel=1e-6)
    # and a slightly smaller noise would not: the calibration is tight, not just valid
    assert gdp_delta(mu * 1.01, EPS) > DELTA * 1.05
    # independently, through dp-accounting's analytic-Gaussian inversion
    from dp_accounting import get_epsilon_gaussian

    assert get_epsilon_gaussian(1.0 / mu, DELTA) == pytest.approx(EPS, rel=1e-6)
    # the sensitivities are the stated ones
    assert s["sensitivity_lambda_min"] == pytest.approx(B**2)
    factor = 2.0 if neighbouring == "replace-one" else 1.0
    assert s["sensitivity_xty"] == pytest.approx(factor * B**2 / 2)
    assert s["sensitivity_gram"] == pytest.approx(math.sqrt(factor) * B**2)


def test_adassp_composition_checked_by_pld_accountant():
    """dp-accounting's privacy-loss-distribution accountant composes the three Gaussian parts
    (noise multipliers sigma_i / Delta_i) and finds epsilon at the target delta."""
    from dp_accounting import ComposedDpEvent, GaussianDpEvent, pld

    s = baselines.adassp_sigmas(Target(EPS, DELTA, 1.0, "replace-one"))
    events = [GaussianDpEvent(s[f"sigma_{p}"] / s[f"sensitivity_{p}"]) for p in ("lambda_min", "gram", "xty")]
    acc = pld.PLDAccountant()
    acc.compose(ComposedDpEvent(events))
    assert acc.get_epsilon(DELTA) == pytest.approx(EPS, rel=1e-3)
    # a fourth part would overspend
    acc.compose(events[0])
    assert acc.get_epsilon(DELTA) > 1.1 * EPS


def test_adassp_released_noise_has_the_calibrated_stds():
    rng = np.random.default_rng(11)
    n, p = 400, 3
    rows = simulation.clip_rows(rng.standard_normal((n, p + 1)), 1.0)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)  # all on the sphere: lambda_min ~ n / (p+1)
    X, y = rows[:, :p], rows[:, p]
    s = baselines.adassp_sigmas(Target(EPS, DELTA, 1.0, "replace-one"))
    lam_min = float(np.linalg.eigvalsh(X.T @ X)[0])
    shift = math.sqrt(math.log(6 / DELTA)) * s["sigma_lambda_min"]
    assert lam_min - shift > 5 * s["sigma_lambda_min"]  # so the max(0, .) never clips below
    reps = 400
    dg, off, dxy, lt = [], [], [], []
    for _ in range(reps):
        fit = baselines.adassp(X, y, Target(EPS, DELTA, 1.0, "replace-one"), rng=rng)
        w = fit.info["gram"] - X.T @ X
        assert np.allclose(w, w.T)
        dg.extend(np.diag(w))
        off.extend(w[np.triu_indices(p, 1)])
        dxy.extend(fit.info["xty"] - X.T @ y)
        lt.append(fit.info["lambda_tilde"])
    tol = 0.12
    assert np.std(dg) == pytest.approx(s["sigma_gram"], rel=tol)
    assert np.std(off) == pytest.approx(s["sigma_gram"] / math.sqrt(2), rel=tol)
    assert np.std(dxy) == pytest.approx(s["sigma_xty"], rel=tol)
    assert np.std(lt) == pytest.approx(s["sigma_lambda_min"], rel=tol)
    assert np.mean(lt) == pytest.approx(lam_min - shift, abs=4 * s["sigma_lambda_min"] / math.sqrt(reps))
    assert abs(np.mean(dg)) < 4 * s["sigma_gram"] / math.sqrt(len(dg))


@pytest.mark.parametrize("neighbouring", NOTIONS)
def test_dgm_and_rmgm_noise_is_the_local_sigma(neighbouring):
    B = 0.7
    sigma = privacy.unit_sigma(EPS, DELTA) * (2 * B if neighbouring == "replace-one" else B)
    assert baselines.data_release_sigma(Target(EPS, DELTA, B, neighbouring)) == pytest.approx(sigma, rel=1e-12)
    # one Gaussian mechanism with sensitivity 2B (B): exactly (epsilon, delta)
    delta_sens = privacy.sensitivity(B, neighbouring)
    assert gdp_delta(delta_sens / sigma, EPS) == pytest.approx(DELTA, rel=1e-6)
    rng = np.random.default_rng(3)
    target = Target(EPS, DELTA, B, neighbouring)
    zeros_x, zeros_y = np.zeros((3000, 4)), np.zeros(3000)
    z = baselines.dgm_release(zeros_x, zeros_y, target, rng=rng)
    assert z.shape == (3000, 5)
    assert np.std(z) == pytest.approx(sigma, rel=0.03)
    zr, k, sr = baselines.rmgm_release(zeros_x[:20], zeros_y[:20], target, rng=rng, k=3000)
    assert (k, sr) == (3000, pytest.approx(sigma))
    assert zr.shape == (3000, 5)
    assert np.std(zr) == pytest.approx(sigma, rel=0.03)


def test_rmgm_k_follows_the_paper_rule():
    for n in (10**5, 10**6, 4 * 10**6):
        expect = round(math.sqrt(n) / privacy.unit_sigma(EPS, DELTA))
        assert baselines.rmgm_k(n, EPS, DELTA, p=10) == expect
    # never fewer than 2 (p + 1) rows, never more than n
    assert baselines.rmgm_k(1000, EPS, DELTA, p=10) == 22
    assert baselines.rmgm_k(5, EPS, DELTA, p=10) == 5
    # a stronger privacy target mixes fewer rows (more noise per row)
    assert baselines.rmgm_k(10**6, 0.3, DELTA) < baselines.rmgm_k(10**6, 1.0, DELTA)


# ---------------------------------------------------------------------------------------------
# sensitivities, checked numerically


@pytest.mark.parametrize("neighbouring", NOTIONS)
def test_xty_sensitivity_holds_and_is_tight(neighbouring):
    rng = np.random.default_rng(5)
    B, p = 1.5, 4
    bound = baselines.xty_sensitivity(B, neighbouring)
    worst = 0.0
    for _ in range(20000):
        a = ball_point(rng, p + 1, B)
        if neighbouring == "replace-one":
            b = ball_point(rng, p + 1, B)
            if rng.uniform() < 0.5:  # also try the adversarial direction: flip the label
                b = np.append(a[:p], -a[p]) * rng.uniform(0.9, 1.0)
            change = a[:p] * a[p] - b[:p] * b[p]
        else:
            change = a[:p] * a[p]
        worst = max(worst, float(np.linalg.norm(change)))
    assert worst <= bound * (1 + 1e-12)
    assert worst > 0.95 * bound
    # attained exactly: x = (B / sqrt 2) e1, y = +-B / sqrt 2
    x = np.eye(p)[0] * B / math.sqrt(2)
    if neighbouring == "replace-one":
        exact = np.linalg.norm(x * (B / math.sqrt(2)) - x * (-B / math.sqrt(2)))
    else:
        exact = np.linalg.norm(x * (B / math.sqrt(2)))
    assert exact == pytest.approx(bound)


@pytest.mark.parametrize("neighbouring", NOTIONS)
def test_lambda_min_sensitivity_holds_and_is_tight(neighbouring):
    rng = np.random.default_rng(6)
    B, p = 1.2, 3
    bound = baselines.lambda_min_sensitivity(B, neighbouring)
    assert bound == pytest.approx(B**2)  # not doubled by replace-one
    worst = 0.0
    for _ in range(3000):
        n = int(rng.integers(p, 3 * p))
        X = np.array([ball_point(rng, p, B) for _ in range(n)])
        base = np.linalg.eigvalsh(X.T @ X)[0]
        if neighbouring == "replace-one":
            X2 = X.copy()
            X2[rng.integers(n)] = ball_point(rng, p, B)
        else:
            X2 = np.vstack([X, ball_point(rng, p, B)])
        worst = max(worst, abs(np.linalg.eigvalsh(X2.T @ X2)[0] - base))
    assert worst <= bound * (1 + 1e-9)
    # tight: the rows B e_1..B e_p have lambda_min = B^2; replacing B e_p by B e_1, or removing
    # B e_p, drops it to 0
    X = np.eye(p) * B
    if neighbouring == "replace-one":
        X2 = X.copy()
        X2[-1] = X[0]
    else:
        X2 = X[:-1]
    change = abs(np.linalg.eigvalsh(X.T @ X)[0] - np.linalg.eigvalsh(X2.T @ X2)[0])
    assert change == pytest.approx(bound)


@pytest.mark.parametrize("mixing", ["rademacher", "gaussian"])
def test_rmgm_mixing_keeps_the_row_sensitivity(mixing):
    rng = np.random.default_rng(8)
    B, n, k, cols = 1.0, 40, 30, 4
    m = baselines.mixing_matrix(k, n, rng, mixing)
    assert m.shape == (k, n)
    np.testing.assert_allclose(np.linalg.norm(m, axis=0), 1.0, rtol=1e-12)
    if mixing == "rademacher":
        assert set(np.unique(np.round(m * math.sqrt(k)))) == {-1.0, 1.0}
    bound = privacy.sensitivity(B, "replace-one")
    D = np.array([ball_point(rng, cols, B) for _ in range(n)])
    worst = 0.0
    for _ in range(3000):
        D2 = D.copy()
        i = rng.integers(n)
        D2[i] = -D[i] * rng.uniform(0.95, 1) if rng.uniform() < 0.5 else ball_point(rng, cols, B)
        worst = max(worst, float(np.linalg.norm(m @ D - m @ D2)))
    assert worst <= bound * (1 + 1e-12)
    assert worst > 0.9 * bound
    # add/remove: one more column of M times the new row
    extra = baselines.mixing_matrix(k, 1, rng, mixing)
    row = ball_point(rng, cols, B, on_sphere=True)
    assert np.linalg.norm(np.outer(extra[:, 0], row)) == pytest.approx(privacy.sensitivity(B, "add-remove"))


def test_rmgm_release_is_the_mixed_data_plus_noise():
    """With the same generator state, the release minus M D is the noise (chunking included)."""
    n, p = baselines.RMGM_CHUNK + 123, 3
    rng_data = np.random.default_rng(9)
    rows = simulation.clip_rows(rng_data.standard_normal((n, p + 1)), 1.0)
    z, k, sigma = baselines.rmgm_release(rows[:, :p], rows[:, p], Target(EPS, DELTA, 1.0, "replace-one"),
                                         rng=np.random.default_rng(1), k=50)
    rng = np.random.default_rng(1)
    mixed = baselines.mixing_matrix(50, baselines.RMGM_CHUNK, rng) @ rows[: baselines.RMGM_CHUNK]
    mixed += baselines.mixing_matrix(50, 123, rng) @ rows[baselines.RMGM_CHUNK :]
    noise = z - mixed
    assert np.std(noise) == pytest.approx(sigma, rel=0.1)
    np.testing.assert_allclose(noise, rng.normal(0.0, sigma, size=(50, p + 1)))


# ---------------------------------------------------------------------------------------------
# the papers' trends on analyzer.synthetic.regression_data (d = 10, B = 1, replace-one)

SEEDS = range(5)


@lru_cache(maxsize=None)
def ratios(epsilon: float, n: int) -> dict[str, np.ndarray]:
    """Ridge error ratios of every baseline, per mechanism, over SEEDS (fixed numpy seeds)."""
    out: dict[str, list[float]] = {}
    for seed in SEEDS:
        data = synthetic.regression_data(n, 10, seed=seed)
        rng = np.random.default_rng(np.random.SeedSequence([0xBA5E, int(epsilon * 100), n, seed]))
        res = central_baselines(data, epsilon=epsilon, delta=DELTA, rng=rng, tasks=("ridge",))["ridge"]
        for mech, val in res.items():
            out.setdefault(mech, []).append(val)
    return {m: np.asarray(v) for m, v in out.items()}


def geomean(v: np.ndarray) -> float:
    return float(np.exp(np.mean(np.log(v))))


def test_adassp_beats_plain_ssp_at_small_n():
    """Wang (2018): SSP's noisy Gram is badly conditioned when n is small; AdaSSP's private
    adaptive ridge fixes that."""
    r = ratios(1.0, 1000)
    assert r["adassp"].mean() < 0.5 * r["ssp"].mean()
    assert geomean(r["adassp"]) < geomean(r["ssp"])
    # at large n both converge to the optimum and the budget split costs AdaSSP little
    big = ratios(1.0, 100_000)
    assert big["adassp"].mean() < 1.02 and big["ssp"].mean() < 1.02


def test_rmgm_beats_dgm_at_large_n():
    """Paper 004, section 5.2: DGM-OLS's de-biased Hessian has small eigenvalues and blows up,
    RMGM-OLS does not (the paper sees it for every n up to 3e6)."""
    r = ratios(1.0, 100_000)
    assert r["rmgm_ols"].mean() < 0.5 * r["dgm_ols"].mean()
    assert geomean(r["rmgm_ols"]) < 0.5 * geomean(r["dgm_ols"])


def test_ratios_fall_as_n_grows():
    # at epsilon = 1 the Gram-based central mechanisms and RMGM improve from n = 1e3 to 1e5 ...
    small, big = ratios(1.0, 1000), ratios(1.0, 100_000)
    for mech in ("central", "ssp", "adassp", "rmgm_ols"):
        assert big[mech].mean() < small[mech].mean(), mech
        assert geomean(big[mech]) < geomean(small[mech]), mech
    # ... while the local model and DGM-OLS (the same release: noise on every row) are still
    # noise-dominated there on this data (their noise Gram ~ sigma^2 sqrt(n d) exceeds the
    # signal ~ n E x^2 until n ~ 1e8); at a large epsilon every mechanism is past that point
    small, big = ratios(20.0, 1000), ratios(20.0, 100_000)
    for mech in RIDGE_BASELINES:
        if mech == "optimum":
            continue
        assert geomean(big[mech]) < geomean(small[mech]), mech
    assert geomean(big["dgm_ols"]) < 0.2 * geomean(small["dgm_ols"])
    assert geomean(big["local"]) < 0.6 * geomean(small["local"])


def test_every_ratio_is_at_least_one_and_the_optimum_is_one():
    for eps, n in ((1.0, 1000), (1.0, 100_000), (20.0, 1000), (20.0, 100_000)):
        r = ratios(eps, n)
        assert set(r) == set(RIDGE_BASELINES)
        for mech, vals in r.items():
            assert np.all(np.isfinite(vals)), mech
            assert np.all(vals >= 1 - 1e-9), (mech, vals)
        np.testing.assert_allclose(r["optimum"], 1.0, rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# the evaluation API


def test_central_baselines_pca_and_array_input():
    low = synthetic.lowrank_data(20_000, 8, seed=1)
    out = central_baselines(low, rng=np.random.default_rng(0))
    assert set(out) == {"pca"}  # no label: ridge skipped
    assert list(out["pca"]) == list(PCA_BASELINES)
    assert out["pca"]["optimum"] == pytest.approx(1.0)
    assert all(v >= 1 - 1e-9 for v in out["pca"].values())
    assert out["pca"]["analyze_gauss"] < out["pca"]["local"]
    # the same on a plain array with explicit bound, label and mechanisms
    reg = synthetic.regression_data(2000, 5, seed=2)
    arr = central_baselines(
        reg.rows, row_bound=1.0, columns=reg.columns, label="y", rng=np.random.default_rng(0),
        tasks=("ridge",), mechanisms=("optimum", "adassp", "rmgm_ols"),
    )
    assert list(arr["ridge"]) == ["optimum", "adassp", "rmgm_ols"]
    with pytest.raises(ValueError, match="row_bound"):
        central_baselines(reg.rows, label="y")
    with pytest.raises(ValueError, match="unknown mechanisms"):
        central_baselines(reg, mechanisms=("adassp", "nope"))


def test_compare_extra_adds_the_baselines_and_defaults_unchanged():
    n = 3000
    reg = synthetic.regression_data(n, 6, seed=4)
    st = studies.make_study(reg.columns, n, reg.label, seed="baselines-tests")
    ltm = simulation.simulate_ltm(st, reg.rows, np.random.default_rng(0))
    plain = compare(reg, st, ltm, rng=np.random.default_rng(1), tasks=("ridge",))
    assert set(plain["ridge"]) == {"ltm", "local", "central"}
    more = compare(reg, st, ltm, rng=np.random.default_rng(1), tasks=("ridge",), extra=EXTRA_BASELINES)
    assert set(more["ridge"]) == {"ltm", "local", "central"} | set(EXTRA_BASELINES)
    # the default entries are drawn first from the same generator: identical
    for mech in ("ltm", "local", "central"):
        assert more["ridge"][mech] == plain["ridge"][mech]
    assert more["ridge"]["optimum"] == pytest.approx(1.0)
    # PCA gets only the names that apply to it
    low = synthetic.lowrank_data(n, 6, seed=4)
    st2 = studies.make_study(low.columns, n, None, seed="baselines-tests")
    ltm2 = simulation.simulate_ltm(st2, low.rows, np.random.default_rng(0))
    pca = compare(low, st2, ltm2, rng=np.random.default_rng(1), tasks=("pca",), extra=EXTRA_BASELINES)
    assert set(pca) == {"pca"}
    assert set(pca["pca"]) == {"ltm", "local", "central", "optimum"}
