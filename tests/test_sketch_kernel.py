"""The compiled loops behind sketch.py (dpsketch/protocol/_sketch_kernel.py): the BLAKE2b loop
gives hashlib's bits (rows and signs equal the hashlib path and the reference form for random
seeds, ids and every block count s; the conformance vectors check the hashlib path), the
compiled rows and signs equal sketch.rows_signs's numpy arithmetic on random and edge words, and the
compiled accumulate equals the sparse product mod 2^64 (signs +1, -1 and 0, adding and
subtracting)."""

from __future__ import annotations

import contextlib
import hashlib
import os

import numpy as np
import pytest

from dpsketch.protocol import kernels, sketch


@pytest.mark.parametrize("s, k", [(1, 1), (1, 7), (2, 10), (3, 9), (4, 400), (5, 40), (8, 64)])
def test_compiled_hash_equals_hashlib(s, k):
    rng = np.random.default_rng(s * 1000 + k)
    for _ in range(3):
        seed = rng.bytes(32)
        ids = [rng.bytes(16) for _ in range(300)] + [bytes(16), b"\xff" * 16]
        words = sketch._digest_words(kernels.SKETCH.require(), seed, b"".join(ids), s)
        expected = np.frombuffer(b"".join(
            hashlib.blake2b(sketch.DOMAIN + rid, digest_size=8 * s, key=seed).digest() for rid in ids),
            dtype="<u8").reshape(len(ids), s)
        assert np.array_equal(words, expected)
    # the public function takes the compiled path for many ids and hashlib for few: same answer
    many = [os.urandom(16) for _ in range(kernels.MIN_ROWS + 5)]
    rows, signs = sketch.hash_report_ids(seed, many, k, s)
    few_rows, few_signs = zip(*(sketch.hash_report_ids(seed, many[i:i + 3], k, s) for i in range(0, 60, 3)))
    assert np.array_equal(np.concatenate(few_rows), rows[:60]) and np.array_equal(np.concatenate(few_signs), signs[:60])
    for i in (0, 17, len(many) - 1):
        for block in range(s):
            bucket, sign = sketch.bucket_and_sign(seed, many[i], k, s, block)
            assert rows[i, block] == block * (k // s) + bucket and signs[i, block] == sign


@pytest.mark.parametrize("m", [300, 3000])  # below and above kernels.RELEASE_FROM: both entry points
def test_compiled_rows_and_signs_equal_numpys(m):
    rng = np.random.default_rng(m)
    words = rng.integers(0, 2**64, (m, 4), dtype=np.uint64, endpoint=False)
    words[:4] = np.array([[0, 1, 2**32 - 1, 2**32], [2**63, 2**64 - 1, 2**64 - 2**32, 2**63 - 1],
                          [2**32 + 1, 2**33, 3, 2**64 - 2], [5, 2**62, 2**40 + 2**32 - 1, 6]], np.uint64)
    loop = kernels.SKETCH.require()
    for b, unit_signs in ((1, True), (1, False), (7, False), (100, False), (2**31 + 7, False), (2**32 - 1, False)):
        rows, signs = loop.rows_signs(words, b, unit_signs)
        want_rows, want_signs = sketch.rows_signs(words, b, unit_signs)
        assert rows.dtype == np.int64 and signs.dtype == np.int8
        assert np.array_equal(rows, want_rows) and np.array_equal(signs, want_signs), b
        assert rows.min() >= 0 and np.all(rows < b * (np.arange(4) + 1)) and set(np.unique(signs)) <= {-1, 1}
    assert np.all(loop.rows_signs(words, 100, True)[1] == 1)


@pytest.mark.parametrize("m", [300, 3000])  # below and above kernels.RELEASE_FROM: both entry points
@pytest.mark.parametrize("s, k, d", [(1, 1, 5), (2, 10, 3), (4, 400, 32), (8, 64, 7)])
def test_compiled_accumulate_equals_the_sparse_product(s, k, d, m):
    rng = np.random.default_rng(s + k + d)
    sketch.warm_up()
    rows = rng.integers(0, k // s, (m, s)) + np.arange(s) * (k // s)
    signs = rng.choice(np.array([-1, 0, 1], dtype=np.int8), (m, s))
    shares = rng.integers(0, 2**64, (m, d), dtype=np.uint64, endpoint=False)
    start = rng.integers(0, 2**64, (k, d), dtype=np.uint64, endpoint=False)
    for sign in (1, -1):
        acc = start.copy()
        sketch.accumulate(acc, rows, signs, shares, sign)  # m * s * 4 >= k: the compiled loop
        delta = sketch.signed_sum(rows, signs, shares, k)
        assert np.array_equal(acc, start + delta if sign > 0 else start - delta)
    for outside in (rows + k, rows - k):  # never writes outside, compiled or not (scipy's
        with pytest.raises(ValueError):  # product wrote out of bounds and crashed the process)
            sketch.accumulate(start.copy(), outside, signs, shares)
        with kernels.SKETCH.reference(), pytest.raises(ValueError):
            sketch.accumulate(start.copy(), outside, signs, shares)


@pytest.mark.parametrize("m", [60, 2000])  # below and above kernels.RELEASE_FROM: both entry points
@pytest.mark.parametrize("s, k", [(1, 1), (2, 10), (4, 400), (8, 64)])
def test_compiled_gram_equals_numpys(s, k, m):
    """The compiled s * S S^T running total equals numpy's (np.add.at per block pair), adding and
    subtracting, signs +1, -1 and 0 included; rows outside the matrix are refused either way."""
    rng = np.random.default_rng(7 * s + k)
    sketch.warm_up()
    rows = rng.integers(0, k // s, (m, s)) + np.arange(s) * (k // s)
    signs = rng.choice(np.array([-1, 0, 1], dtype=np.int8), (m, s))
    start = rng.integers(-1000, 1000, (k, k), dtype=np.int64)
    for sign in (1, -1):
        compiled = start.copy()
        sketch.accumulate_gram(compiled, rows, signs, sign)
        reference = start.copy()
        with kernels.SKETCH.reference():
            sketch.accumulate_gram(reference, rows, signs, sign)
        assert np.array_equal(compiled, reference)
        assert not np.array_equal(compiled, start) or not signs.any()
    for bad in (-1, k):  # one row just outside: np.add.at's flat index would take row -1 to a
        outside = rows.copy()  # valid cell of the last row, without an error
        outside[m // 2, s - 1] = bad
        for path in (contextlib.nullcontext, kernels.SKETCH.reference):
            target = start.copy()
            with path(), pytest.raises(ValueError, match="outside"):
                sketch.accumulate_gram(target, outside, signs)
            assert np.array_equal(target, start)  # refused before any write
