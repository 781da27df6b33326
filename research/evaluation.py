"""Utility figures of paper 000, section 5: error ratios to the non-private optimum.

* Ridge regression: F(theta_hat) / F(theta*) with F(theta) = ||X theta - y||^2 + alpha ||theta||^2
  on the true clipped data, theta* = argmin F, the same alpha for every mechanism (and in F).
* Low-rank approximation: ||A - A V V^T||_F^2 / ||A - A V* V*^T||_F^2 with V the mechanism's
  top-r right singular vectors and V* the exact ones.

1.0 is the non-private optimum. :func:`compare` puts the LTM release next to the local and central
baselines on the same data at the same (epsilon, delta).

Reproduce the benchmark tables (about a minute each)::

    .venv/bin/python -m research.evaluation --seeds 5                 # design() defaults
    .venv/bin/python -m research.evaluation --seeds 5 --k auto        # proposed_k
    .venv/bin/python -m research.evaluation --seeds 5 --clip-quantile 0.99
    .venv/bin/python -m research.evaluation --seeds 5 --central-baselines --n 1e3 1e4 1e5

Everything is seeded (data, sketch seed, report ids, noise), so a run is reproducible.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Sequence

import numpy as np

from dpsketch.analyzer import error_ratios, simulation, synthetic
from dpsketch.analyzer.error_ratios import (DEFAULT_ALPHA_PER_REPORT, default_alpha, fit_ratios, pca_optimum, pca_ratio,
                                   ridge_optimum, ridge_ratio)
from dpsketch.analyzer.release import SecondMoments
from dpsketch.protocol import privacy
from dpsketch.protocol.study import Study, design

from . import baselines


def compare(data, study: Study, ltm_release: SecondMoments, *, extra: Sequence[str] = (),
            rng: np.random.Generator | None = None, debias: bool = True, **options) -> dict[str, dict[str, float]]:
    """:func:`analyzer.error_ratios.compare` (the LTM release next to the local and central
    models; ``options``: its label, rank, alpha, tasks and references), and with ``extra`` more
    mechanisms of :func:`central_baselines` at the study's (epsilon, delta), B and neighbouring
    notion, e.g. ``extra=EXTRA_BASELINES`` (optimum, plain SSP, AdaSSP, DGM-OLS, RMGM-OLS); each
    name is added to the tasks it applies to (see :data:`RIDGE_BASELINES`,
    :data:`PCA_BASELINES`). Default: none, the three above."""
    rng = rng if rng is not None else np.random.default_rng(0)
    out = error_ratios.compare(data, study, ltm_release, rng=rng, debias=debias, **options)
    extra = [m for m in extra if m not in ("local", "central")]  # already there
    if extra:
        options.pop("references", None)
        rows, columns, label, rank, alpha = error_ratios.compare_inputs(data, study, ltm_release, **options)
        more = central_baselines(
            rows, columns=columns, epsilon=study.epsilon, delta=study.delta, row_bound=study.row_bound,
            neighbouring=study.neighbouring, label=label, rank=rank, alpha=alpha, rng=rng, debias=debias,
            tasks=tuple(t for t in options.get("tasks", ("ridge", "pca")) if t in out), mechanisms=extra)
        for task, res in more.items():
            out[task].update(res)
    return out


# ---------------------------------------------------------------------------------------------
# central-model baselines on anyone's data

#: Ridge mechanisms of :func:`central_baselines`: the non-private optimum (ratio 1), the local
#: model (noisy rows, fit by :class:`RidgeRegression`), ``central`` (the SSP release fit by
#: :class:`RidgeRegression`, i.e. with its eigenvalue floor -- what :func:`compare` reports),
#: plain SSP, AdaSSP, DGM-OLS and RMGM-OLS (:mod:`research.baselines`).
RIDGE_BASELINES = ("optimum", "local", "central", "ssp", "adassp", "dgm_ols", "rmgm_ols")
#: PCA mechanisms: optimum, local, Analyze Gauss (noise on A^T A; :func:`compare`'s "central").
PCA_BASELINES = ("optimum", "local", "analyze_gauss")
#: What ``compare(..., extra=EXTRA_BASELINES)`` adds to its ltm / local / central entries.
EXTRA_BASELINES = ("optimum", "ssp", "adassp", "dgm_ols", "rmgm_ols")

_DIRECT_FITS = {
    "ssp": baselines.ssp,
    "adassp": baselines.adassp,
    "dgm_ols": baselines.dgm_ols,
    "rmgm_ols": baselines.rmgm_ols,
}


def central_baselines(
    data,
    *,
    epsilon: float = 1.0,
    delta: float = 1e-6,
    row_bound: float | None = None,
    neighbouring: privacy.Neighbouring = "replace-one",
    columns: Sequence[str] | None = None,
    label: str | None = None,
    rank: int | None = None,
    alpha: float | None = None,
    rng: np.random.Generator | None = None,
    debias: bool = True,
    tasks: Sequence[str] = ("ridge", "pca"),
    mechanisms: Sequence[str] | None = None,
) -> dict[str, dict[str, float]]:
    """Error ratios of the local- and central-model baselines on ``data``, all at the same
    (epsilon, delta), row bound B and neighbouring notion -- no study or LTM release needed.

    ``data``: a :class:`synthetic.Dataset`, or an n x d array with ``columns`` (default
    x0..x{d-1}) and ``row_bound`` given; rows are clipped to B. ``label`` (default the data
    set's) selects the ridge target; ridge is skipped without one. ``rank`` defaults as in
    :func:`compare`. ``alpha`` is the ridge penalty of the objective F (default
    :func:`default_alpha`); every mechanism targets F with it: the Gram-based ones through
    :class:`RidgeRegression`, the others by adding it to their own normal equations (AdaSSP adds
    its adaptive lambda on top). ``mechanisms`` picks from :data:`RIDGE_BASELINES` and
    :data:`PCA_BASELINES` (default: all); a name is used for the tasks it belongs to.
    ``rng`` (numpy, default seeded 0) draws all noise and mixing matrices: a simulation.

    Returns ``{"ridge": {mechanism: F(theta)/F(theta*)}, "pca": {mechanism: ratio}}``.
    """
    rows = getattr(data, "rows", data)
    rows = np.atleast_2d(np.asarray(rows, dtype=np.float64))
    if row_bound is None:
        row_bound = getattr(data, "row_bound", None)
        if row_bound is None:
            raise ValueError("row_bound is required for array data")
    rows = simulation.clip_rows(rows, row_bound)
    if columns is None:
        columns = getattr(data, "columns", None)
    columns = [f"x{i}" for i in range(rows.shape[1])] if columns is None else list(columns)
    if len(columns) != rows.shape[1]:
        raise ValueError(f"data has {rows.shape[1]} columns but {len(columns)} names")
    names = list(mechanisms) if mechanisms is not None else list(dict.fromkeys(RIDGE_BASELINES + PCA_BASELINES))
    unknown = [m for m in names if m not in RIDGE_BASELINES and m not in PCA_BASELINES]
    if unknown:
        raise ValueError(f"unknown mechanisms {unknown}; known: {RIDGE_BASELINES + PCA_BASELINES}")
    rng = rng if rng is not None else np.random.default_rng(0)
    label = label or getattr(data, "label", None)
    alpha = default_alpha(rows.shape[0], row_bound) if alpha is None else float(alpha)
    target = simulation.Target(epsilon, delta, row_bound, neighbouring)

    def gram_releases(wanted: set[str]) -> dict[str, SecondMoments]:
        rel: dict[str, SecondMoments] = {}
        if "local" in wanted:
            rel["local"] = simulation.local_release(rows, columns, target, rng=rng)
        for name in ("central", "analyze_gauss"):
            if name in wanted:
                rel[name] = simulation.central_gram(rows, columns, target, rng=rng)
        return rel

    out: dict[str, dict[str, float]] = {}
    if "ridge" in tasks and label is not None:
        want = [m for m in names if m in RIDGE_BASELINES]
        res = fit_ratios(
            gram_releases(set(want)), rows, columns, label=label, rank=None, alpha=alpha, debias=debias
        ).get("ridge", {})
        li = columns.index(label)
        X, y = np.delete(rows, li, axis=1), rows[:, li]
        for name in want:
            if name == "optimum":
                res[name] = ridge_ratio(X, y, ridge_optimum(X, y, alpha), alpha)
            elif name in _DIRECT_FITS:
                res[name] = ridge_ratio(X, y, _DIRECT_FITS[name](X, y, target, rng=rng, alpha=alpha).coef, alpha)
        out["ridge"] = {m: res[m] for m in want}
    if "pca" in tasks:
        want = [m for m in names if m in PCA_BASELINES]
        rank = rank or getattr(data, "rank", None) or min(synthetic.DEFAULT_RANK, len(columns) - 1)
        res = fit_ratios(
            gram_releases(set(want)), rows, columns, label=None, rank=rank, alpha=alpha, debias=debias
        ).get("pca", {})
        if "optimum" in want:
            res["optimum"] = pca_ratio(rows, pca_optimum(rows, rank))
        out["pca"] = {m: res[m] for m in want}
    return out


# ---------------------------------------------------------------------------------------------
# the benchmark


def proposed_k(
    expected_reports: int,
    d: int,
    *,
    epsilon: float = 1.0,
    delta: float = 1e-6,
    row_bound: float = 1.0,
    neighbouring: privacy.Neighbouring = "replace-one",
    s: int = 4,
) -> int:
    """The k ``design`` picks by default (``study.default_k``), for these parameters."""
    from dpsketch.protocol.study import default_k

    sigma_local = privacy.local_sigma(epsilon, delta, row_bound, neighbouring)
    return default_k(expected_reports, d, sigma_local, row_bound, s)


def benchmark_study(
    columns: list[str], label: str | None, n: int, seed: int, **design_kwargs
) -> Study:
    """The study ``design`` picks for n expected reports (defaults: epsilon 1, delta 1e-6,
    replace-one, B = 1), with a sketch seed derived from ``seed`` so runs are reproducible."""
    sketch_seed = hashlib.sha256(f"dpsketch-benchmark/{seed}".encode()).hexdigest()
    study, _ = design(
        name="benchmark",
        columns=columns,
        label=label,
        servers=["s1", "s2"],
        expected_reports=n,
        seed=sketch_seed,
        **design_kwargs,
    )
    return study


def run_benchmark(
    ns: Sequence[int],
    seeds: Sequence[int],
    *,
    d: int = 10,
    label_noise: float = synthetic.DEFAULT_LABEL_NOISE,
    rank: int = synthetic.DEFAULT_RANK,
    big: float = synthetic.DEFAULT_BIG,
    small: float = synthetic.DEFAULT_SMALL,
    alpha_per_report: float = DEFAULT_ALPHA_PER_REPORT,
    clip_quantile: float | None = None,
    auto_k: bool = False,
    design_kwargs: dict | None = None,
) -> dict[int, dict[str, dict[str, list[float]]]]:
    """Ridge on :func:`synthetic.regression_data` and PCA on :func:`synthetic.lowrank_data`,
    LTM simulated with :func:`simulation.simulate_ltm`; ratios per n, task, mechanism and seed.
    ``auto_k`` uses :func:`proposed_k` instead of design()'s default k."""
    design_kwargs = dict(design_kwargs or {})
    results: dict[int, dict[str, dict[str, list[float]]]] = {}
    for n in ns:
        per = {"ridge": {}, "pca": {}}
        for seed in seeds:
            rng = np.random.default_rng(np.random.SeedSequence([0xB, n, seed]))
            reg = synthetic.regression_data(
                n, d, label_noise=label_noise, seed=seed, clip_quantile=clip_quantile
            )
            if auto_k:
                design_kwargs["k"] = proposed_k(n, len(reg.columns))
            st = benchmark_study(reg.columns, reg.label, n, seed, **design_kwargs)
            ltm = simulation.simulate_ltm(st, reg.rows, rng)
            per.setdefault("k", {})["ridge"] = [st.k]
            r = compare(
                reg, st, ltm, rng=rng, alpha=alpha_per_report * n * st.row_bound**2, tasks=("ridge",)
            )
            low = synthetic.lowrank_data(
                n, d, rank=rank, big=big, small=small, seed=seed, clip_quantile=clip_quantile
            )
            if auto_k:
                design_kwargs["k"] = proposed_k(n, len(low.columns))
            st = benchmark_study(low.columns, None, n, seed, **design_kwargs)
            ltm = simulation.simulate_ltm(st, low.rows, rng)
            per["k"]["pca"] = [st.k]
            p = compare(low, st, ltm, rng=rng, tasks=("pca",))
            for task, res in (("ridge", r["ridge"]), ("pca", p["pca"])):
                for mech, val in res.items():
                    per[task].setdefault(mech, []).append(val)
        results[n] = per
    return results


def format_table(results: dict[int, dict[str, dict[str, list[float]]]]) -> str:
    lines = [
        "| n | k (ridge/pca) | ridge ltm | ridge local | ridge central | pca ltm | pca local | pca central |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, per in results.items():
        cells = []
        for task in ("ridge", "pca"):
            for mech in ("ltm", "local", "central"):
                vals = np.asarray(per[task][mech])
                cells.append(f"{vals.mean():.4g} ± {vals.std():.2g}")
        ks = per.get("k", {})
        kcell = f"{ks.get('ridge', ['?'])[0]}/{ks.get('pca', ['?'])[0]}"
        lines.append(f"| {n:.0e} | {kcell} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_central_baselines(
    ns: Sequence[int],
    seeds: Sequence[int],
    *,
    d: int = 10,
    epsilon: float = 1.0,
    delta: float = 1e-6,
    neighbouring: privacy.Neighbouring = "replace-one",
    label_noise: float = synthetic.DEFAULT_LABEL_NOISE,
    alpha_per_report: float = DEFAULT_ALPHA_PER_REPORT,
) -> dict[int, dict[str, list[float]]]:
    """Ridge ratios of every :data:`RIDGE_BASELINES` mechanism on :func:`synthetic.regression_data`
    (B = 1), per n and mechanism, one value per seed (data seed and noise seed)."""
    out: dict[int, dict[str, list[float]]] = {}
    for n in ns:
        per: dict[str, list[float]] = {}
        for seed in seeds:
            data = synthetic.regression_data(n, d, label_noise=label_noise, seed=seed)
            rng = np.random.default_rng(np.random.SeedSequence([0xC, n, seed]))
            res = central_baselines(
                data, epsilon=epsilon, delta=delta, neighbouring=neighbouring, rng=rng,
                alpha=alpha_per_report * n * data.row_bound**2, tasks=("ridge",),
            )["ridge"]
            for mech, val in res.items():
                per.setdefault(mech, []).append(val)
        out[n] = per
    return out


def format_baseline_table(results: dict[int, dict[str, list[float]]]) -> str:
    mechs = list(next(iter(results.values())).keys()) if results else list(RIDGE_BASELINES)
    lines = ["| n | " + " | ".join(mechs) + " |", "|---|" + "---|" * len(mechs)]
    for n, per in results.items():
        cells = [f"{np.mean(per[m]):.4g} ± {np.std(per[m]):.2g}" for m in mechs]
        lines.append(f"| {n:.0e} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="LTM vs local vs central error ratios (paper 000, sec. 5)")
    ap.add_argument("--n", type=float, nargs="+", default=[1e4, 1e5, 1e6])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--d", type=int, default=10)
    ap.add_argument("--label-noise", type=float, default=synthetic.DEFAULT_LABEL_NOISE)
    ap.add_argument("--rank", type=int, default=synthetic.DEFAULT_RANK)
    ap.add_argument("--big", type=float, default=synthetic.DEFAULT_BIG)
    ap.add_argument("--small", type=float, default=synthetic.DEFAULT_SMALL)
    ap.add_argument("--alpha-per-report", type=float, default=DEFAULT_ALPHA_PER_REPORT)
    ap.add_argument(
        "--clip-quantile",
        type=float,
        default=None,
        help="scale rows so this quantile of the norms is B and clip the rest (default: scale by the max)",
    )
    ap.add_argument(
        "--k", default=None, help="override design()'s sketch rows: an integer, or 'auto' for proposed_k"
    )
    ap.add_argument("--s", type=int, default=None, help="override design()'s blocks")
    ap.add_argument(
        "--central-baselines",
        action="store_true",
        help="instead: ridge ratios of local, SSP, AdaSSP, DGM-OLS, RMGM-OLS (central_baselines)",
    )
    ap.add_argument("--epsilon", type=float, default=1.0, help="with --central-baselines")
    args = ap.parse_args(argv)
    if args.central_baselines:
        t0 = time.time()
        res = run_central_baselines(
            [int(n) for n in args.n], range(args.seeds), d=args.d, epsilon=args.epsilon,
            label_noise=args.label_noise, alpha_per_report=args.alpha_per_report,
        )
        print(
            f"ridge error ratio, d = {args.d} (+ label), epsilon = {args.epsilon}, delta = 1e-6, "
            f"replace-one, B = 1, alpha = {args.alpha_per_report} n; mean ± std over {args.seeds} seeds"
        )
        print(format_baseline_table(res))
        print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
        return 0
    kw = {}
    if args.k is not None and args.k != "auto":
        kw["k"] = int(args.k)
    if args.s is not None:
        kw["s"] = args.s
    t0 = time.time()
    res = run_benchmark(
        [int(n) for n in args.n],
        range(args.seeds),
        d=args.d,
        label_noise=args.label_noise,
        rank=args.rank,
        big=args.big,
        small=args.small,
        alpha_per_report=args.alpha_per_report,
        clip_quantile=args.clip_quantile,
        auto_k=args.k == "auto",
        design_kwargs=kw,
    )
    print(
        f"d = {args.d} (+ label for ridge), epsilon = 1, delta = 1e-6, replace-one, B = 1; "
        f"label noise {args.label_noise}, rank {args.rank}, singular values {args.big}/{args.small}; "
        f"alpha = {args.alpha_per_report} n; rows scaled by "
        f"{'the max norm' if args.clip_quantile is None else f'the {args.clip_quantile} quantile, clipped'}; "
        f"k = {'design() default' if args.k is None else args.k}; mean ± std over {args.seeds} seeds"
    )
    print(format_table(res))
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
