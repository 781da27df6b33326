"""Gaussian noise from the operating system's CSPRNG, for clients and servers alike.

Why a cryptographically secure source. The privacy of a report rests entirely on the noise
being unpredictable to the servers, and a server's own noise (its floor, docs/trust.md) on being
unpredictable to everyone else. A seeded statistical generator (``numpy.random``, Mersenne
Twister, PCG64 seeded from a clock, a user id, ...) is deterministic: anyone who learns or
guesses the seed - or, for some generators, observes enough outputs - can regenerate the noise
and subtract it. So every random bit here comes from ``os.urandom`` (the kernel CSPRNG), exactly
as the shares and salts do.

How. Each sample uses 64 random bits: one sign bit and 53 bits k for a uniform
u = (k + 1) 2^-53 in (0, 1] (exactly representable, never 0), and |z| = -ndtri(u / 2), the
inverse normal CDF of the lower half; the sign bit makes the law exactly symmetric. A 53-bit grid
alone would stop at 8.3 sigma, so when k < 2^22 (|z| beyond about 5.9 sigma, one sample in 10^9)
the unit below k is filled with further random bits, u = (k + r) 2^-53 with r drawn the same way,
up to eight levels: the sampler reaches beyond 25 sigma. Samples beyond ``NOISE_TAIL_SIGMAS`` =
20 sigma (probability 5.5e-89 each) are redrawn, so an encoding never fails; the redraw changes
the mechanism by at most ``privacy.tail_delta``, which a study requires to be below 1e-6 delta.

Floating-point caveat. This is a floating-point approximation of a Gaussian: the inverse CDF is
evaluated in double precision and the set of reachable doubles is not the same for every
mean. Mironov (CCS 2012) showed that the low-order bits of naive floating-point Laplace samples
can reveal the unnoised value. Here the noisy value is then rounded to the study's fixed-point
grid 2^-f, which discards the low-order bits where those artefacts live, but that is a
mitigation, not a proof; a discrete Gaussian sampled directly on the 2^-f grid (Canonne, Kamath,
Steinke 2020) would be the exact remedy.
"""

from __future__ import annotations

import os

import numpy as np

#: Noise is drawn from N(0, sigma^2) and refused beyond this many sigmas (probability 5.5e-89
#: per coordinate; the sampler redraws). Part of the overflow bound; its effect on the privacy
#: guarantee is ``privacy.tail_delta``, which a study checks.
NOISE_TAIL_SIGMAS = 20.0

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
    from scipy.special import ndtri  # here, not at import: a share server imports this module

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
