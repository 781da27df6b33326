"""The compiled merge of two sorted runs of the report index (services/idsets.py).

Why: the index keeps a study's ids in sorted runs and merges them as they grow; numpy can only
merge by sorting the concatenation (a stable radix sort, then a gather of three arrays through
the permutation) or by scattering one run into the other, and at 10^6 held ids those merges
were a quarter of a bulk upload's writer time. Two sorted runs merge in one sequential pass.
This loop makes that pass; idsets.py keeps the numpy merges as the reference, and loads this
through dpsketch/protocol/kernels.py's rule (from kernels.MIN_ROWS ids; the GIL released from
kernels.RELEASE_FROM). :func:`load` checks it against the reference on a probe.
"""

from __future__ import annotations

import numba
import numpy as np

from dpsketch.protocol.kernels import RELEASE_FROM, njit_cached

_OPTIONS = dict(boundscheck=False, error_model="numpy")


@numba.njit(**_OPTIONS)
def _merge(a_hi, a_lo, a_rowid, b_hi, b_lo, b_rowid, hi, lo, rowid):
    """Merge runs a and b (each ascending by (hi, lo)) into hi, lo, rowid (len a + len b);
    whether two ids of the result share their high half (crafted ids: lookups then resolve
    such ranges on the low half)."""
    n, m = a_hi.shape[0], b_hi.shape[0]
    i = j = k = 0
    while i < n and j < m:
        if a_hi[i] < b_hi[j] or (a_hi[i] == b_hi[j] and a_lo[i] < b_lo[j]):
            hi[k], lo[k], rowid[k] = a_hi[i], a_lo[i], a_rowid[i]
            i += 1
        else:
            hi[k], lo[k], rowid[k] = b_hi[j], b_lo[j], b_rowid[j]
            j += 1
        k += 1
    while i < n:
        hi[k], lo[k], rowid[k] = a_hi[i], a_lo[i], a_rowid[i]
        i += 1
        k += 1
    while j < m:
        hi[k], lo[k], rowid[k] = b_hi[j], b_lo[j], b_rowid[j]
        j += 1
        k += 1
    for t in range(1, k):
        if hi[t] == hi[t - 1]:
            return True
    return False


@njit_cached(nogil=True, **_OPTIONS)
def _merge_released(a_hi, a_lo, a_rowid, b_hi, b_lo, b_rowid, hi, lo, rowid):
    return _merge(a_hi, a_lo, a_rowid, b_hi, b_lo, b_rowid, hi, lo, rowid)


@njit_cached(**_OPTIONS)
def _merge_held(a_hi, a_lo, a_rowid, b_hi, b_lo, b_rowid, hi, lo, rowid):
    return _merge(a_hi, a_lo, a_rowid, b_hi, b_lo, b_rowid, hi, lo, rowid)


_release_from = RELEASE_FROM


def merge(a: tuple[np.ndarray, np.ndarray, np.ndarray],
          b: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(hi, lo, rowid, ties) of sorted runs ``a`` and ``b`` (each (hi, lo, rowid)) merged."""
    size = len(a[0]) + len(b[0])
    out = (np.empty(size, np.uint64), np.empty(size, np.uint64), np.empty(size, np.int64))
    loop = _merge_released if size >= _release_from else _merge_held
    ties = loop(*a, *b, *out)
    return (*out, bool(ties))


def load():
    """This module, once both entry points merge a probe as sorting does, else None."""
    import sys

    global _release_from
    rng = np.random.default_rng(3)
    hi = np.sort(rng.integers(0, 1 << 20, 40, dtype=np.uint64))  # repeated high halves, too
    lo = rng.integers(0, 2**64, 40, dtype=np.uint64, endpoint=False)
    order = np.lexsort((lo, hi))
    hi, lo, rowid = hi[order], lo[order], np.arange(40, dtype=np.int64)
    take = rng.permutation(40)
    a, b = np.sort(take[:15]), np.sort(take[15:])
    try:
        for _release_from in (0, RELEASE_FROM):
            got = merge((hi[a], lo[a], rowid[a]), (hi[b], lo[b], rowid[b]))
            if not (np.array_equal(got[0], hi) and np.array_equal(got[1], lo) and np.array_equal(got[2], rowid)
                    and got[3] == bool(np.any(hi[1:] == hi[:-1]))):
                return None
    finally:
        _release_from = RELEASE_FROM
    return sys.modules[__name__]
