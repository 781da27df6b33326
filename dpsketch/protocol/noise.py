"""Exact discrete Gaussian noise on the ring's grid, for clients and servers alike.

Why discrete and why exact. Secure aggregation works on integers, and a floating-point Gaussian
rounded to the grid is not the distribution its analysis assumes: which encoded values such a
sampler can reach depends on the input (Mironov, CCS 2012, showed the same for Laplace). So the
noise is drawn directly on the fixed-point grid from the discrete Gaussian

    P(X = x) = exp(-x^2 / (2 t^2)) / sum_y exp(-y^2 / (2 t^2)),   x an integer,

exactly, using only comparisons of uniform random integers with integers: the magnitude splits
into a block and an offset, |X| = m J + R; the block index J comes from an inverse-CDF table
whose entries are known to every bit the comparison needs (computed in decimal arithmetic with a
proven error bound, a tie extended with more random bits), and the offset from a uniform R kept
with the exact Bernoulli(exp(-gamma)) of Canonne, Kamath and Steinke (NeurIPS 2020, Algorithm
1). No floating-point number enters a sample. The random integers come from one ChaCha20
keystream per batch (:mod:`keystream`), and every step is a vectorised numpy pass.

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

import decimal
import functools
import math
import threading
from dataclasses import dataclass

import numpy as np

from .keystream import Keystream

#: Noise is cut at this many sigmas (redrawn beyond): part of the overflow bound.
NOISE_TAIL_SIGMAS = 20.0
#: Largest sampler parameter t: with |X| <= 20 t < 2^29, the offset's 2 m J R + R^2 < 2^50 and
#: 2 t^2 K < 2^56 for the Bernoulli loop's K <= 128, so every integer fits numpy's uint64.
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
    if grid.shift:
        np.left_shift(x, grid.shift, out=x)
    return x.reshape(shape)


def scaled_noise(rows: int, std: float, scale: np.ndarray, grid: Grid,
                 stream: Keystream | None = None) -> np.ndarray:
    """(rows, len(scale)) noise whose column i has standard deviation std scale[i] (a gram
    validity study's strict upper triangle takes 1/sqrt(2) of the rest): the columns of each
    distinct scale, in the order the scales first appear, drawn as one (rows, columns) block of
    :func:`encoded_noise`. With every scale 1 this is encoded_noise((rows, w)), draw for draw."""
    scale = np.asarray(scale, dtype=np.float64)
    stream = stream or Keystream()
    out = np.empty((rows, len(scale)), dtype=np.int64)
    for value in dict.fromkeys(scale.tolist()):
        cols = np.flatnonzero(scale == value)
        out[:, cols] = encoded_noise((rows, len(cols)), std * value, grid, stream)
    return out


def prepare(std: float, grid: Grid) -> None:
    """Build (and cache) what :func:`encoded_noise` of ``std`` on ``grid`` draws from: its block
    table, 0.06-0.15 s of exact decimal arithmetic once per process and parameter. A share
    server prepares its studies' floor noise ahead of their commit, so a finalization does not
    wait for it (issue 46)."""
    if std > 0 and math.isfinite(std):
        _block_table(grid.scale(std), grid.limit(std))


def discrete_gaussian(count: int, t: int, limit: int, stream: Keystream) -> np.ndarray:
    """``count`` independent draws of N_Z(t) conditioned on |X| <= limit, as int64.

    Two exact stages, each a few vectorised numpy passes:

    * the block: |X| = m J + R with blocks of m = ceil(limit / 2048) values; J is drawn from
      P(J = j) proportional to rho(m j), j = 0 .. limit // m, by inverting its cumulative
      distribution with one 64-bit word (:class:`_BlockTable`: the cumulatives are known to
      enough bits that the comparison is exact, and a word that ties with one is extended);
    * the offset: R uniform below m, kept with Bernoulli(rho(m J + R) / rho(m J)) =
      Bernoulli(exp(-(2 m J R + R^2) / (2 t^2))) (CKS Algorithm 1, integer arithmetic only), and
      m J + R > limit rejected.

    A kept pair has probability proportional to rho(m J) (1/m) rho(m J + R) / rho(m J), that is
    to rho(|X|) on 0 .. limit. A sign bit makes X = +-|X| with (negative, 0) rejected, so
    P(X = x) is proportional to rho(x) on -limit .. limit: the discrete Gaussian conditioned on
    the cut, exactly. The offset's gamma stays below 0.2, so about 97 % of proposals are kept."""
    if not 1 <= t <= MAX_SCALE:
        raise ValueError(f"the sampler's parameter must be in [1, {MAX_SCALE}], got {t}")
    if limit < 0:
        raise ValueError("limit must be >= 0")
    table = _block_table(t, limit)
    m = table.block
    out = np.empty(count, dtype=np.int64)
    filled = 0
    while filled < count:
        need = count - filled
        size = need + need // 16 + 16
        x = table.draw(size, stream)  # J, becoming |X|
        if m > 1:
            r = uniform_below(size, m, stream)
            gamma = x * np.uint64(2 * m)  # 2 m J R + R^2 < 2^50 (checked in the table)
            gamma += r
            gamma *= r
            x *= np.uint64(m)
            x += r
            keep = bernoulli_exp(gamma, table.den, stream)
            if table.partial_last:  # the last block reaches past the limit: cut there
                keep &= x <= np.uint64(limit)
            x = x[keep]
        negative = stream.bits(x.size)
        flip = negative.view(np.int8).astype(np.int64)
        np.negative(flip, out=flip)  # 0 or -1 (all ones)
        signed = x.view(np.int64)
        signed ^= flip
        signed -= flip  # two's complement: (x ^ -1) + 1 = -x where the sign bit is set
        rejected = negative & (signed == 0)  # -0: each sign of 0 would count it twice
        if rejected.any():
            signed = signed[~rejected]
        take = min(signed.size, need)
        out[filled:filled + take] = signed[:take]
        filled += take
    return out


#: The block stage's table has at most this many entries (a few kB: it stays in cache).
_TABLE_BLOCKS = 2048
_GUIDE_BITS = 16


@dataclass(frozen=True)
class _BlockTable:
    """The exact inverse-CDF table of the block index J (see :func:`discrete_gaussian`).

    ``bounds[j] = floor(2^64 F_j)`` with F_j = P(J <= j), computed in decimal arithmetic with a
    proven error bound (Python's ``Decimal.exp`` is correctly rounded). For a uniform U whose
    first 64 bits are the word w, w > bounds[j] means U > F_j and w < bounds[j] means U < F_j
    exactly; only w == bounds[j] (probability about 2^-53 per draw with 2048 entries) needs more
    bits of U, which :meth:`_resolve` draws and compares against F_j to more bits."""

    t: int
    limit: int
    block: int
    bounds: np.ndarray  # uint64, non-decreasing, one per j = 0 .. J - 1 (F_J = 1 needs none)
    guide: np.ndarray  # uint64 per 16-bit prefix p: the number of bounds below p 2^48
    crowded: np.ndarray  # per prefix: whether a bound lies in [p 2^48, (p + 1) 2^48)

    @property
    def den(self) -> int:
        return 2 * self.t * self.t

    @property
    def partial_last(self) -> bool:
        """Whether the last block, J = limit // block, reaches past the limit."""
        return (self.limit + 1) % self.block != 0

    def draw(self, count: int, stream: Keystream) -> np.ndarray:
        """J (uint64) for ``count`` uniform words: a 2^16-entry guide gives J at once for a word
        whose top 16 bits name a slice of [0, 2^64) that holds no bound (at least 97 % of
        words); the others are placed by binary search, and only they can tie with a bound."""
        w = stream.words(count)
        top = (w >> np.uint64(64 - _GUIDE_BITS)).view(np.intp)  # below 2^16: a signed index gathers faster
        j = self.guide[top]
        slow = np.flatnonzero(self.crowded[top])
        if slow.size:
            ws = w[slow]
            js = np.searchsorted(self.bounds, ws, side="right").astype(np.uint64)
            tied = (js > 0) & (self.bounds[np.maximum(js, 1) - 1] == ws)
            for i in np.flatnonzero(tied).tolist():  # a word equal to a bound: more bits of U
                js[i] = self._resolve(int(ws[i]), stream)
            j[slow] = js
        return j

    def _resolve(self, word: int, stream: Keystream) -> int:
        """The J of a U whose first 64 bits equal ``word``, one of the bounds: draw further
        64-bit words of U until its place among the tied cumulatives is certain."""
        tied = [j for j, b in enumerate(self.bounds.tolist()) if b == word]
        below = tied[0]  # every bound before the tie is < word, so U > F_j for those
        u, bits = word, 64
        while tied:
            u, bits = (u << 64) | int(stream.words(1)[0]), bits + 64
            still = []
            floors = _cumulative_floors(self.t, self.limit, self.block, tied, bits)
            for j, f in zip(tied, floors):
                if f < u:
                    below = j + 1
                elif f == u:
                    still.append(j)
                # f > u: U < F_j
            tied = still
        return below


def _block_table(t: int, limit: int) -> _BlockTable:
    """The block table of N_Z(t) cut at ``limit``, built once per process (about 0.1 s of CPU),
    however many threads ask for it at once: lru_cache alone lets every thread that misses
    build it, and 32 devices starting together in one process built it 32 times (a fifth of
    their process's CPU in session 62's relay benchmark)."""
    with _TABLE_BUILD:
        return _built_block_table(t, limit)


_TABLE_BUILD = threading.Lock()


@functools.lru_cache(maxsize=64)
def _built_block_table(t: int, limit: int) -> _BlockTable:
    m = max(1, -(-(limit + 1) // _TABLE_BLOCKS))
    last = limit // m
    if m > 1 and (2 * m * last + m) * m >= 2 * t * t:  # the offset's gamma must stay < 1
        raise ValueError("block too wide for the sampler's parameter")  # pragma: no cover
    bounds = np.array(_cumulative_floors(t, limit, m, range(last), 64), dtype=np.uint64)
    starts = np.arange(1 << _GUIDE_BITS, dtype=np.uint64) << np.uint64(64 - _GUIDE_BITS)
    guide = np.searchsorted(bounds, starts, side="left").astype(np.uint64)
    crowded = np.zeros(1 << _GUIDE_BITS, dtype=bool)
    crowded[(bounds >> np.uint64(64 - _GUIDE_BITS)).astype(np.int64)] = True
    return _BlockTable(t, limit, m, bounds, guide, crowded)


def _cumulative_floors(t: int, limit: int, block: int, js, bits: int) -> list[int]:
    """floor(2^bits F_j) for each j < limit // block in ``js``, F_j = sum_{i <= j} rho(block i) / sum_{i <= limit //
    block} rho(block i), exactly: computed in decimal at a precision whose proven error bound
    leaves no doubt about each floor, raised until it does (Ziv's strategy).

    The bound: each exp argument, each exp, each addition and the division round once, to half a
    unit in the last place (relative 5 10^-digits); an argument is at most 200, so its rounding
    moves exp by at most 200 such units. A partial sum of rounded terms then has relative error
    below (last + 205) 10^(1 - digits), and F_j, a ratio of two, below twice that (taken 4x)."""
    last = limit // block
    order = js = list(js)
    out: dict[int, int] = {}
    digits = bits * 30103 // 100000 + 20
    while js:
        with decimal.localcontext() as ctx:
            ctx.prec = digits
            two_t2 = decimal.Decimal(2 * t * t)
            partial, running = [], decimal.Decimal(0)
            for i in range(last + 1):
                running += (-decimal.Decimal((block * i) ** 2) / two_t2).exp()
                partial.append(running)
            scale = decimal.Decimal(1 << bits) / running
            rel = decimal.Decimal(4 * (last + 205)) * decimal.Decimal(10) ** (1 - digits)
            undecided = []
            for j in js:
                scaled = partial[j] * scale
                err = scaled * rel
                low = int((scaled - err).to_integral_value(decimal.ROUND_FLOOR))
                # F_j < 1 for j < last, so its floor is below 2^bits even where the bound is not
                high = min(int((scaled + err).to_integral_value(decimal.ROUND_FLOOR)), (1 << bits) - 1)
                if low == high:
                    out[j] = low
                else:
                    undecided.append(j)
        js = undecided
        digits += 20
    return [out[j] for j in order]


_ALL_ONES = (1 << 64) - 1


def bernoulli_exp(num: np.ndarray, den: int, stream: Keystream) -> np.ndarray:
    """Exact Bernoulli(exp(-gamma)) per entry for gamma = num / den in [0, 1] (uint64 num <= den,
    one den in [1, 2^56)), CKS Algorithm 1: K = 1; while Bernoulli(gamma / K) succeeds, K += 1;
    the answer is whether K ends odd.

    Bernoulli(num / M) with M = K den, exactly, from one 64-bit word w: with q = floor((2^64 - 1)
    / M), a word w < q M is uniform over q M values, and w < q num has probability num / M;
    words w >= q M (probability below M / 2^64) are redrawn. q is a Python integer per K, so no
    vector division is needed. The first step (K = 1) runs on every entry without index arrays;
    only the entries whose step succeeded (probability gamma) go on."""
    small = den < 1 << 24
    n_run = num.astype(np.uint32) if small else np.asarray(num, dtype=np.uint64)
    success = _bernoulli_step(n_run, den, 1, small, stream)
    result = ~success  # stopped at K = 1: odd, so 1
    running = np.flatnonzero(success)
    n_run = n_run[running]
    kk = 2
    while running.size:
        if kk > _MAX_LOOP:  # probability below 1 / 127!: exact, just slower
            result[running] = _bernoulli_exp_python(num[running], den, kk, stream)
            break
        success = _bernoulli_step(n_run, den, kk, small, stream)
        result[running[~success]] = bool(kk & 1)  # K stops at kk: odd K means 1
        running, n_run = running[success], n_run[success]
        kk += 1
    return result


def _bernoulli_step(n_run: np.ndarray, den: int, kk: int, small: bool, stream: Keystream) -> np.ndarray:
    """Bernoulli(n / (kk den)) per entry, exactly (see :func:`bernoulli_exp`)."""
    m = kk * den
    if small and m < 1 << 28:  # 32-bit words suffice (half the keystream)
        q = 0xFFFFFFFF // m
        w = _words_below(n_run.size, q * m, stream, np.uint32)
        return w < np.uint32(q) * n_run
    q = _ALL_ONES // m
    w = _words_below(n_run.size, q * m, stream, np.uint64)
    return w < np.uint64(q) * n_run.astype(np.uint64, copy=False)


def _bernoulli_exp_python(num: np.ndarray, den: int, first_k: int, stream: Keystream) -> np.ndarray:
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
