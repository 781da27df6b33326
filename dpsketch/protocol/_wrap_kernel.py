"""The compiled loops of batch proofs: the subset sums of a batch's values under its wrap-around
checks' random bits (the method of four Russians; wraparound.py), and a server's signed F_p sums
of its coordinate shares into the sketch's cells in one word each (batch_validity.aggregate).

For every bit row (r + 1 of them: b_0, then b_1 .. b_r; z_k = b_k - b_0) the loop adds up the
values whose bit is set. Done directly that is r + 1 additions per value. Here each block of 8
values gets two tables of the 16 subset sums of its halves (30 additions), and each bit row
then reads its byte of the block and adds two table entries: 30 + 2 (r + 1) additions per 8
values, about 4x fewer at r = 128 (a table of all 256 subsets costs 255 additions a block,
more than the rows' reads save at r + 1 = 129 rows; measured, the halves were 10-40% faster).
Values are split into 32-bit halves, so that sums of up to 2^31 of them are exact in uint64;
the caller reduces mod p.

The F_p sums keep each cell as one uint64 word congruent to its value mod p, in [0, 2^64):
a sum that overflows 2^64 adds 2^64 - p = 2^32 - 1 back, which cannot overflow again (the
addend is at most p, so the wrapped sum is at most p - 2); a subtraction adds p - x. The caller
reduces mod p at the end. Half the words of the split 32-bit halves the per-report path sums.

Loaded on first use by kernels.py's rule through :func:`load`, which checks the loop on a probe
against the numpy reference of wraparound.py before anything uses it.
"""

from __future__ import annotations

import numpy as np

from .kernels import njit_cached

_LOW = np.uint64(0xFFFFFFFF)
_P = np.uint64(2 ** 64 - 2 ** 32 + 1)
_FOLD = np.uint64(2 ** 32 - 1)  # 2^64 mod p
_S32 = np.uint64(32)


@njit_cached(nogil=True, boundscheck=False, error_model="numpy")
def subset_sums(values, table_bytes, out_lo, out_hi):  # pragma: no cover - compiled
    """out_lo[row] += sum of the low halves of the values whose bit is set in ``row``, out_hi
    likewise for the high halves. values (n,) uint64; table_bytes (ceil(n / 8), rows) uint8:
    byte [b, row] holds the bits of values 8 b .. 8 b + 7 (least significant first)."""
    n = values.shape[0]
    blocks, rows = table_bytes.shape
    t = np.zeros((2, 16, 2), dtype=np.uint64)  # [half of the block][subset][low, high]
    for b in range(blocks):
        for h in range(2):
            for bit in range(4):
                j = 8 * b + 4 * h + bit
                v = values[j] if j < n else np.uint64(0)
                lo = v & _LOW
                hi = v >> _S32
                size = 1 << bit
                for s in range(size):
                    t[h, size + s, 0] = t[h, s, 0] + lo
                    t[h, size + s, 1] = t[h, s, 1] + hi
        for row in range(rows):
            k = table_bytes[b, row]
            a = k & 15
            c = k >> 4
            out_lo[row] += t[0, a, 0] + t[1, c, 0]
            out_hi[row] += t[0, a, 1] + t[1, c, 1]


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
    """This module, once its loop gives the reference's sums on a probe, else None."""
    import sys

    from . import wraparound

    rng = np.random.default_rng(7)
    values = rng.integers(0, 2 ** 63, size=37, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    table = rng.integers(0, 256, size=(5, 6), dtype=np.uint8)
    lo, hi = np.zeros(6, np.uint64), np.zeros(6, np.uint64)
    subset_sums(values, table, lo, hi)
    ref_lo, ref_hi = wraparound._subset_sums_ref(values, table)
    if lo.tolist() != ref_lo.tolist() or hi.tolist() != ref_hi.tolist():
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

