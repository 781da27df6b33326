"""Batch proofs of a sketch study's rows: a bulk owner proves a batch of m rows at once, the
coordinates as field elements, wrap-around excluded by the batch's projections (issue 40's cost
targets; docs/validity.md section 15). I/O-free; not on the wire yet.

Why. A per-report proof carries ~10 field elements per coordinate (digits and proof), so its
upload, its client and its servers cost 10-30x a report without proofs (section 10). Here a row
costs w + 4 + q_rem elements (its coordinates, four roots and a remainder's digits), the
batch's proof and wrap digits are shared by its m rows, and a helper's share of the whole
batch expands from one seed.

The flow (one batch, N servers, the leader at position ``leader``):

1. client: x (grid units, validity.grid_units), the slack's roots and remainder
   (BatchNorm.prefix); one seed per helper, whose expansion (input share, then proof share) is
   the helper's share of the whole batch; the leader's share of that prefix = x - the helpers'.
2. parts: part_j = SHA-256("dpsketch/batch-part/1" || "seed" || j || seed_j) for a helper,
   SHA-256(... || "share" || j || blind || header || the leader's share of v = (x, a)) for the
   leader (blind: 32 random bytes only the leader receives, so that the helpers, who know every
   other share, cannot test guesses of the rows against the leader's part); the wrap seed
   = SHA-256("dpsketch/wrap-seed/1" || header || part_0 || ... || part_(N-1)): it commits to v
   before the client learns the projections (wraparound.py).
3. client: the projections <z_k, v>, their digits (T added), the leader's share of them; the
   digits part = SHA-256(... || "digits" || leader || blind || the leader's share of the digits); the
   batch id = SHA-256("dpsketch/batch-id/1" || wrap seed || digits part)[:16], from which the
   FLP's joint randomness is drawn (flp.joint_rand): it commits to every share.
4. client: prove (flp.prove), the leader's proof share = proof - the helpers'.
5. each server (:func:`receive`): its shares (a helper from its seed), its own part recomputed
   and compared with what the client sent (else the batch is refused there), the wrap seed and
   batch id from the parts; aggregation of x (:func:`coordinate_shares`); after uploads close,
   at the round's query point, its verifier share (:func:`verifier_share`, flp.query with the
   batch's projections); :func:`decide` on every server's (batch id, verifier share): refused
   unless all batch ids agree and the summed verifier decides true.

A refused batch proof refuses the whole batch.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import binding, field, flp, validity, wraparound
from .batch_circuit import BatchNorm
from .keystream import Keystream

PART_DOMAIN = b"dpsketch/batch-part/1"
WRAP_DOMAIN = b"dpsketch/wrap-seed/1"
BATCH_ID_DOMAIN = b"dpsketch/batch-id/1"
SHARE_DOMAIN = b"dpsketch/batch-share/1"
ROW_DOMAIN = b"dpsketch/batch-row/1"
SHARE_NONCE = hashlib.sha256(SHARE_DOMAIN).digest()[:12]
SEED_BYTES = 32
#: the leader's blind in its part and digits part (share_part)
BLIND_BYTES = 32


class BatchRefused(validity.ValidityError):
    """A server refuses a batch before its proof is checked (a part that is not its own)."""


@dataclass(frozen=True)
class BatchPlan:
    """What a batch of m rows is: the circuit, the grid's shift and the number of servers."""

    circuit: BatchNorm
    shift: int
    n_servers: int

    @property
    def m(self) -> int:
        return self.circuit.m

    @property
    def w(self) -> int:
        return self.circuit.w

    @property
    def header(self) -> bytes:
        c = self.circuit
        return struct.pack("<IIQIQII", c.m, c.w, c.r2, c.reps, c.threshold, self.n_servers, self.shift)

    def upload_bytes(self) -> dict[str, int]:
        """Bytes one batch sends to its N servers: the leader's input and proof shares (8 bytes an
        element) and its 32-byte blind, a 32-byte seed to each helper, and the N + 1 parts of 32
        bytes to each server (each server recomputes its own; they are counted anyway)."""
        c = self.circuit
        leader = 8 * (c.input_len + c.proof_len) + BLIND_BYTES
        seeds = SEED_BYTES * (self.n_servers - 1)
        parts = 32 * (self.n_servers + 1) * self.n_servers
        return {"leader": leader, "seeds": seeds, "parts": parts, "total": leader + seeds + parts}


@functools.lru_cache(maxsize=4)
def batch_plan(m: int, w: int, r2: int, shift: int, n_servers: int, reps: int = wraparound.REPETITIONS) -> BatchPlan:
    """The plan of a batch of m rows (cached, a few: building a large circuit takes seconds and
    holds its wire map, tens of MB at 10^6 elements)."""
    if n_servers < 2:
        raise ValueError("need at least two servers")
    return BatchPlan(BatchNorm(m, w, r2, reps), shift, n_servers)


def study_plan(study, m: int, reps: int = wraparound.REPETITIONS) -> BatchPlan:
    """A sketch validity study's batch plan: its rows' predicate (validity.plan: the width, R^2 in
    grid units, the grid's shift) over batches of m rows."""
    p = validity.plan(study)
    if study.kind not in ("sketch", "l1") or study.parties is not None:
        raise ValueError("batch proofs exist for sketch and l1 studies without parties")
    return batch_plan(m, p.w, p.bound, p.shift, p.n_servers, reps)


@dataclass
class ProvedBatch:
    """What the client sends: the leader's shares and blind, each helper's seed (None at the
    leader), every server's part (in position order) and the leader's digits part."""

    leader: int
    leader_inputs: np.ndarray
    leader_proof: np.ndarray
    seeds: list[bytes | None]
    parts: list[bytes]
    digits_part: bytes
    blind: bytes

    def payload(self, position: int):
        """What server ``position`` receives besides the parts: its seed, or the leader's shares
        and the blind (inputs, proof, blind)."""
        if position == self.leader:
            return self.leader_inputs, self.leader_proof, self.blind
        return self.seeds[position]


def _part(kind: bytes, position: int, data: bytes) -> bytes:
    return hashlib.sha256(PART_DOMAIN + kind + bytes((position,)) + data).digest()


def seed_part(position: int, seed: bytes) -> bytes:
    return _part(b"seed", position, seed)


def share_part(plan: BatchPlan, position: int, leader_inputs: np.ndarray, blind: bytes) -> bytes:
    """The leader's part: a hiding commitment to its share of v. Every server sees every part, and
    the helpers together know every share but the leader's, hence v minus it: without the blind
    (32 bytes only the leader receives) they could test guesses of the rows against this hash
    (tests/test_batch_records.py measures it); with it, the hash says nothing about them."""
    return _part(b"share", position, blind + plan.header + field.to_wire(leader_inputs[:plan.circuit.v_len]))


def digits_part(plan: BatchPlan, position: int, leader_inputs: np.ndarray, blind: bytes) -> bytes:
    """The leader's commitment to its share of the wrap digits, blinded as :func:`share_part`."""
    return _part(b"digits", position, blind + field.to_wire(leader_inputs[plan.circuit.v_len:]))


def wrap_seed(plan: BatchPlan, parts: Sequence[bytes]) -> bytes:
    if len(parts) != plan.n_servers or any(len(p) != 32 for p in parts):
        raise BatchRefused("a batch has one 32-byte part per server")
    return wrap_seed_of_header(plan.header, parts)


def wrap_seed_of_header(header36: bytes, parts: Sequence[bytes]) -> bytes:
    """The wrap seed of a 36-byte plan header and the parts (a record's own bytes: no plan)."""
    return hashlib.sha256(WRAP_DOMAIN + header36 + b"".join(parts)).digest()


def batch_id(seed: bytes, digits: bytes) -> bytes:
    return hashlib.sha256(BATCH_ID_DOMAIN + seed + digits).digest()[:flp.REPORT_ID_BYTES]


def row_ids(bid: bytes, m: int) -> np.ndarray:
    """The rows' ids (m, 16) uint8, what the sketch hashes (Study.hash_report_ids, a keyed hash):
    SHA-256("dpsketch/batch-row/1" || batch id || u32le(i))[0:16] for row i. A hash and not the
    batch id with the index appended (the second draft's): the servers' report index, the
    analyzer's intersections and every sorted id list search the ids' first 8 bytes and take
    ids sharing them as crafted (a scan), which a batch's rows then all were, so that a round
    over 10^5 batch rows spent a quarter of a server's time in that scan; hashed, a row's id is as
    uniform as a report's. The compiled SHA-256 row loop (binding.hash_rows): about 0.2 us a row."""
    if len(bid) != flp.REPORT_ID_BYTES or not 0 <= m < 1 << 32:
        raise ValueError("a 16-byte batch id and fewer than 2^32 rows")
    index = np.arange(m, dtype="<u4").view(np.uint8).reshape(m, 4)
    return np.ascontiguousarray(binding.hash_rows(m, [ROW_DOMAIN + bid, index])[:, :flp.REPORT_ID_BYTES])


def _helper_shares(plan: BatchPlan, seed: bytes) -> np.ndarray:
    """A helper's input share then proof share, one row: n + P elements from its seed
    (:func:`expand_one`)."""
    c = plan.circuit
    return expand_one(seed, c.input_len + c.proof_len)


def expand_one(seed: bytes, count: int, nonce: bytes = SHARE_NONCE) -> np.ndarray:
    """field.expand of one seed, (count,): its first ``count`` keystream words when none of
    them is >= p (all but about count 2^-32 of seeds), from OpenSSL's ChaCha20
    (wraparound.keystream_into, one long stream: 3-4x faster than the per-row loop field.expand
    takes); else field.expand itself. The same elements either way (tests compare them)."""
    if sys.byteorder == "little":
        words = wraparound.keystream_into(seed, nonce, np.empty(count, dtype=np.uint64))
        if not count or words.max() < np.uint64(field.P):
            return words
    return field.expand(np.frombuffer(seed, dtype=np.uint8).reshape(1, SEED_BYTES), count, nonce)[0]


# --- client -------------------------------------------------------------------------------------------

def prove(plan: BatchPlan, units: np.ndarray, stream: Keystream, leader: int | None = None) -> ProvedBatch:
    """A batch of m rows in grid units (validity.grid_units), each of squared norm <= R^2, proved
    (validity.ValidityError for a row outside, or for a projection outside its range: the client
    redraws its noise, probability <= 2^-96 a batch)."""
    try:
        prefix = plan.circuit.prefix(units)
    except ValueError as exc:
        raise validity.ValidityError(f"{exc}: redraw its noise") from None
    return prove_prefix(plan, prefix, stream, leader)


@dataclass
class Commitment:
    """The first half of proving a batch: the shares of the input's prefix (x and the roots), each
    server's part and the wrap seed they give; the projections are fixed from here on."""

    prefix: np.ndarray
    leader: int
    seeds: list[bytes | None]
    helpers: np.ndarray
    leader_inputs: np.ndarray
    parts: list[bytes]
    wrap_seed: bytes
    blind: bytes


def commit(plan: BatchPlan, prefix: np.ndarray, stream: Keystream, leader: int | None = None) -> Commitment:
    """Helper seeds then the leader's blind (from ``stream``), the leader's share of the prefix,
    the parts, the wrap seed."""
    c = plan.circuit
    n_srv = plan.n_servers
    leader = n_srv - 1 if leader is None else leader
    if not 0 <= leader < n_srv:
        raise ValueError("the leader is a server position")
    prefix = field.elements(prefix, "input")
    if prefix.shape != (c.at_wrap,):
        raise ValueError(f"the prefix has {c.at_wrap} elements")
    seeds: list[bytes | None] = [None if j == leader else stream.bytes(SEED_BYTES) for j in range(n_srv)]
    blind = stream.bytes(BLIND_BYTES)
    helpers = None
    for s in seeds:
        if s is not None:
            share = _helper_shares(plan, s)
            helpers = share if helpers is None else field.add(helpers, share)
    assert helpers is not None
    leader_inputs = np.empty(c.input_len, dtype=np.uint64)
    leader_inputs[:c.at_wrap] = field.sub(prefix, helpers[:c.at_wrap])
    parts = [share_part(plan, j, leader_inputs, blind) if s is None else seed_part(j, s) for j, s in enumerate(seeds)]
    return Commitment(prefix, leader, seeds, helpers, leader_inputs, parts, wrap_seed(plan, parts), blind)


def projections(plan: BatchPlan, committed: Commitment) -> np.ndarray:
    """<z_k, v> of the committed batch, centred integers (r,)."""
    c = plan.circuit
    return field.decode_int(wraparound.project_seeded(committed.prefix[:c.v_len], committed.wrap_seed, c.reps))


def prove_prefix(plan: BatchPlan, prefix: np.ndarray, stream: Keystream, leader: int | None = None,
                 strict: bool = True) -> ProvedBatch:
    """Sharing, parts, projections, wrap digits and proof for the input's first elements (x, roots)
    as given. ``strict=False`` is a forger's: a projection outside its range is written as
    (P_k + T) mod 4^q_w - T, the best digits it has (tests attack with it)."""
    c = plan.circuit
    committed = commit(plan, prefix, stream, leader)
    proj = projections(plan, committed)
    inputs = np.empty(c.input_len, dtype=np.uint64)
    inputs[:c.at_wrap] = committed.prefix
    if strict:
        try:
            inputs[c.at_wrap:] = c.wrap_input(proj)
        except ValueError as exc:
            raise validity.ValidityError(f"{exc}: redraw the batch's noise") from None
    else:
        inputs[c.at_wrap:] = c.wrap_input(np.mod(proj + c.threshold, c.wrap_bound) - c.threshold)
    helpers, leader_inputs = committed.helpers, committed.leader_inputs
    leader_inputs[c.at_wrap:] = field.sub(inputs[c.at_wrap:], helpers[c.at_wrap:c.input_len])
    digits = digits_part(plan, committed.leader, leader_inputs, committed.blind)
    bid = batch_id(committed.wrap_seed, digits)
    jr = flp.joint_rand(c, [bid])
    proof = flp.prove(c, inputs[None], jr, flp.prove_rand(c, 1, stream))[0]
    leader_proof = field.sub(proof, helpers[c.input_len:])
    return ProvedBatch(committed.leader, leader_inputs, leader_proof, committed.seeds, committed.parts, digits,
                       committed.blind)


# --- servers ------------------------------------------------------------------------------------------

@dataclass
class ServerBatch:
    """One server's view of a batch: its input and proof shares, and the wrap seed and batch id
    it computed from the parts (the wrap bits follow from the seed: drawn by the circuit's
    ``checked`` when the verifier share is computed)."""

    position: int
    inputs: np.ndarray
    proof: np.ndarray
    wrap_seed: bytes
    batch_id: bytes


def receive(plan: BatchPlan, position: int, payload, parts: Sequence[bytes], digits: bytes,
            leader: int) -> ServerBatch:
    """Server ``position``'s shares of a batch (a helper's from its 32-byte seed, the leader's
    explicit), after checking that the client's part for it is its own (BatchRefused if not)."""
    c = plan.circuit
    if position == leader:
        if not isinstance(payload, tuple) or len(payload) != 3:
            raise BatchRefused("a leader's payload is its input share, proof share and blind")
        inputs, proof = (field.elements(np.asarray(a), "leader share") for a in payload[:2])
        blind = payload[2]
        if inputs.shape != (c.input_len,) or proof.shape != (c.proof_len,):
            raise BatchRefused("a leader's shares have the batch's input and proof lengths")
        if not isinstance(blind, (bytes, bytearray)) or len(blind) != BLIND_BYTES:
            raise BatchRefused("a leader's blind is 32 bytes")
        mine = share_part(plan, position, inputs, bytes(blind))
        if digits != digits_part(plan, position, inputs, bytes(blind)):
            raise BatchRefused("the batch's digits part is not the leader's")
    else:
        if not isinstance(payload, (bytes, bytearray)) or len(payload) != SEED_BYTES:
            raise BatchRefused("a helper's payload is a 32-byte seed")
        both = _helper_shares(plan, bytes(payload))
        inputs, proof = both[:c.input_len], both[c.input_len:]
        mine = seed_part(position, bytes(payload))
    if len(parts) != plan.n_servers or parts[position] != mine:
        raise BatchRefused(f"the batch's part for server {position} is not what its shares give")
    seed = wrap_seed(plan, parts)
    return ServerBatch(position, inputs, proof, seed, batch_id(seed, digits))


def aggregate(plan: BatchPlan, batch: ServerBatch, rows: np.ndarray, signs: np.ndarray,
              acc: np.ndarray) -> np.ndarray:
    """acc + the server's F_p shares of sum_i signs[i, l] 2^shift x_i in the sketch's cells
    rows[i, l] ((k, w) F_p elements, acc's shape: the sketch's cells by the coordinates): one word a cell,
    summed lazily mod p by the compiled loop (_wrap_kernel.accumulate_fp), the grid's 2^shift
    applied once to the sums rather than to every row (it is linear)."""
    c = plan.circuit
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    signs = np.ascontiguousarray(signs, dtype=np.int8)
    if rows.shape != signs.shape or rows.ndim != 2 or len(rows) != c.m:
        raise ValueError("one row of sketch cells and signs per batch row")
    table = batch.inputs[:c.m * c.k].reshape(c.m, c.k)  # each row: its coordinates, then its roots
    if acc.shape[1] != c.w or (rows.size and (rows.min() < 0 or rows.max() >= acc.shape[0])):
        raise ValueError("sketch cells outside the aggregate")
    loop = wraparound.WRAP.for_rows(c.m)
    if loop is not None:
        sums = np.zeros(acc.shape, dtype=np.uint64)
        loop.accumulate_fp(sums, rows, signs, table, c.w)
        sums %= np.uint64(field.P)
    else:
        sums = _field_sums_ref(np.zeros(acc.shape, dtype=np.uint64), rows, signs, table, c.w)
    if plan.shift:
        sums = field.mul(sums, np.uint64(pow(2, plan.shift, field.P)))
    return field.add(field.elements(acc, "aggregate"), sums)


def _field_sums_ref(acc: np.ndarray, rows: np.ndarray, signs: np.ndarray, values: np.ndarray, w: int) -> np.ndarray:
    """acc + sum_i signs[i, l] values[i, :w] in cells rows[i, l], mod p (numpy: the split 32-bit
    words of the per-report path, summed exactly by the sketch's accumulation, then joined)."""
    from . import sketch

    running = np.zeros((acc.shape[0], 2 * w), dtype=np.uint64)
    sketch.accumulate(running, rows, signs, validity.split_words(np.ascontiguousarray(values[:, :w])))
    return field.add(np.asarray(acc, dtype=np.uint64) % np.uint64(field.P), validity.join_words(running))


def coordinate_shares(plan: BatchPlan, batch: ServerBatch) -> np.ndarray:
    """The server's F_p shares (m, w) of 2^shift x: the coordinates are input elements, no map."""
    x = plan.circuit.coordinates(batch.inputs)
    return field.mul(x, np.uint64(pow(2, plan.shift, field.P))) if plan.shift else np.ascontiguousarray(x)


@functools.lru_cache(maxsize=8)
def _query(plan: BatchPlan, seed: bytes) -> flp.Query:
    return flp.Query(plan.circuit, flp.query_point(seed))


def verifier_share(plan: BatchPlan, batch: ServerBatch, query_seed: bytes, threads: int = 1) -> np.ndarray:
    """The server's verifier share (V, 2) at the round's query point (validity.query_seed); the
    wrap projections on ``threads`` threads (the same share, less wall time where cores are free)."""
    c = plan.circuit
    checked = c.checked(batch.wrap_seed, threads)
    jr = flp.joint_rand(c, [batch.batch_id])
    return flp.query(checked, batch.inputs[None], batch.proof[None], jr, _query(plan, query_seed),
                     plan.n_servers)[0]


def decide(plan: BatchPlan, messages: Sequence[tuple[bytes, np.ndarray]]) -> bool:
    """Whether the batch is accepted, from every server's (batch id, verifier share): the ids
    must agree (else the client gave the servers different parts) and the summed verifier decide."""
    if len(messages) != plan.n_servers:
        return False
    ids = {bid for bid, _ in messages}
    if len(ids) != 1:
        return False
    return accepts(plan, ids.pop(), [v for _, v in messages])


def accepts(plan: BatchPlan, bid: bytes, shares: Sequence[np.ndarray]) -> bool:
    """Whether the verifier shares ``shares`` ((V, 2) each, summed mod p: every server's, or a
    server's own and the sum of the others' it was sent) decide the batch ``bid`` true."""
    total = flp.reconstruct([np.asarray(v)[None] for v in shares])
    return bool(flp.decide(plan.circuit, total, flp.joint_rand(plan.circuit, [bid]))[0])
