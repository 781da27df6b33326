"""The batch section of a verifier message (docs/protocol.md section 6d, studies with
``batch_proofs``). I/O-free: bytes in, bytes out.

Why a section of its own and not more entries of the report section: a batch is decided whole,
by one verifier share of its own length (the batch circuit's V, which depends on m), under its
batch id; its rows are never decided one by one. So a verifier message of a study with
``batch_proofs`` is the report section exactly as before (``validity.encode_verifiers``) followed
by this section, and a study without the member sends and accepts the report section alone: its
bytes are what they were.

Layout (little-endian):

    u32 b                                   the number of batches, then for each, by ascending batch id:
    16 bytes  batch id
    u32       m, the batch's rows
    u32       V, its verifier length (the batch plan's, for that m)
    16 V      its verifier share (V elements of F_(p^2): two 8-byte elements each, each < p)

m and V are on the wire so that a message can be split and checked without building a batch's
circuit; the receiver checks V against the plan of that m when it decides
(:func:`check_lengths`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import field
from .validity import ValidityError

BATCH_ID_BYTES = 16
#: The longest verifier a batch section may name (a decoding bound, far above any batch plan's V).
MAX_VERIFIER_LEN = 1 << 16
_ENTRY = struct.Struct("<16sII")


@dataclass(frozen=True)
class BatchVerifier:
    """One batch's entry: its id, its rows and its verifier share, (V, 2) F_p elements."""

    batch_id: bytes
    m: int
    share: np.ndarray

    @property
    def verifier_len(self) -> int:
        return int(self.share.shape[0])


def encode(entries: Sequence[BatchVerifier]) -> bytes:
    """The batch section of ``entries`` (sorted here by batch id; ids must differ)."""
    ordered = sorted(entries, key=lambda e: e.batch_id)
    for a, b in zip(ordered, ordered[1:]):
        if a.batch_id == b.batch_id:
            raise ValueError(f"batch {a.batch_id.hex()} twice in one verifier message")
    return struct.pack("<I", len(ordered)) + b"".join(encode_entry(e) for e in ordered)


def encode_entry(e: BatchVerifier) -> bytes:
    """One batch's entry (a sender that makes a section a batch at a time writes the count, then
    the entries by ascending batch id)."""
    share = np.ascontiguousarray(e.share, dtype=np.uint64)
    if share.ndim != 2 or share.shape[1] != 2 or len(e.batch_id) != BATCH_ID_BYTES:
        raise ValueError("a batch verifier is a 16-byte id and a (V, 2) share")
    return _ENTRY.pack(e.batch_id, e.m, share.shape[0]) + field.to_wire(share)


def report_section_length(body: bytes, verifier_len: int) -> int:
    """Bytes of a verifier message's report section (its count, ids and (m, V, 2) elements, V
    the study's per-report ``verifier_len``): where the batch section starts."""
    if len(body) < 4:
        raise ValidityError("a verifier message starts with its 4-byte count")
    (m,) = struct.unpack_from("<I", body)
    end = 4 + m * (16 + 16 * verifier_len)
    if end > len(body):
        raise ValidityError(f"a verifier message of {m} reports needs {end} bytes, got {len(body)}")
    return end


def split(body: bytes, verifier_len: int) -> tuple[bytes, bytes]:
    """(the report section, the batch section) of a study with ``batch_proofs``."""
    end = report_section_length(body, verifier_len)
    return body[:end], body[end:]


def decode(section: bytes, max_verifier_len: int = MAX_VERIFIER_LEN) -> list[BatchVerifier]:
    """The entries of a batch section; ValidityError for a malformed one (cut short or too long,
    a V of 0 or over ``max_verifier_len``, an element >= p, ids not strictly ascending)."""
    if len(section) < 4:
        raise ValidityError("a verifier message's batch section starts with its 4-byte count")
    (b,) = struct.unpack_from("<I", section)
    at, entries, last = 4, [], b""
    for _ in range(b):
        if at + _ENTRY.size > len(section):
            raise ValidityError("a verifier message's batch section is cut short")
        bid, m, v = _ENTRY.unpack_from(section, at)
        at += _ENTRY.size
        if not 0 < v <= max_verifier_len or m == 0:
            raise ValidityError(f"batch {bid.hex()}: a verifier of {v} elements for {m} rows")
        if bid <= last:
            raise ValidityError("a verifier message's batch ids must be strictly ascending")
        if at + 16 * v > len(section):
            raise ValidityError("a verifier message's batch section is cut short")
        raw = np.frombuffer(section, dtype="<u8", count=2 * v, offset=at)
        at += 16 * v
        try:
            share = field.elements(raw, "verifier share").reshape(v, 2)
        except field.FieldError as exc:
            raise ValidityError(str(exc)) from None
        entries.append(BatchVerifier(bytes(bid), int(m), share))
        last = bid
    if at != len(section):
        raise ValidityError(f"a verifier message's batch section of {b} batches is {at} bytes, "
                            f"got {len(section)}")
    return entries


def check_lengths(entry: BatchVerifier, plan_verifier_len: int) -> None:
    """ValidityError unless the entry's V is its batch plan's (what m gives)."""
    if entry.verifier_len != plan_verifier_len:
        raise ValidityError(f"batch {entry.batch_id.hex()}: a verifier of {entry.verifier_len} "
                            f"elements, its plan's is {plan_verifier_len}")
