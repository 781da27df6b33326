"""Accuracy of logistic regression on releases: LTM gram and sketch kinds against their peers.

Every mechanism fits a binary logistic model on the same training rows and is scored on the same
held-out rows (test accuracy, AUC and mean log-loss):

* **non-private**: ``sklearn.linear_model.LogisticRegression`` (lbfgs, its default C = 1) on the
  training features;
* **LTM gram** / **LTM sketch**: :class:`analyzer.analyses.logistic.LogisticRegression` (defaults: Taylor
  surrogate direction, Gaussian calibration, noise-scaled ridge) on the study kind's release;
* **local**: the same estimator on the local model's noisy rows (each client adds
  N(0, sigma_local^2) to its clipped row, :func:`analyzer.simulation.simulate_local`) at the same
  (epsilon, delta), B and neighbouring notion; the intercept from the noisy rows' sum;
* **diffprivlib**: IBM diffprivlib's ``LogisticRegression`` (objective perturbation, Chaudhuri et
  al. 2011): a *trusted curator* with pure epsilon-DP (delta = 0) at the same epsilon, its default
  C = 1, ``data_norm`` = B on features scaled to the full row bound (its best case: the label is not
  part of its row norm).

Releases are drawn from their exact noise law with :func:`analyzer.simulation.simulate_ltm` (the real
protocol hash for the sketch, the gram kind's sum plus N(0, n sigma^2 + N server_sigma^2) per
coordinate), at the default floor (servers s1, s2 add their noise). ``tests/test_logistic_evaluation.py``
checks this simulation against :func:`research.experiments.run_pipeline` (SDK client path, server
aggregation, certificate, analyzer decoding).

Rows. A study's row must have norm at most B = 1, label included. The features are scaled so the
0.99 quantile of the training rows' feature norms is R_X and clipped there (a fixed preprocessing,
applied to the test rows too; the scale is taken from the data as in ``research.experiments``), the
label is coded (0, C_Y): gram and local rows are [x, C_Y y] with R_X = C_Y = 1/sqrt(2); sketch rows
are [x, C_Y y, 1/2] with R_X = C_Y = 1/2 (the constant column gives the intercept: a sketch release
has no row sum). So no row is clipped again by the client.

Data: synthetic x ~ N(0, Sigma) in d = 10 (a fixed random Sigma), y ~ Bernoulli(sigmoid(x.w + b)),
b = -1 (about 30 % positive), a fixed w (the non-private model's test AUC is 0.83), 10^5 test rows;
real data from scikit-learn (no download): breast cancer (569 x 30) and digits (1,797 x 64, label
"digit >= 5"), columns standardised on the training split, 5 random 80/20 splits.

``main()`` (``python -m research.logistic_evaluation`` or ``dpsketch experiments --logistic``) writes
``docs/experiments/logistic_results.md``, ``logistic_results.json`` and ``logistic_auc.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.special import expit

from dpsketch.protocol.study import Study, design

from dpsketch.analyzer import simulation
from dpsketch.analyzer.analyses.logistic import LogisticRegression

from . import report

SERVERS = ["s1", "s2"]
DELTA = 1e-6
ROW_BOUND = 1.0
D = 10
TEST_ROWS = 100_000
CLIP_QUANTILE = 0.99
#: (feature radius R_X, label code C_Y, constant column or None) per layout
LAYOUTS = {"gram": (math.sqrt(0.5), math.sqrt(0.5), None), "sketch": (0.5, 0.5, 0.5)}
MECHANISMS = ("nonprivate", "ltm_gram", "ltm_sketch", "local", "diffprivlib")
LABELS = {"nonprivate": "non-private (sklearn)", "ltm_gram": "LTM gram", "ltm_sketch": "LTM sketch",
          "local": "local model", "diffprivlib": "diffprivlib (central, pure eps)"}
STYLE = {"nonprivate": ("k", "--", "o"), "ltm_gram": ("tab:blue", "-", "s"), "ltm_sketch": ("tab:orange", "-", "^"),
         "local": ("tab:red", ":", "v"), "diffprivlib": ("tab:green", "-.", "D")}


# ---------------------------------------------------------------------------------------------
# diffprivlib (evaluation extra only)


def diffprivlib_logistic():
    """diffprivlib's LogisticRegression class, made importable on current scikit-learn.

    diffprivlib 0.6.6 (the newest release) imports ``DOUBLE`` and ``DTYPE`` from
    ``sklearn.tree._tree`` (for its forests, gone from scikit-learn >= 1.8) and passes
    ``multi_class='ovr'`` to scikit-learn's LogisticRegression (removed in 1.8; binary problems are
    what 'ovr' did anyway). The shim restores the two dtype names and drops that one argument; the
    objective perturbation code is untouched.
    """
    import sklearn.tree._tree as tree
    from sklearn import linear_model

    for name, dtype in (("DOUBLE", np.float64), ("DTYPE", np.float32)):
        if not hasattr(tree, name):
            setattr(tree, name, dtype)
    import diffprivlib.models.logistic_regression as dlr
    from diffprivlib.accountant import BudgetAccountant

    cls = dlr.LogisticRegression
    if ("multi_class" not in inspect.signature(linear_model.LogisticRegression.__init__).parameters
            and not getattr(cls, "_dpsketch_shim", False)):
        def __init__(self, *, epsilon=1.0, data_norm=None, tol=1e-4, C=1.0, fit_intercept=True, max_iter=100,
                     verbose=0, warm_start=False, n_jobs=None, random_state=None, accountant=None, **unused_args):
            linear_model.LogisticRegression.__init__(
                self, C=C, dual=False, tol=tol, fit_intercept=fit_intercept, intercept_scaling=1.0,
                class_weight=None, random_state=random_state, solver="lbfgs", max_iter=max_iter,
                verbose=verbose, warm_start=warm_start, n_jobs=n_jobs)
            self.epsilon = epsilon
            self.data_norm = data_norm
            self.classes_ = None
            self.accountant = BudgetAccountant.load_default(accountant)
            self._warn_unused_args(unused_args)

        cls.__init__ = __init__
        cls._dpsketch_shim = True
    return cls


# ---------------------------------------------------------------------------------------------
# data


def synthetic(n: int, seed: int, d: int = D, test_rows: int = TEST_ROWS) -> dict[str, np.ndarray]:
    """Training (n rows) and test rows of the synthetic logistic model; the model is fixed."""
    model_rng = np.random.default_rng(20_251_111)
    a = model_rng.normal(size=(d, d)) / math.sqrt(d)
    chol = np.linalg.cholesky(a @ a.T + 0.5 * np.eye(d))
    w = np.linspace(1.0, -0.5, d) * 0.9
    rng = np.random.default_rng([n, seed, 7])
    x = rng.normal(size=(n + test_rows, d)) @ chol.T
    y = (rng.uniform(size=n + test_rows) < expit(x @ w - 1.0)).astype(float)
    return {"x": x[:n], "y": y[:n], "x_test": x[n:], "y_test": y[n:]}


def real_datasets() -> list[tuple[str, np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_breast_cancer, load_digits

    bc = load_breast_cancer()
    dg = load_digits()
    return [("breast_cancer", bc.data, bc.target.astype(float)),
            ("digits>=5", dg.data, (dg.target >= 5).astype(float))]


def real_split(x: np.ndarray, y: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """A random 80/20 split, columns standardised with the training split's mean and std."""
    rng = np.random.default_rng([seed, 11])
    idx = rng.permutation(len(y))
    cut = int(0.8 * len(y))
    tr, te = idx[:cut], idx[cut:]
    mu, sd = x[tr].mean(axis=0), x[tr].std(axis=0)
    sd[sd == 0] = 1.0
    return {"x": (x[tr] - mu) / sd, "y": y[tr], "x_test": (x[te] - mu) / sd, "y_test": y[te]}


def feature_scale(x: np.ndarray, radius: float) -> float:
    """The factor that puts the CLIP_QUANTILE quantile of the feature norms at ``radius``."""
    return radius / max(float(np.quantile(np.linalg.norm(x, axis=1), CLIP_QUANTILE)), 1e-12)


def scaled(x: np.ndarray, factor: float, radius: float) -> np.ndarray:
    return simulation.clip_rows(x * factor, radius)


def layout_rows(x: np.ndarray, y: np.ndarray, kind: str, factor: float) -> tuple[np.ndarray, list[str]]:
    """The study rows of a layout and their column names (features, label, constant)."""
    r_x, c_y, const = LAYOUTS[kind]
    cols = [f"x{i}" for i in range(x.shape[1])] + ["y"]
    parts = [scaled(x, factor, r_x), (c_y * y)[:, None]]
    if const is not None:
        parts.append(np.full((len(y), 1), const))
        cols.append("const")
    return np.hstack(parts), cols


# ---------------------------------------------------------------------------------------------
# metrics and one case


def metrics(y: np.ndarray, z: np.ndarray) -> dict[str, float]:
    """Accuracy, AUC and mean log-loss of decision values z (log-odds) for 0/1 labels y."""
    from sklearn.metrics import roc_auc_score

    z = np.asarray(z, dtype=np.float64)
    return {"accuracy": float(np.mean((z > 0) == (y > 0.5))),
            "auc": float(roc_auc_score(y, z)),
            "log_loss": float(np.mean(np.logaddexp(0.0, -(2 * y - 1) * z)))}


def design_study(columns: list[str], n: int, epsilon: float, kind: str, seed: Any) -> Study:
    study, _ = design(name="logistic-evaluation", columns=columns, label="y", servers=SERVERS,
                      expected_reports=n, epsilon=epsilon, delta=DELTA, row_bound=ROW_BOUND, kind=kind,
                      seed=hashlib.sha256(f"dpsketch-logistic/{seed}".encode()).hexdigest())
    return study


def fit_ltm(kind: str, data: dict[str, np.ndarray], epsilon: float, rng: np.random.Generator,
            factor: float) -> tuple[LogisticRegression, float]:
    """Simulate the study kind's release of the training rows and fit the estimator on it."""
    rows, cols = layout_rows(data["x"], data["y"], kind, factor)
    study = design_study(cols, len(rows), epsilon, kind, (kind, len(rows), epsilon))
    release = simulation.simulate_ltm(study, rows, rng)
    c_y = LAYOUTS[kind][1]
    model = LogisticRegression("y", classes=(0.0, c_y),
                               intercept_column="const" if kind == "sketch" else None).fit(release)
    return model, LAYOUTS[kind][0]


def fit_local(data: dict[str, np.ndarray], epsilon: float, rng: np.random.Generator,
              factor: float) -> tuple[LogisticRegression, float]:
    rows, cols = layout_rows(data["x"], data["y"], "gram", factor)
    study = design_study(cols, len(rows), epsilon, "gram", ("local", len(rows), epsilon))
    rel = simulation.simulate_local(study, rows, rng)
    model = LogisticRegression("y", classes=(0.0, LAYOUTS["gram"][1])).fit(
        rel.gram(debias=True), columns=cols, n_reports=rel.n_reports, row_sum=rel.noisy_rows.sum(axis=0),
        noise_scale=rel.gram_noise_scale)
    return model, LAYOUTS["gram"][0]


def run_case(data: dict[str, np.ndarray], epsilons: Sequence[float], seed: int,
             mechanisms: Sequence[str] = MECHANISMS) -> list[dict[str, Any]]:
    """Every mechanism on one train/test split, for each epsilon; one record per (epsilon, mechanism)."""
    from sklearn.linear_model import LogisticRegression as SkLogistic

    n = len(data["y"])
    out: list[dict[str, Any]] = []
    factors = {r: feature_scale(data["x"], r) for r in {v[0] for v in LAYOUTS.values()} | {ROW_BOUND}}

    def score(model, radius: float) -> dict[str, float]:
        return metrics(data["y_test"], model.decision_function(scaled(data["x_test"], factors[radius], radius)))

    if "nonprivate" in mechanisms:
        t0 = time.perf_counter()
        r = LAYOUTS["gram"][0]
        sk = SkLogistic(max_iter=2000).fit(scaled(data["x"], factors[r], r), data["y"])
        for eps in epsilons:
            out.append({"mechanism": "nonprivate", "epsilon": eps, **score(sk, r),
                        "seconds": round(time.perf_counter() - t0, 3)})
    for eps in epsilons:
        rng = np.random.default_rng([n, seed, int(round(eps * 1000)), 3])
        for mech in mechanisms:
            if mech == "nonprivate":
                continue
            t0 = time.perf_counter()
            note = None
            try:
                if mech in ("ltm_gram", "ltm_sketch"):
                    model, radius = fit_ltm(mech[4:], data, eps, rng, factors[LAYOUTS[mech[4:]][0]])
                    note = getattr(model, "calibration_", None)
                elif mech == "local":
                    model, radius = fit_local(data, eps, rng, factors[LAYOUTS["gram"][0]])
                elif mech == "diffprivlib":
                    cls = diffprivlib_logistic()
                    from diffprivlib.accountant import BudgetAccountant

                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        model = cls(epsilon=eps, data_norm=ROW_BOUND, random_state=int(rng.integers(2**31)),
                                    accountant=BudgetAccountant()).fit(
                            scaled(data["x"], factors[ROW_BOUND], ROW_BOUND), data["y"])
                    radius = ROW_BOUND
                else:
                    raise ValueError(f"unknown mechanism {mech!r}")
                rec = score(model, radius)
            except ValueError as exc:  # e.g. a sketch study n cannot support
                rec = {"accuracy": float("nan"), "auc": float("nan"), "log_loss": float("nan")}
                note = f"refused: {exc}"
            out.append({"mechanism": mech, "epsilon": eps, **rec, "note": note,
                        "seconds": round(time.perf_counter() - t0, 3)})
    for r in out:
        r.update(n=n, seed=seed)
    return out


# ---------------------------------------------------------------------------------------------
# summaries, table, plot


def summarize(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    out = {}
    for key, rs in report.group(records, "dataset", "n", "epsilon", "mechanism").items():
        s: dict[str, Any] = {"runs": len(rs)}
        for m in ("accuracy", "auc", "log_loss"):
            v = np.array([r[m] for r in rs], dtype=float)
            st = report.stats(v[np.isfinite(v)])
            s[m], s[m + "_std"], s[m + "_median"], s[m + "_p90"] = st["mean"], st["sd"], st["median"], st["p90"]
        out[key] = s
    return out


def _cell(s: dict | None, metric: str) -> str:
    """mean ± sd (median), p90 (``report.cell``), 3 decimals as before."""
    if s is None or not np.isfinite(s[metric]):
        return "-"
    if s["runs"] < 2:
        return f"{s[metric]:.3f}"
    return (f"{s[metric]:.3f} ± {s[metric + '_std']:.3f} ({s[metric + '_median']:.3f}), "
            f"p90 {s[metric + '_p90']:.3f}")


def table(summary: dict, dataset: str, metric: str, epsilons: Sequence[float]) -> str:
    ns = sorted({k[1] for k in summary if k[0] == dataset})
    lines = ["| n | epsilon | " + " | ".join(LABELS[m] for m in MECHANISMS) + " |",
             "|---|---|" + "---|" * len(MECHANISMS)]
    for n in ns:
        for eps in epsilons:
            if not any((dataset, n, eps, m) in summary for m in MECHANISMS):
                continue
            lines.append(f"| {n:,} | {eps:g} | " + " | ".join(_cell(summary.get((dataset, n, eps, m)), metric)
                                                           for m in MECHANISMS) + " |")
    return "\n".join(lines)


def target(summary: dict) -> dict[str, Any]:
    """The issue's target at n = 10^5, d = 10, epsilon = 1 (synthetic)."""
    get = lambda m: summary.get(("synthetic", 100_000, 1.0, m))  # noqa: E731
    g, npv, dpl = get("ltm_gram"), get("nonprivate"), get("diffprivlib")
    if not (g and npv and dpl):
        return {}
    gap = npv["auc"] - g["auc"]
    return {"gram_auc": g["auc"], "nonprivate_auc": npv["auc"], "diffprivlib_auc": dpl["auc"],
            "gap": gap, "within_0.01": bool(gap <= 0.01), "not_worse_than_diffprivlib": bool(g["auc"] >= dpl["auc"]),
            "gram_log_loss": g["log_loss"], "nonprivate_log_loss": npv["log_loss"],
            "diffprivlib_log_loss": dpl["log_loss"], "runs": g["runs"]}


def plot(summary: dict, epsilons: Sequence[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted({k[1] for k in summary if k[0] == "synthetic"})
    fig, axes = plt.subplots(2, len(epsilons), figsize=(5.2 * len(epsilons), 8.2), squeeze=False)
    for j, eps in enumerate(epsilons):
        for i, metric in enumerate(("auc", "log_loss")):
            ax = axes[i][j]
            for m in MECHANISMS:
                pts = [(n, summary[("synthetic", n, eps, m)]) for n in ns if ("synthetic", n, eps, m) in summary]
                pts = [(n, s) for n, s in pts if np.isfinite(s[metric])]
                if not pts:
                    continue
                color, ls, marker = STYLE[m]
                ax.errorbar([n for n, _ in pts], [s[metric] for _, s in pts],
                            yerr=[s[metric + "_std"] for _, s in pts], color=color, ls=ls, marker=marker,
                            label=LABELS[m], capsize=3, lw=1.6, ms=6)
            ax.set_xscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("n (training rows)")
            if metric == "auc":
                ax.set_title(f"epsilon = {eps:g}, delta = 1e-6 (diffprivlib: delta = 0)", fontsize=10)
                ax.set_ylabel("test AUC (higher is better)")
                ax.axhline(0.5, color="grey", lw=0.8)
                ax.set_ylim(0.4, 0.86)
            else:
                ax.set_ylabel("test log-loss (lower is better; clipped at 1)")
                ax.set_ylim(0.45, 1.0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=10, frameon=False)
    fig.suptitle("Logistic regression, synthetic data, d = 10: held-out AUC and log-loss (mean ± std over runs)",
                 fontsize=12)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def results_markdown(summary: dict, records: list[dict[str, Any]], epsilons: Sequence[float], seconds: float,
                     argv: Sequence[str]) -> str:
    t = target(summary)
    lines = ["# Logistic regression: measured results", "",
             report.generated_by("dpsketch experiments --logistic", argv, seconds,
                                 "research/logistic_evaluation.py") + " Mean ± std over runs.", ""]
    if t:
        lines += ["## Target: n = 10^5, d = 10, epsilon = 1 (synthetic)", "",
                  "| | LTM gram | non-private | diffprivlib |", "|---|---|---|---|",
                  f"| test AUC | {t['gram_auc']:.4f} | {t['nonprivate_auc']:.4f} | {t['diffprivlib_auc']:.4f} |",
                  f"| test log-loss | {t['gram_log_loss']:.4f} | {t['nonprivate_log_loss']:.4f} | "
                  f"{t['diffprivlib_log_loss']:.4f} |", "",
                  f"AUC gap to non-private: {t['gap']:.5f} (target <= 0.01: "
                  f"{'met' if t['within_0.01'] else 'missed'}); not worse than diffprivlib: "
                  f"{'met' if t['not_worse_than_diffprivlib'] else 'missed'} (gram - diffprivlib = "
                  f"{t['gram_auc'] - t['diffprivlib_auc']:+.5f}; {t['runs']} runs).", ""]
    datasets = sorted({k[0] for k in summary}, key=lambda s: (s != "synthetic", s))
    for ds in datasets:
        for metric, name in (("auc", "test AUC"), ("accuracy", "test accuracy"), ("log_loss", "test log-loss")):
            lines += [f"## {ds}: {name}", "", table(summary, ds, metric, epsilons), ""]
    refused = sorted({(r["dataset"], r["n"], r["epsilon"], r["mechanism"], r["note"]) for r in records
                      if r.get("note") and str(r["note"]).startswith("refused")})
    if refused:
        lines += ["## Refused cases", ""] + [f"* {d} n={n} eps={e:g} {m}: {note}" for d, n, e, m, note in refused] + [""]
    cal = [r for r in records if r["mechanism"].startswith("ltm") or r["mechanism"] == "local"]
    fallback = sum(1 for r in cal if r.get("note") == "taylor")
    lines += [f"Calibration: {len(cal) - fallback} of {len(cal)} private fits used the Gaussian calibration; "
              f"{fallback} fell back to the Taylor scale (noisy within-class variance not positive).", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpsketch experiments --logistic",
                                description="Logistic regression: LTM gram and sketch kinds against non-private "
                                "sklearn, the local model and diffprivlib (central, objective perturbation).")
    report.add_grid_arguments(p, n="training rows (default: 1e4 1e5 1e6)", epsilons="default: 0.5 1 4",
                              seeds="runs per n (default 5; 3 at n >= 10^6; --quick 1)",
                              quick="bounded: n 1e4 1e5, epsilon 1, one run",
                              from_json="re-draw the plot and tables from a previous run's JSON")
    p.add_argument("--real-seeds", type=int, default=None, help="splits per real data set (default 5)")
    p.add_argument("--no-real-data", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    run = report.grid(args, seeds=5)
    ns, epsilons, seeds = run.ns, run.epsilons, run.seeds
    real_seeds = args.real_seeds if args.real_seeds is not None else (1 if args.quick else 5)
    if (saved := report.saved_run(args)) is not None:
        return write_outputs(saved["records"], saved["epsilons"], saved["seconds"], saved["argv"], args.out)
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []

    def add(rs: list[dict[str, Any]], dataset: str) -> None:
        for r in rs:
            r["dataset"] = dataset
        records.extend(rs)
        best = {(r["epsilon"], r["mechanism"]): r["auc"] for r in rs}
        print(f"[{time.perf_counter() - t0:6.0f}s] {dataset} n={rs[0]['n']} seed={rs[0]['seed']}: " +
              ", ".join(f"{m}@{e:g} {v:.4f}" for (e, m), v in best.items()), file=sys.stderr, flush=True)

    for n in ns:
        for seed in range(min(seeds, 3) if n >= 1_000_000 and args.seeds is None else seeds):
            add(run_case(synthetic(n, seed), epsilons, seed), "synthetic")
    if not args.no_real_data:
        for name, x, y in real_datasets():
            for seed in range(real_seeds):
                add(run_case(real_split(x, y, seed), epsilons, seed), name)
    seconds = time.perf_counter() - t0
    report.save_run(args.out, "logistic_results.json", {
        "argv": argv, "seconds": round(seconds, 1), "epsilons": epsilons, "delta": DELTA,
        "target": target(summarize(records)), "records": records})
    return write_outputs(records, epsilons, seconds, argv, args.out)


def write_outputs(records: list[dict[str, Any]], epsilons: Sequence[float], seconds: float, argv: Sequence[str],
                  out: str) -> int:
    summary = summarize(records)
    plot(summary, epsilons, os.path.join(out, "logistic_auc.png"))
    return report.publish(out, "logistic_results.md", results_markdown(summary, records, epsilons, seconds, argv))


if __name__ == "__main__":
    raise SystemExit(main())
