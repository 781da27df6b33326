"""The logistic regression evaluation harness (research/logistic_evaluation.py), bounded.

Checks that the simulated gram release has the pipeline's noise law, that every baseline runs
(diffprivlib through its compatibility shim), and that the LTM gram kind beats the local model
at moderate n.
"""

from __future__ import annotations

import numpy as np
import pytest

from dpsketch.analyzer import simulation
from research import experiments
from research import logistic_evaluation as le
from dpsketch.protocol import features

# diffprivlib is in the test extra (imported through the harness' shim: 0.6.6 on scikit-learn >= 1.8);
# a missing install fails here rather than skipping the baseline
le.diffprivlib_logistic()


def test_gram_simulation_has_the_pipelines_noise_law():
    """The harness draws gram releases from simulate_ltm; the real client/server/analyzer path
    (experiments.run_pipeline, with the servers' floor noise) must give the same law: the released
    sum of phi minus the exact sum, divided by the stated std, is N(0, 1) per coordinate."""
    data = le.synthetic(8000, 0, test_rows=10)
    rows, cols = le.layout_rows(data["x"], data["y"], "gram", le.feature_scale(data["x"], le.LAYOUTS["gram"][0]))
    study = le.design_study(cols, len(rows), 1.0, "gram", ("sim-vs-pipeline",))
    assert study.server_sigma > 0  # the default floor: the servers' noise is part of the law
    exact = features.gram_features(rows).sum(axis=0)
    piped = experiments.run_pipeline(study, rows).release
    sims = [simulation.simulate_ltm(study, rows, np.random.default_rng(s)) for s in range(3)]
    std = piped.coordinate_noise_std
    assert all(s.coordinate_noise_std == std for s in sims)
    # the pipeline's noise is fresh CSPRNG noise each run: its 78 z-scores' mean within 5 of its
    # standard errors and sum of squares (chi-square, 78 degrees of freedom) within its 1e-6
    # quantiles, rms 0.64-1.39: a correct pipeline fails in 3e-6 of runs (the former |mean| < 0.45
    # and 0.7 < sd < 1.3 failed 2.3e-4 of them); the seeded simulations are checked the same way
    from scipy import stats

    for rel in [piped] + sims:
        z = (rel.values - exact) / std
        assert z.shape == (study.width,) == (78,)
        energy = float(np.sum(z**2))
        assert abs(z.mean()) < 5 / np.sqrt(z.size), (z.mean(), z.std())
        assert stats.chi2.ppf(1e-6, z.size) < energy < stats.chi2.isf(1e-6, z.size), (z.mean(), z.std())
    # and the fitted models agree in quality: the pipeline's AUC is near the simulations' mean.
    # (Not max - min of all four < 0.02: that failed 4 runs in 25 before the discrete sampler and
    # 3 in 20 after it, because one seeded simulation sits at 0.808.) The pipeline's AUC, drawn
    # 20,000 times from this law (simulate_ltm, unseeded draws): mean 0.823, sd 0.0047, skewed
    # low (0.801 at the 0.1 % quantile, 0.794 at 0.01 %, 0.793 at worst) against the seeded mean
    # 0.818: a distance of 0.02 was reached in 5.5e-4 of runs, 0.025 in 1e-4, 0.035 in none (the
    # tail extrapolates to ~1e-5). The bound catches a broken fit, not a subtly wrong noise law
    # (4x the noise variance still averages 0.811): the z-scores above test the law.
    aucs = [le.metrics(data["y"], le.LogisticRegression("y", classes=(0, le.LAYOUTS["gram"][1])).fit(r)
                       .decision_function(rows[:, :10]))["auc"] for r in [piped] + sims]
    assert abs(aucs[0] - float(np.mean(aucs[1:]))) < 0.035, aucs


def test_every_mechanism_runs_and_the_ltm_beats_local_at_moderate_n():
    recs = {r["mechanism"]: r for r in le.run_case(le.synthetic(30_000, 1, test_rows=20_000), [1.0], 1)}
    assert set(recs) == set(le.MECHANISMS)
    for r in recs.values():
        assert r["n"] == 30_000 and r["epsilon"] == 1.0
    assert recs["nonprivate"]["auc"] > 0.8
    assert recs["diffprivlib"]["auc"] > 0.75  # the central peer (pure epsilon) works through the shim
    assert recs["ltm_gram"]["auc"] > recs["nonprivate"]["auc"] - 0.01
    assert recs["ltm_gram"]["auc"] > recs["local"]["auc"] + 0.1
    assert recs["ltm_gram"]["log_loss"] < recs["local"]["log_loss"]
    for r in recs.values():
        assert 0 <= r["accuracy"] <= 1 and r["log_loss"] > 0


def test_summary_target_and_plot(tmp_path):
    recs = []
    for n, auc in ((10_000, 0.80), (100_000, 0.83)):
        for m in le.MECHANISMS:
            for seed in range(2):
                recs.append({"dataset": "synthetic", "n": n, "epsilon": 1.0, "mechanism": m, "seed": seed,
                             "auc": auc - (0.01 if m == "diffprivlib" else 0), "accuracy": 0.7, "log_loss": 0.5})
    summary = le.summarize(recs)
    t = le.target(summary)
    assert t["within_0.01"] and t["not_worse_than_diffprivlib"] and t["gap"] == pytest.approx(0)
    le.plot(summary, [1.0], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 100,000 | 1 |" in le.results_markdown(summary, recs, [1.0], 1.0, [])
