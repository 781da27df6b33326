"""Accuracy of least absolute deviations (LAD) through the l1 sketch, against its peers.

Research harness (like :mod:`analyzer.logistic_evaluation`): numpy-seeded simulations of each
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
vectors are clipped to R_X and the scaled labels to [-C_Y, C_Y], C_Y = 1/sqrt(2) (a winsorised
label: the conditional median, hence LAD's target, survives a monotone clip where the median stays
inside the clip; the conditional mean, least squares' target, does not). So no client clips its
row again. All fits and metrics use these preprocessed rows.

Mechanisms (one record each per (n, noise model, epsilon, seed)):

* ``nonprivate_lad``: :func:`analyzer.lad.lad_full` on the rows (the exact LP, HiGHS; the tests
  check it against statsmodels' QuantReg at q = 0.5);
* ``nonprivate_ls``: ordinary least squares on the rows (what LAD is compared against);
* ``ltm_l1``: the LTM l1 sketch release, simulated exactly: random 16-byte report ids, the real
  protocol map (:func:`dpsketch.protocol.l1sketch.hash_report_ids`, ``apply``) applied to
  A + G in chunks of ``CHUNK`` rows (n = 10^6 runs in bounded memory), G ~ N(0, sigma^2) per value
  with sigma = sigma_local / sqrt(lambda_star), sigma_local =
  ``privacy.local_sigma(epsilon, delta, B, "replace-one")`` and lambda_star the study design's
  (:func:`l1sketch.design`: 0.8 / the typical leverage), checked against the certificate (the
  largest leverage S_i^T (S S^T)^+ S_i over the set, :func:`l1sketch.leverages`, t = 0) as the
  servers would. No server noise (the l1 study's
  floor is not designed yet; the ridge baseline below has none either). Fit:
  :class:`analyzer.lad.LADRegression` with the spec's weights, the study's sigma and the exact
  bucket counts (diag S S^T; public given the inclusion set), the default (no noise correction);
  ``ltm_l1_cal`` records the same fit with ``noise_correction="calibrate"``, to measure it;
* ``local``: each client adds N(0, sigma_local^2) to its row and publishes it; the same
  LADRegression (k = n rows of weight 1, no noise correction);
* ``ltm_gram_ridge``: our own ridge on the same rows: the LTM **gram** study (central-model
  accuracy) at the same (epsilon, delta), B, replace-one, no servers' floor, simulated with
  :func:`analyzer.baselines.simulate_ltm` and fitted with :class:`analyzer.estimators.RidgeRegression`
  (default alpha).

The sketch's shape (``SPEC``, :func:`choose_spec`): s = 2 level-0 blocks of 32 buckets, branching
2, levels 1 and 2 with 8 buckets each (k = 80 rows, weights 1/2, 1/p_1 = 4, 1/p_2 = 8). The deep
buckets then hold about as many reports as the level-0 ones (n/32, n/32, n/64), so the largest
leverage is not set by a sparse deep bucket: with 32 buckets per level and 3 levels
lambda_star fell from about 1,000 to 150 at n = 10^5 (every client's noise x 2.6) and the
coefficient error rose (measured over a grid of shapes at n = 10^5, docs/lad.md).

Metrics: coefficient error ||beta - beta_true||_2 (intercept included), and the l1 objective
ratio sum_i |y_i - x_i beta| / sum_i |y_i - x_i beta_LAD| on the rows (1 = the non-private LAD).

``main()`` (``python -m analyzer.lad_evaluation`` or ``dpsketch experiments --lad``) writes
``docs/experiments/lad_results.md``, ``lad_results.json`` and ``lad_error.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpsketch.protocol import l1sketch, privacy
from dpsketch.protocol.study import design

from . import baselines
from .estimators import RidgeRegression
from .lad import LADRegression, l1_objective, lad_full

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
NS = (10_000, 100_000, 1_000_000)
EPSILONS = (0.5, 1.0, 4.0)
QUICK_NS = (10_000, 100_000)
QUICK_EPSILONS = (1.0,)
CHUNK = 200_000
SPEC = dict(s=2, level0_buckets=32, levels=2, buckets=8, branching=2)
MECHANISMS = ("nonprivate_lad", "nonprivate_ls", "ltm_l1", "ltm_l1_cal", "local", "ltm_gram_ridge")
LABELS = {"nonprivate_lad": "non-private LAD", "nonprivate_ls": "non-private least squares",
          "ltm_l1": "LTM l1 sketch LAD", "ltm_l1_cal": "LTM l1 sketch LAD, calibrated",
          "local": "local model LAD", "ltm_gram_ridge": "LTM gram ridge"}
STYLE = {"nonprivate_lad": ("k", "--", "o"), "nonprivate_ls": ("grey", ":", "x"),
         "ltm_l1": ("tab:orange", "-", "^"), "ltm_l1_cal": ("tab:brown", "-.", "<"),
         "local": ("tab:red", ":", "v"), "ltm_gram_ridge": ("tab:blue", "-", "s")}


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


def preprocess(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Study rows' features and labels: one factor f for both, features clipped to R_X, labels
    to [-C_Y, C_Y] (so every row [x, y] has norm <= B = 1)."""
    f = R_X / float(np.quantile(np.linalg.norm(x, axis=1), CLIP_QUANTILE))
    return baselines.clip_rows(x * f, R_X), np.clip(y * f, -C_Y, C_Y)


# ---------------------------------------------------------------------------------------------
# the l1 sketch release


def choose_spec(n: int) -> tuple[l1sketch.L1Spec, float]:
    """The sketch shape and lambda_star an l1 study of n reports gets (``l1sketch.design``, the
    product's own choice: for these 7 columns the shape ``SPEC`` from 16,384 reports on; one level
    fewer below)."""
    return l1sketch.design(n, len(BETA_TRUE) + 1)


class SketchSet:
    """One inclusion set's public map: report ids, rows/signs, bucket counts, max leverage."""

    def __init__(self, n: int, rng: np.random.Generator):
        self.spec, self.lambda_star = choose_spec(n)
        self.seed = rng.bytes(32)
        ids = baselines.random_report_ids(n, rng)
        self.rows, self.signs = l1sketch.hash_report_ids(self.seed, ids, self.spec)
        k = self.spec.k
        self.counts = l1sketch.apply(self.rows, self.signs, np.ones((n, 1)), k)[:, 0]
        self.max_leverage = float(np.max(l1sketch.leverages(self.rows, self.signs, k)))
        if self.max_leverage * self.lambda_star > 1.0:  # what every server would refuse
            raise RuntimeError(f"the designed lambda_star {self.lambda_star:.1f} fails the certificate "
                               f"(max leverage {self.max_leverage:.3g}) for this set")

    def release(self, a: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
        """Y = S (A + G), G ~ N(0, sigma^2) per value, in chunks of CHUNK reports."""
        k = self.spec.k
        y = np.zeros((k, a.shape[1]))
        for start in range(0, len(a), CHUNK):
            sl = slice(start, start + CHUNK)
            noisy = a[sl] + rng.normal(0.0, sigma, size=a[sl].shape)
            y += l1sketch.apply(self.rows[sl], self.signs[sl], noisy, k)
        return y


# ---------------------------------------------------------------------------------------------
# one case


def run_case(n: int, noise: str, epsilons: Sequence[float], seed: int,
             mechanisms: Sequence[str] = MECHANISMS) -> list[dict[str, Any]]:
    """Every mechanism on one data set, for each epsilon; one record per (epsilon, mechanism)."""
    x, y = preprocess(*synthetic(n, noise, seed))
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
    sset = SketchSet(n, rng) if {"ltm_l1", "ltm_l1_cal"} & set(mechanisms) else None
    for eps in epsilons:
        sigma_local = privacy.local_sigma(eps, DELTA, ROW_BOUND, NEIGHBOURING)
        erng = np.random.default_rng([n, seed, NOISE_MODELS.index(noise), int(round(eps * 1000))])
        if sset is not None:
            t = time.perf_counter()
            sigma = sigma_local / math.sqrt(sset.lambda_star)
            rel = sset.release(a, sigma, erng)
            model = LADRegression(label=-1, noise_correction="calibrate").fit(
                rel, sset.spec.weights(), sigma=sigma, counts=sset.counts)
            sec = time.perf_counter() - t
            info = {"k": sset.spec.k, "levels": sset.spec.levels, "lambda_star": sset.lambda_star,
                    "sigma": sigma}
            if "ltm_l1" in mechanisms:  # the default fit (no correction) is the uncorrected solution
                record("ltm_l1", eps, model.coef_uncorrected_, sec, **info)
            if "ltm_l1_cal" in mechanisms:
                record("ltm_l1_cal", eps, model.coef_, sec, n_floored=model.n_floored_, **info)
        if "local" in mechanisms:
            t = time.perf_counter()
            noisy = a + erng.normal(0.0, sigma_local, size=a.shape)
            model = LADRegression(label=-1).fit(noisy)
            record("local", eps, model.coef_, time.perf_counter() - t, sigma=sigma_local)
        if "ltm_gram_ridge" in mechanisms:
            t = time.perf_counter()
            cols = [f"x{i}" for i in range(D)] + ["y"]
            study, _ = design(name="lad-evaluation", columns=cols, label="y", servers=["s1", "s2"],
                              expected_reports=n, epsilon=eps, delta=DELTA, row_bound=ROW_BOUND,
                              neighbouring=NEIGHBOURING, kind="gram", epsilon_floor=None,
                              seed=f"{n:08x}{seed:08x}".ljust(64, "0"))
            release = baselines.simulate_ltm(study, a, erng)
            ridge = RidgeRegression("y").fit(release)
            record("ltm_gram_ridge", eps, ridge.coef_, time.perf_counter() - t, alpha=ridge.alpha_)
    return out


# ---------------------------------------------------------------------------------------------
# summaries, table, plot


def summarize(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["noise"], r["n"], r["epsilon"], r["mechanism"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        s: dict[str, Any] = {"runs": len(rs)}
        for m in ("coef_error", "objective_ratio"):
            v = np.array([r[m] for r in rs], dtype=float)
            v = v[np.isfinite(v)]
            s[m] = float(v.mean()) if len(v) else float("nan")
            s[m + "_std"] = float(v.std(ddof=1)) if len(v) > 1 else 0.0
        for extra in ("k", "lambda_star", "sigma"):
            if extra in rs[0]:
                s[extra] = float(np.mean([r[extra] for r in rs]))
        out[key] = s
    return out


def _cell(s: dict | None, metric: str) -> str:
    if s is None or not np.isfinite(s[metric]):
        return "-"
    fmt = (lambda v: f"{v:.4f}") if metric == "objective_ratio" else (lambda v: f"{v:.3f}")
    return f"{fmt(s[metric])} ± {fmt(s[metric + '_std'])}" if s["runs"] > 1 else fmt(s[metric])


def table(summary: dict, noise: str, metric: str, epsilons: Sequence[float],
          first: tuple[int, float] | None = None) -> str:
    ns = sorted({k[1] for k in summary if k[0] == noise})
    lines = ["| n | epsilon | k | " + " | ".join(LABELS[m] for m in MECHANISMS) + " |",
             "|---|---|---|" + "---|" * len(MECHANISMS)]
    cases = [(n, e) for n in ns for e in epsilons if any((noise, n, e, m) in summary for m in MECHANISMS)]
    if first in cases:
        cases.remove(first)
        cases.insert(0, first)
    for n, eps in cases:
        k = summary.get((noise, n, eps, "ltm_l1"), {}).get("k")
        lines.append(f"| {n:,} | {eps:g} | {int(k) if k else '-'} | " +
                     " | ".join(_cell(summary.get((noise, n, eps, m)), metric) for m in MECHANISMS) + " |")
    return "\n".join(lines)


def plot(summary: dict, epsilons: Sequence[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    noises = [m for m in NOISE_MODELS if any(k[0] == m for k in summary)]
    shown = ("nonprivate_lad", "nonprivate_ls", "ltm_l1", "local", "ltm_gram_ridge")
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
                 "(mean ± std over runs; delta = 1e-6, replace-one)", fontsize=12)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def results_markdown(summary: dict, epsilons: Sequence[float], seconds: float, argv: Sequence[str]) -> str:
    lines = ["# Least absolute deviations: measured results", "",
             f"Generated by `dpsketch experiments --lad {' '.join(argv)}`".rstrip() +
             f" in {seconds:.0f} s on {platform.machine()} ({os.cpu_count()} cores); "
             "`analyzer/lad_evaluation.py` says exactly what runs. Mean ± std over runs; "
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
                                description="Least absolute deviations through the l1 sketch against the "
                                "non-private LAD, the local model and the LTM gram kind's ridge.")
    p.add_argument("--out", default="docs/experiments")
    p.add_argument("--n", type=float, nargs="+", default=None, help="reports (default: 1e4 1e5 1e6)")
    p.add_argument("--epsilons", type=float, nargs="+", default=None, help="default: 0.5 1 4")
    p.add_argument("--seeds", type=int, default=None, help="runs per n (default 3; 2 at n >= 10^6; --quick 1)")
    p.add_argument("--quick", action="store_true", help="bounded (< 30 s): n 1e4 1e5, epsilon 1, one run")
    p.add_argument("--from-json", metavar="FILE", help="re-draw the plot and tables from a previous run's JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    ns = [int(n) for n in (args.n or (QUICK_NS if args.quick else NS))]
    epsilons = [float(e) for e in (args.epsilons or (QUICK_EPSILONS if args.quick else EPSILONS))]
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    os.makedirs(args.out, exist_ok=True)
    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        return write_outputs(saved["records"], saved["epsilons"], saved["seconds"], saved["argv"], args.out)
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    for n in ns:
        for noise in NOISE_MODELS:
            for seed in range(min(seeds, 2) if n >= 1_000_000 and args.seeds is None else seeds):
                rs = run_case(n, noise, epsilons, seed)
                records.extend(rs)
                print(f"[{time.perf_counter() - t0:6.0f}s] n={n} {noise} seed={seed}: " +
                      ", ".join(f"{r['mechanism']}@{r['epsilon']:g} {r['coef_error']:.3f}" for r in rs),
                      file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    with open(os.path.join(args.out, "lad_results.json"), "w") as fh:
        json.dump({"argv": argv, "seconds": round(seconds, 1), "epsilons": epsilons, "delta": DELTA,
                   "beta_true": BETA_TRUE.tolist(), "records": records}, fh, indent=1, default=float)
    return write_outputs(records, epsilons, seconds, argv, args.out)


def write_outputs(records: list[dict[str, Any]], epsilons: Sequence[float], seconds: float, argv: Sequence[str],
                  out: str) -> int:
    summary = summarize(records)
    plot(summary, epsilons, os.path.join(out, "lad_error.png"))
    md = results_markdown(summary, epsilons, seconds, argv)
    with open(os.path.join(out, "lad_results.md"), "w") as fh:
        fh.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
