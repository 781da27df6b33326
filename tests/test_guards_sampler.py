"""The exact discrete Gaussian sampler's law inside each block (issue 47).

``noise.discrete_gaussian`` draws |X| = m J + R: the block J from an exact table, the offset R
uniform below m, kept with Bernoulli(exp(-gamma / (2 t^2))), gamma = 2 m J R + R^2. The
end-to-end chi-square of tests/test_noise.py (10^7 draws) sees the block masses, but a tilt
inside a block is below 1 % of a block's mass (m / t is about 20 / 2048), so a sampler that kept
offsets with exp(-gamma / 2) instead passed it. These tests pin the offset step directly:

* every proposal's acceptance exponent is exactly (|X|^2 - (m J)^2) / (2 t^2), for the |X| it
  yields (a deterministic check on every draw: no false alarm, and any change of the exponent's
  numerator or denominator fails it);
* the acceptance step's law, Bernoulli(exp(-gamma)), in bulk at fixed gammas (power stated in
  each test);
* the offset's proposal is exactly uniform below m (chi-square, power stated).

Reproducible: every stream is ``Keystream.from_key`` with a fixed key, so a run's verdict is
fixed; the stated false-alarm rates are what a fresh key would give.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from scipy import stats

from dpsketch.protocol import noise
from dpsketch.protocol.keystream import Keystream

T = 4096
LIMIT = 20 * T - 1  # blocks of m = 40 offsets
Z_MAX = 5.0  # two-sided false alarm 5.7e-7 per check


def _stream(tag: int) -> Keystream:
    return Keystream.from_key(bytes([tag]) * 32)


@pytest.mark.parametrize("limit,m", [(LIMIT, 40), (10_250, 6)])
def test_every_offset_is_kept_with_exp_minus_x2_minus_mj2_over_2t2(monkeypatch, limit, m):
    """Spy on the offset's Bernoulli (the real one still decides): for every value drawn, the
    proposal that yielded it was tested with num / den = (|X|^2 - (m J)^2) / (2 t^2) and succeeded.
    Then P(|X| = x) is proportional to P(J = j) exp(-num / den) = rho(m j) rho(x) / rho(m j) = rho(x)
    inside every block. 200 000 draws. With the 20-sigma limit (m = 40) gamma reaches 0.195 and
    every (J, R) of the body is visited; with a cut at 2.5 t (m = 6, the last block reaching past
    the limit) about 1.2 % of the draws lie beyond 2.5 t - m, so the cut inside the last block is
    exercised: no |X| beyond the limit, and the limit itself is reached."""
    calls = []
    real = noise.bernoulli_exp

    def spy(num, den, stream):
        kept = real(num, den, stream)
        calls.append((np.array(num, dtype=np.uint64), den, kept.copy()))
        return kept

    monkeypatch.setattr(noise, "bernoulli_exp", spy)
    table = noise._block_table(T, limit)
    assert table.block == m and table.partial_last == (limit != LIMIT)
    x = noise.discrete_gaussian(200_000, T, limit, _stream(1))
    assert int(np.abs(x).max()) <= limit
    if table.partial_last:
        assert int(np.abs(x).max()) > limit - m  # the last, partial block is drawn from
    assert calls and all(den == 2 * T * T for _, den, _ in calls)
    a = np.abs(x).astype(np.int64)
    j, r = a // m, a % m
    exponent = (a * a - (m * j) ** 2)
    assert np.array_equal(exponent, 2 * m * j * r + r * r)
    kept = Counter(np.concatenate([num[k] for num, _, k in calls]).tolist())
    needed = Counter(exponent.tolist())
    short = {g: c for g, c in needed.items() if kept[g] < c}
    assert not short, f"{len(short)} exponents drawn more often than kept, e.g. {list(short.items())[:5]}"
    # the offsets are all there: every R of a central block occurs
    assert set(r[j == 50].tolist()) == set(range(m))


def test_the_kept_fraction_of_offsets_is_the_sum_of_their_acceptance_probabilities(monkeypatch):
    """The same spy, read as a law: over the N ~ 2.1e5 proposals of 200 000 draws, the number
    kept must equal sum exp(-gamma_i / (2 t^2)) within 5 standard deviations
    (sd = sqrt(sum p_i (1 - p_i)), about 29 here; false alarm 5.7e-7). Keeping with
    exp(-gamma / 2) would keep about 420 more (z ~ 14: detected with probability > 1 - 1e-20),
    a 1 % change of each acceptance probability about 2000 more (z ~ 70)."""
    calls = []
    real = noise.bernoulli_exp

    def spy(num, den, stream):
        kept = real(num, den, stream)
        calls.append((np.asarray(num, dtype=np.float64) / den, kept.copy()))
        return kept

    monkeypatch.setattr(noise, "bernoulli_exp", spy)
    noise.discrete_gaussian(200_000, T, LIMIT, _stream(2))
    gamma = np.concatenate([g for g, _ in calls])
    kept = np.concatenate([k for _, k in calls])
    p = np.exp(-gamma)
    sd = math.sqrt(float(np.sum(p * (1 - p))))
    z = (int(kept.sum()) - float(p.sum())) / sd
    assert abs(z) < Z_MAX, z
    # the power claim, from the same proposals: halving gamma moves the expectation by
    tilt = float(np.sum(np.exp(-gamma / 2) - p)) / sd
    assert tilt > 10, tilt


@pytest.mark.parametrize("den", [2 * 64 * 64, 2 * T * T, 2 * (1 << 20) ** 2])  # 32- and 64-bit paths
def test_bernoulli_exp_minus_gamma_in_bulk(den):
    """Bernoulli(exp(-num / den)) at gamma = 0.01, 0.05, 0.195 and 1.0, 400 000 entries each (both
    word widths of ``_bernoulli_step``): each success count within 5 sd of exp(-gamma) N (false
    alarm 5.7e-7 per gamma). Power against the issue's tilt: exp(-gamma / 2) moves the count at
    gamma = 0.195 by 0.083 N, i.e. z ~ 270; a 1 % relative change of exp(-gamma) moves it by
    z >= 13 at every gamma here (at gamma = 0.01: p = 0.990, sd = 1.6e-4, shift 9.9e-3 ~ 63 sd)."""
    n = 400_000
    stream = _stream(3)
    for gamma in (0.01, 0.05, 0.195, 1.0):
        num_value = round(gamma * den)
        num = np.full(n, num_value, dtype=np.uint64)
        p = math.exp(-num_value / den)
        hits = int(noise.bernoulli_exp(num, den, stream).sum())
        sd = math.sqrt(n * p * (1 - p))
        assert abs(hits - n * p) < Z_MAX * sd, (gamma, den, hits, n * p, sd)
        assert abs(n * math.exp(-num_value / den / 2) - n * p) > 4 * Z_MAX * sd  # >= 31 sd at every gamma
    # gamma = 0 is always kept: exp(0) = 1
    assert noise.bernoulli_exp(np.zeros(1000, dtype=np.uint64), den, stream).all()


def test_bernoulli_exp_mixed_gammas_in_one_call():
    """One call with entries at different gammas (the sampler's case): each group's count matches
    its own exp(-gamma) (5 sd each), so no entry's answer leaks into another's."""
    den = 2 * T * T
    groups = np.array([0, den // 50, den // 5, den])
    num = np.repeat(groups, 100_000).astype(np.uint64)
    order = np.random.default_rng(0).permutation(num.size)
    kept = noise.bernoulli_exp(num[order], den, _stream(4))
    back = np.empty_like(kept)
    back[order] = kept
    for g, chunk in zip(groups, np.split(back, 4)):
        p = math.exp(-int(g) / den)
        sd = math.sqrt(chunk.size * p * (1 - p)) or 1e-9
        assert abs(int(chunk.sum()) - chunk.size * p) < Z_MAX * sd + 1e-6, (g, chunk.sum(), p)


def test_bernoulli_exp_python_tail_has_the_same_law():
    """The rare tail of Algorithm 1 (K > 128, Python integers) run from K = 1 on 20 000 entries
    at gamma = 0.195: within 5 sd of exp(-gamma) (sd = 55 successes; false alarm 5.7e-7);
    exp(-gamma / 2) would be about 30 sd away."""
    den = 2 * T * T
    num_value = round(0.195 * den)
    n = 20_000
    got = noise._bernoulli_exp_python(np.full(n, num_value, dtype=np.uint64), den, 1, _stream(5))
    p = math.exp(-num_value / den)
    sd = math.sqrt(n * p * (1 - p))
    assert abs(int(got.sum()) - n * p) < Z_MAX * sd
    assert abs(n * math.exp(-num_value / den / 2) - n * p) > 6 * Z_MAX * sd


@pytest.mark.parametrize("bound", [40, 3, (1 << 28) + 3])
def test_offset_proposal_is_uniform_below_m(bound):
    """``uniform_below`` (the offset R): 600 000 draws all below the bound; for small bounds a
    chi-square over the values (p > 1e-6); for a bound past the 32-bit path, the top and bottom
    halves balance within 5 sd (false alarm 5.7e-7). The within-block tilt itself is pinned by
    the acceptance tests above; this pins the proposal the acceptance is applied to."""
    n = 600_000
    r = noise.uniform_below(n, bound, _stream(6))
    assert r.dtype == np.uint64 and int(r.max()) < bound
    if bound < 1000:
        counts = np.bincount(r.astype(np.int64), minlength=bound)
        assert counts.size == bound and counts.min() > 0
        assert stats.chisquare(counts).pvalue > 1e-6
    else:
        low = int((r < bound // 2).sum())
        assert abs(low - n * (bound // 2) / bound) < Z_MAX * math.sqrt(n / 4)
        assert int(r.max()) > bound - bound // 1000  # reaches the top


def test_the_block_table_is_exact_at_every_entry():
    """The block stage: bounds[j] = floor(2^64 F_j) with F_j = sum_{i <= j} rho(m i) / sum_i rho(m i)
    for every j, recomputed here with 120-digit decimals (independent of the module's own
    precision strategy)."""
    import decimal

    table = noise._block_table(T, LIMIT)
    m, last = table.block, LIMIT // table.block
    with decimal.localcontext() as ctx:
        ctx.prec = 120
        two_t2 = decimal.Decimal(2 * T * T)
        terms = [(-decimal.Decimal((m * i) ** 2) / two_t2).exp() for i in range(last + 1)]
        total = sum(terms)
        running = decimal.Decimal(0)
        expected = []
        for j in range(last):
            running += terms[j]
            expected.append(int((running / total * (1 << 64)).to_integral_value(decimal.ROUND_FLOOR)))
    assert table.bounds.tolist() == expected
    assert table.den == 2 * T * T


@pytest.mark.parametrize("t,limit", [(1, 19), (2, 39), (3, 59)])
def test_small_parameters_follow_the_exact_pmf_with_zero_counted_once(t, limit):
    """t <= 3 (blocks of one value: no offset step): 300 000 draws against the exact pmf
    rho(x) / sum rho on -limit .. limit, a chi-square over the values with mass above 1e-4 (the rest
    pooled), p > 1e-6 (false alarm 1e-6). Counting 0 for both signs (not rejecting -0) would move
    P(0) from 0.40 / 0.20 / 0.13 to about 0.57 / 0.33 / 0.24: a z of 100 or more."""
    n = 300_000
    x = noise.discrete_gaussian(n, t, limit, _stream(7 + t))
    assert int(np.abs(x).max()) <= limit
    values = np.arange(-limit, limit + 1)
    rho = np.exp(-(values.astype(float) ** 2) / (2.0 * t * t))
    pmf = rho / rho.sum()
    counts = np.bincount(x + limit, minlength=values.size)
    body = pmf > 1e-4
    obs = np.append(counts[body], counts[~body].sum())
    exp = np.append(pmf[body], pmf[~body].sum()) * n
    assert stats.chisquare(obs, exp).pvalue > 1e-6
    p0 = pmf[limit]
    assert abs(counts[limit] - n * p0) < Z_MAX * math.sqrt(n * p0 * (1 - p0))


class _Words:
    """A stream that returns chosen 64-bit words, in order (the block stage reads words only)."""

    def __init__(self, words):
        self.left = [int(w) for w in words]

    def words(self, count):
        taken, self.left = self.left[:count], self.left[count:]
        return np.array(taken, dtype=np.uint64)


def test_the_block_stage_places_every_word_by_the_table():
    """J for a word w is the number of cumulative bounds below it (w never equal to one here):
    the 2^16-entry guide answers most words, the binary search the words of slices holding a
    bound. Words one below and one above every bound, plus slice edges, must all get
    searchsorted(bounds, w) exactly - a guide used for a crowded slice would be off by one."""
    table = noise._block_table(T, LIMIT)
    b = table.bounds.astype(object)
    words = [int(v) - 1 for v in b if int(v) > 0] + [int(v) + 1 for v in b if int(v) < (1 << 64) - 1]
    words += [p << 48 for p in range(0, 1 << 16, 257)] + [((p + 1) << 48) - 1 for p in range(0, 1 << 16, 263)]
    words = [w for w in words if w not in set(int(v) for v in b)]
    got = table.draw(len(words), _Words(words))
    want = np.searchsorted(table.bounds, np.array(words, dtype=np.uint64), side="right")
    assert got.dtype == np.uint64 and np.array_equal(got.astype(np.int64), want)
    assert table.crowded[(np.array(words, dtype=np.uint64) >> np.uint64(48)).astype(np.int64)].any()


@pytest.mark.parametrize("std,frac_bits,shift", [(1.0, 16, 0), (3.7, 20, 2), (0.01, 30, 0), (1000.0, 20, 12)])
def test_the_tail_cut_is_the_protocols_floor_of_20_sigma_over_h_minus_1(std, frac_bits, shift):
    """docs/protocol.md section 5: |X| <= floor(20 sigma / h) - 1 grid steps h = 2^(shift - f),
    so every kept value lies strictly inside 20 sigma (the overflow bound counts 20 sigma); the
    sampler's parameter is ceil(sigma / h) steps."""
    grid = noise.Grid(frac_bits, shift)
    h = 2.0 ** (shift - frac_bits)
    assert grid.spacing == h
    assert grid.limit(std) == math.floor(20 * std / h) - 1
    assert grid.limit(std) * h < 20 * std
    assert grid.scale(std) == max(1, math.ceil(std / h))
    assert grid.scale(std) * h >= std


def test_a_rejected_word_is_redrawn_at_its_own_width():
    """``_words_below``: a word at or above the top is redrawn from the same width of keystream
    (a 64-bit redraw taken from 32-bit words would put it below 2^32, far from uniform). A
    stream that first returns words above the top shows which words replace them."""
    class Scripted:
        def __init__(self, words64, words32):
            self.w64, self.w32 = list(words64), list(words32)

        def words(self, count):
            taken, self.w64 = self.w64[:count], self.w64[count:]
            return np.array(taken, dtype=np.uint64)

        def words32(self, count):
            taken, self.w32 = self.w32[:count], self.w32[count:]
            return np.array(taken, dtype=np.uint32)

    top64 = (1 << 64) - 5
    stream = Scripted([top64 + 1, 7, top64, (1 << 63) + 11, 1 << 40], [1, 2, 3])  # the top itself is out
    got = noise._words_below(3, top64, stream, np.uint64)
    assert got.dtype == np.uint64 and got.tolist() == [(1 << 63) + 11, 7, 1 << 40]
    top32 = (1 << 32) - 7
    stream = Scripted([99, 98], [top32 + 2, 5, top32, 4_000_000_000, 6])
    got = noise._words_below(3, top32, stream, np.uint32)
    assert got.dtype == np.uint32 and got.tolist() == [4_000_000_000, 5, 6]


def test_a_parameter_below_one_step_is_one_step_and_a_zero_limit_gives_zero():
    """Noise narrower than the grid still gets parameter 1 (never 2: that would be another
    distribution than the accounting's); a limit of 0 keeps only 0."""
    grid = noise.Grid(16, 0)
    assert grid.scale(2.0 ** -20) == 1 and grid.scale(2.0 ** -16) == 1 and grid.scale(1.5 * 2.0 ** -16) == 2
    assert grid.limit(2.0 ** -20) == 0 and grid.limit(2.0 ** -16) == 19  # floor(20 sigma / h) - 1, at least 0
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            noise.encoded_noise(3, bad, grid)
    assert noise.discrete_gaussian(500, 3, 0, _stream(11)).tolist() == [0] * 500
    with pytest.raises(ValueError):
        noise.discrete_gaussian(1, 3, -1, _stream(11))


def test_a_word_equal_to_any_bound_takes_more_bits_including_the_first():
    """A word equal to bounds[j] (j = 0, a middle one, the last) is settled by the next word
    against floor(2^128 F_j): below it J = j, above it J = j + 1 - for the first bound too."""
    table = noise._block_table(T, LIMIT)
    last = table.bounds.size - 1
    for j in (0, 1, last // 2, last):
        tie = int(table.bounds[j])
        if (table.bounds == table.bounds[j]).sum() != 1:
            continue
        fine = noise._cumulative_floors(T, LIMIT, table.block, [j], 128)[0]
        low = fine & ((1 << 64) - 1)
        assert table.draw(1, _Words([tie, low - 1])).tolist() == [j]
        assert table.draw(1, _Words([tie, low + 1])).tolist() == [j + 1]


def test_the_offsets_gamma_guard_at_its_edge():
    """A table whose offset exponent could reach 1 is refused (Bernoulli(exp(-gamma)) needs
    gamma <= 1): discrete_gaussian takes any limit up to that edge and refuses past it."""
    t = 1000
    ok, too_far = None, None
    for limit in range(30 * t, 50 * t, 97):
        m = -(-(limit + 1) // 2048)
        last = limit // m
        reaches = (2 * m * last + m) * m >= 2 * t * t
        if not reaches:
            ok = limit
        elif too_far is None:
            too_far = limit
    assert ok is not None and too_far is not None and ok > 40 * t
    x = noise.discrete_gaussian(2000, t, ok, _stream(12))
    assert int(np.abs(x).max()) <= ok
    with pytest.raises(ValueError):
        noise.discrete_gaussian(10, t, too_far, _stream(12))
    # blocks of two values (m = 2) are guarded too: t = 60, a cut at 3000 would reach gamma >= 1
    assert -(-3001 // 2048) == 2 and (2 * 2 * (3000 // 2) + 2) * 2 >= 2 * 60 * 60
    with pytest.raises(ValueError):
        noise.discrete_gaussian(10, 60, 3000, _stream(12))


def test_uniform_below_a_64_bit_bound():
    """Bounds past 2^32 (the 64-bit path): all values below the bound, halves balanced (5 sd)."""
    n, bound = 200_000, (1 << 40) + 3
    r = noise.uniform_below(n, bound, _stream(13))
    assert int(r.max()) < bound and int(r.max()) > bound // 2
    assert abs(int((r < bound // 2).sum()) - n / 2) < Z_MAX * math.sqrt(n / 4)


def test_the_python_uniform_rejects_the_limit_word_itself():
    """``_uniform_below_int`` (the Bernoulli's rare tail): a word at the limit (the largest
    multiple of the bound that fits) is redrawn, or 0 would be drawn once too often."""
    bound = 3 * 2 ** 70 + 1
    nbytes = (bound.bit_length() + 7) // 8 + 8
    top = 1 << (8 * nbytes)
    limit = top - top % bound

    class Bytes:
        def __init__(self, values):
            self.values = list(values)

        def bytes(self, n):
            assert n == nbytes
            return self.values.pop(0).to_bytes(n, "little")

    assert noise._uniform_below_int(bound, Bytes([limit, 5])) == 5
    assert noise._uniform_below_int(bound, Bytes([limit - 1, 5])) == (limit - 1) % bound


def test_the_largest_parameter_is_allowed_and_one_more_is_not():
    x = noise.discrete_gaussian(1000, noise.MAX_SCALE, 20 * noise.MAX_SCALE - 1, _stream(14))
    assert int(np.abs(x).max()) < 20 * noise.MAX_SCALE
    with pytest.raises(ValueError):
        noise.discrete_gaussian(1, noise.MAX_SCALE + 1, 10, _stream(14))


class _Same:
    """A stream whose every 32- and 64-bit word is ``word``."""

    def __init__(self, word: int):
        self.word = word

    def words32(self, count):
        return np.full(count, self.word, dtype=np.uint32)

    def words(self, count):
        return np.full(count, self.word, dtype=np.uint64)


def test_a_bernoulli_step_compares_strictly_below_q_n():
    """Bernoulli(n / M) from a word w < q M: success iff w < q n, so the word q n itself fails
    (on both word widths); <= would add 1 / (q M) to every success probability."""
    n = 3
    for small, den in ((True, 8), (False, 1 << 30)):
        q = (0xFFFFFFFF if small and den < 1 << 28 else (1 << 64) - 1) // den
        num = np.array([n], dtype=np.uint32 if small else np.uint64)
        assert noise._bernoulli_step(num, den, 1, small, _Same(q * n)).tolist() == [False]
        assert noise._bernoulli_step(num, den, 1, small, _Same(q * n - 1)).tolist() == [True]


def test_the_python_tail_is_reached_through_bernoulli_exp_and_ends(monkeypatch):
    """With the vector loop cut at K = 1 every entry still running goes to the Python tail, which
    must finish with the same law: 40 000 entries at gamma = 0.5 within 5 sd of exp(-0.5)."""
    monkeypatch.setattr(noise, "_MAX_LOOP", 1)
    den = 2 * T * T
    n = 40_000
    got = noise.bernoulli_exp(np.full(n, den // 2, dtype=np.uint64), den, _stream(15))
    p = math.exp(-(den // 2) / den)
    assert abs(int(got.sum()) - n * p) < Z_MAX * math.sqrt(n * p * (1 - p))
