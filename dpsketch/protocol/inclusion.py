"""The compact inclusion set of a commit: a bitmap over the server's own sorted report ids
(docs/protocol.md section 7, ``application/x-dpsketch-inclusion-bitmap``).

Why: the plain form of an inclusion set lists every included id, 16 bytes each, so a commit of
10^8 reports was a 1.6 GB body that each server read into memory (issue 41: a streamed 768 MiB
junk commit took a server from 360 MiB to a 2 GiB peak before its 422). Every server already
holds the ids, sorted, and the analyzer has just fetched that sorted list (GET .../report-ids),
so one bit per held id says the same: 1.25 MB for 10^7 held ids, 12.5 MB for 10^8, never more
than the ids the server holds (which its memory budget already counts at about 95 bytes each).

Layout (little-endian count, bits least significant first in each byte, as
``numpy.packbits(bitorder="little")``)::

    held (8, uint64 LE) | inclusion_hash (32) | bitmap (ceil(held / 8) bytes)

* ``held``: how many ids the list the bitmap was made from had (the server's GET .../report-ids,
  or GET .../blocks for a study with parties: block ids by id). A server holding any other
  number refuses the bitmap (409 ``inclusion-stale``): its sorted order moved under new reports
  and the analyzer must fetch the list again.
* ``inclusion_hash``: SHA-256 of the included ids, sorted and concatenated: the inclusion hash of
  the same set in the plain form, which every server computes from its own ids and must find
  equal (422 ``invalid-request`` otherwise). So all servers commit to one set, named as before.
* bit i is set when the i-th id of that sorted list is in the set; the unused bits of the last
  byte are zero (400 ``malformed-body`` otherwise).

Everything here works on numpy arrays, never one Python object per id (issue 46).
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from .messages import locate, native_halves, report_id_halves
from .sketch import REPORT_ID_BYTES

MEDIA_TYPE = "application/x-dpsketch-inclusion-bitmap"
HEADER_BYTES = 8 + 32
#: ids hashed per step when a server checks the declared inclusion hash (16 MiB of ids at a time)
HASH_CHUNK = 1 << 20


def body_bytes(held: int) -> int:
    """The size of a bitmap body over ``held`` ids: the most a server ever reads for one."""
    return HEADER_BYTES + (held + 7) // 8


def mask_of(held_ids: bytes, included_ids: bytes) -> np.ndarray:
    """Which ids of a sorted id list (a server's) are on another sorted id list (the inclusion
    set), as a bool array; ValueError if either is malformed."""
    held_hi, held_lo = native_halves(report_id_halves(held_ids))
    in_hi, in_lo = native_halves(report_id_halves(included_ids))
    return locate(in_hi, in_lo, held_hi, held_lo) >= 0


def encode(mask: np.ndarray, inclusion_hash: bytes) -> bytes:
    """The body for a server whose sorted ids ``mask`` selects (``inclusion_hash``: 32 bytes)."""
    mask = np.asarray(mask, dtype=bool)
    if len(inclusion_hash) != 32:
        raise ValueError("an inclusion hash is 32 bytes (SHA-256)")
    return struct.pack("<Q", len(mask)) + bytes(inclusion_hash) + np.packbits(mask, bitorder="little").tobytes()


def encode_for(held_ids: bytes, included_ids: bytes) -> bytes:
    """The bitmap body of a server holding the sorted ids ``held_ids`` for the inclusion set
    ``included_ids`` (a sorted id list); ValueError unless the set is a subset of them."""
    mask = mask_of(held_ids, included_ids)
    if int(mask.sum()) != len(included_ids) // REPORT_ID_BYTES:
        raise ValueError("the inclusion set names ids this server does not hold")
    return encode(mask, hashlib.sha256(included_ids).digest())


def header(body: bytes | memoryview) -> tuple[int, bytes]:
    """(held, inclusion hash) of a bitmap body; ValueError if it is not one."""
    if len(body) < HEADER_BYTES:
        raise ValueError(f"an inclusion bitmap starts with {HEADER_BYTES} bytes (held count, hash)")
    (held,) = struct.unpack_from("<Q", body, 0)
    if len(body) != body_bytes(held):
        raise ValueError(f"an inclusion bitmap over {held} ids is {body_bytes(held)} bytes, not {len(body)}")
    return held, bytes(body[8:HEADER_BYTES])


def decode(body: bytes | memoryview) -> tuple[np.ndarray, bytes]:
    """(mask, inclusion hash) of a bitmap body; ValueError if malformed (its length, or a set
    bit past the last id)."""
    held, digest = header(body)
    bits = np.frombuffer(body, dtype=np.uint8, offset=HEADER_BYTES)
    if held % 8 and int(bits[-1]) >> (held % 8):
        raise ValueError("an inclusion bitmap's bits past its last id must be zero")
    return np.unpackbits(bits, count=held, bitorder="little").view(bool), digest


def hash_selected(hi: np.ndarray, lo: np.ndarray, mask: np.ndarray) -> bytes:
    """SHA-256 of the ids (given by their big-endian halves, ascending) that ``mask`` selects,
    concatenated: the inclusion hash, computed HASH_CHUNK ids at a time."""
    digest = hashlib.sha256()
    out = np.empty((HASH_CHUNK, 2), dtype=">u8")
    for start in range(0, len(mask), HASH_CHUNK):
        part = mask[start:start + HASH_CHUNK]
        n = int(np.count_nonzero(part))
        if not n:
            continue
        chunk = out[:n]
        chunk[:, 0] = hi[start:start + HASH_CHUNK][part]
        chunk[:, 1] = lo[start:start + HASH_CHUNK][part]
        digest.update(chunk.data.cast("B"))  # memoryview(chunk)
    return digest.digest()
