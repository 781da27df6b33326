"""The compiled loops behind ``sketch.py`` for many reports: the sketch hash (BLAKE2b, RFC 7693)
and the signed sum S' X into a running aggregate.

The hash.

The sketch hash of a report id r is keyed BLAKE2b(key = seed, digest_size = 8 s) of the 32-byte
message ``DOMAIN || r``: a key block, then one final block holding the message. The key block's
compression is the same for every id, so it is done once per call; per id, one compression of a
block whose only non-zero words are the two domain words and the id's two words, and the digest
words are the state's first s words (little-endian, exactly the u_l of docs/protocol.md). The
result is bit for bit hashlib's (tests compare them on random seeds, ids and every s); this only
removes the per-id Python overhead (a hashlib object, a copy and a digest per id), and releases
the GIL.

The rows and signs: from the digest words, each block's bucket floor(u * b / 2^64) and the sign
from u's low bit, in one pass (sketch.py's numpy form of the same arithmetic made a dozen passes
over the (m, s) words: 4.0 ms of a 27,594-id batch's 11.2 ms).

The signed sum: acc[rows[i, l]] += sign * signs[i, l] * shares[i] (mod 2^64), a plain loop over
the reports in order (numba's uint64 arithmetic wraps as numpy's does): about 15x faster than
the sparse product of ``sketch.signed_sum`` for a 10^4 x 32 batch, without a dense k x d delta.
The s * S S^T running total likewise: s^2 additions per report in one loop, where numpy's
``np.add.at`` took s^2 calls per batch (0.16 us a report at s = 4, and 130 us for a group of
thirty single uploads).

Loaded on first use by kernels.py (its rule: when, and the reference while it is not loaded),
through :func:`load`; compiled with numba's on-disk cache where one is writable.
"""

from __future__ import annotations

import hashlib

import numba
import numpy as np

from .kernels import RELEASE_FROM, njit_cached

IV = np.array([0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1,
               0x510E527FADE682D1, 0x9B05688C2B3E6C1F, 0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179],
              dtype=np.uint64)
SIGMA = np.array([
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
    [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
    [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
    [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
    [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
    [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
    [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
    [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
], dtype=np.int64)
#: the (a, b, c, d) state words of the eight G calls of a round
COLUMNS = np.array([[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15],
                     [0, 5, 10, 15], [1, 6, 11, 12], [2, 7, 8, 13], [3, 4, 9, 14]], dtype=np.int64)

_OPTIONS = dict(boundscheck=False, error_model="numpy")


@numba.njit(inline="always")
def _rotr(x, n):
    return (x >> np.uint64(n)) | (x << np.uint64(64 - n))


@numba.njit(inline="always")
def _compress(h, m, v, t, last, sigma, columns, iv):
    """h ^= the BLAKE2b compression of block ``m`` at byte offset ``t`` (RFC 7693, 3.2)."""
    for i in range(8):
        v[i] = h[i]
        v[i + 8] = iv[i]
    v[12] ^= np.uint64(t)
    if last:
        v[14] = ~v[14]
    for r in range(12):
        for g in range(8):
            a, b, c, d = columns[g, 0], columns[g, 1], columns[g, 2], columns[g, 3]
            x, y = m[sigma[r, 2 * g]], m[sigma[r, 2 * g + 1]]
            va = v[a] + v[b] + x
            vd = _rotr(v[d] ^ va, 32)
            vc = v[c] + vd
            vb = _rotr(v[b] ^ vc, 24)
            va = va + vb + y
            vd = _rotr(vd ^ va, 16)
            vc = vc + vd
            vb = _rotr(vb ^ vc, 63)
            v[a], v[b], v[c], v[d] = va, vb, vc, vd
    for i in range(8):
        h[i] ^= v[i] ^ v[i + 8]


@numba.njit(inline="always")
def _g(a, b, c, d, x, y):
    """The mixing function G (RFC 7693, 3.1)."""
    a = a + b + x
    d = _rotr(d ^ a, 32)
    c = c + d
    b = _rotr(b ^ c, 24)
    a = a + b + y
    d = _rotr(d ^ a, 16)
    c = c + d
    b = _rotr(b ^ c, 63)
    return a, b, c, d


@numba.njit(**_OPTIONS)
def _keyed_words(key_words, key_bytes, digest_bytes, prefix_words, id_words, out, sigma, columns, iv):
    """out[i, :] = the first out.shape[1] little-endian words of BLAKE2b(key, digest_bytes)
    over prefix || id i, for a 16-byte prefix (two words) and 16-byte ids (id_words (m, 2));
    key_words: the key zero-padded to 16 words."""
    h0 = iv.copy()
    h0[0] ^= np.uint64(0x01010000) ^ (np.uint64(key_bytes) << np.uint64(8)) ^ np.uint64(digest_bytes)
    v = np.empty(16, dtype=np.uint64)
    m = np.zeros(16, dtype=np.uint64)
    for j in range(16):
        m[j] = key_words[j]
    _compress(h0, m, v, 128, False, sigma, columns, iv)  # the key block
    m[:] = 0
    m[0] = prefix_words[0]
    m[1] = prefix_words[1]
    width = out.shape[1]
    for i in range(id_words.shape[0]):
        # the message block (key block + 32 bytes, the last): the 16 state words as scalars,
        # so they stay in registers through the 12 rounds
        m[2] = id_words[i, 0]
        m[3] = id_words[i, 1]
        v0, v1, v2, v3, v4, v5, v6, v7 = h0[0], h0[1], h0[2], h0[3], h0[4], h0[5], h0[6], h0[7]
        v8, v9, v10, v11 = iv[0], iv[1], iv[2], iv[3]
        v12, v13, v14, v15 = iv[4] ^ np.uint64(160), iv[5], ~iv[6], iv[7]
        for r in range(12):
            v0, v4, v8, v12 = _g(v0, v4, v8, v12, m[sigma[r, 0]], m[sigma[r, 1]])
            v1, v5, v9, v13 = _g(v1, v5, v9, v13, m[sigma[r, 2]], m[sigma[r, 3]])
            v2, v6, v10, v14 = _g(v2, v6, v10, v14, m[sigma[r, 4]], m[sigma[r, 5]])
            v3, v7, v11, v15 = _g(v3, v7, v11, v15, m[sigma[r, 6]], m[sigma[r, 7]])
            v0, v5, v10, v15 = _g(v0, v5, v10, v15, m[sigma[r, 8]], m[sigma[r, 9]])
            v1, v6, v11, v12 = _g(v1, v6, v11, v12, m[sigma[r, 10]], m[sigma[r, 11]])
            v2, v7, v8, v13 = _g(v2, v7, v8, v13, m[sigma[r, 12]], m[sigma[r, 13]])
            v3, v4, v9, v14 = _g(v3, v4, v9, v14, m[sigma[r, 14]], m[sigma[r, 15]])
        v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7] = (
            h0[0] ^ v0 ^ v8, h0[1] ^ v1 ^ v9, h0[2] ^ v2 ^ v10, h0[3] ^ v3 ^ v11,
            h0[4] ^ v4 ^ v12, h0[5] ^ v5 ^ v13, h0[6] ^ v6 ^ v14, h0[7] ^ v7 ^ v15)
        for j in range(width):
            out[i, j] = v[j]


@numba.njit(**_OPTIONS)
def _accumulate(acc, rows, signs, shares, sign):
    """acc[rows[i, l]] += sign * signs[i, l] * shares[i]  (mod 2^64) for every report i and
    block l; a sign of 0 adds nothing (the l1 sketch's empty slot)."""
    m, s = rows.shape
    d = shares.shape[1]
    for i in range(m):
        for b in range(s):
            g = signs[i, b] * sign
            if g == 0:
                continue
            r = rows[i, b]
            if g > 0:
                for j in range(d):
                    acc[r, j] += shares[i, j]
            else:
                for j in range(d):
                    acc[r, j] -= shares[i, j]


@numba.njit(**_OPTIONS)
def _rows_signs(words, b, unit_signs, rows, signs):
    """rows[i, l] = l * b + floor(words[i, l] * b / 2^64) and signs[i, l] = +1 where the word's
    low bit is 0, else -1 (all +1 with ``unit_signs``): sketch.hash_report_ids's arithmetic, in
    uint64 as there (32-bit halves, no 128-bit product)."""
    m, s = words.shape
    bb = np.uint64(b)
    low = np.uint64(0xFFFFFFFF)
    shift = np.uint64(32)
    one = np.uint64(1)
    for i in range(m):
        for l in range(s):
            u = words[i, l]
            hi = u >> shift
            lo = u & low
            bucket = (hi * bb + ((lo * bb) >> shift)) >> shift
            rows[i, l] = np.int64(bucket) + l * b
            signs[i, l] = 1 if unit_signs or (u & one) == 0 else -1


@numba.njit(**_OPTIONS)
def _accumulate_gram(sst, rows, signs, sign):
    """sst[rows[i, a], rows[i, c]] += sign * signs[i, a] * signs[i, c] for every report i and
    blocks a, c (sketch.accumulate_gram's s * S S^T)."""
    m, s = rows.shape
    for i in range(m):
        for a in range(s):
            ga = np.int64(signs[i, a]) * sign
            if ga == 0:
                continue
            ra = rows[i, a]
            for c in range(s):
                sst[ra, rows[i, c]] += ga * np.int64(signs[i, c])


# Each loop has two entry points: one that releases the GIL while it runs (a large batch: the
# server's other threads go on meanwhile) and one that keeps it (kernels.RELEASE_FROM says when;
# load() checks both).
_release_from = RELEASE_FROM


@njit_cached(nogil=True, **_OPTIONS)
def _keyed_words_released(key_words, key_bytes, digest_bytes, prefix_words, id_words, out, sigma, columns, iv):
    _keyed_words(key_words, key_bytes, digest_bytes, prefix_words, id_words, out, sigma, columns, iv)


@njit_cached(**_OPTIONS)
def _keyed_words_held(key_words, key_bytes, digest_bytes, prefix_words, id_words, out, sigma, columns, iv):
    _keyed_words(key_words, key_bytes, digest_bytes, prefix_words, id_words, out, sigma, columns, iv)


@njit_cached(nogil=True, **_OPTIONS)
def _rows_signs_released(words, b, unit_signs, rows, signs):
    _rows_signs(words, b, unit_signs, rows, signs)


@njit_cached(**_OPTIONS)
def _rows_signs_held(words, b, unit_signs, rows, signs):
    _rows_signs(words, b, unit_signs, rows, signs)


@njit_cached(nogil=True, **_OPTIONS)
def _accumulate_released(acc, rows, signs, shares, sign):
    _accumulate(acc, rows, signs, shares, sign)


@njit_cached(**_OPTIONS)
def _accumulate_held(acc, rows, signs, shares, sign):
    _accumulate(acc, rows, signs, shares, sign)


@njit_cached(nogil=True, **_OPTIONS)
def _accumulate_gram_released(sst, rows, signs, sign):
    _accumulate_gram(sst, rows, signs, sign)


@njit_cached(**_OPTIONS)
def _accumulate_gram_held(sst, rows, signs, sign):
    _accumulate_gram(sst, rows, signs, sign)


def keyed_words(key_words, key_bytes, digest_bytes, prefix_words, id_words, out, sigma, columns, iv):
    """:func:`_keyed_words` (the sketch hash of m ids), the GIL kept below kernels.RELEASE_FROM ids."""
    loop = _keyed_words_released if len(id_words) >= _release_from else _keyed_words_held
    loop(key_words, key_bytes, digest_bytes, prefix_words, id_words, out, sigma, columns, iv)


def rows_signs(words, b, unit_signs):
    """:func:`_rows_signs` (rows and signs of the sketch from its (m, s) digest words), as
    :func:`keyed_words`: two new (m, s) arrays, int64 and int8."""
    rows = np.empty(words.shape, np.int64)
    signs = np.empty(words.shape, np.int8)
    (_rows_signs_released if len(words) >= _release_from else _rows_signs_held)(words, int(b), bool(unit_signs),
                                                                                 rows, signs)
    return rows, signs


def accumulate(acc, rows, signs, shares, sign):
    """:func:`_accumulate` (the signed sum into a running aggregate), as :func:`keyed_words`."""
    (_accumulate_released if len(rows) >= _release_from else _accumulate_held)(acc, rows, signs, shares, sign)


def accumulate_gram(sst, rows, signs, sign):
    """:func:`_accumulate_gram` (s S S^T), as :func:`keyed_words`."""
    (_accumulate_gram_released if len(rows) >= _release_from else _accumulate_gram_held)(sst, rows, signs, sign)


def load():
    """This module, once its loops give the reference's bits on a probe (hashlib's BLAKE2b for
    the hash, through sketch.py's own call of it; numpy's wrapping sums for the signed sum and
    s S S^T), through both entry points of each, else None."""
    global _release_from
    try:
        for _release_from in (0, RELEASE_FROM):  # the releasing entry points, then the others
            if not _probe():
                return None
    finally:
        _release_from = RELEASE_FROM
    import sys

    return sys.modules[__name__]


def _probe() -> bool:
    import sys

    from . import sketch

    this = sys.modules[__name__]
    seed, ids = bytes(range(32)), bytes(range(100, 132))
    words = sketch._digest_words(this, seed, ids, 8)
    expected = b"".join(hashlib.blake2b(sketch.DOMAIN + ids[i:i + 16], digest_size=64, key=seed).digest()
                        for i in (0, 16))
    acc = np.zeros((3, 2), np.uint64)
    shares = np.array([[1, 2], [5, 7]], np.uint64)
    accumulate(acc, np.array([[0, 2], [2, 1]], np.int64), np.array([[1, -1], [1, 1]], np.int8), shares, 1)
    minus = np.uint64(0) - shares[0]
    if words.astype("<u8").tobytes() != expected or acc.tolist() != [[1, 2], [5, 7], (shares[1] + minus).tolist()]:
        return False
    sst = np.zeros((3, 3), np.int64)
    accumulate_gram(sst, np.array([[0, 2], [2, 1]], np.int64), np.array([[1, -1], [1, -1]], np.int8), 1)
    if sst.tolist() != [[1, 0, -1], [0, 1, -1], [-1, -1, 2]]:
        return False
    edges = np.array([[0, 1, 2**32 - 1, 2**32], [2**63, 2**64 - 1, 2**64 - 2**32, 0x9E3779B97F4A7C15]], np.uint64)
    for b, unit_signs in ((100, False), (2**31 + 7, False), (1, True)):
        got, want = rows_signs(edges, b, unit_signs), sketch.rows_signs(edges, b, unit_signs)
        if not all(np.array_equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want)):
            return False
    return True
