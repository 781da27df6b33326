"""Estimators on noisy histograms (analyzer/analyses/histogram.py).

* exactness: with noise_variance 0 every statistic equals its non-private reference (scipy,
  scikit-learn, numpy) on the bin indices / representatives of the binned data;
* the generic quadratic-form algebra (Kronecker factors, traces, blockwise materialisation)
  equals the dense formulas on a small grid;
* unbiasedness: the debiased forms average to the truth over many noisy draws, where the plain
  plug-in is visibly biased, and the predicted variances match the spread of the draws;
* coverage of the confidence intervals over 2,000 simulated releases at the product's noise
  (n = 10^5, epsilon = 1: v = 50) and at a noisier one (v = 5,000, about epsilon = 0.1);
* bad input gives a ValueError that says what is wrong.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
from sklearn.metrics import roc_auc_score

from dpsketch.analyzer.analyses import histogram as hg
from dpsketch.analyzer.analyses.histogram import (AUC, BinnedMoments, Counts, GiniMeanDifference, GiniSimpson,
                                KendallTau, NoisyHistogram, QuadraticForm, Quantiles,
                                estimate_forms)
from dpsketch.protocol.histogram import OTHER, Axis, HistogramSpec


def release(spec: HistogramSpec, values: np.ndarray, v: float = 0.0,
            rng: np.random.Generator | None = None) -> NoisyHistogram:
    """The histogram of ``values`` ((n, axes) rows) plus N(0, v) per cell."""
    counts = np.bincount(spec.cell_index(values), minlength=spec.cells).astype(np.float64)
    if v:
        counts = counts + rng.normal(0.0, math.sqrt(v), spec.cells)
    return NoisyHistogram(spec, counts, v, len(values))


def noisy(exact: NoisyHistogram, v: float, rng: np.random.Generator) -> NoisyHistogram:
    return NoisyHistogram(exact.spec, exact.counts + rng.normal(0.0, math.sqrt(v), exact.counts.size),
                          v, exact.n_reports)


def correlated(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(size=n)
    return x, 0.6 * x + 0.8 * rng.normal(size=n)


XY = HistogramSpec(axes=[Axis(column="x", edges=list(np.linspace(-2.0, 2.0, 11))),
                         Axis(column="y", edges=list(np.linspace(-1.5, 1.5, 7)))])


def labelled(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A score and a label in {"neg", "pos", "unk", "weird"} ("weird" lands in "(other)")."""
    score = rng.normal(size=n)
    label = np.where(score + 1.2 * rng.normal(size=n) > 0.3, "pos", "neg").astype(object)
    label[rng.random(n) < 0.1] = "unk"
    label[rng.random(n) < 0.03] = "weird"
    return score, label


SCORE_LABEL = HistogramSpec(axes=[Axis(column="score", edges=list(np.linspace(-2.0, 2.0, 9))),
                                  Axis(column="label", categories=["neg", "pos", "unk"])])


def reference_gmd(values: np.ndarray) -> float:
    n = len(values)
    return float(np.abs(values[:, None] - values[None, :]).sum() / (n * (n - 1)))


# ---------------------------------------------------------------------------------------------
# Exactness without noise


def test_counts_exact_and_nonnegative_projection():
    rng = np.random.default_rng(1)
    x, y = correlated(2_000, rng)
    h = release(XY, np.column_stack([x, y]))
    c = Counts().fit(h)
    expected = np.zeros(XY.shape)
    np.add.at(expected, (XY.axes[0].index(x), XY.axes[1].index(y)), 1)
    np.testing.assert_array_equal(c.counts_, expected)
    np.testing.assert_allclose(c.proportions_, expected / 2_000)
    assert c.se_ == 0 and c.counts_ci_.shape == XY.shape + (2,)
    np.testing.assert_array_equal(c.nonnegative_counts_, expected)
    # under noise: the projection onto {c >= 0, sum c = n} is non-negative, keeps n, is closer
    hn = noisy(h, 400.0, rng)
    cn = Counts().fit(hn)
    assert cn.nonnegative_counts_.min() >= 0
    assert cn.nonnegative_counts_.sum() == pytest.approx(2_000)
    assert (np.linalg.norm(cn.nonnegative_counts_ - expected)
            <= np.linalg.norm(cn.counts_ - expected))
    assert cn.se_ == pytest.approx(20.0) and cn.proportions_se_ == pytest.approx(0.01)


def test_kendall_tau_b_and_a_exact():
    rng = np.random.default_rng(2)
    x, y = correlated(1_500, rng)
    k = KendallTau().fit(release(XY, np.column_stack([x, y])))
    ix, iy = XY.axes[0].index(x), XY.axes[1].index(y)
    assert k.tau_ == pytest.approx(scipy.stats.kendalltau(ix, iy).statistic, abs=1e-12)
    n = len(x)
    tau_a = float((np.sign(ix[:, None] - ix[None, :]) * np.sign(iy[:, None] - iy[None, :])).sum()
                  / (n * (n - 1)))
    assert k.tau_a_ == pytest.approx(tau_a, abs=1e-12)
    assert k.se_ == 0 and k.ci_[0] == k.ci_[1] == pytest.approx(k.tau_)


def test_kendall_tau_with_an_ordered_categorical_axis():
    rng = np.random.default_rng(3)
    x, y = correlated(1_000, rng)
    grade = np.where(y < -0.5, "low", np.where(y < 0.5, "mid", "high")).astype(object)
    grade[rng.random(1_000) < 0.05] = "??"          # -> "(other)", ordered last
    spec = HistogramSpec(axes=[Axis(column="grade", categories=["low", "mid", "high"]), XY.axes[0]])
    k = KendallTau().fit(release(spec, np.column_stack([grade, x])))
    ref = scipy.stats.kendalltau(spec.axes[0].index(grade), spec.axes[1].index(x)).statistic
    assert k.tau_ == pytest.approx(ref, abs=1e-12)


@pytest.mark.parametrize("label_first", [False, True])
def test_auc_exact(label_first):
    rng = np.random.default_rng(4)
    score, label = labelled(3_000, rng)
    spec = HistogramSpec(axes=SCORE_LABEL.axes[::-1] if label_first else SCORE_LABEL.axes)
    values = np.column_stack([label, score] if label_first else [score, label])
    h = release(spec, values)
    s_bin = SCORE_LABEL.axes[0].index(score)
    # default negatives: every category but the positive and "(other)"
    a = AUC("score", "label", "pos").fit(h)
    keep = np.isin(label, ["pos", "neg", "unk"])
    assert a.auc_ == pytest.approx(roc_auc_score(label[keep] == "pos", s_bin[keep]), abs=1e-12)
    assert a.n_positive_ == np.sum(label == "pos")
    assert a.n_negative_ == np.sum(np.isin(label, ["neg", "unk"]))
    u = scipy.stats.mannwhitneyu(s_bin[label == "pos"], s_bin[np.isin(label, ["neg", "unk"])]).statistic
    assert a.u_ == pytest.approx(u)
    # explicit negatives, "(other)" among them allowed
    for negative in (["neg"], ["neg", OTHER]):
        a = AUC("score", "label", "pos", negative=negative).fit(h)
        neg = np.isin(label, ["neg"] + (["weird"] if OTHER in negative else []))
        keep = (label == "pos") | neg
        assert a.auc_ == pytest.approx(roc_auc_score(label[keep] == "pos", s_bin[keep]), abs=1e-12)


def test_gmd_gini_simpson_and_moments_exact():
    rng = np.random.default_rng(5)
    x, y = correlated(2_000, rng)
    x[:30] = 5.0                                    # some mass in the overflow bin
    h = release(XY, np.column_stack([x, y]))
    ix = XY.axes[0].index(x)
    r = XY.axes[0].representatives()[ix]
    n = len(x)
    assert GiniMeanDifference("x").fit(h).gmd_ == pytest.approx(reference_gmd(r), rel=1e-12)
    m = BinnedMoments("x").fit(h)
    assert m.mean_ == pytest.approx(np.mean(r), abs=1e-12)
    assert m.variance_ == pytest.approx(np.var(r), rel=1e-12)
    assert BinnedMoments("x", ddof=1).fit(h).variance_ == pytest.approx(np.var(r, ddof=1), rel=1e-12)
    assert m.mean_se_ == 0 and m.variance_se_ == 0
    for column, idx in (("x", ix), ("y", XY.axes[1].index(y))):
        c = np.bincount(idx)
        ref = 1 - np.sum(c * (c - 1)) / (n * (n - 1))
        assert GiniSimpson(column).fit(h).diversity_ == pytest.approx(ref, abs=1e-12)
    cells = XY.cell_index(np.column_stack([x, y]))
    c = np.bincount(cells)
    joint = 1 - np.sum(c * (c - 1)) / (n * (n - 1))
    assert GiniSimpson().fit(h).diversity_ == pytest.approx(joint, abs=1e-12)
    # a categorical column has a Gini-Simpson index too
    _, label = labelled(2_000, rng)
    hl = release(HistogramSpec(axes=[SCORE_LABEL.axes[1]]), label[:, None])
    c = np.unique(np.where(np.isin(label, ["neg", "pos", "unk"]), label, OTHER), return_counts=True)[1]
    assert GiniSimpson("label").fit(hl).diversity_ == pytest.approx(
        1 - np.sum(c * (c - 1)) / (n * (n - 1)), abs=1e-12)


def test_quantiles_match_numpy_within_a_bin():
    """Tolerance one bin width (0.1): the histogram only knows each value's bin, and a quantile
    is interpolated inside the bin where the CDF crosses p, as if values were spread evenly in
    it; the sample quantile lies in that same bin (or on its boundary), so they cannot differ
    by more than the width. With uniform data the error is in fact far smaller."""
    rng = np.random.default_rng(6)
    x = rng.uniform(0.0, 10.0, 20_000)
    spec = HistogramSpec(axes=[Axis(column="x", edges=list(np.linspace(0.0, 10.0, 101)))])
    p = [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99]
    q = Quantiles("x", p).fit(release(spec, x[:, None]))
    np.testing.assert_allclose(q.quantiles_, np.quantile(x, p), atol=0.1)
    assert not q.clipped_.any()
    assert q.cdf_[-1] == 1.0 and q.cdf_[0] == 0.0
    # quantiles in an unbounded outer bin come back as its edge, flagged
    y = np.concatenate([x, np.full(3_000, -50.0), np.full(3_000, 70.0)])
    q = Quantiles("x", [0.05, 0.5, 0.95]).fit(release(spec, y[:, None]))
    np.testing.assert_array_equal(q.clipped_, [True, False, True])
    assert q.quantiles_[0] == 0.0 and q.quantiles_[2] == 10.0
    assert abs(q.quantiles_[1] - np.quantile(y, 0.5)) <= 0.1


def test_quantiles_under_noise_are_a_proper_cdf():
    rng = np.random.default_rng(7)
    x = rng.normal(5.0, 2.0, 5_000)
    spec = HistogramSpec(axes=[Axis(column="x", edges=list(np.linspace(0.0, 10.0, 201)))])
    h = release(spec, x[:, None], v=2_500.0, rng=rng)       # noise sd 50 per bin of ~50 reports
    raw = np.cumsum(h.counts)[:-1] / h.n_reports
    assert np.any(np.diff(raw) < 0)                          # the raw cumulative is not monotone
    q = Quantiles("x", [0.1, 0.5, 0.9]).fit(h)
    assert np.all(np.diff(q.cdf_) >= 0) and q.cdf_.min() >= 0 and q.cdf_.max() <= 1
    assert np.all(np.diff(q.quantiles_) >= 0)
    assert abs(q.quantiles_[1] - 5.0) < 1.0


# ---------------------------------------------------------------------------------------------
# The generic algebra against dense formulas


def dense(form: QuadraticForm, shape) -> np.ndarray:
    k = np.zeros((math.prod(shape),) * 2)
    for coef, factors in form.terms:
        mats = [f.rows(slice(0, f.m)) for f in factors]
        term = mats[0]
        for m in mats[1:]:
            term = np.kron(term, m)
        k += coef * term
    return k


@pytest.mark.parametrize("block", [None, 3])
def test_forms_match_dense_algebra(monkeypatch, block):
    """Values and covariance from the structured code equal the textbook formulas with dense
    K (antisymmetric factors, a non-symmetric bilinear kernel, linear and constant parts); with a
    tiny block size the blockwise path (used above 2^20 entries per axis) gives the same."""
    if block:
        monkeypatch.setattr(hg, "BLOCK_ENTRIES", block)
    rng = np.random.default_rng(8)
    shape = (5, 4)
    spec = HistogramSpec(axes=[Axis(column="a", edges=[0.0, 1.0, 2.0, 3.0]),
                               Axis(column="b", categories=["u", "v", "w"])])
    h = NoisyHistogram(spec, rng.poisson(30, 20) + rng.normal(0, 3, 20), 9.0, 600)
    forms = [QuadraticForm([(1.0, (hg.sign_matrix(5), hg.sign_matrix(4)))]),
             QuadraticForm([(-1.0, (hg.identity(5), hg.ones(4)))], const=600.0**2),
             QuadraticForm([(1.0, (hg.above_half_ties(5), hg.outer(np.eye(4)[1], [1.0, 0, 1, 1])))],
                           linear=rng.normal(size=20)),
             QuadraticForm([(2.0, (hg.abs_difference(rng.normal(size=5)), hg.identity(4))),
                            (0.5, (hg.outer(rng.normal(size=5)), hg.ones(4)))])]
    est = estimate_forms(h, forms)
    y, v = h.counts, h.noise_variance
    ks = [dense(f, shape) for f in forms]
    sym = [(k + k.T) / 2 for k in ks]
    lin = [np.zeros(20) if f.linear is None else f.linear for f in forms]
    expected = [y @ k @ y - v * np.trace(k) + a @ y + f.const for k, a, f in zip(ks, lin, forms)]
    np.testing.assert_allclose(est.values, expected, rtol=1e-10)
    grads = np.array([2 * s @ y + a for s, a in zip(sym, lin)])
    traces = np.array([[np.trace(s1 @ s2) for s2 in sym] for s1 in sym])
    gram = grads @ grads.T - 4 * v * traces
    np.testing.assert_allclose(est.traces, traces, rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(est.gradient_gram, gram, rtol=1e-10, atol=1e-6)
    # the variance of a combination w . q: v max(w G w, 0) + 2 v^2 w T w
    w = rng.normal(size=4)
    combined = sum(wi * s for wi, s in zip(w, sym))
    grad = 2 * combined @ y + sum(wi * a for wi, a in zip(w, lin))
    data = grad @ grad - 4 * v * np.trace(combined @ combined)
    assert est.variance(w) == pytest.approx(v * max(data, 0) + 2 * v * v * np.trace(combined @ combined),
                                            rel=1e-9)
    ev, vec = np.linalg.eigh(gram)
    np.testing.assert_allclose(est.cov(), v * (vec * np.maximum(ev, 0)) @ vec.T + 2 * v * v * traces,
                               rtol=1e-9, atol=1e-6)


def test_marginal_noise_and_values():
    rng = np.random.default_rng(9)
    x, y = correlated(500, rng)
    h = release(XY, np.column_stack([x, y]), v=7.0, rng=rng)
    mx = h.marginal("x")
    assert mx.spec.columns == ["x"] and mx.noise_variance == 7.0 * XY.axes[1].bins
    np.testing.assert_allclose(mx.counts, h.grid().sum(axis=1))
    my = h.marginal("y")
    assert my.noise_variance == 7.0 * XY.axes[0].bins
    assert mx.marginal("x") is mx


# ---------------------------------------------------------------------------------------------
# Unbiasedness of the debiased forms


def test_debiased_forms_are_unbiased_and_their_variance_is_right():
    """Over 1,000 draws at noise sd 30 per cell on 500 reports: each debiased form's mean is
    within 4 Monte Carlo standard errors of the truth, the plain plug-in of the forms with a
    non-zero trace (sum of squares, tie counts, squared mean) is off by many, and the predicted
    standard error matches the spread of the draws within 10%. The forms with tr(K) = 0
    (concordance, U, GMD) need no correction; they are checked for unbiasedness all the same."""
    rng = np.random.default_rng(10)
    v, draws = 900.0, 1_000
    x, y = correlated(500, rng)
    exact = release(XY, np.column_stack([x, y]))
    score, label = labelled(500, rng)
    exact_auc = release(SCORE_LABEL, np.column_stack([score, label]))
    reps = XY.axes[0].representatives()

    def forms(h, ha):
        k = KendallTau().fit(h)
        a = AUC("score", "label", "pos").fit(ha)
        g = GiniMeanDifference("x").fit(h)
        s = GiniSimpson("x").fit(h)
        m = BinnedMoments("x").fit(h)
        est = {**k.forms_, "u": a.u_, "gmd": g.forms_["gmd"], **s.forms_, "variance": m.variance_}
        se = {**k.forms_se_, "u": a.forms_se_["u"], "gmd": g.se_, **s.forms_se_,
              "variance": m.variance_se_}
        grid, mx = h.grid(), h.marginal("x").counts
        n = h.n_reports
        naive = {"untied_1": n**2 - np.sum(grid.sum(1) ** 2), "untied_2": n**2 - np.sum(grid.sum(0) ** 2),
                 "sum_of_squares": np.sum(mx**2),
                 "variance": mx @ reps**2 / n - (mx @ reps / n) ** 2}
        return est, se, naive

    truth, _, _ = forms(exact, exact_auc)
    runs = [forms(noisy(exact, v, rng), noisy(exact_auc, v, rng)) for _ in range(draws)]
    for name, true in truth.items():
        values = np.array([r[0][name] for r in runs])
        mc_se = values.std(ddof=1) / math.sqrt(draws)
        assert abs(values.mean() - true) < 4 * mc_se, (name, values.mean(), true, mc_se)
        predicted = math.sqrt(np.mean([r[1][name] ** 2 for r in runs]))
        assert predicted == pytest.approx(values.std(ddof=1), rel=0.1), name
        line = (f"{name}: debiased {(values.mean() - true) / mc_se:+.1f} MC se off, predicted/"
                f"actual sd {predicted / values.std(ddof=1):.3f}")
        if name in runs[0][2]:
            naive = np.array([r[2][name] for r in runs])
            assert abs(naive.mean() - true) > 10 * mc_se, (name, naive.mean(), true, mc_se)
            line += f", plug-in {(naive.mean() - true) / mc_se:+.1f} MC se off"
        print(line)


# ---------------------------------------------------------------------------------------------
# Coverage of the confidence intervals


@pytest.mark.parametrize("v", [50.0, 5_000.0])
def test_confidence_intervals_cover(v):
    """2,000 releases of one data set of n = 10^5 reports: v = 50 is the product at epsilon = 1
    (1.27 (sqrt(2) 4.4)^2), v = 5,000 about epsilon = 0.1. Every 95% interval must cover the
    non-private value in 92%..98% of the releases (the Monte Carlo sd of a true 95% is 0.5%)."""
    rng = np.random.default_rng(11)                 # the data set: the same for both v
    n, runs = 100_000, 2_000
    x, y = correlated(n, rng)
    exact = release(XY, np.column_stack([x, y]))
    score, label = labelled(n, rng)
    exact_auc = release(SCORE_LABEL, np.column_stack([score, label]))
    estimators = {"kendall": (KendallTau(), "tau_", False), "auc": (AUC("score", "label", "pos"), "auc_", True),
                  "gmd": (GiniMeanDifference("x"), "gmd_", False),
                  "gini_simpson": (GiniSimpson("y"), "diversity_", False),
                  "mean": (BinnedMoments("x"), "mean_", False),
                  "variance": (BinnedMoments("x"), "variance_", False)}
    ci_of = {"mean": "mean_ci_", "variance": "variance_ci_"}
    truth = {k: getattr(e.fit(exact_auc if on_auc else exact), attr)
             for k, (e, attr, on_auc) in estimators.items()}
    # noise draws of their own per v: with shared draws the linear statistics' coverage events
    # would be identical at both v (the interval scales with sqrt(v) exactly as the noise does)
    rng = np.random.default_rng(int(v))
    covered = {k: 0 for k in estimators}
    counts_covered = np.zeros(XY.shape)
    for _ in range(runs):
        h, ha = noisy(exact, v, rng), noisy(exact_auc, v, rng)
        ci = Counts().fit(h).counts_ci_
        counts_covered += (ci[..., 0] <= exact.grid()) & (exact.grid() <= ci[..., 1])
        for k, (e, _, on_auc) in estimators.items():
            lo, hi = getattr(e.fit(ha if on_auc else h), ci_of.get(k, "ci_"))
            covered[k] += lo <= truth[k] <= hi
    coverage = {k: c / runs for k, c in covered.items()}
    coverage["counts (worst cell)"] = float(np.abs(counts_covered / runs - 0.95).max()) + 0.95
    coverage["counts (all cells)"] = float(counts_covered.mean() / runs)
    print(f"v={v:g}: " + ", ".join(f"{k} {c:.3f}" for k, c in coverage.items()))
    for k, c in coverage.items():
        assert 0.92 <= c <= 0.98, (k, c, coverage)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_says_what_is_wrong():
    rng = np.random.default_rng(12)
    x, y = correlated(200, rng)
    h = release(XY, np.column_stack([x, y]))
    score, label = labelled(200, rng)
    ha = release(SCORE_LABEL, np.column_stack([score, label]))
    with pytest.raises(ValueError, match=r"no column 'z' \(its columns: 'x', 'y'\)"):
        Quantiles("z").fit(h)
    with pytest.raises(ValueError, match="no column 'z'"):
        h.marginal("z")
    with pytest.raises(ValueError, match="Quantiles needs a numeric column, but 'label' is categorical"):
        Quantiles("label").fit(ha)
    with pytest.raises(ValueError, match="GiniMeanDifference needs a numeric column"):
        GiniMeanDifference("label").fit(ha)
    with pytest.raises(ValueError, match="BinnedMoments needs a numeric column"):
        BinnedMoments("label").fit(ha)
    with pytest.raises(ValueError, match=r"positive='maybe' is not a category of 'label'"):
        AUC("score", "label", "maybe").fit(ha)
    with pytest.raises(ValueError, match="not a category"):
        AUC("score", "label", OTHER).fit(ha)
    with pytest.raises(ValueError, match=r"negative=\['nope'\]: not categories"):
        AUC("score", "label", "pos", negative=["nope"]).fit(ha)
    with pytest.raises(ValueError, match="both positive and negative"):
        AUC("score", "label", "pos", negative=["pos", "neg"]).fit(ha)
    with pytest.raises(ValueError, match="label column 'y' must be categorical"):
        AUC("x", "y", "1").fit(h)
    with pytest.raises(ValueError, match="KendallTau needs a two-axis histogram"):
        KendallTau().fit(h.marginal("x"))
    with pytest.raises(ValueError, match="confidence must be in"):
        KendallTau(confidence=95).fit(h)
    with pytest.raises(ValueError, match="probabilities must be numbers in"):
        Quantiles("x", [0.5, 1.5]).fit(h)
    with pytest.raises(ValueError, match="counts has 3 values but the spec has 96 cells"):
        NoisyHistogram(XY, np.zeros(3), 0.0, 0)
    with pytest.raises(ValueError, match="noise_variance"):
        NoisyHistogram(XY, np.zeros(96), -1.0, 0)
    with pytest.raises(TypeError, match="NoisyHistogram"):
        Counts().fit(np.zeros(96))
