"""Wrap-around checks (the idea of PINE, draft-chen-cfrg-vdaf-pine): a batch's values are small
integers, not merely elements of F_p whose squares happen to add up, checked by r random
projections in range (docs/validity.md section 15).

Why. A batch proof (batch_circuit.py) takes the coordinates x and the slack's roots a as field
elements, without digits: its norm equation sum x^2 + sum a^2 = R^2 holds in F_p, and holds
over the integers only if no element wraps around p (a coordinate at (p + 1) / 2 squares to
1/4). Digits for every element would cost ~7 elements a coordinate (section 8). Instead the
client shows that <z_k, v> + T is in [0, 4^q) for r random vectors z_k in {-1, 0, 1}^n,
v = (x, a): q base-4 digits per repetition, for the whole batch.

The z. z_k = b_k - b_0 with b_0, b_1, ..., b_r independent uniform vectors of bits: each z_kj is
-1, 0, 1 with probabilities 1/4, 1/2, 1/4 (PINE's law), and a server adds up r + 1 bit rows,
not 2 r. Soundness (per repetition k, conditioned on b_0 and on every other b_kj'): if some
|v_j| >= 4^q (centred), the two values c and c + v_j that <z_k, v> takes as b_kj is 0 or 1
cannot both lie in the accepted interval S = [-T, 4^q - T) (their difference would be the
difference of two elements of S, below 4^q in absolute value), so Pr[pass] <= 1/2, and the r
repetitions, independent given b_0, all pass with probability at most 2^-r. Completeness: each
<z_k, v> is a sum of independent terms z_kj v_j in [-|v_j|, |v_j|] with mean 0, so by Hoeffding
|<z_k, v>| <= T but for probability 2 exp(-T^2 / (2 ||v||^2)), ||v||^2 <= m R^2 (:func:`threshold`).

The bits are derived from a wrap seed that commits to the batch's x and a (batch_validity.py),
so a client fixes v before it learns them: the ChaCha20 keystream (RFC 8439) under the wrap seed
as key, nonce SHA-256("dpsketch/wrap-bits/1")[:12], block counter 0 (the protocol's one PRG, as
field.expand; it replaced AES-128-CTR, measured as fast through OpenSSL: section 15), read as
(ceil(n / 8), r + 1) bytes: byte [b, k] holds the bits of b_k for values 8 b .. 8 b + 7 (least
significant first). I/O-free.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from . import field, kernels

P = field.P
BITS_DOMAIN = b"dpsketch/wrap-bits/1"
BITS_NONCE = hashlib.sha256(BITS_DOMAIN).digest()[:12]
#: the digits' base of the projections (the Range(4) gadget the batch's remainders use too)
BASE = 4
#: an honest batch fails a repetition with probability at most 2^REFUSAL_LOG2 over all of them
REFUSAL_LOG2 = -96
#: repetitions: 2^-128 per wrap seed, 2^-64 for a client that tries 2^64 of them
REPETITIONS = 128

WRAP = kernels.Kernel("._wrap_kernel", "the wrap-around projections")


def threshold(m: int, r2: int, reps: int = REPETITIONS, refusal_log2: float = REFUSAL_LOG2) -> int:
    """T with Pr[some |<z_k, v>| > T] <= 2^refusal_log2 for an honest batch of m rows: each
    z_kj v_j is in [-|v_j|, |v_j|] with mean 0, so by Hoeffding Pr[|<z_k, v>| >= T] <= 2 exp(-T^2 /
    (2 ||v||^2)), and ||v||^2 = sum_i (||x_i||^2 + ||a_i||^2) <= m R^2; a union over the reps:
    T^2 = 2 m R^2 (ln(2 reps) - refusal_log2 ln 2), rounded up."""
    t2 = 2.0 * m * r2 * (math.log(2.0 * reps) - refusal_log2 * math.log(2.0))
    return math.isqrt(math.ceil(t2 * (1.0 + 1e-12))) + 1


def digits_for(t: int) -> int:
    """The least q with 4^q > 2 T: the accepted interval [-T, 4^q - T) holds [-T, T]."""
    q = 1
    while BASE ** q <= 2 * t:
        q += 1
    return q


def keystream_into(key: bytes, nonce: bytes, out: np.ndarray) -> np.ndarray:
    """``out`` (any contiguous array) filled with the ChaCha20 keystream under ``key``, ``nonce``
    (12 bytes), block counter 0: OpenSSL's, through ``cryptography``, in 1 MiB pieces. For one
    long stream (a batch's wrap bits, a helper's share of a whole batch) it is 3-4x faster than
    chacha.py's compiled loop, which is built for many short streams (one per row)."""
    if len(key) != 32 or len(nonce) != 12:
        raise ValueError("a ChaCha20 key is 32 bytes and its nonce 12")
    if not out.flags.c_contiguous:
        raise ValueError("the keystream goes into a contiguous array")
    view = out.reshape(-1).view(np.uint8).data
    enc = Cipher(algorithms.ChaCha20(key, bytes(4) + nonce), mode=None).encryptor()
    chunk = 1 << 20
    zeros = bytes(min(chunk, len(view)))
    for start in range(0, len(view), chunk):
        size = min(chunk, len(view) - start)
        enc.update_into(zeros[:size], view[start:start + size])
    return out


def bits(seed: bytes, reps: int, n: int) -> np.ndarray:
    """The random bits of r repetitions over n values, (ceil(n / 8), r + 1) bytes (module doc)."""
    if len(seed) != 32:
        raise ValueError("a wrap seed is 32 bytes")
    out = np.empty((-(-n // 8), reps + 1), dtype=np.uint8)
    return keystream_into(seed, BITS_NONCE, out)


def signs(table: np.ndarray, n: int) -> np.ndarray:
    """z (r, n) int8 in {-1, 0, 1} from the bits: what the projections multiply (tests, reference)."""
    unpacked = np.unpackbits(np.ascontiguousarray(table.T), axis=1, bitorder="little")[:, :n].astype(np.int8)
    return unpacked[1:] - unpacked[:1]


def _subset_sums_ref(values: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sums of the low and of the high 32-bit halves of the values under each bit row (numpy)."""
    v = np.asarray(values, dtype=np.uint64)
    rows = np.unpackbits(np.ascontiguousarray(table.T), axis=1, bitorder="little")[:, :len(v)]
    lo = np.zeros(table.shape[1], dtype=np.uint64)
    hi = np.zeros(table.shape[1], dtype=np.uint64)
    step = 1 << 16
    for start in range(0, len(v), step):  # uint64 matrix products, exact (sums < 2^63)
        part = rows[:, start:start + step].astype(np.uint64)
        lo += part @ (v[start:start + step] & np.uint64(0xFFFFFFFF))
        hi += part @ (v[start:start + step] >> np.uint64(32))
    return lo, hi


def subset_sums(values: np.ndarray, table: np.ndarray, loop=None) -> np.ndarray:
    """The sum mod p of the values under each bit row, (rows,) F_p: by the compiled ``loop``
    (_wrap_kernel.subset_sums) if given, else the numpy reference."""
    if loop is None:
        lo, hi = _subset_sums_ref(values, table)
        return field.add(lo % np.uint64(P), field.mul(hi % np.uint64(P), np.uint64(1 << 32)))
    total = np.zeros(table.shape[1], dtype=np.uint64)
    carry = np.zeros(table.shape[1], dtype=np.uint64)
    loop.subset_sums(values, np.ascontiguousarray(table), total, carry)
    return field.add(total % np.uint64(P), field.mul(carry, np.uint64(2 ** 32 - 1)))  # 2^64 = 2^32 - 1


def _projected_values(values: np.ndarray) -> np.ndarray:
    v = field.elements(np.ascontiguousarray(values, dtype=np.uint64).reshape(-1), "projected values")
    if len(v) >= 1 << 31:
        raise ValueError("at most 2^31 values per projection (exact 64-bit sums)")
    return v


def project(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """<z_k, v> mod p for every repetition k, (r,) F_p: values (n,) F_p (a client's v, or a
    server's share of it: the projection is linear), the bits of :func:`bits`."""
    v = _projected_values(values)
    if table.shape[0] != -(-len(v) // 8) or table.shape[1] < 2:
        raise ValueError("the bits do not match the values")
    sums = subset_sums(v, table, WRAP.for_rows(len(v)))
    return field.sub(sums[1:], sums[:1])


#: blocks of 8 values whose bits project_seeded draws at a time (4096 x 129 bytes: 0.5 MiB, in L2)
PIECE_BLOCKS = 4096


def project_seeded(values: np.ndarray, seed: bytes, reps: int, piece_blocks: int = PIECE_BLOCKS,
                   threads: int = 1) -> np.ndarray:
    """project(values, bits(seed, reps, n)), the bits drawn and projected a piece at a time (the
    compiled loop's sums carry over from piece to piece): the 17 bytes of bits per value stay in
    the cache between the keystream and the loop instead of going out to memory and back.
    ``threads`` > 1 cuts the values into that many ranges, each with its own keystream from its
    block counter, run on threads (the loop and OpenSSL release the GIL): the same CPU time, less
    wall time where cores are free."""
    v = _projected_values(values)
    loop = WRAP.for_rows(len(v))
    if loop is None:
        return project(v, bits(seed, reps, len(v)))
    if len(seed) != 32 or reps < 1 or piece_blocks < 1 or threads < 1:
        raise ValueError("a 32-byte wrap seed, reps >= 1, pieces of at least one block, threads >= 1")
    blocks = -(-len(v) // 8)
    # each range starts at a multiple of 64 blocks: 64 (r + 1) bytes, whole ChaCha20 blocks
    inner = {64 * round(blocks * i / threads / 64) for i in range(1, threads)}
    cuts = sorted({0, blocks} | {cut for cut in inner if 0 < cut < blocks})
    ranges = list(zip(cuts[:-1], cuts[1:]))

    def run(first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        counter = first * (reps + 1) // 64
        enc = Cipher(algorithms.ChaCha20(seed, counter.to_bytes(4, "little") + BITS_NONCE), mode=None).encryptor()
        buf = np.empty((min(piece_blocks, end - first), reps + 1), dtype=np.uint8)
        zeros = bytes(buf.size)
        total = np.zeros(reps + 1, dtype=np.uint64)
        carry = np.zeros(reps + 1, dtype=np.uint64)
        for start in range(first, end, piece_blocks):
            part = buf[:min(piece_blocks, end - start)]
            enc.update_into(zeros[:part.size], part.reshape(-1).data)
            loop.subset_sums(v[8 * start:8 * (start + len(part))], part, total, carry)
        return total, carry

    if len(ranges) == 1:
        results = [run(*ranges[0])]
    else:
        with ThreadPoolExecutor(len(ranges), thread_name_prefix="wrap-projection") as pool:
            results = list(pool.map(lambda r: run(*r), ranges))
    sums = np.zeros(reps + 1, dtype=np.uint64)
    for total, carry in results:
        sums = field.add(sums, field.add(total % np.uint64(P), field.mul(carry, np.uint64(2 ** 32 - 1))))
    return field.sub(sums[1:], sums[:1])
