"""The scaffold every analysis' evaluation shares: its command line's grid, its saved run, its report.

An evaluation (``lad_evaluation``, ``logistic_evaluation``, ``vertical_evaluation``) runs a grid
of report counts n, privacy targets epsilon and seeds, saves every run's record as JSON next to
its figures, and writes a markdown report (the tables under docs/experiments/) that it also
prints. ``--from-json`` redraws the figures and the report from a saved run without running
anything; ``--quick`` is the bounded form the tests run. What differs between the evaluations
(their mechanisms, records, tables and plots) stays in each module.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Where the figures, the saved runs and the reports go by default.
DEFAULT_OUT = "docs/experiments"
#: The grid every evaluation runs by default, and with ``--quick`` (one run per point).
NS = (10_000, 100_000, 1_000_000)
EPSILONS = (0.5, 1.0, 4.0)
QUICK_NS = (10_000, 100_000)
QUICK_EPSILONS = (1.0,)


def add_grid_arguments(p: argparse.ArgumentParser, *, out: str | None = None, n: str, epsilons: str, seeds: str,
                       quick: str, from_json: str) -> None:
    """The options every evaluation has, each with its module's help text: --out, --n,
    --epsilons, --seeds, --quick and --from-json."""
    p.add_argument("--out", default=DEFAULT_OUT, help=out)
    p.add_argument("--n", type=float, nargs="+", default=None, help=n)
    p.add_argument("--epsilons", type=float, nargs="+", default=None, help=epsilons)
    p.add_argument("--seeds", type=int, default=None, help=seeds)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--from-json", metavar="FILE", help=from_json)


@dataclass(frozen=True)
class Grid:
    """The report counts, privacy targets and runs per point that one invocation runs."""

    ns: list[int]
    epsilons: list[float]
    seeds: int


def grid(args: argparse.Namespace, *, seeds: int) -> Grid:
    """The grid the options ask for: ``--n``, ``--epsilons`` and ``--seeds`` where given, else the
    defaults above (``seeds`` runs per point), or the quick ones (one run per point) with ``--quick``."""
    return Grid(ns=[int(n) for n in (args.n or (QUICK_NS if args.quick else NS))],
                epsilons=[float(e) for e in (args.epsilons or (QUICK_EPSILONS if args.quick else EPSILONS))],
                seeds=args.seeds if args.seeds is not None else (1 if args.quick else seeds))


def stats(values: Sequence[float]) -> dict[str, float]:
    """mean, sample sd (ddof 1), median, 90th percentile, largest value and number of runs: the
    summary every figure in the docs quotes (a right-skewed ratio needs its median and tail, not
    its mean alone)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"mean": math.nan, "sd": math.nan, "median": math.nan, "p90": math.nan, "max": math.nan, "runs": 0}
    return {"mean": float(v.mean()), "sd": float(v.std(ddof=1)) if v.size > 1 else 0.0,
            "median": float(np.median(v)), "p90": float(np.percentile(v, 90)), "max": float(v.max()),
            "runs": int(v.size)}


def number(v: float, digits: int = 3) -> str:
    """``digits`` significant digits (no exponent for ordinary sizes)."""
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-4):
        return f"{v:.{max(digits - 1, 1)}e}"
    if abs(v) >= 10 ** digits:
        return f"{v:.0f}"
    out = f"{v:#.{digits}g}"
    return out.rstrip(".") if "e" not in out else out


def cell(s: dict[str, float], digits: int = 3, *, near_one: bool = True) -> str:
    """The docs' form of a summary: "mean ± sd (median), p90 x"; a ratio within 1 % above 1 as
    "1 + excess" so its excess stays readable; one run alone as its value; no runs as "-"."""
    if not s or s.get("runs", 0) == 0 or not math.isfinite(s["mean"]):
        return "-"
    if near_one and 1.0 <= s["mean"] < 1.01 and s["median"] >= 1.0:
        ex = lambda v: f"{v - 1.0:.1e}"  # noqa: E731
        if s["runs"] == 1:
            return f"1 + {ex(s['mean'])}"
        return f"1 + {ex(s['mean'])} ± {s['sd']:.1e} ({ex(s['median'])}), p90 1 + {ex(s['p90'])}"
    if s["runs"] == 1:
        return number(s["mean"], digits)
    return (f"{number(s['mean'], digits)} ± {number(s['sd'], 2)} ({number(s['median'], digits)}), "
            f"p90 {number(s['p90'], digits)}")


def group(records: Sequence[dict[str, Any]], *fields: str) -> dict[tuple, list[dict[str, Any]]]:
    """The runs of each point: the records by the values of ``fields`` (for example dataset, n,
    epsilon and mechanism), in the order they first appear."""
    out: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault(tuple(r[f] for f in fields), []).append(r)
    return out


def saved_run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Make the output folder; the saved run ``--from-json`` names (its records, argv, seconds and
    whatever the module saved), or None: run the grid."""
    os.makedirs(args.out, exist_ok=True)
    if not args.from_json:
        return None
    with open(args.from_json) as fh:
        return json.load(fh)


def save_run(out: str, name: str, run: dict[str, Any]) -> None:
    """Save a run's records and parameters as ``out/name`` (numpy numbers as floats)."""
    with open(os.path.join(out, name), "w") as fh:
        json.dump(run, fh, indent=1, default=float)


def generated_by(command: str, argv: Sequence[str], seconds: float, source: str) -> str:
    """The report's first sentence: which command wrote it, how long it took on what machine, and
    which module says exactly what runs."""
    return (f"Generated by `{command} {' '.join(argv)}`".rstrip() +
            f" in {seconds:.0f} s on {platform.machine()} ({os.cpu_count()} cores); "
            f"`{source}` says exactly what runs.")


def publish(out: str, name: str, markdown: str) -> int:
    """Write the report as ``out/name`` and print it; 0, the command's exit status."""
    with open(os.path.join(out, name), "w") as fh:
        fh.write(markdown)
    print(markdown)
    return 0
