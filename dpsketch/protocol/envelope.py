"""Sealed shares: each share encrypted to its server with HPKE (docs/protocol.md section 7a,
docs/sealing.md).

A client seals the plaintext of one report for one server (its d-value share, or the 32-byte
seed of a seed-compressed share) with HPKE base mode (RFC 9180) to that server's current public
key of one of two suites:

* ``classical``: DHKEM(X25519, HKDF-SHA256) / HKDF-SHA256 / ChaCha20-Poly1305 (KEM 0x0020), the
  suite since the start, and the default;
* ``post-quantum`` (opt-in): the hybrid KEM MLKEM768-X25519 (KEM 0x647a, X-Wing,
  draft-ietf-hpke-pq) / HKDF-SHA256 / ChaCha20-Poly1305. A recording of today's sealed shares
  stays closed to a future quantum computer as long as ML-KEM-768 holds, and to a classical one
  as long as either ML-KEM-768 or X25519 holds. Only the KEM differs: HKDF-SHA256 and
  ChaCha20-Poly1305 (256-bit keys) keep a 128-bit margin against Grover's search.

The study id, the server id, the report id and the kind of plaintext are bound into the HPKE
``info`` (the key schedule), so a sealed share opens only at the server it was sealed for, only
for that study and only under that report id: a misrouted, replayed-elsewhere or tampered share
is useless. Version 2 records also bind their key id, their format version and their suite.
This lets shares travel through one untrusted gateway, or be stored by one.

Why ``info`` and not the AEAD's associated data: the single-shot API of the ``cryptography``
package (``hpke.Suite.encrypt``) takes no AAD, only ``info``; ``info`` enters the key schedule,
so a different context derives a different key and nonce and the AEAD tag fails exactly as a
wrong AAD would. The context is hashed to keep ``info`` at 49 bytes, under the 64 bytes every
RFC 9180 implementation must accept.

Records (``application/x-dpsketch-sealed``, a body is m >= 1 of them back to back, all of one
kind, version and suite). Version 1 (classical suite only; what clients sealing classically
send, unchanged since the first release)::

    report_id (16) | key_id (8) | content (1) | enc (32) | ciphertext (len(plaintext) + 16)

Version 2 (any suite; byte 24 has bit 7 set, which no version 1 record has, so both versions
share the media type and a server before version 2 refuses it as an unknown kind)::

    report_id (16) | key_id (8) | 0x80 (1) | version (1) = 0x02 | kem_id (2) | kdf_id (2)
      | aead_id (2) | content (1) | enc (Nenc: 32 classical, 1120 post-quantum) | ciphertext

(the ids big-endian, as in RFC 9180). The plaintext is the report's proof for this server (16 N
bytes: its salt and the other servers' commitments, ``binding``) followed by the payload:
``content`` is 0x01 for a share (8 * width bytes, the share's little-endian uint64) or 0x02 for
a seed (32 bytes, expanded as in section 4). The salt is inside the ciphertext on purpose: a
relay that saw it could test guesses of the row against the commitment together with colluding
servers. ``key_id`` is the first 8 bytes of SHA-256 of the server's raw public key (32 bytes
X25519; 1216 bytes ML-KEM-768 || X25519 for the hybrid). ``info`` of version 1 is the 17 ASCII
bytes ``dpsketch/sealed/1`` followed by SHA-256 of
``study_id (32 raw bytes) || report_id (16) || content (1) || len(server_id) (1) || server_id``;
of version 2 it is ``dpsketch/sealed/2`` followed by SHA-256 of the same bytes then
``key_id (8) || version (1) || kem_id (2) || kdf_id (2) || aead_id (2)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hpke, serialization
from cryptography.hazmat.primitives.asymmetric import mlkem, x25519

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

INFO_LABEL = b"dpsketch/sealed/1"
INFO_LABEL_V2 = b"dpsketch/sealed/2"
VERSION_1, VERSION_2 = 1, 2
#: Bit 7 of byte 24 marks a record with a version and a suite in its header (version >= 2).
EXTENDED = 0x80
KEY_ID_BYTES = 8
PUBLIC_KEY_BYTES = 32
ENC_BYTES = 32
TAG_BYTES = 16
HEADER_BYTES = REPORT_ID_BYTES + KEY_ID_BYTES + 1 + ENC_BYTES  # 57
#: Bytes a sealed record adds to the plaintext record (16-byte id + proof + payload): 57.
OVERHEAD_BYTES = HEADER_BYTES - REPORT_ID_BYTES + TAG_BYTES
#: A version 2 record's header before ``enc``: id, key id, 0x80, version, 3 suite ids, content.
V2_FIXED_BYTES = REPORT_ID_BYTES + KEY_ID_BYTES + 1 + 1 + 1 + 6  # 33

SEED_BYTES = 32
MLKEM_SEED_BYTES = 64
MLKEM_PUBLIC_BYTES = 1184


class SealError(ValueError):
    """A sealed record that does not open: unknown key id, or failed authentication (wrong
    server, study, report id or kind, or tampered bytes)."""


class UnknownSuite(SealError):
    """A version 2 record naming a suite this code does not seal or open."""


class MalformedSealedBatch(ValueError):
    """A body that is not a whole sequence of well-formed sealed records."""


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


def _context(study_id: str, server_id: str, report_id: bytes, content: int) -> bytes:
    study = bytes.fromhex(study_id)
    if len(study) != 32:
        raise ValueError("a study id is 64 hex characters")
    if len(report_id) != REPORT_ID_BYTES:
        raise ValueError(f"a report id is {REPORT_ID_BYTES} bytes")
    sid = server_id.encode("ascii")
    if not 0 < len(sid) < 256:
        raise ValueError("a server id is 1..255 ASCII characters")
    return study + report_id + bytes([content, len(sid)]) + sid


def info(study_id: str, server_id: str, report_id: bytes, content: int) -> bytes:
    """The HPKE ``info`` of one version 1 sealed share (see the module docstring)."""
    return INFO_LABEL + hashlib.sha256(_context(study_id, server_id, report_id, content)).digest()


def info_v2(study_id: str, server_id: str, report_id: bytes, content: int, kid: bytes,
            suite: SealingSuite) -> bytes:
    """The HPKE ``info`` of one version 2 sealed share: version 1's context, then the record's key
    id, version and suite (so no header byte can change without the tag failing)."""
    if len(kid) != KEY_ID_BYTES:
        raise ValueError(f"a key id is {KEY_ID_BYTES} bytes")
    context = _context(study_id, server_id, report_id, content) + kid + bytes([VERSION_2]) + suite.ids
    return INFO_LABEL_V2 + hashlib.sha256(context).digest()


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


def header_bytes(suite: SealingSuite = CLASSICAL, version: int = VERSION_1) -> int:
    """Bytes of a record before its AEAD ciphertext (the report id and ``enc`` included)."""
    if version == VERSION_1:
        if suite is not CLASSICAL:
            raise ValueError("version 1 records are classical; seal other suites as version 2")
        return HEADER_BYTES
    if version == VERSION_2:
        return V2_FIXED_BYTES + suite.enc_bytes
    raise ValueError(f"unknown sealed record version {version}")


def overhead_bytes(suite: SealingSuite = CLASSICAL, version: int | None = None) -> int:
    """Bytes a sealed record adds to the plaintext record: 57 (classical, version 1), 65
    (classical, version 2), 1153 (post-quantum)."""
    version = default_version(suite) if version is None else version
    return header_bytes(suite, version) - REPORT_ID_BYTES + TAG_BYTES


def record_bytes(content: int, width: int, n_servers: int, suite: SealingSuite = CLASSICAL,
                 version: int = VERSION_1) -> int:
    return header_bytes(suite, version) + plaintext_bytes(content, width, n_servers) + TAG_BYTES


def default_version(suite: SealingSuite) -> int:
    """Classical shares keep the version 1 layout (any server opens them); other suites need 2."""
    return VERSION_1 if suite is CLASSICAL else VERSION_2


# --- seal ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipient:
    """Where a share is sealed to: a server's id and its current public key (raw bytes) of
    ``suite``."""

    server_id: str
    public_key: bytes
    suite: SealingSuite = CLASSICAL

    @property
    def key_id(self) -> bytes:
        return key_id(self.public_key)


def _sealer(recipient: Recipient, study_id: str, content: int, version: int | None):
    """A function report_id, plaintext -> sealed record, for one recipient, kind and version."""
    suite = recipient.suite
    version = default_version(suite) if version is None else version
    header_bytes(suite, version)  # refuses a version 1 post-quantum record
    pk = suite.load_public_key(recipient.public_key)
    kid = recipient.key_id
    sid = recipient.server_id
    encrypt = suite.hpke_suite.encrypt
    if version == VERSION_1:
        head = kid + bytes([content])
        return lambda rid, pt: rid + head + encrypt(bytes(pt), pk, info=info(study_id, sid, rid, content))
    head = kid + bytes([EXTENDED, VERSION_2]) + suite.ids + bytes([content])
    return lambda rid, pt: rid + head + encrypt(
        bytes(pt), pk, info=info_v2(study_id, sid, rid, content, kid, suite))


def seal(recipient: Recipient, study_id: str, report_id: bytes, content: int, plaintext: bytes,
         version: int | None = None) -> bytes:
    """One sealed record (version 1 for the classical suite unless ``version`` says 2)."""
    return _sealer(recipient, study_id, content, version)(report_id, plaintext)


def seal_batch(recipient: Recipient, study_id: str, report_ids: Sequence[bytes], content: int,
               plaintexts: Sequence[bytes], version: int | None = None) -> bytes:
    """A sealed body: one record per report id, ``plaintexts[i]`` (its proof and payload) sealed
    under ``report_ids[i]``."""
    if len(report_ids) != len(plaintexts):
        raise ValueError("one plaintext per report id")
    one = _sealer(recipient, study_id, content, version)
    out = bytearray()
    for rid, pt in zip(report_ids, plaintexts):
        out += one(rid, pt)
    return bytes(out)


def seal_body(recipient: Recipient, study_id: str, body: bytes, media_type: str, width: int,
              n_servers: int, version: int | None = None) -> bytes:
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
    return seal_batch(recipient, study_id, ids, content, plaintexts, version)


# --- parse and open --------------------------------------------------------------------------


@dataclass
class SealedRecord:
    report_id: bytes
    key_id: bytes
    content: int
    ciphertext: bytes  # enc || AEAD ciphertext
    version: int = VERSION_1
    suite: SealingSuite = CLASSICAL


def _header(body: bytes, pos: int, index: int) -> tuple[int, int, SealingSuite]:
    """(content, version, suite) of the record at ``pos``."""
    kind = body[pos + REPORT_ID_BYTES + KEY_ID_BYTES]
    if not kind & EXTENDED:
        return kind, VERSION_1, CLASSICAL
    if len(body) - pos < V2_FIXED_BYTES:
        raise MalformedSealedBatch(f"record {index}: {len(body) - pos} bytes left, a version 2 "
                                   f"sealed record has a {V2_FIXED_BYTES}-byte header before enc")
    at = pos + REPORT_ID_BYTES + KEY_ID_BYTES + 1
    version, ids, content = body[at], body[at + 1:at + 7], body[at + 7]
    if kind != EXTENDED:
        raise MalformedSealedBatch(f"record {index}: unknown content kind 0x{kind:02x} (0x01 share, "
                                   f"0x02 seed; 0x80 marks a versioned record)")
    if version != VERSION_2:
        raise MalformedSealedBatch(f"record {index}: sealed record version {version} is unknown here "
                                   f"(this server reads versions 1 and 2)")
    if content not in (CONTENT_SHARE, CONTENT_SEED):
        raise MalformedSealedBatch(f"record {index}: unknown content kind 0x{content:02x} (0x01 share, "
                                   f"0x02 seed)")
    suite = _BY_IDS.get(ids)
    if suite is None:
        kem, kdf, aead = (int.from_bytes(ids[i:i + 2], "big") for i in (0, 2, 4))
        known = "; ".join(f"{s.name}: kem 0x{s.kem_id:04x}, kdf 0x{s.kdf_id:04x}, aead 0x{s.aead_id:04x}"
                          for s in SUITES.values())
        raise UnknownSuite(f"record {index}: HPKE suite (kem 0x{kem:04x}, kdf 0x{kdf:04x}, aead "
                           f"0x{aead:04x}) is not one this server opens ({known})")
    return content, version, suite


def parse(body: bytes, width: int, n_servers: int) -> list[SealedRecord]:
    """Split a sealed body into records (no decryption); MalformedSealedBatch if it is empty,
    names an unknown content kind or version, mixes kinds, versions or suites, or does not end on
    a record boundary; UnknownSuite for a version 2 record of a suite not known here."""
    if not body:
        raise MalformedSealedBatch("a sealed batch holds at least one record")
    out: list[SealedRecord] = []
    pos, n = 0, len(body)
    while pos < n:
        if n - pos < HEADER_BYTES:
            raise MalformedSealedBatch(f"record {len(out)}: {n - pos} bytes left, a sealed record "
                                       f"has a header of at least {HEADER_BYTES} bytes")
        content, version, suite = _header(body, pos, len(out))
        if out and (content, version, suite) != (out[0].content, out[0].version, out[0].suite):
            raise MalformedSealedBatch(f"record {len(out)}: a sealed batch holds records of one kind "
                                       f"(shares or seeds), one version and one suite, not several")
        size = record_bytes(content, width, n_servers, suite, version)
        if n - pos < size:
            raise MalformedSealedBatch(f"record {len(out)}: {n - pos} bytes left, a version {version} "
                                       f"{suite.name} sealed record of kind 0x{content:02x} at width "
                                       f"{width} is {size} bytes")
        rid = body[pos:pos + REPORT_ID_BYTES]
        kid = body[pos + REPORT_ID_BYTES:pos + REPORT_ID_BYTES + KEY_ID_BYTES]
        enc_at = pos + header_bytes(suite, version) - suite.enc_bytes
        out.append(SealedRecord(rid, kid, content, body[enc_at:pos + size], version, suite))
        pos += size
    return out


def count_records(body: bytes, width: int, n_servers: int) -> int:
    return len(parse(body, width, n_servers))


def split_body(body: bytes, width: int, n_servers: int) -> tuple[bytes, bytes]:
    """Cut a sealed body into two at the record boundary nearest its middle record."""
    records = parse(body, width, n_servers)
    half = len(records) // 2
    cut = sum(record_bytes(r.content, width, n_servers, r.suite, r.version) for r in records[:half])
    return body[:cut], body[cut:]


def open_record(private_key, study_id: str, server_id: str, record: SealedRecord) -> bytes:
    """The plaintext of one record, opened with the private key its key id names (a loaded key
    of the record's suite; a key of another suite is refused, never tried)."""
    suite = record.suite
    if not suite.owns(private_key):
        raise SealError(f"report {record.report_id.hex()}: key id {record.key_id.hex()} names a key "
                        f"of another suite than the record's ({suite.name}); fetch /v1/info and seal again")
    if record.version == VERSION_1:
        context = info(study_id, server_id, record.report_id, record.content)
    else:
        context = info_v2(study_id, server_id, record.report_id, record.content, record.key_id, suite)
    try:
        return suite.hpke_suite.decrypt(record.ciphertext, private_key, info=context)
    except InvalidTag:
        raise SealError(
            f"report {record.report_id.hex()}: the sealed share does not open here (sealed for "
            f"another server, study or report id, or altered in transit)") from None


def open_batch(body: bytes, width: int, n_servers: int, study_id: str, server_id: str,
               private_key_for: Callable[[bytes], Any]):
    """Open every record of a sealed body into a ``messages.Upload`` (ids, proofs, payloads of
    one kind; not yet verified or expanded). ``private_key_for(key_id)`` is a loaded private key
    of either suite, or None. All or nothing: the first record that does not parse raises
    MalformedSealedBatch (UnknownSuite for a suite not known here), the first that does not open
    raises SealError."""
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
