"""The compiled multi-key ChaCha20 (dpsketch/protocol/chacha.py): RFC 8439's test vectors, the
``cryptography`` package's ChaCha20 on random keys, nonces, counters and lengths, and seed
expansion (ring.expand_seeds) unchanged byte for byte from the one-cipher-per-seed definition."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from dpsketch.protocol import _chacha_kernel, chacha, kernels, ring

RFC_KEY = bytes(range(32))  # 00:01:02:...:1f


def reference(key: bytes, nonce: bytes, nbytes: int, counter: int = 0) -> bytes:
    """ChaCha20 keystream from OpenSSL through ``cryptography`` (its 16-byte nonce is the
    little-endian 32-bit initial counter followed by RFC 8439's 96-bit nonce)."""
    cipher = Cipher(algorithms.ChaCha20(key, counter.to_bytes(4, "little") + nonce), mode=None)
    return cipher.encryptor().update(bytes(nbytes))


ENGINES = pytest.mark.parametrize("compiled", [True, False], ids=["numba", "cryptography"])


@ENGINES
def test_rfc8439_section_2_3_2_block_function(compiled):
    want = bytes.fromhex(
        "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
        "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")
    got = chacha.keystream(RFC_KEY, bytes.fromhex("000000090000004a00000000"), 64, counter=1, compiled=compiled)
    assert got.shape == (1, 64) and got[0].tobytes() == want


@ENGINES
def test_rfc8439_section_2_4_2_encryption_over_two_blocks(compiled):
    plaintext = (b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for "
                 b"the future, sunscreen would be it.")
    want = bytes.fromhex(
        "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
        "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
        "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
        "5af90bbf74a35be6b40b8eedf2785e42874d")
    assert len(plaintext) == 114  # not a whole number of blocks, nor of 32-bit words
    stream = chacha.keystream(RFC_KEY, bytes.fromhex("000000000000004a00000000"), len(plaintext), counter=1,
                              compiled=compiled)
    assert bytes(a ^ b for a, b in zip(plaintext, stream[0].tobytes())) == want


@ENGINES
def test_rfc8439_appendix_a1_first_block_with_counter_zero(compiled):
    """Counter 0, as the seed expansion uses: the all-zero key and nonce (test vector #1)."""
    want = bytes.fromhex(
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586")
    assert chacha.keystream(bytes(32), bytes(12), 64, compiled=compiled)[0].tobytes() == want


@ENGINES
def test_many_keys_match_cryptography_on_random_keys_nonces_counters_and_lengths(compiled):
    rng = np.random.default_rng(20260)
    lengths = [0, 1, 4, 7, 63, 64, 65, 80, 127, 128, 129, 200, 800, 1000]
    for trial, nbytes in enumerate(lengths * 2):
        m = int(rng.integers(1, 70))  # around LANES: partial and whole lane groups
        keys = rng.integers(0, 256, size=(m, 32), dtype=np.uint8)
        nonce = rng.bytes(12)
        counter = int(rng.integers(0, 1 << 32)) if trial % 2 else 0
        counter = min(counter, (1 << 32) - -(-nbytes // 64))  # never wraps
        got = chacha.keystream(keys, nonce, nbytes, counter=counter, compiled=compiled)
        assert got.shape == (m, nbytes) and got.dtype == np.uint8
        for i in range(m):
            assert got[i].tobytes() == reference(keys[i].tobytes(), nonce, nbytes, counter), (trial, i)
    # concatenated keys as bytes give the same rows
    raw = rng.bytes(32 * 5)
    np.testing.assert_array_equal(chacha.keystream(raw, bytes(12), 96),
                                  chacha.keystream(np.frombuffer(raw, np.uint8).reshape(5, 32), bytes(12), 96))


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_rows_split_among_threads_give_the_same_keystream(threads):
    keys = np.random.default_rng(threads).integers(0, 256, size=(1001, 32), dtype=np.uint8)
    one = chacha.keystream(keys, ring.SEED_NONCE, 8 * 37, threads=1)
    np.testing.assert_array_equal(chacha.keystream(keys, ring.SEED_NONCE, 8 * 37, threads=threads), one)


def test_a_large_batch_is_split_by_default_and_still_exact():
    m = chacha.PARALLEL_WORDS // 50 + 1  # d = 25: just over the threshold
    keys = np.random.default_rng(3).integers(0, 256, size=(m, 32), dtype=np.uint8)
    got = chacha.keystream(keys, ring.SEED_NONCE, 200)
    for i in (0, m // 2, m - 1):
        assert got[i].tobytes() == reference(keys[i].tobytes(), ring.SEED_NONCE, 200)


@pytest.mark.parametrize("d", [1, 2, 7, 8, 9, 10, 15, 16, 17, 31, 100])
def test_expand_seeds_is_the_chacha20_keystream_of_each_seed(d):
    """Byte for byte what one ``cryptography`` cipher per seed gives (docs/protocol.md section 4:
    key = seed, counter 0, nonce SHA-256(b"dpsketch/seed-share/1")[:12]); d not a multiple of
    8 words leaves part of the last 64-byte block unused."""
    seeds = np.random.default_rng(d).integers(0, 256, size=(45, 32), dtype=np.uint8)
    got = ring.expand_seeds(seeds, d)
    assert got.shape == (45, d) and got.dtype == ring.WIRE_DTYPE and got.flags.writeable
    for i in range(45):
        want = np.frombuffer(reference(seeds[i].tobytes(), ring.SEED_NONCE, 8 * d), dtype="<u8")
        np.testing.assert_array_equal(got[i], want)
        if i < 3:
            np.testing.assert_array_equal(ring.expand_seed(seeds[i].tobytes(), d), want)
    np.testing.assert_array_equal(ring.expand_seeds(seeds.tobytes(), d), got)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        chacha.keystream(bytes(31), bytes(12), 64)
    with pytest.raises(ValueError):
        chacha.keystream(np.zeros((2, 16), np.uint8), bytes(12), 64)
    with pytest.raises(ValueError):
        chacha.keystream(bytes(32), bytes(8), 64)
    with pytest.raises(ValueError):
        chacha.keystream(bytes(32), bytes(12), 65, counter=(1 << 32) - 1)  # the counter would wrap
    assert chacha.keystream(bytes(32), bytes(12), 64, counter=(1 << 32) - 1).shape == (1, 64)
    with pytest.raises(ValueError):
        ring.expand_seeds(bytes(33), 4)
    with pytest.raises(ValueError):
        ring.expand_seed(bytes(16), 4)
    assert ring.expand_seeds(b"", 5).shape == (0, 5)
    assert ring.expand_seeds(np.zeros((3, 32), np.uint8), 0).shape == (3, 0)


def test_without_a_writable_cache_directory_the_loop_compiles_in_memory(monkeypatch):
    """A read-only install (no __pycache__, NUMBA_CACHE_DIR or user cache to write): numba
    refuses cache=True with a RuntimeError and the loop is compiled without a cache."""
    real = _chacha_kernel.numba.njit
    calls = []

    def njit(*args, **kwargs):
        calls.append(kwargs.get("cache"))
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function 'f': no locator available for file 'x.py'")
        return real(*args, **kwargs)

    monkeypatch.setattr(_chacha_kernel.numba, "njit", njit)

    def add(a, b):
        return a + b

    compiled = kernels.njit_cached(nogil=True)(add)
    assert calls == [True, False] and compiled(2, 3) == 5


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_expands_large_batches_with_threads_of_its_own():
    """After the parent's thread pool has run, a forked child (multiprocessing's default on
    Linux) still splits a large batch among threads and gets the same shares."""
    import multiprocessing

    keys = np.random.default_rng(11).integers(0, 256, size=(2000, 32), dtype=np.uint8)
    parent = chacha.keystream(keys, ring.SEED_NONCE, 80, threads=2)  # the parent's pool exists
    with multiprocessing.get_context("fork").Pool(1) as pool:
        child = pool.apply_async(chacha.keystream, (keys, ring.SEED_NONCE, 80), {"threads": 2}).get(timeout=120)
    np.testing.assert_array_equal(child, parent)


def test_small_batches_do_not_load_numba_until_a_large_one_comes():
    """A fresh process (a share server's first seed batches): fewer than kernels.MIN_ROWS keys take
    ``cryptography`` and leave numba unimported (about a second of CPU saved); a batch of
    kernels.MIN_ROWS keys loads the loop, and from then on every batch uses it. The rows agree."""
    import subprocess
    import sys

    code = """
import sys, numpy as np
from dpsketch.protocol import chacha, kernels
rng = np.random.default_rng(7)
keys = rng.integers(0, 256, size=(kernels.MIN_ROWS, 32), dtype=np.uint8)
small = chacha.keystream(keys[:100], bytes(12), 80)
assert "numba" not in sys.modules and kernels.CHACHA.state == "untried"
large = chacha.keystream(keys, bytes(12), 80)
assert "numba" in sys.modules and kernels.CHACHA.ready
again = chacha.keystream(keys[:100], bytes(12), 80)
assert (large[:100] == small).all() and (again == small).all()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
