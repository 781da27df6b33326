"""How far one report moves a sketch study's ridge answer, with and without validity proofs
(issue 40's table), in process, over repeated releases.

A sketch study of d columns (the label last) with the secret sign and the default floor, n
honest rows of a linear model inside the ball; every release is the ring sum of the sketch of
the clients' noisy signed vectors plus N servers' noise (what the servers release, computed here
with the product's own kernels). For each seed the ridge coefficients are fitted on:

* the honest release;
* plus the issue's attack without proofs: one report carrying the row [1000, 0, ..., -40000]
  (4 10^4 B), which a study without validity stores and sums;
* plus the strongest report a study with validity accepts: the same direction at the norm bound
  R h (B plus the noise allowance), which is the most a malicious client can send there (the
  attack itself is refused at every server: tests/test_validity_round_attacks.py);
* plus an honest report at the bound: the same direction at norm B, with its own noise.

Reported: the shift of the coefficients from the honest fit, ||theta' - theta||, mean +- sd
(median) and the 90th percentile over the seeds, and the honest fit's own error against the
model, for scale.

    .venv/bin/python benchmarks/validity_influence.py                 # n = 10^5, d = 10, 20 seeds
    .venv/bin/python benchmarks/validity_influence.py --n 20000 --seeds 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analyzer.estimators import RidgeRegression  # noqa: E402
from analyzer.release import SketchRelease  # noqa: E402
from client_sdk import noise as client_noise  # noqa: E402
from client_sdk.prepare import signed_vectors  # noqa: E402
from dpsketch.protocol import ring, sketch, validity  # noqa: E402
from dpsketch.protocol.keystream import Keystream  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402


def _ring_sketch(study, ids, encoded) -> np.ndarray:
    acc = np.zeros(study.aggregate_shape, dtype=np.uint64)
    rows, signs = study.hash_report_ids(ids)
    sketch.accumulate(acc, rows, signs, encoded)
    return acc


def _fit(study, ring_sum, n) -> np.ndarray:
    release = SketchRelease.from_ring_sum(study, ring_sum, n)
    return RidgeRegression(label=study.label).fit(release).coef_


def run(n: int, d: int, seeds: int) -> dict:
    columns = [f"x{i}" for i in range(d - 1)] + ["y"]
    study = design(name="influence", columns=columns, label="y", servers=["s0", "s1", "s2"],
                   expected_reports=n, validity=True)[0]
    grid = study.noise_grid
    reach = validity.bound_value(study)  # R h: the largest norm a valid report has
    direction = np.zeros(d)
    direction[0], direction[-1] = 1000.0, -40000.0
    unit = direction / np.linalg.norm(direction)
    shifts: dict[str, list[float]] = {"attack without proofs": [], "strongest valid report": [],
                                      "honest report at the bound": []}
    errors = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        theta = rng.normal(size=d - 1)
        x = rng.normal(size=(n, d - 1))
        y = x @ theta + rng.normal(size=n)
        rows = np.column_stack([x, y])
        scale = 1.0 / np.quantile(np.linalg.norm(rows, axis=1), 0.99)
        rows *= scale
        stream = Keystream()
        encoded = client_noise.noisy_encoded(signed_vectors(rows, study, stream), study, stream)
        ids = [stream.array(16).tobytes() for _ in range(n)]
        base = _ring_sketch(study, ids, encoded)
        for _ in range(study.n_servers):
            base += study.server_noise()
        honest = _fit(study, base, n)
        errors.append(float(np.linalg.norm(honest - theta)))
        extra_id = [stream.array(16).tobytes()]
        attack = ring.encode(direction[None, :], study.frac_bits, 1e5)
        valid = ring.encode_on_grid(unit[None, :] * (reach - grid.spacing), study.frac_bits, grid.shift,
                                    1e3).view(np.uint64)
        at_bound = client_noise.noisy_encoded(unit[None, :] * study.clip_bound, study, stream)
        for name, vec in (("attack without proofs", attack), ("strongest valid report", valid),
                          ("honest report at the bound", at_bound)):
            moved = _fit(study, base + _ring_sketch(study, extra_id, vec), n + 1)
            shifts[name].append(float(np.linalg.norm(moved - honest)))
        assert validity.within(validity.plan(study), validity.grid_units(validity.plan(study), valid)).all()
    return {"n": n, "d": d, "seeds": seeds, "reach": reach, "row_bound": study.row_bound,
            "honest_error": errors, "shifts": shifts}


def _summary(values: list[float]) -> str:
    return (f"{statistics.mean(values):.4g} ± {statistics.stdev(values):.2g} "
            f"({statistics.median(values):.4g}), p90 {float(np.quantile(values, 0.9)):.4g}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--d", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args(argv)
    out = run(args.n, args.d, args.seeds)
    print(f"n = {out['n']}, d = {out['d']}, {out['seeds']} seeds; a valid report's norm is at most "
          f"{out['reach']:.3f} (B = {out['row_bound']:g})")
    print("| report added | ||theta' - theta|| mean ± sd (median), p90 |")
    print("|---|---|")
    print(f"| (honest fit's own error against the model) | {_summary(out['honest_error'])} |")
    for name, values in out["shifts"].items():
        print(f"| {name} | {_summary(values)} |")


if __name__ == "__main__":
    main()
