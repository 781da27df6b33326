"""The compiled BLAKE2b loop behind the sketch hash (dpsketch/protocol/_blake2b_kernel.py) gives
hashlib's bits: rows and signs from it equal the hashlib path and the reference form for random
seeds, ids and every block count s (the conformance vectors check the hashlib path)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from dpsketch.protocol import sketch


@pytest.mark.parametrize("s, k", [(1, 1), (1, 7), (2, 10), (3, 9), (4, 400), (5, 40), (8, 64)])
def test_compiled_hash_equals_hashlib(s, k):
    rng = np.random.default_rng(s * 1000 + k)
    for _ in range(3):
        seed = rng.bytes(32)
        ids = [rng.bytes(16) for _ in range(300)] + [bytes(16), b"\xff" * 16]
        words = sketch._digest_words(seed, b"".join(ids), s)
        expected = np.frombuffer(b"".join(
            hashlib.blake2b(sketch.DOMAIN + rid, digest_size=8 * s, key=seed).digest() for rid in ids),
            dtype="<u8").reshape(len(ids), s)
        assert np.array_equal(words, expected)
    # the public function takes the compiled path for many ids and hashlib for few: same answer
    many = [os.urandom(16) for _ in range(sketch._KERNEL_MIN_IDS + 5)]
    rows, signs = sketch.hash_report_ids(seed, many, k, s)
    few_rows, few_signs = zip(*(sketch.hash_report_ids(seed, many[i:i + 3], k, s) for i in range(0, 60, 3)))
    assert np.array_equal(np.concatenate(few_rows), rows[:60]) and np.array_equal(np.concatenate(few_signs), signs[:60])
    for i in (0, 17, len(many) - 1):
        for block in range(s):
            bucket, sign = sketch.bucket_and_sign(seed, many[i], k, s, block)
            assert rows[i, block] == block * (k // s) + bucket and signs[i, block] == sign
