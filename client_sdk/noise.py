"""Clipping and Gaussian noise for one client's rows (docs/protocol.md, section 5).

Why a cryptographically secure source. The privacy of a report rests entirely on the noise
being unpredictable to the servers. A seeded statistical generator (``numpy.random``, Mersenne
Twister, PCG64 seeded from a clock, a user id, ...) is deterministic: anyone who learns or
guesses the seed - or, for some generators, observes enough outputs - can regenerate the noise
and subtract it, which turns a differentially private report into the raw row. So every random
bit here comes from ``os.urandom`` (the kernel CSPRNG), exactly as the shares and report ids do.

How. Each sample uses 64 random bits: one sign bit and 53 bits k for a uniform
u = (k + 1) 2^-53 in (0, 1] (exactly representable, never 0), and |z| = -ndtri(u / 2), the
inverse normal CDF of the lower half; the sign bit makes the law exactly symmetric. A 53-bit grid
alone would stop at 8.3 sigma, so when k < 2^22 (|z| beyond about 5.9 sigma, one sample in 10^9)
the unit below k is filled with further random bits, u = (k + r) 2^-53 with r drawn the same way,
up to eight levels: the sampler reaches beyond 25 sigma. Coordinates whose noise exceeds
``NOISE_TAIL_SIGMAS`` = 20 sigma (probability 5.5e-89 per coordinate) are redrawn, so encoding
never fails for a clipped row (|clipped + noise| <= bound + 20 sigma, the study's encoding
bound); the redraw changes the mechanism by at most ``privacy.tail_delta``, which a study
requires to be below 1e-6 delta.

Floating-point caveat. This is a floating-point approximation of a Gaussian: the inverse CDF is
evaluated in double precision and the set of reachable doubles is not the same for every
mean. Mironov (CCS 2012) showed that the
low-order bits of naive floating-point Laplace samples can reveal the unnoised value. Here the
noisy value is then rounded to the study's fixed-point grid 2^-f, which discards the low-order
bits where those artefacts live, but that is a mitigation, not a proof; a discrete Gaussian
sampled directly on the 2^-f grid (Canonne, Kamath, Steinke 2020) would be the exact remedy.
Clipping is done so that the clipped norm never exceeds B even after rounding.
"""

from __future__ import annotations

import os

import numpy as np
from scipy.special import ndtri

from dpsketch.protocol import features
from dpsketch.protocol.study import NOISE_TAIL_SIGMAS, Study

_MANTISSA_BITS = 53
#: Below this k the 53-bit grid is refined with more random bits (|z| > ~5.9 sigma).
_REFINE_BELOW = 1 << 22
_MAX_REFINEMENTS = 8


def _urandom_u64(count: int) -> np.ndarray:
    """``count`` uniform 64-bit words from the OS CSPRNG."""
    return np.frombuffer(os.urandom(8 * count), dtype="<u8").copy()


def standard_normal(shape: int | tuple[int, ...]) -> np.ndarray:
    """N(0, 1) samples, every bit from ``os.urandom`` (inverse CDF, see module docstring)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    count = int(np.prod(shape, dtype=np.int64))
    words = _urandom_u64(count)
    negative = (words >> np.uint64(63)).astype(bool)
    u = _unit_uniform(words)
    magnitude = -ndtri(0.5 * u)  # >= 0; u = 1 gives exactly 0
    return np.where(negative, -magnitude, magnitude).reshape(shape)


def _unit_uniform(words: np.ndarray, level: int = 0) -> np.ndarray:
    """u in (0, 1] from the low 53 bits of each word, refined near 0 with fresh CSPRNG words."""
    k = (words & np.uint64((1 << _MANTISSA_BITS) - 1)).astype(np.float64)
    r = np.ones_like(k)
    small = np.flatnonzero(k < _REFINE_BELOW)
    if small.size and level < _MAX_REFINEMENTS:
        r[small] = _unit_uniform(_urandom_u64(small.size), level + 1)
    return (k + r) * 2.0 ** -_MANTISSA_BITS  # k + 1 when unrefined: exact


def gaussian(shape: int | tuple[int, ...], sigma: float,
             tail_sigmas: float = NOISE_TAIL_SIGMAS) -> np.ndarray:
    """N(0, sigma^2) noise, any sample beyond ``tail_sigmas`` sigma redrawn (CSPRNG)."""
    if not (sigma > 0 and np.isfinite(sigma)):
        raise ValueError("sigma must be a positive finite number")
    z = standard_normal(shape)
    while True:
        bad = np.abs(z) > tail_sigmas
        if not bad.any():
            break
        z[bad] = standard_normal(int(bad.sum()))
    return z * sigma


def row_norms(rows: np.ndarray) -> np.ndarray:
    """L2 norm of each row, without overflow for huge coordinates."""
    a = np.asarray(rows, dtype=np.float64)
    peak = np.max(np.abs(a), axis=1) if a.shape[1] else np.zeros(len(a))
    safe = np.where(peak > 0, peak, 1.0)
    return np.linalg.norm(a / safe[:, None], axis=1) * safe


def clip_rows(rows: np.ndarray, bound: float) -> np.ndarray:
    """Scale each row to L2 norm at most ``bound``: a * min(1, bound / ||a||).

    Rows already inside the ball are returned unchanged. A scaled row is nudged down by a few
    ulps if rounding left its computed norm above ``bound``, and every coordinate is kept in
    [-bound, bound], so the sensitivity bound holds in floating point too.
    """
    a = np.array(rows, dtype=np.float64, ndmin=2)
    if not np.all(np.isfinite(a)):
        raise ValueError("rows must be finite before clipping")
    norms = row_norms(a)
    over = norms > bound
    if over.any():
        # scale by the largest coordinate first: huge rows (1e200) must not overflow to inf
        peak = np.max(np.abs(a[over]), axis=1, keepdims=True)
        unit = a[over] / peak
        clipped = unit * (bound / np.linalg.norm(unit, axis=1))[:, None]
        for _ in range(8):
            too_big = row_norms(clipped) > bound
            if not too_big.any():
                break
            clipped[too_big] *= 1.0 - 4.0 * np.finfo(np.float64).eps
        a[over] = clipped
    np.clip(a, -bound, bound, out=a)
    return a


def privatize(rows: np.ndarray, study: Study) -> np.ndarray:
    """Clip to the study's row bound B, map to the study kind's vector (the row itself, or
    [a, u(a a^T), 1] for a gram study) and add N(0, sigma^2) noise to every coordinate.

    The result always lies within ``study.value_bound`` (feature bound + 20 sigma), so
    ``ring.encode`` accepts it. The noise scale is the study's ``sigma``, never recomputed here.
    """
    clipped = clip_rows(rows, study.row_bound)
    vectors = features.client_vectors(study.kind, clipped)
    return vectors + gaussian(vectors.shape, study.sigma)
