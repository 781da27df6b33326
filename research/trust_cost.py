"""What the server noise floor costs in accuracy (docs/trust.md, "The price of the floor").

For each study kind, report count n and floor setting (none, epsilon_floor = 4, epsilon_floor =
epsilon: the servers' noise alone, the DAP model), this designs the study exactly as the
analyzer does for a three-server cluster, simulates its release with the real sketch hash, the
calibrated client noise and the three servers' noise (``simulation.simulate_ltm``), and reports
ridge and PCA error ratios to the non-private optimum on the synthetic data of paper 000
section 5 (``analyzer.synthetic``), the same data for every setting so that only the noise
differs. The local and central models of the same rows are the yardsticks.

    .venv/bin/python -m research.trust_cost --n 1e4 1e5 1e6 --seeds 20

The figures in docs/trust.md come from ``python -m research.figures --only trust_cost``, which
runs :func:`run` one seed at a time and prints mean ± sd (median), p90 (design()'s defaults: a
sketch study is signed, docs/secret_sign.md, its k from default_k). This command's own cells:
mean ± sample sd (median) over the seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

import numpy as np

from dpsketch.protocol import design

from dpsketch.analyzer import simulation, synthetic

from . import evaluation

FLOORS: dict[str, float | None | str] = {"none": None, "4": 4.0, "epsilon": "epsilon"}
SERVERS = ["s1", "s2", "s3"]


def cell_noise_variance(study, n: int) -> float:
    """Noise variance of one released cell: sigma^2 n / k from the clients (about: S S^T ~ n/k),
    N server_sigma^2 from the servers. The floor's deterministic cost, next to the noisy ratios."""
    return study.sigma ** 2 * n / study.k + study.n_servers * study.server_sigma ** 2


def _floor(setting: float | None | str, epsilon: float) -> float | None:
    return epsilon if setting == "epsilon" else setting  # type: ignore[return-value]


def run(ns: Sequence[int], seeds: Sequence[int], *, d: int = 10, epsilon: float = 1.0,
        kinds: Sequence[str] = ("sketch", "gram")) -> dict:
    """{kind: {n: {floor: {"ridge": [...], "pca": [...], "sigma", "server_sigma"}}}} plus the
    local and central references per n."""
    out: dict = {"kinds": {}, "references": {}}
    for n in ns:
        refs: dict[str, list[float]] = {"ridge_local": [], "ridge_central": [], "pca_local": [], "pca_central": []}
        for seed in seeds:
            reg = synthetic.regression_data(n, d, seed=seed, clip_quantile=0.99)
            low = synthetic.lowrank_data(n, d, rank=synthetic.DEFAULT_RANK, seed=seed + 1000, clip_quantile=0.99)
            first = True
            for kind in kinds:
                for name, setting in FLOORS.items():
                    cell = out["kinds"].setdefault(kind, {}).setdefault(n, {}).setdefault(
                        name, {"ridge": [], "pca": []})
                    for task, data in (("ridge", reg), ("pca", low)):
                        study, _ = design(name="cost", columns=data.columns, label=data.label,
                                          servers=SERVERS, expected_reports=n, epsilon=epsilon,
                                          kind=kind, epsilon_floor=_floor(setting, epsilon))
                        rng = np.random.default_rng([seed, n, len(name), len(kind)])
                        release = simulation.simulate_ltm(study, data.rows, rng)
                        ratios = evaluation.compare(data, study, release, rng=rng, tasks=(task,),
                                                    references=first)[task]
                        cell[task].append(ratios["ltm"])
                        cell["sigma"], cell["server_sigma"] = study.sigma, study.server_sigma
                        cell["k"], cell["signed"] = study.k, study.secret_sign
                        cell["cell_noise_variance"] = cell_noise_variance(study, n)
                        if first:
                            refs[f"{task}_local"].append(ratios["local"])
                            refs[f"{task}_central"].append(ratios["central"])
                    first = False
        out["references"][n] = refs
    return out


def _mean(values: list[float]) -> str:
    """mean ± sample sd (median) over the runs."""
    if not values:
        return "-"
    m = float(np.mean(values))
    digits = 4 if m > 1.1 else 6  # ratios near 1 differ in the later digits
    if len(values) < 2:
        return f"{m:.{digits}g}"
    return f"{m:.{digits}g} ± {float(np.std(values, ddof=1)):.2g} ({float(np.median(values)):.{digits}g})"


def format_table(result: dict, epsilon: float) -> str:
    lines = ["| kind | n | floor | client sigma | server sigma | noise variance per cell (x floor off) | ridge | PCA |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, by_n in result["kinds"].items():
        for n, by_floor in by_n.items():
            base = by_floor.get("none", {}).get("cell_noise_variance")
            for name, cell in by_floor.items():
                floor = {"none": "none", "4": "4", "epsilon": f"= epsilon ({epsilon:g})"}[name]
                var = cell.get("cell_noise_variance")
                rel = f"{var:.4g} ({var / base:.2f}x)" if var is not None and base else "-"
                lines.append(f"| {kind} | {n:.0e} | {floor} | {cell['sigma']:.4g} | "
                             f"{cell['server_sigma']:.4g} | {rel} | {_mean(cell['ridge'])} | {_mean(cell['pca'])} |")
    lines.append("")
    lines.append("| n | ridge local | ridge central | PCA local | PCA central |")
    lines.append("|---|---|---|---|---|")
    for n, refs in result["references"].items():
        lines.append(f"| {n:.0e} | {_mean(refs['ridge_local'])} | {_mean(refs['ridge_central'])} | "
                     f"{_mean(refs['pca_local'])} | {_mean(refs['pca_central'])} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research.trust_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", nargs="+", type=float, default=[1e4, 1e5, 1e6], help="report counts")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--d", type=int, default=10, help="feature columns (default: %(default)s)")
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--kinds", nargs="+", default=["sketch", "gram"], choices=["sketch", "gram"])
    ap.add_argument("--json", help="also write the raw ratios to this file")
    ap.add_argument("--from-json", metavar="FILE", help="print the table of an earlier --json run")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            raw = json.load(f)
        result = {"kinds": {k: {int(n): v for n, v in by_n.items()} for k, by_n in raw["kinds"].items()},
                  "references": {int(n): v for n, v in raw["references"].items()}}
        print(format_table(result, args.epsilon))
        return 0
    ns = [int(n) for n in args.n]
    result = run(ns, range(args.seeds), d=args.d, epsilon=args.epsilon, kinds=args.kinds)
    print(format_table(result, args.epsilon))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else o)
    return 0


if __name__ == "__main__":
    sys.exit(main())
