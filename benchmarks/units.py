"""Issue 39's table, redone: raw rows in, coefficients in units out.

    .venv/bin/python -m benchmarks.units [--runs 20] [--n 20000]

Data like the issue's: age ~ U(18, 65), hours ~ U(10, 60), wage = 505 + 30 age + 20 hours +
N(0, 400^2) (wage about 2,500). Each configuration is released --runs times through the clients'
own ``prepare_batch`` and the servers' aggregation in process (``research.experiments.
run_pipeline``: real shares, real noise, real certificates; only the HTTP is left out), and fit
with the analyzer's least squares. Printed per coefficient: mean +- sd (median) and the 90th
percentile of the absolute error against plain least squares on the same rows, over the runs;
and the coverage of the 95% intervals of the release's noise (population=False) around plain
least squares.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from dpsketch.analyzer.estimators import LeastSquares
from research.experiments import run_pipeline
from dpsketch.protocol.study import design

BOUNDS = {"age": [16, 90], "hours": [0, 100], "wage": [0, 10000]}
SERVERS = ["s1", "s2", "s3"]


def rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    age = rng.uniform(18, 65, n)
    hours = rng.uniform(10, 60, n)
    return np.column_stack([age, hours, 505 + 30 * age + 20 * hours + rng.normal(0, 400, n)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--n", type=int, default=20000)
    args = p.parse_args(argv)
    x = rows(args.n, 7)
    design_ = np.column_stack([x[:, :2], np.ones(len(x))])
    truth = np.linalg.lstsq(design_, x[:, 2], rcond=None)[0]  # age, hours, intercept
    cases = [("no bounds, kind sketch (the README as it was)", dict(kind="sketch")),
             ("no bounds, kind auto (gram)", dict(kind="gram")),
             ("bounds, kind auto (gram)", dict(kind="gram", bounds=BOUNDS)),
             ("bounds, kind moments", dict(kind="moments", bounds=BOUNDS)),
             ("bounds, kind sketch", dict(kind="sketch", bounds=BOUNDS))]
    print(f"n = {args.n}, epsilon = 1, delta = 1e-6, {args.runs} releases per row; plain least squares: "
          f"age {truth[0]:.2f}, hours {truth[1]:.2f}, intercept {truth[2]:.1f}\n")
    print("| study | age | hours | intercept | abs error p90 (age, hours, intercept) | 95% coverage |")
    print("|---|---|---|---|---|---|")
    for name, kw in cases:
        study, _ = design(name="units", columns=["age", "hours", "wage"], label="wage", servers=SERVERS,
                          expected_reports=args.n, **kw)
        est, covered = [], []
        for _ in range(args.runs):
            model = LeastSquares("wage").fit(run_pipeline(study, x).release)
            value = np.append(model.coef_, model.intercept_)
            est.append(value)
            if model.fit_intercept_:
                ci = model.conf_int(0.95, population=False)
                covered.append((ci[:, 0] <= truth) & (truth <= ci[:, 1]))
        est = np.array(est)
        cells = [f"{m:.3g} ± {s:.2g} ({md:.3g})" for m, s, md in
                 zip(est.mean(0), est.std(0, ddof=1), np.median(est, 0))]
        p90 = np.quantile(np.abs(est - truth), 0.9, axis=0)
        cover = ", ".join(f"{c:.2f}" for c in np.mean(covered, 0)) if covered else "no intervals (no intercept)"
        print(f"| {name} | {' | '.join(cells)} | {', '.join(f'{v:.3g}' for v in p90)} | {cover} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
