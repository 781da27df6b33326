"""How far one report moves a sketch (or gram) study's ridge answer, with and without validity
proofs (issue 40's table), in process, over repeated releases.

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

With ``--kind gram`` (docs/validity.md section 12): a gram study with the default floor, designed
twice (with and without ``validity``) on the same rows; every release is the ring sum of the
clients' noisy features (the SDK's own noise: raw products with the strict upper triangle's noise
at sigma / sqrt(2) for the study with proofs) plus N servers' noise, decoded as the analyzer
decodes it. Reported: the ridge error ||theta_hat - theta|| with and without proofs and their
ratio per seed, and the shift of the coefficients when one more report is added: the issue's
gram attack in a study without proofs (-10,935 on the x1*y feature only), the strongest report
the study with proofs accepts in that direction (a row of norm R_r g with x1 = -y, its noise all
on x1*y at the weighted bound R), and an honest report at the bound (x1 = -y, norm B').

    .venv/bin/python benchmarks/validity_influence.py                 # n = 10^5, d = 10, 20 seeds
    .venv/bin/python benchmarks/validity_influence.py --n 20000 --seeds 20
    .venv/bin/python benchmarks/validity_influence.py --kind gram     # n = 10^5, d = 10, 20 seeds
    .venv/bin/python benchmarks/validity_influence.py --kind parties  # two parties, n = 10^5, d = 10

With ``--kind parties`` (docs/validity.md section 13): a signed sketch study with two parties and
validity, one more individual whose second party's block is the attack, the strongest block the
party's predicate accepts, or an honest block at the party's bound (:func:`run_parties`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpsketch.analyzer.estimators import RidgeRegression  # noqa: E402
from dpsketch.analyzer.release import SketchRelease, release_from_ring_sum  # noqa: E402
from dpsketch.protocol import report as report_path  # noqa: E402
from dpsketch.client_sdk.prepare import signed_vectors  # noqa: E402
from dpsketch.protocol import ring, sketch, validity  # noqa: E402
from dpsketch.protocol.keystream import Keystream  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402



def regression_rows(seed: int, n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(theta, rows): n rows of d - 1 standard normal features and y = x theta + N(0, 1), scaled
    so that 99 % of rows lie in the unit ball (the study's bound), as every part of this
    benchmark draws them."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=d - 1)
    x = rng.normal(size=(n, d - 1))
    rows = np.column_stack([x, x @ theta + rng.normal(size=n)])
    return theta, rows / np.quantile(np.linalg.norm(rows, axis=1), 0.99)

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
        theta, rows = regression_rows(seed, n, d)
        stream = Keystream()
        encoded = report_path.noisy_encoded(signed_vectors(rows, study, stream), study, stream)
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
        at_bound = report_path.noisy_encoded(unit[None, :] * study.clip_bound, study, stream)
        for name, vec in (("attack without proofs", attack), ("strongest valid report", valid),
                          ("honest report at the bound", at_bound)):
            moved = _fit(study, base + _ring_sketch(study, extra_id, vec), n + 1)
            shifts[name].append(float(np.linalg.norm(moved - honest)))
        assert validity.within(validity.plan(study), validity.grid_units(validity.plan(study), valid)).all()
    return {"n": n, "d": d, "seeds": seeds, "reach": reach, "row_bound": study.row_bound,
            "honest_error": errors, "shifts": shifts}


def _ring_sum(encoded: np.ndarray) -> np.ndarray:
    return encoded.view(np.uint64).sum(axis=0, dtype=np.uint64)[None]  # wraps mod 2^64, as the ring


def _fit_gram(study, ring_sum, n) -> np.ndarray:
    return RidgeRegression(label=study.label).fit(release_from_ring_sum(study, ring_sum, n)).coef_


def _strongest_valid(study, d: int) -> np.ndarray:
    """The ring encoding of the valid report that moves x1*y furthest down: the witness row with
    x1 = -y at norm R_r g, and its noise all on the x1*y coordinate at the weighted bound."""
    plan = validity.plan(study)
    c = plan.circuit
    grid = study.noise_grid
    reach = math.isqrt(c.r2_row) / math.sqrt(2.0)  # witness units, each of the two coordinates
    r = np.zeros((1, d), dtype=np.int64)
    r[0, 0], r[0, -1] = math.floor(reach), -math.floor(reach)
    e = np.zeros((1, c.w), dtype=np.int64)
    k = d + d + list(zip(*np.triu_indices(d, k=1), strict=True)).index((0, d - 1))
    e[0, k] = -math.isqrt(c.r2 // 2)
    assert c.within(r, e).all()
    units = c.features(r) + e
    return (units << grid.shift).view(np.uint64)


def run_gram(n: int, d: int, seeds: int) -> dict:
    columns = [f"x{i}" for i in range(d - 1)] + ["y"]
    args = dict(name="gram-validity", columns=columns, label="y", servers=["s0", "s1", "s2"],
                expected_reports=n, kind="gram")
    plain, proved = design(**args)[0], design(**args, validity=True)[0]
    attack = np.zeros((1, plain.width))
    k = d + d + list(zip(*np.triu_indices(d, k=1), strict=True)).index((0, d - 1))
    attack[0, k] = -10_935 * math.sqrt(2.0)  # the feature is sqrt(2) x1 y: the Gram entry moves by -10,935
    strongest = _strongest_valid(proved, d)
    bound_row = np.zeros((1, d))
    bound_row[0, 0], bound_row[0, -1] = 1.0, -1.0
    bound_row *= proved.clip_bound / math.sqrt(2.0)
    errors: dict[str, list[float]] = {"without proofs": [], "with proofs": [], "ratio": []}
    shifts: dict[str, list[float]] = {"the attack, study without proofs": [], "strongest valid report": [],
                                      "honest report at the bound": []}
    for seed in range(seeds):
        theta, rows = regression_rows(seed, n, d)
        fits = {}
        for name, study in (("without proofs", plain), ("with proofs", proved)):
            stream = Keystream()
            total = _ring_sum(report_path.privatize_encoded(rows, study, stream))
            for _ in range(study.n_servers):
                total = total + study.server_noise()
            fits[name] = (study, total, _fit_gram(study, total, n))
            errors[name].append(float(np.linalg.norm(fits[name][2] - theta)))
        errors["ratio"].append(errors["with proofs"][-1] / errors["without proofs"][-1])
        study, base, honest_plain = fits["without proofs"]
        moved = _fit_gram(study, base + ring.encode(attack, study.frac_bits, 1e5), n + 1)
        shifts["the attack, study without proofs"].append(float(np.linalg.norm(moved - honest_plain)))
        study, base, honest = fits["with proofs"]
        for name, vec in (("strongest valid report", strongest),
                          ("honest report at the bound", report_path.privatize_encoded(bound_row, study))):
            moved = _fit_gram(study, base + vec, n + 1)
            shifts[name].append(float(np.linalg.norm(moved - honest)))
    return {"n": n, "d": d, "seeds": seeds, "errors": errors, "shifts": shifts,
            "sigma": proved.sigma, "allowance_sigmas": math.sqrt(validity.plan(proved).bound)
            * proved.noise_grid.spacing / proved.sigma}


def run_parties(n: int, d: int, seeds: int) -> dict:
    """A signed sketch study with two parties (the first half of the columns, then the rest with
    the label) and validity: n honest individuals (each party's block clipped to its bound, signed
    with the party-key sign, its noise; report_path.block_vectors), and one more individual whose first
    party's block is honest and whose second party's block is (a) the issue's attack in a study
    without proofs (its label at -40,000 B), (b) the strongest block a study with proofs accepts
    from that party (the same direction at its norm bound R_j h, checked to satisfy its party's
    predicate), (c) an honest block at the party's bound B_j (the same direction, its own noise);
    and, for scale, (d) an honest individual at the bound in every party (the same direction in
    the second party's columns). The shift of the ridge coefficients from the honest fit."""
    from dpsketch.protocol import parties

    columns = [f"x{i}" for i in range(d - 1)] + ["y"]
    half = d // 2
    spec = [{"name": "a", "columns": columns[:half]}, {"name": "b", "columns": columns[half:]}]
    study = design(name="influence-parties", columns=columns, label="y", servers=["s0", "s1", "s2"],
                   expected_reports=n, parties=spec, secret_sign=True, validity=True)[0]
    grid = study.noise_grid
    plan = validity.party_plan(study, 1)
    reach = math.sqrt(plan.bound) * grid.spacing  # R_j h: the largest norm a valid block of party b has
    direction = np.zeros(d - half)
    direction[0], direction[-1] = 1000.0, -40000.0
    unit = direction / np.linalg.norm(direction)
    names = ("attack without proofs", "strongest valid block", "honest block at the party's bound",
             "honest individual at the bound")
    shifts: dict[str, list[float]] = {name: [] for name in names}
    errors = []
    key = parties.new_key()
    for seed in range(seeds):
        theta, rows = regression_rows(seed, n, d)
        ids = parties.pseudonyms(key, study.study_id, [f"{seed}/{i}" for i in range(n + 1)])
        signs = parties.signs(key, study.study_id, ids)
        stream = Keystream()
        encoded = np.concatenate(
            [report_path.noisy_encoded(report_path.block_vectors(study, q.name, rows[:, cols], signs[:n]), study, stream)
             for q, cols in zip(study.parties, parties.slices(study.parties))], axis=1)
        base = _ring_sketch(study, ids[:n], encoded)
        for _ in range(study.n_servers):
            base += study.server_noise()
        honest = _fit(study, base, n)
        errors.append(float(np.linalg.norm(honest - theta)))
        first = report_path.noisy_encoded(report_path.block_vectors(study, "a", rows[:1, :half] * 0, signs[n:]),
                                           study, stream)
        valid = ring.encode_on_grid(unit[None, :] * (reach - grid.spacing), study.frac_bits, grid.shift,
                                    1e3).view(np.uint64)
        assert validity.within(plan, validity.grid_units(plan, valid)).all()
        blocks = {"attack without proofs": ring.encode(direction[None, :], study.frac_bits, 1e5),
                  "strongest valid block": valid,
                  "honest block at the party's bound": report_path.noisy_encoded(
                      report_path.block_vectors(study, "b", unit[None, :] * study.parties[1].row_bound, signs[n:]),
                      study, stream)}
        whole = np.zeros((1, d))
        whole[0, half:] = unit * study.row_bound
        at_bound = np.concatenate([report_path.noisy_encoded(report_path.block_vectors(
            study, q.name, whole[:, cols], signs[n:]), study, stream)
            for q, cols in zip(study.parties, parties.slices(study.parties))], axis=1)
        for name in names:
            extra = at_bound if name == "honest individual at the bound" else np.concatenate([first, blocks[name]], axis=1)
            moved = _fit(study, base + _ring_sketch(study, ids[n:], extra), n + 1)
            shifts[name].append(float(np.linalg.norm(moved - honest)))
    allowance = validity.norm_allowance(grid.scale(study.sigma), study.parties[1].width) * grid.spacing
    return {"n": n, "d": d, "seeds": seeds, "reach": reach, "row_bound": study.parties[1].row_bound,
            "allowance": allowance, "sigma": study.sigma, "honest_error": errors, "shifts": shifts}


def _summary(values: list[float]) -> str:
    return (f"{statistics.mean(values):.4g} ± {statistics.stdev(values):.2g} "
            f"({statistics.median(values):.4g}), p90 {float(np.quantile(values, 0.9)):.4g}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--d", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--kind", choices=["sketch", "gram", "parties"], default="sketch")
    args = parser.parse_args(argv)
    if args.kind == "gram":
        out = run_gram(args.n, args.d, args.seeds)
        print(f"gram study, n = {out['n']}, d = {out['d']}, {out['seeds']} seeds; sigma = {out['sigma']:.4g}, "
              f"noise allowance {out['allowance_sigmas']:.1f} sigma")
        print("| ridge error ||theta_hat - theta|| | mean ± sd (median), p90 |")
        print("|---|---|")
        for name, values in out["errors"].items():
            print(f"| {name} | {_summary(values)} |")
        print()
    elif args.kind == "parties":
        out = run_parties(args.n, args.d, args.seeds)
        print(f"parties, n = {out['n']}, d = {out['d']}, {out['seeds']} seeds; a valid block of the second "
              f"party has norm at most {out['reach']:.3f} (its B_j = {out['row_bound']:.4g})")
    else:
        out = run(args.n, args.d, args.seeds)
        print(f"n = {out['n']}, d = {out['d']}, {out['seeds']} seeds; a valid report's norm is at most "
              f"{out['reach']:.3f} (B = {out['row_bound']:g})")
    print("| report added | ||theta' - theta_hat|| mean ± sd (median), p90 |")
    print("|---|---|")
    if "honest_error" in out:
        print(f"| (honest fit's own error against the model) | {_summary(out['honest_error'])} |")
    for name, values in out["shifts"].items():
        print(f"| {name} | {_summary(values)} |")


if __name__ == "__main__":
    main()
