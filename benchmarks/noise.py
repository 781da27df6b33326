"""Sampler and client-prepare speed, as ratios within one run (docs/protocol.md section 5a).

    .venv/bin/python benchmarks/noise.py [--samples 1000000] [--rows 100000]

Rows printed:
* the exact discrete Gaussian (``noise.discrete_gaussian``, t = 2^24) against the sampler it
  replaced (a float Gaussian by inverse CDF from os.urandom words, rounded to the grid: the
  product before the exact sampler, reproduced here) and against a floor: the same number of
  keystream words turned into Gaussians by the vectorised inverse CDF (what a float sampler
  costs at best, with no rounding and no tail cut);
* ``prepare_batch`` of a gram study (d = 10, width 66, 3 servers) against two floors: (a) drawing
  the keystream bytes the batch needs (noise words, N-1 shares, salts) plus the inverse CDF of
  the noise; (b) (a) plus the N + 1 SHA-256 calls per report that the binding (docs/protocol.md
  4a) makes, each on a ready buffer of the bytes it hashes: the least a client of this protocol
  does in CPython.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np
from scipy.special import ndtri

from dpsketch.client_sdk.prepare import prepare_batch
from dpsketch.protocol import binding, noise
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


def _former_sampler(count: int, t: int) -> np.ndarray:
    """The float sampler the product used before the exact one (commit 4e4776b^): an inverse-CDF
    Gaussian from os.urandom words (53-bit uniforms, refined near 0), redrawn beyond 20 sigma,
    rounded to the grid."""
    def standard_normal(n: int) -> np.ndarray:
        words = np.frombuffer(os.urandom(8 * n), dtype="<u8").copy()
        negative = (words >> np.uint64(63)).astype(bool)
        k = (words & np.uint64((1 << 53) - 1)).astype(np.float64)
        r = np.ones_like(k)
        small = np.flatnonzero(k < (1 << 22))
        if small.size:
            r[small] = (np.frombuffer(os.urandom(8 * small.size), dtype="<u8") >> np.uint64(11)) * 2.0 ** -53
        magnitude = -ndtri(0.5 * (k + r) * 2.0 ** -53)
        return np.where(negative, -magnitude, magnitude)

    z = standard_normal(count)
    bad = np.abs(z) > 20.0
    while bad.any():
        z[bad] = standard_normal(int(bad.sum()))
        bad = np.abs(z) > 20.0
    return np.rint(z * t).astype(np.int64)


def _hash_floor(m: int, sizes: list[int]) -> None:
    """One bare SHA-256 call per report and message size, on slices of one ready buffer."""
    sha = hashlib.sha256
    for size in sizes:
        view = memoryview(bytes(m * size))
        for i in range(0, m * size, size):
            sha(view[i:i + size]).digest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()

    t = noise.MAX_SCALE
    noise.discrete_gaussian(1000, t, 20 * t - 1, Keystream())  # the block table, once per process
    discrete = _best(lambda: noise.discrete_gaussian(args.samples, t, 20 * t - 1, Keystream()))
    former = _best(lambda: _former_sampler(args.samples, t))
    floor = _best(lambda: _float_floor(args.samples))
    print(f"discrete Gaussian (exact): {args.samples / discrete:,.0f} samples/s; former float sampler "
          f"{args.samples / former:,.0f}/s (ratio {former / discrete:.2f}x as long); float floor "
          f"(keystream + inverse CDF) {args.samples / floor:,.0f}/s (exact takes {discrete / floor:.2f}x)")

    study, _ = design(name="bench", columns=[f"c{i}" for i in range(10)], label=None, kind="gram",
                      servers=["s1", "s2", "s3"], expected_reports=10**6, epsilon=1.0, delta=1e-6)
    rows = np.random.default_rng(0).normal(size=(args.rows, 10)) / 4  # benchmark data only
    prepare_batch(study, rows[:100])
    prep = _best(lambda: prepare_batch(study, rows), repeat=2)
    width, n = study.width, study.n_servers

    def random_floor() -> None:
        stream = Keystream()
        _float_floor(args.rows * width)
        stream.array(args.rows * width * 8 * (n - 1) + binding.SALT_BYTES * n * args.rows)

    commit_size = len(binding.COMMIT_DOMAIN) + 2 + binding.SALT_BYTES + 8 * width
    id_size = len(binding.REPORT_DOMAIN) + 32 + binding.COMMITMENT_BYTES * n
    rf = _best(random_floor, repeat=2)
    hf = _best(lambda: _hash_floor(args.rows, [commit_size] * n + [id_size]), repeat=2)
    print(f"gram prepare (d = 10, width {width}, {n} servers): {args.rows / prep:,.0f} rows/s; "
          f"(a) keystream + transform floor {args.rows / rf:,.0f} rows/s (ratio {prep / rf:.2f}x); "
          f"(b) with the binding's {n + 1} SHA-256 per report {args.rows / (rf + hf):,.0f} rows/s "
          f"(ratio {prep / (rf + hf):.2f}x)")


if __name__ == "__main__":
    main()
