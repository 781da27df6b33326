"""The compiled loops of batch proofs: the subset sums of a batch's values under its wrap-around
checks' random bits (the method of four Russians; wraparound.py), and a server's signed F_p sums
of its coordinate shares into the sketch's cells in one word each (batch_validity.aggregate).

For every bit row (r + 1 of them: b_0, then b_1 .. b_r; z_k = b_k - b_0) the loop adds up the
values whose bit is set, mod p. Done directly that is r + 1 additions per value. Here each block
of 8 values gets a table of its 256 subset sums (255 additions mod p, vectorised across the
table), and each bit row reads its byte of the block and adds one table entry: (255 + r + 1) / 8
additions per value, 48 at r = 128, and the table reads run over a chunk of ``CHUNK`` blocks per
row, its sum kept in registers. A row's sum is a 64-bit word plus a count of its overflows
(2^64 = 2^32 - 1 mod p), exact for up to 2^60 reads; the caller reduces. (The loop it replaced
built two 16-entry tables of 32-bit halves per block and added two entries of each per row into
sums in memory: 1.2-1.5x slower, measured at d = 100 in section 15.)

The F_p sums keep each cell as one uint64 word congruent to its value mod p, in [0, 2^64):
a sum that overflows 2^64 adds 2^64 - p = 2^32 - 1 back, which cannot overflow again (the
addend is at most p, so the wrapped sum is at most p - 2); a subtraction adds p - x. The caller
reduces mod p at the end. Half the words of the split 32-bit halves the per-report path sums.

Loaded on first use by kernels.py's rule through :func:`load`, which checks the loop on a probe
against the numpy reference of wraparound.py before anything uses it.
"""

from __future__ import annotations

import sys

import numpy as np

from .kernels import njit_cached

_P = np.uint64(2 ** 64 - 2 ** 32 + 1)
_FOLD = np.uint64(2 ** 32 - 1)  # 2^64 mod p


#: blocks of 8 values whose tables a row reads in one pass (8 x 256 words: 16 KiB, in L1)
CHUNK = 8
_ONE = np.uint64(1)
_ZERO = np.uint64(0)


@njit_cached(nogil=True, boundscheck=False, error_model="numpy")
def subset_sums(values, table_bytes, out_sum, out_carry):  # pragma: no cover - compiled
    """out_sum[row] + 2^64 out_carry[row] += the values whose bit is set in ``row``, mod p (out_sum
    wraps; out_carry counts the wraps). values (n,) uint64 below p; table_bytes (ceil(n / 8),
    rows) uint8: byte [b, row] holds the bits of values 8 b .. 8 b + 7 (least significant first)."""
    n = values.shape[0]
    blocks, rows = table_bytes.shape
    t = np.zeros(CHUNK * 256, dtype=np.uint64)  # [block of the chunk][subset]: its sum mod p
    for b0 in range(0, blocks, CHUNK):
        nb = min(CHUNK, blocks - b0)
        for c in range(nb):
            base = c * 256
            for bit in range(8):
                j = 8 * (b0 + c) + bit
                neg = _P - values[j] if j < n else _P  # t[s] + v mod p = t[s] - (p - v), + p if below 0
                size = 1 << bit
                for s in range(size):
                    a = t[base + s]
                    r = a - neg
                    t[base + size + s] = r + _P if a < neg else r
        if nb == CHUNK:  # a constant trip count: unrolled, the table offsets constants (1.6x faster)
            for row in range(rows):
                acc = out_sum[row]
                car = out_carry[row]
                for c in range(CHUNK):
                    e = t[c * 256 + np.intp(table_bytes[b0 + c, row])]
                    acc += e
                    car += _ONE if acc < e else _ZERO
                out_sum[row] = acc
                out_carry[row] = car
        else:
            for row in range(rows):
                acc = out_sum[row]
                car = out_carry[row]
                for c in range(nb):
                    e = t[c * 256 + np.intp(table_bytes[b0 + c, row])]
                    acc += e
                    car += _ONE if acc < e else _ZERO
                out_sum[row] = acc
                out_carry[row] = car


@njit_cached(nogil=True, boundscheck=False, error_model="numpy")
def accumulate_fp(acc, rows, signs, values, w):  # pragma: no cover - compiled
    """acc[rows[i, l]] += signs[i, l] * values[i, :w] (mod p, lazily: module doc) for every row i
    and slot l; a sign of 0 adds nothing. acc (k, w) uint64 words congruent mod p; rows (m, s)
    int64; signs (m, s) int8; values (m, >= w) uint64 elements below p."""
    m, s = rows.shape
    for i in range(m):
        for b in range(s):
            g = signs[i, b]
            if g == 0:
                continue
            r = rows[i, b]
            if g > 0:
                for j in range(w):
                    y = values[i, j]
                    x = acc[r, j] + y
                    acc[r, j] = x + _FOLD if x < y else x
            else:
                for j in range(w):
                    y = _P - values[i, j]
                    x = acc[r, j] + y
                    acc[r, j] = x + _FOLD if x < y else x


def load():
    """This module, once its loops give the references' sums on a probe, else None."""
    from . import wraparound

    rng = np.random.default_rng(7)
    values = rng.integers(0, 2 ** 63, size=37 + 8 * CHUNK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    values %= _P
    values[:3] = [_P - np.uint64(1), _P - np.uint64(2), 0]
    table = rng.integers(0, 256, size=(-(-len(values) // 8), 6), dtype=np.uint8)
    if wraparound.subset_sums(values, table, sys.modules[__name__]).tolist() != wraparound.subset_sums(values, table).tolist():
        return None
    from . import batch_validity  # the F_p sums: near p, at 0, both signs and empty slots

    x = np.concatenate([values % _P, np.array([_P - np.uint64(1), 0, 1], dtype=np.uint64)]).reshape(-1, 2)
    rows = rng.integers(0, 3, size=(len(x), 2)).astype(np.int64)
    signs = rng.integers(-1, 2, size=(len(x), 2)).astype(np.int8)
    start = np.full((3, 2), _P - np.uint64(2), dtype=np.uint64)
    acc = start.copy()
    accumulate_fp(acc, rows, signs, x, 2)
    if (acc % _P).tolist() != batch_validity._field_sums_ref(start, rows, signs, x, 2).tolist():
        return None
    return sys.modules[__name__]

