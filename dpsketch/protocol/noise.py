"""Exact discrete Gaussian noise on the ring's grid, for clients and servers alike.

Why discrete and why exact. Secure aggregation works on integers, and a floating-point Gaussian
rounded to the grid is not the distribution its analysis assumes: which encoded values such a
sampler can reach depends on the input (Mironov, CCS 2012, showed the same for Laplace). So the
noise is drawn directly on the fixed-point grid from the discrete Gaussian

    P(X = x) = exp(-x^2 / (2 t^2)) / sum_y exp(-y^2 / (2 t^2)),   x an integer,

with the exact algorithm of Canonne, Kamath and Steinke (NeurIPS 2020): a discrete Laplace
proposal and an exact Bernoulli(exp(-gamma)) acceptance, using only integer arithmetic on
uniform random integers. No floating-point number enters a sample. The random integers come from
one ChaCha20 keystream per batch (:mod:`keystream`), so the sampler is vectorised: numpy does
each step for every sample still running.

Where the noise lives. A value x is encoded as round(x 2^f); noise of standard deviation sigma is
X 2^shift in those units, X ~ N_Z(t) with t = ceil(sigma 2^(f - shift)), so its parameter is
t 2^(shift - f) >= sigma. ``shift`` is the smallest that keeps t <= 2^24 (every integer of the
sampler then fits 64 bits); a study fixes one shift for its clients and servers
(``Study.noise_grid``), and clients round their values to the same 2^(shift - f) grid, so that
every report and every noise term lies on one lattice (docs/protocol.md, section 5, gives the
privacy argument for sums of such noise through the sketch).

The tail. A sample with |X| > floor(20 sigma 2^(f - shift)) - 1 is redrawn: the noise is exactly
the discrete Gaussian conditioned on |X| staying within 20 sigma, which the overflow bound
needs; the conditioning costs at most ``privacy.tail_delta`` of delta (a study checks it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .keystream import Keystream

#: Noise is cut at this many sigmas (redrawn beyond): part of the overflow bound.
NOISE_TAIL_SIGMAS = 20.0
#: Largest sampler parameter t: with |X| <= 20 t, (|X| - t)^2 < 2^57 and 2 t^2 K < 2^56 for the
#: Bernoulli loop's K <= 128, so every integer fits numpy's uint64, and the discrete Laplace's
#: steps (denominators K t < 2^28) run on 32-bit words.
MAX_SCALE = 1 << 24
_MAX_LOOP = 128


@dataclass(frozen=True)
class Grid:
    """The lattice 2^(shift - frac_bits) Z on which a study's noise and values live."""

    frac_bits: int
    shift: int

    @property
    def spacing(self) -> float:
        return math.ldexp(1.0, self.shift - self.frac_bits)

    def scale(self, std: float) -> int:
        """The sampler parameter t (in grid steps) for noise of standard deviation ``std``."""
        return max(1, math.ceil(std / self.spacing))

    def limit(self, std: float) -> int:
        """Largest |X| kept: every noise value stays within NOISE_TAIL_SIGMAS * std."""
        return max(0, math.floor(NOISE_TAIL_SIGMAS * std / self.spacing) - 1)


def tail_probability(t: int, limit: int) -> float:
    """An upper bound on P(|X| > limit) for X ~ N_Z(t): twice (rho(limit + 1) + the integral of rho
    beyond limit + 1) over rho(Z) >= t sqrt(2 pi) - 1, rho(x) = exp(-x^2 / (2 t^2))."""
    a = (limit + 1) / t
    mass = math.exp(-0.5 * a * a) + t * math.sqrt(math.pi / 2.0) * math.erfc(a / math.sqrt(2.0))
    return 2.0 * mass / (t * math.sqrt(2.0 * math.pi) - 1.0)


def grid_for(largest_std: float, frac_bits: int) -> Grid:
    """The finest grid 2^(shift - f) on which noise of ``largest_std`` has t <= MAX_SCALE."""
    shift = 0
    while largest_std * math.ldexp(1.0, frac_bits - shift) > MAX_SCALE:
        shift += 1
    return Grid(frac_bits, shift)


def encoded_noise(shape: int | tuple[int, ...], std: float, grid: Grid,
                  stream: Keystream | None = None) -> np.ndarray:
    """Discrete Gaussian noise of parameter ``grid.scale(std)`` grid steps, in ring units
    (int64 multiples of 2^shift), conditioned on the 20-sigma tail cut."""
    if not (std > 0 and math.isfinite(std)):
        raise ValueError("std must be a positive finite number")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    count = int(np.prod(shape, dtype=np.int64))
    x = discrete_gaussian(count, grid.scale(std), grid.limit(std), stream or Keystream())
    return (x << np.int64(grid.shift)).reshape(shape)


def discrete_gaussian(count: int, t: int, limit: int, stream: Keystream) -> np.ndarray:
    """``count`` independent draws of N_Z(t) conditioned on |X| <= limit, as int64.

    Canonne-Kamath-Steinke, Algorithm 3 with sigma = t: propose Y from the discrete Laplace of
    scale t, accept with probability exp(-(|Y| - t)^2 / (2 t^2)). Proposals beyond ``limit``
    are rejected before the acceptance test (conditioning on the event, exactly)."""
    if not 1 <= t <= MAX_SCALE:
        raise ValueError(f"the sampler's parameter must be in [1, {MAX_SCALE}], got {t}")
    if limit < 0:
        raise ValueError("limit must be >= 0")
    out = np.empty(count, dtype=np.int64)
    filled = 0
    while filled < count:
        need = count - filled
        y = discrete_laplace(need + need // 4 + 16, t, stream)  # ~80 % are accepted
        y = y[np.abs(y) <= limit]
        a = np.abs(y).astype(np.uint64) - np.uint64(t)  # wraps when |y| < t; squared it is right
        keep = y[bernoulli_exp(a * a, 2 * t * t, stream)]  # (|y| - t)^2 fits 2^61
        take = min(keep.size, need)
        out[filled:filled + take] = keep[:take]
        filled += take
    return out


def discrete_laplace(count: int, t: int, stream: Keystream) -> np.ndarray:
    """``count`` draws of the discrete Laplace P(Y = y) proportional to exp(-|y| / t) (CKS
    Algorithm 2): U uniform in [0, t) kept with probability exp(-U / t), V geometric with
    P(V >= v) = exp(-v), X = U + t V, a sign bit, and (sign -, X = 0) rejected."""
    out = np.empty(count, dtype=np.int64)
    filled = 0
    while filled < count:
        need = count - filled
        u = uniform_below(need * 8 // 5 + 16, t, stream)  # 1 - 1/e = 63 % are kept
        u = u[bernoulli_exp(u, t, stream)]
        x = u.astype(np.int64) + np.int64(t) * geometric_exp(u.size, stream)
        negative = stream.bits(u.size)
        y = np.where(negative, -x, x)[~(negative & (x == 0))]
        take = min(y.size, need)
        out[filled:filled + take] = y[:take]
        filled += take
    return out


def geometric_exp(count: int, stream: Keystream) -> np.ndarray:
    """``count`` draws of V with P(V >= v) = exp(-v): the number of Bernoulli(exp(-1)) successes
    before the first failure."""
    v = np.zeros(count, dtype=np.int64)
    running = np.arange(count)
    while running.size:
        running = running[_bernoulli_exp_one(running.size, stream)]
        v[running] += 1
    return v


def bernoulli_exp(num: np.ndarray, den: int, stream: Keystream) -> np.ndarray:
    """Exact Bernoulli(exp(-num / den)) per entry (uint64 num >= 0, one den in [1, 2^56)): for
    the whole part of gamma = num / den, that many Bernoulli(exp(-1)) must all succeed; the
    fraction is CKS Algorithm 1 (:func:`_bernoulli_exp_unit`)."""
    num = np.asarray(num, dtype=np.uint64)
    d = np.uint64(den)
    whole = num // d
    result = _bernoulli_exp_unit(num - whole * d, den, stream)
    pending = np.flatnonzero(result & (whole > 0))
    left = whole[pending]
    while pending.size:
        success = _bernoulli_exp_one(pending.size, stream)
        result[pending[~success]] = False
        left = left - np.uint64(1)
        more = success & (left > 0)
        pending, left = pending[more], left[more]
    return result


_ALL_ONES = (1 << 64) - 1


def _bernoulli_exp_unit(num: np.ndarray, den: int, stream: Keystream) -> np.ndarray:
    """Exact Bernoulli(exp(-gamma)) for gamma = num / den in [0, 1] (CKS Algorithm 1): K = 1;
    while Bernoulli(gamma / K) succeeds, K += 1; the answer is whether K ends odd.

    Bernoulli(num / M) with M = K den, exactly, from one 64-bit word w: with q = floor((2^64 - 1)
    / M), a word w < q M is uniform over q M values, and w < q num has probability num / M;
    words w >= q M (probability below M / 2^64) are redrawn. q is a Python integer per K, so no
    vector division is needed."""
    return _algorithm_1(num, den, 1, stream)


def _bernoulli_exp_one(count: int, stream: Keystream) -> np.ndarray:
    """``count`` exact Bernoulli(exp(-1)): Algorithm 1 with gamma = 1, whose first step
    (Bernoulli(1)) always succeeds, so it starts at K = 2."""
    return _algorithm_1(np.ones(count, dtype=np.uint64), 1, 2, stream)


def _algorithm_1(num: np.ndarray, den: int, first_k: int, stream: Keystream) -> np.ndarray:
    result = np.empty(num.shape, dtype=bool)
    running = np.arange(num.size)
    small = den < 1 << 24
    n_run = num.astype(np.uint32) if small else num  # num <= den
    kk = first_k
    while running.size:
        if kk > _MAX_LOOP:  # probability below 1 / 127!: exact, just slower
            result[running] = _bernoulli_exp_unit_python(num[running], den, kk, stream)
            break
        m = kk * den
        if small and m < 1 << 28:  # 32-bit words suffice (half the keystream)
            q = 0xFFFFFFFF // m
            w = _words_below(running.size, q * m, stream, np.uint32)
            success = w < np.uint32(q) * n_run
        else:
            q = _ALL_ONES // m
            w = _words_below(running.size, q * m, stream, np.uint64)
            success = w < np.uint64(q) * n_run.astype(np.uint64)
        result[running[~success]] = bool(kk & 1)  # K stops at kk: odd K means 1
        running, n_run = running[success], n_run[success]
        kk += 1
    return result


def _bernoulli_exp_unit_python(num: np.ndarray, den: int, first_k: int, stream: Keystream) -> np.ndarray:
    """The rare tail of Algorithm 1 with Python integers (no 64-bit limit on K den)."""
    out = np.empty(num.shape, dtype=bool)
    for i, n in enumerate(num.tolist()):
        kk = first_k
        while _uniform_below_int(kk * den, stream) < n:
            kk += 1
        out[i] = bool(kk & 1)
    return out


def uniform_below(count: int, bound: int, stream: Keystream) -> np.ndarray:
    """``count`` exact uniform integers in [0, bound) (bound in [1, 2^63]), uint64: a word w <
    q bound with q = floor((2^64 - 1) / bound) gives floor(w / q), each value from exactly q
    words; other words are redrawn."""
    if bound < 1 << 28:
        q = 0xFFFFFFFF // bound
        return (_words_below(count, q * bound, stream, np.uint32) // np.uint32(q)).astype(np.uint64)
    q = _ALL_ONES // bound
    return _words_below(count, q * bound, stream, np.uint64) // np.uint64(q)


def _words_below(count: int, top: int, stream: Keystream, dtype) -> np.ndarray:
    """``count`` uniform words of ``dtype`` below ``top`` (rejection: a word at or above top,
    probability (2^bits - top) / 2^bits, is redrawn)."""
    w = stream.words(count) if dtype is np.uint64 else stream.words32(count)
    limit = dtype(top)
    fresh = w >= limit
    while fresh.any():
        n = int(fresh.sum())
        w[fresh] = stream.words(n) if dtype is np.uint64 else stream.words32(n)
        fresh = w >= limit
    return w


def _uniform_below_int(bound: int, stream: Keystream) -> int:
    nbytes = (bound.bit_length() + 7) // 8 + 8
    top = 1 << (8 * nbytes)
    limit = top - top % bound
    while True:
        w = int.from_bytes(stream.bytes(nbytes), "little")
        if w < limit:
            return w % bound
