"""The histogram evaluation harness (research/histogram_evaluation.py): its baselines draw the
noise they claim, the LTM simulation matches the real client/server pipeline, the quick command
writes its figure, and the LTM beats the local model by a wide margin."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from research import histogram_evaluation as he
from dpsketch.analyzer.release import HistogramRelease
from dpsketch.protocol import privacy
from dpsketch.protocol.histogram import HistogramSpec

SPEC = HistogramSpec.model_validate({"axes": [{"column": "x", "edges": [-1.0, 0.0, 1.0]},
                                              {"column": "c", "categories": ["a", "b"]}]})  # 4 x 3 cells


def _values(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal(n), "c": rng.choice(np.array(["a", "b", "zz"]), n)}


def _residual_variance(draw, counts: np.ndarray, repeats: int) -> float:
    res = np.concatenate([draw().counts - counts for _ in range(repeats)])
    assert abs(res.mean()) < 4 * math.sqrt(res.var() / res.size)  # centred
    return float(res.var())


def test_baselines_noise_has_the_stated_variance():
    values = _values(300)
    counts = he.cell_counts(values, SPEC)
    assert counts.sum() == 300
    assert np.array_equal(counts, np.bincount(SPEC.cell_index(np.column_stack([values["x"], values["c"]])),
                                              minlength=SPEC.cells))
    rng = np.random.default_rng(1)
    eps, delta = 1.0, 1e-6
    sigma_c = math.sqrt(2) * privacy.unit_sigma(eps, delta)  # replace-one: Delta = sqrt(2)
    assert he.central_sigma(eps, delta) == pytest.approx(sigma_c)
    assert he.central_sigma(eps, delta, "add-remove") == pytest.approx(sigma_c / math.sqrt(2))
    assert he.exact(values, SPEC).noise_variance == 0 and np.array_equal(he.exact(values, SPEC).counts, counts)

    h = he.central(values, SPEC, eps, delta, rng=rng)
    assert h.noise_variance == pytest.approx(sigma_c**2) and h.n_reports == 300
    got = _residual_variance(lambda: he.central(values, SPEC, eps, delta, rng=rng), counts, 300)
    assert got == pytest.approx(sigma_c**2, rel=0.12)  # 3600 draws: se of the variance ~2.4%

    # local: every client's one-hot + N(0, sigma_local^2) per cell, summed: n sigma_local^2
    assert he.local_sigma(eps, delta) == pytest.approx(sigma_c)
    want = 300 * sigma_c**2
    got = _residual_variance(lambda: he.local(values, SPEC, eps, delta, rng=rng, per_client=True), counts, 150)
    assert got == pytest.approx(want, rel=0.15)
    got = _residual_variance(lambda: he.local(values, SPEC, eps, delta, rng=rng), counts, 300)
    assert got == pytest.approx(want, rel=0.12)
    assert he.local(values, SPEC, eps, delta, rng=rng).noise_variance == pytest.approx(want)

    # LTM: n sigma^2 + N server_sigma^2, the release's own noise law
    study = he.histogram_study(SPEC, 300, eps)
    assert study.kind == "histogram" and study.n_servers == 3 and study.epsilon_floor == 4.0
    want = 300 * study.sigma**2 + 3 * study.server_sigma**2
    release = HistogramRelease(study=study, values=counts, n_reports=300)
    assert release.cell_noise_variance == pytest.approx(want)
    h = he.ltm(values, SPEC, study, rng)
    assert h.noise_variance == pytest.approx(want)
    got = _residual_variance(lambda: he.ltm(values, SPEC, study, rng), counts, 300)
    assert got == pytest.approx(want, rel=0.12)
    # the price of the LTM over the central model at epsilon 1: ~12% more noise sd
    assert 1.0 < math.sqrt(want) / sigma_c < 1.2


def test_ltm_simulation_matches_the_real_pipeline():
    """The noise law the harness draws from is what the client SDK + servers + analyzer produce:
    the residuals of 60 real releases (720 cells, about 20 ms a release) are N(0, want), their
    sum of squares / want chi-square with 720 degrees of freedom, checked at its 1e-6 quantiles
    (0.77 .. 1.27 of the expected variance) and the mean at 5 standard errors: a correct pipeline
    fails in about 3e-6 of runs. (It was 6 releases with a variance within 35 %: 72 cells, whose
    sample variance falls outside that in 3.3 % of runs; 2,000 releases measured the law itself:
    mean -0.007 sd, variance 1.006 of want.)"""
    from scipy import stats

    from research.experiments import run_pipeline

    n = 3000
    values = _values(n, seed=5)
    rows = np.column_stack([values["x"].astype(object), values["c"]])
    counts = he.cell_counts(values, SPEC)
    study = he.histogram_study(SPEC, n, 1.0)
    res = np.concatenate([run_pipeline(study, rows).release.values - counts for _ in range(60)])
    want = he.ltm_noise_variance(study, n)
    assert abs(res.mean()) < 5 * math.sqrt(want / res.size)
    energy = float(np.sum(res**2)) / want
    assert stats.chi2.ppf(1e-6, res.size) < energy < stats.chi2.isf(1e-6, res.size), (energy / res.size, res.size)


def test_statistics_of_the_exact_histogram_are_the_binned_statistics():
    from scipy.stats import kendalltau
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(3)
    data = he.synthetic(5000, rng)
    (_, xy, xy_roles), (_, xl, xl_roles), (_, g, g_roles) = he.synthetic_studies()
    ix = xy.axes[0].index(data["x"])
    iy = xy.axes[1].index(data["y"])
    s = he.statistics(he.exact(data, xy), xy_roles)
    assert s["kendall_tau"] == pytest.approx(kendalltau(ix, iy).statistic, abs=1e-9)
    a = he.statistics(he.exact(data, xl), xl_roles)["auc"]
    assert a == pytest.approx(roc_auc_score(data["label"] == "1", ix), abs=1e-9)
    gs = he.statistics(he.exact(data, g), g_roles)["gini_simpson"]
    assert gs == pytest.approx(he.raw_statistics(data, g, g_roles)["gini_simpson"], abs=1e-12)
    raw = he.raw_statistics(data, xy, xy_roles)
    assert abs(s["mean"] - raw["mean"]) < 0.02 and abs(s["median"] - raw["median"]) < 0.05
    assert abs(s["gini_mean_difference"] - 2 / math.sqrt(math.pi)) < 0.06  # E|X - X'| of N(0, 1)


def test_ltm_beats_local_by_a_wide_margin_at_1e4_for_auc():
    n = 10_000
    data = he.synthetic(n, np.random.default_rng(11))
    _, spec, roles = he.synthetic_studies()[1]
    r = he.compare({c: data[c] for c in spec.columns}, spec, roles, epsilon=1.0, runs=20,
                   rng=np.random.default_rng(12))
    err = he.mean_errors(r)
    assert set(err) == {"ltm", "central", "local"} and set(err["ltm"]) == {"auc"}
    assert err["local"]["auc"] > 20 * err["ltm"]["auc"], err
    assert err["ltm"]["auc"] < 0.01 and r["undefined"]["ltm"]["auc"] == 0


def test_quick_run_writes_a_valid_png(tmp_path):
    t0 = time.process_time()  # CPU time: what --quick costs, whatever else the machine runs
    assert he.main(["--quick", "--out", str(tmp_path)]) == 0
    seconds = time.process_time() - t0
    png = tmp_path / "histogram_error_eps1.png"
    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 20_000
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 500 and img.shape[1] > 800
    md = (tmp_path / "histogram_results.md").read_text()
    assert "## Targets" in md and "histogram_error_eps1.png" in md and "Quick run" in md
    saved = json.loads((tmp_path / "histogram_results.json").read_text())
    assert [t["statistic"] for t in saved["targets"]] == list(he.STATISTICS)
    assert {r["dataset"] for r in saved["real"]} == {"breast_cancer", "diabetes", "diabetes_coarse"}
    assert seconds < 60, f"--quick took {seconds:.0f} s of CPU (budget 30 s)"
