"""One CSPRNG keystream per batch: every random bit a client or server draws for a batch (its
noise, its shares, its commitment salts) comes from ChaCha20 keyed from ``os.urandom``.

Why a keystream and not ``os.urandom`` for everything. The kernel CSPRNG costs a system call
and a copy per request, about 40 % of preparing a batch; ChaCha20 (RFC 8439, the same cipher as
the seed-compressed shares and the kernel's own generator) produces the same quality of
randomness several times faster, vectorised. Its security is the kernel's: a fresh 256-bit key
from ``os.urandom`` per :class:`Keystream`, so an attacker who does not know the key cannot tell
the output from uniform bits (ChaCha20 is a PRF); no key is ever reused, and a forked process
never shares a stream with its parent because a stream lives only as long as the batch that
created it.

Nothing here is seeded deterministically, except :meth:`Keystream.from_key`, which the tests and
the sampler's test vectors (docs/protocol.md, section 5) use to reproduce a stream, and which a
resumable submission keys from its own secret (itself from os.urandom) so that a rerun rebuilds
the same reports (client_sdk/journal.py).
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

KEY_BYTES = 32
#: RFC 8439 ChaCha20 with a 32-bit block counter starting at 0 and the 96-bit nonce
#: b"dpsketch/rng" (12 bytes): a fresh key per stream makes a fixed nonce safe. A stream may
#: produce at most 2^32 blocks of 64 bytes (256 GiB) before the counter would wrap.
NONCE = b"dpsketch/rng"
_CIPHER_NONCE = b"\x00" * 4 + NONCE
MAX_BYTES = 64 << 32
_CHUNK = 1 << 20
_ZEROS = memoryview(bytes(_CHUNK))


class Keystream:
    """Uniform random bytes and 64-bit words from one ChaCha20 key (fresh from os.urandom)."""

    def __init__(self) -> None:
        self._init(os.urandom(KEY_BYTES))

    @classmethod
    def from_key(cls, key: bytes) -> "Keystream":
        """A reproducible stream: a known key gives known noise (test vectors), a secret key
        the same noise again (a resumed submission; its key must stay secret)."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"a keystream key is {KEY_BYTES} bytes")
        stream = cls.__new__(cls)
        stream._init(bytes(key))
        return stream

    def _init(self, key: bytes) -> None:
        self._cipher = Cipher(algorithms.ChaCha20(key, _CIPHER_NONCE), mode=None).encryptor()
        self._used = 0

    @property
    def position(self) -> int:
        """How many bytes of the stream have been read (the conformance vectors of the sampler
        state it after each draw, so that another implementation can find where it went astray)."""
        return self._used

    def bytes(self, n: int) -> bytes:
        """The next n bytes of the stream."""
        if n <= _CHUNK:
            self._count(n)
            return self._cipher.update(_ZEROS[:n])
        return self.array(n).tobytes()

    def array(self, n: int) -> np.ndarray:
        """The next n bytes of the stream as a fresh writable uint8 array. The cipher writes
        straight into it from a shared read-only block of zeros: no zero buffer is allocated per
        call and nothing is copied (each costs as much as the cipher itself)."""
        self._count(n)
        out = np.empty(n, dtype=np.uint8)
        view = out.data  # memoryview(out)
        for start in range(0, n, _CHUNK):
            size = min(_CHUNK, n - start)
            self._cipher.update_into(_ZEROS[:size], view[start:start + size])
        return out

    def words(self, count: int) -> np.ndarray:
        """The next ``count`` uniform 64-bit words (little-endian), as a writable uint64 array."""
        return self.array(8 * count).view("<u8").view(np.uint64)

    def words32(self, count: int) -> np.ndarray:
        """The next ``count`` uniform 32-bit words, as a writable uint32 array."""
        return self.array(4 * count).view("<u4").view(np.uint32)

    def bits(self, count: int) -> np.ndarray:
        """The next ``count`` uniform bits, as a bool array (8 per byte, least significant first)."""
        raw = self.array((count + 7) // 8)
        return np.unpackbits(raw, bitorder="little", count=count).view(bool)

    def _count(self, n: int) -> None:
        self._used += n
        if self._used > MAX_BYTES:
            raise OverflowError("a keystream is good for 256 GiB; start a new one")


def random_bytes(n: int) -> bytes:
    """n bytes from a fresh keystream (a convenience for one-off draws)."""
    return Keystream().bytes(n)
