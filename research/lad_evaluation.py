"""Accuracy of the product's robust regression (Huber rounds) and of LAD through the l1 sketch, against
their peers (docs/lad.md).

Research harness (like :mod:`research.logistic_evaluation`): numpy-seeded simulations of each
mechanism on the same rows, at the same (epsilon, delta), row bound B and neighbouring notion.

Data (synthetic, ``synthetic``): d = 6 features, x = [1, z] with z ~ N(0, Sigma) in 5 dimensions
(a fixed random Sigma with unit diagonal), y = x . beta_true + e with beta_true =
(0.5, 1, -0.8, 0.6, 0.3, -0.2) (the first is the intercept). Two label noise models:

* ``student_t``: e = 0.5 t_2 (Student-t with 2 degrees of freedom: infinite variance);
* ``outliers``: e = 0.5 N(0, 1), then 5 % of the labels, chosen at random, are replaced by the
  huge value +100 (one-sided gross errors, e.g. data entry; the signal's std is about 1.4).

Rows. A study row [x, y] must have norm at most B = 1. One public factor f (the 0.99 quantile of
the training rows' feature norms mapped to R_X = 1/sqrt(2), as the other harnesses do) scales
features and labels alike, so beta_true is unchanged in the scaled units; the scaled feature
vectors are clipped to R_X (the constant f kept, the other features shrunk) and the scaled labels
to [-C_Y, C_Y], C_Y = 1/sqrt(2) (a winsorised label: the conditional median, hence LAD's target,
survives a monotone clip where the median stays inside the clip; the conditional mean, least
squares' target, does not). So no client clips its row again. All fits and metrics use these
preprocessed rows; the rounds' rows are the same rows with the constant f as their ``_1`` column
(units: the rows divided by f, i.e. the raw data, so their coefficients compare with beta_true).

Every private mechanism is the product's default study of its kind: ``design()`` with the
default floor (epsilon_floor = max(4, epsilon), each server's noise) and min_reports = 0.9 n (the
calibration's lambda_star), two servers. Mechanisms (one record each per (n, noise model,
epsilon, seed)):

* ``nonprivate_lad``: :func:`analyzer.analyses.lad.lad_full` on the rows (the exact LP, HiGHS; the tests
  check it against statsmodels' QuantReg at q = 0.5);
* ``nonprivate_ls``: ordinary least squares on the rows (what LAD is compared against);
* ``ltm_rounds``: **the product's LAD** (:mod:`analyzer.analyses.lad_rounds`): ``DEFAULT_ROUNDS`` moments
  studies of the same clients, each at its share of (epsilon, delta) and of the floor
  (:func:`lad_rounds.round_budget`: they compose to the target), round 1 the rows, each later round
  the rows weighted by the previous round's published fit (:func:`lad_rounds.weighted_rows`),
  every release simulated in law (:func:`analyzer.simulation.simulate_ltm`) and fitted by
  :class:`lad_rounds.RobustRegression`; the record is the last round's fit (the earlier rounds'
  errors are in ``round_errors``);
* ``ltm_gram_ls``: the product's least squares on a gram study at the same (epsilon, delta)
  (:class:`analyzer.estimators.LeastSquares` on :func:`simulation.simulate_ltm`'s release): what
  LAD has to beat;
* ``ltm_l1``: the l1 study (``design(kind="l1")``: its sketch shape, lambda_star, client and server
  noise), simulated exactly: random 16-byte report ids, the real protocol map
  (:func:`dpsketch.protocol.l1sketch.hash_report_ids`, ``apply``) applied to A + G in chunks of
  ``CHUNK`` rows, G ~ N(0, sigma^2) per value, plus the servers' noise per cell; checked against
  the certificate (the largest leverage over the set, :func:`l1sketch.leverages`) as the servers
  would; fitted by :meth:`analyzer.analyses.lad.LADRegression.fit_release` (no noise correction);
  ``ltm_l1_cal`` records the same fit with ``noise_correction="calibrate"``;
* ``local``: each client adds N(0, sigma_local^2) to its row and publishes it; the same
  LADRegression (k = n rows of weight 1, no noise correction).

Metrics: coefficient error ||beta - beta_true||_2 (intercept included), and the l1 objective
ratio sum_i |y_i - x_i beta| / sum_i |y_i - x_i beta_LAD| on the rows (1 = the non-private LAD).

``main()`` (``python -m research.lad_evaluation`` or ``dpsketch experiments --lad``) writes
``docs/experiments/lad_results.md``, ``lad_results.json`` and ``lad_error.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpsketch.protocol import l1sketch, privacy
from dpsketch.protocol.study import design

from dpsketch.analyzer import simulation
from dpsketch.analyzer.analyses.lad import LADRegression, l1_objective, lad_full
from dpsketch.analyzer.analyses.lad_rounds import (DEFAULT_ROUNDS, DEFAULT_TUNING, RobustRegression, RoundWeights,
                                          round_budget, weighted_rows)
from dpsketch.analyzer.estimators import LeastSquares
from dpsketch.analyzer.release import L1Release

from . import report

DELTA = 1e-6
ROW_BOUND = 1.0
NEIGHBOURING = "replace-one"
R_X = C_Y = math.sqrt(0.5)
CLIP_QUANTILE = 0.99
BETA_TRUE = np.array([0.5, 1.0, -0.8, 0.6, 0.3, -0.2])
D = len(BETA_TRUE)
NOISE_MODELS = ("student_t", "outliers")
OUTLIER_FRACTION = 0.05
OUTLIER_VALUE = 100.0
CHUNK = 200_000
MECHANISMS = ("nonprivate_lad", "nonprivate_ls", "ltm_rounds", "ltm_gram_ls", "ltm_l1", "ltm_l1_cal", "local")
LABELS = {"nonprivate_lad": "non-private LAD", "nonprivate_ls": "non-private least squares",
          "ltm_rounds": "LTM LAD (Huber rounds)", "ltm_gram_ls": "LTM gram least squares",
          "ltm_l1": "LTM l1 sketch LAD", "ltm_l1_cal": "LTM l1 sketch LAD, calibrated",
          "local": "local model LAD"}
STYLE = {"nonprivate_lad": ("k", "--", "o"), "nonprivate_ls": ("grey", ":", "x"),
         "ltm_rounds": ("tab:green", "-", "D"), "ltm_gram_ls": ("tab:blue", "-", "s"),
         "ltm_l1": ("tab:orange", "-", "^"), "ltm_l1_cal": ("tab:brown", "-.", "<"),
         "local": ("tab:red", ":", "v")}


# ---------------------------------------------------------------------------------------------
# data


def synthetic(n: int, noise: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw (x, y) of the synthetic model (module docstring); x includes the constant column."""
    if noise not in NOISE_MODELS:
        raise ValueError(f"noise must be one of {NOISE_MODELS}")
    model_rng = np.random.default_rng(20_251_120)
    a = model_rng.normal(size=(D - 1, D - 1))
    cov = a @ a.T + (D - 1) * np.eye(D - 1)
    sd = np.sqrt(np.diag(cov))
    chol = np.linalg.cholesky(cov / np.outer(sd, sd))
    rng = np.random.default_rng([n, seed, NOISE_MODELS.index(noise), 17])
    z = rng.normal(size=(n, D - 1)) @ chol.T
    x = np.hstack([np.ones((n, 1)), z])
    if noise == "student_t":
        e = 0.5 * rng.standard_t(2, size=n)
        y = x @ BETA_TRUE + e
    else:
        y = x @ BETA_TRUE + 0.5 * rng.normal(size=n)
        y[rng.uniform(size=n) < OUTLIER_FRACTION] = OUTLIER_VALUE
    return x, y


def preprocess(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Study rows' features and labels and the factor f: one factor for both, features clipped to
    R_X with the constant column kept at f (the others shrunk), labels to [-C_Y, C_Y] (so every row
    [x, y] has norm <= B = 1)."""
    f = R_X / float(np.quantile(np.linalg.norm(x, axis=1), CLIP_QUANTILE))
    xs = x * f
    xs[:, 1:] = simulation.clip_rows(xs[:, 1:], math.sqrt(R_X ** 2 - f ** 2))
    return xs, np.clip(y * f, -C_Y, C_Y), f


COLUMNS = [f"x{i}" for i in range(D)] + ["y"]


def _design(n: int, eps: float, kind: str, seed: int, columns: Sequence[str] = COLUMNS, **kw):
    study, _ = design(name="lad-evaluation", columns=list(columns), label="y", servers=["s1", "s2"],
                      expected_reports=n, epsilon=eps, delta=DELTA, row_bound=ROW_BOUND,
                      neighbouring=NEIGHBOURING, kind=kind, seed=f"{n:08x}{seed:08x}".ljust(64, "0"), **kw)
    return study


# ---------------------------------------------------------------------------------------------
# the l1 sketch release


class SketchSet:
    """One inclusion set's public map under an l1 study: report ids, rows/signs, bucket counts,
    max leverage (checked against the study's lambda_star, as every server does)."""

    def __init__(self, study, n: int, rng: np.random.Generator):
        self.study = study
        self.spec, self.lambda_star = study.l1_spec, study.lambda_star
        self.seed = rng.bytes(32)
        ids = simulation.random_report_ids(n, rng)
        self.rows, self.signs = l1sketch.hash_report_ids(self.seed, ids, self.spec)
        k = self.spec.k
        self.counts = l1sketch.apply(self.rows, self.signs, np.ones((n, 1)), k)[:, 0]
        self.max_leverage = float(np.max(l1sketch.leverages(self.rows, self.signs, k)))
        if self.max_leverage * self.lambda_star > 1.0:  # what every server would refuse
            raise RuntimeError(f"the designed lambda_star {self.lambda_star:.1f} fails the certificate "
                               f"(max leverage {self.max_leverage:.3g}) for this set")

    def release(self, study, a: np.ndarray, rng: np.random.Generator) -> L1Release:
        """Y = S (A + G) + E: G ~ N(0, sigma^2) per value in chunks of CHUNK reports, E the N
        servers' noise per cell."""
        k = self.spec.k
        y = np.zeros((k, a.shape[1]))
        for start in range(0, len(a), CHUNK):
            sl = slice(start, start + CHUNK)
            noisy = a[sl] + rng.normal(0.0, study.sigma, size=a[sl].shape) if study.sigma > 0 else a[sl]
            y += l1sketch.apply(self.rows[sl], self.signs[sl], noisy, k)
        rel = L1Release(study=study, sketch=y, n_reports=len(a))
        if rel.server_noise_variance > 0:
            rel = L1Release(study=study, sketch=y + rng.normal(0.0, math.sqrt(rel.server_noise_variance), y.shape),
                            n_reports=len(a))
        return rel


# ---------------------------------------------------------------------------------------------
# the product's LAD: Huber rounds of moments studies


def rounds_fit(a: np.ndarray, f: float, n: int, eps: float, seed: int, rng: np.random.Generator,
               rounds: int = DEFAULT_ROUNDS, tuning: float = DEFAULT_TUNING) -> tuple[np.ndarray, dict[str, Any]]:
    """The last round's [intercept, coef] and details (per-round errors, budgets)."""
    budget = round_budget(eps, DELTA, rounds)
    cols = COLUMNS[1:]  # x1..x5, y: the constant x0 = f is the rounds' _1 column
    weights = RoundWeights.unweighted("y", cols, None, f)
    errors, beta = [], None
    for r, (eps_r, floor_r) in enumerate(budget):
        rows = weighted_rows(a[:, 1:], weights)
        study = _design(n, eps_r, "moments", seed * 16 + r, weights.round_columns, epsilon_floor=floor_r)
        model = RobustRegression("y", weighted_by=weights, tuning=tuning).fit(simulation.simulate_ltm(study, rows, rng))
        beta = np.append(model.intercept_, model.coef_)
        errors.append(float(np.linalg.norm(beta - BETA_TRUE)))
        weights = model.next_weights_
    return beta, {"round_errors": errors, "round_epsilons": [b[0] for b in budget], "rounds": rounds}


# ---------------------------------------------------------------------------------------------
# one case


def run_case(n: int, noise: str, epsilons: Sequence[float], seed: int,
             mechanisms: Sequence[str] = MECHANISMS) -> list[dict[str, Any]]:
    """Every mechanism on one data set, for each epsilon; one record per (epsilon, mechanism)."""
    x, y, f = preprocess(*synthetic(n, noise, seed))
    a = np.hstack([x, y[:, None]])
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    beta_lad = lad_full(x, y)
    obj_lad = l1_objective(x, y, beta_lad)
    lad_seconds = time.perf_counter() - t0

    def record(mech: str, eps: float, beta: np.ndarray, seconds: float, **extra) -> None:
        out.append({"mechanism": mech, "epsilon": eps, "n": n, "noise": noise, "seed": seed,
                    "coef_error": float(np.linalg.norm(beta - BETA_TRUE)),
                    "objective_ratio": l1_objective(x, y, beta) / obj_lad,
                    "coef": [float(b) for b in beta], "seconds": round(seconds, 3), **extra})

    beta_ls = np.linalg.lstsq(x, y, rcond=None)[0]
    for eps in epsilons:
        if "nonprivate_lad" in mechanisms:
            record("nonprivate_lad", eps, beta_lad, lad_seconds)
        if "nonprivate_ls" in mechanisms:
            record("nonprivate_ls", eps, beta_ls, 0.0)
    rng = np.random.default_rng([n, seed, NOISE_MODELS.index(noise), 5])
    for eps in epsilons:
        erng = np.random.default_rng([n, seed, NOISE_MODELS.index(noise), int(round(eps * 1000))])
        if {"ltm_l1", "ltm_l1_cal"} & set(mechanisms):
            t = time.perf_counter()
            study = _design(n, eps, "l1", seed)
            sset = SketchSet(study, n, rng)
            model = LADRegression(label="y", noise_correction="calibrate").fit_release(sset.release(study, a, erng))
            sec = time.perf_counter() - t
            info = {"k": study.k, "levels": sset.spec.levels, "lambda_star": study.lambda_star,
                    "sigma": study.sigma, "server_sigma": study.server_sigma}
            if "ltm_l1" in mechanisms:  # the default fit (no correction) is the uncorrected solution
                record("ltm_l1", eps, model.coef_uncorrected_, sec, **info)
            if "ltm_l1_cal" in mechanisms:
                record("ltm_l1_cal", eps, model.coef_, sec, n_floored=model.n_floored_, **info)
        if "ltm_rounds" in mechanisms:
            t = time.perf_counter()
            beta, info = rounds_fit(a, f, n, eps, seed, erng)
            record("ltm_rounds", eps, beta, time.perf_counter() - t, **info)
        if "ltm_gram_ls" in mechanisms:
            t = time.perf_counter()
            study = _design(n, eps, "gram", seed)
            ls = LeastSquares("y").fit(simulation.simulate_ltm(study, a, erng))
            record("ltm_gram_ls", eps, ls.coef_, time.perf_counter() - t, sigma=study.sigma,
                   server_sigma=study.server_sigma)
        if "local" in mechanisms:
            t = time.perf_counter()
            sigma_local = privacy.local_sigma(eps, DELTA, ROW_BOUND, NEIGHBOURING)
            noisy = a + erng.normal(0.0, sigma_local, size=a.shape)
            model = LADRegression(label=-1).fit(noisy)
            record("local", eps, model.coef_, time.perf_counter() - t, sigma=sigma_local)
    return out


# ---------------------------------------------------------------------------------------------
# summaries, table, plot


def summarize(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(noise, n, epsilon, mechanism) -> runs, and per metric its mean, sample sd, median and 90th
    percentile (``report.stats``)."""
    out = {}
    for key, rs in report.group(records, "noise", "n", "epsilon", "mechanism").items():
        s: dict[str, Any] = {"runs": len(rs)}
        for m in ("coef_error", "objective_ratio"):
            v = np.array([r[m] for r in rs], dtype=float)
            st = report.stats(v[np.isfinite(v)])
            s[m], s[m + "_std"], s[m + "_median"], s[m + "_p90"] = st["mean"], st["sd"], st["median"], st["p90"]
        for extra in ("k", "lambda_star", "sigma"):
            if extra in rs[0]:
                s[extra] = float(np.mean([r[extra] for r in rs]))
        out[key] = s
    return out


def _cell(s: dict | None, metric: str) -> str:
    """mean ± sd (median), p90 over the runs."""
    if s is None or not np.isfinite(s[metric]):
        return "-"
    fmt = (lambda v: f"{v:.4f}") if metric == "objective_ratio" else (lambda v: f"{v:.3f}")
    if s["runs"] < 2:
        return fmt(s[metric])
    return (f"{fmt(s[metric])} ± {fmt(s[metric + '_std'])} ({fmt(s[metric + '_median'])}), "
            f"p90 {fmt(s[metric + '_p90'])}")


def table(summary: dict, noise: str, metric: str, epsilons: Sequence[float],
          first: tuple[int, float] | None = None) -> str:
    ns = sorted({k[1] for k in summary if k[0] == noise})
    mechs = [m for m in MECHANISMS if any(k[0] == noise and k[3] == m for k in summary)]
    lines = ["| n | epsilon | k | " + " | ".join(LABELS[m] for m in mechs) + " |",
             "|---|---|---|" + "---|" * len(mechs)]
    cases = [(n, e) for n in ns for e in epsilons if any((noise, n, e, m) in summary for m in mechs)]
    if first in cases:
        cases.remove(first)
        cases.insert(0, first)
    for n, eps in cases:
        k = summary.get((noise, n, eps, "ltm_l1"), {}).get("k")
        lines.append(f"| {n:,} | {eps:g} | {int(k) if k else '-'} | " +
                     " | ".join(_cell(summary.get((noise, n, eps, m)), metric) for m in mechs) + " |")
    return "\n".join(lines)


def plot(summary: dict, epsilons: Sequence[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    noises = [m for m in NOISE_MODELS if any(k[0] == m for k in summary)]
    shown = ("nonprivate_lad", "nonprivate_ls", "ltm_rounds", "ltm_gram_ls", "ltm_l1", "local")
    fig, axes = plt.subplots(len(noises), len(epsilons), figsize=(5.0 * len(epsilons), 4.3 * len(noises)),
                             squeeze=False, sharey="row")
    for i, noise in enumerate(noises):
        ns = sorted({k[1] for k in summary if k[0] == noise})
        for j, eps in enumerate(epsilons):
            ax = axes[i][j]
            for m in shown:
                pts = [(n, summary[(noise, n, eps, m)]) for n in ns if (noise, n, eps, m) in summary]
                pts = [(n, s) for n, s in pts if np.isfinite(s["coef_error"])]
                if not pts:
                    continue
                color, ls, marker = STYLE[m]
                ax.errorbar([n for n, _ in pts], [s["coef_error"] for _, s in pts],
                            yerr=[s["coef_error_std"] for _, s in pts], color=color, ls=ls, marker=marker,
                            label=LABELS[m], capsize=3, lw=1.6, ms=6)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{'Student-t(2) label noise' if noise == 'student_t' else '5% gross outliers'}, "
                         f"epsilon = {eps:g}", fontsize=10)
            ax.set_xlabel("n (reports)")
            if j == 0:
                ax.set_ylabel("||beta - beta_true||_2 (lower is better)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=10, frameon=False)
    fig.suptitle(f"Least absolute deviations, synthetic data, d = {D}: coefficient error "
                 "(mean ± sd over runs; delta = 1e-6, replace-one)", fontsize=12)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def results_markdown(summary: dict, epsilons: Sequence[float], seconds: float, argv: Sequence[str]) -> str:
    lines = ["# Least absolute deviations: measured results", "",
             report.generated_by("dpsketch experiments --lad", argv, seconds, "research/lad_evaluation.py") +
             " Mean ± sample sd (median), p90 = the 90th percentile over runs; "
             f"d = {D} (intercept included), delta = 1e-6, replace-one, B = 1.", ""]
    first = (100_000, 1.0)
    for noise, title in (("student_t", "Student-t (2 degrees of freedom) label noise"),
                         ("outliers", "5 % gross outliers (label +100)")):
        if not any(k[0] == noise for k in summary):
            continue
        lines += [f"## {title}: coefficient error ||beta - beta_true||_2", "",
                  table(summary, noise, "coef_error", epsilons, first), "",
                  f"## {title}: l1 objective ratio (1 = non-private LAD)", "",
                  table(summary, noise, "objective_ratio", epsilons, first), ""]
    cert: dict[tuple[int, float], list[tuple[float, float]]] = {}
    for k, s in summary.items():
        if k[3] == "ltm_l1":
            cert.setdefault((k[1], k[2]), []).append((s["lambda_star"], s["sigma"]))
    if cert:
        lines += ["## The l1 sketch's certificate", "",
                  "lambda_star from the study design (l1sketch.design; every set passed the servers' leverage "
                  "certificate) and "
                  "the client noise sigma = sigma_local / sqrt(lambda_star) it allows:", "",
                  "| n | epsilon | lambda_star | sigma |", "|---|---|---|---|"]
        lines += [f"| {n:,} | {e:g} | {np.mean([v[0] for v in vs]):.1f} | {np.mean([v[1] for v in vs]):.3f} |"
                  for (n, e), vs in sorted(cert.items())] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpsketch experiments --lad",
                                description="Robust regression (Huber rounds of moments studies) and LAD through "
                                "the l1 sketch against the non-private LAD, the local model and least squares on a "
                                "gram study.")
    report.add_grid_arguments(p, n="reports (default: 1e4 1e5 1e6)", epsilons="default: 0.5 1 4",
                              seeds="runs per n (default 20; 2 at n >= 10^6; --quick 1)",
                              quick="bounded (< 30 s): n 1e4 1e5, epsilon 1, one run",
                              from_json="re-draw the plot and tables from a previous run's JSON")
    p.add_argument("--mechanisms", nargs="+", choices=MECHANISMS, default=list(MECHANISMS),
                   help="which mechanisms to run (default: all)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    run = report.grid(args, seeds=20)
    if (saved := report.saved_run(args)) is not None:
        return write_outputs(saved["records"], saved["epsilons"], saved["seconds"], saved["argv"], args.out)
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    for n in run.ns:
        for noise in NOISE_MODELS:
            for seed in range(min(run.seeds, 2) if n >= 1_000_000 and args.seeds is None else run.seeds):
                rs = run_case(n, noise, run.epsilons, seed, args.mechanisms)
                records.extend(rs)
                print(f"[{time.perf_counter() - t0:6.0f}s] n={n} {noise} seed={seed}: " +
                      ", ".join(f"{r['mechanism']}@{r['epsilon']:g} {r['coef_error']:.3f}" for r in rs),
                      file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    report.save_run(args.out, "lad_results.json", {"argv": argv, "seconds": round(seconds, 1), "epsilons": run.epsilons,
                                                   "delta": DELTA, "beta_true": BETA_TRUE.tolist(), "records": records})
    return write_outputs(records, run.epsilons, seconds, argv, args.out)


def write_outputs(records: list[dict[str, Any]], epsilons: Sequence[float], seconds: float, argv: Sequence[str],
                  out: str) -> int:
    summary = summarize(records)
    plot(summary, epsilons, os.path.join(out, "lad_error.png"))
    return report.publish(out, "lad_results.md", results_markdown(summary, epsilons, seconds, argv))


if __name__ == "__main__":
    raise SystemExit(main())
