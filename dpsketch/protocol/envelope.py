"""Sealed shares: each share encrypted to its server with HPKE (docs/protocol.md section 7a).

A client seals the plaintext of one report for one server (its d-value share, or the 32-byte
seed of a seed-compressed share) with HPKE base mode (RFC 9180), suite DHKEM(X25519,
HKDF-SHA256) / HKDF-SHA256 / ChaCha20-Poly1305, to that server's current public key. The study
id, the server id, the report id and the kind of plaintext are bound into the HPKE ``info``
(the key schedule), so a sealed share opens only at the server it was sealed for, only for that
study and only under that report id: a misrouted, replayed-elsewhere or tampered share is
useless. This lets shares travel through one untrusted gateway, or be stored by one.

Why ``info`` and not the AEAD's associated data: the single-shot API of the ``cryptography``
package (``hpke.Suite.encrypt``) takes no AAD, only ``info``; ``info`` enters the key schedule,
so a different context derives a different key and nonce and the AEAD tag fails exactly as a
wrong AAD would. The context is hashed to keep ``info`` at 49 bytes, under the 64 bytes every
RFC 9180 implementation must accept.

Record (``application/x-dpsketch-sealed``, a body is m >= 1 of them back to back)::

    report_id (16) | key_id (8) | content (1) | enc (32) | ciphertext (len(plaintext) + 16)

``content`` is 0x01 for a share (plaintext = 8 * width bytes, the share's little-endian uint64)
or 0x02 for a seed (plaintext = 32 bytes, expanded as in section 4). ``key_id`` is the first 8
bytes of SHA-256 of the server's raw 32-byte X25519 public key. ``info`` is the 17 ASCII bytes
``dpsketch/sealed/1`` followed by SHA-256 of
``study_id (32 raw bytes) || report_id (16) || content (1) || len(server_id) (1) || server_id``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hpke, serialization
from cryptography.hazmat.primitives.asymmetric import x25519

from .sketch import REPORT_ID_BYTES

SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.CHACHA20_POLY1305)
#: RFC 9180 identifiers of the suite (published in ``/v1/info``).
KEM_ID, KDF_ID, AEAD_ID = 0x0020, 0x0001, 0x0003
SUITE_NAME = "DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, ChaCha20-Poly1305"

INFO_LABEL = b"dpsketch/sealed/1"
KEY_ID_BYTES = 8
PUBLIC_KEY_BYTES = 32
ENC_BYTES = 32
TAG_BYTES = 16
HEADER_BYTES = REPORT_ID_BYTES + KEY_ID_BYTES + 1 + ENC_BYTES  # 57
#: Bytes a sealed record adds to the plaintext record (16-byte id + plaintext): 57.
OVERHEAD_BYTES = HEADER_BYTES - REPORT_ID_BYTES + TAG_BYTES

CONTENT_SHARE = 0x01
CONTENT_SEED = 0x02
SEED_BYTES = 32


class SealError(ValueError):
    """A sealed record that does not open: unknown key id, or failed authentication (wrong
    server, study, report id or kind, or tampered bytes)."""


class MalformedSealedBatch(ValueError):
    """A body that is not a whole sequence of well-formed sealed records."""


# --- keys ------------------------------------------------------------------------------------


def key_id(public_key: bytes) -> bytes:
    """The 8-byte id of a raw 32-byte X25519 public key: SHA-256(public_key)[:8]."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an X25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).digest()[:KEY_ID_BYTES]


def generate_private_key() -> bytes:
    """A fresh raw 32-byte X25519 private key (OS CSPRNG, via the ``cryptography`` package)."""
    return x25519.X25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def public_key_of(private_key: bytes) -> bytes:
    """The raw 32-byte public key of a raw private key."""
    return x25519.X25519PrivateKey.from_private_bytes(private_key).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_public_key(raw: bytes) -> x25519.X25519PublicKey:
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an X25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(raw)}")
    return x25519.X25519PublicKey.from_public_bytes(raw)


# --- context ---------------------------------------------------------------------------------


def info(study_id: str, server_id: str, report_id: bytes, content: int) -> bytes:
    """The HPKE ``info`` of one sealed share (see the module docstring)."""
    study = bytes.fromhex(study_id)
    if len(study) != 32:
        raise ValueError("a study id is 64 hex characters")
    if len(report_id) != REPORT_ID_BYTES:
        raise ValueError(f"a report id is {REPORT_ID_BYTES} bytes")
    sid = server_id.encode("ascii")
    if not 0 < len(sid) < 256:
        raise ValueError("a server id is 1..255 ASCII characters")
    context = study + report_id + bytes([content, len(sid)]) + sid
    return INFO_LABEL + hashlib.sha256(context).digest()


def plaintext_bytes(content: int, width: int) -> int:
    if content == CONTENT_SHARE:
        return 8 * width
    if content == CONTENT_SEED:
        return SEED_BYTES
    raise MalformedSealedBatch(f"unknown content kind 0x{content:02x} (0x01 share, 0x02 seed)")


def record_bytes(content: int, width: int) -> int:
    return HEADER_BYTES + plaintext_bytes(content, width) + TAG_BYTES


# --- seal ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipient:
    """Where a share is sealed to: a server's id and its current public key (raw bytes)."""

    server_id: str
    public_key: bytes

    @property
    def key_id(self) -> bytes:
        return key_id(self.public_key)


def seal(recipient: Recipient, study_id: str, report_id: bytes, content: int, plaintext: bytes) -> bytes:
    """One sealed record."""
    pk = load_public_key(recipient.public_key)
    ct = SUITE.encrypt(plaintext, pk, info=info(study_id, recipient.server_id, report_id, content))
    return report_id + recipient.key_id + bytes([content]) + ct


def seal_batch(recipient: Recipient, study_id: str, report_ids: Sequence[bytes], content: int,
               payloads: np.ndarray | Sequence[bytes]) -> bytes:
    """A sealed body: one record per report id, ``payloads[i]`` (bytes, or a row of a uint64
    share matrix / uint8 seed matrix) sealed under ``report_ids[i]``."""
    if len(report_ids) != len(payloads):
        raise ValueError("one payload per report id")
    pk = load_public_key(recipient.public_key)
    kid = recipient.key_id
    head = bytes([content])
    sid = recipient.server_id
    if isinstance(payloads, np.ndarray):
        arr = np.ascontiguousarray(payloads, dtype="<u8" if content == CONTENT_SHARE else np.uint8)
        raw = arr.tobytes()
        step = len(raw) // len(arr) if len(arr) else 0
        rows = [raw[i * step:(i + 1) * step] for i in range(len(arr))]
    else:
        rows = list(payloads)
    out = bytearray()
    for rid, pt in zip(report_ids, rows):
        out += rid + kid + head + SUITE.encrypt(pt, pk, info=info(study_id, sid, rid, content))
    return bytes(out)


def seal_body(recipient: Recipient, study_id: str, body: bytes, media_type: str, width: int) -> bytes:
    """Seal a plaintext batch body (``application/x-dpsketch-shares`` or ``-seeds``) record by
    record: the sealed body holds the same reports with the same plaintexts."""
    from .messages import SEEDS_MEDIA_TYPE, SHARES_MEDIA_TYPE

    if media_type == SHARES_MEDIA_TYPE:
        content, size = CONTENT_SHARE, 8 * width
    elif media_type == SEEDS_MEDIA_TYPE:
        content, size = CONTENT_SEED, SEED_BYTES
    else:
        raise ValueError(f"cannot seal a body of type {media_type!r}")
    record = REPORT_ID_BYTES + size
    if not body or len(body) % record:
        raise ValueError(f"not a whole number of {record}-byte records")
    ids = [body[i:i + REPORT_ID_BYTES] for i in range(0, len(body), record)]
    payloads = [body[i + REPORT_ID_BYTES:i + record] for i in range(0, len(body), record)]
    return seal_batch(recipient, study_id, ids, content, payloads)


# --- parse and open --------------------------------------------------------------------------


@dataclass
class SealedRecord:
    report_id: bytes
    key_id: bytes
    content: int
    ciphertext: bytes  # enc || AEAD ciphertext


def parse(body: bytes, width: int) -> list[SealedRecord]:
    """Split a sealed body into records (no decryption); MalformedSealedBatch if it is empty,
    names an unknown content kind or does not end on a record boundary."""
    if not body:
        raise MalformedSealedBatch("a sealed batch holds at least one record")
    out: list[SealedRecord] = []
    pos, n = 0, len(body)
    while pos < n:
        if n - pos < HEADER_BYTES:
            raise MalformedSealedBatch(f"record {len(out)}: {n - pos} bytes left, a sealed record "
                                       f"has a {HEADER_BYTES}-byte header")
        content = body[pos + REPORT_ID_BYTES + KEY_ID_BYTES]
        size = record_bytes(content, width)
        if n - pos < size:
            raise MalformedSealedBatch(f"record {len(out)}: {n - pos} bytes left, a sealed record "
                                       f"of kind 0x{content:02x} at width {width} is {size} bytes")
        rid = body[pos:pos + REPORT_ID_BYTES]
        kid = body[pos + REPORT_ID_BYTES:pos + REPORT_ID_BYTES + KEY_ID_BYTES]
        out.append(SealedRecord(rid, kid, content, body[pos + REPORT_ID_BYTES + KEY_ID_BYTES + 1:pos + size]))
        pos += size
    return out


def count_records(body: bytes, width: int) -> int:
    return len(parse(body, width))


def split_body(body: bytes, width: int) -> tuple[bytes, bytes]:
    """Cut a sealed body into two at the record boundary nearest its middle record."""
    records = parse(body, width)
    half = len(records) // 2
    cut = sum(record_bytes(r.content, width) for r in records[:half])
    return body[:cut], body[cut:]


def open_record(private_key: x25519.X25519PrivateKey, study_id: str, server_id: str,
                record: SealedRecord) -> bytes:
    try:
        return SUITE.decrypt(record.ciphertext, private_key,
                             info=info(study_id, server_id, record.report_id, record.content))
    except InvalidTag:
        raise SealError(
            f"report {record.report_id.hex()}: the sealed share does not open here (sealed for "
            f"another server, study or report id, or altered in transit)") from None


def open_batch(body: bytes, width: int, study_id: str, server_id: str,
               private_key_for: Callable[[bytes], x25519.X25519PrivateKey | None],
               expand_seeds: Callable[[np.ndarray, int], np.ndarray]) -> tuple[list[bytes], np.ndarray]:
    """Open every record of a sealed body: the report ids and the (m, width) uint64 shares
    (seed records expanded with ``expand_seeds``). All or nothing: the first record that does not
    parse raises MalformedSealedBatch, the first that does not open raises SealError."""
    records = parse(body, width)
    ids: list[bytes] = []
    shares = np.empty((len(records), width), dtype=np.uint64)
    seeds: list[tuple[int, bytes]] = []
    for i, rec in enumerate(records):
        key = private_key_for(rec.key_id)
        if key is None:
            raise SealError(f"report {rec.report_id.hex()}: unknown key id {rec.key_id.hex()} (not a "
                            f"key of this server, or retired); fetch /v1/info and seal again")
        pt = open_record(key, study_id, server_id, rec)
        ids.append(rec.report_id)
        if rec.content == CONTENT_SHARE:
            shares[i] = np.frombuffer(pt, dtype="<u8")
        else:
            seeds.append((i, pt))
    if seeds:
        rows = [i for i, _ in seeds]
        raw = np.frombuffer(b"".join(s for _, s in seeds), dtype=np.uint8).reshape(-1, SEED_BYTES)
        shares[rows] = expand_seeds(raw, width)
    return ids, shares
