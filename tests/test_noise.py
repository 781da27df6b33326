"""The exact discrete Gaussian sampler, its keystream, and the argument that covers a study
(docs/protocol.md section 5a): the law checked against the exact pmf, the randomness traced to
one os.urandom key per batch, the rounding slack and the smoothing conditions computed."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from scipy import stats

from dpsketch.protocol import report as report_path
from dpsketch.client_sdk.prepare import prepare_batch
from dpsketch.protocol import noise, ring, smoothing
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.study import _clip_bound, design


def _exact_pmf(t: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(-limit, limit + 1)
    rho = np.exp(-(x.astype(float) ** 2) / (2.0 * t * t))
    return x, rho / rho.sum()


@pytest.mark.parametrize("t, limit", [(1, 19), (3, 59), (200, 3999), (5000, 99_999)])
def test_sampler_matches_the_exact_pmf_over_ten_million_draws(t, limit):
    """10^7 draws of N_Z(t) against the exact pmf: a chi-square over every value with an
    expected count of at least 20, and each tail beyond 3 t tested on its own (binomial).
    t = 1, 3 draw from the block table alone (blocks of one value); t = 200 and 5000 use blocks
    of 2 and 49 values with the exact offset acceptance (the last block of t = 5000 is cut short
    by the limit).

    The keystream is fresh (os.urandom), so each check is a test at its own level: at p > 1e-6
    the module's 13 p-value checks (chi-square and two binomials per t, the KS test below) fail
    a correct sampler in at most 1.3e-5 of runs (at p > 1e-4 it was 1.3e-3); a wrong law still
    gives p-values near 0 over 10^7 draws."""
    draws = noise.discrete_gaussian(10_000_000, t, limit, Keystream())
    assert np.abs(draws).max() <= limit
    x, pmf = _exact_pmf(t, limit)
    counts = np.bincount(draws + limit, minlength=x.size)
    expected = pmf * draws.size
    body = expected >= 20
    rest_obs, rest_exp = counts[~body].sum(), expected[~body].sum()
    chi = stats.chisquare(np.append(counts[body], rest_obs), np.append(expected[body], rest_exp))
    assert chi.pvalue > 1e-6, chi
    for side in (x > 3 * t, x < -3 * t):  # the tails, where a float sampler goes wrong
        p = pmf[side].sum()
        test = stats.binomtest(int(counts[side].sum()), draws.size, p)
        assert test.pvalue > 1e-6, (t, counts[side].sum(), p * draws.size)
    # symmetric, zero mean, variance of the discrete law (not t^2 exactly for small t)
    variance = float((pmf * x.astype(float) ** 2).sum())
    assert abs(draws.mean()) < 6 * math.sqrt(variance / draws.size)
    assert abs(draws.var() / variance - 1) < 6 * math.sqrt(2 / draws.size)


def test_large_parameter_is_the_gaussian_and_respects_the_cut():
    t = noise.MAX_SCALE
    draws = noise.discrete_gaussian(400_000, t, 20 * t - 1, Keystream())
    z = draws / t
    assert stats.kstest(z, "norm").pvalue > 1e-6  # a fresh key: false alarms at most 1e-6
    assert abs(z.std() - 1) < 6 / math.sqrt(2 * z.size)
    with pytest.raises(ValueError):
        noise.discrete_gaussian(10, t + 1, 10, Keystream())
    # a cut at 2 t really conditions: nothing beyond it, and the kept law is the truncated pmf
    cut = noise.discrete_gaussian(200_000, 50, 100, Keystream())
    assert np.abs(cut).max() <= 100 and np.abs(cut).max() >= 95


@pytest.mark.parametrize("den", [1_000_003, 2 * (1 << 24) ** 2])  # 32- and 64-bit words
@pytest.mark.parametrize("gamma", [0.0, 0.25, 0.6, 1.0])
def test_bernoulli_of_exp_minus_gamma_is_exact_in_law(gamma, den):
    n = 400_000
    num = np.full(n, round(gamma * den), dtype=np.uint64)
    p = math.exp(-int(num[0]) / den)
    hits = noise.bernoulli_exp(num, den, Keystream()).sum()
    assert abs(hits - n * p) <= 6 * math.sqrt(n * p * (1 - p)) + 1e-9


def test_block_table_bounds_are_the_cumulatives_and_ties_take_more_bits():
    """The table's 64-bit bounds are floor(2^64 F_j) (checked against a float computation to
    2^-40), and a word equal to a bound is settled by the next word against floor(2^128 F_j):
    below it U < F_j, above it U > F_j, exactly as the infinite-precision comparison says."""
    t, limit = 5000, 12345
    table = noise._block_table(t, limit)
    j = np.arange(limit // table.block + 1)
    rho = np.exp(-((table.block * j).astype(float) ** 2) / (2.0 * t * t))
    cdf = np.cumsum(rho) / rho.sum()
    assert table.bounds.size == j.size - 1
    assert np.all(np.diff(table.bounds.astype(float)) >= 0)
    assert np.allclose(table.bounds.astype(float) * 2.0 ** -64, cdf[:-1], rtol=0, atol=2.0 ** -40)

    class Words:  # a stream that returns chosen words, in order
        def __init__(self, words):
            self.left = list(words)

        def words(self, count):
            taken, self.left = self.left[:count], self.left[count:]
            return np.array(taken, dtype=np.uint64)

    k = 40
    fine = noise._cumulative_floors(t, limit, table.block, [k], 128)[0]
    assert fine >> 64 == int(table.bounds[k])
    low_half = fine & ((1 << 64) - 1)
    tie = int(table.bounds[k])
    assert table._resolve(tie, Words([low_half - 1])) == k  # U < F_k: J = k
    assert table._resolve(tie, Words([low_half + 1])) == k + 1  # U > F_k: J = k + 1
    # a word that equals the 128-bit prefix too reads a third word
    finer = noise._cumulative_floors(t, limit, table.block, [k], 192)[0] & ((1 << 64) - 1)
    assert table._resolve(tie, Words([low_half, finer + 1])) == k + 1
    # through draw: the tied word is the second of three; the refinement reads the next word
    below = int(table.bounds[k]) - 1
    assert list(table.draw(3, Words([below, tie, 0, low_half + 1]))) == [k, k + 1, 0]


def test_a_keystream_key_fixes_the_noise_and_nothing_else_draws(monkeypatch):
    """All randomness of a prepared batch (noise, shares, salts) comes from ONE os.urandom call of
    32 bytes (the ChaCha20 key): the same key gives the same bytes, numpy's generator is unused."""
    study, _ = design(name="n", columns=["a", "b", "c"], label=None, servers=["s1", "s2", "s3"],
                      expected_reports=10_000, epsilon=1.0, delta=1e-6)
    rows = np.linspace(-1, 1, 60).reshape(20, 3)
    calls = []
    key = bytes(range(32))

    def fake_urandom(n):
        calls.append(n)
        return key[:n] if n == 32 else os.urandom(n)

    def forbidden(*a, **k):
        raise AssertionError("numpy's statistical generator must not be used for noise")

    monkeypatch.setattr(os, "urandom", fake_urandom)
    monkeypatch.setattr(np.random, "default_rng", forbidden)
    a = prepare_batch(study, rows)
    b = prepare_batch(study, rows)
    assert calls == [32, 32]
    assert a.report_ids == b.report_ids
    assert all(np.array_equal(x, y) for x, y in zip(a.shares, b.shares))
    monkeypatch.undo()
    c = prepare_batch(study, rows)
    assert c.report_ids != a.report_ids
    # the reconstructed values are the rounded rows plus noise on the study's grid
    total = ring.reconstruct(c.shares).view(np.int64)
    assert np.all(total % (1 << study.noise_grid.shift) == 0)


def test_rounding_to_a_coarse_grid_keeps_the_sensitivity():
    """Rows clipped to clip_bound and rounded to the grid never exceed B (sketch) and the gram
    feature vectors keep their sensitivity, even on a grid as coarse as 1/4."""
    rng = np.random.default_rng(3)  # test data
    rows = rng.normal(size=(2000, 5)) * 10
    for shift in (0, 30):
        frac_bits = 32
        h = math.ldexp(1.0, shift - frac_bits)
        b = _clip_bound("sketch", 1.0, h * math.sqrt(5))
        assert b < 1.0
        rounded = ring.encode_on_grid(report_path.clip_rows(rows, b), frac_bits, shift, 2.0)
        norms = np.linalg.norm(rounded / 2.0 ** frac_bits, axis=1)
        assert norms.max() <= 1.0
        if shift:  # the coarse grid really moves values: without the margin B would be exceeded
            plain = ring.encode_on_grid(report_path.clip_rows(rows, 1.0), frac_bits, shift, 2.0)
            assert np.linalg.norm(plain / 2.0 ** frac_bits, axis=1).max() > 1.0


def test_the_argument_covers_default_studies_and_says_why_not_otherwise():
    common = dict(label=None, servers=["s1", "s2", "s3"], expected_reports=100_000, epsilon=1.0, delta=1e-6)
    sketch, _ = design(name="a", columns=list("abcd"), **common)
    arg = sketch.discrete_argument
    assert arg.covered and sketch.server_sigma > 0
    assert arg.linear_error_log2 < -1e5 and arg.epsilon_slack() == 0.0  # 2^-100000 underflows
    assert arg.delta_slack(1e-6, 1.0) < 1e-25
    assert sketch.guarantees()["discrete_noise"] is True
    assert sketch.guarantees()["epsilon"] <= 1.0 * (1 + 1e-9)
    # no server noise, s > 1: the smoothing needs the servers -> not covered, and it says so
    bare, _ = design(name="b", columns=list("abcd"), epsilon_floor=None, **common)
    if bare.s > 1:
        assert not bare.discrete_argument.covered
        assert "server" in bare.discrete_argument.reason
    # a gram study is a plain sum: covered without server noise
    gram, _ = design(name="c", columns=list("abc"), kind="gram", epsilon_floor=None, **common)
    assert gram.server_sigma == 0 and gram.discrete_argument.covered
    # the accounting with the grid's sigma_c and tau_c^2 - r^2 differs from the continuous one by
    # far less than the calibration's 1e-6 margin
    continuous = sketch.model_copy()
    assert abs(sketch.report_epsilon(sketch.lambda_star)
               - continuous.mechanism.epsilon(sketch.lambda_star, sketch.delta)) < 1e-6


def test_smoothing_error_bound():
    # beta sqrt(ln(2m(1 + 1/eps)) / pi) = 1 at the returned eps
    for beta, m in ((0.3, 100), (0.4, 10)):
        log2_eps = smoothing.smoothing_error_log2(beta, m)
        eps = 2.0 ** log2_eps
        assert math.isclose(beta * math.sqrt(math.log(2 * m * (1 + 1 / eps)) / math.pi), 1.0, rel_tol=1e-9)
    assert smoothing.smoothing_error_log2(1.0, 10) == math.inf


def test_the_block_table_is_built_once_however_many_threads_ask_at_once(monkeypatch):
    """The sampler's block table (about 0.1 s to build) is built once per (t, limit) even when
    many threads miss it together, as one-row devices starting at once in one process do; each
    gets the same table."""
    import threading

    from dpsketch.protocol import noise

    builds = []
    real = noise._cumulative_floors

    def counted(*args):
        builds.append(args[:2])
        return real(*args)

    monkeypatch.setattr(noise, "_cumulative_floors", counted)
    t, limit = 3001, 20 * 3001 - 7  # a (t, limit) no other test builds
    start = threading.Barrier(16)
    tables = []

    def ask():
        start.wait()
        tables.append(noise._block_table(t, limit))

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(tables) == 16 and all(tab is tables[0] for tab in tables)
    assert builds.count((t, limit)) == 1
