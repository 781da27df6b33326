"""What validity proofs cost the accuracy of a study at epsilon = its floor (docs/validity.md
section 14), in process, over repeated releases: a study with no client noise (sigma = 0), the
servers' floor noise carrying the whole guarantee, designed twice on the same rows, with and
without ``validity``. With proofs the grid comes from the servers' noise and max_reports
(validity.floor_grid, about 2^20 steps per server noise at n = 10^5) and clients clip a hair
under B; without them the grid is the ring's usual one (2^24 steps of the widest noise).

Every release is the ring sum of the sketch (or the plain sum, gram) of the clients' encoded
vectors (the SDK's own: clipped, signed in a signed sketch study, rounded to the grid) plus N
servers' floor noise, decoded as the analyzer decodes it. Reported per kind: the ridge error
||theta_hat - theta|| with and without proofs, mean +- sd (median), p90, and the per-seed ratio;
the server_sigma of each design; and how far the strongest valid report reaches (R h / B: 1 plus
rounding at the floor, against 2.2 at epsilon = 1).

    .venv/bin/python benchmarks/validity_floor.py                       # n = 10^5, d = 10, 20 seeds
    .venv/bin/python benchmarks/validity_floor.py --n 20000 --seeds 5
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dpsketch.client_sdk.prepare import signed_vectors  # noqa: E402
from dpsketch.protocol import report as report_path  # noqa: E402
from dpsketch.protocol import validity  # noqa: E402
from dpsketch.protocol.keystream import Keystream  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402
from validity_influence import _fit, _fit_gram, _ring_sketch, _ring_sum, _summary, regression_rows  # noqa: E402


def run(kind: str, n: int, d: int, seeds: int) -> dict:
    columns = [f"x{i}" for i in range(d - 1)] + ["y"]
    args = dict(name=f"floor-{kind}", columns=columns, label="y", servers=["s0", "s1", "s2"],
                expected_reports=n, kind=kind, epsilon=4.0)
    plain, proved = design(**args)[0], design(**args, validity=True)[0]
    assert plain.sigma == proved.sigma == 0 and proved.epsilon_floor == 4.0
    errors: dict[str, list[float]] = {"without proofs": [], "with proofs": [], "ratio": []}
    for seed in range(seeds):
        theta, rows = regression_rows(seed, n, d)
        for name, study in (("without proofs", plain), ("with proofs", proved)):
            stream = Keystream()
            if kind == "gram":
                total = _ring_sum(report_path.privatize_encoded(rows, study, stream))
                for _ in range(study.n_servers):
                    total = total + study.server_noise()
                coef = _fit_gram(study, total, n)
            else:
                vectors = (signed_vectors(rows, study, stream) if study.secret_sign
                           else report_path.clipped_rows(rows, study))
                encoded = report_path.noisy_encoded(vectors, study, stream)
                ids = [stream.array(16).tobytes() for _ in range(n)]
                total = _ring_sketch(study, ids, encoded)
                for _ in range(study.n_servers):
                    total += study.server_noise()
                coef = _fit(study, total, n)
            errors[name].append(float(np.linalg.norm(coef - theta)))
        errors["ratio"].append(errors["with proofs"][-1] / errors["without proofs"][-1])
    plan = validity.plan(proved)
    reach = (validity.bound_value(proved) if kind != "gram"
             else math.sqrt(plan.circuit.r2_row) * math.sqrt(proved.noise_grid.spacing))
    return {"kind": kind, "n": n, "d": d, "seeds": seeds, "errors": errors,
            "server_sigma": (plain.server_sigma, proved.server_sigma), "k": (plain.k, proved.k),
            "grid_steps": proved.server_noise_std / proved.noise_grid.spacing, "clip_bound": proved.clip_bound,
            "reach_over_B": reach / proved.row_bound, "input_len": plan.input_len, "proof_len": plan.proof_len}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--d", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--kinds", nargs="+", default=["sketch", "gram"], choices=["sketch", "gram"])
    args = parser.parse_args(argv)
    for kind in args.kinds:
        out = run(kind, args.n, args.d, args.seeds)
        print(f"{kind}: n = {out['n']}, d = {out['d']}, {out['seeds']} seeds, k = {out['k']}, "
              f"server_sigma {out['server_sigma'][0]:.6g} (without) / {out['server_sigma'][1]:.6g} (with), "
              f"{out['grid_steps']:.4g} grid steps per server noise, clip bound {out['clip_bound']:.7g}, "
              f"a valid report reaches {out['reach_over_B']:.6f} B; {out['input_len']} input and "
              f"{out['proof_len']} proof elements a report")
        for name, values in out["errors"].items():
            print(f"  {'ridge error ' + name if name != 'ratio' else 'ratio with / without'}: {_summary(values)}")


if __name__ == "__main__":
    main()
