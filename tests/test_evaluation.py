"""Baselines, the LTM simulator, synthetic data and the error ratios."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpsketch.analyzer import simulation, synthetic
from dpsketch.analyzer.estimators import PCA, RidgeRegression
from dpsketch.analyzer.error_ratios import (
    compare,
    pca_error,
    pca_optimum,
    pca_ratio,
    ridge_optimum,
    ridge_ratio,
)
from research.evaluation import proposed_k
from dpsketch.protocol import design, features, privacy, sketch

import studies


def make_study(columns, n, label=None, epsilon=1.0, k=None, neighbouring="replace-one",
               epsilon_floor="default", kind="sketch", secret_sign=None):
    """design()'s study; ``epsilon_floor=None`` for one without server noise (sigma as before);
    ``secret_sign`` as design() takes it (None: signed when the study can be)."""
    return studies.make_study(columns, n, label, seed="evaluation-tests", epsilon=epsilon, k=k,
                              neighbouring=neighbouring, epsilon_floor=epsilon_floor, kind=kind,
                              secret_sign=secret_sign)


# ---------------------------------------------------------------------------------------------
# the central Gram mechanism


def test_upper_triangle_norm_is_frobenius_and_invertible():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((6, 6))
    m = m + m.T
    u = simulation.upper_triangle(m)
    assert u.shape == (21,)
    assert np.linalg.norm(u) == pytest.approx(np.linalg.norm(m, "fro"))
    np.testing.assert_allclose(simulation.symmetric_from_upper(u, 6), m)


@pytest.mark.parametrize("d", [1, 2, 5, 11])
def test_gram_sensitivity_bound_holds_and_is_tight(d):
    rng = np.random.default_rng(d)
    B = 1.7
    bound = simulation.gram_sensitivity(B, "replace-one")
    assert bound == pytest.approx(math.sqrt(2) * B**2)
    worst = 0.0
    for _ in range(4000):
        a, b = rng.standard_normal((2, d))
        a *= B / np.linalg.norm(a)  # on the sphere of radius B
        b *= B * rng.uniform(0, 1) ** 0.1 / np.linalg.norm(b)  # inside the ball, near the sphere
        diff = np.linalg.norm(simulation.upper_triangle(np.outer(a, a)) - simulation.upper_triangle(np.outer(b, b)))
        worst = max(worst, diff)
    assert worst <= bound * (1 + 1e-12)
    if d >= 2:
        # orthogonal rows on the sphere attain it
        e1, e2 = np.eye(d)[0] * B, np.eye(d)[1] * B
        diff = np.linalg.norm(simulation.upper_triangle(np.outer(e1, e1)) - simulation.upper_triangle(np.outer(e2, e2)))
        assert diff == pytest.approx(bound)
        assert worst > 0.9 * bound
    # add/remove: the change is a a^T itself
    assert simulation.gram_sensitivity(B, "add-remove") == pytest.approx(B**2)
    a = rng.standard_normal(d)
    a *= B / np.linalg.norm(a)
    assert np.linalg.norm(simulation.upper_triangle(np.outer(a, a))) == pytest.approx(B**2)


def test_central_noise_has_calibrated_scale():
    rows = np.zeros((10, 4))
    cols = ["a", "b", "c", "d"]
    sig = simulation.central_sigma(1.0, 1e-6, 1.0, "replace-one")
    assert sig == pytest.approx(privacy.gaussian_sigma(1.0, 1e-6, math.sqrt(2.0)))
    rng = np.random.default_rng(1)
    draws = np.array(
        [
            simulation.upper_triangle(
                simulation.central_gram(rows, cols, simulation.Target(1.0, 1e-6, 1.0, "replace-one"), rng=rng).gram()
            )
            for _ in range(300)
        ]
    )
    # all 10 coordinates of u(W) share one scale: pool them (3000 samples)
    assert draws.std() == pytest.approx(sig, rel=0.05)
    assert abs(draws.mean()) < 5 * sig / np.sqrt(draws.size)
    # matrix form: off-diagonal noise is sigma / sqrt(2), diagonal sigma
    mats = np.array([simulation.symmetric_from_upper(u, 4) for u in draws])
    assert mats[:, 0, 1].std() == pytest.approx(sig / np.sqrt(2), rel=0.15)
    assert mats[:, 2, 2].std() == pytest.approx(sig, rel=0.15)


def test_local_noise_scale():
    study = make_study(["a", "b"], 1000)
    rng = np.random.default_rng(2)
    rel = simulation.simulate_local(study, np.zeros((20000, 2)), rng)
    assert rel.sigma == pytest.approx(privacy.local_sigma(1.0, 1e-6, 1.0, "replace-one"))
    assert rel.noisy_rows.std() == pytest.approx(rel.sigma, rel=0.02)
    assert rel.gram(True)[0, 0] == pytest.approx(0.0, abs=5 * rel.sigma**2 * math.sqrt(2 * 20000))


# ---------------------------------------------------------------------------------------------
# the LTM simulator


def test_simulated_ltm_equals_dense_sketch_of_noisy_rows():
    n = 300
    data = synthetic.regression_data(n, 4, seed=1)
    # no servers' noise, no secret sign (test_simulated_ltm_signs_each_row_whole)
    study = make_study(data.columns, 2000, label="y", k=12, epsilon_floor=None, secret_sign=False)
    rel, ids, noise = simulation.simulate_ltm(study, data.rows, np.random.default_rng(3), return_inputs=True)
    assert len(ids) == n and all(len(r) == 16 for r in ids)
    assert len(set(ids)) == n
    assert noise.shape == data.rows.shape
    assert noise.std() == pytest.approx(study.sigma, rel=0.1)
    dense = sketch.dense_matrix(study.seed_bytes, ids, study.k, study.s)
    np.testing.assert_allclose(rel.sketch, dense @ (data.rows + noise), rtol=1e-12, atol=1e-12)
    # every column of S has unit norm, so trace(S^T S) = n: the debiasing constant
    assert np.sum(dense**2) == pytest.approx(n)
    assert rel.n_reports == n and rel.gram_bias == pytest.approx(study.sigma**2 * n)


def test_simulated_ltm_via_ring_matches_float_path():
    n = 400
    data = synthetic.lowrank_data(n, 5, rank=2, seed=2)
    study = make_study(data.columns, 2000, k=8, epsilon_floor=None)  # no servers' noise
    a = simulation.simulate_ltm(study, data.rows, np.random.default_rng(4))
    b = simulation.simulate_ltm(study, data.rows, np.random.default_rng(4), via_ring=True)
    np.testing.assert_allclose(a.sketch, b.sketch, atol=n * 2.0 ** -study.frac_bits)


def test_simulated_ltm_signs_each_row_whole():
    """A secret-sign study (the default for a sketch study): the simulated release is
    S(diag(t) A + G) for signs t = +-1, each row signed whole, about half of them flipped. With
    fewer rows than sketch rows S has full column rank, so diag(t) A is recovered exactly."""
    n = 40
    data = synthetic.regression_data(n, 4, seed=1)
    study = make_study(data.columns, 2000, label="y", k=48, epsilon_floor=None)
    assert study.secret_sign
    rel, ids, noise = simulation.simulate_ltm(study, data.rows, np.random.default_rng(3), return_inputs=True)
    dense = sketch.dense_matrix(study.seed_bytes, ids, study.k, study.s)
    signed = np.linalg.lstsq(dense, rel.sketch - dense @ noise, rcond=None)[0]
    flipped = np.all(np.abs(signed + data.rows) < 1e-9, axis=1)
    kept = np.all(np.abs(signed - data.rows) < 1e-9, axis=1)
    assert np.all(flipped ^ kept)
    assert 10 <= flipped.sum() <= 30
    # second moments are the data's
    np.testing.assert_allclose(signed.T @ signed, data.rows.T @ data.rows, atol=1e-9)


@pytest.mark.parametrize("via_ring", [False, True])
def test_simulated_ltm_adds_the_servers_noise(via_ring):
    """With a floor the simulated release is S(A + G) plus the N servers' noise, i.e.
    N(0, N server_sigma^2) per released cell, on both paths; the release's noise law counts it."""
    n = 300
    data = synthetic.regression_data(n, 4, seed=1)
    study = make_study(data.columns, 2000, label="y", k=12, secret_sign=False)  # residual = servers' noise
    assert study.server_sigma > 0 and study.n_servers == 2
    residuals = []
    for seed in range(30):  # 30 x 12 x 5 = 1800 cells
        rel, ids, noise = simulation.simulate_ltm(study, data.rows, np.random.default_rng(100 + seed),
                                                 via_ring=via_ring, return_inputs=True)
        assert noise.std() == pytest.approx(study.sigma, rel=0.1)
        dense = sketch.dense_matrix(study.seed_bytes, ids, study.k, study.s)
        residuals.append(rel.sketch - dense @ (data.rows + noise))
    res = np.array(residuals)
    std = math.sqrt(study.n_servers) * study.server_sigma
    assert res.std() == pytest.approx(std, rel=0.1)  # 1800 cells: 10% is 6 standard errors
    assert abs(res.mean()) < 5 * std / math.sqrt(res.size)
    assert rel.gram_bias == pytest.approx(study.sigma**2 * n + study.k * std**2)


def test_simulated_gram_release_adds_the_servers_noise():
    """A gram study's simulated sum carries N(0, n sigma^2 + N server_sigma^2) per coordinate,
    its ``coordinate_noise_std``, whether drawn at once or per client through the ring."""
    n = 500
    data = synthetic.regression_data(n, 3, seed=2)
    study = make_study(data.columns, n, label="y", kind="gram")
    assert study.server_sigma > 0
    phi = features.gram_features(data.rows)
    for via_ring in (False, True):
        residuals = []
        for seed in range(40):
            rel = simulation.simulate_ltm(study, data.rows, np.random.default_rng(200 + seed), via_ring=via_ring)
            residuals.append(np.asarray(rel.values) - phi.sum(axis=0))
        res = np.array(residuals)  # 40 x 15 coordinates
        std = math.sqrt(n * study.sigma**2 + study.n_servers * study.server_sigma**2)
        assert rel.coordinate_noise_std == pytest.approx(std, rel=1e-12)
        assert res.std() == pytest.approx(std, rel=0.15), via_ring  # 600 draws: 15% is 5 se
        assert abs(res.mean()) < 5 * std / math.sqrt(res.size)


def test_simulate_clips_rows_to_the_bound():
    study = make_study(["a", "b"], 1000, k=4)
    rows = np.array([[3.0, 4.0], [0.3, 0.4]])
    np.testing.assert_allclose(simulation.clip_rows(rows, 1.0), [[0.6, 0.8], [0.3, 0.4]])
    with pytest.raises(ValueError):
        simulation.simulate_ltm(study, np.zeros((5, 3)), np.random.default_rng(0))


# ---------------------------------------------------------------------------------------------
# synthetic data


def test_synthetic_data_deterministic_and_bounded():
    a = synthetic.regression_data(1000, 5, seed=7)
    b = synthetic.regression_data(1000, 5, seed=7)
    c = synthetic.regression_data(1000, 5, seed=8)
    np.testing.assert_array_equal(a.rows, b.rows)
    assert not np.array_equal(a.rows, c.rows)
    assert a.columns == ["x0", "x1", "x2", "x3", "x4", "y"] and a.label == "y"
    norms = np.linalg.norm(a.rows, axis=1)
    assert norms.max() == pytest.approx(1.0) and np.all(norms <= 1.0 + 1e-12)
    # the common scale keeps the linear model: y / c = x / c . theta + noise
    resid = a.target() / a.scale - (a.features() / a.scale) @ a.truth["theta"]
    assert resid.std() == pytest.approx(synthetic.DEFAULT_LABEL_NOISE, rel=0.1)

    low = synthetic.lowrank_data(2000, 10, rank=3, big=1.0, small=0.1, seed=7)
    np.testing.assert_array_equal(low.rows, synthetic.lowrank_data(2000, 10, rank=3, big=1.0, small=0.1, seed=7).rows)
    assert np.linalg.norm(low.rows, axis=1).max() == pytest.approx(1.0)
    sv = np.linalg.svd(low.rows, compute_uv=False)
    np.testing.assert_allclose(sv, low.truth["singular_values"], rtol=1e-10)
    np.testing.assert_allclose(sv[:3] / sv[3:].max(), 10.0, rtol=1e-10)
    assert low.columns == [f"x{i}" for i in range(10)] and low.rank == 3

    # quantile scaling: 1% of the rows clipped to B, the rest inside, the linear model intact
    q = synthetic.regression_data(20000, 5, seed=7, clip_quantile=0.99)
    norms = np.linalg.norm(q.rows, axis=1)
    assert np.all(norms <= 1.0 + 1e-12)
    assert np.mean(norms > 1.0 - 1e-9) == pytest.approx(0.01, abs=0.002)
    assert q.scale > synthetic.regression_data(20000, 5, seed=7).scale
    fit = np.linalg.lstsq(q.features(), q.target(), rcond=None)[0]
    assert np.linalg.norm(fit - q.truth["theta"]) < 0.05
    with pytest.raises(ValueError):
        synthetic.regression_data(100, 3, clip_quantile=0.1)


# ---------------------------------------------------------------------------------------------
# error ratios


def test_ratios_are_one_at_the_optimum_and_above_elsewhere():
    data = synthetic.regression_data(3000, 4, seed=1)
    X, y = data.features(), data.target()
    for alpha in (0.0, 3.0):
        theta = ridge_optimum(X, y, alpha)
        assert ridge_ratio(X, y, theta, alpha) == pytest.approx(1.0)
        assert ridge_ratio(X, y, theta + 0.01, alpha) > 1.0
        # the exact-Gram estimator reaches it
        model = RidgeRegression("y", alpha=alpha).fit(simulation.exact_gram(data.rows, data.columns))
        assert ridge_ratio(X, y, model.coef_, alpha) == pytest.approx(1.0, abs=1e-9)
    low = synthetic.lowrank_data(3000, 6, rank=2, seed=1)
    v = pca_optimum(low.rows, 2)
    assert pca_ratio(low.rows, v) == pytest.approx(1.0)
    assert pca_error(low.rows, v) == pytest.approx(np.sum(low.truth["singular_values"][2:] ** 2))
    other = np.eye(6)[:2]
    assert pca_ratio(low.rows, other) > 1.0
    model = PCA(2).fit(simulation.exact_gram(low.rows, low.columns))
    assert pca_ratio(low.rows, model.components_) == pytest.approx(1.0)


@pytest.mark.parametrize("k_choice", ["design", "proposed"])
def test_compare_ltm_beats_local_at_1e5(k_choice):
    """n = 10^5, epsilon = 1, delta = 1e-6, replace-one, d = 10 (+ label), mean over 8 seeds,
    design()'s default floor (the servers' noise included).

    With the proposed k (20) the LTM beats local on both tasks. The floor hardly moves this
    (simulated over 40 seeds, ridge LTM 4.98 with the floor and 4.90 without, local 8.37; PCA LTM
    12.1 and 12.8, local 29.7), but the ridge ratios vary a lot per seed (std about 1.9 for LTM,
    2.1 for local): with 4 seeds, LTM's mean exceeded local's in 1 of 15 random streams of this
    procedure -- the stream of this test once the servers' noise draws shifted it -- so the test
    averages 8 seeds. With design()'s k (440/400) it
    beats local on PCA, but ridge is at the noise level there (the noise x noise part of the
    Gram error grows like sqrt(k); both LTM and local are close to the zero predictor), so for
    ridge we only check it is not worse than local by more than noise. Central is best; the
    output structure is what the demo consumes."""
    n = 100_000
    ratios = {"ridge": {}, "pca": {}}
    for seed in range(8):
        rng = np.random.default_rng(20 + seed)
        reg = synthetic.regression_data(n, 10, seed=seed)
        k = None if k_choice == "design" else proposed_k(n, reg.d)
        study = make_study(reg.columns, n, label="y", k=k)
        ltm = simulation.simulate_ltm(study, reg.rows, rng)
        out = compare(reg, study, ltm, rng=rng, tasks=("ridge",))
        assert set(out) == {"ridge"} and set(out["ridge"]) == {"ltm", "local", "central"}
        low = synthetic.lowrank_data(n, 10, seed=seed)
        k = None if k_choice == "design" else proposed_k(n, low.d)
        study = make_study(low.columns, n, k=k)
        ltm = simulation.simulate_ltm(study, low.rows, rng)
        out.update(compare(low, study, ltm, rng=rng, tasks=("pca",)))
        for task in ("ridge", "pca"):
            assert min(out[task].values()) >= 1.0 - 1e-9
            for mech, val in out[task].items():
                ratios[task].setdefault(mech, []).append(val)
    for task in ("ridge", "pca"):
        mean = {mech: float(np.mean(v)) for mech, v in ratios[task].items()}
        assert mean["central"] < 1.01
        assert mean["central"] < mean["ltm"], (task, mean)
        if task == "pca" or k_choice == "proposed":
            assert mean["ltm"] < mean["local"], (task, mean)
        else:
            assert mean["ltm"] < 1.5 * mean["local"], (task, mean)
    if k_choice == "proposed":
        assert np.mean(ratios["pca"]["local"]) > 1.5 * np.mean(ratios["pca"]["ltm"])


def test_compare_checks_its_inputs():
    data = synthetic.regression_data(500, 3, seed=0)
    study = make_study(data.columns, 500, label="y", k=4)
    ltm = simulation.simulate_ltm(study, data.rows, np.random.default_rng(0))
    with pytest.raises(ValueError):
        compare(data.rows[:-1], study, ltm)
    with pytest.raises(ValueError):
        compare(data.rows[:, :-1], study, ltm)
    out = compare(data.rows, study, ltm, rank=2)  # a plain array in the study's column order
    assert set(out) == {"ridge", "pca"}


def test_compare_without_references_fits_only_the_given_release():
    """recommend compares two kinds on the same rows and simulates local and central once."""
    data = synthetic.regression_data(3000, 4, seed=3)
    study, _ = design(name="t", columns=data.columns, label=data.label, servers=["s1", "s2"],
                      expected_reports=3000)
    release = simulation.simulate_ltm(study, data.rows, np.random.default_rng(0))
    full = compare(data, study, release, rng=np.random.default_rng(1), tasks=("ridge",))
    bare = compare(data, study, release, rng=np.random.default_rng(1), tasks=("ridge",), references=False)
    assert set(full["ridge"]) == {"ltm", "local", "central"} and set(bare["ridge"]) == {"ltm"}
    assert bare["ridge"]["ltm"] == pytest.approx(full["ridge"]["ltm"], rel=1e-12)
