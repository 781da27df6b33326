"""Estimators on releases: exactness without noise, debiasing, robustness, PCA geometry."""

from __future__ import annotations


import numpy as np
import pytest

from dpsketch.analyzer import simulation, synthetic
from dpsketch.analyzer.estimators import PCA, LeastSquares, RidgeRegression, default_ridge_alpha, robust_solve
from dpsketch.analyzer.error_ratios import ridge_optimum
from dpsketch.analyzer.release import GramRelease, SecondMoments, SketchRelease
from dpsketch.protocol import ring, sketch

import studies


def make_study(columns, n, label=None, epsilon=1.0, k=None, seed="s", epsilon_floor="default",
               secret_sign=None):
    """design()'s study; ``epsilon_floor=None`` for one without server noise (sigma as before);
    ``secret_sign=False`` for the unsigned calibration (design()'s default signs sketch studies)."""
    return studies.make_study(columns, n, label, seed=seed, epsilon=epsilon, k=k,
                              epsilon_floor=epsilon_floor, secret_sign=secret_sign)


def servers_noise(study):
    """What the N servers add to the released sketch: each server's ``study.server_noise()``
    (the function services/store.py calls at commit), decoded and scaled as the analyzer does."""
    total = np.zeros(study.aggregate_shape)
    for _ in range(study.n_servers):
        total += ring.decode(study.server_noise(), study.frac_bits) * sketch.scale(study.s)
    return total


def exact_linear(n, d, rng):
    """Rows [x, x.theta] with no label noise, scaled into the unit ball."""
    x = rng.standard_normal((n, d))
    theta = rng.standard_normal(d)
    rows = np.column_stack([x, x @ theta])
    return rows / np.linalg.norm(rows, axis=1).max(), theta


def principal_sines(v1, v2):
    """Sines of the principal angles between the row spans of v1 and v2 (orthonormal rows)."""
    s = np.linalg.svd(v1 @ v2.T, compute_uv=False)
    return np.sqrt(np.clip(1.0 - s**2, 0.0, None))


# ---------------------------------------------------------------------------------------------
# noise-free recovery


def test_protocol_conformance():
    rng = np.random.default_rng(0)
    rows, _ = exact_linear(50, 3, rng)
    cols = ["a", "b", "c", "y"]
    study = make_study(cols, 1000, label="y")
    rel = simulation.simulate_ltm(study, rows, rng)
    for obj in (rel, simulation.exact_gram(rows, cols), simulation.simulate_local(study, rows, rng),
                simulation.simulate_central(study, rows, rng)):
        assert isinstance(obj, SecondMoments)
        assert obj.columns == cols
        assert obj.n_reports == 50
        assert obj.gram(True).shape == (4, 4)


def test_exact_gram_ridge_and_least_squares_match_non_private_solution():
    rng = np.random.default_rng(1)
    data = synthetic.regression_data(5000, 6, seed=3)
    rel = simulation.exact_gram(data.rows, data.columns)
    X, y = data.features(), data.target()
    for alpha in (0.0, 0.5, 50.0):
        m = RidgeRegression("y", alpha=alpha).fit(rel)
        np.testing.assert_allclose(m.coef_, ridge_optimum(X, y, alpha), rtol=1e-8, atol=1e-10)
        assert m.alpha_ == alpha
    ls = LeastSquares("y").fit(rel)
    np.testing.assert_allclose(ls.coef_, np.linalg.lstsq(X, y, rcond=None)[0], rtol=1e-8)
    # the default alpha on a noise-free release is 0: plain least squares
    assert RidgeRegression("y").fit(rel).alpha_ == 0.0
    np.testing.assert_allclose(ls.predict(X[:5]), X[:5] @ ls.coef_)
    assert ls.feature_names_ == [f"x{i}" for i in range(6)]
    del rng


def test_least_squares_on_rank_deficient_exact_gram_is_min_norm():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((200, 3))
    x = np.column_stack([x, x[:, 0]])  # a duplicated feature
    y = x @ np.array([1.0, -2.0, 0.5, 1.0])
    rows = np.column_stack([x, y]) / 10
    rel = simulation.exact_gram(rows, ["a", "b", "c", "d", "y"])
    m = LeastSquares("y").fit(rel)
    assert np.all(np.isfinite(m.coef_))
    np.testing.assert_allclose(m.coef_, np.linalg.pinv(rows[:, :4]) @ rows[:, 4], atol=1e-8)
    assert m.n_floored_ == 1


def test_noise_free_sketch_recovers_exact_solutions():
    """Y = S A with no noise (the sigma -> 0 limit): a subspace embedding keeps an exactly
    linear relation and an exactly low-rank row space, so the solutions are exact."""
    rng = np.random.default_rng(3)
    n, d = 20000, 5
    rows, theta = exact_linear(n, d, rng)
    cols = [f"x{i}" for i in range(d)] + ["y"]
    # epsilon = 100 makes the declared noise (and so the eigenvalue floor) tiny
    study = make_study(cols, n, label="y", k=48, epsilon=100.0)
    ids = simulation.random_report_ids(n, rng)
    rel = SketchRelease(study=study, sketch=simulation.ltm_sketch(study, ids, rows), n_reports=n)
    m = LeastSquares("y", debias=False).fit(rel)
    assert m.n_floored_ == 0
    np.testing.assert_allclose(m.coef_, theta, rtol=1e-8, atol=1e-10)

    low = synthetic.lowrank_data(n, 8, rank=3, small=0.0, seed=1)
    study = make_study(low.columns, n, k=32, epsilon=100.0)
    rel = SketchRelease(study=study, sketch=simulation.ltm_sketch(study, ids, low.rows), n_reports=n)
    p = PCA(3, debias=False).fit(rel)
    assert principal_sines(p.components_, low.truth["V"][:3]).max() < 1e-6
    # with debias=False the singular values are those of Y exactly
    np.testing.assert_allclose(p.singular_values_, np.linalg.svd(rel.sketch, compute_uv=False)[:3])


def test_tiny_noise_ltm_is_close_to_non_private():
    """A real simulated release at epsilon = 100 (sigma ~ 0.03 against rows of norm <= 1)."""
    rng = np.random.default_rng(4)
    n, d = 20000, 4
    rows, theta = exact_linear(n, d, rng)
    cols = [f"x{i}" for i in range(d)] + ["y"]
    study = make_study(cols, n, label="y", epsilon=100.0, k=40)
    rel = simulation.simulate_ltm(study, rows, rng)
    m = LeastSquares("y").fit(rel)
    assert np.linalg.norm(m.coef_ - theta) < 0.1 * np.linalg.norm(theta)
    p = PCA(d).fit(rel)  # the data span d of the d + 1 dimensions
    normal = np.append(theta, -1.0) / np.linalg.norm(np.append(theta, -1.0))
    assert np.linalg.norm(p.components_ @ normal) < 0.05


# ---------------------------------------------------------------------------------------------
# debiasing


@pytest.mark.parametrize("epsilon, floor", [(1.0, None), (1.0, "default"), (4.0, "default")],
                         ids=["no-floor", "floor", "floor-servers-only"])
def test_debiased_gram_is_unbiased_for_fixed_sketch(epsilon, floor):
    """E[Y^T Y] - (sigma^2 n + k N server_sigma^2) I = A^T S^T S A exactly, Y = S(A + G) + E with
    E the N servers' noise; check the mean over noise draws. Without a floor E = 0 (the original
    law); with the default floor at epsilon = 1 both parts add up; at epsilon = 4 = the floor the
    clients add nothing (sigma = 0) and the whole bias is the servers' noise, so the check is on
    the k N server_sigma^2 term alone."""
    rng = np.random.default_rng(5)
    n, d = 2000, 3
    # the unsigned calibration: its noise sizes are what the bounds below were set for (the sign
    # changes sigma, not the law of Y^T Y given sigma)
    study = make_study(["a", "b", "c"], n, k=20, epsilon=epsilon, epsilon_floor=floor, secret_sign=False)
    server_part = study.k * study.n_servers * study.server_sigma**2
    if floor is None:
        assert study.server_sigma == 0
    else:
        assert study.server_sigma > 0
    if epsilon == 4.0:
        assert study.sigma == 0  # the servers carry all the noise
    a = simulation.clip_rows(rng.standard_normal((n, d)) * 0.3, 1.0)
    ids = simulation.random_report_ids(n, rng)
    s = simulation.sketch_matrix(study, ids)
    target = (s @ a).T @ (s @ a)
    draws = 300
    deb, raw = [], []
    for _ in range(draws):
        y = s @ (a + rng.normal(0, study.sigma, size=a.shape)) + servers_noise(study)
        rel = SketchRelease(study=study, sketch=y, n_reports=n)
        deb.append(rel.gram(True))
        raw.append(rel.gram(False))
    deb, raw = np.array(deb), np.array(raw)
    se = deb.std(axis=0) / np.sqrt(draws)
    bias = study.sigma**2 * n + server_part
    assert rel.gram_bias == pytest.approx(bias, rel=1e-12)
    assert np.all(np.abs(deb.mean(axis=0) - target) < 5 * se)
    assert np.all(np.abs(np.diag(raw.mean(axis=0) - target) - bias) < 5 * np.diag(se))
    assert bias > 20 * se.max()
    if epsilon == 4.0:
        assert server_part > 20 * se.max()  # leaving out the servers' term would be caught


@pytest.mark.parametrize("floor", [None, "default"], ids=["no-floor", "floor"])
def test_debiasing_reduces_ridge_bias_over_seeds(floor):
    """Without a floor the noise is the clients' (sigma^2 n); with the default floor at
    epsilon = 10 (= the floor) the clients add nothing and the servers carry all of it
    (k N server_sigma^2): debiasing must remove either."""
    rng = np.random.default_rng(6)
    n, d = 20000, 3
    x = rng.standard_normal((n, d))
    theta = np.array([1.0, -0.5, 0.25])
    y = x @ theta + 0.3 * rng.standard_normal(n)
    rows = np.column_stack([x, y])
    rows /= np.linalg.norm(rows, axis=1).max()
    cols = ["a", "b", "c", "y"]
    # epsilon = 10: noise energy is ~15% (no floor; ~22% with the servers' noise) of the data's,
    # a regime where debiasing matters but the debiased Gram stays positive definite
    study = make_study(cols, n, label="y", k=40, epsilon=10.0, epsilon_floor=floor, secret_sign=False)
    assert (study.server_sigma > 0 and study.sigma == 0) if floor else study.server_sigma == 0
    server_std = np.sqrt(study.n_servers) * study.server_sigma  # the N servers' noise per cell
    # fix the sketch and vary only the noise, so the target is the noise-free sketched solution
    s = simulation.sketch_matrix(study, simulation.random_report_ids(n, rng))
    sa = s @ rows
    truth = ridge_optimum(sa[:, :3], sa[:, 3], 0.0)
    fits = {True: [], False: []}
    for _ in range(60):
        y = s @ (rows + rng.normal(0, study.sigma, size=rows.shape))
        y = y + rng.normal(0, server_std, size=y.shape)
        rel = SketchRelease(study=study, sketch=y, n_reports=n)
        for debias in (True, False):
            fits[debias].append(RidgeRegression("y", alpha=0.0, debias=debias).fit(rel).coef_)
    bias_deb = np.linalg.norm(np.mean(fits[True], axis=0) - truth)
    bias_raw = np.linalg.norm(np.mean(fits[False], axis=0) - truth)
    assert bias_deb < 0.5 * bias_raw
    # without debiasing the noise acts as a ridge: shrinkage towards 0
    assert np.linalg.norm(np.mean(fits[False], axis=0)) < np.linalg.norm(truth)


# ---------------------------------------------------------------------------------------------
# robustness and defaults


def test_robust_solve_floors_indefinite_matrix():
    m = np.diag([4.0, -1.0, 0.001])
    x, changed = robust_solve(m, np.array([4.0, 1.0, 1.0]), floor=0.5)
    np.testing.assert_allclose(x, [1.0, 2.0, 2.0])
    assert changed == 2


def test_ridge_on_very_noisy_release_is_finite_and_shrunk():
    """The local model at small n: the debiased Gram is indefinite; the fit must not explode."""
    rng = np.random.default_rng(7)
    data = synthetic.regression_data(2000, 5, seed=1)
    study = make_study(data.columns, 2000, label="y")
    loc = simulation.simulate_local(study, data.rows, rng)
    assert np.linalg.eigvalsh(loc.gram(True)[:5, :5])[0] < 0
    for alpha in (None, 0.0):
        m = RidgeRegression("y", alpha=alpha).fit(loc)
        assert np.all(np.isfinite(m.coef_))
        assert np.linalg.norm(m.coef_) < 1.0
    m = RidgeRegression("y", alpha=0.0).fit(loc)
    assert m.n_floored_ >= 1


def test_default_alpha_is_adassp_and_deterministic():
    rng = np.random.default_rng(8)
    data = synthetic.regression_data(20000, 5, seed=2)
    study = make_study(data.columns, 20000, label="y")
    rel = simulation.simulate_ltm(study, data.rows, rng)
    a1 = RidgeRegression("y").fit(rel)
    a2 = RidgeRegression("y").fit(rel)
    assert a1.alpha_ == a2.alpha_
    np.testing.assert_array_equal(a1.coef_, a2.coef_)
    gxx = rel.gram(True)[:5, :5]
    tau = rel.gram_noise_scale
    assert tau > 0
    cross = rel.cross_noise_scale
    # the cross term: sqrt(v) ||A||_F with v = sigma^2 n/k + N server_sigma^2 the noise variance
    # of one released cell (clients' and servers'), ||A||_F^2 from the debiased release
    assert study.server_sigma > 0  # the default floor: the servers' noise is part of v
    energy = np.trace(rel.gram(True))
    cell = study.sigma**2 * 20000 / study.k + study.n_servers * study.server_sigma**2
    assert cross == pytest.approx(np.sqrt(cell) * np.sqrt(energy))
    assert energy > 0
    assert a1.alpha_ == pytest.approx(max(0.0, tau - np.linalg.eigvalsh(gxx)[0]) + cross)
    assert np.linalg.eigvalsh(gxx + a1.alpha_ * np.eye(5))[0] >= tau * (1 - 1e-9)
    assert default_ridge_alpha(gxx, 0.0) == 0.0


def test_tau_is_the_public_noise_scale_whatever_debias():
    """tau_ (the eigenvalue floor, answered as `tau`, docs/protocol.md 6c) is the formula of the
    public parameters alone, the same with and without debiasing, 0 for an exact release; and
    n_floored_ counts the eigenvalues of G_xx + alpha I below it."""
    rng = np.random.default_rng(9)
    n = 5000
    data = synthetic.regression_data(n, 4, seed=3)
    study = make_study(data.columns, n, label="y")
    rel = simulation.simulate_ltm(study, data.rows, rng)
    k, d = study.k, study.d
    bias = study.sigma ** 2 * n + k * study.n_servers * study.server_sigma ** 2
    want = bias * (2 * np.sqrt(d / k) + d / k)
    features = [i for i, c in enumerate(data.columns) if c != "y"]
    for debias in (True, False):
        for alpha in (0.0, 3.0 * want):
            m = RidgeRegression("y", alpha=alpha, debias=debias).fit(rel)
            assert m.tau_ == pytest.approx(want, rel=1e-12) and m.tau_ == m.noise_scale_
            gxx = rel.gram(debias)[np.ix_(features, features)]
            assert m.n_floored_ == int(np.sum(np.linalg.eigvalsh(gxx + alpha * np.eye(len(features))) < want))
    assert RidgeRegression("y", alpha=3.0 * want).fit(rel).n_floored_ == 0
    assert RidgeRegression("y", alpha=0.0).fit(rel).n_floored_ >= 1  # the noise dominates here
    exact = simulation.exact_gram(data.rows, data.columns)
    assert RidgeRegression("y").fit(exact).tau_ == 0.0


def test_unknown_label_and_bad_parameters():
    rel = simulation.exact_gram(np.eye(3), ["a", "b", "c"])
    with pytest.raises(KeyError):
        RidgeRegression("nope").fit(rel)
    with pytest.raises(ValueError):
        RidgeRegression("a", alpha=-1.0).fit(rel)
    with pytest.raises(ValueError):
        PCA(4).fit(rel)


# ---------------------------------------------------------------------------------------------
# PCA


def test_pca_components_orthonormal_and_match_truth_on_spectral_gap():
    data = synthetic.lowrank_data(20000, 10, rank=3, big=1.0, small=0.1, seed=4)
    exact = PCA(3).fit(simulation.exact_gram(data.rows, data.columns))
    np.testing.assert_allclose(exact.components_ @ exact.components_.T, np.eye(3), atol=1e-12)
    assert principal_sines(exact.components_, data.truth["V"][:3]).max() < 1e-6
    np.testing.assert_allclose(exact.singular_values_, data.truth["singular_values"][:3], rtol=1e-8)
    np.testing.assert_allclose(exact.explained_variance_, exact.singular_values_**2 / 20000)
    # sign convention: the largest entry of each component is positive
    assert np.all(exact.components_[np.arange(3), np.abs(exact.components_).argmax(1)] > 0)
    z = exact.transform(data.rows[:7])
    np.testing.assert_allclose(exact.inverse_transform(z), data.rows[:7] @ exact.projector(), atol=1e-12)

    # through a noisy LTM release (epsilon = 10): still orthonormal, close to the truth
    study = make_study(data.columns, 20000, k=40, epsilon=10.0)
    rel = simulation.simulate_ltm(study, data.rows, np.random.default_rng(9))
    p = PCA(3).fit(rel)
    np.testing.assert_allclose(p.components_ @ p.components_.T, np.eye(3), atol=1e-12)
    assert principal_sines(p.components_, data.truth["V"][:3]).max() < 0.5
    # debiasing changes the eigenvalues, not the components
    q = PCA(3, debias=False).fit(rel)
    np.testing.assert_allclose(np.abs(p.components_ @ q.components_.T), np.eye(3), atol=1e-10)
    np.testing.assert_allclose(q.eigenvalues_ - p.eigenvalues_, rel.gram_bias, rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# release construction


def test_from_ring_sum_matches_float_sketch():
    rng = np.random.default_rng(10)
    n = 500
    data = synthetic.regression_data(n, 3, seed=5)
    # no floor: the ring sum is exactly S(A + G), no servers' noise to account for
    study = make_study(data.columns, n, label="y", k=8, epsilon_floor=None)
    assert study.server_sigma == 0
    ids = simulation.random_report_ids(n, rng)
    noisy = data.rows + rng.normal(0, study.sigma, size=data.rows.shape)
    ring_sum = simulation.ltm_ring_sum(study, ids, noisy)
    # split into shares and reconstruct, as the analyzer does with the servers' answers
    total = ring.reconstruct(ring.share(ring_sum, 3))
    rel = SketchRelease.from_ring_sum(study, total, n)
    expected = sketch.dense_matrix(study.seed_bytes, ids, study.k, study.s) @ noisy
    np.testing.assert_allclose(rel.sketch, expected, atol=n * 2.0 ** -study.frac_bits)
    with pytest.raises(TypeError):
        SketchRelease.from_ring_sum(study, ring_sum.astype(np.int64), n)
    with pytest.raises(ValueError):
        SketchRelease.from_ring_sum(study, ring_sum[:-1], n)
    info = rel.noise_info()
    assert info["gram_bias"] == pytest.approx(study.sigma**2 * n)
    assert info["server_noise_variance"] == 0.0


def test_ring_sum_carries_each_servers_noise():
    """With a floor the ring sum is S(A + G) plus N draws of ``study.server_noise()`` (what each
    server adds at commit): after decoding, i.i.d. N(0, N server_sigma^2) per released cell on top
    of the float sketch, and the release's noise law says so."""
    rng = np.random.default_rng(11)
    n = 500
    data = synthetic.regression_data(n, 3, seed=5)
    study = make_study(data.columns, n, label="y", k=8)
    assert study.server_sigma > 0 and study.n_servers == 2
    ids = simulation.random_report_ids(n, rng)
    noisy = data.rows + rng.normal(0, study.sigma, size=data.rows.shape)
    expected = sketch.dense_matrix(study.seed_bytes, ids, study.k, study.s) @ noisy
    residuals, seeded = [], []  # the servers' CSPRNG draw; the simulator's numpy draw
    for _ in range(200):
        real = SketchRelease.from_ring_sum(study, simulation.ltm_ring_sum(study, ids, noisy), n)
        sim = SketchRelease.from_ring_sum(study, simulation.ltm_ring_sum(study, ids, noisy, rng), n)
        residuals.append(real.sketch - expected)
        seeded.append(sim.sketch - expected)
    std = np.sqrt(study.n_servers) * study.server_sigma
    for res in (np.array(residuals), np.array(seeded)):  # 6400 cells: std within 5% is 5.7 se
        assert res.std() == pytest.approx(std, rel=0.05)
        assert abs(res.mean()) < 5 * std / np.sqrt(res.size)
    info = real.noise_info()
    assert info["server_noise_variance"] == pytest.approx(study.n_servers * study.server_sigma**2)
    assert info["gram_bias"] == pytest.approx(study.sigma**2 * n + study.k * std**2)


def test_gram_release_debias_subtracts_bias():
    g = GramRelease(columns=["a", "b"], n_reports=10, gram_matrix=np.eye(2) * 5, bias=2.0)
    np.testing.assert_allclose(g.gram(True), np.eye(2) * 3)
    np.testing.assert_allclose(g.gram(False), np.eye(2) * 5)
    with pytest.raises(ValueError):
        GramRelease(columns=["a"], n_reports=1, gram_matrix=np.eye(2))


def test_fuller_option_is_fullers_modification_and_only_for_sketch_releases():
    """``fuller=a`` adds (1 - h) k v + a k v / (k - 1) to the debiased feature Gram (h = 1 when the
    smallest eigenvalue of the undebiased feature Gram exceeds (1 + 1/(k-1)) k v), so with a
    well-resolved Gram it is ridge with a k v / (k - 1) more penalty; it leaves Gram releases alone."""
    from dpsketch.analyzer.estimators import fuller_adjustment

    rng = np.random.default_rng(5)
    data = synthetic.regression_data(20_000, 5, seed=5, clip_quantile=0.99)
    study = make_study(data.columns, data.n, label="y", k=40, epsilon=4.0, epsilon_floor=None)
    release = simulation.simulate_ltm(study, data.rows, rng)
    k, kv = study.k, study.k * release.cell_noise_variance
    fi = list(range(5))
    raw = release.gram(False)[np.ix_(fi, fi)]
    assert np.linalg.eigvalsh(raw)[0] > (1 + 1 / (k - 1)) * kv  # the resolved case at this n
    assert fuller_adjustment(release, fi, 4.0) == pytest.approx(4.0 * kv / (k - 1))
    plain = RidgeRegression("y", alpha=10.0).fit(release).coef_
    more = RidgeRegression("y", alpha=10.0 + 4.0 * kv / (k - 1)).fit(release).coef_
    fuller = RidgeRegression("y", alpha=10.0, fuller=4.0).fit(release).coef_
    np.testing.assert_allclose(fuller, more, rtol=1e-10)
    assert not np.allclose(fuller, plain)
    # an unresolved Gram (lambda_hat < 1 + 1/(k-1)) subtracts less than k v
    weak = SketchRelease(study=study, sketch=release.sketch * 0.01, n_reports=release.n_reports)
    lam_hat = np.linalg.eigvalsh(weak.gram(False)[np.ix_(fi, fi)])[0] / kv
    assert fuller_adjustment(weak, fi, 0.0) == pytest.approx((1 - (lam_hat - 1 / (k - 1))) * kv)
    gram = GramRelease(columns=list(data.columns), n_reports=data.n, gram_matrix=data.rows.T @ data.rows)
    np.testing.assert_array_equal(RidgeRegression("y", fuller=4.0).fit(gram).coef_,
                                  RidgeRegression("y").fit(gram).coef_)
