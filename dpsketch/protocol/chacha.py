"""ChaCha20 keystreams under many keys at once (RFC 8439, section 2.3): one compiled loop.

Seed-compressed shares (ring.py, docs/protocol.md section 4) expand one 32-byte seed per row and
server into that row's share: the ChaCha20 keystream under the seed as key. A cipher object per
seed (the ``cryptography`` package) pays a key set-up of several microseconds per row, more than
the keystream itself; here a loop compiled with numba (``_chacha_kernel.py``) runs the block
function for every (row, block) of a batch. Its output is RFC 8439's byte for byte (the tests
check the RFC's vectors, and ``cryptography`` on random keys, nonces, counters and lengths).

The loop is compiled on first use, or loaded from numba's on-disk cache, by kernels.py's rule;
``warm_up`` does that ahead of the first batch. Loading it costs about a second of CPU (numba's
import), so until it is loaded a batch of fewer than ``kernels.MIN_ROWS`` keys takes
``cryptography``'s ChaCha20, one cipher per key (a few microseconds each): a server that only
ever sees small batches never loads numba. The loop releases the GIL, and a
batch of at least ``PARALLEL_WORDS`` output words is cut into row ranges run on ``THREADS``
threads. I/O-free apart from numba's cache files.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import kernels

KEY_BYTES = 32
NONCE_BYTES = 12
BLOCK_BYTES = 64
#: a batch of at least this many 32-bit output words is cut into row ranges for several threads
PARALLEL_WORDS = 1 << 20
#: threads for such a batch: the machine's cores, at most 4
THREADS = max(1, min(4, os.cpu_count() or 1))

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _per_key(key_words: np.ndarray, nonce: bytes, nbytes: int, counter: int) -> np.ndarray:
    """The same keystreams from ``cryptography``: one ChaCha20 cipher per key (its 16-byte nonce
    is RFC 8439's 32-bit little-endian block counter followed by the 96-bit nonce)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    full_nonce = counter.to_bytes(4, "little") + nonce
    keys = key_words.astype("<u4").tobytes()
    zeros = bytes(nbytes)
    out = np.empty((len(key_words), nbytes), np.uint8)
    for i in range(len(key_words)):
        cipher = Cipher(algorithms.ChaCha20(keys[KEY_BYTES * i:KEY_BYTES * (i + 1)], full_nonce), mode=None)
        out[i] = np.frombuffer(cipher.encryptor().update(zeros), np.uint8)
    return out


def warm_up() -> bool:
    """Compile the block loop, or load it from the cache, now (about a second from the cache,
    numba's import included); whether it is available. The SDK's Client does it in a background
    thread while it fetches the study. A server loads it when it opens a large study
    (services/store.py) or when a batch of ``kernels.MIN_ROWS`` seeds arrives first."""
    return kernels.CHACHA.warm_up()


def _as_words(raw: bytes | np.ndarray, size: int, what: str) -> np.ndarray:
    """Values of ``size`` bytes (concatenated bytes, or an (m, size) uint8 array) as an (m, size/4)
    array of uint32 in machine order, read little-endian."""
    if isinstance(raw, np.ndarray):
        if raw.dtype != np.uint8 or (raw.ndim == 2 and raw.shape[1] != size) or raw.ndim > 2:
            raise ValueError(f"ChaCha20 {what}s are an (m, {size}) uint8 array")
        flat = np.ascontiguousarray(raw).reshape(-1)
    else:
        flat = np.frombuffer(bytes(raw), dtype=np.uint8)
    if flat.size % size:
        raise ValueError(f"a ChaCha20 {what} is {size} bytes")
    return flat.view("<u4").astype(np.uint32).reshape(-1, size // 4)


def keystream(keys: bytes | np.ndarray, nonce: bytes, nbytes: int, counter: int = 0,
              threads: int | None = None, compiled: bool | None = None) -> np.ndarray:
    """The first ``nbytes`` bytes of the ChaCha20 keystream under each key (RFC 8439: 96-bit
    ``nonce``, 32-bit block counter starting at ``counter``): an (m, nbytes) uint8 array for an
    (m, 32) uint8 array of keys, or m keys concatenated as bytes. ``threads``: split the rows
    among this many threads (default: ``THREADS`` from ``PARALLEL_WORDS`` words on, else one).
    ``compiled``: the numba loop (True; RuntimeError where it cannot be had) or ``cryptography``
    per key (False); by default the loop by kernels.py's rule (once it is loaded, or from
    ``kernels.MIN_ROWS`` keys), else ``cryptography``."""
    key_words = _as_words(keys, KEY_BYTES, "key")
    nonce_words = _as_words(nonce, NONCE_BYTES, "nonce")
    if len(nonce_words) != 1:
        raise ValueError(f"a ChaCha20 nonce is {NONCE_BYTES} bytes")
    if nbytes < 0 or not 0 <= counter < 1 << 32:
        raise ValueError("need nbytes >= 0 and a 32-bit block counter")
    if counter + -(-nbytes // BLOCK_BYTES) > 1 << 32:
        raise ValueError("the 32-bit block counter would wrap")
    m, width = len(key_words), -(-nbytes // 4)
    blocks = kernels.CHACHA.for_rows(m) if compiled is None else kernels.CHACHA.require() if compiled else None
    if blocks is None:
        return _per_key(key_words, bytes(nonce), nbytes, counter)
    out = np.empty((m, width), np.uint32)
    if m and width:
        if threads is None:
            threads = THREADS if m * width >= PARALLEL_WORDS else 1
        threads = max(1, min(int(threads), m))
        if threads == 1:
            blocks(key_words, counter, nonce_words[0], out)
        else:
            cuts = np.linspace(0, m, threads + 1).astype(np.int64)
            parts = [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:])]
            list(_executor().map(lambda s: blocks(key_words[s], counter, nonce_words[0], out[s]), parts))
        if sys.byteorder != "little":  # the keystream's words are little-endian
            out.byteswap(inplace=True)
    raw = out.view(np.uint8)
    return raw if raw.shape[1] == nbytes else raw[:, :nbytes]


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="chacha20")
        return _pool


def _after_fork() -> None:
    """A forked child has none of its parent's threads: it starts its own pool when it needs one
    (the parent's would look idle and never run anything)."""
    global _lock, _pool
    _lock = threading.Lock()
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
