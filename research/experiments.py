"""``dpsketch experiments``: the figures and tables of paper 000, section 5, on the real code paths.

Reproduce everything in ``docs/experiments/`` (plots, ``results.md``, ``results.json``) with one
command from the repository root (needs the ``experiments`` extra: matplotlib, scikit-learn and,
for the larger real data sets, statsmodels)::

    # what docs/accuracy.md shows: 20 runs per cell, LTM releases drawn in law (see results.md for the time)
    nice -n 10 .venv/bin/dpsketch experiments --ltm simulate --seeds 20 --real-seeds 20 --jobs 2
    .venv/bin/dpsketch experiments --jobs 2        # the real client/server code, 3 seeds
    .venv/bin/dpsketch experiments --quick --out /tmp/x   # bounded form (< 60 s), used by the tests

Tables give mean ± sample sd (median) over the runs; ``--from-json results.json`` re-draws them
(``--refresh-predicted`` recomputes the predicted sketch floor with this checkout's formula).

What runs, for every (task, n, epsilon, seed) and both study kinds (``sketch``, ``gram``):

1. **study**: :func:`dpsketch.protocol.study.design` with servers s1, s2, delta = 1e-6,
   replace-one, B = 1 and the defaults for k, s, lambda_star, the floor (epsilon_floor =
   max(4, epsilon): client noise sigma and server noise server_sigma) and the ring encoding;
2. **client path**: :func:`client_sdk.client.prepare_batch` on chunks of ``--chunk`` rows: clip,
   the study kind's feature map, CSPRNG Gaussian noise, fixed-point ring encoding, additive shares
   and fresh random report ids. It cannot be seeded (it must not be), so LTM figures are mean +- sd
   over repeated runs (with ``--ltm simulate`` steps 2-3 are drawn in law instead:
   :func:`simulate_pipeline`, the same study, the protocol hash, numpy noise and the certificate
   on the same S, seeded);
3. **server path**, once per server on its own share only: :func:`sketch.hash_report_ids`,
   :func:`sketch.accumulate` into a ``study.aggregate_shape`` uint64 aggregate and
   :func:`sketch.accumulate_gram` into s * S S^T, then the release certificate
   :func:`privacy.certify` and the minimum report count, as ``services/store.py`` checks before
   it releases (a refusal is reported, not hidden), then the server's own noise
   (:meth:`Study.server_noise`, the function ``services/store.py`` adds at commit);
4. **analyzer path**: the N aggregates added in uint64 (mod 2^64),
   :func:`analyzer.release.release_from_ring_sum`, then :class:`~analyzer.estimators.RidgeRegression`
   / :class:`~analyzer.estimators.PCA` and the error ratios of :mod:`research.evaluation`, with
   the evaluation's ridge penalty ``default_alpha(n, B)`` for every mechanism (as ``fit_ratios``).

This is the same code the HTTP services run, called in process (no sockets, no SQLite). The local
and central baselines (:func:`simulation.simulate_local`, :func:`simulation.simulate_central`) and
the central-model regression baselines AdaSSP, DGM-OLS and RMGM-OLS
(:func:`evaluation.central_baselines`) are numpy-seeded simulations at the same (epsilon, delta),
B and neighbouring notion.

Data: :func:`analyzer.synthetic.regression_data` (d = 10 features + label) for ridge and
:func:`analyzer.synthetic.lowrank_data` (d = 10, rank 3) for PCA, rows scaled so the 0.99
quantile of the norms is B and clipped. Real data shipped inside installed packages:
scikit-learn's diabetes, wine, breast cancer and digits, and (if statsmodels is installed)
statsmodels' RAND health insurance (randhie) and Fair's affairs data; columns standardised, rows
scaled and clipped the same way.
"""

from __future__ import annotations

import argparse
import importlib
import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpsketch.protocol import privacy, sketch
from dpsketch.protocol.study import Study, design

from dpsketch.analyzer import error_ratios, simulation, synthetic
from dpsketch.analyzer.release import SketchRelease, release_from_ring_sum

from . import evaluation, report, sketch_floor

SERVERS = ["s1", "s2"]
DELTA = 1e-6
ROW_BOUND = 1.0
CLIP_QUANTILE = 0.99
D = 10
PCA_RANK = synthetic.DEFAULT_RANK
DEFAULT_NS = (1_000, 10_000, 100_000, 1_000_000)
DEFAULT_EPSILONS = (0.5, 1.0, 4.0)
QUICK_NS = (1_000, 10_000, 100_000)
QUICK_EPSILONS = (1.0,)
CHUNK_ROWS = 100_000

KINDS = ("sketch", "gram")
#: Mechanisms in plots and tables: (key, label). ``ltm_*`` are the real pipeline.
LTM_MECHANISMS = [("local", "local"), ("local_sign", "local (secret sign)"), ("ltm_sketch", "LTM sketch"),
                  ("ltm_gram", "LTM Gram"), ("central", "central")]
#: Central-model regression baselines of ``evaluation.central_baselines``, added to ridge when
#: available (hook: any name of ``evaluation.RIDGE_BASELINES`` can be listed here).
EXTRA_RIDGE = [("adassp", "AdaSSP"), ("dgm_ols", "DGM-OLS"), ("rmgm_ols", "RMGM-OLS")]


def extra_ridge_available() -> list[tuple[str, str]]:
    """The extra ridge baselines this checkout has (the hook stays empty without them)."""
    known = set(getattr(evaluation, "RIDGE_BASELINES", ()))
    if not hasattr(evaluation, "central_baselines"):
        return []
    return [(k, v) for k, v in EXTRA_RIDGE if k in known]


# ---------------------------------------------------------------------------------------------
# the pipeline: client -> N servers -> analyzer, in process


class Refused(Exception):
    """A study that cannot be designed for this n, or a server that refuses to release."""


@dataclass
class PipelineRun:
    release: Any
    study: Study
    client_s: float
    server_s: float
    lambda_min: float


def run_pipeline(study: Study, rows: np.ndarray, chunk_rows: int = CHUNK_ROWS) -> PipelineRun:
    """Rows -> ``prepare_batch`` -> per-server sketch aggregation + certificate -> release."""
    from dpsketch.client_sdk.client import prepare_batch

    n_servers = study.n_servers
    aggregates = [np.zeros(study.aggregate_shape, dtype=np.uint64) for _ in range(n_servers)]
    sst = [np.zeros((study.k, study.k), dtype=np.int64) for _ in range(n_servers)]
    client_s = server_s = 0.0
    n = 0
    for start in range(0, rows.shape[0], chunk_rows):
        t0 = time.perf_counter()
        batch = prepare_batch(study, rows[start : start + chunk_rows])
        t1 = time.perf_counter()
        for j in range(n_servers):  # each server on its own share, hashing the ids itself
            idx, signs = sketch.hash_report_ids(study.seed_bytes, batch.report_ids, study.k, study.s)
            sketch.accumulate(aggregates[j], idx, signs, batch.share(j))
            sketch.accumulate_gram(sst[j], idx, signs, +1)
        client_s += t1 - t0
        server_s += time.perf_counter() - t1
        n += len(batch)
    t0 = time.perf_counter()
    lam = math.inf
    for j in range(n_servers):
        if n < study.min_reports:
            raise Refused(f"server {study.servers[j]}: {n} reports < min_reports {study.min_reports}")
        cert = privacy.certify(sst[j], study.s, n, study.t, study.lambda_star)
        if not cert.ok:
            raise Refused(
                f"server {study.servers[j]}: certificate refused (lambda_min {cert.lambda_min:.4g} "
                f"< lambda_star {study.lambda_star:.4g})"
            )
        lam = min(lam, cert.lambda_min)
    server_s += time.perf_counter() - t0
    ring_sum = np.zeros(study.aggregate_shape, dtype=np.uint64)
    for agg in aggregates:
        ring_sum += agg + study.server_noise()  # wraps mod 2^64: the shares cancel; each server's noise
    return PipelineRun(release_from_ring_sum(study, ring_sum, n), study, client_s, server_s, lam)


def study_seed(*parts: Any) -> str:
    return hashlib.sha256("/".join(["dpsketch-experiments", *map(str, parts)]).encode()).hexdigest()


def design_study(columns: list[str], label: str | None, n: int, epsilon: float, kind: str,
                 seed_parts: Sequence[Any], secret_sign: bool | None = None, k: int | None = None) -> Study:
    """design()'s study for these columns and n (its defaults: a sketch study is signed; ``k``
    None: its default k)."""
    try:
        study, _ = design(
            name="experiments", columns=columns, label=label, servers=SERVERS, expected_reports=n,
            epsilon=epsilon, delta=DELTA, row_bound=ROW_BOUND, kind=kind,
            seed=study_seed(*seed_parts, kind), secret_sign=secret_sign, k=k,
        )
    except ValueError as exc:
        raise Refused(f"n too small: {exc}") from exc
    return study


# ---------------------------------------------------------------------------------------------
# one case: a data set at one epsilon and seed, every mechanism on the same rows


def simulate_pipeline(study: Study, rows: np.ndarray, rng: np.random.Generator) -> PipelineRun:
    """The release :func:`run_pipeline` makes, drawn in law instead of computed through the SDK
    and the ring: :func:`simulation.simulate_ltm` (the study as designed, the protocol hash over
    random report ids, numpy Gaussian noise at the study's sigma and the N servers' noise), plus
    the servers' certificate on S S^T of the same ids (a refusal raises :class:`Refused`). The
    SDK's fixed-point rounding (2^-f) and 20-sigma redraw are left out; they change no figure at
    the precision shown. About 10x faster at n = 10^6, which is what makes 20 runs per cell
    affordable; ``--ltm pipeline`` keeps the real code path."""
    t0 = time.perf_counter()
    n = rows.shape[0]
    if n < study.min_reports:
        raise Refused(f"{n} reports < min_reports {study.min_reports}")
    if study.kind == "gram":  # the plain sum: S S^T = n exactly
        return PipelineRun(simulation.simulate_ltm(study, rows, rng), study, time.perf_counter() - t0, 0.0,
                           float(n))
    ids = simulation.random_report_ids(n, rng)
    s_mat = simulation.sketch_matrix(study, ids)
    if study.secret_sign:  # each client signs its clipped row before its noise (client_sdk/prepare.py)
        rows = rows * simulation.secret_signs(rng, n)[:, None]
    noisy = rows + simulation._truncated_normal(rng, study.sigma, rows.shape) if study.sigma > 0 else rows
    y = np.asarray(s_mat @ noisy)
    if study.server_sigma > 0:
        y = y + rng.normal(0.0, math.sqrt(simulation.server_noise_variance(study)), size=y.shape)
    release = SketchRelease(study=study, sketch=y, n_reports=n)
    lam = float(np.linalg.eigvalsh((s_mat @ s_mat.T).toarray())[0])
    if lam - study.t < study.lambda_star:
        raise Refused(f"certificate refused (lambda_min {lam:.4g} < lambda_star {study.lambda_star:.4g})")
    return PipelineRun(release, study, time.perf_counter() - t0, 0.0, lam)


def run_case(task: str, rows: np.ndarray, columns: list[str], label: str | None, epsilon: float,
             seed: int, tag: str, *, rank: int = PCA_RANK, extras: Sequence[str] = (),
             chunk_rows: int = CHUNK_ROWS, simulate: bool = False) -> dict[str, Any]:
    """Ratios of every mechanism for one task on (already scaled and clipped) rows; with
    ``simulate`` the LTM releases come from :func:`simulate_pipeline` (seeded) instead of the
    real client and server code."""
    n = rows.shape[0]
    releases: dict[str, Any] = {}
    notes: dict[str, str] = {}
    info: dict[str, Any] = {}
    gram_study = None
    rng = np.random.default_rng(np.random.SeedSequence(
        [0xE7, int(hashlib.sha256(f"{tag}/{task}".encode()).hexdigest()[:8], 16), n, seed,
         int(round(epsilon * 1000))]))
    for kind in KINDS:
        key = f"ltm_{kind}"
        try:
            study = design_study(columns, label, n, epsilon, kind, (tag, task, n, epsilon, seed))
            if kind == "gram":
                gram_study = study
            run = simulate_pipeline(study, rows, rng) if simulate else run_pipeline(study, rows, chunk_rows)
        except Refused as exc:
            notes[key] = str(exc)
            continue
        releases[key] = run.release
        info[key] = {"k": study.k, "s": study.s, "sigma": study.sigma, "server_sigma": study.server_sigma,
                     "n_servers": study.n_servers, "lambda_star": study.lambda_star,
                     "lambda_min": run.lambda_min, "width": study.width,
                     "client_s": round(run.client_s, 3), "server_s": round(run.server_s, 3)}
    if gram_study is None:  # the plain sum exists for any n >= 2; needed for the baselines' study
        gram_study = design_study(columns, label, n, epsilon, "gram", (tag, task, n, epsilon, seed))
    releases["local"] = simulation.simulate_local(gram_study, rows, rng)
    if gram_study.neighbouring == "replace-one":
        releases["local_sign"] = simulation.simulate_local(gram_study, rows, rng, secret_sign=True)
    releases["central"] = simulation.simulate_central(gram_study, rows, rng)
    alpha = error_ratios.default_alpha(n, ROW_BOUND)
    ratios = error_ratios.fit_ratios(
        releases, rows, list(columns), label=label if task == "ridge" else None,
        rank=rank if task == "pca" else None, alpha=alpha, debias=True,
    )[task]
    if task == "ridge" and extras:
        more = evaluation.central_baselines(
            rows, columns=list(columns), epsilon=epsilon, delta=DELTA, row_bound=ROW_BOUND,
            label=label, alpha=alpha, rng=rng, tasks=("ridge",), mechanisms=list(extras),
        )["ridge"]
        ratios.update(more)
    return {"ratios": {k: float(v) for k, v in ratios.items()}, "notes": notes, "info": info,
            "ltm": "simulated" if simulate else "pipeline"}


# ---------------------------------------------------------------------------------------------
# synthetic cases (module-level so a process pool can run them)


def synthetic_case(task: str, n: int, epsilon: float, seed: int, extras: Sequence[str],
                   chunk_rows: int, simulate: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    if task == "ridge":
        data = synthetic.regression_data(n, D, seed=seed, clip_quantile=CLIP_QUANTILE, row_bound=ROW_BOUND)
    else:
        data = synthetic.lowrank_data(n, D, rank=PCA_RANK, seed=seed, clip_quantile=CLIP_QUANTILE,
                                      row_bound=ROW_BOUND)
    out = run_case(task, data.rows, list(data.columns), data.label, epsilon, seed, "synthetic",
                   rank=PCA_RANK, extras=extras if task == "ridge" else (), chunk_rows=chunk_rows,
                   simulate=simulate)
    if task == "ridge":
        out["predicted_sketch_excess"] = predicted_sketch_excess(data, epsilon, out["info"].get("ltm_sketch"))
    out.update(task=task, dataset="synthetic", n=n, epsilon=epsilon, seed=seed,
               seconds=round(time.perf_counter() - t0, 2))
    return out


def predicted_sketch_excess(data: synthetic.Dataset, epsilon: float, info: dict | None) -> float | None:
    """The sketch kind's predicted ridge excess (ratio - 1) for the study in ``info``:
    :func:`sketch_floor.ridge_floor` (sketch p/(k - p - 1) + noise x data + noise x noise), with
    the cell variance v = sigma^2 n / k + N server_sigma^2 of the study as designed and the
    evaluation's penalty."""
    if not info:
        return None
    li = data.columns.index(data.label)
    X, y = np.delete(data.rows, li, axis=1), data.rows[:, li]
    v = sketch_floor.cell_variance(info["sigma"], data.n, info["k"],
                                   info.get("n_servers", len(SERVERS)) * float(info.get("server_sigma", 0.0)) ** 2)
    return sketch_floor.ridge_floor(X, y, error_ratios.default_alpha(data.n, ROW_BOUND), info["k"], v).excess


def refresh_predicted(records: list[dict[str, Any]]) -> None:
    """Recompute ``predicted_sketch_excess`` of saved synthetic ridge records (the data are
    regenerated from their seeds)."""
    for r in records:
        if r["dataset"] == "synthetic" and r["task"] == "ridge":
            data = synthetic.regression_data(r["n"], D, seed=r["seed"], clip_quantile=CLIP_QUANTILE,
                                             row_bound=ROW_BOUND)
            r["predicted_sketch_excess"] = predicted_sketch_excess(data, r["epsilon"], r["info"].get("ltm_sketch"))


# ---------------------------------------------------------------------------------------------
# real data shipped inside installed packages


@dataclass
class RealData:
    name: str
    source: str
    task: str
    rows: np.ndarray
    columns: list[str]
    label: str | None


def prepare_real(x: np.ndarray) -> np.ndarray:
    """Standardise columns (constant columns stay 0), scale rows so the 0.99 quantile of the
    norms is B, clip the rest to B: how a data owner would pick B."""
    x = np.asarray(x, dtype=np.float64)
    mu, sd = x.mean(axis=0), x.std(axis=0)
    z = (x - mu) / np.where(sd > 0, sd, 1.0)
    norms = np.linalg.norm(z, axis=1)
    c = ROW_BOUND / float(np.quantile(norms, CLIP_QUANTILE))
    return simulation.clip_rows(z * c, ROW_BOUND)


def _names(prefix: str, k: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(k)]


def real_datasets(quick: bool = False) -> list[RealData]:
    """Every real data set available in this environment (scikit-learn; statsmodels if present)."""
    out: list[RealData] = []
    try:
        from sklearn import datasets as skd
    except ImportError:  # pragma: no cover - the experiments extra installs it
        print("experiments: scikit-learn not installed, no real data", file=sys.stderr)
        return out
    diab = skd.load_diabetes()
    xy = np.column_stack([diab.data, diab.target])
    out.append(RealData("diabetes", "sklearn.datasets.load_diabetes", "ridge", prepare_real(xy),
                        _names("x", diab.data.shape[1]) + ["y"], "y"))
    out.append(RealData("diabetes", "sklearn.datasets.load_diabetes", "pca", prepare_real(diab.data),
                        _names("x", diab.data.shape[1]), None))
    if quick:
        return out
    for name, loader in (("wine", "load_wine"), ("breast_cancer", "load_breast_cancer"), ("digits", "load_digits")):
        x = getattr(skd, loader)().data
        out.append(RealData(name, f"sklearn.datasets.{loader}", "pca", prepare_real(x),
                            _names("x", x.shape[1]), None))
    try:
        import statsmodels.api as sm
    except ImportError:
        print("experiments: statsmodels not installed, skipping randhie and fair", file=sys.stderr)
        return out
    for name in ("randhie", "fair"):
        ds = getattr(sm.datasets, name).load_pandas()
        y = np.asarray(ds.endog, dtype=np.float64).reshape(-1)
        x = np.asarray(ds.exog, dtype=np.float64)
        out.append(RealData(name, f"statsmodels.datasets.{name}", "ridge",
                            prepare_real(np.column_stack([x, y])), _names("x", x.shape[1]) + ["y"], "y"))
        if name == "randhie":
            out.append(RealData(name, f"statsmodels.datasets.{name}", "pca",
                                prepare_real(np.column_stack([x, y])), _names("x", x.shape[1] + 1), None))
    return out


def real_case(ds: RealData, epsilon: float, seed: int, extras: Sequence[str], chunk_rows: int,
              simulate: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = run_case(ds.task, ds.rows, ds.columns, ds.label, epsilon, seed, f"real/{ds.name}",
                   rank=PCA_RANK, extras=extras if ds.task == "ridge" else (), chunk_rows=chunk_rows,
                   simulate=simulate)
    out.update(task=ds.task, dataset=ds.name, source=ds.source, n=int(ds.rows.shape[0]),
               d=int(ds.rows.shape[1]), epsilon=epsilon, seed=seed,
               seconds=round(time.perf_counter() - t0, 2))
    return out


# ---------------------------------------------------------------------------------------------
# aggregation, tables, plots


def mechanisms_for(task: str, extras: Sequence[str]) -> list[tuple[str, str]]:
    mech = list(LTM_MECHANISMS)
    if task == "ridge":
        mech += [(k, v) for k, v in EXTRA_RIDGE if k in extras]
    return mech


def summarize(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(dataset, task, n, epsilon) -> {mechanism: (mean, sd, count, median) or note, "k": ...}.

    sd is the sample standard deviation (ddof = 1) over the runs."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["dataset"], r["task"], r["n"], r["epsilon"]), []).append(r)
    out: dict[tuple, dict[str, Any]] = {}
    for key, recs in groups.items():
        cell: dict[str, Any] = {"seeds": len(recs), "ratios": {}, "notes": {}, "k": None}
        mechs = sorted({m for r in recs for m in r["ratios"]} | {m for r in recs for m in r["notes"]})
        for m in mechs:
            vals = np.array([r["ratios"][m] for r in recs if m in r["ratios"]], dtype=np.float64)
            if vals.size:
                sd = float(vals.std(ddof=1)) if vals.size > 1 else 0.0
                cell["ratios"][m] = (float(vals.mean()), sd, int(vals.size), float(np.median(vals)))
            else:
                cell["notes"][m] = next(r["notes"][m] for r in recs if m in r["notes"])
        ks = [r["info"]["ltm_sketch"]["k"] for r in recs if "ltm_sketch" in r["info"]]
        cell["k"] = ks[0] if ks else None
        preds = [r.get("predicted_sketch_excess") for r in recs if r.get("predicted_sketch_excess") is not None]
        cell["predicted"] = float(np.mean(preds)) if preds else None
        out[key] = cell
    return out


def fmt(mean: float, std: float, count: int | None = None, median: float | None = None) -> str:
    """"mean ± sd (median)"; ratios within 1 % of optimal as 1 + excess."""
    def f(v: float) -> str:
        if v >= 100:
            return f"{v:.0f}"
        if v >= 10:
            return f"{v:.1f}"
        return f"{v:.3g}" if v < 1.1 else f"{v:.2f}"

    if mean < 1.01:  # close to optimal: show the excess, 1 + (ratio - 1)
        out = f"1 + {mean - 1:.1e} ± {std:.1e}"
        return out if median is None else out + f" ({median - 1:.1e})"
    out = f"{f(mean)} ± {std:.2g}"
    return out if median is None else out + f" ({f(median)})"


def short_note(note: str) -> str:
    if note.startswith("n too small"):
        return "n too small"
    if "certificate" in note:
        return "certificate refused"
    return note[:40]


def table(summary: dict, dataset_filter: Callable[[str], bool], task: str, extras: Sequence[str],
          real: bool = False) -> str:
    mechs = mechanisms_for(task, extras)
    head = ["data set", "n", "d"] if real else ["n", "k (sketch)"]
    head += ["epsilon"] + [label for _, label in mechs]
    if task == "ridge" and not real:
        head.append("predicted sketch floor")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted((k for k in summary if k[1] == task and dataset_filter(k[0])),
                  key=lambda k: (k[0], k[2], k[3]))
    for key in keys:
        dataset, _, n, eps = key
        cell = summary[key]
        row = [dataset, str(n), str(cell.get("d", ""))] if real else [f"{n:,}", str(cell["k"] or "-")]
        row.append(f"{eps:g}")
        for m, _ in mechs:
            if m in cell["ratios"]:
                row.append(fmt(*cell["ratios"][m]))
            elif m in cell["notes"]:
                row.append(short_note(cell["notes"][m]))
            else:
                row.append("-")
        if task == "ridge" and not real:
            pred = cell["predicted"]
            row.append("-" if pred is None else "- (k <= p + 1)" if not math.isfinite(pred) else f"{1 + pred:.3g}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


#: Lines of the plots: mechanism -> (colour, marker, line style).
STYLE = {
    "local": ("tab:red", "v", "-"),
    "local_sign": ("tab:pink", "<", "--"),
    "ltm_sketch": ("tab:blue", "o", "-"),
    "ltm_gram": ("tab:green", "s", "-"),
    "central": ("black", "D", "-"),
    "adassp": ("tab:purple", "^", "--"),
    "dgm_ols": ("tab:orange", "x", "--"),
    "rmgm_ols": ("tab:brown", "+", "--"),
}
#: Excess ratios below this are drawn at it (log axis; central at 10^6 is ~1e-6 above 1).
PLOT_FLOOR = 1e-7


def plot(summary: dict, task: str, epsilons: Sequence[float], extras: Sequence[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mechs = mechanisms_for(task, extras)
    fig, axes = plt.subplots(1, len(epsilons), figsize=(max(5.2 * len(epsilons), 9.0), 4.8), sharey=True,
                             squeeze=False)
    title = {"ridge": "Ridge regression (synthetic, d = 10 + label)",
             "pca": f"Rank-{PCA_RANK} approximation / PCA (synthetic, d = 10)"}[task]
    handles = {}
    for ax, eps in zip(axes[0], epsilons):
        for m, label in mechs:
            pts = sorted(
                (n, *summary[("synthetic", task, n, eps)]["ratios"][m][:2])
                for (ds, t, n, e) in summary
                if ds == "synthetic" and t == task and e == eps and m in summary[(ds, t, n, e)]["ratios"]
            )
            if not pts:
                continue
            ns = np.array([p[0] for p in pts], dtype=float)
            mean = np.array([p[1] for p in pts]) - 1.0
            std = np.array([p[2] for p in pts])
            y = np.maximum(mean, PLOT_FLOOR)
            lo = np.maximum(mean - std, PLOT_FLOOR)
            hi = np.maximum(mean + std, PLOT_FLOOR)
            colour, marker, ls = STYLE.get(m, ("gray", ".", ":"))
            thin = m in dict(EXTRA_RIDGE)
            # error bars for the four main mechanisms only: the extra baselines' std can exceed
            # their mean (DGM-OLS), which on a log axis would draw whiskers down to the floor
            yerr = None if thin else [y - lo, hi - y]
            h = ax.errorbar(ns, y, yerr=yerr, color=colour, marker=marker, linestyle=ls,
                            linewidth=1.0 if thin else 1.8, markersize=5 if thin else 6, capsize=3,
                            alpha=0.8 if thin else 1.0, label=label)
            handles[label] = h
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"epsilon = {eps:g}, delta = 1e-6")
        ax.set_xlabel("n (clients)")
        ax.grid(True, which="major", alpha=0.4)
        ax.grid(True, which="minor", alpha=0.1)
    axes[0][0].set_ylabel("excess error ratio  (ratio - 1, log scale)")
    fig.suptitle(f"{title}\nexcess error ratio vs n (mean over runs); error bars = sd over runs "
                 f"(main mechanisms)", fontsize=12)
    ncol = len(handles) if len(epsilons) >= 3 else 4
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=ncol, frameon=False)
    rows = math.ceil(len(handles) / ncol)
    fig.tight_layout(rect=(0, 0.05 + 0.05 * rows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def results_markdown(summary: dict, records: list[dict], args: argparse.Namespace, extras: Sequence[str],
                     seconds: float, timing: dict[str, Any]) -> str:
    for key, cell in summary.items():
        d = next((r.get("d") for r in records if (r["dataset"], r["task"], r["n"], r["epsilon"]) == key), None)
        cell["d"] = d if d is not None else ""
    cmd = "dpsketch experiments " + " ".join(args.argv_echo)
    lines = [
        "# Experiments: error ratios on the real code paths" if ltm_mode(records) == "pipeline"
        else "# Experiments: error ratios (LTM releases drawn in law by simulate_pipeline)",
        "",
        f"Generated by `{cmd.strip()}` in {seconds / 60:.1f} min on {os.cpu_count()} cores "
        f"({platform.machine()}, Python {platform.python_version()}). See `docs/accuracy.md` for how to "
        "read them and `research/experiments.py` for exactly what runs.",
        "",
        "Error ratio to the non-private optimum (1 is optimal): ridge F(theta)/F(theta*) with "
        "F = ||X theta - y||^2 + alpha ||theta||^2, alpha = 1e-3 n B^2 for every mechanism; PCA "
        f"||A - A V V^T||_F^2 / ||A - A V* V*^T||_F^2 at rank {PCA_RANK}. Each cell: mean ± sample sd "
        f"(median) over {runs_text(summary)}. "
        "delta = 1e-6, replace-one, B = 1 (0.99 quantile of row norms, rest clipped), servers s1, s2; "
        "LTM studies have design()'s defaults: the floor epsilon_floor = max(4, epsilon) (each server adds "
        "N(0, server_sigma^2) per released cell, docs/trust.md), lambda_star at 0.97 of the Bai-Yin "
        "estimate, and the sketch study signed with the secret sign (each row times a secret +-1 before "
        "its noise, docs/secret_sign.md).",
        "",
        ("* **LTM sketch**, **LTM Gram**: drawn in law by `simulate_pipeline` (the study as designed, "
         "the protocol hash over random report ids, the client noise at sigma and each server's noise, "
         "the servers' certificate on the same S S^T; numpy-seeded), then `release` and the estimators; "
         "`--ltm pipeline` runs the SDK's `prepare_batch`, ring shares and per-server accumulation instead."
         if ltm_mode(records) == "simulated" else
         "* **LTM sketch**, **LTM Gram**: the real pipeline (SDK `prepare_batch` with CSPRNG noise, "
         "ring shares; per-server `hash_report_ids` + `accumulate` + certificate; "
         "each server's own noise `study.server_noise()` (the floor, as `services/store.py` adds it); "
         "`release_from_ring_sum`; estimators). Not seedable: the sd is over independent runs."),
        "* **local**, **central**: `simulation.simulate_local` / `simulate_central` (numpy-seeded "
        "simulations; central = SSP for ridge, Analyze Gauss for PCA). **local (secret sign)**: the "
        "local model with each row signed before its noise, calibrated by the secret sign's "
        "certified bound at lambda = 1 (`simulation.signed_local_sigma`, docs/secret_sign.md section 7a).",
    ]
    if extras:
        lines.append("* **AdaSSP**, **DGM-OLS**, **RMGM-OLS**: `evaluation.central_baselines` "
                     "(numpy-seeded simulations, same alpha).")
    lines += [
        "* *predicted sketch floor*: 1 + p/(k - p - 1) + noise x data + noise x noise "
        "(`research/sketch_floor.py`, docs/accuracy.md), on each run's data, averaged; a first-order "
        "prediction (infinite when k <= p + 1, and not meaningful where the sketch kind saturates "
        "near predicting zero).",
        "",
        "## Ridge regression, synthetic (d = 10 features + label)",
        "",
        table(summary, lambda ds: ds == "synthetic", "ridge", extras),
        "",
        "## PCA, synthetic (d = 10, rank 3)",
        "",
        table(summary, lambda ds: ds == "synthetic", "pca", extras),
        "",
    ]
    if any(k[0] != "synthetic" for k in summary):
        lines += [
            "## Real data (like Tables 2 and 3 of paper 000)",
            "",
            "Columns standardised, rows scaled so the 0.99 quantile of the norms is B = 1, the rest "
            "clipped. \"n too small\": `design()` cannot make a sketch study for so few reports "
            "(lambda_min(S S^T) would not exceed 1).",
            "",
            "Sources: " + ", ".join(sorted({f"{r['dataset']} (`{r['source']}`)" for r in records
                                           if r["dataset"] != "synthetic"})) + ".",
            "",
            "### Ridge",
            "",
            table(summary, lambda ds: ds != "synthetic", "ridge", extras, real=True),
            "",
            "### PCA (rank 3)",
            "",
            table(summary, lambda ds: ds != "synthetic", "pca", extras, real=True),
            "",
        ]
    if timing and ltm_mode(records) == "pipeline":
        lines += ["## Pipeline cost (per run, both servers, in process)", "",
                  "| kind | task | n | client path (s) | both servers incl. certificate (s) |",
                  "|---|---|---|---|---|"]
        for (kind, task, n), (c, s) in sorted(timing.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            lines.append(f"| {kind} | {task} | {n:,} | {c:.2f} | {s:.2f} |")
        lines.append("")
    return "\n".join(lines)


def ltm_mode(records: list[dict]) -> str:
    modes = {r.get("ltm", "pipeline") for r in records}
    return modes.pop() if len(modes) == 1 else "mixed"


def runs_text(summary: dict) -> str:
    counts = sorted({cell["seeds"] for cell in summary.values()})
    if len(counts) == 1:
        return f"{counts[0]} runs"
    return f"{counts[-1]} runs (at least {counts[0]} in every cell)"


def pipeline_timing(records: list[dict]) -> dict[tuple, tuple[float, float]]:
    acc: dict[tuple, list[tuple[float, float]]] = {}
    for r in records:
        if r["dataset"] != "synthetic":
            continue
        for key, inf in r["info"].items():
            acc.setdefault((key.removeprefix("ltm_"), r["task"], r["n"]), []).append((inf["client_s"], inf["server_s"]))
    return {k: (float(np.mean([a for a, _ in v])), float(np.mean([b for _, b in v]))) for k, v in acc.items()}


# ---------------------------------------------------------------------------------------------
# command line


#: ``--FLAG`` runs that module's own figures and tables instead (each honours --out and --quick).
OTHER_HARNESSES = {
    "histogram": ("histogram_evaluation", "the histogram study figures and tables"),
    "logistic": ("logistic_evaluation", "the logistic regression figures and tables"),
    "lad": ("lad_evaluation", "the least absolute deviations figures and tables"),
    "vertical": ("vertical_evaluation", "ridge on column-partitioned data, LTM vs DGM-OLS / RMGM-OLS"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpsketch experiments",
        description="Paper 000 section 5 on the real code paths: error ratio vs n for local, LTM "
        "sketch, LTM Gram and central (plus AdaSSP / DGM-OLS / RMGM-OLS for ridge), PNG plots and "
        "markdown tables, synthetic and real data. Clients, servers and analyzer run in process.",
    )
    p.add_argument("--out", default="docs/experiments",
                   help="folder for ridge.png, pca.png, results.md, results.json (default: %(default)s)")
    p.add_argument("--n", type=float, nargs="+", default=None,
                   help="numbers of clients (default: 1e3 1e4 1e5 1e6; --quick: 1e3 1e4 1e5)")
    p.add_argument("--epsilons", type=float, nargs="+", default=None,
                   help="epsilon values, one plot panel each (default: 0.5 1 4; --quick: 1)")
    p.add_argument("--seeds", type=int, default=None,
                   help="runs per (n, epsilon) on synthetic data (default: 3; --quick: 1)")
    p.add_argument("--seeds-1e6", type=int, default=None,
                   help="runs at n >= 10^6 (default: --seeds); fewer bounds the run time")
    p.add_argument("--real-seeds", type=int, default=None,
                   help="runs per real data set and epsilon (default: 5; --quick: 2)")
    p.add_argument("--no-real-data", action="store_true", help="skip the real-data tables")
    p.add_argument("--no-extra-baselines", action="store_true",
                   help="leave AdaSSP, DGM-OLS and RMGM-OLS out of the ridge results")
    p.add_argument("--chunk", type=int, default=CHUNK_ROWS,
                   help="rows per prepare_batch call, bounds memory (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes (default: %(default)s; the docs' run, --ltm simulate --seeds 20 "
                   "--real-seeds 20, took 52 min with --jobs 2 on a shared, loaded 2-core machine)")
    p.add_argument("--from-json", metavar="FILE",
                   help="re-draw the plots and results.md from a previous run's results.json, run nothing")
    p.add_argument("--ltm", choices=["pipeline", "simulate"], default="pipeline",
                   help="LTM releases from the real client and server code (pipeline, default) or drawn "
                   "in law by simulate_pipeline (seeded, ~10x faster at 10^6; what makes 20 runs per "
                   "cell affordable)")
    p.add_argument("--refresh-predicted", action="store_true",
                   help="with --from-json: recompute the predicted sketch floor with this checkout's formula")
    p.add_argument("--quick", action="store_true",
                   help="bounded form (< 60 s): n up to 1e5, epsilon 1, one seed, diabetes only")
    for flag, (module, what) in OTHER_HARNESSES.items():
        p.add_argument(f"--{flag}", action="store_true",
                       help=f"instead: {what} (research.{module}; honours --out and --quick)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv_echo = argv
    for flag, (module, _) in OTHER_HARNESSES.items():  # another analysis' figures instead
        if getattr(args, flag):
            harness = importlib.import_module(f".{module}", __package__)
            return harness.main(["--out", args.out] + (["--quick"] if args.quick else []))
    ns = [int(n) for n in (args.n or (QUICK_NS if args.quick else DEFAULT_NS))]
    epsilons = [float(e) for e in (args.epsilons or (QUICK_EPSILONS if args.quick else DEFAULT_EPSILONS))]
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    seeds_big = args.seeds_1e6 if args.seeds_1e6 is not None else seeds
    real_seeds = args.real_seeds if args.real_seeds is not None else (2 if args.quick else 5)
    extras = [] if args.no_extra_baselines else [k for k, _ in extra_ridge_available()]
    os.makedirs(args.out, exist_ok=True)
    simulate = args.ltm == "simulate"

    jobs: list[tuple[Callable, tuple]] = []
    for n in sorted(ns, reverse=True):  # biggest first: better packing over the workers
        for eps in epsilons:
            for seed in range(seeds_big if n >= 1_000_000 else seeds):
                for task in ("ridge", "pca"):
                    jobs.append((synthetic_case, (task, n, eps, seed, extras, args.chunk, simulate)))
    if not args.no_real_data:
        for ds in real_datasets(quick=args.quick):
            for eps in epsilons:
                for seed in range(real_seeds):
                    jobs.append((real_case, (ds, eps, seed, extras, args.chunk, simulate)))

    if args.from_json:
        with open(args.from_json) as fh:
            saved = json.load(fh)
        args.argv_echo = saved["argv"]
        if args.refresh_predicted:
            refresh_predicted(saved["records"])
            report.save_run(args.out, "results.json", saved)
        return write_outputs(saved["records"], args, saved["epsilons"], saved["extras"], saved["seconds"])

    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    print(f"experiments: {len(jobs)} runs, n = {ns}, epsilon = {epsilons}, {seeds} seed(s)"
          f"{f' ({seeds_big} at 10^6)' if seeds_big != seeds else ''}, {args.jobs} worker(s)", file=sys.stderr)

    def done(r: dict[str, Any]) -> None:
        records.append(r)
        short = ", ".join(f"{m} {v:.4g}" for m, v in r["ratios"].items())
        print(f"[{time.perf_counter() - t0:6.0f}s] {r['dataset']} {r['task']} n={r['n']} eps={r['epsilon']:g} "
              f"seed={r['seed']}: {short}", file=sys.stderr, flush=True)

    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(fn, *a) for fn, a in jobs]
            for f in futures:
                done(f.result())
    else:
        for fn, a in jobs:
            done(fn(*a))
    seconds = time.perf_counter() - t0
    report.save_run(args.out, "results.json", {"argv": argv, "seconds": round(seconds, 1), "ns": ns,
                                               "epsilons": epsilons, "delta": DELTA, "extras": extras,
                                               "records": records})
    return write_outputs(records, args, epsilons, extras, seconds)


def write_outputs(records: list[dict[str, Any]], args: argparse.Namespace, epsilons: Sequence[float],
                  extras: Sequence[str], seconds: float) -> int:
    os.makedirs(args.out, exist_ok=True)
    summary = summarize(records)
    for task in ("ridge", "pca"):
        plot(summary, task, epsilons, extras, os.path.join(args.out, f"{task}.png"))
    report.publish(args.out, "results.md",
                   results_markdown(summary, records, args, extras, seconds, pipeline_timing(records)))
    print(f"experiments: wrote {args.out}/ridge.png, pca.png, results.md, results.json in {seconds:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
