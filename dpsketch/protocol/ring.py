"""Fixed-point encoding into Z_(2^64) and additive secret sharing (DESIGN.md, "Ring encoding").

x -> round(x * 2^f) mod 2^64, little-endian uint64; a sum decodes as a signed int64 / 2^f.
N-1 shares are uniform (from a ChaCha20 keystream keyed by the OS's CSPRNG, keystream.py); the last is x minus their sum. numpy's uint64
addition and negation wrap mod 2^64 exactly, so servers and analyzer need nothing else.
"""

from __future__ import annotations

import hashlib

import math

import numpy as np

from . import chacha
from .keystream import Keystream

RING_BITS = 64
WIRE_DTYPE = np.dtype("<u8")


class EncodingRangeError(ValueError):
    """A value does not fit the study's fixed-point range; it is refused, never wrapped."""


def max_frac_bits(max_reports: int, value_bound: float, extra: float = 0.0) -> int:
    """The largest f with (max_reports * value_bound + extra) * 2^f < 2^63 (a signed sum of that
    many values, plus ``extra`` of server noise, cannot overflow)."""
    if max_reports < 1 or not value_bound > 0 or not extra >= 0:
        raise ValueError("need max_reports >= 1, a positive value bound and extra >= 0")
    total = max_reports * value_bound + extra
    f = 0
    while total * 2.0 ** (f + 1) < 2.0**63 and f < 62:
        f += 1
    if total * 2.0**f >= 2.0**63:
        raise ValueError(
            f"{max_reports} reports of magnitude up to {value_bound} (and {extra:g} of server "
            f"noise) cannot be summed in 64 bits"
        )
    return f


def _in_range(values: np.ndarray, frac_bits: int, bound: float) -> np.ndarray:
    """The values as float64, refused unless finite, within bound, and bound * 2^f fits 63 bits."""
    if not bound * 2.0**frac_bits < 2.0**63:
        raise EncodingRangeError(f"bound {bound} with {frac_bits} fractional bits does not fit 64 bits")
    x = np.asarray(values, dtype=np.float64)
    if not (np.abs(x) <= bound).all():  # one pass: NaN and +-inf fail it too
        if not np.all(np.isfinite(x)):
            raise EncodingRangeError("values must be finite")
        raise EncodingRangeError(f"a value exceeds the encoding bound {bound}")
    return x


def encode(values: np.ndarray, frac_bits: int, bound: float) -> np.ndarray:
    """Encode floats with |x| <= bound as uint64 ring elements; refuse anything outside."""
    # times 2^f, exact in IEEE arithmetic (a power of two, no overflow after the range check),
    # the same as np.ldexp and four times as fast
    fixed = np.rint(_in_range(values, frac_bits, bound) * math.ldexp(1.0, frac_bits)).astype(np.int64)
    return fixed.view(np.uint64)


def encode_on_grid(values: np.ndarray, frac_bits: int, shift: int, bound: float) -> np.ndarray:
    """Encode floats with |x| <= bound, rounded to the noise grid: round(x 2^(f - shift)) 2^shift
    (int64), so that a client's values lie on the same lattice as its noise (noise.py)."""
    scaled = _in_range(values, frac_bits, bound) * math.ldexp(1.0, frac_bits - shift)  # exact, as above
    fixed = np.rint(scaled, out=scaled).astype(np.int64)
    if shift:
        np.left_shift(fixed, shift, out=fixed)
    return fixed


def decode(ring: np.ndarray, frac_bits: int) -> np.ndarray:
    """Read ring elements as signed int64 and scale back to floats."""
    values = np.asarray(ring, dtype=np.uint64).view(np.int64).astype(np.float64)
    values *= math.ldexp(1.0, -frac_bits)  # exact: |values| >= 1 never reaches the subnormals
    return values


def random_ring(shape: tuple[int, ...] | int, stream: Keystream | None = None) -> np.ndarray:
    """Uniform elements of Z_(2^64) from a CSPRNG keystream (a fresh one if none is given)."""
    count = int(np.prod(shape))
    return (stream or Keystream()).words(count).reshape(shape)


def share(encoded: np.ndarray, n_shares: int, stream: Keystream | None = None) -> list[np.ndarray]:
    """Split ring elements into n additive shares: n-1 uniform, the last x minus their sum."""
    if n_shares < 2:
        raise ValueError("need at least two shares")
    x = np.asarray(encoded, dtype=np.uint64)
    stream = stream or Keystream()
    shares = [random_ring(x.shape, stream) for _ in range(n_shares - 1)]
    last = x.copy()
    for s in shares:
        last -= s
    return shares + [last]


def reconstruct(shares: list[np.ndarray]) -> np.ndarray:
    """Sum shares mod 2^64."""
    total = np.zeros_like(np.asarray(shares[0], dtype=np.uint64))
    for s in shares:
        total += np.asarray(s, dtype=np.uint64)
    return total


# --- seed-compressed shares (docs/protocol.md sections 4 and 7) ------------------------------

SEED_BYTES = 32


def seed_is_smaller(width: int) -> bool:
    """Whether a share of this width takes more bytes than the seed it expands from (width
    above 4): only then is a seed worth sending (the SDK) or storing (a share server)."""
    return 8 * width > SEED_BYTES

#: Domain string of the seed expansion; the ChaCha20 nonce is derived from it.
SEED_DOMAIN = b"dpsketch/seed-share/1"
#: RFC 8439 ChaCha20 with a 32-bit block counter starting at 0 and the 96-bit nonce
#: SHA-256(SEED_DOMAIN)[:12] (chacha.py computes the keystreams of a whole batch at once).
SEED_NONCE = hashlib.sha256(SEED_DOMAIN).digest()[:12]


def expand_seed(seed: bytes, d: int) -> np.ndarray:
    """A share of d ring elements from a 32-byte seed: the first 8d bytes of the ChaCha20
    keystream (key = seed, counter 0, nonce SHA-256(b"dpsketch/seed-share/1")[:12]), read as
    little-endian uint64."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a seed is {SEED_BYTES} bytes, got {len(seed)}")
    return expand_seeds(bytes(seed), d)[0]


def expand_seeds(seeds: np.ndarray | bytes, d: int) -> np.ndarray:
    """Expand an (m, 32) uint8 array (or m concatenated seeds as bytes) into an (m, d) share:
    row i is ``expand_seed(seeds[i], d)``."""
    if isinstance(seeds, np.ndarray) and (seeds.dtype != np.uint8 or seeds.ndim != 2):
        seeds = np.ascontiguousarray(seeds).view(np.uint8).reshape(-1, SEED_BYTES)
    try:
        stream = chacha.keystream(seeds, SEED_NONCE, 8 * d)
    except ValueError:
        raise ValueError(f"seeds are a whole number of {SEED_BYTES}-byte values") from None
    return stream.view(WIRE_DTYPE)


def share_with_seeds(encoded: np.ndarray, n_shares: int,
                     stream: Keystream | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """Seed-compressed sharing of an (m, d) matrix: n-1 arrays of (m, 32) uint8 seeds (from the
    keystream), one for each server but one, and that one server's full (m, d) share
    x - sum_j expand(seed_j) mod 2^64. With a secure PRG any n-1 of the n messages are
    indistinguishable from uniform, independent of x, exactly as with ``share``."""
    if n_shares < 2:
        raise ValueError("need at least two shares")
    x = np.asarray(encoded, dtype=np.uint64)
    if x.ndim != 2:
        raise ValueError("share_with_seeds takes an (m, d) matrix")
    m, d = x.shape
    stream = stream or Keystream()
    seeds = [stream.array(SEED_BYTES * m).reshape(m, SEED_BYTES) for _ in range(n_shares - 1)]
    last = x.copy()
    for s in seeds:
        last -= expand_seeds(s, d)
    return seeds, last
