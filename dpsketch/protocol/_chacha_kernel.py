"""The compiled ChaCha20 block loop behind ``chacha.py`` (RFC 8439, section 2.3).

Loaded on first use by kernels.py (its rule: when, and the reference while it is not loaded),
through :func:`load`. ``blocks`` runs
the block function for every (row, block) of a batch, ``LANES`` blocks side by side: the 20 rounds
work on a (16, LANES) state whose inner loop over lanes the compiler turns into SIMD
instructions. Compiled with ``cache=True``: numba keeps the machine code in ``__pycache__`` beside
this file, else in ``$NUMBA_CACHE_DIR`` or the user's cache directory; where none is writable it
compiles in memory instead (once per process: kernels.njit_cached).
"""

from __future__ import annotations

import numba
import numpy as np

from .kernels import njit_cached

#: RFC 8439 section 2.3: "expand 32-byte k" as four little-endian words
CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)
#: blocks computed side by side (32 uint32 lanes vectorise well with AVX2; 8 did not)
LANES = 32

_C0, _C1, _C2, _C3 = (np.uint32(c) for c in CONSTANTS)
_OPTIONS = dict(nogil=True, boundscheck=False, error_model="numpy")


@numba.njit(inline="always")
def _quarter(a, b, c, d):
    """RFC 8439 section 2.1, on uint32 (numba widens the arithmetic; each step truncates)."""
    a = np.uint32(a + b)
    d = np.uint32(d ^ a)
    d = np.uint32((d << np.uint32(16)) | (d >> np.uint32(16)))
    c = np.uint32(c + d)
    b = np.uint32(b ^ c)
    b = np.uint32((b << np.uint32(12)) | (b >> np.uint32(20)))
    a = np.uint32(a + b)
    d = np.uint32(d ^ a)
    d = np.uint32((d << np.uint32(8)) | (d >> np.uint32(24)))
    c = np.uint32(c + d)
    b = np.uint32(b ^ c)
    b = np.uint32((b << np.uint32(7)) | (b >> np.uint32(25)))
    return a, b, c, d


@njit_cached(**_OPTIONS)
def blocks(keys, counter, nonce, out):
    """out[r] = the first out.shape[1] keystream words under keys[r] (8 words), block counter
    starting at ``counter``, nonce ``nonce`` (3 words); all uint32 in machine order."""
    m, width = out.shape
    per_row = (width + 15) // 16
    total = m * per_row
    state = np.zeros((16, LANES), np.uint32)  # one input block per lane (RFC 8439 section 2.3)
    x = np.empty((16, LANES), np.uint32)
    rows = np.zeros(LANES, np.int64)
    first = np.zeros(LANES, np.int64)
    for lane in range(LANES):  # the constants and the nonce are the same in every block
        state[0, lane] = _C0
        state[1, lane] = _C1
        state[2, lane] = _C2
        state[3, lane] = _C3
        state[13, lane] = nonce[0]
        state[14, lane] = nonce[1]
        state[15, lane] = nonce[2]
    r = 0  # the next (row, block) to compute
    b = 0
    for start in range(0, total, LANES):
        n = min(LANES, total - start)  # lanes past n keep stale blocks, never written out
        for lane in range(n):
            rows[lane] = r
            first[lane] = 16 * b
            for k in range(8):
                state[4 + k, lane] = keys[r, k]
            state[12, lane] = np.uint32((counter + b) & 0xFFFFFFFF)
            b += 1
            if b == per_row:
                b = 0
                r += 1
        x[:, :] = state
        for _ in range(10):  # 20 rounds: a column round and a diagonal round, ten times
            for lane in range(LANES):
                x0 = x[0, lane]; x1 = x[1, lane]; x2 = x[2, lane]; x3 = x[3, lane]  # noqa: E702
                x4 = x[4, lane]; x5 = x[5, lane]; x6 = x[6, lane]; x7 = x[7, lane]  # noqa: E702
                x8 = x[8, lane]; x9 = x[9, lane]; x10 = x[10, lane]; x11 = x[11, lane]  # noqa: E702
                x12 = x[12, lane]; x13 = x[13, lane]; x14 = x[14, lane]; x15 = x[15, lane]  # noqa: E702
                x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
                x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
                x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
                x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
                x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
                x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
                x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
                x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
                x[0, lane] = x0; x[1, lane] = x1; x[2, lane] = x2; x[3, lane] = x3  # noqa: E702
                x[4, lane] = x4; x[5, lane] = x5; x[6, lane] = x6; x[7, lane] = x7  # noqa: E702
                x[8, lane] = x8; x[9, lane] = x9; x[10, lane] = x10; x[11, lane] = x11  # noqa: E702
                x[12, lane] = x12; x[13, lane] = x13; x[14, lane] = x14; x[15, lane] = x15  # noqa: E702
        for w in range(16):  # a block is the rounds' output plus its input
            for lane in range(LANES):
                x[w, lane] += state[w, lane]
        for lane in range(n):
            row = rows[lane]
            base = first[lane]
            for w in range(min(16, width - base)):
                out[row, base + w] = x[w, lane]


#: RFC 8439 section 2.3.2: key 00..1f, nonce 000000090000004a00000000, block counter 1
_RFC_KEY = np.arange(32, dtype=np.uint8).view("<u4").astype(np.uint32).reshape(1, 8)
_RFC_NONCE = np.frombuffer(bytes.fromhex("000000090000004a00000000"), "<u4").astype(np.uint32)
_RFC_BLOCK = bytes.fromhex(
    "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
    "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")


def load():
    """``blocks``, once it gives RFC 8439's test block (section 2.3.2), else None."""
    import sys

    out = np.empty((1, 16), np.uint32)
    blocks(_RFC_KEY, 1, _RFC_NONCE, out)
    return blocks if sys.byteorder == "little" and out.tobytes() == _RFC_BLOCK else None
