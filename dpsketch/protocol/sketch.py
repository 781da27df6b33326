"""The public block-OSNAP sketch: h_l(r), g_l(r) and their application in the ring.

Column r of S (one per report id r) has one non-zero in each of the s blocks of b = k/s rows:
row l*b + h_l(r) holds g_l(r)/sqrt(s). Servers only add and negate uint64 shares; the
1/sqrt(s) scale is applied by the analyzer after reconstruction (:func:`scale`).

The hash (docs/protocol.md, "Sketch hash", with test vectors):

    digest = BLAKE2b(key = seed, digest_size = 8*s, message = b"dpsketch/osnap/1" || r)
    u_l    = little-endian uint64 of digest[8l : 8l+8]
    h_l(r) = floor(u_l * b / 2^64)        (the high bits: a multiply-shift, no modulo bias)
    g_l(r) = +1 if u_l is even else -1    (the low bit), except g = +1 when k = 1

Many ids are hashed by the same BLAKE2b compiled with numba (``_sketch_kernel.py``: no Python
object per id), few by hashlib; the bits are the same (kernels.py: which, when).

With k = 1 (hence s = 1) the sketch is the plain sum of the rows: secure aggregation, the basis of
sufficient-statistics study kinds; a random sign there would only scramble the sum.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from . import kernels

DOMAIN = b"dpsketch/osnap/1"
SEED_BYTES = 32
REPORT_ID_BYTES = 16
MAX_BLOCKS = 8  # BLAKE2b digests are at most 64 bytes = 8 blocks of 8 bytes


def hash_report_ids(seed: bytes, report_ids: Sequence[bytes], k: int, s: int,
                    joined: bytes | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows (absolute, in [0, k)) and signs (+1/-1, int8) of S for each report: two (m, s) arrays.
    ``joined``: the same ids concatenated, if the caller has them so."""
    if len(seed) != SEED_BYTES:
        raise ValueError("sketch seed must be 32 bytes")
    if not 1 <= s <= MAX_BLOCKS or k % s:
        raise ValueError("need 1 <= s <= 8 and s dividing k")
    b = k // s
    m = len(report_ids)
    width = 8 * s
    loop = kernels.SKETCH.for_rows(m)
    if loop is None:
        joined = b""
    elif joined is None:
        joined = b"".join(report_ids)
    if len(joined) == REPORT_ID_BYTES * m and m:  # many 16-byte ids: the compiled loops
        return loop.rows_signs(_digest_words(loop, seed, joined, s), b, k == 1)
    keyed = hashlib.blake2b(DOMAIN, digest_size=width, key=seed)  # keyed once, copied per id
    digests = []
    for rid in report_ids:
        h = keyed.copy()
        h.update(rid)
        digests.append(h.digest())
    return rows_signs(np.frombuffer(b"".join(digests), dtype="<u8").reshape(m, s), b, k == 1)


def rows_signs(u: np.ndarray, b: int, unit_signs: bool) -> tuple[np.ndarray, np.ndarray]:
    """Rows and signs of S from the (m, s) digest words u: block l's bucket floor(u * b / 2^64)
    (row l * b + bucket) and sign +1 where u's low bit is 0, else -1 (all +1 when k = 1). The
    reference form of the compiled loop (_sketch_kernel.rows_signs), which gives the same."""
    s = u.shape[1]
    # floor(u * b / 2^64) without 128-bit integers: split u into 32-bit halves.
    hi = u >> np.uint64(32)
    lo = u & np.uint64(0xFFFFFFFF)
    bb = np.uint64(b)
    buckets = (hi * bb + ((lo * bb) >> np.uint64(32))) >> np.uint64(32)
    rows = buckets.astype(np.int64) + (np.arange(s, dtype=np.int64) * b)[None, :]
    signs = np.where((u & np.uint64(1)) == 0, 1, -1).astype(np.int8)
    if unit_signs:
        signs[:] = 1
    return rows, signs



def _digest_words(kernel, seed: bytes, joined: bytes, s: int) -> np.ndarray:
    """The (m, s) little-endian digest words of the sketch hash of concatenated 16-byte ids, from
    the compiled loop: the same bits as hashlib's BLAKE2b (tests compare them), without a Python
    object per id, and with the GIL released."""
    key = np.frombuffer(seed.ljust(128, b"\0"), dtype="<u8").astype(np.uint64)
    prefix = np.frombuffer(DOMAIN, dtype="<u8").astype(np.uint64)
    ids = np.frombuffer(joined, dtype="<u8").astype(np.uint64).reshape(-1, 2)
    out = np.empty((len(ids), s), dtype=np.uint64)
    kernel.keyed_words(key, len(seed), 8 * s, prefix, ids, out, kernel.SIGMA, kernel.COLUMNS, kernel.IV)
    return out


def warm_up() -> bool:
    """Load the compiled loops now (from numba's cache: about a second, numba's import
    included), so that no upload waits for them; whether they are available. A server does it in
    a thread when it opens a large study; until it returns, other threads use hashlib and scipy."""
    return kernels.SKETCH.warm_up()


def bucket_and_sign(seed: bytes, report_id: bytes, k: int, s: int, block: int) -> tuple[int, int]:
    """h_l(r) (within its block) and g_l(r) for one report and block: the reference form."""
    b = k // s
    digest = hashlib.blake2b(DOMAIN + report_id, digest_size=8 * s, key=seed).digest()
    u = int.from_bytes(digest[8 * block : 8 * block + 8], "little")
    return (u * b) >> 64, (1 if u % 2 == 0 or k == 1 else -1)


_MINUS_ONE = np.uint64(0xFFFF_FFFF_FFFF_FFFF)


def signed_sum(rows: np.ndarray, signs: np.ndarray, shares: np.ndarray, k: int) -> np.ndarray:
    """The (k, d) uint64 matrix S' X mod 2^64, where S' has the signs (not the 1/sqrt(s) scale);
    a sign of 0 is an empty slot (the l1 sketch's, l1sketch.py) and adds nothing.

    One sparse product: scipy's integer kernels use C unsigned arithmetic, which wraps mod 2^64
    exactly like numpy's, and a sign of -1 is the ring element 2^64 - 1 (multiplying by it
    negates). S' is column-major (one column of s entries per report), so the product streams
    the shares in order into the small k x d result: about 10x faster than ``np.add.at``, which
    matters at upload rates of 10^5 rows/s. Tests check it against a Python-integer reference.
    """
    import scipy.sparse as sp

    m, s = rows.shape
    d = shares.shape[1]
    if m == 0:
        return np.zeros((k, d), dtype=np.uint64)
    if int(rows.min()) < 0 or int(rows.max()) >= k:  # scipy does not check: it would write outside
        raise ValueError("sketch rows outside the aggregate")
    flat = signs.ravel()
    data = np.where(flat > 0, np.uint64(1), np.where(flat < 0, _MINUS_ONE, np.uint64(0))).astype(np.uint64)
    indptr = np.arange(0, m * s + 1, s, dtype=np.int64)
    matrix = sp.csc_matrix((data, rows.ravel().astype(np.int64), indptr), shape=(k, m))
    return np.asarray(matrix @ np.ascontiguousarray(shares, dtype=np.uint64), dtype=np.uint64)


#: reports' slots (m s) that accumulate adds one by one when the compiled kernel is not loaded
FEW_SLOTS = 64


def accumulate(acc: np.ndarray, rows: np.ndarray, signs: np.ndarray, shares: np.ndarray,
               sign: int = 1) -> None:
    """acc[rows[i, l]] += sign * signs[i, l] * shares[i]  (mod 2^64), in place; acc is (k, d).

    A few reports touch only their own rows: they are added in place, so a single upload to a
    study with a large k x d aggregate neither builds nor adds a dense k x d matrix (which would
    also touch, and so pin, every page of the aggregate). Without the compiled kernel, a few
    reports are added so too whatever k is: building a sparse matrix for them (signed_sum) cost
    a k = 1 study about a twelfth of a server's CPU per single upload."""
    m, s = rows.shape
    kernel = kernels.SKETCH.loaded()
    if m * s * 4 < acc.shape[0] or (kernel is None and m * s <= FEW_SLOTS):
        if m and (int(rows.min()) < 0 or int(rows.max()) >= acc.shape[0]):  # np.add.at wraps negatives
            raise ValueError("sketch rows outside the aggregate")
        flip = (signs.astype(np.int64) * sign) < 0
        values = np.repeat(np.asarray(shares, dtype=np.uint64), s, axis=0)
        values[flip.ravel()] = np.uint64(0) - values[flip.ravel()]
        values[signs.ravel() == 0] = 0  # an empty slot (the l1 sketch's unsampled level)
        np.add.at(acc, rows.ravel(), values)
        return
    if kernel is not None and acc.flags.c_contiguous and acc.dtype == np.uint64:  # loaded: in place
        if m and (int(rows.min()) < 0 or int(rows.max()) >= acc.shape[0]):
            raise ValueError("sketch rows outside the aggregate")
        kernel.accumulate(acc, np.ascontiguousarray(rows, dtype=np.int64),
                           np.ascontiguousarray(signs, dtype=np.int8),
                           np.ascontiguousarray(shares, dtype=np.uint64), int(sign))
        return
    delta = signed_sum(rows, signs, shares, acc.shape[0])
    if sign >= 0:
        acc += delta
    else:
        acc -= delta


def subtract(acc: np.ndarray, rows: np.ndarray, signs: np.ndarray, shares: np.ndarray) -> None:
    """Undo :func:`accumulate` for these reports (mod 2^64)."""
    accumulate(acc, rows, signs, shares, sign=-1)


def accumulate_gram(sst: np.ndarray, rows: np.ndarray, signs: np.ndarray, sign: int = 1) -> None:
    """sst += sign * sum_r (s * S_r)(s * S_r)^T / s, i.e. the integer matrix s * S S^T.

    With one non-zero of +-1/sqrt(s) per block, s * S S^T has integer entries: the diagonal
    counts reports per row, off-diagonal entries sum sign products across blocks.
    """
    if len(rows) == 0:
        return
    k = sst.shape[0]
    s = rows.shape[1]
    # both paths: the compiled loop would write outside, the flat index of np.add.at would land
    # on a wrong cell of the matrix (row r, column k + c is cell (r + 1, c)) without an error
    if int(rows.min()) < 0 or int(rows.max()) >= k:
        raise ValueError("sketch rows outside the Gram matrix")
    kernel = kernels.SKETCH.loaded()
    if kernel is not None and sst.flags.c_contiguous and sst.dtype == np.int64:  # loaded: in place
        kernel.accumulate_gram(sst, np.ascontiguousarray(rows, dtype=np.int64),
                               np.ascontiguousarray(signs, dtype=np.int8), int(sign))
        return
    for a in range(s):
        for c in range(s):
            prod = signs[:, a].astype(np.int64) * signs[:, c].astype(np.int64) * sign
            np.add.at(sst.reshape(-1), rows[:, a] * k + rows[:, c], prod)


def scale(s: int) -> float:
    """The entry magnitude 1/sqrt(s) the analyzer applies after decoding."""
    return 1.0 / math.sqrt(s)


def dense_matrix(seed: bytes, report_ids: Sequence[bytes], k: int, s: int) -> np.ndarray:
    """S as a dense (k, n) float matrix: for tests and small checks only."""
    rows, signs = hash_report_ids(seed, report_ids, k, s)
    out = np.zeros((k, len(report_ids)))
    cols = np.arange(len(report_ids))
    for block in range(s):
        out[rows[:, block], cols] = signs[:, block] * scale(s)
    return out
