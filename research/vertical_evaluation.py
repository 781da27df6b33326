"""Vertically partitioned data (issue 12, paper 004): the LTM against DGM-OLS, RMGM-OLS and central.

A research-harness measurement of the release a study with parties makes (the protocol is built:
docs/vertical.md, docs/protocol.md sections 2d, 6a, 7), drawn in law::

    .venv/bin/python -m research.vertical_evaluation            # 20 runs per cell
    .venv/bin/python -m research.vertical_evaluation --quick --out /tmp/v   # ~6 s
    .venv/bin/dpsketch experiments --vertical                   # the same, through the harness

Model. Each individual's row a = [a_1 | ... | a_P] (d = 10 columns including the label, split in
contiguous blocks; the label is in the last party's block) is held by P parties. Party j clips
its block to norm B_j, B_j^2 = B^2 d_j / d (so sum_j B_j^2 = B^2 and the joined row has norm at
most B), adds N(0, sigma^2) per value with the sigma of a sketch study of the joined columns
(:func:`dpsketch.protocol.study.design`), and shares its block under the individual's common
report id. The servers apply the same OSNAP S to every block (S depends only on the report id),
so the release is S(A + G) of the joined rows: identical in law to the sketch-kind release of
the block-clipped rows. It is simulated exactly that way: :func:`simulation.simulate_ltm` of the
design()ed study (with the servers' floor noise) on the block-clipped rows. The only difference
from the single-owner sketch kind is the clipping, per block instead of joint; the joint-clipped
sketch kind is reported as the reference line, simulated with the same random numbers (report
ids, client and server noise), so the two differ by S(A_block - A_joint) only.

Mechanisms (all at the same (epsilon, delta), replace-one, B = 1, ridge penalty
``error_ratios.default_alpha``), every ratio F(theta)/F(theta*) on the *same* rows: the
generator's rows (``synthetic.regression_data`` scaled so the 0.99 quantile of the norms is B,
the rest clipped, as ``research.experiments`` uses them):

* ``nonpriv_block``: the non-private ridge fit on the block-clipped rows (the clipping's own cost;
  the joint optimum is 1 by definition);
* ``ltm_party``: LTM sketch with per-party clipping (our product for parties: unsigned, since a
  study with parties cannot take the secret sign);
* ``ltm_joint``: LTM sketch with joint clipping and the same unsigned study (the clipping's cost,
  paired with ``ltm_party``);
* ``ltm_owner``: the default one-owner study of the joined columns (``design()``'s defaults: the
  secret sign and its k) on the jointly clipped rows: what parties are measured against;
* ``ltm_party_sign``: the design docs/vertical.md proposes and does not build: parties sign every
  individual's blocks with one secret sign derived from the party key, so the joined row is a
  signed single owner's report; its release has the law of the default signed study (same
  calibration and k) on the block-clipped rows, simulated that way;
* ``ltm_party_sign_floor``: the same with the servers' noise of the unsigned study at that k (a
  floor that does not rest on the party key staying secret);
* ``local``: the local model (each party publishes its noisy clipped block);
* ``central``: SSP on the joined rows (:func:`simulation.simulate_central` + RidgeRegression),
  and ``adassp`` (AdaSSP) -- a trusted curator holding all columns;
* ``dgm_ols``, ``rmgm_ols``: paper 004's mechanisms on the block-clipped rows (each party
  releases its own noisy or mixed-and-noisy block with the shared public mixing matrix; the
  joined release has the same law as the single-owner one), with the evaluation's alpha, as
  ``evaluation.central_baselines`` calls them.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from dpsketch.analyzer import error_ratios, simulation, synthetic

from . import baselines, evaluation, experiments, report

D_TOTAL = 10  # columns including the label
PARTIES = (2, 3)
NEIGHBOURING = "replace-one"

#: (key, label) in table and plot order.
MECHANISMS = [
    ("nonpriv_block", "non-private, per-party clip"),
    ("ltm_party", "LTM sketch, per-party clip"),
    ("ltm_joint", "LTM sketch, joint clip"),
    ("ltm_owner", "LTM sketch, one owner (default, signed)"),
    ("ltm_party_sign", "LTM sketch, per-party clip, party-key sign (proposed)"),
    ("ltm_party_sign_floor", "LTM sketch, per-party clip, party-key sign, unsigned floor (proposed)"),
    ("local", "local"),
    ("central", "central (SSP)"),
    ("adassp", "AdaSSP"),
    ("dgm_ols", "DGM-OLS"),
    ("rmgm_ols", "RMGM-OLS"),
]
STYLE = {
    **experiments.STYLE,  # the shared baselines look as in docs/accuracy.md's plots
    "nonpriv_block": ("gray", ".", ":"),
    "ltm_party": ("tab:blue", "o", "-"),
    "ltm_joint": ("tab:cyan", "s", "--"),
    "ltm_owner": ("navy", "*", "-"),
    "ltm_party_sign": ("tab:olive", "P", "-."),
    "ltm_party_sign_floor": ("tab:brown", "X", "-."),
}


# ---------------------------------------------------------------------------------------------
# parties and their clipping


def blocks(d: int, parties: int) -> list[tuple[int, int]]:
    """Contiguous column blocks [start, stop) for ``parties`` parties; the last one is the
    largest, so with the label last it is held by the last party (10 -> 5+5, 3+3+4)."""
    base = d // parties
    sizes = [base] * parties
    sizes[-1] += d - base * parties
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def block_bounds(d: int, parties: int, row_bound: float) -> list[float]:
    """B_j = B sqrt(d_j / d): sum_j B_j^2 = B^2."""
    return [row_bound * math.sqrt((b - a) / d) for a, b in blocks(d, parties)]


def clip_blocks(rows: np.ndarray, parties: int, row_bound: float,
                bounds: Sequence[float] | None = None) -> np.ndarray:
    """Each party clips its own block to B_j (``simulation.clip_rows`` per block)."""
    a = np.asarray(rows, dtype=np.float64)
    bl = blocks(a.shape[1], parties)
    bounds = block_bounds(a.shape[1], parties, row_bound) if bounds is None else list(bounds)
    if len(bounds) != len(bl):
        raise ValueError("one bound per party")
    if abs(sum(b * b for b in bounds) - row_bound ** 2) > 1e-9 * row_bound ** 2:
        raise ValueError("sum_j B_j^2 must equal B^2")
    return np.column_stack([simulation.clip_rows(a[:, lo:hi], bj) for (lo, hi), bj in zip(bl, bounds)])


def simulate_party_ltm(study, rows: np.ndarray, parties: int, rng: np.random.Generator, **kw):
    """The per-party LTM release: each party's clipped block plus its N(0, sigma^2) noise,
    sketched by the servers with the report-id keyed S (the same for every block) and summed:
    S(A_blockclipped + G), the sketch study's release of the block-clipped rows."""
    return simulation.simulate_ltm(study, clip_blocks(rows, parties, study.row_bound), rng, **kw)


# ---------------------------------------------------------------------------------------------
# one case


def _rng(*parts: Any) -> np.random.Generator:
    h = int(hashlib.sha256("/".join(map(str, ("vertical", *parts))).encode()).hexdigest()[:8], 16)
    return np.random.default_rng(np.random.SeedSequence([0x7E, h]))


def _ratio(rows: np.ndarray, li: int, coef: np.ndarray, alpha: float) -> float:
    X, y = np.delete(rows, li, axis=1), rows[:, li]
    return error_ratios.ridge_ratio(X, y, coef, alpha)


def run_case(n: int, epsilon: float, seed: int, parties: Sequence[int] = PARTIES) -> list[dict[str, Any]]:
    """Every mechanism at one (n, epsilon, seed); one record per number of parties (the
    partition-free mechanisms -- joint sketch, central, AdaSSP -- are shared by them)."""
    t0 = time.perf_counter()
    data = synthetic.regression_data(n, D_TOTAL - 1, seed=seed, clip_quantile=experiments.CLIP_QUANTILE,
                                     row_bound=experiments.ROW_BOUND)
    rows, cols, label = data.rows, list(data.columns), data.label
    li = cols.index(label)
    B = experiments.ROW_BOUND
    alpha = error_ratios.default_alpha(n, B)
    kw = dict(epsilon=epsilon, delta=experiments.DELTA, row_bound=B, neighbouring=NEIGHBOURING)
    # unsigned: a study with parties cannot take the secret sign (the parties would need a common
    # sign per individual, docs/secret_sign.md section 7), and the joint reference shares its noise
    study = experiments.design_study(cols, label, n, epsilon, "sketch", ("vertical", n, epsilon, seed),
                                     secret_sign=False)
    rng = _rng("shared", n, epsilon, seed)
    # common random numbers: the per-party and joint LTM releases draw the same report ids, client
    # noise and server noise, so their difference is the clipping's alone
    signed = experiments.design_study(cols, label, n, epsilon, "sketch", ("vertical-signed", n, epsilon, seed))
    # the party-key sign with a floor that does not rest on the key: the signed study's client noise,
    # the servers' noise of the unsigned study at the same k (a leaked key leaves the floor standing)
    unsigned_k = experiments.design_study(cols, label, n, epsilon, "sketch", ("vertical-signed", n, epsilon, seed),
                                          secret_sign=False, k=signed.k)
    signed_floor = signed.model_copy(update={"server_sigma": unsigned_k.server_sigma})
    shared_rel = {"ltm_joint": simulation.simulate_ltm(study, rows, _rng("ltm", n, epsilon, seed)),
                  "ltm_owner": simulation.simulate_ltm(signed, rows, _rng("ltm-signed", n, epsilon, seed)),
                  "central": simulation.simulate_central(study, rows, rng)}
    shared = error_ratios.fit_ratios(shared_rel, rows, cols, label=label, rank=None, alpha=alpha,
                                    debias=True)["ridge"]
    shared.update(evaluation.central_baselines(rows, columns=cols, label=label, alpha=alpha, rng=rng,
                                               tasks=("ridge",), mechanisms=["adassp"], **kw)["ridge"])
    out = []
    for p in parties:
        t1 = time.perf_counter()
        prng = _rng("party", p, n, epsilon, seed)
        clipped = clip_blocks(rows, p, B)
        rel = {"ltm_party": simulation.simulate_ltm(study, clipped, _rng("ltm", n, epsilon, seed)),
               "ltm_party_sign": simulation.simulate_ltm(signed, clipped, _rng("ltm-signed", n, epsilon, seed)),
               "ltm_party_sign_floor": simulation.simulate_ltm(signed_floor, clipped,
                                                              _rng("ltm-signed", n, epsilon, seed)),
               "local": simulation.simulate_local(study, clipped, prng)}
        ratios = error_ratios.fit_ratios(rel, rows, cols, label=label, rank=None, alpha=alpha,
                                        debias=True)["ridge"]
        Xc, yc = np.delete(clipped, li, axis=1), clipped[:, li]
        ratios["nonpriv_block"] = _ratio(rows, li, error_ratios.ridge_optimum(Xc, yc, alpha), alpha)
        for name, fit in (("dgm_ols", baselines.dgm_ols), ("rmgm_ols", baselines.rmgm_ols)):
            ratios[name] = _ratio(rows, li, fit(Xc, yc, simulation.Target(**kw), rng=prng, alpha=alpha).coef, alpha)
        ratios.update(shared)
        out.append({
            "n": n, "epsilon": epsilon, "seed": seed, "parties": p,
            "blocks": [list(b) for b in blocks(D_TOTAL, p)],
            "block_bounds": block_bounds(D_TOTAL, p, B),
            "clipped_rows": int(np.sum(np.any(np.abs(clipped - rows) > 1e-12, axis=1))),
            "ratios": {k: float(ratios[k]) for k, _ in MECHANISMS},
            "info": {"k": study.k, "s": study.s, "sigma": study.sigma, "server_sigma": study.server_sigma,
                     "signed_k": signed.k, "signed_sigma": signed.sigma, "signed_server_sigma": signed.server_sigma,
                     "rmgm_k": baselines.rmgm_k(n, epsilon, experiments.DELTA, D_TOTAL - 1)},
            "seconds": round(time.perf_counter() - t1 + (t1 - t0) / len(parties), 2),
        })
    return out


# ---------------------------------------------------------------------------------------------
# summary, table, plot


def summarize(records: list[dict]) -> dict[tuple, dict[str, tuple[float, float, int, float, float]]]:
    """(parties, epsilon, n) -> mechanism -> (mean, sample sd, runs, median, 90th percentile)."""
    acc: dict[tuple, dict[str, list[float]]] = {}
    for r in records:
        cell = acc.setdefault((r["parties"], r["epsilon"], r["n"]), {})
        for m, v in r["ratios"].items():
            cell.setdefault(m, []).append(v)
    def row(v: list[float]) -> tuple[float, float, int, float, float]:
        s = report.stats(v)
        return s["mean"], s["sd"], s["runs"], s["median"], s["p90"]

    return {k: {m: row(v) for m, v in cell.items()} for k, cell in acc.items()}


def _num(v: float) -> str:
    digits = 3 if v < 10 else 4
    return f"{v:.{max(4, digits + int(-math.log10(max(v - 1, 1e-9))) if v < 1.1 else digits)}g}"


def _fmt(mean: float, std: float, count: int, median: float | None = None, p90: float | None = None) -> str:
    """mean ± sd (median), p90."""
    if not math.isfinite(mean):
        return "inf"
    s = _num(mean)
    if count > 1 and std > 5e-4 * mean:
        s += f" ± {std:.2g}"
    if median is not None and count > 1:
        s += f" ({_num(median)})"
    if p90 is not None and count > 1:
        s += f", p90 {_num(p90)}"
    return s


def _n_label(n: int) -> str:
    e = math.log10(n)
    return f"10^{int(round(e))}" if abs(e - round(e)) < 1e-9 else f"{n:,}"


def table(summary: dict, order: list[tuple]) -> str:
    head = "| parties | epsilon | n | " + " | ".join(lab for _, lab in MECHANISMS) + " |"
    lines = [head, "|" + "---|" * (3 + len(MECHANISMS))]
    for key in order:
        cell = summary[key]
        p, eps, n = key
        lines.append(f"| {p} | {eps:g} | {_n_label(n)} | "
                     + " | ".join(_fmt(*cell[m]) if m in cell else "" for m, _ in MECHANISMS) + " |")
    return "\n".join(lines)


def ordered_keys(summary: dict) -> list[tuple]:
    """n = 10^5, epsilon = 1 first, then everything by (parties, epsilon, n)."""
    keys = sorted(summary)
    first = [k for k in keys if k[1] == 1.0 and k[2] == 100_000]
    return first + [k for k in keys if k not in first]


#: Excess ratios below this are drawn at it (log axis).
PLOT_FLOOR = 1e-7
#: ... and above this at it (DGM-OLS's worst runs reach 10^7 and would squash the rest).
PLOT_CEIL = 1e4


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parties = sorted({k[0] for k in summary})
    epsilons = sorted({k[1] for k in summary})
    fig, axes = plt.subplots(len(parties), len(epsilons), figsize=(4.6 * len(epsilons) + 0.6, 3.9 * len(parties) + 1.3),
                             sharex=True, sharey=True, squeeze=False)
    handles: dict[str, Any] = {}
    for i, p in enumerate(parties):
        for j, eps in enumerate(epsilons):
            ax = axes[i][j]
            for m, lab in MECHANISMS:
                pts = sorted((k[2], summary[k][m][3]) for k in summary
                             if k[0] == p and k[1] == eps and m in summary[k])
                if not pts:
                    continue
                ns = np.array([q[0] for q in pts], dtype=float)
                y = np.clip(np.array([q[1] for q in pts]) - 1.0, PLOT_FLOOR, PLOT_CEIL)
                colour, marker, ls = STYLE[m]
                main = m in ("ltm_party", "ltm_joint", "ltm_owner", "ltm_party_sign", "central", "dgm_ols", "rmgm_ols")
                h, = ax.plot(ns, y, color=colour, marker=marker, linestyle=ls,
                             linewidth=2.0 if m == "ltm_party" else (1.5 if main else 1.0),
                             markersize=7 if m == "ltm_party" else 5, alpha=1.0 if main else 0.75, label=lab)
                handles[lab] = h
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_ylim(PLOT_FLOOR / 2, PLOT_CEIL * 2)
            ax.set_title(f"{p} parties ({'+'.join(str(b - a) for a, b in blocks(D_TOTAL, p))} columns), "
                         f"epsilon = {eps:g}", fontsize=10)
            ax.grid(True, which="major", alpha=0.4)
            ax.grid(True, which="minor", alpha=0.1)
            if i == len(parties) - 1:
                ax.set_xlabel("n (individuals)")
            if j == 0:
                ax.set_ylabel("excess ratio  F/F* - 1")
    fig.suptitle("Ridge on vertically partitioned synthetic data (d = 10 incl. label, delta = 1e-6, B = 1): "
                 "excess error ratio vs n\n(median over runs; the non-private joint optimum is 0 excess; "
                 f"clipped to [{PLOT_FLOOR:g}, {PLOT_CEIL:g}])", fontsize=11)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=4, frameon=False,
               fontsize=10)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(summary: dict, records: list[dict], argv: list[str], seconds: float) -> str:
    info = {(r["n"], r["epsilon"]): r["info"] for r in records}
    lines = [
        "# Vertically partitioned ridge: LTM vs paper 004's mechanisms",
        "",
        f"Generated by `{' '.join(['python -m research.vertical_evaluation', *argv])}`"
        f" in {seconds / 60:.1f} min on {os.cpu_count()} cores ({platform.machine()}, Python "
        f"{platform.python_version()}). See `docs/vertical.md` for how to read it and "
        "`research/vertical_evaluation.py` for exactly what runs.",
        "",
        "Ridge ratio F(theta)/F(theta*) (F = ||X theta - y||^2 + alpha ||theta||^2, alpha = 1e-3 n B^2, "
        "`error_ratios.ridge_ratio` on the generator's jointly clipped rows for every mechanism), mean ± sample "
        "sd (median), p90 = the 90th percentile over runs. d = 10 columns incl. the label (the last party's), contiguous blocks, B_j^2 = B^2 d_j / d, "
        "delta = 1e-6, replace-one, B = 1, servers s1, s2 with design()'s floor noise.",
        "",
        table(summary, ordered_keys(summary)),
        "",
        "Runs per cell: " + ", ".join(sorted({f"{_n_label(k[2])}: {c['ltm_party'][2]}" for k, c in summary.items()}))
        + ".",
        "",
        "Parties against the default one-owner study (ratio of the mean ridge ratios; paired runs, same data):",
        "",
        "| parties | epsilon | n | per-party clip (today) / one owner | party-key sign (proposed) / one owner |",
        "|---|---|---|---|---|",
        *[f"| {k[0]} | {k[1]:g} | {_n_label(k[2])} | {summary[k]['ltm_party'][0] / summary[k]['ltm_owner'][0]:.3g} | "
          f"{summary[k]['ltm_party_sign'][0] / summary[k]['ltm_owner'][0]:.3g} |"
          for k in ordered_keys(summary) if 'ltm_owner' in summary[k] and 'ltm_party_sign' in summary[k]],
        "",
        "| n | epsilon | sketch k (unsigned) | sigma | server_sigma | signed k | signed sigma | signed server_sigma "
        "| RMGM k |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (n, eps), inf in sorted(info.items()):
        lines.append(f"| {_n_label(n)} | {eps:g} | {inf['k']} | {inf['sigma']:.4g} | {inf['server_sigma']:.4g} | "
                     f"{inf.get('signed_k', '-')} | {inf.get('signed_sigma', float('nan')):.4g} | "
                     f"{inf.get('signed_server_sigma', float('nan')):.4g} | {inf['rmgm_k']} |")
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m research.vertical_evaluation",
                                description="Ridge on column-partitioned data: LTM sketch (per-party and "
                                "joint clipping) vs central, AdaSSP, local, DGM-OLS, RMGM-OLS.")
    report.add_grid_arguments(p, out="folder for vertical_results.md/.json, vertical.png",
                              n="default 1e4 1e5 1e6 (--quick: 1e4 1e5)", epsilons="default 0.5 1 4 (--quick: 1)",
                              seeds="runs per point (default 20; --quick 1)",
                              quick="n 1e4 1e5, epsilon 1, one run (< 40 s)",
                              from_json="redraw from a previous vertical_results.json")
    p.add_argument("--seeds-1e6", type=int, default=None, help="runs at n >= 10^6 (default: --seeds)")
    p.add_argument("--parties", type=int, nargs="+", default=list(PARTIES))
    p.add_argument("--jobs", type=int, default=2)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if (saved := report.saved_run(args)) is not None:
        records, seconds, argv = saved["records"], saved["seconds"], saved["argv"]
    else:
        run = report.grid(args, seeds=20)
        ns, epsilons, seeds = run.ns, run.epsilons, run.seeds
        seeds_big = args.seeds_1e6 if args.seeds_1e6 is not None else seeds
        jobs = [(n, e, s) for n in sorted(ns, reverse=True) for e in epsilons
                for s in range(seeds_big if n >= 1_000_000 else seeds)]
        print(f"vertical: {len(jobs)} cases, parties {args.parties}, {args.jobs} worker(s)", file=sys.stderr)
        t0 = time.perf_counter()
        records: list[dict] = []

        def done(rs: list[dict]) -> None:
            records.extend(rs)
            for r in rs:
                print(f"[{time.perf_counter() - t0:5.0f}s] P={r['parties']} n={r['n']} eps={r['epsilon']:g} "
                      f"seed={r['seed']}: " + ", ".join(f"{m} {v:.4g}" for m, v in r["ratios"].items()),
                      file=sys.stderr, flush=True)

        if args.jobs > 1:
            with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                for f in [pool.submit(run_case, *j, tuple(args.parties)) for j in jobs]:
                    done(f.result())
        else:
            for j in jobs:
                done(run_case(*j, tuple(args.parties)))
        seconds = time.perf_counter() - t0
        report.save_run(args.out, "vertical_results.json", {"argv": argv, "seconds": round(seconds, 1),
                                                            "delta": experiments.DELTA, "records": records})
    summary = summarize(records)
    plot(summary, os.path.join(args.out, "vertical.png"))
    report.publish(args.out, "vertical_results.md", markdown(summary, records, list(argv), seconds))
    print(f"vertical: wrote {args.out}/vertical_results.md, .json, vertical.png in {seconds:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
