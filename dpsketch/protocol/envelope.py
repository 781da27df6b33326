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

* **Version 4**: one *batch*. Its header seals a fresh 32-byte batch secret with HPKE
  single-shot, once per batch and server, with ``info`` binding the study, the server, the batch
  id, the key id, the version, the suite, the record kind and the record count. Then come the
  report ids of the records in the clear, then all the records' plaintexts sealed as one message
  with ChaCha20-Poly1305 under a key derived (HKDF-SHA256) from the secret and the whole header,
  whose associated data is the header's transcript followed by every report id in order. So a
  record opens only in its own batch, at its own place, under its own report id, at the server
  and study it was sealed for, and a batch opens only whole: one KEM and one AEAD per batch and
  server, whatever the number of records (issue 46: the AEAD per record of version 3 was most
  of a sealed upload's CPU)::

      batch_id (16) | key_id (8) | 0x80 (1) | version (1) = 0x04 | kem_id (2) | kdf_id (2)
        | aead_id (2) | content (1) | count (4) | enc (Nenc) | wrapped secret (48)
      then  report_id_0 .. report_id_{count-1}  (16 each)
      then  ChaCha20-Poly1305 of plaintext_0 || .. || plaintext_{count-1}  (count * P + 16)

      context4   = study_id (32) || len(server_id) (1) || server_id || header[0:37]
      info4      = "dpsketch/sealed/4" || SHA-256(context4)                            (49 bytes)
      enc || wrapped = HPKE.Seal(pk, info4, secret)                     (single shot, empty aad)
      transcript = SHA-256(study_id || len(server_id) || server_id || header)     (the whole header)
      key        = HKDF-SHA256(salt = none, ikm = secret, info = "dpsketch/sealed/4/records" || transcript, 32)
      sealed     = ChaCha20-Poly1305(key, nonce = 12 zero bytes, aad = transcript || report ids,
                                     plaintext_0 || .. || plaintext_{count-1})

Versions 1 and 2, one HPKE seal per record, were dropped before any release used them (issue
41): each record cost the server a KEM (a 2.8 MiB version 1 body 1.1 s of CPU, against 0.05 s as
one batch), and they were opened before the upload's quota was checked, so a replayed body cost
that CPU indefinitely. Version 3 (one HPKE seal per batch, then an AEAD per record) was replaced
by version 4 before any release too (issue 46). A body in any of these layouts is refused as
malformed, before any decryption (:func:`open_batch`); their bytes are recognised only to say so.

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

**Blocks** (a study with parties, docs/sealing.md section 3a): ``content`` 0x03, one party's
blocks. The batch names its party as the plaintext block batch does (``Content-Type:
application/x-dpsketch-sealed; party=NAME``), and binds it: the context's prefix is followed by
the party's index j (one byte) in both ``info4`` and the transcript. The clear id of a record is
its block id; its plaintext is the pseudonym, then the proof and the share of the party's d_j
columns, so a relay sees block ids only, which differ between the parties of one individual,
and cannot join the parties' uploads. A validity study's helper (docs/protocol.md section 4c)
gets its blocks as ``content`` 0x04: the pseudonym, then the proof and a 32-byte seed.
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

INFO_LABEL = b"dpsketch/sealed/4"
#: HKDF ``info`` label of a batch's record key (followed by the batch's transcript).
RECORD_KEY_LABEL = b"dpsketch/sealed/4/records"
VERSION_4 = 4
#: The content kind of a sealed batch of one party's blocks: pseudonym, proof and share sealed,
#: the block id in the clear (a header byte only: the blocks' commitments are of kind 0x01).
CONTENT_BLOCK = 0x03
#: The same for a validity study's helper: pseudonym, proof and a 32-byte seed (docs/sealing.md 3a).
CONTENT_BLOCK_SEED = 0x04
#: The kinds that hold one party's blocks (and name their party in the context).
BLOCK_CONTENTS = (CONTENT_BLOCK, CONTENT_BLOCK_SEED)
#: A batch proof's record (docs/sealing.md section 3b): a leader's (0x05) or a helper's (0x06),
#: one record a batch, its clear id the batch id and its plaintext the whole record (no binding
#: proof: the batch id is the binding). Its length is not the study's width's: a helper's is fixed
#: by N, a leader's by the m inside it (checked after opening, ``batch_records.decode``).
CONTENT_PROOF_BATCH = 0x05
CONTENT_PROOF_BATCH_SEED = 0x06
RECORD_CONTENTS = (CONTENT_PROOF_BATCH, CONTENT_PROOF_BATCH_SEED)
#: Every sealed layout this code seals and opens (published in ``/v1/info`` as ``hpke.versions``).
VERSIONS = (VERSION_4,)
#: Layouts recognised only to be refused by name (1 and 2: an HPKE seal per record, issue 41; 3:
#: an AEAD per record, issue 46).
DROPPED_VERSIONS = {1: "one HPKE seal per record", 2: "one HPKE seal per record",
                    3: "one AEAD per record"}
#: Byte 24 of a batch body (0x80, then the version byte).
EXTENDED = 0x80
KEY_ID_BYTES = 8
PUBLIC_KEY_BYTES = 32
ENC_BYTES = 32
TAG_BYTES = 16
#: A batch header before ``enc``: batch id, key id, 0x80, version, suite ids, content, count.
BATCH_ID_BYTES = 16
COUNT_BYTES = 4
FIXED_BYTES = BATCH_ID_BYTES + KEY_ID_BYTES + 1 + 1 + 6 + 1 + COUNT_BYTES  # 37
#: The batch secret a header seals, and its HPKE ciphertext (the secret and a tag).
SECRET_BYTES = 32
WRAPPED_BYTES = SECRET_BYTES + TAG_BYTES
#: The nonce of a batch's one record message: its key is the batch's own (a fresh secret and
#: the transcript), used for that one message only.
RECORDS_NONCE = bytes(12)
MAX_BATCH_RECORDS = 2**32 - 1
#: The most plaintext bytes one batch seals (count * P): the ``cryptography`` package's AEADs
#: take messages of at most 2^31 - 1 bytes, the ciphertext and its tag included. A server's
#: request size limit (64 MiB by default) refuses far smaller bodies first.
MAX_BATCH_PLAINTEXT_BYTES = 2**31 - 1 - TAG_BYTES

SEED_BYTES = 32
MLKEM_SEED_BYTES = 64
MLKEM_PUBLIC_BYTES = 1184


class SealError(ValueError):
    """A sealed record that does not open: unknown key id, or failed authentication (wrong
    server, study, report id or kind, or tampered bytes)."""


class UnknownSuite(SealError):
    """A batch naming a suite this code does not seal or open."""


class MalformedSealedBatch(ValueError):
    """A body that is not one well-formed version 4 sealed batch."""


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


def _prefix(study_id: str, server_id: str, party: int | None) -> bytes:
    """study_id || len(server_id) || server_id, then the party's index (a block batch only)."""
    tail = b""
    if party is not None:
        if not 0 <= party < 256:
            raise ValueError("a party's index is one byte")
        tail = bytes([party])
    return _study_bytes(study_id) + _server_bytes(server_id) + tail


def info_v4(study_id: str, server_id: str, fixed: bytes, party: int | None = None) -> bytes:
    """The HPKE ``info`` of a batch header: ``"dpsketch/sealed/4" || SHA-256(study_id ||
    len(server_id) || server_id || fixed)``, ``fixed`` the header's first 37 bytes (batch id, key
    id, 0x80, version, suite ids, content, count); for a block batch (``party``, its index) the
    index follows the server id."""
    if len(fixed) != FIXED_BYTES:
        raise ValueError(f"a batch header has {FIXED_BYTES} bytes before enc")
    return INFO_LABEL + hashlib.sha256(_prefix(study_id, server_id, party) + fixed).digest()


def transcript_v4(study_id: str, server_id: str, header: bytes, party: int | None = None) -> bytes:
    """SHA-256 of ``study_id || len(server_id) || server_id || header``, the whole batch header
    (``enc`` and the wrapped secret included): what the records' key and associated data bind
    (for a block batch, the party's index after the server id)."""
    return hashlib.sha256(_prefix(study_id, server_id, party) + bytes(header)).digest()


def record_key(secret: bytes, transcript: bytes) -> bytes:
    """The ChaCha20-Poly1305 key of a batch's records: HKDF-SHA256 (RFC 5869) of the batch
    secret, no salt, ``info`` = "dpsketch/sealed/4/records" || transcript, 32 bytes."""
    if len(secret) != SECRET_BYTES or len(transcript) != 32:
        raise ValueError(f"a batch secret and a transcript are {SECRET_BYTES} and 32 bytes")
    return HKDF(hashes.SHA256(), SECRET_BYTES, None, RECORD_KEY_LABEL + transcript).derive(secret)


def records_aad(transcript: bytes, report_ids: bytes | bytearray | memoryview) -> bytes:
    """The records' associated data: the batch transcript, then every report id in order (what
    binds each record's plaintext, at its place, to its report id)."""
    return transcript + bytes(report_ids)


# --- sizes -----------------------------------------------------------------------------------


def payload_bytes(content: int, width: int) -> int:
    if content == CONTENT_SHARE:
        return 8 * width
    if content == CONTENT_SEED:
        return SEED_BYTES
    if content == CONTENT_BLOCK:  # the pseudonym, then the share of the party's columns
        return REPORT_ID_BYTES + 8 * width
    if content == CONTENT_BLOCK_SEED:  # the pseudonym, then a helper's seed
        return REPORT_ID_BYTES + SEED_BYTES
    raise MalformedSealedBatch(f"unknown content kind 0x{content:02x} (0x01 share, 0x02 seed, "
                               f"0x03 block, 0x04 block seed; 0x80 marks a versioned record)")


def plaintext_bytes(content: int, width: int, n_servers: int) -> int:
    """The proof and the payload of one record."""
    return binding.proof_bytes(n_servers) + payload_bytes(content, width)


def _version_4(version: int) -> None:
    if version != VERSION_4:
        raise ValueError(f"sealed layout version {version} is not sealed or opened any more: version 4 "
                         f"batches only (versions 1 and 2 were dropped in issue 41, 3 in issue 46)")


def batch_header_bytes(suite: SealingSuite = CLASSICAL) -> int:
    """A batch's header: 117 bytes classical, 1205 post-quantum."""
    return FIXED_BYTES + suite.enc_bytes + WRAPPED_BYTES


def batch_overhead_bytes(suite: SealingSuite = CLASSICAL) -> int:
    """What sealing adds to a plaintext batch body, once per batch: its header and the records'
    one tag (133 bytes classical, 1221 post-quantum)."""
    return batch_header_bytes(suite) + TAG_BYTES


def overhead_bytes(suite: SealingSuite = CLASSICAL, version: int = VERSION_4) -> int:
    """Bytes a sealed record adds to the plaintext record: none (a record is its report id and
    its plaintext's ciphertext, as long as the plaintext; the batch adds
    :func:`batch_overhead_bytes` once)."""
    _version_4(version)
    return 0


def record_bytes(content: int, width: int, n_servers: int, suite: SealingSuite = CLASSICAL,
                 version: int = VERSION_4) -> int:
    """One record's bytes in a batch: its report id and its sealed proof and payload (the
    records' one tag is counted once per batch, :func:`body_bytes`)."""
    _version_4(version)
    return REPORT_ID_BYTES + plaintext_bytes(content, width, n_servers)


def body_bytes(content: int, width: int, n_servers: int, m: int, suite: SealingSuite = CLASSICAL,
               version: int = VERSION_4) -> int:
    """The size of a sealed body of ``m`` records."""
    return batch_overhead_bytes(suite) + m * record_bytes(content, width, n_servers, suite, version)


def default_version(suite: SealingSuite) -> int:
    """The layout ``seal_batch`` uses: version 4, for either suite (the only one)."""
    return VERSION_4


# --- seal ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipient:
    """Where a share is sealed to: a server's id, its current public key (raw bytes) of
    ``suite``, and the layout (``version``) to seal in."""

    server_id: str
    public_key: bytes
    suite: SealingSuite = CLASSICAL
    version: int = VERSION_4

    @property
    def key_id(self) -> bytes:
        return key_id(self.public_key)


@dataclass(frozen=True)
class BatchHeader:
    """A batch header. ``sealed_secret`` is ``enc || wrapped``, what HPKE's single-shot seal of
    the 32-byte batch secret returns."""

    batch_id: bytes
    key_id: bytes
    suite: SealingSuite
    content: int
    count: int
    sealed_secret: bytes

    def fixed(self) -> bytes:
        """The 37 bytes before ``enc`` (what ``info_v4`` binds)."""
        return (self.batch_id + self.key_id + bytes([EXTENDED, VERSION_4]) + self.suite.ids
                + bytes([self.content]) + self.count.to_bytes(COUNT_BYTES, "big"))


def _joined(parts: Sequence[bytes | memoryview] | bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    return parts if isinstance(parts, (bytes, bytearray, memoryview)) else b"".join(parts)


def seal_records(secret: bytes, transcript: bytes, report_ids: Sequence[bytes] | bytes,
                 plaintexts: Sequence[bytes | memoryview] | bytes | memoryview) -> bytes:
    """A batch's records (deterministic given the secret and the transcript): the report ids
    (a sequence of 16-byte ids, or their concatenation), then the plaintexts (a sequence, or
    their concatenation) sealed as one ChaCha20-Poly1305 message."""
    ids = _joined(report_ids)
    if len(ids) % REPORT_ID_BYTES or (not isinstance(report_ids, (bytes, bytearray, memoryview))
                                      and any(len(rid) != REPORT_ID_BYTES for rid in report_ids)):
        raise ValueError(f"a report id is {REPORT_ID_BYTES} bytes")
    sealed = ChaCha20Poly1305(record_key(secret, transcript)).encrypt(
        RECORDS_NONCE, _joined(plaintexts), records_aad(transcript, ids))
    return bytes(ids) + sealed


def _seal_v4(recipient: Recipient, study_id: str, ids: bytes, content: int, plain: bytes | memoryview,
             plaintext_len: int, party: int | None = None) -> bytes:
    """One batch: a fresh batch id and secret, one HPKE seal of the secret, then the report ids
    ``ids`` (concatenated) and the concatenated plaintexts ``plain`` sealed as one message."""
    m = len(ids) // REPORT_ID_BYTES
    if not 1 <= m <= MAX_BATCH_RECORDS:
        raise ValueError(f"a sealed batch holds 1 to {MAX_BATCH_RECORDS} records, not {m}")
    if content not in RECORD_CONTENTS:
        payload_bytes(content, 1)  # a known kind
    if len(ids) != m * REPORT_ID_BYTES or len(plain) != m * plaintext_len:
        raise ValueError("one plaintext of one length per 16-byte report id")
    if len(plain) > MAX_BATCH_PLAINTEXT_BYTES:
        raise ValueError(f"a sealed batch seals at most {MAX_BATCH_PLAINTEXT_BYTES} bytes of plaintext, "
                         f"not {len(plain)}: seal it as several batches")
    suite = recipient.suite
    pk = suite.load_public_key(recipient.public_key)
    secret = os.urandom(SECRET_BYTES)
    head = BatchHeader(os.urandom(BATCH_ID_BYTES), recipient.key_id, suite, content, m, b"")
    fixed = head.fixed()
    if (content in BLOCK_CONTENTS) != (party is not None):
        raise ValueError("a block batch (content 0x03 or 0x04), and only one, names its party")
    header = fixed + suite.hpke_suite.encrypt(secret, pk, info=info_v4(study_id, recipient.server_id, fixed, party))
    transcript = transcript_v4(study_id, recipient.server_id, header, party)
    return header + seal_records(secret, transcript, ids, plain)


def seal(recipient: Recipient, study_id: str, report_id: bytes, content: int, plaintext: bytes,
         version: int | None = None) -> bytes:
    """One report sealed: a one-record body (in ``version``, default ``recipient.version``)."""
    return seal_batch(recipient, study_id, [report_id], content, [plaintext], version)


def seal_batch(recipient: Recipient, study_id: str, report_ids: Sequence[bytes], content: int,
               plaintexts: Sequence[bytes | memoryview], version: int | None = None) -> bytes:
    """A sealed body: one batch, ``plaintexts[i]`` (a proof and a payload) sealed under
    ``report_ids[i]``. ``version``: 4 (the default, ``recipient.version``), or ValueError."""
    if len(report_ids) != len(plaintexts):
        raise ValueError("one plaintext per report id")
    _version_4(recipient.version if version is None else version)
    if any(len(rid) != REPORT_ID_BYTES for rid in report_ids):
        raise ValueError(f"a report id is {REPORT_ID_BYTES} bytes")
    lengths = {len(pt) for pt in plaintexts}
    if len(lengths) > 1:
        raise ValueError("the records of a batch have plaintexts of one length")
    return _seal_v4(recipient, study_id, b"".join(report_ids), content, b"".join(plaintexts),
                    lengths.pop() if lengths else 0)


def seal_body(recipient: Recipient, study_id: str, body: bytes, media_type: str, width: int,
              n_servers: int, version: int | None = None, party: int | None = None) -> bytes:
    """Seal a plaintext batch body (``application/x-dpsketch-shares`` or ``-seeds``, or a party's
    ``application/x-dpsketch-blocks`` with ``party`` its index and ``width`` its columns): the
    sealed body holds the same records, in the same order, with the same proofs and payloads
    (a block's pseudonym sealed with them). The body's ids and plaintexts are cut apart as two
    array copies, and sealed in one AEAD call."""
    from .messages import (BLOCK_SEEDS_MEDIA_TYPE, BLOCKS_MEDIA_TYPE, SEEDS_MEDIA_TYPE, SHARES_MEDIA_TYPE,
                           record_bytes as plain_record_bytes)

    if media_type == SHARES_MEDIA_TYPE:
        content = CONTENT_SHARE
    elif media_type == SEEDS_MEDIA_TYPE:
        content = CONTENT_SEED
    elif media_type.split(";", 1)[0].strip() == BLOCKS_MEDIA_TYPE and party is not None:
        content = CONTENT_BLOCK
    elif media_type.split(";", 1)[0].strip() == BLOCK_SEEDS_MEDIA_TYPE and party is not None:
        content = CONTENT_BLOCK_SEED
    else:
        raise ValueError(f"cannot seal a body of type {media_type!r}")
    _version_4(recipient.version if version is None else version)
    record = plain_record_bytes(media_type, width, n_servers)
    if not body or len(body) % record:
        raise ValueError(f"not a whole number of {record}-byte records")
    rows = np.frombuffer(body, dtype=np.uint8).reshape(-1, record)
    return _seal_v4(recipient, study_id, rows[:, :REPORT_ID_BYTES].tobytes(), content,
                    rows[:, REPORT_ID_BYTES:].tobytes(), record - REPORT_ID_BYTES, party)


# --- parse and open --------------------------------------------------------------------------


def is_batch(body: bytes) -> bool:
    """Whether a sealed body is a version 4 batch (byte 24 is 0x80 and byte 25 is 4)."""
    at = REPORT_ID_BYTES + KEY_ID_BYTES
    return len(body) > at + 1 and body[at] == EXTENDED and body[at + 1] == VERSION_4


def suite_of(ids: bytes, where: str) -> SealingSuite:
    """The suite of a header's 6 suite-id bytes; UnknownSuite naming ``where`` otherwise."""
    suite = _BY_IDS.get(bytes(ids))
    if suite is None:
        kem, kdf, aead = (int.from_bytes(ids[i:i + 2], "big") for i in (0, 2, 4))
        known = "; ".join(f"{s.name}: kem 0x{s.kem_id:04x}, kdf 0x{s.kdf_id:04x}, aead 0x{s.aead_id:04x}"
                          for s in SUITES.values())
        raise UnknownSuite(f"{where}: HPKE suite (kem 0x{kem:04x}, kdf 0x{kdf:04x}, aead "
                           f"0x{aead:04x}) is not one this server opens ({known})")
    return suite


def _check_content(content: int, where: str, party: int | None = None) -> None:
    if content in RECORD_CONTENTS:
        raise MalformedSealedBatch(f"{where}: content 0x{content:02x} is a batch proof's record, taken only "
                                   f"by a study with batch_proofs (docs/sealing.md section 3b)")
    if content not in (CONTENT_SHARE, CONTENT_SEED, *BLOCK_CONTENTS):
        raise MalformedSealedBatch(f"{where}: unknown content kind 0x{content:02x} (0x01 share, "
                                   f"0x02 seed, 0x03 block, 0x04 block seed)")
    if party is not None and content not in BLOCK_CONTENTS:
        raise MalformedSealedBatch(f"{where}: a study with parties takes sealed blocks (content 0x03 or "
                                   f"0x04), not content 0x{content:02x}")
    if party is None and content in BLOCK_CONTENTS:
        raise MalformedSealedBatch(f"{where}: sealed blocks (content 0x03 or 0x04) are for a study with "
                                   f"parties, sent as application/x-dpsketch-sealed; party=NAME")


def check_layout(body: bytes) -> None:
    """MalformedSealedBatch unless ``body`` starts as a version 4 batch: an empty body, or one of
    the dropped layouts (version 1: a content byte without bit 7 at byte 24; versions 2 and 3:
    0x80 then the version), is refused here, before any key is looked up or any decryption."""
    if not body:
        raise MalformedSealedBatch("a sealed batch holds at least one record")
    if is_batch(body):
        return
    at = REPORT_ID_BYTES + KEY_ID_BYTES
    marker = body[at] if len(body) > at else None
    version = body[at + 1] if marker == EXTENDED and len(body) > at + 1 else (1 if marker in (1, 2) else None)
    if version in DROPPED_VERSIONS:
        raise MalformedSealedBatch(f"sealed records of version {version} ({DROPPED_VERSIONS[version]}) are "
                                   f"not accepted any more: seal one version 4 batch (docs/sealing.md)")
    raise MalformedSealedBatch("not a version 4 sealed batch (byte 24 must be 0x80 and byte 25 the "
                               "version, 4)")


def parse_batch(body: bytes, width: int, n_servers: int, party: int | None = None) -> BatchHeader:
    """The header of a batch body, checked against the body's length (no decryption):
    MalformedSealedBatch if it is short, names an unknown kind or no records, or the body is not
    exactly its header, ``count`` report ids and their sealed plaintexts (truncated, padded or
    spliced); UnknownSuite for a suite not known here. ``party``: the index of the party whose
    blocks the batch must hold (``width`` its columns); None: shares or seeds."""
    check_layout(body)
    if len(body) < FIXED_BYTES:
        raise MalformedSealedBatch(f"{len(body)} bytes: a sealed batch has a header of at "
                                   f"least {FIXED_BYTES} bytes")
    at = BATCH_ID_BYTES + KEY_ID_BYTES + 2
    content = body[at + 6]
    _check_content(content, "sealed batch", party)
    suite = suite_of(body[at:at + 6], "sealed batch")
    count = int.from_bytes(body[at + 7:FIXED_BYTES], "big")
    if count == 0:
        raise MalformedSealedBatch("a sealed batch holds at least one record (its count is 0)")
    head = batch_header_bytes(suite)
    expected = body_bytes(content, width, n_servers, count, suite)
    if len(body) != expected:
        raise MalformedSealedBatch(
            f"a version 4 {suite.name} sealed batch of {count} records of kind 0x{content:02x} at "
            f"width {width} is {expected} bytes, this body is {len(body)} (truncated, padded or spliced)")
    if count * plaintext_bytes(content, width, n_servers) > MAX_BATCH_PLAINTEXT_BYTES:
        raise MalformedSealedBatch(f"a sealed batch seals at most {MAX_BATCH_PLAINTEXT_BYTES} bytes of "
                                   f"plaintext; this one {count} records: send several batches")
    return BatchHeader(bytes(body[:BATCH_ID_BYTES]), bytes(body[BATCH_ID_BYTES:BATCH_ID_BYTES + KEY_ID_BYTES]),
                       suite, content, count, bytes(body[FIXED_BYTES:head]))


def count_records(body: bytes, width: int, n_servers: int, party: int | None = None) -> int:
    return parse_batch(body, width, n_servers, party).count


def record_ids(body: bytes, header: BatchHeader, width: int, n_servers: int) -> bytes:
    """The report ids of a parsed batch's records, concatenated: they travel in the clear (the
    records' associated data binds them), so a server can judge a batch by them (the upload
    token's quota) before any decryption."""
    head = batch_header_bytes(header.suite)
    return bytes(body[head:head + header.count * REPORT_ID_BYTES])


def split_body(body: bytes, width: int, n_servers: int) -> tuple[bytes, bytes]:
    """A sealed batch does not cut in two (its count and order are sealed): ValueError. Seal
    each half of its plaintext again."""
    raise ValueError("a sealed batch cannot be cut in two: seal each half of its plaintext again")


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


def open_secret(private_key, study_id: str, server_id: str, header: BatchHeader, party: int | None = None) -> bytes:
    """A batch's secret (HPKE single-shot open of its header under ``info_v4``)."""
    try:
        secret = header.suite.hpke_suite.decrypt(header.sealed_secret, private_key,
                                                 info=info_v4(study_id, server_id, header.fixed(), party))
    except InvalidTag:
        raise SealError(f"sealed batch {header.batch_id.hex()}: its key does not open here (sealed "
                        f"for another server or study, or its header altered in transit)") from None
    if len(secret) != SECRET_BYTES:  # cannot happen: WRAPPED_BYTES fixes the length
        raise SealError(f"sealed batch {header.batch_id.hex()}: a batch secret is {SECRET_BYTES} bytes")
    return secret


def open_records(secret: bytes, transcript: bytes, records: bytes | memoryview, count: int, plaintext_len: int,
                 batch_id: bytes = b"") -> tuple[bytes, bytes]:
    """The concatenated report ids and plaintexts of a batch's ``count`` records (``records``:
    the body after its header), in one AEAD call. SealError if they do not open: a record moved
    from another batch, to another place or under another report id, one dropped or added, or
    bytes altered (one tag covers them all, so the batch is refused whole, not a record)."""
    view = memoryview(records)
    split = count * REPORT_ID_BYTES
    ids = bytes(view[:split])
    try:
        plain = ChaCha20Poly1305(record_key(secret, transcript)).decrypt(
            RECORDS_NONCE, view[split:split + count * plaintext_len + TAG_BYTES], records_aad(transcript, ids))
    except InvalidTag:
        raise SealError(f"sealed batch {batch_id.hex()}: its records do not open here (a record moved from "
                        f"another batch or place, dropped, added or under another report id, or bytes "
                        f"altered in transit)") from None
    return ids, plain


def _upload(ids: bytes, plain: bytes, content: int, width: int, n_servers: int, party: int | None = None):
    from .messages import IdList, Upload, split_ids

    m = len(ids) // REPORT_ID_BYTES
    rows = np.frombuffer(plain, dtype=np.uint8).reshape(m, -1)
    pseudonyms = None
    if content in BLOCK_CONTENTS:  # a block: its pseudonym first, then a share's (seed's) proof and payload
        pseudonyms = split_ids(rows[:, :REPORT_ID_BYTES].tobytes())
        rows = rows[:, REPORT_ID_BYTES:]
        content = CONTENT_SHARE if content == CONTENT_BLOCK else CONTENT_SEED
    proof_len = binding.proof_bytes(n_servers)
    proofs = np.ascontiguousarray(rows[:, :proof_len])
    payload = np.ascontiguousarray(rows[:, proof_len:])
    if content == CONTENT_SHARE:
        payload = payload.view("<u8").reshape(m, width).astype(np.uint64, copy=False)
    if pseudonyms is not None:
        return Upload(split_ids(ids), proofs, payload, content, pseudonyms, party)
    return Upload(IdList(ids), proofs, payload, content)


def open_batch(body: bytes, width: int, n_servers: int, study_id: str, server_id: str,
               private_key_for: Callable[[bytes], Any], party: int | None = None, *,
               header: BatchHeader | None = None, transcript: bytes | None = None):
    """Open a sealed body (one batch) into a ``messages.Upload`` (ids, proofs, payloads of one
    kind; not yet verified or expanded). ``private_key_for(key_id)`` is a loaded private key of
    either suite, or None. All or nothing: a body that does not parse raises
    MalformedSealedBatch before any key is used (a body of the dropped layouts 1 to 3 too;
    UnknownSuite for a suite not known here), a header or records that do not open SealError.
    ``party``: the index of the party whose blocks the batch must hold (``width`` its columns):
    the Upload carries their pseudonyms and the party, as a plaintext block batch's does.

    A server that judged the batch before opening it (its key id, its quota, a relayed entry's
    MAC) passes what it already computed: ``header``, :func:`parse_batch` of this same body with
    the same ``width``, ``n_servers`` and ``party``, and ``transcript``, :func:`transcript_v4`
    of its header for this study, server and party; then neither is computed again."""
    if header is None:
        header = parse_batch(body, width, n_servers, party)
    where = f"sealed batch {header.batch_id.hex()}"
    key = _key_of(private_key_for, header.key_id, header.suite, where)
    secret = open_secret(key, study_id, server_id, header, party)
    head = batch_header_bytes(header.suite)
    if transcript is None:
        transcript = transcript_v4(study_id, server_id, body[:head], party)
    ids, plain = open_records(secret, transcript, memoryview(body)[head:], header.count,
                              plaintext_bytes(header.content, width, n_servers), header.batch_id)
    return _upload(ids, plain, header.content, width, n_servers, party)


# --- one batch proof record (docs/sealing.md section 3b) --------------------------------------


def content_of(body: bytes) -> int | None:
    """The content byte of a body laid out as a version 4 batch (None if it is not one, or is
    shorter than the header's fixed part): what a server dispatches a sealed body on."""
    if not is_batch(body) or len(body) < FIXED_BYTES:
        return None
    return body[FIXED_BYTES - COUNT_BYTES - 1]


def seal_record(recipient: Recipient, study_id: str, clear_id: bytes, content: int, record: bytes) -> bytes:
    """A batch proof's record sealed as a version 4 batch of one record (docs/sealing.md section
    3b): ``content`` 0x05 (a leader's) or 0x06 (a helper's), ``clear_id`` the batch id, the
    plaintext the whole record. The same key schedule as every batch (:func:`_seal_v4`)."""
    if content not in RECORD_CONTENTS:
        raise ValueError(f"a batch proof's record is content 0x05 or 0x06, not 0x{content:02x}")
    if len(clear_id) != REPORT_ID_BYTES or not record:
        raise ValueError(f"a sealed batch record has a {REPORT_ID_BYTES}-byte id and a non-empty record")
    return _seal_v4(recipient, study_id, bytes(clear_id), content, bytes(record), len(record))


def parse_record(body: bytes, helper_bytes: int) -> BatchHeader:
    """The header of a sealed batch proof record, checked without decryption: the layout (as
    :func:`check_layout`), content 0x05 or 0x06, ``count`` 1, and the body's length: a helper's
    record (0x06) exactly ``helper_bytes``, a leader's any non-empty length (its m is sealed:
    ``batch_records.decode`` checks it after opening). MalformedSealedBatch, or UnknownSuite."""
    check_layout(body)
    if len(body) < FIXED_BYTES:
        raise MalformedSealedBatch(f"{len(body)} bytes: a sealed batch has a header of at least {FIXED_BYTES} bytes")
    at = BATCH_ID_BYTES + KEY_ID_BYTES + 2
    content = body[at + 6]
    if content not in RECORD_CONTENTS:
        raise MalformedSealedBatch(f"sealed batch record: content 0x{content:02x} is not a batch proof's "
                                   f"record (0x05 a leader's, 0x06 a helper's)")
    suite = suite_of(body[at:at + 6], "sealed batch record")
    count = int.from_bytes(body[at + 7:FIXED_BYTES], "big")
    if count != 1:
        raise MalformedSealedBatch(f"a sealed batch proof record (content 0x{content:02x}) is a batch of one "
                                   f"record; its count is {count}")
    head = batch_header_bytes(suite)
    plain = len(body) - head - REPORT_ID_BYTES - TAG_BYTES
    if content == CONTENT_PROOF_BATCH_SEED and plain != helper_bytes:
        raise MalformedSealedBatch(f"a version 4 {suite.name} sealed helper's batch record is "
                                   f"{head + REPORT_ID_BYTES + helper_bytes + TAG_BYTES} bytes, this body is "
                                   f"{len(body)} (truncated, padded or spliced)")
    if plain < 1:
        raise MalformedSealedBatch(f"a version 4 {suite.name} sealed batch record is more than "
                                   f"{head + REPORT_ID_BYTES + TAG_BYTES} bytes, this body is {len(body)}")
    if plain > MAX_BATCH_PLAINTEXT_BYTES:
        raise MalformedSealedBatch(f"a sealed batch seals at most {MAX_BATCH_PLAINTEXT_BYTES} bytes of plaintext")
    return BatchHeader(bytes(body[:BATCH_ID_BYTES]), bytes(body[BATCH_ID_BYTES:BATCH_ID_BYTES + KEY_ID_BYTES]),
                       suite, content, count, bytes(body[FIXED_BYTES:head]))


def record_clear_id(body: bytes, header: BatchHeader) -> bytes:
    """The clear id (the claimed batch id) of a parsed sealed batch record."""
    head = batch_header_bytes(header.suite)
    return bytes(body[head:head + REPORT_ID_BYTES])


def open_record(body: bytes, helper_bytes: int, study_id: str, server_id: str,
                private_key_for: Callable[[bytes], Any], *,
                header: BatchHeader | None = None) -> tuple[int, bytes, bytes]:
    """Open a sealed batch proof record: (content, clear id, record). Parsed by
    :func:`parse_record` first (MalformedSealedBatch before any key is used), then opened as any
    version 4 batch (:func:`open_secret`, :func:`open_records`; SealError if it does not open).
    A server that judged the record before (its key id, its quota) passes ``header``,
    :func:`parse_record` of this same body and ``helper_bytes``; then it is not parsed again."""
    if header is None:
        header = parse_record(body, helper_bytes)
    key = _key_of(private_key_for, header.key_id, header.suite, f"sealed batch {header.batch_id.hex()}")
    secret = open_secret(key, study_id, server_id, header)
    head = batch_header_bytes(header.suite)
    transcript = transcript_v4(study_id, server_id, body[:head])
    plain_len = len(body) - head - REPORT_ID_BYTES - TAG_BYTES
    ids, plain = open_records(secret, transcript, memoryview(body)[head:], 1, plain_len, header.batch_id)
    return header.content, ids, plain
