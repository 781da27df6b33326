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

The plaintext is the report's proof for this server (16 N bytes: its salt and the other servers'
commitments, ``binding``) followed by the payload: ``content`` is 0x01 for a share (8 * width
bytes, the share's little-endian uint64) or 0x02 for a seed (32 bytes, expanded as in section 4).
The salt is inside the ciphertext on purpose: a relay that saw it could test guesses of the row
against the commitment together with colluding servers. All records of one body have the same
``content``. ``key_id`` is the first 8
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

from . import binding
from .binding import CONTENT_SEED, CONTENT_SHARE
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
#: Bytes a sealed record adds to the plaintext record (16-byte id + proof + payload): 57.
OVERHEAD_BYTES = HEADER_BYTES - REPORT_ID_BYTES + TAG_BYTES

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


def payload_bytes(content: int, width: int) -> int:
    if content == CONTENT_SHARE:
        return 8 * width
    if content == CONTENT_SEED:
        return SEED_BYTES
    raise MalformedSealedBatch(f"unknown content kind 0x{content:02x} (0x01 share, 0x02 seed)")


def plaintext_bytes(content: int, width: int, n_servers: int) -> int:
    """The proof and the payload of one record."""
    return binding.proof_bytes(n_servers) + payload_bytes(content, width)


def record_bytes(content: int, width: int, n_servers: int) -> int:
    return HEADER_BYTES + plaintext_bytes(content, width, n_servers) + TAG_BYTES


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
               plaintexts: Sequence[bytes]) -> bytes:
    """A sealed body: one record per report id, ``plaintexts[i]`` (its proof and payload) sealed
    under ``report_ids[i]``."""
    if len(report_ids) != len(plaintexts):
        raise ValueError("one plaintext per report id")
    pk = load_public_key(recipient.public_key)
    kid = recipient.key_id
    head = bytes([content])
    sid = recipient.server_id
    out = bytearray()
    for rid, pt in zip(report_ids, plaintexts):
        out += rid + kid + head + SUITE.encrypt(bytes(pt), pk, info=info(study_id, sid, rid, content))
    return bytes(out)


def seal_body(recipient: Recipient, study_id: str, body: bytes, media_type: str, width: int,
              n_servers: int) -> bytes:
    """Seal a plaintext batch body (``application/x-dpsketch-shares`` or ``-seeds``) record by
    record: the sealed body holds the same reports with the same proofs and payloads."""
    from .messages import SEEDS_MEDIA_TYPE, SHARES_MEDIA_TYPE, record_bytes as plain_record_bytes

    if media_type == SHARES_MEDIA_TYPE:
        content = CONTENT_SHARE
    elif media_type == SEEDS_MEDIA_TYPE:
        content = CONTENT_SEED
    else:
        raise ValueError(f"cannot seal a body of type {media_type!r}")
    record = plain_record_bytes(media_type, width, n_servers)
    if not body or len(body) % record:
        raise ValueError(f"not a whole number of {record}-byte records")
    ids = [body[i:i + REPORT_ID_BYTES] for i in range(0, len(body), record)]
    plaintexts = [body[i + REPORT_ID_BYTES:i + record] for i in range(0, len(body), record)]
    return seal_batch(recipient, study_id, ids, content, plaintexts)


# --- parse and open --------------------------------------------------------------------------


@dataclass
class SealedRecord:
    report_id: bytes
    key_id: bytes
    content: int
    ciphertext: bytes  # enc || AEAD ciphertext


def parse(body: bytes, width: int, n_servers: int) -> list[SealedRecord]:
    """Split a sealed body into records (no decryption); MalformedSealedBatch if it is empty,
    names an unknown content kind, mixes kinds or does not end on a record boundary."""
    if not body:
        raise MalformedSealedBatch("a sealed batch holds at least one record")
    out: list[SealedRecord] = []
    pos, n = 0, len(body)
    while pos < n:
        if n - pos < HEADER_BYTES:
            raise MalformedSealedBatch(f"record {len(out)}: {n - pos} bytes left, a sealed record "
                                       f"has a {HEADER_BYTES}-byte header")
        content = body[pos + REPORT_ID_BYTES + KEY_ID_BYTES]
        if out and content != out[0].content:
            raise MalformedSealedBatch(f"record {len(out)}: a sealed batch holds records of one "
                                       f"kind (shares or seeds), not both")
        size = record_bytes(content, width, n_servers)
        if n - pos < size:
            raise MalformedSealedBatch(f"record {len(out)}: {n - pos} bytes left, a sealed record "
                                       f"of kind 0x{content:02x} at width {width} is {size} bytes")
        rid = body[pos:pos + REPORT_ID_BYTES]
        kid = body[pos + REPORT_ID_BYTES:pos + REPORT_ID_BYTES + KEY_ID_BYTES]
        out.append(SealedRecord(rid, kid, content, body[pos + REPORT_ID_BYTES + KEY_ID_BYTES + 1:pos + size]))
        pos += size
    return out


def count_records(body: bytes, width: int, n_servers: int) -> int:
    return len(parse(body, width, n_servers))


def split_body(body: bytes, width: int, n_servers: int) -> tuple[bytes, bytes]:
    """Cut a sealed body into two at the record boundary nearest its middle record."""
    records = parse(body, width, n_servers)
    half = len(records) // 2
    cut = sum(record_bytes(r.content, width, n_servers) for r in records[:half])
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


def open_batch(body: bytes, width: int, n_servers: int, study_id: str, server_id: str,
               private_key_for: Callable[[bytes], x25519.X25519PrivateKey | None]):
    """Open every record of a sealed body into a ``messages.Upload`` (ids, proofs, payloads of
    one kind; not yet verified or expanded). All or nothing: the first record that does not
    parse raises MalformedSealedBatch, the first that does not open raises SealError."""
    from .messages import Upload

    records = parse(body, width, n_servers)
    content = records[0].content
    proof_len = binding.proof_bytes(n_servers)
    ids: list[bytes] = []
    plain = bytearray()
    for rec in records:
        key = private_key_for(rec.key_id)
        if key is None:
            raise SealError(f"report {rec.report_id.hex()}: unknown key id {rec.key_id.hex()} (not a "
                            f"key of this server, or retired); fetch /v1/info and seal again")
        plain += open_record(key, study_id, server_id, rec)
        ids.append(rec.report_id)
    rows = np.frombuffer(bytes(plain), dtype=np.uint8).reshape(len(records), -1)
    proofs = np.ascontiguousarray(rows[:, :proof_len])
    payload = np.ascontiguousarray(rows[:, proof_len:])
    if content == CONTENT_SHARE:
        payload = payload.view("<u8").reshape(len(records), width).astype(np.uint64)
    return Upload(ids, proofs, payload, content)
