"""research/figures.py, the one command behind every accuracy figure in the docs, run end to end at
a tiny n and few runs (seconds), so that it cannot rot: every figure set it runs summarises each
metric as mean, sd, median, p90 over at least the runs asked for, resumes without re-running what
is recorded, and prints the docs' "mean ± sd (median), p90" cells."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("sklearn")

from research import figures, report  # noqa: E402

FIELDS = {"mean", "sd", "median", "p90", "max", "runs"}
QUICK_SETS = ["synthetic", "trivial", "vertical", "lad"]


def test_stats_and_cell_are_the_docs_form():
    s = report.stats([1.0, 2.0, 3.0, 4.0, 10.0])
    assert set(s) == FIELDS and s["runs"] == 5
    assert s["median"] == 3.0 and s["p90"] == pytest.approx(7.6) and s["sd"] == pytest.approx(3.536, abs=1e-3)
    assert report.cell(s) == "4.00 ± 3.5 (3.00), p90 7.60"
    near = report.cell(report.stats([1.0002, 1.0004, 1.0006]))
    assert near.startswith("1 + 4.0e-04 ± 2.0e-04 (4.0e-04), p90 1 + ")
    assert report.cell(report.stats([])) == "-"


def test_paired_differences_are_derived_when_summarising():
    """A value asked for after the runs were recorded (logistic's gram - non-private) comes from
    each run's own values, so the difference's spread is the noise's, not the data's."""
    rec = {"figure": "logistic", "job": [1000, [1.0]], "seed": 0, "load": 1.0, "seconds": 1.0,
           "rows": [{"row": ["synthetic", 1000, 1.0],
                     "values": {"ltm_gram/auc": 0.80, "nonprivate/auc": 0.83, "diffprivlib/auc": 0.79}}]}
    recs = [rec, {**rec, "seed": 1, "rows": [{**rec["rows"][0], "values": {
        "ltm_gram/auc": 0.70, "nonprivate/auc": 0.72, "diffprivlib/auc": 0.70}}]}]
    (row,) = figures.summarize(recs)["logistic"]["rows"]
    assert row["stats"]["gram_minus_nonprivate/auc"]["mean"] == pytest.approx(-0.025)
    assert row["stats"]["gram_minus_nonprivate/auc"]["sd"] == pytest.approx(0.00707, abs=1e-5)
    assert row["stats"]["gram_minus_diffprivlib/auc"]["median"] == pytest.approx(0.005)
    assert row["runs"] == 2


def test_runs_go_seed_by_seed_and_the_tail_target_gets_more():
    plan = figures.planned(["synthetic", "k_sweep"], 4, None)
    seeds = [seed for _, _, seed in plan]
    assert seeds == sorted(seeds)  # every point gets seed s before any gets s + 1
    per = {}
    for name, job, _ in plan:
        per[(name, job)] = per.get((name, job), 0) + 1
    assert per[("synthetic", ("ridge", 1_000_000, 1.0))] == 4
    assert per[("k_sweep", ("ridge", 100_000, 1.0, (20, 60, 100, 140)))] == 10  # 2.5x: 50 at the default 20
    only = figures.planned(["vertical", "logistic"], 1, [10_000], [0.5, 4.0])
    assert sorted(job for name, job, _ in only if name == "vertical") == [(10_000, 0.5), (10_000, 4.0)]
    assert [job for name, job, _ in only if name == "logistic"] == [(10_000, (0.5, 1.0, 4.0))]  # all targets at once


def test_one_command_at_tiny_n(tmp_path, capsys):
    out = str(tmp_path / "fig")
    assert figures.main(["--only", *QUICK_SETS, "--n", "2000", "--runs", "2", "--out", out]) == 0
    printed = capsys.readouterr().out
    summary = json.load(open(out + ".json"))["sets"]
    assert sorted(summary) == sorted(QUICK_SETS)
    for name, fig in summary.items():
        assert fig["rows"], name
        for row in fig["rows"]:
            assert row["runs"] >= 2, (name, row["row"])
            assert row["load"][0] <= row["load"][1]
            assert row["stats"], (name, row["row"])
            for metric, s in row["stats"].items():
                assert set(s) == FIELDS, (name, metric)
                assert s["runs"] >= 2 or name == "synthetic", (name, row["row"], metric)
                assert s["median"] <= s["max"] and s["p90"] <= s["max"]
    # what the tables print is the docs' form, with the command and the load
    assert "`python -m research.figures --only vertical`; load average" in printed
    assert re.search(r"\| 2 \| 1 \| 2,000 \| \d+ \| \d+ \| 2 \| [\d.]+ ± [\d.e+-]+ \([\d.]+\), p90 [\d.]+ \|", printed)
    ridge = next(r for r in summary["synthetic"]["rows"] if r["row"][0] == "ridge")
    assert {"local", "ltm_gram", "central"} <= set(ridge["stats"])
    lad = summary["lad"]["rows"][0]["stats"]
    assert {"ltm_rounds", "ltm_gram_ls", "round1", "rounds_beat_ls"} <= set(lad)
    assert 0.0 <= lad["rounds_beat_ls"]["mean"] <= 1.0
    # a second call with one more run runs only the missing seed of every job, and keeps the rest
    lines = len(open(out + ".jsonl").read().splitlines())
    jobs = sum(len(figures.FIGURES[n].jobs([2000])) for n in QUICK_SETS)
    assert lines == 2 * jobs
    assert figures.main(["--only", "trivial", "--n", "2000", "--runs", "3", "--out", out]) == 0
    assert len(open(out + ".jsonl").read().splitlines()) == lines + 1
    again = json.load(open(out + ".json"))["sets"]["trivial"]["rows"][0]
    assert again["runs"] == 3 and again["stats"]["ridge_theta_zero"]["runs"] == 3


def test_sign_and_histogram_sets_at_tiny_n(tmp_path, capsys):
    """The secret sign's end-to-end pipeline in memory and the histogram targets: each run's ratio
    is of that run's own values (signed / unsigned on the same data and draws; LTM / central and
    local / LTM of the run's mean errors), a fraction of runs prints as a fraction, and the
    histogram set covers every statistic of docs/histogram.md's target table."""
    from research import histogram_evaluation

    out = str(tmp_path / "fig")
    assert figures.main(["--only", "secret_sign_e2e", "histogram", "--n", "2000", "--runs", "2", "--out", out]) == 0
    printed = capsys.readouterr().out
    recs = figures.load_records(out + ".jsonl")
    assert len(recs) == 4
    for rec in recs:
        for row in rec["rows"]:
            v = row["values"]
            if rec["figure"] == "secret_sign_e2e":
                assert v["signed_over_unsigned"] == pytest.approx(v["signed"] / v["unsigned"])
                assert v["signed_better"] == float(v["signed"] < v["unsigned"])
            else:
                assert v["ltm_over_central"] == pytest.approx(v["ltm"] / v["central"])
                assert v["local_over_ltm"] == pytest.approx(v["local"] / v["ltm"])
    summary = json.load(open(out + ".json"))["sets"]
    assert {r["row"][0] for r in summary["secret_sign_e2e"]["rows"]} == {"ridge_coef", "pca"}
    assert {r["row"][0] for r in summary["histogram"]["rows"]} == set(histogram_evaluation.STATISTICS)
    better = [line for line in printed.splitlines() if line.startswith("| pca | 2,000 | 20 |")]
    assert better and " 1 + " not in better[0]  # the fraction column is not printed as 1 + excess
