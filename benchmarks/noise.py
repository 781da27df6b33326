"""Sampler and client-prepare speed, as ratios within one run (docs/protocol.md section 5a).

    .venv/bin/python benchmarks/noise.py [--samples 1000000] [--rows 100000]

Rows printed:
* the exact discrete Gaussian (``noise.discrete_gaussian``) against a floating-point floor: the
  same keystream's words turned into Gaussians by the vectorised inverse CDF (what a float
  sampler costs at best);
* ``prepare_batch`` of a gram study (d = 10, width 66, 3 servers) against a floor: drawing the
  keystream bytes the batch needs (noise words, N-1 shares, salts) plus the float transform.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.special import ndtri

from client_sdk.prepare import prepare_batch
from dpsketch.protocol import noise
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.study import design


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _float_floor(count: int) -> None:
    w = Keystream().words(count)
    u = ((w >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53
    ndtri(u)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()

    t = noise.MAX_SCALE
    discrete = _best(lambda: noise.discrete_gaussian(args.samples, t, 20 * t - 1, Keystream()))
    floor = _best(lambda: _float_floor(args.samples))
    print(f"discrete Gaussian: {args.samples / discrete:,.0f} samples/s; float floor (keystream + "
          f"inverse CDF) {args.samples / floor:,.0f}/s; ratio {discrete / floor:.2f}x")

    study, _ = design(name="bench", columns=[f"c{i}" for i in range(10)], label=None, kind="gram",
                      servers=["s1", "s2", "s3"], expected_reports=10**6, epsilon=1.0, delta=1e-6)
    rows = np.random.default_rng(0).normal(size=(args.rows, 10)) / 4  # benchmark data only
    prep = _best(lambda: prepare_batch(study, rows), repeat=2)
    width = study.width

    def prep_floor() -> None:
        stream = Keystream()
        _float_floor(args.rows * width)
        stream.bytes(args.rows * width * 8 * (study.n_servers - 1) + 16 * study.n_servers * args.rows)

    pf = _best(prep_floor, repeat=2)
    print(f"gram prepare (d = 10, width {width}, {study.n_servers} servers): {args.rows / prep:,.0f} rows/s; "
          f"floor {args.rows / pf:,.0f} rows/s; ratio {prep / pf:.2f}x")


if __name__ == "__main__":
    main()
