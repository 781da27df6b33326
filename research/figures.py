"""Every accuracy figure the docs quote, from one command: ``python -m research.figures``.

::

    nice -n 10 .venv/bin/python -m research.figures --jobs 2            # everything, 20 runs a point
    .venv/bin/python -m research.figures --list                          # the figure sets, where quoted
    .venv/bin/python -m research.figures --only logistic vertical --runs 20
    .venv/bin/python -m research.figures --tables                        # re-print from the saved runs

Each **figure set** is one table of README.md or docs/*.md (``--list`` says which): a grid of
jobs (a data set size, privacy target, task ...), each run ``--runs`` times with seeds 0, 1, ...
by the evaluation module that owns it (:mod:`research.experiments`, :mod:`research.accuracy_runs`,
:mod:`research.logistic_evaluation`, :mod:`research.lad_evaluation`,
:mod:`research.vertical_evaluation`, :mod:`research.histogram_evaluation`, :mod:`research.trust_cost`):
this module adds no mechanism and no data of its own. A run
gives one or more table rows' values; every value is summarised over the runs by
:func:`report.stats` (mean, sample sd, median, 90th percentile, largest, runs) and printed as
:func:`report.cell` writes it, "mean ± sd (median), p90 x", the form every accuracy figure in the
docs takes.

Every finished run is appended to ``OUT.jsonl`` at once, with the load average when it ended, so
an interrupted command keeps what it measured, and the next one (same ``--out``) runs only the
seeds that are missing. Runs go seed by seed across the whole grid, so that a run stopped by
``--until`` (a UTC time after which no new run starts) leaves every point with about the same
number of runs, and the tables say how many each has. ``OUT.json`` holds the summaries,
``OUT.md`` the tables. ``--n`` replaces every set's report counts (the test runs the whole
command at a tiny n in seconds).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any


from . import report

DEFAULT_OUT = "docs/experiments/figures"
DEFAULT_RUNS = 20
NS = (1_000, 10_000, 100_000, 1_000_000)

Row = dict[str, Any]  # {"row": [...], "values": {metric: float}, "info": {...}}


# ---------------------------------------------------------------------------------------------
# one run of each set (module level: a process pool runs them)


def _extras() -> list[str]:
    from . import experiments

    return [k for k, _ in experiments.extra_ridge_available()]


def run_synthetic(task: str, n: int, epsilon: float, seed: int) -> list[Row]:
    """:func:`experiments.synthetic_case` with the LTM drawn in law (``--ltm simulate``): local,
    local with the sign, LTM sketch and gram, central, and for ridge AdaSSP, DGM-OLS, RMGM-OLS and
    the predicted sketch floor."""
    from . import experiments

    r = experiments.synthetic_case(task, n, epsilon, seed, _extras() if task == "ridge" else [],
                                   experiments.CHUNK_ROWS, simulate=True)
    values = dict(r["ratios"])
    if r.get("predicted_sketch_excess") is not None:
        values["predicted"] = 1.0 + r["predicted_sketch_excess"]
    return [{"row": [task, n, epsilon], "values": values, "notes": r["notes"],
             "info": {"k": r["info"].get("ltm_sketch", {}).get("k")}}]


@functools.lru_cache(maxsize=1)
def _real_datasets() -> dict[tuple[str, str], Any]:
    from . import experiments

    return {(ds.name, ds.task): ds for ds in experiments.real_datasets()}


def run_real(name: str, task: str, epsilon: float, seed: int) -> list[Row]:
    """:func:`experiments.real_case` on a data set shipped with scikit-learn or statsmodels."""
    from . import experiments

    ds = _real_datasets()[(name, task)]
    r = experiments.real_case(ds, epsilon, seed, _extras() if task == "ridge" else [], experiments.CHUNK_ROWS,
                              simulate=True)
    return [{"row": [name, task, r["n"], r["d"], epsilon], "values": dict(r["ratios"]), "notes": r["notes"],
             "info": {"k": r["info"].get("ltm_sketch", {}).get("k")}}]


def run_trivial(n: int, seed: int) -> list[Row]:
    """:func:`accuracy_runs.trivial_run`: ridge with theta = 0, PCA on a random subspace."""
    from . import accuracy_runs

    return [{"row": [n], "values": accuracy_runs.trivial_run(n, seed)}]


def run_moments(task: str, n: int, epsilon: float, seed: int) -> list[Row]:
    """:func:`accuracy_runs.gram_run`: the gram and moments kinds and central on the same normals."""
    from . import accuracy_runs

    r = accuracy_runs.gram_run(task, n, epsilon, seed)
    return [{"row": [task, n, epsilon], "values": dict(r["ratios"])}]


def run_k_sweep(task: str, n: int, epsilon: float, ks: Sequence[int], seed: int, signed: bool = True) -> list[Row]:
    """:func:`accuracy_runs.k_sweep_run`: design()'s study (signed unless told) at each k on common
    random numbers."""
    from . import accuracy_runs

    r = accuracy_runs.k_sweep_run(task, n, epsilon, seed, tuple(ks), signed, ("bench", "product"))
    out = []
    for k in ks:
        v = {}
        if str(k) in r["ratios"]:
            v[task] = r["ratios"][str(k)]
        if f"{k}/product" in r["ratios"]:
            v["ridge_product"] = r["ratios"][f"{k}/product"]
        out.append({"row": [n, epsilon, int(k)], "values": v,
                    "notes": {task: r["notes"][str(k)]} if str(k) in r["notes"] else {}})
    return out


@functools.lru_cache(maxsize=2)
def _logistic_data(n: int, seed: int):
    from . import logistic_evaluation

    return logistic_evaluation.synthetic(n, seed)


def run_logistic(n: int, epsilons: Sequence[float], seed: int) -> list[Row]:
    """:func:`logistic_evaluation.run_case` on the synthetic data: AUC and log-loss of every
    mechanism at each epsilon, on 10^5 held-out rows."""
    from . import logistic_evaluation

    recs = logistic_evaluation.run_case(_logistic_data(n, seed), epsilons, seed)
    return _logistic_rows(recs, ["synthetic", n])


def _logistic_rows(recs: list[dict[str, Any]], head: list[Any]) -> list[Row]:
    rows: dict[float, Row] = {}
    for r in recs:
        row = rows.setdefault(r["epsilon"], {"row": [*head, r["epsilon"]], "values": {}, "notes": {}})
        for metric in ("auc", "log_loss", "accuracy"):
            if math.isfinite(r[metric]):
                row["values"][f"{r['mechanism']}/{metric}"] = r[metric]
        if r.get("note") and str(r["note"]).startswith("refused"):
            row["notes"][r["mechanism"]] = r["note"]
        elif r.get("note") in ("gaussian", "taylor"):  # the calibration used: Taylor when the noisy v <= 0
            row["values"][f"{r['mechanism']}/taylor_fallback"] = float(r["note"] == "taylor")
    return list(rows.values())


def logistic_differences(values: dict[str, float]) -> dict[str, float]:
    """The gram kind's paired differences to the non-private model and to diffprivlib on the same
    split (their spread is the noise's alone; the data's is in every mechanism's own sd)."""
    out = {}
    for metric in ("auc", "log_loss"):
        for other in ("nonprivate", "diffprivlib"):
            a, b = values.get(f"ltm_gram/{metric}"), values.get(f"{other}/{metric}")
            if a is not None and b is not None:
                out[f"gram_minus_{other}/{metric}"] = a - b
    return out


def run_logistic_real(name: str, epsilons: Sequence[float], seed: int) -> list[Row]:
    """:func:`logistic_evaluation.run_case` on a random 80/20 split of a scikit-learn data set."""
    from . import logistic_evaluation

    x, y = next((x, y) for nm, x, y in logistic_evaluation.real_datasets() if nm == name)
    recs = logistic_evaluation.run_case(logistic_evaluation.real_split(x, y, seed), epsilons, seed)
    return _logistic_rows(recs, [name, len(y)])


#: Below about this n the l1 kind cannot be designed (8,192 reports at min_reports = 0.9 n).
L1_MIN_N = 10_000


def run_lad(n: int, noise: str, epsilon: float, seed: int) -> list[Row]:
    """:func:`lad_evaluation.run_case`: coefficient error of every LAD mechanism, the rounds' error
    after each round, and whether the rounds beat the gram study's least squares on this data."""
    from . import lad_evaluation

    mechanisms = [m for m in lad_evaluation.MECHANISMS if n >= L1_MIN_N or not m.startswith("ltm_l1")]
    recs = lad_evaluation.run_case(n, noise, [epsilon], seed, mechanisms)
    v = {r["mechanism"]: r["coef_error"] for r in recs}
    rounds = next((r for r in recs if r["mechanism"] == "ltm_rounds"), None)
    if rounds is not None:
        for i, e in enumerate(rounds.get("round_errors", []), 1):
            v[f"round{i}"] = e
        if "ltm_gram_ls" in v:
            v["rounds_beat_ls"] = float(v["ltm_rounds"] < v["ltm_gram_ls"])
    return [{"row": [noise, n, epsilon], "values": v}]


def run_vertical(n: int, epsilon: float, seed: int) -> list[Row]:
    """:func:`vertical_evaluation.run_case`: parties (2 and 3) against one owner and the baselines."""
    from . import vertical_evaluation

    out = []
    for r in vertical_evaluation.run_case(n, epsilon, seed):
        v = dict(r["ratios"])
        if v.get("ltm_owner"):
            v["party_sign_over_owner"] = v["ltm_party_sign"] / v["ltm_owner"]
            v["party_over_owner"] = v["ltm_party"] / v["ltm_owner"]
        out.append({"row": [r["parties"], epsilon, n], "values": v,
                    "info": {"k": r["info"]["k"], "signed_k": r["info"]["signed_k"]}})
    return out


def run_trust_cost(n: int, seed: int) -> list[Row]:
    """:func:`trust_cost.run` for one data set: the floor's price per kind and floor setting, and
    the local and central references."""
    from . import trust_cost

    r = trust_cost.run([n], [seed])
    out = [{"row": [kind, n, floor], "values": {"ridge": cell["ridge"][0], "pca": cell["pca"][0]},
            "info": {"k": cell["k"], "signed": cell["signed"], "sigma": round(cell["sigma"], 4),
                     "server_sigma": round(cell["server_sigma"], 4),
                     "cell_noise_variance": float(f"{cell['cell_noise_variance']:.4g}")}}
           for kind, by_n in r["kinds"].items() for floor, cell in by_n[n].items()]
    refs = r["references"][n]
    out.append({"row": ["references", n, "-"], "values": {k: v[0] for k, v in refs.items()}})
    return out


def run_secret_sign(task: str, n: int, epsilon: float, seed: int) -> list[Row]:
    """:func:`accuracy_runs.sketch_run`'s ``today`` (unsigned) and ``sign`` variants: design()'s
    sketch study without and with the secret sign on the same data, S and normals."""
    from . import accuracy_runs

    r = accuracy_runs.sketch_run(task, n, epsilon, seed, ("today", "sign"), None)
    unsigned, signed = r["ratios"]["today"], r["ratios"]["sign"]
    return [{"row": [task, n, epsilon], "info": {"k": r["k"]},
             "values": {"unsigned": unsigned, "signed": signed, "signed_over_unsigned": signed / unsigned,
                        "signed_better": float(signed < unsigned)}}]


#: The secret sign's end-to-end test: n = 3000 reports, k = 20 (tests/test_secret_sign_e2e.py).
SIGN_E2E = (3_000, 20)


def run_secret_sign_e2e(n: int, k: int, epsilon: float, seed: int) -> list[Row]:
    """:func:`accuracy_runs.sign_pair_run`: the end-to-end test's pipeline in memory on one of its
    data sets, signed and unsigned on common random numbers."""
    from . import accuracy_runs

    v = accuracy_runs.sign_pair_run(n, k, epsilon, seed)
    return [{"row": [metric, n, k, epsilon], "values": {key.split("/", 1)[1]: x for key, x in v.items()
                                                        if key.startswith(metric + "/")}}
            for metric in ("ridge_coef", "pca")]


#: Noise draws per mechanism in one run of the histogram set (20 runs: 2,000 draws).
HISTOGRAM_DRAWS = 100


def run_histogram(n: int, epsilon: float, seed: int) -> list[Row]:
    """:func:`histogram_evaluation.run_synthetic` on one synthetic data set with HISTOGRAM_DRAWS
    noise draws per mechanism, as :func:`histogram_evaluation.target_rows` sums it up: each
    statistic's mean absolute error per mechanism over the draws, and the ratios LTM / central
    and local / LTM of those means."""
    from . import histogram_evaluation

    recs = histogram_evaluation.run_synthetic([n], [epsilon], HISTOGRAM_DRAWS, seed)
    return [{"row": [r["statistic"], n, epsilon],
             "values": {"ltm": r["err_ltm"], "central": r["err_central"], "local": r["err_local"],
                        "ltm_over_central": r["ltm_over_central"], "local_over_ltm": r["local_over_ltm"]}}
            for r in histogram_evaluation.target_rows(recs)]


# ---------------------------------------------------------------------------------------------
# the figure sets


@dataclass(frozen=True)
class FigureSet:
    """One table of the docs: where it is quoted, the jobs of its grid, the function that runs one
    job once (``run(*job, seed)``), its rows' fields and its tables' columns."""

    name: str
    where: str
    run: Callable[..., list[Row]]
    jobs: Callable[[Sequence[int] | None], list[tuple]]
    row_fields: tuple[str, ...]
    tables: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
    digits: int = 3
    #: runs of a job, as a multiple of ``--runs`` (a tail target asks for 50)
    runs_factor: Callable[[tuple], float] = field(default=lambda job: 1.0)
    info: tuple[str, ...] = ()
    #: values computed from a run's values when summarising (paired differences), so that runs
    #: recorded before a difference was asked for have it too
    derive: Callable[[dict[str, float]], dict[str, float]] = field(default=lambda values: {})
    #: a job's privacy target, for ``--epsilons`` (None: the job runs every epsilon of the set)
    epsilon_of: Callable[[tuple], float | None] = field(default=lambda job: None)


def _ns(default: Sequence[int], given: Sequence[int] | None) -> list[int]:
    return [int(n) for n in (given or default)]


RIDGE_COLUMNS = (("local", "local"), ("local_sign", "local (secret sign)"), ("ltm_sketch", "LTM sketch"),
                 ("ltm_gram", "LTM Gram"), ("central", "central (SSP)"), ("adassp", "AdaSSP"),
                 ("dgm_ols", "DGM-OLS"), ("rmgm_ols", "RMGM-OLS"), ("predicted", "predicted sketch"))
PCA_COLUMNS = (("local", "local"), ("local_sign", "local (secret sign)"), ("ltm_sketch", "LTM sketch"),
               ("ltm_gram", "LTM Gram"), ("central", "central (Analyze Gauss)"))
README_COLUMNS = (("ltm_sketch", "LTM sketch"), ("local", "local"), ("local_sign", "local, signed"),
                  ("ltm_gram", "LTM Gram"), ("central", "central"))
LOGISTIC_MECHS = (("nonprivate", "non-private (sklearn)"), ("ltm_gram", "LTM gram"), ("ltm_sketch", "LTM sketch"),
                  ("local", "local model"), ("diffprivlib", "diffprivlib"))
LAD_COLUMNS = (("nonprivate_lad", "non-private LAD"), ("nonprivate_ls", "non-private LS"),
               ("ltm_rounds", "LTM LAD (Huber rounds)"), ("ltm_gram_ls", "LTM gram least squares"),
               ("ltm_l1", "LTM l1 sketch LAD"), ("ltm_l1_cal", "l1, calibrated"), ("local", "local model LAD"),
               ("round1", "rounds: after 1"), ("round2", "after 2"), ("round3", "after 3"),
               ("rounds_beat_ls", "rounds < gram LS (fraction)"))
VERTICAL_COLUMNS = (("ltm_party", "per-party clip"), ("ltm_joint", "joint clip"),
                    ("ltm_owner", "one owner (signed)"), ("ltm_party_sign", "party-key sign"),
                    ("local", "local"), ("central", "central (SSP)"), ("dgm_ols", "DGM-OLS"),
                    ("rmgm_ols", "RMGM-OLS"))
VERTICAL_SIGN_COLUMNS = (("ltm_party", "unsigned (default)"), ("ltm_party_sign", "party-key sign"),
                         ("ltm_party_sign_floor", "party-key sign, unsigned floor"),
                         ("ltm_owner", "one owner (signed)"), ("party_over_owner", "unsigned / one owner, per run"),
                         ("party_sign_over_owner", "party-key sign / one owner, per run"), ("adassp", "AdaSSP"),
                         ("nonpriv_block", "non-private, per-party clip"))
LOGISTIC_EPSILONS = (0.5, 1.0, 4.0)
REAL_DATA = (("diabetes", "ridge"), ("fair", "ridge"), ("randhie", "ridge"), ("breast_cancer", "pca"),
             ("diabetes", "pca"), ("digits", "pca"), ("randhie", "pca"), ("wine", "pca"))


def run_k_sweep_unsigned(task: str, n: int, epsilon: float, ks: Sequence[int], seed: int) -> list[Row]:
    """:func:`run_k_sweep` of the unsigned study (what a study with parties is by default)."""
    return run_k_sweep(task, n, epsilon, ks, seed, signed=False)


def _k_sweep_jobs(ns: Sequence[int] | None) -> list[tuple]:
    grid = ((100_000, (20, 60, 100, 140)), (1_000_000, (200, 400))) if not ns else \
        tuple((n, tuple(sorted({max(8, n // 1000), max(8, n // 500)}))) for n in ns)
    return [(task, n, 1.0, ks) for n, ks in grid for task in ("ridge", "pca")]


FIGURES: dict[str, FigureSet] = {f.name: f for f in (
    FigureSet("synthetic", "README.md (accuracy table), docs/accuracy.md 'Measured' and 'Targets'", run_synthetic,
              lambda ns: [(t, n, 1.0) for n in sorted(_ns(NS, ns), reverse=True) for t in ("ridge", "pca")],
              ("task", "n", "epsilon"),
              (("ridge", RIDGE_COLUMNS), ("pca", PCA_COLUMNS), ("ridge (README)", README_COLUMNS),
               ("pca (README)", README_COLUMNS)), info=("k",), epsilon_of=lambda job: job[2]),
    FigureSet("synthetic_eps", "docs/accuracy.md: the sketch kind at n = 10^6, epsilon 0.5 and 4", run_synthetic,
              lambda ns: [(t, n, e) for n in _ns((1_000_000,), ns) for e in (0.5, 4.0) for t in ("ridge", "pca")],
              ("task", "n", "epsilon"),
              (("ridge", RIDGE_COLUMNS), ("pca", PCA_COLUMNS)), info=("k",), epsilon_of=lambda job: job[2]),
    FigureSet("trivial", "docs/accuracy.md: where the sketch kind is no better than predicting zero", run_trivial,
              lambda ns: [(n,) for n in _ns(NS[:3], ns)], ("n",),
              (("", (("ridge_theta_zero", "ridge, theta = 0"), ("pca_random_subspace", "PCA, random subspace"))),)),
    FigureSet("moments", "README.md and docs/accuracy.md: the moments kind against gram and central", run_moments,
              lambda ns: [(t, n, 1.0) for n in _ns((10_000, 100_000), ns) for t in ("ridge", "pca")],
              ("task", "n", "epsilon"),
              (("", (("gram", "gram"), ("gram_moments", "moments"), ("central", "central"))),)),
    FigureSet("k_sweep", "docs/accuracy.md 'k for a signed study' (50 runs at 10^5: the tail target)", run_k_sweep,
              _k_sweep_jobs, ("n", "epsilon", "k"),
              (("", (("ridge", "ridge"), ("ridge_product", "ridge, product's penalty"), ("pca", "PCA"))),),
              runs_factor=lambda job: 2.5 if job[1] == 100_000 else 1.0),
    FigureSet("k_sweep_unsigned", "docs/vertical.md: no k helps an unsigned study at 10^5", run_k_sweep_unsigned,
              lambda ns: [("ridge", n, 1.0, (20, 40, 80) if not ns else (8, 16)) for n in _ns((100_000,), ns)],
              ("n", "epsilon", "k"), (("", (("ridge", "ridge"), ("ridge_product", "ridge, product's penalty"))),)),
    FigureSet("real", "docs/accuracy.md 'Real data'", run_real,
              lambda ns: [(name, task, 1.0) for name, task in REAL_DATA], ("data set", "task", "n", "d", "epsilon"),
              (("", PCA_COLUMNS),)),
    FigureSet("logistic", "docs/logistic.md 'Measured' (target and AUC tables)", run_logistic,
              lambda ns: [(n, LOGISTIC_EPSILONS) for n in _ns((10_000, 100_000, 1_000_000), ns)],
              ("data", "n", "epsilon"),
              (("test AUC", tuple((f"{m}/auc", lab) for m, lab in LOGISTIC_MECHS)),
               ("test log-loss", tuple((f"{m}/log_loss", lab) for m, lab in LOGISTIC_MECHS)),
               ("paired differences", (("gram_minus_nonprivate/auc", "AUC, gram - non-private"),
                                       ("gram_minus_diffprivlib/auc", "AUC, gram - diffprivlib"),
                                       ("gram_minus_nonprivate/log_loss", "log-loss, gram - non-private"),
                                       ("gram_minus_diffprivlib/log_loss", "log-loss, gram - diffprivlib"),
                                       ("ltm_gram/taylor_fallback", "gram: Taylor scale kept (fraction)"),
                                       ("ltm_sketch/taylor_fallback", "sketch: Taylor scale kept (fraction)")))),
              digits=4, derive=logistic_differences),
    FigureSet("logistic_real", "docs/logistic.md 'Real data'", run_logistic_real,
              lambda ns: [(name, LOGISTIC_EPSILONS) for name in ("breast_cancer", "digits>=5")],
              ("data", "n", "epsilon"),
              (("test AUC", tuple((f"{m}/auc", lab) for m, lab in LOGISTIC_MECHS)),), digits=4),
    FigureSet("lad", "README.md and docs/lad.md 'Measured'", run_lad,
              lambda ns: [(n, noise, 1.0) for n in _ns((100_000,), ns) for noise in ("student_t", "outliers")],
              ("noise", "n", "epsilon"), (("coefficient error", LAD_COLUMNS),)),
    FigureSet("trust_cost", "docs/trust.md 'The price of the floor'", run_trust_cost,
              lambda ns: [(n,) for n in _ns((10_000, 100_000, 1_000_000), ns)], ("kind", "n", "floor"),
              (("", (("ridge", "ridge"), ("pca", "PCA"), ("ridge_local", "ridge local"),
                     ("ridge_central", "ridge central"), ("pca_local", "PCA local"),
                     ("pca_central", "PCA central"))),),
              info=("k", "signed", "sigma", "server_sigma", "cell_noise_variance")),
    FigureSet("secret_sign", "docs/secret_sign.md section 8 (in memory, on the benchmark's data)", run_secret_sign,
              lambda ns: [(t, n, 1.0) for n in _ns((20_000,), ns) for t in ("ridge", "pca")],
              ("task", "n", "epsilon"),
              (("", (("unsigned", "unsigned"), ("signed", "signed"), ("signed_over_unsigned", "signed / unsigned"),
                     ("signed_better", "signed better (fraction)"))),), info=("k",), epsilon_of=lambda job: job[2]),
    FigureSet("secret_sign_e2e", "docs/secret_sign.md section 8 (the end-to-end test's pipeline in memory)",
              run_secret_sign_e2e, lambda ns: [(n, SIGN_E2E[1], 1.0) for n in _ns((SIGN_E2E[0],), ns)],
              ("error", "n", "k", "epsilon"),
              (("", (("unsigned", "unsigned"), ("signed", "signed"), ("signed_over_unsigned", "signed / unsigned"),
                     ("signed_better", "signed better (fraction)"))),), epsilon_of=lambda job: job[2]),
    FigureSet("histogram", "docs/histogram.md 'Targets'", run_histogram,
              lambda ns: [(n, 1.0) for n in _ns((100_000,), ns)], ("statistic", "n", "epsilon"),
              (("", (("ltm", "LTM error"), ("central", "central error"), ("local", "local error"),
                     ("ltm_over_central", "LTM / central"), ("local_over_ltm", "local / LTM"))),),
              epsilon_of=lambda job: job[1]),
    FigureSet("vertical", "docs/vertical.md 'Measured' and 'Parties and the secret sign'", run_vertical,
              lambda ns: [(n, e) for n in sorted(_ns((10_000, 100_000, 1_000_000), ns), reverse=True)
                          for e in (1.0, 0.5, 4.0)],
              ("parties", "epsilon", "n"),
              (("ridge ratio", VERTICAL_COLUMNS), ("parties' designs", VERTICAL_SIGN_COLUMNS)),
              info=("k", "signed_k"), epsilon_of=lambda job: job[1]),
)}


# ---------------------------------------------------------------------------------------------
# running


def _key(name: str, job: tuple, seed: int) -> str:
    return json.dumps([name, list(job), seed], default=float)


def _task(name: str, job: tuple, seed: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    rows = FIGURES[name].run(*job, seed)
    return {"figure": name, "job": list(job), "seed": seed, "rows": rows,
            "seconds": round(time.perf_counter() - t0, 2), "load": os.getloadavg()[0],
            "ended": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def planned(names: Sequence[str], runs: int, ns: Sequence[int] | None,
            epsilons: Sequence[float] | None = None) -> list[tuple[str, tuple, int]]:
    """Every (set, job, seed) to run, seed by seed across the whole grid (so a stopped run leaves
    every point with about the same number of runs); ``epsilons`` keeps the jobs at those
    privacy targets (and the jobs that run every target)."""
    per: list[tuple[str, tuple, int]] = []
    for name in names:
        f = FIGURES[name]
        for job in f.jobs(ns):
            eps = f.epsilon_of(job)
            if epsilons and eps is not None and not any(abs(eps - e) < 1e-12 for e in epsilons):
                continue
            per.append((name, job, max(1, int(round(runs * f.runs_factor(job))))))
    most = max((r for _, _, r in per), default=0)
    return [(name, job, seed) for seed in range(most) for name, job, r in per if seed < r]


def load_records(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def run_all(todo: list[tuple[str, tuple, int]], jsonl: str, jobs: int, until: datetime | None) -> int:
    """Run ``todo``, appending each finished run to ``jsonl``; no new run starts after ``until``.
    Returns how many ran."""
    t0 = time.perf_counter()
    count = 0

    def late() -> bool:
        return until is not None and datetime.now(timezone.utc) >= until

    with open(jsonl, "a") as fh:
        def done(rec: dict[str, Any]) -> None:
            nonlocal count
            count += 1
            fh.write(json.dumps(rec, default=float) + "\n")
            fh.flush()
            first = rec["rows"][0]["values"] if rec["rows"] else {}
            print(f"[{time.perf_counter() - t0:6.0f}s, load {rec['load']:.1f}] {rec['figure']} {rec['job']} "
                  f"seed {rec['seed']} ({rec['seconds']:.0f} s): "
                  + ", ".join(f"{k} {v:.4g}" for k, v in list(first.items())[:6]), file=sys.stderr, flush=True)

        if jobs <= 1:
            for item in todo:
                if late():
                    break
                done(_task(*item))
            return count
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            pending: set[Future] = set()
            it = iter(todo)
            while True:
                while len(pending) < jobs and not late():
                    item = next(it, None)
                    if item is None:
                        break
                    pending.add(pool.submit(_task, *item))
                if not pending:
                    break
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    done(f.result())
    return count


# ---------------------------------------------------------------------------------------------
# summaries and tables


def summarize(records: Sequence[dict[str, Any]], names: Sequence[str] | None = None) -> dict[str, Any]:
    """{set: {"rows": [{"row": [...], "runs": R, "stats": {metric: report.stats(...)}, "info",
    "notes", "load": [min, max], "seconds"}]}} over every run recorded (a job's last record of a
    seed counts once)."""
    latest: dict[str, dict[str, Any]] = {}
    for r in records:
        if names is None or r["figure"] in names:
            latest[_key(r["figure"], tuple(r["job"]), r["seed"])] = r
    out: dict[str, Any] = {}
    for r in latest.values():
        fig = out.setdefault(r["figure"], {"where": FIGURES[r["figure"]].where if r["figure"] in FIGURES else "",
                                           "rows": {}})
        for row in r["rows"]:
            key = json.dumps(row["row"], default=float)
            cell = fig["rows"].setdefault(key, {"row": row["row"], "values": {}, "info": row.get("info", {}),
                                                "notes": {}, "seeds": set(), "loads": [], "seconds": 0.0})
            derived = FIGURES[r["figure"]].derive(row["values"]) if r["figure"] in FIGURES else {}
            for m, v in {**row["values"], **derived}.items():
                if v is not None and math.isfinite(v):
                    cell["values"].setdefault(m, []).append(float(v))
            for m in row.get("notes") or {}:
                cell["notes"][m] = cell["notes"].get(m, 0) + 1
            cell["seeds"].add(r["seed"])
            cell["loads"].append(r["load"])
            cell["seconds"] += r["seconds"] / max(1, len(r["rows"]))
    for fig in out.values():
        rows = []
        for cell in fig["rows"].values():
            rows.append({"row": cell["row"], "runs": len(cell["seeds"]),
                         "stats": {m: report.stats(v) for m, v in cell["values"].items()},
                         "info": cell["info"], "refused": cell["notes"],
                         "load": [min(cell["loads"]), max(cell["loads"])], "seconds": round(cell["seconds"], 1)})
        fig["rows"] = rows
    return out


def _field(v: Any) -> str:
    if isinstance(v, float) and v.is_integer() and v >= 1000:
        v = int(v)
    if isinstance(v, int) and v >= 1000:
        e = math.log10(v)
        return f"10^{int(round(e))}" if abs(e - round(e)) < 1e-9 else f"{v:,}"
    return f"{v:g}" if isinstance(v, float) else str(v)


#: Metrics that are a fraction of runs (a 0/1 per run): never printed as "1 + excess".
FRACTIONS = ("fallback", "_better", "_beat_ls")


def tables(summary: dict[str, Any]) -> str:
    """The markdown tables of every set in ``summary``: its rows' fields, runs, the load average
    range over its runs, and each column's "mean ± sd (median), p90"."""
    out = []
    for name, fig in summary.items():
        f = FIGURES.get(name)
        if f is None:
            continue
        loads = [x for row in fig["rows"] for x in row["load"]]
        out += [f"## {name}", "", f"Quoted in {f.where}. `python -m research.figures --only {name}`; "
                f"load average {min(loads):.1f}-{max(loads):.1f} over its runs; mean ± sd (median), p90.", ""]
        for title, columns in f.tables:
            rows = [row for row in fig["rows"] if title and row["row"][0] == title.split()[0]]  # per task ...
            rows = rows or fig["rows"]  # ... or one of every row
            cols = [(m, lab) for m, lab in columns if any(m in row["stats"] for row in rows)]
            if not rows or not cols:
                continue
            if title:
                out += [f"### {title}", ""]
            head = list(f.row_fields) + list(f.info) + ["runs"] + [lab for _, lab in cols]
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for row in sorted(rows, key=lambda r: [str(x) if isinstance(x, str) else x for x in r["row"]]):
                cells = [_field(v) for v in row["row"]] + [str(row["info"].get(i, "")) for i in f.info]
                cells.append(str(row["runs"]))
                for m, _ in cols:
                    s = row["stats"].get(m)
                    fraction = m.endswith(FRACTIONS)
                    digits = 2 if "_minus_" in m or fraction else f.digits  # differences, fractions
                    txt = report.cell(s, digits, near_one="/" not in m and not fraction)
                    if s and s["runs"] != row["runs"]:
                        txt += f" [{s['runs']} runs]"
                    refused = row["refused"].get(m.split("/")[0])
                    if refused:
                        txt += f" [{refused} refused]"
                    cells.append(txt)
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


def _jsonable(summary: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(summary, default=lambda o: sorted(o) if isinstance(o, set) else float(o)))


# ---------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m research.figures",
                                description="Every accuracy figure the docs quote, from one command: "
                                "mean ± sd (median), p90 over --runs runs per point.")
    p.add_argument("--only", nargs="+", choices=sorted(FIGURES), metavar="SET",
                   help=f"these figure sets only (default: all: {', '.join(FIGURES)})")
    p.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="runs per point (default %(default)s; the "
                   "k sweep runs 2.5x this at 10^5)")
    p.add_argument("--n", type=float, nargs="+", default=None,
                   help="replace every set's report counts (a bounded run; the test uses a tiny n)")
    p.add_argument("--epsilons", type=float, nargs="+", default=None,
                   help="only the points at these privacy targets (of the sets whose jobs have one)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (default %(default)s)")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="OUT.jsonl (every run, appended), OUT.json (summaries), OUT.md (tables); default "
                   "%(default)s")
    p.add_argument("--until", metavar="HH:MM", help="start no run after this UTC time today (a budget)")
    p.add_argument("--tables", action="store_true", help="run nothing: summarise OUT.jsonl and print the tables")
    p.add_argument("--list", action="store_true", help="the figure sets, their grids and where they are quoted")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    names = args.only or list(FIGURES)
    ns = [int(n) for n in args.n] if args.n else None
    if args.list:
        for name in names:
            f = FIGURES[name]
            print(f"{name}: {f.where}; {len(f.jobs(ns))} jobs: " + "; ".join(map(str, f.jobs(ns))))
        return 0
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    jsonl = args.out + ".jsonl"
    if not args.tables:
        have = {_key(r["figure"], tuple(r["job"]), r["seed"]) for r in load_records(jsonl)}
        todo = [t for t in planned(names, args.runs, ns, args.epsilons) if _key(t[0], t[1], t[2]) not in have]
        until = None
        if args.until:
            hh, mm = map(int, args.until.split(":"))
            until = datetime.now(timezone.utc).replace(hour=hh, minute=mm, second=0, microsecond=0)
        print(f"figures: {len(todo)} runs to do ({len(have)} recorded in {jsonl})", file=sys.stderr)
        run_all(todo, jsonl, args.jobs, until)
    records = load_records(jsonl)
    every = summarize(records)  # the files hold every set recorded, whatever --only ran
    with open(args.out + ".json", "w") as fh:
        json.dump({"argv": argv, "sets": _jsonable(every)}, fh, indent=1)
    with open(args.out + ".md", "w") as fh:
        fh.write("# Accuracy figures\n\nGenerated by `python -m research.figures` (`research/figures.py` says "
                 "what runs); every run is in `figures.jsonl`.\n\n" + tables(every) + "\n")
    print(tables(summarize(records, names)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
