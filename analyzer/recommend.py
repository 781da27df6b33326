"""Which study kind to create for d columns and n expected reports, and what it will cost.

A *gram* study releases the noisy A^T A with central-model noise (sufficient statistics
perturbation spread over the clients) but every client uploads d + d(d+1)/2 + 1 values per
server. A *sketch* study uploads only d values but its release carries noise-by-data terms that
do not shrink with k, so its accuracy approaches the central model only for large n
(docs/accuracy.md). The recommendation therefore is: the gram kind whenever its upload fits the
budget (it was never less accurate in our measurements, n = 10^3 ... 10^6), the sketch kind
otherwise.

With ``predict=True`` the expected error ratios (ridge and PCA, 1.0 = non-private optimum) are
measured by simulating each kind's release on synthetic data of the same n and d, with the same
(epsilon, delta), through the same estimators the analyzer serves -- a prediction for data like
the benchmark's, not a promise about the user's data.

Run ``dpsketch recommend --help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from dpsketch.protocol import features, messages, privacy
from dpsketch.protocol.study import design

#: Default per-server upload budget per report (values of 8 bytes plus the 16-byte report id).
DEFAULT_MAX_SHARE_KIB = 64.0

#: Simulations at larger n are run at this many rows and said so (time and memory bound): at most
#: this many reports, and at most MAX_SIMULATED_CELLS rows x columns of data.
MAX_SIMULATED_REPORTS = 1_000_000
MAX_SIMULATED_CELLS = 20_000_000
#: Above this many columns no prediction is simulated (the data's SVD alone would take minutes).
MAX_PREDICTED_COLUMNS = features.GRAM_MAX_COLUMNS


@dataclass
class KindOption:
    kind: str
    k: int
    s: int
    width: int
    share_bytes: int = field(metadata={"doc": "bytes one server receives per report"})
    upload_bytes: int = field(metadata={"doc": "bytes one client sends in all, to N servers"})
    sigma: float | None
    feasible: bool = True
    note: str = ""
    predicted: dict[str, float] = field(default_factory=dict)


@dataclass
class Recommendation:
    kind: str
    reasons: list[str]
    options: list[KindOption]
    simulated_reports: int | None = None
    reference: dict[str, dict[str, float]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _columns(d: int) -> tuple[list[str], str]:
    return [f"x{i}" for i in range(d - 1)] + ["y"], "y"


def _option(kind: str, d: int, n: int, n_servers: int, design_kwargs: dict) -> KindOption:
    columns, label = _columns(d)
    width = features.width(kind, d)  # type: ignore[arg-type]
    # one record on the wire: report id, proof, share
    share = messages.record_bytes(messages.SHARES_MEDIA_TYPE, width, n_servers)
    try:
        study, _ = design(name="recommend", columns=columns, label=label,
                          servers=[f"s{j}" for j in range(n_servers)], expected_reports=n,
                          kind=kind, **design_kwargs)  # type: ignore[arg-type]
    except ValueError as exc:
        return KindOption(kind, 0, 0, width, share, n_servers * share, None, False, str(exc))
    note = "k <= d: too few reports for a useful sketch" if kind == "sketch" and study.k <= d else ""
    return KindOption(kind, study.k, study.s, width, share, n_servers * share, study.sigma, note=note)


def _predict(options: list[KindOption], d: int, n: int, n_servers: int, design_kwargs: dict,
             seed: int) -> tuple[int, dict[str, dict[str, float]]]:
    from . import error_ratios, simulation, synthetic

    n_sim = min(n, MAX_SIMULATED_REPORTS, max(1000, MAX_SIMULATED_CELLS // d))
    rng = np.random.default_rng(np.random.SeedSequence([0x12EC, n, d, seed]))
    reg = synthetic.regression_data(n_sim, d - 1, seed=seed, clip_quantile=0.99)
    low = synthetic.lowrank_data(n_sim, d, rank=min(synthetic.DEFAULT_RANK, d - 1), seed=seed,
                                 clip_quantile=0.99) if d >= 2 else None
    reference: dict[str, dict[str, float]] = {}
    for opt in options:
        if not opt.feasible:
            continue
        for task, data in (("ridge", reg), ("pca", low)):
            if data is None:
                continue
            study, _ = design(name="recommend", columns=data.columns, label=data.label,
                              servers=[f"s{j}" for j in range(n_servers)], expected_reports=n_sim,
                              kind=opt.kind, **design_kwargs)  # type: ignore[arg-type]
            release = simulation.simulate_ltm(study, data.rows, rng)
            # local and central depend on the rows and the privacy target, not on the kind:
            # simulate them with the first kind only
            first = task not in reference
            ratios = error_ratios.compare(data, study, release, rng=rng, tasks=(task,),
                                        references=first)[task]
            opt.predicted[task] = ratios["ltm"]
            if first:
                reference[task] = {"local": ratios["local"], "central": ratios["central"]}
    return n_sim, reference


def recommend(
    d: int,
    expected_reports: int,
    *,
    n_servers: int = 3,
    epsilon: float = 1.0,
    delta: float = 1e-6,
    row_bound: float = 1.0,
    neighbouring: privacy.Neighbouring = "replace-one",
    t: int = 0,
    epsilon_floor: float | None | str = "default",
    max_share_kib: float = DEFAULT_MAX_SHARE_KIB,
    predict: bool = True,
    seed: int = 0,
) -> Recommendation:
    """Compare the study kinds for d columns (label included) and n expected reports (with the
    server noise of the floor, ``epsilon_floor`` as in ``design()``)."""
    if d < 1:
        raise ValueError("need at least one column")
    if expected_reports < 2:
        raise ValueError("expected_reports must be at least 2")
    if not max_share_kib > 0:
        raise ValueError("max_share_kib must be positive")
    kw = dict(epsilon=epsilon, delta=delta, row_bound=row_bound, neighbouring=neighbouring, t=t,
              epsilon_floor=epsilon_floor)
    options = [_option(kind, d, expected_reports, n_servers, kw) for kind in ("gram", "sketch")]
    gram, sketch = options
    budget = max_share_kib * 1024
    if gram.feasible and gram.share_bytes > budget:
        gram.feasible = False
        gram.note = (f"{gram.share_bytes} bytes per report and server exceed the budget of "
                     f"{budget:.0f} (max_share_kib)")
    if gram.feasible and d > features.GRAM_MAX_COLUMNS:
        gram.feasible = False
    n_sim = None
    reference: dict[str, dict[str, float]] = {}
    if predict and d > MAX_PREDICTED_COLUMNS:
        predict = False
        reasons_extra = [f"no prediction simulated above {MAX_PREDICTED_COLUMNS} columns"]
    else:
        reasons_extra = []
    if predict:
        n_sim, reference = _predict(options, d, expected_reports, n_servers, kw, seed)
    reasons: list[str] = []
    if gram.feasible:
        kind = "gram"
        reasons.append(f"gram: central-model noise on A^T A at {gram.width} values per report "
                       f"({gram.share_bytes} bytes per server, within the budget).")
        if sketch.feasible:
            reasons.append(f"sketch would upload only {sketch.width} values but its release keeps "
                           f"noise-by-data terms that do not shrink with k (docs/accuracy.md).")
    elif sketch.feasible:
        kind = "sketch"
        reasons.append(f"sketch: {sketch.width} values per report; the gram kind is not possible "
                       f"here ({gram.note or 'too many columns'}).")
    else:
        raise ValueError(f"no study kind fits: gram: {gram.note}; sketch: {sketch.note}")
    reasons += reasons_extra
    if predict and all(o.predicted for o in options if o.feasible):
        best = min((o for o in options if o.predicted), key=lambda o: o.predicted.get("ridge", np.inf))
        if gram.feasible and best.kind != "gram":
            reasons.append("note: in this simulation the sketch kind predicted a lower ridge error.")
    return Recommendation(kind, reasons, options, n_sim, reference)


def format_recommendation(rec: Recommendation) -> str:
    lines = [f"recommended kind: {rec.kind}", *("  " + r for r in rec.reasons), ""]
    head = "| kind | k | values/report | bytes/report/server | bytes/client (all servers) | sigma | ridge ratio | PCA ratio |"
    lines += [head, "|---|---|---|---|---|---|---|---|"]
    for o in rec.options:
        if not o.feasible:
            lines.append(f"| {o.kind} | - | {o.width} | {o.share_bytes} | {o.upload_bytes} | - | "
                         f"not possible: {o.note} | |")
            continue
        cells = [f"{o.predicted[t]:.3f}" if t in o.predicted else "-" for t in ("ridge", "pca")]
        note = f" {o.note} |" if o.note else ""
        lines.append(f"| {o.kind} | {o.k} | {o.width} | {o.share_bytes} | {o.upload_bytes} | "
                     f"{o.sigma:.4g} | {cells[0]} | {cells[1]} |{note}")
    for name in ("central", "local"):
        if rec.reference:
            lines.append(f"| ({name} model) | | | | | | {rec.reference.get('ridge', {}).get(name, float('nan')):.3f} | "
                         f"{rec.reference.get('pca', {}).get(name, float('nan')):.3f} |")
    if rec.simulated_reports is not None:
        lines.append(f"\nratios: error / non-private optimum on synthetic data with n = "
                     f"{rec.simulated_reports} (1.0 is perfect); a prediction, not a promise.")
    lines += ["", *OTHER_ANALYSES]
    return "\n".join(lines)


#: What the table above does not cover, measured (printed under every recommendation).
OTHER_ANALYSES = (
    "logistic regression: on the same release, at the non-private model's AUC on the gram kind from "
    "n = 10^5, far from it on the sketch kind (docs/logistic.md);",
    "least absolute deviations / robust regression: a few Huber rounds of moments or gram studies "
    "(`dpsketch study lad`, `study weight-rows`), 2-4x lower coefficient error than least squares under "
    "heavy tails or outliers at n = 10^5; the l1 kind (--kind l1) wins nowhere measured (docs/lad.md);",
    "counts, quantiles, Kendall's tau, AUC, Gini: a histogram study (--histogram-cells M prints its plan; "
    "docs/histogram.md).",
)


def histogram_plan(cells: int, expected_reports: int, *, n_servers: int = 3, epsilon: float = 1.0,
                   delta: float = 1e-6, neighbouring: privacy.Neighbouring = "replace-one", t: int = 0,
                   epsilon_floor: float | None | str = "default",
                   max_share_kib: float = DEFAULT_MAX_SHARE_KIB) -> dict:
    """What a histogram study of ``cells`` cells costs and gives: bytes per report (full shares,
    and with seed compression, where only one server per report gets the full width), the noise
    standard deviation of each released count, and whether the upload fits the budget; beyond it
    a sketched histogram (an OSNAP sketch of the one-hot vectors) would be the tool."""
    import math

    from dpsketch.protocol import accounting, sketch
    from dpsketch.protocol.histogram import MAX_CELLS
    from dpsketch.protocol.study import DEFAULT_EPSILON_FLOOR, DEFAULT_MAX_STUDY_BYTES, default_max_reports

    if not 1 <= cells <= MAX_CELLS:
        raise ValueError(f"a histogram study has 1 .. {MAX_CELLS} cells, not {cells}")
    min_reports = max(t + 1, math.floor(0.9 * expected_reports))  # as design() chooses it
    lam = privacy.choose_lambda_star(min_reports, 1, t)
    floor = max(DEFAULT_EPSILON_FLOOR, epsilon) if epsilon_floor == "default" else epsilon_floor
    noise = accounting.calibrate(neighbouring, "histogram", 1.0, epsilon, delta, lam, cells, floor)  # type: ignore[arg-type]
    full = messages.record_bytes(messages.SHARES_MEDIA_TYPE, cells, n_servers)
    # what a server commits to store: max_reports shares of 8 bytes a cell plus a 16-byte id
    max_reports = default_max_reports(expected_reports)
    storage = max_reports * (sketch.REPORT_ID_BYTES + 8 * cells)
    storage_cells = (DEFAULT_MAX_STUDY_BYTES // max_reports - sketch.REPORT_ID_BYTES) // 8
    seeded = messages.record_bytes(messages.SEEDS_MEDIA_TYPE, cells, n_servers)
    noise_sd = float(np.sqrt(noise.sigma ** 2 * min_reports + n_servers * noise.server_sigma ** 2))
    budget = max_share_kib * 1024
    return {"cells": cells, "share_bytes": full, "upload_bytes": n_servers * full,
            "upload_bytes_seed_compressed": (n_servers - 1) * seeded + full,
            "count_noise_sd": noise_sd, "sigma": noise.sigma, "server_sigma": noise.server_sigma,
            "fits_budget": full <= budget,
            "max_reports": max_reports, "server_storage_bytes": storage,
            "fits_default_server_storage": storage <= DEFAULT_MAX_STUDY_BYTES,
            "max_cells_in_default_storage": int(max(storage_cells, 0)),
            "note": _histogram_note(full, budget, storage, DEFAULT_MAX_STUDY_BYTES, storage_cells)}


def _histogram_note(share: int, budget: float, storage: int, storage_limit: int, storage_cells: int) -> str:
    problems = []
    if share > budget:
        problems.append(f"{share} bytes per report and server exceed the budget of {budget:.0f}")
    if storage > storage_limit:
        problems.append(f"servers would commit {storage / 2**30:.1f} GiB, over their default "
                        f"{storage_limit / 2**30:.0f} GiB a study (at most {max(storage_cells, 0)} cells "
                        f"fit; or a lower max_reports)")
    if not problems:
        return "fits"
    return "; ".join(problems) + ": use coarser bins, or a sketched histogram (not built yet)"


def add_floor_arguments(ap: argparse.ArgumentParser) -> None:
    """``--epsilon-floor`` / ``--no-floor``, for every command that designs a study."""
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--epsilon-floor", type=float, metavar="EPS",
                       help="the floor: each report stays (EPS, delta)-DP with no other honest report "
                            "and all servers but one colluding; the servers add noise for it "
                            "(default: max(4, epsilon); docs/trust.md)")
    group.add_argument("--no-floor", action="store_true",
                       help="promise no floor (no server noise; share servers refuse such a study by default)")


def floor_argument(args: argparse.Namespace) -> float | None | str:
    """design()'s epsilon_floor from the flags of :func:`add_floor_arguments`."""
    if getattr(args, "no_floor", False):
        return None
    return "default" if getattr(args, "epsilon_floor", None) is None else args.epsilon_floor


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dpsketch recommend",
        description="Say which study kind (gram or sketch) suits d columns and n expected reports: "
        "upload size per client and predicted error ratios of each kind, by simulation on "
        "synthetic data with the same n, d, epsilon and delta.")
    ap.add_argument("--d", type=int, help="number of columns, label included (for regression and PCA)")
    ap.add_argument("--histogram-cells", type=int, metavar="W",
                    help="instead of --d: the cost and the count noise of a histogram study of W cells")
    ap.add_argument("--expected-reports", "-n", type=int, required=True)
    ap.add_argument("--servers", type=int, default=3, help="number of share servers (default 3)")
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--row-bound", type=float, default=1.0)
    ap.add_argument("--neighbouring", choices=["replace-one", "add-remove"], default="replace-one")
    ap.add_argument("--t", type=int, default=0, help="tolerated colluding clients")
    add_floor_arguments(ap)
    ap.add_argument("--max-share-kib", type=float, default=DEFAULT_MAX_SHARE_KIB,
                    help=f"upload budget per report and server (default {DEFAULT_MAX_SHARE_KIB:g} KiB)")
    ap.add_argument("--no-predict", action="store_true", help="skip the simulation (instant)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.histogram_cells is not None:
        try:
            plan = histogram_plan(args.histogram_cells, args.expected_reports, n_servers=args.servers,
                                  epsilon=args.epsilon, delta=args.delta, neighbouring=args.neighbouring,
                                  t=args.t, epsilon_floor=floor_argument(args), max_share_kib=args.max_share_kib)
        except ValueError as exc:
            print(f"dpsketch recommend: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(plan, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in plan.items()))
        return 0
    if args.d is None:
        parser.error("give --d (columns) or --histogram-cells")
    try:
        rec = recommend(args.d, args.expected_reports, n_servers=args.servers, epsilon=args.epsilon,
                        delta=args.delta, row_bound=args.row_bound, neighbouring=args.neighbouring,
                        t=args.t, epsilon_floor=floor_argument(args), max_share_kib=args.max_share_kib,
                        predict=not args.no_predict)
    except ValueError as exc:
        print(f"dpsketch recommend: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rec.as_dict(), indent=2) if args.json else format_recommendation(rec))
    return 0
