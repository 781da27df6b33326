"""``dpsketch experiments --quick``: plots and tables from the real client, server and analyzer paths."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")

from research import experiments  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("experiments")
    assert experiments.main(["--quick", "--out", str(out)]) == 0
    return out


def test_quick_run_writes_valid_pngs(quick_run):
    for name in ("ridge.png", "pca.png"):
        data = (quick_run / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 10_000, name  # a drawn figure, not an empty canvas


def test_results_markdown_has_every_row(quick_run):
    md = (quick_run / "results.md").read_text()
    assert "## Ridge regression, synthetic" in md and "## PCA, synthetic" in md
    synthetic_part = md.split("## Real data")[0]
    for n in ("| 1,000 |", "| 10,000 |", "| 100,000 |"):
        assert synthetic_part.count(n) == 2, n  # one row per task (epsilon = 1 only)
    assert "| diabetes | 442 | 11 |" in md  # ridge on the real data (10 features + target)
    assert "| diabetes | 442 | 10 |" in md  # PCA
    for header in ("local", "LTM sketch", "LTM Gram", "central"):
        assert f"| {header} |" in md or f" {header} |" in md


def test_ratios_are_finite_and_at_least_one(quick_run):
    saved = json.loads((quick_run / "results.json").read_text())
    records = saved["records"]
    assert {r["task"] for r in records} == {"ridge", "pca"}
    for r in records:
        assert {"local", "ltm_sketch", "ltm_gram", "central"} <= set(r["ratios"]), r["notes"]
        for mech, ratio in r["ratios"].items():
            assert math.isfinite(ratio), (r["task"], r["n"], mech)
            assert ratio >= 1 - 1e-6, (r["task"], r["n"], mech, ratio)
        # the pipeline really ran: each server certified its release
        for kind in ("ltm_sketch", "ltm_gram"):
            info = r["info"][kind]
            assert info["lambda_min"] >= info["lambda_star"]


def test_gram_kind_matches_central_and_local_is_worst(quick_run):
    """At the quick run's largest n the Gram kind is the central model's SSP spread over the
    clients (ridge within 10% of central), and both LTM kinds beat the local model on PCA and
    the Gram kind beats it on ridge."""
    saved = json.loads((quick_run / "results.json").read_text())
    big = max(r["n"] for r in saved["records"] if r["dataset"] == "synthetic")
    by_task = {r["task"]: r["ratios"] for r in saved["records"]
               if r["dataset"] == "synthetic" and r["n"] == big and r["epsilon"] == 1.0}
    ridge, pca = by_task["ridge"], by_task["pca"]
    assert ridge["ltm_gram"] <= 1.1 * ridge["central"], ridge
    assert ridge["local"] > ridge["ltm_gram"], ridge
    assert pca["ltm_gram"] <= 1.1 * pca["central"], pca
    assert pca["local"] > max(pca["ltm_sketch"], pca["ltm_gram"]), pca


def test_pipeline_adds_each_servers_noise():
    """The in-process pipeline releases what the real servers would: the clients' shares plus
    each server's own noise (``study.server_noise()``, as services/store.py adds at commit). At
    epsilon = 4 = the default floor the clients add no noise (sigma = 0), so a gram release minus
    the exact sum of the feature vectors is the N servers' noise alone: N(0, N server_sigma^2)
    per coordinate, the release's ``coordinate_noise_std``."""
    import numpy as np

    from dpsketch.analyzer import synthetic
    from dpsketch.protocol import features

    data = synthetic.regression_data(1000, 10, seed=0)
    study = experiments.design_study(list(data.columns), data.label, data.n, 4.0, "gram", ("servers-noise",))
    assert study.sigma == 0 and study.server_sigma > 0 and study.n_servers == 2
    exact = features.gram_features(data.rows).sum(axis=0)
    residuals = []
    for _ in range(20):  # 20 x 78 coordinates
        release = experiments.run_pipeline(study, data.rows).release
        residuals.append(release.values - exact)
    res = np.array(residuals)
    std = math.sqrt(study.n_servers) * study.server_sigma
    assert release.coordinate_noise_std == pytest.approx(std, rel=1e-12)
    assert res.std() == pytest.approx(std, rel=0.1)  # 1560 draws: 10% is 5.6 standard errors
    assert abs(res.mean()) < 5 * std / math.sqrt(res.size)


def test_cli_registers_the_subcommand(capsys):
    from dpsketch.tools import cli

    assert cli.main(["--help"]) == 0
    assert "experiments" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["experiments", "--help"])
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_simulated_pipeline_has_the_pipelines_noise_law_and_certificate():
    """``--ltm simulate`` draws the release in law: on all-zero rows a sketch release is its noise
    alone, whose cells have the release's public variance sigma^2 n / k + N server_sigma^2 in both
    modes; and the servers' certificate is checked on the drawn S (a lambda_star no S reaches is
    refused, as the real servers would)."""
    import numpy as np

    n = 4000
    rows = np.zeros((n, 4))
    study = experiments.design_study(["a", "b", "c", "y"], "y", n, 1.0, "sketch", ("sim-law",))
    rng = np.random.default_rng(3)
    sim = [experiments.simulate_pipeline(study, rows, rng).release for _ in range(30)]
    real = [experiments.run_pipeline(study, rows).release for _ in range(12)]  # ~30 ms each
    expected = sim[0].cell_noise_variance
    from scipy import stats

    for releases in (sim, real):
        cells = np.concatenate([r.sketch.ravel() for r in releases])
        # sum(cells^2) / expected is chi-square with one degree of freedom per cell (their mean
        # is 0): within its 1e-6 quantiles, 0.69-1.38 of m = 384 for the 12 real releases (fresh
        # CSPRNG noise: a correct pipeline fails 2e-6 of runs; the former check, the sample
        # variance of 6 releases' 192 cells within 4 normal-approximation sd, 0.59-1.41, failed
        # 1.3e-4), 0.80-1.23 for the 30 seeded ones
        energy = float(np.sum(cells**2)) / expected
        assert stats.chi2.ppf(1e-6, cells.size) < energy < stats.chi2.isf(1e-6, cells.size), (energy / cells.size, cells.size)
    assert abs(np.mean([r.sketch.mean() for r in sim])) < 5 * math.sqrt(expected / (30 * sim[0].sketch.size))
    with pytest.raises(experiments.Refused, match="certificate"):
        experiments.simulate_pipeline(study.model_copy(update={"lambda_star": 10.0 * n}), rows, rng)


def test_summary_reports_mean_sample_sd_median_and_runs():
    recs = [{"dataset": "synthetic", "task": "ridge", "n": 10, "epsilon": 1.0, "ratios": {"x": v},
             "notes": {}, "info": {}} for v in (1.0, 2.0, 6.0)]
    (cell,) = experiments.summarize(recs).values()
    mean, sd, runs, median = cell["ratios"]["x"]
    assert (mean, runs, median) == (3.0, 3, 2.0)
    assert sd == pytest.approx(math.sqrt(7.0))  # ddof = 1
    assert experiments.fmt(mean, sd, runs, median) == "3.00 ± 2.6 (2.00)"
