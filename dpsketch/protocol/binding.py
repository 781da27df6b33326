"""Binding the N shares of a report together: a report is all or nothing (docs/protocol.md 4a).

Why. A report id travels in clear, and anyone can seal a share to a server's public key. Without
a binding, a relay that delivers a junk share under a victim's report id to one server first
makes the client's genuine share a conflict there, while every server holds the id, so the report
is included with a junk share: one relay could corrupt the release without bound.

How. Each report's id *is* a commitment to all of its N shares:

    c_j       = SHA-256("dpsketch/commit/2" || j || content_j || salt_j || payload_j)[:16]
    report_id = SHA-256("dpsketch/report/2" || study_id (32 raw bytes) || c_1 || ... || c_N)[:16]

where payload_j is what server j receives (its share, 8 * width bytes, or its 32-byte seed,
``content_j`` saying which) and salt_j 16 fresh random bytes. Server j receives its payload with
a **proof**: salt_j followed by the other servers' commitments c_i (i != j, in server order),
16 * N bytes. It recomputes c_j, then the id, and refuses the record unless that is the id it
came with. So server j accepts under a report id only the one payload the id commits to: a
substituted share needs a second preimage of SHA-256 (truncated to 128 bits), and a relay can
only drop a share (the report is then excluded everywhere, as any partial report is) or replace
the whole report with one of its own under a new id, which is no more than a malicious client
can do. The salt keeps c_j hiding: colluding servers that know every other share cannot test
guesses of the row against c_j. The study id in the report id means a report cannot be replayed
into another study.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import numpy as np

from . import kernels
from .keystream import Keystream

from .sketch import REPORT_ID_BYTES

COMMIT_DOMAIN = b"dpsketch/commit/2"
REPORT_DOMAIN = b"dpsketch/report/2"
#: A party's block (parties.py): its id also commits to the party and the individual's pseudonym.
BLOCK_DOMAIN = b"dpsketch/block/2"
SALT_BYTES = 16
COMMITMENT_BYTES = 16
#: What a payload is (part of the commitment, and the kind byte of a sealed record).
CONTENT_SHARE = 0x01
CONTENT_SEED = 0x02


class BindingError(ValueError):
    """A record whose payload is not the one its report id commits to."""


def proof_bytes(n_servers: int) -> int:
    """Length of one server's proof: its salt and the other N - 1 commitments."""
    return SALT_BYTES + (n_servers - 1) * COMMITMENT_BYTES


def commitment(position: int, content: int, salt: bytes, payload: bytes) -> bytes:
    """c_j of the payload for server ``position`` (0-based, the study's server order)."""
    if not 0 <= position < 256:
        raise ValueError("a server position is 0..255")
    return hashlib.sha256(COMMIT_DOMAIN + bytes((position, content)) + salt + payload).digest()[:COMMITMENT_BYTES]


def report_id(study_id: str, commitments: Sequence[bytes]) -> bytes:
    """The report id: a commitment to every share of the report, in server order."""
    study = bytes.fromhex(study_id)
    if len(study) != 32:
        raise ValueError("a study id is 64 hex characters")
    return hashlib.sha256(REPORT_DOMAIN + study + b"".join(commitments)).digest()[:REPORT_ID_BYTES]


def block_prefixes(study_id: str, party: int, pseudonyms: Sequence[bytes]) -> list[bytes]:
    """What a block's id hashes before the commitments: the block domain, the study id, the
    party's index (one byte) and the individual's 16-byte pseudonym (docs/protocol.md 4a)."""
    study = bytes.fromhex(study_id)
    if len(study) != 32 or not 0 <= party < 256:
        raise ValueError("a study id is 64 hex characters and a party index 0..255")
    head = BLOCK_DOMAIN + study + bytes((party,))
    out = []
    for p in pseudonyms:
        if len(p) != REPORT_ID_BYTES:
            raise ValueError(f"a pseudonym is {REPORT_ID_BYTES} bytes")
        out.append(head + bytes(p))
    return out


def _prefixes(study_id: str, m: int, prefixes: Sequence[bytes] | None) -> Sequence[bytes]:
    if prefixes is None:
        return [REPORT_DOMAIN + bytes.fromhex(study_id)] * m
    if len(prefixes) != m:
        raise ValueError(f"{len(prefixes)} id prefixes for {m} records")
    return prefixes


def bind(study_id: str, contents: Sequence[int], payloads: Sequence[np.ndarray],
         prefixes: Sequence[bytes] | None = None,
         stream: Keystream | None = None) -> tuple[list[bytes], list[np.ndarray]]:
    """Report ids and, per server j, the (m, 16 N) uint8 proofs for m reports whose payload for
    server j is row i of ``payloads[j]`` (a uint64 share matrix or a uint8 seed matrix) of kind
    ``contents[j]``. Salts come from the batch's keystream (a fresh one if none is given). ``prefixes`` (one per record, from
    :func:`block_prefixes`) makes block ids instead of report ids."""
    n = len(payloads)
    m = len(payloads[0])
    salts = (stream or Keystream()).array(SALT_BYTES * n * m).reshape(n, m, SALT_BYTES)
    # each hash input is laid out as one row of a contiguous matrix (numpy fills the columns), so
    # the per-report Python work is one slice, one hash and one digest
    tables = []
    for j in range(n):
        head = COMMIT_DOMAIN + bytes((j, contents[j]))
        digests = hash_rows(m, [head, salts[j], _payload_matrix(payloads[j])])
        tables.append(digests[:, :COMMITMENT_BYTES])
    commitments = np.concatenate(tables, axis=1)
    flat = hash_rows(m, [_id_head(study_id, m, prefixes), commitments])[:, :REPORT_ID_BYTES].tobytes()
    ids = [flat[i:i + REPORT_ID_BYTES] for i in range(0, m * REPORT_ID_BYTES, REPORT_ID_BYTES)]
    proofs = [np.concatenate([salts[j]] + [tables[o] for o in range(n) if o != j], axis=1)
              for j in range(n)]
    return ids, proofs


def _id_head(study_id: str, m: int, prefixes: Sequence[bytes] | None):
    """What each id hashes before the commitments, as a :func:`hash_rows` part: the report
    domain and study id (the same bytes for every record), or one block prefix per record."""
    heads = _prefixes(study_id, m, prefixes)
    if prefixes is None:
        return heads[0] if m else b""
    joined = b"".join(heads)  # block ids: a 50-byte prefix per record (block_prefixes)
    if len(joined) != m * len(heads[0]):
        raise ValueError("id prefixes must all have the same length")
    return np.frombuffer(joined, dtype=np.uint8).reshape(m, len(heads[0]))


def hash_rows(m: int, parts: list) -> np.ndarray:
    """SHA-256 of each of m messages part_1[i] || part_2[i] || ..., as an (m, 32) uint8 matrix;
    a ``bytes`` part is the same for every message, an (m, w) uint8 matrix gives row i."""
    if m == 0:
        return np.empty((0, 32), dtype=np.uint8)
    cols = [np.frombuffer(p, dtype=np.uint8) if isinstance(p, bytes) else p for p in parts]
    width = sum(c.shape[-1] for c in cols)
    buf = np.empty((m, width), dtype=np.uint8)
    at = 0
    for c in cols:
        buf[:, at:at + c.shape[-1]] = c
        at += c.shape[-1]
    compiled = _compiled_rows(m)
    if compiled is not None:
        out = np.empty((m, 32), dtype=np.uint8)
        if compiled(buf, out) == 0:
            return out
    view = buf.data.cast("B")  # memoryview(buf)
    sha = hashlib.sha256
    digests = b"".join([sha(view[i:i + width]).digest() for i in range(0, m * width, width)])
    return np.frombuffer(digests, dtype=np.uint8).reshape(m, 32)


def _compiled_rows(m: int):
    """The compiled SHA-256 row loop for a batch of ``m`` records, or None for hashlib (kernels.py:
    loaded from kernels.MIN_ROWS records, as the sketch's own loops, so a process that only
    ever checks small batches never imports numba)."""
    return kernels.SHA256.for_rows(m)


def warm_up() -> bool:
    """Load the compiled SHA-256 row loop now (numba's import and a compile, about a second);
    whether it is available. A server does it with the sketch's loops when it opens a large
    study; until it is loaded, batches under kernels.MIN_ROWS rows hash with hashlib."""
    return kernels.SHA256.warm_up()


def bind_for_server(study_id: str, n_servers: int, position: int, content: int,
                    payloads: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """Report ids and (m, 16 N) proofs for payloads as ONE server receives them, with random
    commitments standing in for the other servers': what a load generator or a test needs to
    drive one server (it cannot tell them from a client's; nothing else would ever accept them)."""
    raw, step = payload_bytes(payloads)
    m = len(payloads)
    sha = hashlib.sha256
    salts = os.urandom(SALT_BYTES * m)
    others = os.urandom(COMMITMENT_BYTES * (n_servers - 1) * m)
    width = COMMITMENT_BYTES * (n_servers - 1)
    cut = position * COMMITMENT_BYTES
    head = COMMIT_DOMAIN + bytes((position, content))
    prefix = REPORT_DOMAIN + bytes.fromhex(study_id)
    ids = []
    for i in range(m):
        salt = salts[i * SALT_BYTES:(i + 1) * SALT_BYTES]
        rest = others[i * width:(i + 1) * width]
        own = sha(head + salt + raw[i * step:(i + 1) * step]).digest()[:COMMITMENT_BYTES]
        ids.append(sha(prefix + rest[:cut] + own + rest[cut:]).digest()[:REPORT_ID_BYTES])
    proofs = np.concatenate([np.frombuffer(salts, dtype=np.uint8).reshape(m, SALT_BYTES),
                             np.frombuffer(others, dtype=np.uint8).reshape(m, width)], axis=1)
    return ids, proofs


def verify(study_id: str, n_servers: int, position: int, content: int, report_ids: Sequence[bytes],
           proofs: np.ndarray, payloads: np.ndarray, prefixes: Sequence[bytes] | None = None,
           joined: bytes | None = None) -> None:
    """Raise BindingError unless every record's payload is the one its report id commits to at
    server ``position``; ``proofs`` is (m, 16 N) uint8, ``payloads`` the (m, ...) payload rows,
    ``prefixes`` as for :func:`bind` (blocks); ``joined``: the ids concatenated, if the caller
    has them so."""
    size = proof_bytes(n_servers)
    m = len(report_ids)
    cut = SALT_BYTES + position * COMMITMENT_BYTES
    if m == 1 and prefixes is None:  # a single upload: the same two hashes over bytes, 10x faster
        proof = np.ascontiguousarray(proofs, dtype=np.uint8).tobytes()
        if len(proof) == size:
            sha = hashlib.sha256
            own = sha(COMMIT_DOMAIN + bytes((position, content)) + proof[:SALT_BYTES]
                      + payload_bytes(payloads)[0]).digest()[:COMMITMENT_BYTES]
            rid = sha(REPORT_DOMAIN + bytes.fromhex(study_id) + proof[SALT_BYTES:cut] + own
                      + proof[cut:]).digest()[:REPORT_ID_BYTES]
            if rid != report_ids[0]:
                _refuse(report_ids, 0)
            return
    wrong = unbound(study_id, n_servers, position, content, report_ids, proofs, payloads, prefixes, joined)
    if wrong.size:
        _refuse(report_ids, int(wrong[0]))


def unbound(study_id: str, n_servers: int, position: int, content: int, report_ids: Sequence[bytes],
            proofs: np.ndarray, payloads: np.ndarray, prefixes: Sequence[bytes] | None = None,
            joined: bytes | None = None) -> np.ndarray:
    """The indices (ascending) of the records whose payload is not the one their report id commits
    to at server ``position``; empty when every record is bound. Arguments as for :func:`verify`,
    which refuses a whole upload for the first of them; a server checking many single reports at
    once (services/writer.py) refuses only those."""
    size = proof_bytes(n_servers)
    m = len(report_ids)
    cut = SALT_BYTES + position * COMMITMENT_BYTES
    proofs = np.asarray(proofs, dtype=np.uint8).reshape(m, size)
    compiled = _compiled_rows(m)
    if joined is None:
        joined = b"".join(report_ids)
    if compiled is not None and prefixes is None and len(joined) == m * REPORT_ID_BYTES and m:
        # the compiled check over the records' parts where they lie (no hash inputs built)
        # writable C arrays, read-only views of bytes: the argument types the loop was compiled
        # for when it loaded (_sha256_kernel._bound_probe), so no call compiles another
        matrix = np.require(_payload_matrix(payloads), requirements=["C", "W"])
        proofs = np.require(proofs, requirements=["C", "W"])
        claimed = np.frombuffer(joined, dtype=np.uint8).reshape(m, REPORT_ID_BYTES)
        wrong = np.zeros(m, dtype=np.uint8)
        heads = (np.frombuffer(COMMIT_DOMAIN + bytes((position, content)), np.uint8),
                 np.frombuffer(REPORT_DOMAIN + bytes.fromhex(study_id), np.uint8))
        if compiled.bound(proofs, matrix, claimed, *heads, cut, wrong) == 0:
            return np.flatnonzero(wrong)
    proofs = np.ascontiguousarray(proofs)
    own = hash_rows(m, [COMMIT_DOMAIN + bytes((position, content)), proofs[:, :SALT_BYTES],
                         _payload_matrix(payloads)])[:, :COMMITMENT_BYTES]
    ids = hash_rows(m, [_id_head(study_id, m, prefixes), proofs[:, SALT_BYTES:cut], own,
                         proofs[:, cut:]])[:, :REPORT_ID_BYTES]
    if len(joined) == m * REPORT_ID_BYTES:
        claimed = np.frombuffer(joined, dtype=np.uint8).reshape(m, REPORT_ID_BYTES)
        return np.flatnonzero((ids != claimed).any(axis=1))
    # an id of another length commits to nothing here
    return np.array([i for i, rid in enumerate(report_ids) if len(rid) != REPORT_ID_BYTES
                     or bytes(ids[i]) != rid] or [0], dtype=np.int64)


def _refuse(report_ids: Sequence[bytes], i: int) -> None:
    raise BindingError(
        f"report {report_ids[i].hex()}: its share for this server is not the one its report id "
        f"commits to (record {i}; substituted or corrupted in transit, or bound for another "
        f"server or study); nothing of this request was stored")


def _payload_matrix(payloads: np.ndarray) -> np.ndarray:
    """The payload rows as an (m, row size) uint8 matrix of the bytes :func:`payload_bytes`
    gives (little-endian uint64 for shares), without a copy where the layout allows."""
    arr = np.ascontiguousarray(payloads)
    if arr.dtype != np.uint8:
        arr = np.ascontiguousarray(arr.astype("<u8", copy=False))
    return arr.reshape(len(arr), int(np.prod(arr.shape[1:], dtype=np.int64))).view(np.uint8)  # m = 0 too


def payload_bytes(payloads: np.ndarray) -> tuple[bytes, int]:
    """The payload rows as one bytes object (little-endian uint64 for shares) and the row size."""
    arr = np.ascontiguousarray(payloads)
    if arr.dtype != np.uint8:
        arr = arr.astype("<u8", copy=False)
    raw = arr.tobytes()
    return raw, (len(raw) // len(arr) if len(arr) else 0)
