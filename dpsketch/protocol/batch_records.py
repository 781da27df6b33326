"""The wire records of batch proofs (docs/protocol.md section 4d; the proofs themselves are
docs/validity.md section 15 and :mod:`batch_validity`). I/O-free: bytes in, bytes out.

Why a module of its own: the batch core (batch_circuit, wraparound, batch_validity) proves and
checks a batch held in memory; what a server reads from a request body must be judged before
any of that work starts, and every way it can be wrong must map to one documented problem
(docs/protocol.md section 8), as a share record's does (section 4c). So the decoder checks, in
this order and each before anything that costs more: the study takes batch proofs and the media
type is one of the two below (else 415 ``unsupported-media-type``); the header is whole, names
the study's N, a leader position that matches the media type and the receiving server, an m in
[1, min(max_reports, MAX_BATCH_ROWS)], the study's w, R^2, shift and r, and a body at least as
long as m rows need, all before the batch's circuit is built (:func:`read_header`: a server judges
the upload token's quota on m there); then the header's T is the study's plan's for that m, the
body exactly its length and every leader element < p (else 400
``malformed-body``). :func:`receive` then runs the core's checks of the parts: a part that is not
what the server's own payload gives is 422 ``binding-refused`` (the batch id is the binding).

Layouts (little-endian; docs/protocol.md section 4d has the byte table):

    header  m u32 | w u32 | R^2 u64 | r u32 | T u64 | N u32 | shift u32 | leader u32   (40 bytes)
    parts   part_0 .. part_(N-1) | digits part                                   (32 (N + 1) bytes)
    leader  its 32-byte blind, then input share (n) then proof share (P), 8 bytes each, each < p
    helper  its 32-byte seed

The first 36 header bytes are :attr:`batch_validity.BatchPlan.header`, the bytes the parts and
the wrap seed hash; the leader's position is on the wire only (a server needs it to know the
parts' order is the client's, and it is checked against the media type).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import batch_circuit, batch_validity, envelope, field, validity, wraparound
from .problems import ProblemError

#: a leader's record: header, parts, its blind, its input and proof shares as F_p elements
LEADER_MEDIA_TYPE = "application/x-dpsketch-proof-batch"
#: a helper's record: header, parts, its 32-byte seed
HELPER_MEDIA_TYPE = "application/x-dpsketch-proof-batch-seed"
MEDIA_TYPES = (LEADER_MEDIA_TYPE, HELPER_MEDIA_TYPE)
#: sealed content kinds (docs/sealing.md section 3b): one record per sealed batch, its clear id
#: the batch id, its plaintext the whole record
SEALED_LEADER_CONTENT = envelope.CONTENT_PROOF_BATCH
SEALED_HELPER_CONTENT = envelope.CONTENT_PROOF_BATCH_SEED

HEADER = struct.Struct("<IIQIQIII")
HEADER_BYTES = HEADER.size  # 40
PART_BYTES = 32
SEED_BYTES = batch_validity.SEED_BYTES
BLIND_BYTES = batch_validity.BLIND_BYTES
ELEMENT_BYTES = 8
#: the most rows one batch record may hold: a server builds the batch's circuit (seconds and tens
#: of MB at 10^5 rows) from the header's m, and the SDK's batches hold at most 100,000 rows
MAX_BATCH_ROWS = 1 << 17


class BatchRecordError(ValueError):
    """A batch record a server refuses, with the problem it answers (docs/protocol.md section 8)."""

    def __init__(self, slug: str, detail: str):
        super().__init__(detail)
        self.slug = slug
        self.detail = detail

    def problem(self) -> ProblemError:
        return ProblemError(self.slug, self.detail)


def _malformed(detail: str) -> BatchRecordError:
    return BatchRecordError("malformed-body", detail)


@dataclass(frozen=True)
class HeaderFields:
    """The record header's fields, in :data:`HEADER`'s order."""

    m: int
    w: int
    r2: int
    reps: int
    threshold: int
    n_servers: int
    shift: int
    leader: int


@dataclass(frozen=True, eq=False)
class BatchRecord(HeaderFields):
    """One server's record of a batch, decoded: the header's fields, the N parts and the digits
    part, and either the leader's ``blind`` and shares (``inputs``, ``proof``: F_p elements) or a
    helper's ``seed``."""

    parts: tuple[bytes, ...]
    digits_part: bytes
    inputs: np.ndarray | None = None
    proof: np.ndarray | None = None
    seed: bytes | None = None
    blind: bytes | None = None

    @property
    def is_leader(self) -> bool:
        return self.seed is None

    @property
    def media_type(self) -> str:
        return LEADER_MEDIA_TYPE if self.is_leader else HELPER_MEDIA_TYPE

    @property
    def header(self) -> bytes:
        return HEADER.pack(self.m, self.w, self.r2, self.reps, self.threshold, self.n_servers, self.shift,
                           self.leader)

    def payload(self):
        """What :func:`batch_validity.receive` takes: the leader's (inputs, proof, blind) or the seed."""
        return (self.inputs, self.proof, self.blind) if self.is_leader else self.seed

    def __eq__(self, other) -> bool:
        if not isinstance(other, BatchRecord):
            return NotImplemented
        same_shares = all(
            (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
            for a, b in ((self.inputs, other.inputs), (self.proof, other.proof)))
        return (self.header, self.parts, self.digits_part, self.seed, self.blind) == (
            other.header, other.parts, other.digits_part, other.seed, other.blind) and same_shares

    __hash__ = None  # type: ignore[assignment]


# --- encoding -----------------------------------------------------------------------------------

def header_bytes(plan: batch_validity.BatchPlan, leader: int) -> bytes:
    """The record header: the plan's header (what the parts hash) and the leader's position."""
    return plan.header + struct.pack("<I", leader)


def record(plan: batch_validity.BatchPlan, proved: batch_validity.ProvedBatch, position: int) -> BatchRecord:
    """Server ``position``'s record of a proved batch."""
    c = plan.circuit
    common: dict[str, Any] = dict(m=c.m, w=c.w, r2=c.r2, reps=c.reps, threshold=c.threshold, n_servers=plan.n_servers,
                  shift=plan.shift, leader=proved.leader, parts=tuple(proved.parts), digits_part=proved.digits_part)
    if position == proved.leader:
        return BatchRecord(**common, inputs=np.asarray(proved.leader_inputs, dtype=np.uint64),
                           proof=np.asarray(proved.leader_proof, dtype=np.uint64), blind=bytes(proved.blind))
    seed = proved.seeds[position]
    assert seed is not None
    return BatchRecord(**common, seed=bytes(seed))


def encode(rec: BatchRecord) -> bytes:
    """The record's bytes (its media type: ``rec.media_type``)."""
    if len(rec.parts) != rec.n_servers or any(len(p) != PART_BYTES for p in rec.parts) \
            or len(rec.digits_part) != PART_BYTES:
        raise ValueError("a batch record has N parts and a digits part of 32 bytes each")
    head = rec.header + b"".join(rec.parts) + rec.digits_part
    if rec.is_leader:
        assert rec.inputs is not None and rec.proof is not None and rec.blind is not None
        if len(rec.blind) != BLIND_BYTES:
            raise ValueError("a leader's blind is 32 bytes")
        return head + rec.blind + field.to_wire(field.elements(rec.inputs, "input share")) \
            + field.to_wire(field.elements(rec.proof, "proof share"))
    assert rec.seed is not None
    if len(rec.seed) != SEED_BYTES:
        raise ValueError("a helper's seed is 32 bytes")
    return head + rec.seed


def records(plan: batch_validity.BatchPlan, proved: batch_validity.ProvedBatch) -> list[tuple[str, bytes]]:
    """Every server's (media type, body), in position order: what a client sends."""
    out = []
    for position in range(plan.n_servers):
        rec = record(plan, proved, position)
        out.append((rec.media_type, encode(rec)))
    return out


def leader_length(plan: batch_validity.BatchPlan) -> int:
    c = plan.circuit
    return HEADER_BYTES + PART_BYTES * (plan.n_servers + 1) + BLIND_BYTES + ELEMENT_BYTES * (c.input_len + c.proof_len)


def helper_length(n_servers: int) -> int:
    return HEADER_BYTES + PART_BYTES * (n_servers + 1) + SEED_BYTES


# --- decoding -----------------------------------------------------------------------------------

def max_rows(study) -> int:
    """The most rows a batch record of this study may hold."""
    return min(study.max_reports, MAX_BATCH_ROWS)


@dataclass(frozen=True)
class Header(HeaderFields):
    """A record header that passed the checks that need no circuit (:func:`read_header`), and
    whether the receiving server leads the batch."""

    leading: bool


def read_header(study, position: int, media_type: str, body: bytes) -> Header:
    """The header of server ``position``'s record, judged on what needs no circuit: the study and
    media type (415), the header's N, leader position, m, w, R^2, shift and r and the body's least
    length (400). Cheap whatever m says, so that a server can judge the upload token's quota on m
    (m reports) between this and :func:`decode`, which builds the batch's circuit."""
    if media_type not in MEDIA_TYPES:
        raise BatchRecordError("unsupported-media-type", f"{media_type[:80]!r} is not a batch record")
    if not getattr(study, "batch_proofs", False):
        raise BatchRecordError("unsupported-media-type",
                               "this study does not take batch proofs (its batch_proofs is false): send "
                               "per-report records (docs/protocol.md section 4c)")
    n_srv = study.n_servers
    if not 0 <= position < n_srv:
        raise ValueError("the server's position is one of the study's")
    if len(body) < HEADER_BYTES:
        raise _malformed(f"a batch record starts with a {HEADER_BYTES}-byte header; the body has {len(body)} bytes")
    m, w, r2, reps, threshold, n_hdr, shift, leader = HEADER.unpack_from(body)
    if n_hdr != n_srv:
        raise _malformed(f"the batch header names N = {n_hdr}; the study has {n_srv} servers")
    if leader >= n_srv:
        raise _malformed(f"the batch header names leader position {leader}; positions are 0..{n_srv - 1}")
    leading = media_type == LEADER_MEDIA_TYPE
    if leading and leader != position:
        raise _malformed(f"a leader's record ({LEADER_MEDIA_TYPE}) names leader {leader}, not this server "
                         f"(position {position})")
    if not leading and leader == position:
        raise _malformed(f"a helper's record ({HELPER_MEDIA_TYPE}) names this server (position {position}) "
                         f"as the leader")
    if not 1 <= m <= max_rows(study):
        raise _malformed(f"a batch holds 1 to {max_rows(study)} rows (min(max_reports, {MAX_BATCH_ROWS})); "
                         f"the header says {m}")
    rows = validity.plan(study)
    if (w, r2, shift) != (rows.w, rows.bound, rows.shift):
        raise _malformed(f"the batch header's (w, R^2, shift) = ({w}, {r2}, {shift}) is not the study's "
                         f"({rows.w}, {rows.bound}, {rows.shift})")
    fixed = HEADER_BYTES + PART_BYTES * (n_srv + 1)
    if leading:
        # every row has at least w + 5 elements (coordinates and roots): judged before the circuit
        # of m rows is built, so a short body cannot make the server build a large one
        least = fixed + BLIND_BYTES + ELEMENT_BYTES * m * (w + batch_circuit.greedy_steps(r2) + batch_circuit.EXACT)
        if len(body) < least:
            raise _malformed(f"a leader's record of {m} rows has at least {least} bytes; the body has {len(body)}")
    elif len(body) != helper_length(n_srv):
        raise _malformed(f"a helper's record is {helper_length(n_srv)} bytes at N = {n_srv}; the body has {len(body)}")
    if reps != wraparound.REPETITIONS:
        raise _malformed(f"a batch has r = {wraparound.REPETITIONS} wrap-around checks; the header says {reps}")
    return Header(m, w, r2, reps, threshold, n_srv, shift, leader, leading)


def decode(study, position: int, media_type: str, body: bytes) -> tuple[BatchRecord, batch_validity.BatchPlan]:
    """Server ``position``'s record of a study's batch, and the batch's plan, or
    :class:`BatchRecordError` with the problem to answer (module doc: the order of the checks)."""
    body = bytes(body)
    h = read_header(study, position, media_type, body)
    try:
        plan = batch_validity.study_plan(study, h.m)
    except ValueError as exc:  # m too large for the field (K (4^q_w - 1)^2 >= p)
        raise _malformed(f"no batch of {h.m} rows in this study: {exc}") from None
    if h.threshold != plan.circuit.threshold:
        raise _malformed(f"the batch header's T = {h.threshold} is not the plan's {plan.circuit.threshold} "
                         f"for m = {h.m}")
    n_srv = h.n_servers
    fixed = HEADER_BYTES + PART_BYTES * (n_srv + 1)
    parts = tuple(body[HEADER_BYTES + PART_BYTES * j:HEADER_BYTES + PART_BYTES * (j + 1)] for j in range(n_srv))
    common: dict[str, Any] = dict(m=h.m, w=h.w, r2=h.r2, reps=h.reps, threshold=h.threshold, n_servers=n_srv, shift=h.shift,
                  leader=h.leader, parts=parts, digits_part=body[fixed - PART_BYTES:fixed])
    if not h.leading:
        return BatchRecord(**common, seed=body[fixed:]), plan
    c = plan.circuit
    if len(body) != leader_length(plan):
        raise _malformed(f"a leader's record of {h.m} rows is {leader_length(plan)} bytes (n = {c.input_len}, "
                         f"P = {c.proof_len}); the body has {len(body)}")
    values = np.frombuffer(body, dtype="<u8", offset=fixed + BLIND_BYTES).astype(np.uint64)
    above = np.flatnonzero(values >= np.uint64(field.P))
    if above.size:
        raise _malformed(f"a leader's element is not below p (element {int(above[0])} of {values.size})")
    return BatchRecord(**common, inputs=values[:c.input_len], proof=values[c.input_len:],
                       blind=body[fixed:fixed + BLIND_BYTES]), plan


def receive(study, position: int, media_type: str, body: bytes
            ) -> tuple[BatchRecord, batch_validity.BatchPlan, batch_validity.ServerBatch]:
    """:func:`decode`, then the core's checks of the parts (:func:`batch_validity.receive`): a part
    for this server that its own payload does not give, or a digits part that is not the
    leader's, is 422 ``binding-refused``. Returns the record, the plan and the server's batch (its
    shares, wrap seed and batch id)."""
    rec, plan = decode(study, position, media_type, body)
    try:
        batch = batch_validity.receive(plan, position, rec.payload(), rec.parts, rec.digits_part, rec.leader)
    except batch_validity.BatchRefused as exc:
        raise BatchRecordError("binding-refused", f"batch refused: {exc}") from None
    return rec, plan, batch


def batch_id_of(body: bytes, n_servers: int) -> bytes:
    """The batch id a record's header and parts give (section 4d: the wrap seed of its 36-byte
    plan header and parts, then the digits part), by two hashes: no circuit built, no share read,
    nothing checked (a server judges a record's quota by it before :func:`receive`, and reads a
    stored record's id with it). ValueError for a body too short to hold the parts."""
    at = HEADER_BYTES + PART_BYTES * n_servers
    if len(body) < at + PART_BYTES:
        raise ValueError(f"a batch record of {n_servers} servers is at least {at + PART_BYTES} bytes")
    parts = [body[HEADER_BYTES + PART_BYTES * j:HEADER_BYTES + PART_BYTES * (j + 1)] for j in range(n_servers)]
    seed = batch_validity.wrap_seed_of_header(body[:36], parts)
    return batch_validity.batch_id(seed, body[at:at + PART_BYTES])


def check_sealed_id(clear_id: bytes, batch: batch_validity.ServerBatch) -> None:
    """A sealed batch record's clear id (docs/sealing.md section 3b) must be the batch id the
    server computes from the opened record: else 422 ``binding-refused``."""
    if bytes(clear_id) != batch.batch_id:
        raise BatchRecordError("binding-refused", "the sealed record's id is not the batch id its parts give")


# --- sealed (docs/sealing.md section 3b) --------------------------------------------------------

def sealed_content(media_type: str) -> int:
    """The sealed content kind of a record of this media type: 0x05 a leader's, 0x06 a helper's."""
    if media_type == LEADER_MEDIA_TYPE:
        return SEALED_LEADER_CONTENT
    if media_type == HELPER_MEDIA_TYPE:
        return SEALED_HELPER_CONTENT
    raise ValueError(f"{media_type!r} is not a batch record's media type")


def seal(recipient: envelope.Recipient, study_id: str, media_type: str, body: bytes, n_servers: int) -> bytes:
    """Server ``recipient``'s record (``body``, of ``media_type``) sealed to it: a version 4 batch
    of one record, content 0x05 or 0x06, its clear id the batch id its header and parts give."""
    return envelope.seal_record(recipient, study_id, batch_id_of(body, n_servers), sealed_content(media_type), body)


def open_sealed(study, server_id: str, body: bytes, private_key_for,
                header: envelope.BatchHeader | None = None) -> tuple[str, bytes, bytes]:
    """A sealed batch record opened at server ``server_id``: (the media type its content names,
    its clear id, the record), or :class:`BatchRecordError`: 400 ``malformed-body`` for a body
    that is not one sealed record of content 0x05 or 0x06 (count 1, a helper's exactly
    104 + 32 N bytes; judged before any key is used), 422 ``sealed-share-refused`` for one that
    does not open here. The record itself is judged by :func:`read_header`, :func:`receive` and
    :func:`check_sealed_id` after this. ``header``: ``envelope.parse_record`` of this body, if
    the server already judged it (then not parsed again)."""
    try:
        content, clear_id, record = envelope.open_record(body, helper_length(study.n_servers), study.study_id,
                                                         server_id, private_key_for, header=header)
    except envelope.SealError as exc:
        raise BatchRecordError("sealed-share-refused", str(exc)) from None
    except ValueError as exc:  # MalformedSealedBatch
        raise _malformed(str(exc)) from None
    media_type = LEADER_MEDIA_TYPE if content == SEALED_LEADER_CONTENT else HELPER_MEDIA_TYPE
    return media_type, clear_id, record
