"""Choosing bounds: what their width costs, and what the private pilot proposes (docs/bounds.md).

    .venv/bin/python benchmarks/bounds_choice.py [--runs 50] [--n 20000] [--out docs/experiments]

Two measurements, both simulated in law (``research.experiments.simulate_pipeline``: the study as
the analyzer designs it, its noise drawn with numpy at the study's sigma and the servers' noise):

1. **Width.** Synthetic rows in raw units, age ~ 16-90, hours 0-100, wage = 505 + 30 age +
   20 hours + skewed noise (about 2,500). For each multiplier w, every column's bounds are its
   true 1-99 % range scaled by w about its midpoint; the study is the analyzer's default for
   three columns with bounds (kind gram, epsilon 1, delta 1e-6, replace-one, 3 servers); the
   figure is the released least squares' relative coefficient error ||coef - coef_ols|| /
   ||coef_ols|| against plain least squares with an intercept on the unclamped data, over
   ``--runs`` fresh data sets and releases per point. Below 1 clamping biases the answer; above
   it the data fill less of the row ball, so the same noise weighs more. The pilot's proposal
   (measurement 2 on the same data, epsilon 0.5) is the last point, at its own width.
2. **Pilot proposals.** Eleven column shapes (uniform-ish, normal, lognormal, Pareto,
   zero-inflated, bimodal, 0/1, constant, 1e-3 and 1e6 scales, a normal with negatives), four
   columns per pilot (the noise of a four-axis marginal histogram at epsilon 0.5 and at twice its
   noise), ``--runs`` releases each: the share clamped per tail and the proposed range over the
   true 0.5-99.5 % range, for the proposal (``analyzer.analyses.pilot``) and for the plain quantiles of
   the noisy CDF (``analyzer.analyses.histogram.Quantiles``) it does not use.

Writes ``bounds_width.png`` and ``bounds_results.json`` to ``--out`` and prints both tables.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from dpsketch.analyzer.estimators import LeastSquares
from research.experiments import simulate_pipeline
from dpsketch.analyzer.analyses.histogram import NoisyHistogram, Quantiles
from dpsketch.analyzer.analyses.pilot import pilot_spec, propose_bounds
from dpsketch.protocol.study import design

COLUMNS = ["age", "hours", "wage"]
SERVERS = ["s1", "s2", "s3"]
MULTIPLIERS = (0.5, 0.75, 1.0, 2.0, 4.0, 8.0)


def wages(n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, 3) rows in raw units: age, hours, wage (the two-step test's data, tests/test_pilot.py)."""
    age = np.round(16 + 74 * rng.beta(2, 3, n))
    hours = np.clip(np.round(rng.normal(40, 12, n)), 0, 100)
    wage = 505 + 30 * age + 20 * hours + 600 * (rng.lognormal(0, 0.5, n) - math.exp(0.125))
    return np.column_stack([age, hours, np.round(wage, 2)])


def ols(rows: np.ndarray) -> np.ndarray:
    x = np.column_stack([rows[:, :2], np.ones(len(rows))])
    return np.linalg.lstsq(x, rows[:, 2], rcond=None)[0]


def released_fit(rows: np.ndarray, bounds: list[list[float]], epsilon: float, seed: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, float]:
    study, _ = design(name="bounds-width", columns=COLUMNS, label="wage", servers=SERVERS,
                      expected_reports=len(rows), epsilon=epsilon, kind="gram", bounds=bounds,
                      seed=f"{seed:064x}")
    run = simulate_pipeline(study, study.column_map.to_ball(rows), rng)
    model = LeastSquares("wage").fit(run.release)
    return np.asarray(model.coef_), float(model.intercept_)


def pilot_release(data: dict[str, np.ndarray], epsilon: float, rng: np.random.Generator,
                  noise_scale: float = 1.0) -> NoisyHistogram:
    """A pilot's release over ``data`` in law: exact marginal counts plus the designed noise."""
    spec = pilot_spec(list(data))
    n = len(next(iter(data.values())))
    study, _ = design(name="pilot", kind="histogram", columns=[], label=None, servers=SERVERS,
                      expected_reports=n, epsilon=epsilon, histogram=spec)
    v = (n * study.sigma ** 2 + len(SERVERS) * study.server_sigma ** 2) * noise_scale ** 2
    counts = spec.one_hot(spec.cell_index(np.column_stack(list(data.values())).astype(object))).sum(axis=0)
    return NoisyHistogram(spec, counts + rng.normal(0.0, math.sqrt(v), counts.size), v, n)


def width_study(n: int, runs: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    errors: dict[str, list[float]] = {str(w): [] for w in MULTIPLIERS}
    errors["pilot"] = []
    intercepts: dict[str, list[float]] = {k: [] for k in errors}
    pilot_width: list[float] = []
    for r in range(runs):
        rows = wages(n, rng)
        truth = ols(rows)
        q1, q99 = np.quantile(rows, [0.01, 0.99], axis=0)
        mid, half = (q1 + q99) / 2, (q99 - q1) / 2
        for w in MULTIPLIERS:
            bounds = np.column_stack([mid - w * half, mid + w * half]).tolist()
            coef, intercept = released_fit(rows, bounds, 1.0, 1000 * r + int(100 * w), rng)
            errors[str(w)].append(float(np.linalg.norm(coef - truth[:2]) / np.linalg.norm(truth[:2])))
            intercepts[str(w)].append(abs(intercept - truth[2]))
        proposal = propose_bounds(pilot_release(dict(zip(COLUMNS, rows.T)), 0.5, rng))
        bounds = [proposal.bounds[c] for c in COLUMNS]
        pilot_width.append(float(np.mean([(hi - lo) / (2 * h) for (lo, hi), h in zip(bounds, half)])))
        coef, intercept = released_fit(rows, bounds, 1.0, 1000 * r + 999, rng)
        errors["pilot"].append(float(np.linalg.norm(coef - truth[:2]) / np.linalg.norm(truth[:2])))
        intercepts["pilot"].append(abs(intercept - truth[2]))
    summary = {k: stats(v) | {"intercept_abs_error": stats(intercepts[k])} for k, v in errors.items()}
    summary["pilot"]["width_multiplier"] = stats(pilot_width)
    return {"n": n, "runs": runs, "epsilon": 1.0, "pilot_epsilon": 0.5, "multipliers": list(MULTIPLIERS),
            "relative_coef_error": summary}


def stats(x: list[float]) -> dict[str, float]:
    a = np.asarray(x, dtype=np.float64)
    return {"mean": float(a.mean()), "sd": float(a.std(ddof=1)) if a.size > 1 else 0.0,
            "median": float(np.median(a)), "p90": float(np.quantile(a, 0.9)), "max": float(a.max())}


SHAPES = {
    "age (beta, integers)": lambda n, g: np.round(16 + 74 * g.beta(2, 3, n)),
    "hours (normal, clipped)": lambda n, g: np.clip(np.round(g.normal(40, 12, n)), 0, 100),
    "wage (lognormal)": lambda n, g: g.lognormal(math.log(2500), 0.5, n),
    "0/1": lambda n, g: (g.random(n) < 0.4).astype(float),
    "temperature (normal, +-)": lambda n, g: g.normal(5, 10, n),
    "Pareto 2.5": lambda n, g: 1000 * (g.pareto(2.5, n) + 1),
    "tiny (uniform 1e-3..0.05)": lambda n, g: g.uniform(0.001, 0.05, n),
    "big (normal 3e6)": lambda n, g: g.normal(3e6, 5e5, n),
    "constant 7": lambda n, g: np.full(n, 7.0),
    "zero-inflated wage": lambda n, g: np.where(g.random(n) < 0.3, 0.0, g.lognormal(math.log(2500), 0.5, n)),
    "bimodal": lambda n, g: np.where(g.random(n) < 0.5, g.normal(-100, 10, n), g.normal(300, 30, n)),
}


def proposal_study(n: int, runs: int, seed: int) -> dict:
    """Per shape, per noise level: the share clamped per tail and the width ratio, both ways."""
    rng = np.random.default_rng(seed)
    names = list(SHAPES)
    out: dict = {}
    for scale in (1.0, 2.0):
        rec: dict[str, dict[str, list[float]]] = {s: {"clamped": [], "width": [], "plain_clamped": [],
                                                      "plain_width": []} for s in names}
        for _ in range(runs):
            for start in range(0, len(names), 4):  # four columns a pilot
                group = (names[start:start + 4] + names[:4])[:4]
                data = {f"c{j}": SHAPES[s](n, rng) for j, s in enumerate(group)}
                hist = pilot_release(data, 0.5, rng, scale)
                proposal = propose_bounds(hist)
                for j, s in enumerate(group[:len(names[start:start + 4])]):
                    x = data[f"c{j}"]
                    q_lo, q_hi = np.quantile(x, [0.005, 0.995])
                    span = q_hi - q_lo if q_hi > q_lo else max(abs(q_hi), 1.0)  # a constant: its size
                    lo, hi = proposal.bounds[f"c{j}"]
                    rec[s]["clamped"].append(float(max(np.mean(x < lo), np.mean(x > hi))))
                    rec[s]["width"].append(float((hi - lo) / span))
                    plo, phi = Quantiles(f"c{j}", (0.005, 0.995)).fit(hist).quantiles_
                    rec[s]["plain_clamped"].append(float(max(np.mean(x < plo), np.mean(x > phi))))
                    rec[s]["plain_width"].append(float((phi - plo) / span))
        out[f"noise x{scale:g}"] = {s: {k: stats(v) for k, v in r.items()} for s, r in rec.items()}
    return {"n": n, "runs": runs, "epsilon": 0.5, "columns_per_pilot": 4, "proposals": out}


def plot(width: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = width["relative_coef_error"]
    xs = width["multipliers"]
    mean = [s[str(w)]["mean"] for w in xs]
    sd = [s[str(w)]["sd"] for w in xs]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.errorbar(xs, mean, yerr=sd, marker="o", capsize=3, label="mean +- sd")
    ax.plot(xs, [s[str(w)]["median"] for w in xs], "s--", label="median")
    ax.plot(xs, [s[str(w)]["p90"] for w in xs], "^:", label="90th percentile")
    p = s["pilot"]
    ax.errorbar([p["width_multiplier"]["median"]], [p["mean"]], yerr=[p["sd"]], fmt="*", markersize=12,
                color="black", capsize=3, label="bounds proposed by the pilot (eps 0.5)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{w:g}x" for w in xs])
    ax.set_xlabel("bound width / the data's 1-99 % range")
    ax.set_ylabel("relative coefficient error of least squares")
    ax.set_title(f"Bounds: clamping bias vs noise (n = {width['n']:,}, eps 1, gram, {width['runs']} runs)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=39)
    ap.add_argument("--out", type=Path, default=Path("docs/experiments"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    width = width_study(args.n, args.runs, args.seed)
    proposals = proposal_study(args.n, args.runs, args.seed + 1)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(width, args.out / "bounds_width.png")
    (args.out / "bounds_results.json").write_text(json.dumps({"width": width, **proposals}, indent=1) + "\n")
    print(f"relative coefficient error of least squares, n = {args.n}, {args.runs} runs (mean +- sd, median, p90)")
    for k, v in width["relative_coef_error"].items():
        extra = f"  width {v['width_multiplier']['median']:.2f}x" if k == "pilot" else ""
        print(f"  {k:>6}: {v['mean']:.4f} +- {v['sd']:.4f}, median {v['median']:.4f}, p90 {v['p90']:.4f}; "
              f"intercept |error| median {v['intercept_abs_error']['median']:.1f}{extra}")
    for level, shapes in proposals["proposals"].items():
        print(f"pilot proposals, {level} (eps 0.5, 4 columns): clamped per tail mean / max, width ratio median / max;"
              f" plain CDF quantiles")
        for s, v in shapes.items():
            print(f"  {s:28s} {100 * v['clamped']['mean']:.2f}% / {100 * v['clamped']['max']:.2f}%  "
                  f"{v['width']['median']:.2f} / {v['width']['max']:.3g}   |   plain {100 * v['plain_clamped']['mean']:.2f}% / "
                  f"{100 * v['plain_clamped']['max']:.2f}%  {v['plain_width']['median']:.2f} / {v['plain_width']['max']:.3g}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
