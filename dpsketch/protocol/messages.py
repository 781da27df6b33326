"""Wire formats shared by the SDK, the share servers and the analyzer (docs/protocol.md).

JSON bodies are pydantic models; bulk data travels as little-endian binary:

* a share batch (``application/x-dpsketch-shares``): m records of 16-byte report id followed by
  d little-endian uint64 share values, nothing else;
* a seed batch (``application/x-dpsketch-seeds``): m records of 16-byte report id followed by a
  32-byte seed that expands to the d-value share (``ring.expand_seed``), nothing else;
* a report-id list (``application/x-dpsketch-report-ids``): m 16-byte ids in ascending bytewise
  order, no repeats;
* an aggregate share (``application/x-dpsketch-aggregate``): k * d little-endian uint64, row-major;
* a sealed batch (``application/x-dpsketch-sealed``): m records, each a share or seed sealed to
  one server with HPKE (``envelope``: layout, context binding, seal and open).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from . import ring
from .sketch import REPORT_ID_BYTES
from .study import Study

SHARES_MEDIA_TYPE = "application/x-dpsketch-shares"
SEEDS_MEDIA_TYPE = "application/x-dpsketch-seeds"
REPORT_IDS_MEDIA_TYPE = "application/x-dpsketch-report-ids"
AGGREGATE_MEDIA_TYPE = "application/x-dpsketch-aggregate"
#: A batch of HPKE-sealed shares or seeds (dpsketch.protocol.envelope, docs/protocol.md 7a).
SEALED_MEDIA_TYPE = "application/x-dpsketch-sealed"
PROBLEM_MEDIA_TYPE = "application/problem+json"

#: Response header carrying the inclusion hash next to an aggregate share.
INCLUSION_HASH_HEADER = "X-Dpsketch-Inclusion-Hash"


def new_report_id() -> bytes:
    """A random 128-bit report id from the OS CSPRNG; the same id goes to every server."""
    return os.urandom(REPORT_ID_BYTES)


# --- binary formats --------------------------------------------------------------------------


def batch_dtype(d: int) -> np.dtype:
    return np.dtype([("id", f"V{REPORT_ID_BYTES}"), ("share", "<u8", (d,))])


def encode_batch(report_ids: np.ndarray | list[bytes], shares: np.ndarray) -> bytes:
    shares = np.asarray(shares, dtype=np.uint64)
    records = np.empty(len(shares), dtype=batch_dtype(shares.shape[1]))
    records["id"] = np.frombuffer(b"".join(report_ids), dtype=f"V{REPORT_ID_BYTES}") if isinstance(
        report_ids, list
    ) else report_ids
    records["share"] = shares
    return records.tobytes()


def decode_batch(body: bytes, d: int) -> tuple[list[bytes], np.ndarray]:
    """Split a batch body into report ids and an (m, d) uint64 share matrix; ValueError if malformed."""
    record = REPORT_ID_BYTES + 8 * d
    if len(body) == 0 or len(body) % record:
        raise ValueError(
            f"a share batch is a whole number of {record}-byte records (16-byte id + {d} x 8 bytes); "
            f"got {len(body)} bytes"
        )
    records = np.frombuffer(body, dtype=batch_dtype(d))
    raw = records["id"].tobytes()
    ids = [raw[i : i + REPORT_ID_BYTES] for i in range(0, len(raw), REPORT_ID_BYTES)]
    return ids, np.ascontiguousarray(records["share"])


SEED_RECORD_BYTES = REPORT_ID_BYTES + 32


def encode_seed_batch(report_ids: np.ndarray | list[bytes], seeds: np.ndarray) -> bytes:
    """An ``application/x-dpsketch-seeds`` body: per report its 16-byte id, then its 32-byte seed."""
    seeds = np.asarray(seeds, dtype=np.uint8).reshape(-1, 32)
    ids = b"".join(report_ids) if isinstance(report_ids, list) else np.asarray(report_ids).tobytes()
    if len(ids) != REPORT_ID_BYTES * len(seeds):
        raise ValueError("one report id per seed")
    records = np.empty((len(seeds), SEED_RECORD_BYTES), dtype=np.uint8)
    records[:, :REPORT_ID_BYTES] = np.frombuffer(ids, dtype=np.uint8).reshape(-1, REPORT_ID_BYTES)
    records[:, REPORT_ID_BYTES:] = seeds
    return records.tobytes()


def decode_seed_batch(body: bytes) -> tuple[list[bytes], np.ndarray]:
    """Split a seed batch into report ids and an (m, 32) uint8 seed matrix; ValueError if malformed."""
    if len(body) == 0 or len(body) % SEED_RECORD_BYTES:
        raise ValueError(
            f"a seed batch is a whole number of {SEED_RECORD_BYTES}-byte records (16-byte id + "
            f"32-byte seed); got {len(body)} bytes"
        )
    records = np.frombuffer(body, dtype=np.uint8).reshape(-1, SEED_RECORD_BYTES)
    raw = records[:, :REPORT_ID_BYTES].tobytes()
    ids = [raw[i : i + REPORT_ID_BYTES] for i in range(0, len(raw), REPORT_ID_BYTES)]
    return ids, np.ascontiguousarray(records[:, REPORT_ID_BYTES:])


def decode_upload(body: bytes, media_type: str, d: int) -> tuple[list[bytes], np.ndarray]:
    """Report ids and the (m, d) uint64 shares of a batch body of either media type (a seed
    batch is expanded, ``ring.expand_seeds``); ValueError if malformed or of another type."""
    if media_type == SEEDS_MEDIA_TYPE:
        ids, seeds = decode_seed_batch(body)
        return ids, ring.expand_seeds(seeds, d)
    if media_type == SHARES_MEDIA_TYPE:
        return decode_batch(body, d)
    raise ValueError(f"not a batch media type: {media_type!r}")


def encode_report_ids(report_ids: list[bytes]) -> bytes:
    return b"".join(sorted(set(report_ids)))


def decode_report_ids(body: bytes) -> list[bytes]:
    """Parse a sorted, repeat-free id list; ValueError if malformed."""
    if len(body) % REPORT_ID_BYTES:
        raise ValueError(f"a report-id list is a whole number of {REPORT_ID_BYTES}-byte ids")
    if len(body) > REPORT_ID_BYTES:
        # bytewise order of 16-byte ids = lexicographic order of their two big-endian halves
        halves = np.frombuffer(body, dtype=">u8").reshape(-1, 2)
        hi, lo = halves[:, 0], halves[:, 1]
        ascending = (hi[1:] > hi[:-1]) | ((hi[1:] == hi[:-1]) & (lo[1:] > lo[:-1]))
        if not ascending.all():
            raise ValueError("report ids must be in strictly ascending bytewise order")
    return [body[i : i + REPORT_ID_BYTES] for i in range(0, len(body), REPORT_ID_BYTES)]


def inclusion_hash(sorted_ids: list[bytes]) -> str:
    """SHA-256 over the concatenated sorted ids: names an inclusion set in one line."""
    h = hashlib.sha256()
    for rid in sorted_ids:
        h.update(rid)
    return h.hexdigest()


def encode_aggregate(aggregate: np.ndarray) -> bytes:
    return np.ascontiguousarray(aggregate, dtype="<u8").tobytes()


def decode_aggregate(body: bytes, k: int, d: int) -> np.ndarray:
    if len(body) != 8 * k * d:
        raise ValueError(f"an aggregate share is {8 * k * d} bytes, got {len(body)}")
    return np.frombuffer(body, dtype="<u8").reshape(k, d).copy()


# --- JSON messages ---------------------------------------------------------------------------

HEX_ID = re.compile(r"^[0-9a-f]{32}$")


class Report(BaseModel):
    """One report's share for one server (the single-upload body)."""

    model_config = ConfigDict(extra="forbid")
    report_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="16 random bytes, lower-case hex")
    share: str = Field(description="d little-endian uint64 values, standard base64")

    @field_validator("share")
    @classmethod
    def _b64(cls, v: str) -> str:
        try:
            base64.b64decode(v, validate=True)
        except ValueError as exc:
            raise ValueError("share must be standard base64") from exc
        return v

    def share_values(self, d: int) -> np.ndarray:
        raw = base64.b64decode(self.share)
        if len(raw) != 8 * d:
            raise ValueError(f"share must be {8 * d} bytes ({d} uint64 values), got {len(raw)}")
        return np.frombuffer(raw, dtype="<u8").copy()

    @classmethod
    def of(cls, report_id: bytes, share: np.ndarray) -> "Report":
        return cls(
            report_id=report_id.hex(),
            share=base64.b64encode(np.asarray(share, dtype="<u8").tobytes()).decode(),
        )


class UploadResult(BaseModel):
    accepted: int = Field(description="reports newly stored by this request")
    duplicates: int = Field(description="reports already held with identical bytes (not recounted)")
    report_count: int = Field(description="reports this server now holds for the study")


class CommitResult(BaseModel):
    """The certificate a server checked and the inclusion set it committed to."""

    inclusion_hash: str
    n_reports: int
    lambda_min: float
    lambda_star: float
    t: int
    margin: float = Field(description="lambda_min - t - lambda_star; >= 0 for a release")


StudyStatus = Literal["open", "committed"]


class StudyInfo(BaseModel):
    """What a server says about a study it holds: the parameters and its progress."""

    study_id: str
    server_id: str
    status: StudyStatus
    report_count: int
    study: Study
    commit: CommitResult | None = None
    hpke: "HpkeKeys | None" = Field(default=None, description="the server's HPKE keys for sealing "
                                    "shares of this study (the same as in /v1/info)")


class HpkeKey(BaseModel):
    """One of a server's HPKE public keys (X25519, raw 32 bytes as hex)."""

    key_id: str = Field(pattern=r"^[0-9a-f]{16}$", description="hex SHA-256(public_key)[:8]")
    public_key: str = Field(pattern=r"^[0-9a-f]{64}$", description="raw X25519 public key, hex")
    created_at: float
    superseded_at: float | None = Field(default=None, description="when a newer key became "
                                        "current; null for the current key")


class HpkeKeys(BaseModel):
    """A server's HPKE configuration: the suite (RFC 9180 ids), its current key (seal to this
    one) and every key it still opens shares with."""

    kem_id: int
    kdf_id: int
    aead_id: int
    suite: str
    current: str = Field(pattern=r"^[0-9a-f]{16}$", description="key_id of the key to seal to")
    keys: list[HpkeKey]


class ServerInfo(BaseModel):
    server_id: str
    protocol: str
    version: str
    #: The server's privacy and retention policy (services/policy.py); optional, servers that
    #: do not publish one leave it out.
    policy: dict[str, float | int | None] | None = None
    #: The server's HPKE public keys for sealed shares (section 7a); optional.
    hpke: HpkeKeys | None = None


class UploadToken(BaseModel):
    """An upload token as listed: never the token, only its id (hex SHA-256(token)[:8])."""

    token_id: str
    created_at: float
    revoked_at: float | None = None


class UploadTokenList(BaseModel):
    study_id: str
    #: True once the study was given any upload token: uploads need a valid (unrevoked) one,
    #: even after every token was revoked.
    required: bool
    active: int
    tokens: list[UploadToken]


class Problem(BaseModel):
    """RFC 9457 problem details: every 4xx/5xx body of every dpsketch service."""

    type: str = Field(description="urn:dpsketch:problem:<slug>, stable, documented")
    title: str
    status: int
    detail: str
    instance: str | None = None


StudyInfo.model_rebuild()
