"""Sealed shares: each share encrypted to its server with HPKE (docs/protocol.md section 7a,
docs/sealing.md).

A client seals the plaintext of each report for one server (its d-value share, or the 32-byte
seed of a seed-compressed share, after the report's proof) to that server's current public key
of one of two HPKE (RFC 9180, base mode) suites:

* ``classical``: DHKEM(X25519, HKDF-SHA256) / HKDF-SHA256 / ChaCha20-Poly1305 (KEM 0x0020), the
  suite since the start;
* ``post-quantum`` (opt-in): the hybrid KEM MLKEM768-X25519 (KEM 0x647a, X-Wing,
  draft-ietf-hpke-pq) / HKDF-SHA256 / ChaCha20-Poly1305. A recording of today's sealed shares
  stays closed to a future quantum computer as long as ML-KEM-768 holds, and to a classical one
  as long as either ML-KEM-768 or X25519 holds. Only the KEM differs: HKDF-SHA256 and
  ChaCha20-Poly1305 (256-bit keys) keep a 128-bit margin against Grover's search.

One layout has the media type ``application/x-dpsketch-sealed``:

* **Version 3**: one *batch*. Its header seals a fresh 32-byte batch secret with HPKE
  single-shot, once per batch and server, with ``info`` binding the study, the server, the batch id, the key id, the version,
  the suite, the record kind and the record count; every record is then the report id and its
  plaintext sealed with ChaCha20-Poly1305 under a key derived (HKDF-SHA256) from the secret and
  the whole header, with the record's index as its nonce and the header's transcript and the
  report id as its associated data. So a record opens only in its own batch, at its own place,
  under its own report id, at the server and study it was sealed for; a batch opens only whole
  (its record count is sealed). One KEM per batch instead of one per record::

      batch_id (16) | key_id (8) | 0x80 (1) | version (1) = 0x03 | kem_id (2) | kdf_id (2)
        | aead_id (2) | content (1) | count (4) | enc (Nenc) | wrapped secret (48)
      then count records:  report_id (16) | ciphertext (len(plaintext) + 16)

      context3   = study_id (32) || len(server_id) (1) || server_id || header[0:37]
      info3      = "dpsketch/sealed/3" || SHA-256(context3)                            (49 bytes)
      enc || wrapped = HPKE.Seal(pk, info3, secret)                     (single shot, empty aad)
      transcript = SHA-256(study_id || len(server_id) || server_id || header)     (the whole header)
      key        = HKDF-SHA256(salt = none, ikm = secret, info = "dpsketch/sealed/3/records" || transcript, 32)
      record i   = report_id_i || ChaCha20-Poly1305(key, nonce = i as 12 bytes big-endian,
                                                    aad = transcript || report_id_i, plaintext_i)

Versions 1 and 2, one HPKE seal per record, were dropped before any release used them (issue
41): each record cost the server a KEM (a 2.8 MiB version 1 body 1.1 s of CPU, against 0.05 s as
one version 3 batch), and they were opened before the upload's quota was checked, so a replayed
body cost that CPU indefinitely. A body in either layout is refused as malformed, before any
decryption (:func:`open_batch`); their bytes are recognised only to say so.

Why ``info`` and not HPKE's associated data for the header: the single-shot API of the
``cryptography`` package (``hpke.Suite.encrypt``) takes no AAD, only ``info``; ``info`` enters
the key schedule, so a different context derives a different key and the AEAD tag fails exactly
as a wrong AAD would. The context is hashed to keep ``info`` at 49 bytes, under the 64 bytes
every RFC 9180 implementation must accept. (The records are sealed with the ``cryptography``
package's ChaCha20-Poly1305, which does take associated data.)

The plaintext of a record is the report's proof for this server (16 N bytes: its salt and the
other servers' commitments, ``binding``) followed by the payload: ``content`` 0x01 for a share
(8 * width bytes, the share's little-endian uint64) or 0x02 for a seed (32 bytes, expanded as in
section 4). The salt is inside the ciphertext on purpose: a relay that saw it could test guesses
of the row against the commitment together with colluding servers. ``key_id`` is the first 8
bytes of SHA-256 of the server's raw public key (32 bytes X25519; 1216 bytes ML-KEM-768 ||
X25519 for the hybrid). Integers are big-endian, as in RFC 9180.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, hpke, serialization
from cryptography.hazmat.primitives.asymmetric import mlkem, x25519
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from . import binding
from .binding import CONTENT_SEED, CONTENT_SHARE
from .sketch import REPORT_ID_BYTES

SUITE = hpke.Suite(hpke.KEM.X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.CHACHA20_POLY1305)
#: RFC 9180 identifiers of the classical suite (published in ``/v1/info``).
KEM_ID, KDF_ID, AEAD_ID = 0x0020, 0x0001, 0x0003
SUITE_NAME = "DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, ChaCha20-Poly1305"
#: The hybrid KEM's identifier (draft-ietf-hpke-pq: MLKEM768-X25519, also known as X-Wing).
PQ_KEM_ID = 0x647A
PQ_SUITE_NAME = "MLKEM768-X25519, HKDF-SHA256, ChaCha20-Poly1305"

INFO_LABEL_V3 = b"dpsketch/sealed/3"
#: HKDF ``info`` label of a version 3 batch's record key (followed by the batch's transcript).
RECORD_KEY_LABEL = b"dpsketch/sealed/3/records"
VERSION_3 = 3
#: Every sealed layout this code seals and opens (published in ``/v1/info`` as ``hpke.versions``).
VERSIONS = (VERSION_3,)
#: Byte 24 of a version 3 body (0x80, then the version byte 3).
EXTENDED = 0x80
KEY_ID_BYTES = 8
PUBLIC_KEY_BYTES = 32
ENC_BYTES = 32
TAG_BYTES = 16
#: A version 3 batch header before ``enc``: batch id, key id, 0x80, version, suite ids, content, count.
BATCH_ID_BYTES = 16
COUNT_BYTES = 4
V3_FIXED_BYTES = BATCH_ID_BYTES + KEY_ID_BYTES + 1 + 1 + 6 + 1 + COUNT_BYTES  # 37
#: The batch secret a version 3 header seals, and its HPKE ciphertext (the secret and a tag).
SECRET_BYTES = 32
WRAPPED_BYTES = SECRET_BYTES + TAG_BYTES
NONCE_BYTES = 12
MAX_BATCH_RECORDS = 2**32 - 1

SEED_BYTES = 32
MLKEM_SEED_BYTES = 64
MLKEM_PUBLIC_BYTES = 1184


class SealError(ValueError):
    """A sealed record that does not open: unknown key id, or failed authentication (wrong
    server, study, report id or kind, or tampered bytes)."""


class UnknownSuite(SealError):
    """A batch naming a suite this code does not seal or open."""


class MalformedSealedBatch(ValueError):
    """A body that is not one well-formed version 3 sealed batch."""


# --- suites ----------------------------------------------------------------------------------


def _raw_x25519_private(key: x25519.X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


@dataclass(frozen=True)
class SealingSuite:
    """One HPKE suite a share can be sealed with, and its raw key formats.

    Raw keys are what servers store and publish: classical, the 32-byte X25519 keys; post-quantum,
    the private key as the 64-byte ML-KEM-768 seed (d || z, FIPS 203) followed by the 32-byte
    X25519 private key, the public key as the 1184-byte ML-KEM-768 encapsulation key followed by
    the 32-byte X25519 public key (draft-ietf-hpke-pq's SerializePublicKey order)."""

    name: str
    description: str
    kem_id: int
    kdf_id: int
    aead_id: int
    public_key_bytes: int
    private_key_bytes: int
    enc_bytes: int
    hpke_suite: Any = field(compare=False, repr=False)

    @property
    def ids(self) -> bytes:
        return (self.kem_id.to_bytes(2, "big") + self.kdf_id.to_bytes(2, "big")
                + self.aead_id.to_bytes(2, "big"))

    @property
    def post_quantum(self) -> bool:
        return self.kem_id != KEM_ID

    def generate_private_key(self) -> bytes:
        """A fresh raw private key (OS CSPRNG, via the ``cryptography`` package)."""
        x = _raw_x25519_private(x25519.X25519PrivateKey.generate())
        if not self.post_quantum:
            return x
        return mlkem.MLKEM768PrivateKey.generate().private_bytes_raw() + x

    def _check(self, raw: bytes, size: int, what: str) -> bytes:
        raw = bytes(raw)
        if len(raw) != size:
            raise ValueError(f"a {self.name} {what} key is {size} bytes, got {len(raw)}")
        return raw

    def load_private_key(self, raw: bytes):
        raw = self._check(raw, self.private_key_bytes, "private")
        if not self.post_quantum:
            return x25519.X25519PrivateKey.from_private_bytes(raw)
        return hpke.MLKEM768X25519PrivateKey(
            mlkem.MLKEM768PrivateKey.from_seed_bytes(raw[:MLKEM_SEED_BYTES]),
            x25519.X25519PrivateKey.from_private_bytes(raw[MLKEM_SEED_BYTES:]))

    def public_key_of(self, private_key: bytes) -> bytes:
        raw = self._check(private_key, self.private_key_bytes, "private")
        x = x25519.X25519PrivateKey.from_private_bytes(raw[-32:]).public_key().public_bytes_raw()
        if not self.post_quantum:
            return x
        m = mlkem.MLKEM768PrivateKey.from_seed_bytes(raw[:MLKEM_SEED_BYTES])
        return m.public_key().public_bytes_raw() + x

    def load_public_key(self, raw: bytes):
        raw = self._check(raw, self.public_key_bytes, "public")
        if not self.post_quantum:
            return x25519.X25519PublicKey.from_public_bytes(raw)
        return hpke.MLKEM768X25519PublicKey(
            mlkem.MLKEM768PublicKey.from_public_bytes(raw[:MLKEM_PUBLIC_BYTES]),
            x25519.X25519PublicKey.from_public_bytes(raw[MLKEM_PUBLIC_BYTES:]))

    def owns(self, private_key) -> bool:
        """Whether a loaded private key is of this suite's KEM."""
        kind = hpke.MLKEM768X25519PrivateKey if self.post_quantum else x25519.X25519PrivateKey
        return isinstance(private_key, kind)


CLASSICAL = SealingSuite("classical", SUITE_NAME, KEM_ID, KDF_ID, AEAD_ID, 32, 32, ENC_BYTES, SUITE)
POST_QUANTUM = SealingSuite(
    "post-quantum", PQ_SUITE_NAME, PQ_KEM_ID, KDF_ID, AEAD_ID, MLKEM_PUBLIC_BYTES + 32,
    MLKEM_SEED_BYTES + 32, 1120,
    hpke.Suite(hpke.KEM.MLKEM768_X25519, hpke.KDF.HKDF_SHA256, hpke.AEAD.CHACHA20_POLY1305))


def _ml_kem_available() -> bool:
    """Whether the ``cryptography`` backend has ML-KEM (its wheels do; a build against an
    OpenSSL without it does not): without it the post-quantum suite is simply not offered."""
    try:
        mlkem.MLKEM768PrivateKey.generate()
    except Exception:  # noqa: BLE001 - UnsupportedAlgorithm, or whatever an old backend raises
        return False
    return True


#: Every suite this process can seal and open, by name and by its (kem, kdf, aead) ids.
SUITES = {s.name: s for s in (CLASSICAL, POST_QUANTUM) if s is CLASSICAL or _ml_kem_available()}
_BY_IDS = {s.ids: s for s in SUITES.values()}


def suite_by_ids(kem_id: int, kdf_id: int, aead_id: int) -> SealingSuite | None:
    return _BY_IDS.get(kem_id.to_bytes(2, "big") + kdf_id.to_bytes(2, "big") + aead_id.to_bytes(2, "big"))


# --- keys ------------------------------------------------------------------------------------


def key_id(public_key: bytes) -> bytes:
    """The 8-byte id of a raw public key of either suite: SHA-256(public_key)[:8]."""
    if len(public_key) not in (CLASSICAL.public_key_bytes, POST_QUANTUM.public_key_bytes):
        raise ValueError(f"a public key is {CLASSICAL.public_key_bytes} (X25519) or "
                         f"{POST_QUANTUM.public_key_bytes} (MLKEM768-X25519) bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).digest()[:KEY_ID_BYTES]


def generate_private_key() -> bytes:
    """A fresh raw 32-byte X25519 private key (OS CSPRNG, via the ``cryptography`` package)."""
    return CLASSICAL.generate_private_key()


def public_key_of(private_key: bytes) -> bytes:
    """The raw 32-byte public key of a raw X25519 private key."""
    return CLASSICAL.public_key_of(private_key)


def load_public_key(raw: bytes) -> x25519.X25519PublicKey:
    if len(raw) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an X25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(raw)}")
    return x25519.X25519PublicKey.from_public_bytes(raw)


# --- context ---------------------------------------------------------------------------------


def _study_bytes(study_id: str) -> bytes:
    study = bytes.fromhex(study_id)
    if len(study) != 32:
        raise ValueError("a study id is 64 hex characters")
    return study


def _server_bytes(server_id: str) -> bytes:
    """len(server_id) (1) || server_id (ASCII)."""
    sid = server_id.encode("ascii")
    if not 0 < len(sid) < 256:
        raise ValueError("a server id is 1..255 ASCII characters")
    return bytes([len(sid)]) + sid


def info_v3(study_id: str, server_id: str, fixed: bytes) -> bytes:
    """The HPKE ``info`` of a version 3 batch header: ``"dpsketch/sealed/3" || SHA-256(study_id
    || len(server_id) || server_id || fixed)``, ``fixed`` the header's first 37 bytes (batch id,
    key id, 0x80, version, suite ids, content, count)."""
    if len(fixed) != V3_FIXED_BYTES:
        raise ValueError(f"a version 3 header has {V3_FIXED_BYTES} bytes before enc")
    return INFO_LABEL_V3 + hashlib.sha256(_study_bytes(study_id) + _server_bytes(server_id) + fixed).digest()


def transcript_v3(study_id: str, server_id: str, header: bytes) -> bytes:
    """SHA-256 of ``study_id || len(server_id) || server_id || header``, the whole batch header
    (``enc`` and the wrapped secret included): what every record's key and associated data bind."""
    return hashlib.sha256(_study_bytes(study_id) + _server_bytes(server_id) + bytes(header)).digest()


def record_key(secret: bytes, transcript: bytes) -> bytes:
    """The ChaCha20-Poly1305 key of a version 3 batch's records: HKDF-SHA256 (RFC 5869) of the
    batch secret, no salt, ``info`` = "dpsketch/sealed/3/records" || transcript, 32 bytes."""
    if len(secret) != SECRET_BYTES or len(transcript) != 32:
        raise ValueError(f"a batch secret and a transcript are {SECRET_BYTES} and 32 bytes")
    return HKDF(hashes.SHA256(), SECRET_BYTES, None, RECORD_KEY_LABEL + transcript).derive(secret)


def record_nonce(index: int) -> bytes:
    """Record ``index``'s nonce (0-based): the index as 12 bytes, big-endian."""
    return index.to_bytes(NONCE_BYTES, "big")


def record_aad(transcript: bytes, report_id: bytes) -> bytes:
    """A version 3 record's associated data: the batch transcript, then its report id."""
    return transcript + report_id


# --- sizes -----------------------------------------------------------------------------------


def payload_bytes(content: int, width: int) -> int:
    if content == CONTENT_SHARE:
        return 8 * width
    if content == CONTENT_SEED:
        return SEED_BYTES
    raise MalformedSealedBatch(f"unknown content kind 0x{content:02x} (0x01 share, 0x02 seed; "
                               f"0x80 marks a versioned record)")


def plaintext_bytes(content: int, width: int, n_servers: int) -> int:
    """The proof and the payload of one record."""
    return binding.proof_bytes(n_servers) + payload_bytes(content, width)


def _version_3(version: int) -> None:
    if version != VERSION_3:
        raise ValueError(f"sealed layout version {version} is not sealed or opened any more: version 3 "
                         f"batches only (versions 1 and 2 were dropped, issue 41)")


def batch_header_bytes(suite: SealingSuite = CLASSICAL) -> int:
    """A version 3 batch's header: 117 bytes classical, 1205 post-quantum."""
    return V3_FIXED_BYTES + suite.enc_bytes + WRAPPED_BYTES


def overhead_bytes(suite: SealingSuite = CLASSICAL, version: int = VERSION_3) -> int:
    """Bytes a sealed record adds to the plaintext record: 16 (its tag; the batch adds its
    header, ``batch_header_bytes``, once)."""
    _version_3(version)
    return TAG_BYTES


def record_bytes(content: int, width: int, n_servers: int, suite: SealingSuite = CLASSICAL,
                 version: int = VERSION_3) -> int:
    """One record of a batch: its report id, then its proof and payload sealed (with a tag)."""
    _version_3(version)
    return REPORT_ID_BYTES + plaintext_bytes(content, width, n_servers) + TAG_BYTES


def body_bytes(content: int, width: int, n_servers: int, m: int, suite: SealingSuite = CLASSICAL,
               version: int = VERSION_3) -> int:
    """The size of a sealed body of ``m`` records."""
    return batch_header_bytes(suite) + m * record_bytes(content, width, n_servers, suite, version)


def default_version(suite: SealingSuite) -> int:
    """The layout ``seal_batch`` uses: version 3, for either suite (the only one)."""
    return VERSION_3


# --- seal ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipient:
    """Where a share is sealed to: a server's id, its current public key (raw bytes) of
    ``suite``, and the layout (``version``) to seal in."""

    server_id: str
    public_key: bytes
    suite: SealingSuite = CLASSICAL
    version: int = VERSION_3

    @property
    def key_id(self) -> bytes:
        return key_id(self.public_key)


@dataclass(frozen=True)
class BatchHeader:
    """A version 3 batch header. ``sealed_secret`` is ``enc || wrapped``, what HPKE's single-shot
    seal of the 32-byte batch secret returns."""

    batch_id: bytes
    key_id: bytes
    suite: SealingSuite
    content: int
    count: int
    sealed_secret: bytes

    def fixed(self) -> bytes:
        """The 37 bytes before ``enc`` (what ``info_v3`` binds)."""
        return (self.batch_id + self.key_id + bytes([EXTENDED, VERSION_3]) + self.suite.ids
                + bytes([self.content]) + self.count.to_bytes(COUNT_BYTES, "big"))


def seal_records(secret: bytes, transcript: bytes, report_ids: Sequence[bytes],
                 plaintexts: Sequence[bytes | memoryview]) -> bytes:
    """A version 3 batch's records (deterministic given the secret and the transcript)."""
    if any(len(rid) != REPORT_ID_BYTES for rid in report_ids):
        raise ValueError(f"a report id is {REPORT_ID_BYTES} bytes")
    encrypt = ChaCha20Poly1305(record_key(secret, transcript)).encrypt
    out = [rid + encrypt(record_nonce(i), pt, record_aad(transcript, rid))
           for i, (rid, pt) in enumerate(zip(report_ids, plaintexts))]
    return b"".join(out)


def _seal_v3(recipient: Recipient, study_id: str, report_ids: Sequence[bytes], content: int,
             plaintexts: Sequence[bytes | memoryview]) -> bytes:
    """One version 3 batch: a fresh batch id and secret, one HPKE seal of the secret, then the
    records."""
    m = len(report_ids)
    if not 1 <= m <= MAX_BATCH_RECORDS:
        raise ValueError(f"a sealed batch holds 1 to {MAX_BATCH_RECORDS} records, not {m}")
    payload_bytes(content, 1)  # a known kind
    if len({len(pt) for pt in plaintexts}) != 1:
        raise ValueError("the records of a batch have plaintexts of one length")
    suite = recipient.suite
    pk = suite.load_public_key(recipient.public_key)
    secret = os.urandom(SECRET_BYTES)
    head = BatchHeader(os.urandom(BATCH_ID_BYTES), recipient.key_id, suite, content, m, b"")
    fixed = head.fixed()
    header = fixed + suite.hpke_suite.encrypt(secret, pk, info=info_v3(study_id, recipient.server_id, fixed))
    transcript = transcript_v3(study_id, recipient.server_id, header)
    return header + seal_records(secret, transcript, report_ids, plaintexts)


def seal(recipient: Recipient, study_id: str, report_id: bytes, content: int, plaintext: bytes,
         version: int | None = None) -> bytes:
    """One report sealed: a one-record body (in ``version``, default ``recipient.version``)."""
    return seal_batch(recipient, study_id, [report_id], content, [plaintext], version)


def seal_batch(recipient: Recipient, study_id: str, report_ids: Sequence[bytes], content: int,
               plaintexts: Sequence[bytes | memoryview], version: int | None = None) -> bytes:
    """A sealed body: one version 3 batch, ``plaintexts[i]`` (a proof and a payload) sealed under
    ``report_ids[i]``. ``version``: 3 (the default, ``recipient.version``), or ValueError."""
    if len(report_ids) != len(plaintexts):
        raise ValueError("one plaintext per report id")
    _version_3(recipient.version if version is None else version)
    return _seal_v3(recipient, study_id, report_ids, content, plaintexts)


def seal_body(recipient: Recipient, study_id: str, body: bytes, media_type: str, width: int,
              n_servers: int, version: int | None = None) -> bytes:
    """Seal a plaintext batch body (``application/x-dpsketch-shares`` or ``-seeds``): the sealed
    body holds the same reports, in the same order, with the same proofs and payloads."""
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
    view = memoryview(body)
    starts = range(0, len(body), record)
    ids = [bytes(view[i:i + REPORT_ID_BYTES]) for i in starts]
    plaintexts = [view[i + REPORT_ID_BYTES:i + record] for i in starts]
    return seal_batch(recipient, study_id, ids, content, plaintexts, version)


# --- parse and open --------------------------------------------------------------------------


def is_batch(body: bytes) -> bool:
    """Whether a sealed body is a version 3 batch (byte 24 is 0x80 and byte 25 is 3)."""
    at = REPORT_ID_BYTES + KEY_ID_BYTES
    return len(body) > at + 1 and body[at] == EXTENDED and body[at + 1] == VERSION_3


def _suite_of(ids: bytes, where: str) -> SealingSuite:
    suite = _BY_IDS.get(bytes(ids))
    if suite is None:
        kem, kdf, aead = (int.from_bytes(ids[i:i + 2], "big") for i in (0, 2, 4))
        known = "; ".join(f"{s.name}: kem 0x{s.kem_id:04x}, kdf 0x{s.kdf_id:04x}, aead 0x{s.aead_id:04x}"
                          for s in SUITES.values())
        raise UnknownSuite(f"{where}: HPKE suite (kem 0x{kem:04x}, kdf 0x{kdf:04x}, aead "
                           f"0x{aead:04x}) is not one this server opens ({known})")
    return suite


def _check_content(content: int, where: str) -> None:
    if content not in (CONTENT_SHARE, CONTENT_SEED):
        raise MalformedSealedBatch(f"{where}: unknown content kind 0x{content:02x} (0x01 share, "
                                   f"0x02 seed)")


def check_layout(body: bytes) -> None:
    """MalformedSealedBatch unless ``body`` starts as a version 3 batch: an empty body, or one of
    the dropped per-record layouts (version 1: a content byte without bit 7 at byte 24; version
    2: 0x80 then version 2), is refused here, before any key is looked up or any decryption."""
    if not body:
        raise MalformedSealedBatch("a sealed batch holds at least one record")
    if is_batch(body):
        return
    at = REPORT_ID_BYTES + KEY_ID_BYTES
    marker = body[at] if len(body) > at else None
    version = body[at + 1] if marker == EXTENDED and len(body) > at + 1 else (1 if marker in (1, 2) else None)
    if version in (1, 2):
        raise MalformedSealedBatch(f"sealed records of version {version} (one HPKE seal per record) are "
                                   f"not accepted any more: seal one version 3 batch (docs/sealing.md)")
    raise MalformedSealedBatch("not a version 3 sealed batch (byte 24 must be 0x80 and byte 25 the "
                               "version, 3)")


def parse_batch(body: bytes, width: int, n_servers: int) -> BatchHeader:
    """The header of a version 3 body, checked against the body's length (no decryption):
    MalformedSealedBatch if it is short, names an unknown kind or no records, or the body is not
    exactly its header and ``count`` records (truncated, padded or spliced); UnknownSuite for a
    suite not known here."""
    check_layout(body)
    if len(body) < V3_FIXED_BYTES:
        raise MalformedSealedBatch(f"{len(body)} bytes: a version 3 sealed batch has a header of at "
                                   f"least {V3_FIXED_BYTES} bytes")
    at = BATCH_ID_BYTES + KEY_ID_BYTES + 2
    content = body[at + 6]
    _check_content(content, "sealed batch")
    suite = _suite_of(body[at:at + 6], "sealed batch")
    count = int.from_bytes(body[at + 7:V3_FIXED_BYTES], "big")
    if count == 0:
        raise MalformedSealedBatch("a sealed batch holds at least one record (its count is 0)")
    head = batch_header_bytes(suite)
    expected = head + count * record_bytes(content, width, n_servers, suite, VERSION_3)
    if len(body) != expected:
        raise MalformedSealedBatch(
            f"a version 3 {suite.name} sealed batch of {count} records of kind 0x{content:02x} at "
            f"width {width} is {expected} bytes, this body is {len(body)} (truncated, padded or spliced)")
    return BatchHeader(bytes(body[:BATCH_ID_BYTES]), bytes(body[BATCH_ID_BYTES:BATCH_ID_BYTES + KEY_ID_BYTES]),
                       suite, content, count, bytes(body[V3_FIXED_BYTES:head]))


def count_records(body: bytes, width: int, n_servers: int) -> int:
    return parse_batch(body, width, n_servers).count


def record_ids(body: bytes, header: BatchHeader, width: int, n_servers: int) -> bytes:
    """The report ids of a parsed batch's records, concatenated: they travel in the clear (each
    record's associated data binds its own), so a server can judge a batch by them (the
    upload token's quota) before any decryption."""
    head = batch_header_bytes(header.suite)
    size = record_bytes(header.content, width, n_servers, header.suite)
    rows = np.frombuffer(body, dtype=np.uint8, offset=head).reshape(header.count, size)
    return rows[:, :REPORT_ID_BYTES].tobytes()


def split_body(body: bytes, width: int, n_servers: int) -> tuple[bytes, bytes]:
    """A sealed batch does not cut in two (its count and order are sealed): ValueError. Seal
    each half of its plaintext again."""
    raise ValueError("a version 3 sealed batch cannot be cut in two: seal each half of its "
                     "plaintext again")


def _check_suite(key, kid: bytes, suite: SealingSuite, what: str):
    """``key`` if it is of ``suite``: a key of another suite is refused, never tried."""
    if not suite.owns(key):
        raise SealError(f"{what}: key id {kid.hex()} names a key of another suite, not "
                        f"{suite.name}; fetch /v1/info and seal again")
    return key


def _key_of(private_key_for: Callable[[bytes], Any], kid: bytes, suite: SealingSuite, what: str):
    key = private_key_for(kid)
    if key is None:
        raise SealError(f"{what}: unknown key id {kid.hex()} (not a key of this server, or retired); "
                        f"fetch /v1/info and seal again")
    return _check_suite(key, kid, suite, what)


def open_secret(private_key, study_id: str, server_id: str, header: BatchHeader) -> bytes:
    """A version 3 batch's secret (HPKE single-shot open of its header under ``info_v3``)."""
    try:
        secret = header.suite.hpke_suite.decrypt(header.sealed_secret, private_key,
                                                 info=info_v3(study_id, server_id, header.fixed()))
    except InvalidTag:
        raise SealError(f"sealed batch {header.batch_id.hex()}: its key does not open here (sealed "
                        f"for another server or study, or its header altered in transit)") from None
    if len(secret) != SECRET_BYTES:  # cannot happen: WRAPPED_BYTES fixes the length
        raise SealError(f"sealed batch {header.batch_id.hex()}: a batch secret is {SECRET_BYTES} bytes")
    return secret


def open_records(secret: bytes, transcript: bytes, records: bytes | memoryview, count: int, plaintext_len: int,
                 batch_id: bytes = b"", first: int = 0) -> tuple[list[bytes], bytes]:
    """The report ids and the concatenated plaintexts of ``count`` records of a version 3 batch,
    its records ``first`` to ``first + count - 1`` (``records``: those records' bytes; by default
    the whole body after the header). SealError naming the first record that does not open:
    moved from another batch, to another place or report id, or altered."""
    decrypt = ChaCha20Poly1305(record_key(secret, transcript)).decrypt
    size = REPORT_ID_BYTES + plaintext_len + TAG_BYTES
    view = memoryview(records)
    starts = range(0, count * size, size)
    ids = [bytes(view[p:p + REPORT_ID_BYTES]) for p in starts]
    try:
        out = [decrypt(record_nonce(i), view[p + REPORT_ID_BYTES:p + size], record_aad(transcript, rid))
               for i, p, rid in zip(range(first, first + count), starts, ids)]
    except InvalidTag:
        for i, p, rid in zip(range(first, first + count), starts, ids):  # which one (refusals only)
            try:
                decrypt(record_nonce(i), view[p + REPORT_ID_BYTES:p + size], record_aad(transcript, rid))
            except InvalidTag:
                raise SealError(f"report {rid.hex()}: record {i} of sealed batch {batch_id.hex()} does "
                                f"not open here (moved from another batch or place, under another "
                                f"report id, or altered in transit)") from None
        raise  # pragma: no cover - every record opened the second time
    return ids, b"".join(out)


def _upload(ids: list[bytes], plain: bytes, content: int, width: int, n_servers: int):
    from .messages import Upload

    rows = np.frombuffer(plain, dtype=np.uint8).reshape(len(ids), -1)
    proof_len = binding.proof_bytes(n_servers)
    proofs = np.ascontiguousarray(rows[:, :proof_len])
    payload = np.ascontiguousarray(rows[:, proof_len:])
    if content == CONTENT_SHARE:
        payload = payload.view("<u8").reshape(len(ids), width).astype(np.uint64)
    return Upload(ids, proofs, payload, content)


def open_batch(body: bytes, width: int, n_servers: int, study_id: str, server_id: str,
               private_key_for: Callable[[bytes], Any]):
    """Open a sealed body (one version 3 batch) into a ``messages.Upload`` (ids, proofs, payloads
    of one kind; not yet verified or expanded). ``private_key_for(key_id)`` is a loaded private
    key of either suite, or None. All or nothing: a body that does not parse raises
    MalformedSealedBatch before any key is used (a body of the dropped layouts 1 and 2 too;
    UnknownSuite for a suite not known here), a header or record that does not open SealError."""
    header = parse_batch(body, width, n_servers)
    where = f"sealed batch {header.batch_id.hex()}"
    key = _key_of(private_key_for, header.key_id, header.suite, where)
    secret = open_secret(key, study_id, server_id, header)
    head = batch_header_bytes(header.suite)
    transcript = transcript_v3(study_id, server_id, body[:head])
    ids, plain = open_records(secret, transcript, memoryview(body)[head:], header.count,
                              plaintext_bytes(header.content, width, n_servers), header.batch_id)
    return _upload(ids, plain, header.content, width, n_servers)
