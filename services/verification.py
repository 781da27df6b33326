"""A validity study's verification round at one share server (docs/protocol.md section 6d).

Each server checks every report's proof (dpsketch/protocol/validity.py) and decides for itself;
nothing travels from server to server, the analyzer carries every message. The round's steps
and why each is stored before it is answered:

* commit: the study takes no more uploads from the moment the request is taken (the upload
  gate below), and this server's 32-byte contribution to the query seed is stored durably
  before its commitment is answered: after a crash the server commits to the same value, so
  the seed that comes out is the same, and no report is ever queried at two points (two
  points would reveal two values of each wire polynomial, which the proof hides only once).
* reveal: the N commitments are stored, and the contribution is answered only if this
  server's own is at its position; another list later is refused forever.
* query: the contributions are checked against the commitments, the query seed (a hash of all
  of them) is stored, and the verifier share of every held report is answered, computed in
  chunks of reports, vectorised over each chunk (``validity.verifier_shares``); the same
  bytes are kept on disk for the decision.
* decide: this server's verifier shares are read back from the query's answer kept on disk
  (services/verify_cache.py: bound to this server, study, seed and held set, checked whole), or,
  without a valid one, recomputed (deterministic from the stored shares and seed: always
  correct), added to the others' sum the analyzer sent, and every report decided; the decided
  ids and the refused ones are stored before the answer, then the kept answer is removed. A
  commit (store.py) then refuses an inclusion set with a refused report or one this server did
  not decide.

A study with ``batch_proofs`` (docs/protocol.md sections 4d and 6d): the query answers the
report section over its per-report records only (a batch's rows are never decided one by one)
followed by the batch section (``batch_verifiers``): every held batch proof's verifier share,
re-received from its stored record (services/batches.py) one batch at a time and computed at
the query point; the decision splits the body the same way, decides each named batch whole (its
own share plus the others' sum, ``batch_validity.accepts``) and stores all its m row ids as
decided, and refused too when it is refused. Such a study's answers are not kept on disk (the
verifier cache keeps report sections only): its decision recomputes its own report shares, and
takes its batches' own shares from memory (V elements a batch, kept by the query at its seed),
recomputing them only after a restart or at another replica (the same shares: a function of the
stored record and the seed).

Why the upload gate is in the store and not the writer: the writer runs jobs in the order they
were queued (services/writer.py), so a commit job queued under the gate's lock runs after
every upload queued before it and before any queued after it, and every upload queued after
it is refused under the same lock. The contribution is thus drawn after the last report this
server will ever hold. Replicas sharing a PostgreSQL database learn of a closure another
replica made from the database, under the study's row lock, before they store any upload
(``Store._catch_up_uploads``); the commit takes that lock too.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dpsketch.protocol import batch_validity, batch_verifiers, field, messages, proved_shares, validity
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.sketch import REPORT_ID_BYTES
from dpsketch.protocol.verification import Commitment, Contribution

from . import batches, idsets, verify_cache
from .writer import CallJob

if TYPE_CHECKING:  # pragma: no cover
    from .state import StudyRecord
    from .store import Store

log = logging.getLogger("dpsketch.server")

SCHEMA = """
CREATE TABLE IF NOT EXISTS verifications (
    study          BIGINT PRIMARY KEY,
    contribution   BLOB NOT NULL,
    commitment     BLOB NOT NULL,
    committed_at   REAL NOT NULL,
    commitments    BLOB,
    contributions  BLOB,
    query_seed     BLOB,
    decided_hash   BLOB,
    decided        BLOB,
    refused        BLOB,
    decided_at     REAL
)"""

_COLUMNS = ("contribution, commitment, committed_at, commitments, contributions, query_seed, "
            "decided_hash, decided, refused, decided_at")

#: Working memory of one chunk of reports a query or decision computes at once (their stored
#: payloads, as uint64 elements; the verifier computation holds a few times that).
CHUNK_BYTES = 32 << 20


@dataclass
class Round:
    """What this server stored of one study's round (None: that step is not done)."""

    contribution: bytes
    commitment: bytes
    committed_at: float
    commitments: bytes | None = None
    contributions: bytes | None = None
    query_seed: bytes | None = None
    decided_hash: bytes | None = None
    decided: bytes | None = None  # the decided ids, sorted, concatenated
    refused: bytes | None = None  # the refused ids among them, sorted, concatenated
    decided_at: float | None = None
    _decided_halves: tuple[np.ndarray, np.ndarray] | None = None
    _refused_halves: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def of_row(cls, row: tuple) -> "Round":
        c, m, at, cs, cb, seed, dh, dec, ref, dat = row
        def b(v: Any) -> bytes | None:
            return None if v is None else bytes(v)
        return cls(bytes(c), bytes(m), float(at), b(cs), b(cb), b(seed), b(dh), b(dec), b(ref),
                   None if dat is None else float(dat))

    def halves(self, which: str) -> tuple[np.ndarray, np.ndarray]:
        """The decided or refused ids as native uint64 halves (made once)."""
        if which == "decided":
            if self._decided_halves is None:
                self._decided_halves = idsets.halves(self.decided or b"")
            return self._decided_halves
        if self._refused_halves is None:
            self._refused_halves = idsets.halves(self.refused or b"")
        return self._refused_halves

    @property
    def n_decided(self) -> int:
        return len(self.decided or b"") // REPORT_ID_BYTES

    @property
    def n_refused(self) -> int:
        return len(self.refused or b"") // REPORT_ID_BYTES


@dataclass
class _Held:
    """Held ids ascending (what the report index's run has: ``hi``, ``lo``, ``rowid``)."""

    hi: np.ndarray
    lo: np.ndarray
    rowid: np.ndarray

    def __len__(self) -> int:
        return len(self.hi)


@dataclass
class HeldBatch:
    """A held batch proof at the round: its stored rows and record, plan and batch id (read from
    the record's parts: no seed expanded, nothing re-received until its verifier is computed)."""

    stored: batches.Stored
    plan: batch_validity.BatchPlan
    batch_id: bytes

    @property
    def verifier_len(self) -> int:
        return int(self.plan.circuit.verifier_len)

    def verifier_share(self, study: Any, seed: bytes) -> np.ndarray:
        """This server's verifier share at the query point: the record re-received (its shares,
        a helper's seed expanded), then batch_validity.verifier_share."""
        plan, batch = batches.proof_batch(self.stored, study)
        return batch_validity.verifier_share(plan, batch, seed)


def in_proofs(rowids: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """Which of ``rowids`` are rows of a batch proof, ``spans`` their batches' (first, m) by first."""
    rowids = np.asarray(rowids, dtype=np.int64)
    if not len(spans):
        return np.zeros(len(rowids), dtype=bool)
    at = np.searchsorted(spans[:, 0], rowids, side="right") - 1
    ok = at >= 0
    safe = np.maximum(at, 0)
    return ok & (rowids - spans[safe, 0] < spans[safe, 1])


def _sorted_ids(joined: bytes) -> bytes:
    """Concatenated 16-byte ids in ascending bytewise order."""
    hi, lo = idsets.halves(joined)
    order = np.lexsort((lo, hi))
    return idsets.join_halves(hi[order], lo[order])


@dataclass
class Decision:
    """A decision's answer: the refused ids (a report-id list) and the counts."""

    refused: bytes
    decided: int

    @property
    def n_refused(self) -> int:
        return len(self.refused) // REPORT_ID_BYTES


class Rounds:
    """The verification rounds of one store's validity studies."""

    def __init__(self, store: "Store"):
        self.store = store
        self.backend = store.backend
        self.server_id = store.settings.server_id
        #: taken to queue an upload or a round's commit (module docstring)
        self.gate = threading.Lock()
        self._closed: set[int] = set()  # studies (seq) closed to uploads
        self._rounds: dict[int, Round] = {}
        self._lock = threading.Lock()
        #: the queries' answers kept for the decisions (services/verify_cache.py)
        self.cache = verify_cache.VerifierCache(store.settings.verify_cache_dir)
        #: decisions stored by this process, by where its own verifier shares came from ("cache":
        #: the query's kept answer; "recomputed"): the dpsketch_verify_decisions metric
        self.decided_from = {"cache": 0, "recomputed": 0}
        #: a study with batch_proofs: its batches' own verifier shares from its query, by study
        #: (seq), for the decision (query seed, {batch id: share}); V elements a batch, so kept in
        #: memory. Without them (a restart, another replica) the decision recomputes them.
        self._batch_shares: dict[int, tuple[bytes, dict[bytes, np.ndarray]]] = {}

    def load(self, conn: Any) -> None:
        """At start: which studies are closed to uploads (their rounds are read when asked for);
        the kept answers of every study not waiting for its decision are removed."""
        self._closed = {int(seq) for (seq,) in conn.execute("SELECT study FROM verifications").fetchall()}
        if self.cache.enabled:
            waiting = {str(sid) for (sid,) in conn.execute(
                "SELECT s.study_id FROM verifications v JOIN studies s ON s.seq = v.study "
                "LEFT JOIN closures x ON x.study = v.study "
                "WHERE v.query_seed IS NOT NULL AND v.decided_hash IS NULL AND x.study IS NULL").fetchall()}
            self.cache.sweep(self.server_id, waiting)

    def close(self) -> None:
        """At a clean shutdown (Store.close)."""
        self.cache.close()

    def forget(self, record: "StudyRecord") -> None:
        """The study was dropped or expired: its kept answer goes (it will not be decided)."""
        self.cache.discard(self.server_id, record.study_id)
        self._batch_shares.pop(record.seq, None)

    def _cache_key(self, record: "StudyRecord", plans: list[Any], seed: bytes, run: Any) -> verify_cache.Key:
        digest = hashlib.sha256()
        for start in range(0, len(run), 1 << 16):
            digest.update(idsets.join_halves(run.hi[start:start + (1 << 16)], run.lo[start:start + (1 << 16)]))
        return self._key(record, plans, seed, len(run), digest.digest())

    def _key(self, record: "StudyRecord", plans: list[Any], seed: bytes, count: int,
             held_digest: bytes) -> verify_cache.Key:
        return verify_cache.Key(self.server_id, record.study_id, seed, count, held_digest,
                                validity.verifier_len(record.study), len(plans))

    # --- uploads -----------------------------------------------------------------------------
    def admit(self, record: "StudyRecord", submit: Callable[[], Any]) -> Any:
        """``submit()`` (queue an upload to the writer) unless the study's round has begun: 409
        uploads-closed. Under the gate, so that no upload is queued behind a round's commit."""
        with self.gate:
            if record.seq in self._closed:
                raise ProblemError("uploads-closed", f"study {record.study_id} is being verified (its "
                                   f"verification round began): it takes no more reports")
            return submit()

    def closed_in(self, conn: Any, record: "StudyRecord") -> bool:
        """A store shared with other replicas, under the study's row lock: whether some replica
        closed the study (taken into this one's gate too)."""
        if record.study.validity is None:
            return False
        if record.seq not in self._closed and conn.execute(
                "SELECT 1 FROM verifications WHERE study = ?", (record.seq,)).fetchone():
            self._closed.add(record.seq)
        return record.seq in self._closed

    # --- state -------------------------------------------------------------------------------
    def _read(self, conn: Any, seq: int) -> Round | None:
        row = conn.execute(f"SELECT {_COLUMNS} FROM verifications WHERE study = ?", (seq,)).fetchone()
        return None if row is None else Round.of_row(row)

    def round(self, record: "StudyRecord") -> Round | None:
        """The study's round as stored (cached; a shared store re-reads it)."""
        with self._lock:
            cached = self._rounds.get(record.seq)
        if cached is not None and not self.store.shared:  # this process wrote every step
            return cached
        with self.store._reading() as conn:
            got = self._read(conn, record.seq)
        if got is not None:
            with self._lock:
                self._rounds[record.seq] = got
        return got

    def _store(self, fn: Callable[[Any], tuple[Any, Callable[[], None] | None]]) -> Any:
        return self.store.writer.submit(CallJob(fn)).result()

    def _remember(self, seq: int, rnd: Round) -> Callable[[], None]:
        def apply() -> None:
            with self._lock:
                self._rounds[seq] = rnd
            self._closed.add(seq)
        return apply

    @staticmethod
    def _plan(record: "StudyRecord") -> list[Any]:
        """The study's plans: its reports' one, or one per party (a block is proved with its
        party's: validity.plans)."""
        study = record.study
        if study.validity is None:
            raise ProblemError("invalid-request", f"study {record.study_id} has no validity proofs: it "
                               f"has no verification round")
        return validity.plans(study)

    def _position(self, record: "StudyRecord") -> int:
        return record.study.servers.index(self.server_id)

    @staticmethod
    def _open(record: "StudyRecord") -> None:
        if record.closure is not None:
            raise ProblemError("study-closed", f"study {record.study_id} was {record.closure.reason}: it "
                               f"releases nothing and is not verified")

    def _started(self, record: "StudyRecord", step: str) -> Round:
        rnd = self.round(record)
        if rnd is None:
            raise ProblemError("verification-pending", f"study {record.study_id}: {step} before "
                               f"verify/commit; run the round's steps in order")
        return rnd

    # --- 1. commit ---------------------------------------------------------------------------
    def commit(self, record: "StudyRecord") -> Commitment:
        """Close the study to uploads, draw and store this server's contribution, answer its
        commitment (the same on every repeat)."""
        self._plan(record)
        study = record.study
        position = self._position(record)
        rnd = self.round(record)
        if rnd is None:
            self._open(record)
            if record.commit is not None:
                raise ProblemError("study-closed", f"study {record.study_id} is committed; it is not verified")
            contribution = validity.new_contribution()
            fresh = Round(contribution, validity.commitment(study.study_id, position, contribution), time.time())

            def fn(conn: Any) -> tuple[Round, Callable[[], None]]:
                if self.store.shared:  # one round per study whichever replica is asked
                    self.backend.lock_study(conn, record.seq)
                stored = self._read(conn, record.seq)
                if stored is None:
                    if record.closure is not None:
                        raise ProblemError("study-closed", f"study {record.study_id} was {record.closure.reason}")
                    conn.execute("INSERT INTO verifications (study, contribution, commitment, committed_at) "
                                 "VALUES (?, ?, ?, ?)", (record.seq, fresh.contribution, fresh.commitment,
                                                         fresh.committed_at))
                    stored = fresh
                    log.info("study %s: closed to uploads for its verification round (%d reports held)",
                             record.study_id, self.store.held(record))
                return stored, self._remember(record.seq, stored)

            with self.gate:  # every upload queued before this job is stored before it; none after
                self._closed.add(record.seq)
                future = self.store.writer.submit(CallJob(fn))
            rnd = future.result()
        return Commitment(study_id=study.study_id, server_id=self.server_id, position=position,
                          commitment=rnd.commitment.hex())

    # --- 2. reveal ---------------------------------------------------------------------------
    def reveal(self, record: "StudyRecord", commitments: list[bytes]) -> Contribution:
        """Store the N commitments (once), answer this server's contribution."""
        self._plan(record)
        study = record.study
        position = self._position(record)
        rnd = self._started(record, "verify/reveal")
        if len(commitments) != study.n_servers:
            raise ProblemError("verification-refused", f"the round of study {study.study_id} has "
                               f"{study.n_servers} commitments, one per server; got {len(commitments)}")
        if commitments[position] != rnd.commitment:
            raise ProblemError("verification-refused", f"commitment {position} is not this server's "
                               f"(server {self.server_id} is at position {position} of the study's servers)")
        joined = b"".join(commitments)
        if rnd.commitments is None:
            def fn(conn: Any) -> tuple[Round, Callable[[], None]]:
                stored = self._read(conn, record.seq)
                assert stored is not None
                if stored.commitments is None:
                    conn.execute("UPDATE verifications SET commitments = ? WHERE study = ?", (joined, record.seq))
                    stored.commitments = joined
                return stored, self._remember(record.seq, stored)

            rnd = self._store(fn)
        if rnd.commitments != joined:
            raise ProblemError("verification-conflict", f"study {study.study_id}: this server revealed its "
                               f"contribution for another list of commitments; it reveals for no other")
        return Contribution(study_id=study.study_id, server_id=self.server_id, position=position,
                            contribution=rnd.contribution.hex())

    # --- 3. query ----------------------------------------------------------------------------
    def fix_seed(self, record: "StudyRecord", contributions: list[bytes]) -> tuple[Round, Any]:
        """Check the contributions against the commitments and store the query seed (once)."""
        plan = self._plan(record)
        study = record.study
        rnd = self._started(record, "verify/query")
        if rnd.commitments is None:
            raise ProblemError("verification-pending", f"study {study.study_id}: verify/query before "
                               f"verify/reveal; run the round's steps in order")
        if len(contributions) != study.n_servers:
            raise ProblemError("verification-refused", f"the round of study {study.study_id} has "
                               f"{study.n_servers} contributions, one per server; got {len(contributions)}")
        commitments = [rnd.commitments[i * 32:(i + 1) * 32] for i in range(study.n_servers)]
        wrong = [i for i, c in enumerate(contributions)
                 if validity.commitment(study.study_id, i, c) != commitments[i]]
        if wrong:
            raise ProblemError("verification-refused", f"contribution(s) {wrong} do not open the commitments "
                               f"this server stored for study {study.study_id}", extra={"positions": wrong})
        seed = validity.query_seed(study.study_id, contributions)
        if rnd.query_seed is None:
            joined = b"".join(contributions)

            def fn(conn: Any) -> tuple[Round, Callable[[], None]]:
                stored = self._read(conn, record.seq)
                assert stored is not None
                if stored.query_seed is None:
                    conn.execute("UPDATE verifications SET contributions = ?, query_seed = ? WHERE study = ?",
                                 (joined, seed, record.seq))
                    stored.contributions, stored.query_seed = joined, seed
                    log.info("study %s: query seed fixed", study.study_id)
                return stored, self._remember(record.seq, stored)

            rnd = self._store(fn)
        if rnd.query_seed != seed:  # the commitments bind the contributions: a hash collision
            raise ProblemError("verification-conflict", f"study {study.study_id}: another query seed is fixed")
        return rnd, plan

    def _held_run(self, record: "StudyRecord") -> Any:
        state = self.store.ensure_state(record)
        if state is None:
            raise ProblemError("study-closed", f"study {record.study_id} is no longer open")
        with state.lock:
            return state.ids.consolidate()  # its arrays never change once made

    def _chunk_rows(self, plans: list[Any]) -> int:
        return max(256, CHUNK_BYTES // (8 * max(p.leader_width for p in plans)))

    def verifiers(self, record: "StudyRecord", plans: list[Any], seed: bytes, rowids: np.ndarray,
                  ids: bytes) -> tuple[np.ndarray, np.ndarray]:
        """(m, V, 2) verifier shares of the held reports with these rowids, in the given order
        (``ids``: their ids, concatenated, to check the store against), computed per kind of
        stored payload (seeds, the leader's shares) and per party (a study with parties: each
        block with its party's plan, its share in the first V_j elements and 0 after them) in
        one vectorised call each; and each report's plan (its index in ``plans``)."""
        order = np.argsort(rowids, kind="stable")
        ascending = rowids[order]
        out = np.zeros((len(rowids), validity.verifier_len(record.study), 2), dtype=np.uint64)
        which = np.zeros(len(rowids), dtype=np.int64)
        parts: dict[tuple[int, bool], list[tuple[np.ndarray, bytes, np.ndarray]]] = {}
        at = 0
        for got in self.store._fetch(record.seq, ascending.tolist()):
            n = len(got)
            payload, seeded = batches.study_payloads(got, record.study)
            parts.setdefault((got.party or 0, seeded), []).append((order[at:at + n], got.ids, payload))
            at += n
        got_ids = np.empty(len(rowids) * REPORT_ID_BYTES, dtype=np.uint8).reshape(-1, REPORT_ID_BYTES)
        for (party, seeded), pieces in parts.items():
            where = np.concatenate([p[0] for p in pieces])
            id_matrix = np.frombuffer(b"".join(p[1] for p in pieces), dtype=np.uint8).reshape(-1, REPORT_ID_BYTES)
            payload = np.concatenate([p[2] for p in pieces])
            plan = plans[party]
            inputs, proofs = proved_shares.server_shares(
                record.study, payload, seeded, None if record.study.parties is None else party)
            out[where, :plan.verifier_len] = validity.verifier_shares(plan, seed, id_matrix, inputs, proofs)
            which[where] = party
            got_ids[where] = id_matrix
        if got_ids.tobytes() != ids:  # never: rowids come from the report index
            raise RuntimeError(f"store inconsistent: study {record.study_id}'s stored ids differ from its index")
        return out, which

    def query(self, record: "StudyRecord", contributions: list[bytes]) -> tuple[int, bytes, Iterator[bytes]]:
        """Fix the seed; (how many reports, the seed, the answer's body in pieces): the
        verifier share of every held report, by id, computed a chunk of reports at a time."""
        rnd, plan = self.fix_seed(record, contributions)
        seed = rnd.query_seed
        assert seed is not None
        run = self._held_run(record)
        proofs = record.study.batch_proofs
        held_ids = len(run)
        held_batches: list[HeldBatch] = []
        if proofs:  # the report section: per-report records only (module docstring)
            run, held_batches = self._reports_and_batches(record, run)
        step = self._chunk_rows(plan)
        keep = self.cache.enabled and rnd.decided_hash is None and len(plan) <= 256 and not proofs

        def chunks() -> Iterator[bytes]:
            # validity.encode_verifiers' layout, a piece at a time: the count, every id, then
            # the shares of a chunk of reports after another (what its encoder joins whole);
            # the same bytes go to the cache for the decision, which counts only once whole
            held = hashlib.sha256()
            yield struct.pack("<I", len(run))
            for start in range(0, len(run), 1 << 16):
                piece = idsets.join_halves(run.hi[start:start + (1 << 16)], run.lo[start:start + (1 << 16)])
                held.update(piece)
                yield piece
            writer = self.cache.writer(self._key(record, plan, seed, len(run), held.digest())) if keep else None
            try:
                for start in range(0, len(run), step):
                    ids = idsets.join_halves(run.hi[start:start + step], run.lo[start:start + step])
                    shares, which = self.verifiers(record, plan, seed, np.asarray(run.rowid[start:start + step]), ids)
                    wire = field.to_wire(np.ascontiguousarray(shares))
                    if writer is not None:
                        writer.add_ids(ids)
                        writer.add_shares(start, wire, which)
                    yield wire
                if writer is not None:
                    writer.finish()
                    writer = None
            finally:
                if writer is not None:  # the answer was not all written: no file
                    writer.abort()
            if proofs:  # the batch section: every held batch proof's verifier share, one batch at a time
                kept: dict[bytes, np.ndarray] = {}
                yield struct.pack("<I", len(held_batches))
                for h in sorted(held_batches, key=lambda h: h.batch_id):
                    kept[h.batch_id] = h.verifier_share(record.study, seed)
                    yield batch_verifiers.encode_entry(batch_verifiers.BatchVerifier(h.batch_id, h.plan.m,
                                                                                     kept[h.batch_id]))
                self._batch_shares[record.seq] = (seed, kept)

        return held_ids, seed, chunks()

    def _reports_and_batches(self, record: "StudyRecord", run: Any) -> tuple[_Held, list[HeldBatch]]:
        """A study with batch_proofs: its held per-report records (the run without the batches'
        rows) and its held batch proofs, each with its plan and batch id (batches.proof_batch_id)."""
        with self.store._reading() as conn:
            stored = batches.proof_batches(conn, record.seq)
        spans = np.array([(s.first, len(s)) for s in stored], dtype=np.int64).reshape(-1, 2)
        keep = ~in_proofs(np.asarray(run.rowid), spans)
        reports = _Held(np.asarray(run.hi)[keep], np.asarray(run.lo)[keep], np.asarray(run.rowid)[keep])
        return reports, [HeldBatch(s, *batches.proof_batch_id(s, record.study)) for s in stored]

    def batch_section_limit(self, record: "StudyRecord") -> int:
        """The largest batch section a decision may carry: its count and every held batch's
        entry (a study with batch_proofs; 0 otherwise)."""
        if not record.study.batch_proofs:
            return 0
        with self.store._reading() as conn:
            spans = batches.proof_rows(conn, record.seq)
        return 4 + sum(24 + 16 * batch_validity.study_plan(record.study, int(m)).circuit.verifier_len
                       for _, m in spans.tolist())

    # --- 4. decide ---------------------------------------------------------------------------
    def decide(self, record: "StudyRecord", body: bytes) -> Decision:
        """Add this server's verifier shares to the others' sum in ``body``, decide every report
        it names, store the decided and refused ids; the same answer for the same body, 409
        verification-conflict for any other."""
        plan = self._plan(record)
        study = record.study
        rnd = self._started(record, "verify/decide")
        if rnd.query_seed is None:
            raise ProblemError("verification-pending", f"study {study.study_id}: verify/decide before "
                               f"verify/query; run the round's steps in order")
        digest = hashlib.sha256(body).digest()
        if rnd.decided_hash is not None:
            self.forget(record)
            return self._repeat(record, rnd, digest)
        run: Any = None  # the held run (a study with batch_proofs: without the batches' rows)
        section = b""
        held_batches: list[HeldBatch] = []
        if study.batch_proofs:
            try:
                body_reports, section = batch_verifiers.split(body, validity.verifier_len(study))
            except ValueError as exc:
                raise ProblemError("malformed-body", f"a decision's body: {exc}") from None
            run, held_batches = self._reports_and_batches(record, self._held_run(record))
        else:
            body_reports = body
        try:
            id_matrix, others = validity.decode_verifiers(body_reports, validity.verifier_len(study))  # ids ascending
            entries = batch_verifiers.decode(section, len(section) // 16 + 1) if study.batch_proofs else []
        except ValueError as exc:
            raise ProblemError("malformed-body", f"a decision's body: {exc}") from None
        ids = id_matrix.tobytes()
        hi, lo = idsets.halves(ids)
        if run is None:
            run = self._held_run(record)
        at = messages.locate(run.hi, run.lo, hi, lo)
        missing = np.flatnonzero(at < 0)
        if missing.size:
            first = ids[int(missing[0]) * 16:int(missing[0]) * 16 + 16]
            raise ProblemError("unknown-reports", f"{missing.size} of the {len(hi)} reports of the decision are "
                               f"not held by this server (first: {first.hex()})",
                               extra={"unknown_count": int(missing.size)})
        # the batches first: an unknown one or a wrong length is refused before any report is decided
        batch_ids, batch_refused = self._decide_batches(record, held_batches, entries, rnd.query_seed,
                                                        self._batch_shares.get(record.seq))
        rowids = np.asarray(run.rowid)[at]
        step = self._chunk_rows(plan)
        refused: list[np.ndarray] = []
        seed = rnd.query_seed
        kept = (self.cache.open(self._cache_key(record, plan, seed, run))
                if self.cache.enabled and not study.batch_proofs else None)
        for start in range(0, len(hi), step):
            end = min(start + step, len(hi))
            part = ids[start * 16:end * 16]
            if kept is not None:  # the query's answer, bound to this held run: positions ``at``
                own, which = kept.take(at[start:end])
            else:
                own, which = self.verifiers(record, plan, seed, rowids[start:end], part)
            total = validity.add_verifiers(own, others[start:end])
            part_ids = np.frombuffer(part, dtype=np.uint8).reshape(-1, 16)
            ok = np.zeros(end - start, dtype=bool)
            for j, plan_j in enumerate(plan):  # a block by its party's circuit (the padding is not read)
                mine = np.flatnonzero(which == j)
                if mine.size:
                    ok[mine] = np.asarray(validity.decide(plan_j, part_ids[mine], total[mine, :plan_j.verifier_len]),
                                          dtype=bool)
            refused.append(start + np.flatnonzero(~ok))
        where = np.concatenate(refused) if refused else np.zeros(0, dtype=np.int64)
        refused_ids = np.frombuffer(ids, dtype=np.uint8).reshape(-1, 16)[where].tobytes()
        n_reports, n_refused_reports = len(hi), len(where)
        if batch_ids:  # the batches' rows among the decided and refused ids, all sorted
            ids = _sorted_ids(ids + batch_ids)
            refused_ids = _sorted_ids(refused_ids + batch_refused)
        now = time.time()
        from_cache = kept is not None
        source = "from the query's kept answer" if from_cache else "recomputed"
        kept = None  # unmapped before the file goes

        def fn(conn: Any) -> tuple[Round, Callable[[], None]]:
            stored = self._read(conn, record.seq)
            assert stored is not None
            if stored.decided_hash is None:
                conn.execute("UPDATE verifications SET decided_hash = ?, decided = ?, refused = ?, decided_at = ? "
                             "WHERE study = ?", (digest, ids, refused_ids, now, record.seq))
                stored.decided_hash, stored.decided, stored.refused, stored.decided_at = (
                    digest, ids, refused_ids, now)
                log.info("study %s: decided %d reports, refused %d (own shares %s); batch rows decided %d, "
                         "refused %d", study.study_id, n_reports, n_refused_reports, source,
                         len(batch_ids) // REPORT_ID_BYTES, len(batch_refused) // REPORT_ID_BYTES)
                self.decided_from["cache" if from_cache else "recomputed"] += 1
            return stored, self._remember(record.seq, stored)

        decided = self._store(fn)
        self.forget(record)
        return self._repeat(record, decided, digest)

    @staticmethod
    def _decide_batches(record: "StudyRecord", held: list[HeldBatch], entries: list[batch_verifiers.BatchVerifier],
                        seed: bytes, kept: tuple[bytes, dict[bytes, np.ndarray]] | None) -> tuple[bytes, bytes]:
        """Decide every batch the decision names, whole: (the row ids of them all, those of the
        refused ones), concatenated; this server's own shares from ``kept`` (its query's, at
        ``seed``), else recomputed. An unknown batch id: 422 unknown-reports; an entry whose m
        or V is not its batch's: 400 malformed-body (as a report section's wrong length)."""
        by_id = {h.batch_id: h for h in held}
        mine = kept[1] if kept is not None and kept[0] == seed else {}
        unknown = [e for e in entries if e.batch_id not in by_id]
        if unknown:
            raise ProblemError("unknown-reports", f"{len(unknown)} of the {len(entries)} batches of the decision are "
                               f"not held by this server (first: {unknown[0].batch_id.hex()})",
                               extra={"unknown_count": len(unknown)})
        for e in entries:  # every entry checked before any verifier is computed
            h = by_id[e.batch_id]
            try:
                if e.m != h.plan.m:
                    raise validity.ValidityError(f"batch {e.batch_id.hex()}: {e.m} rows, it holds {h.plan.m}")
                batch_verifiers.check_lengths(e, h.verifier_len)
            except validity.ValidityError as exc:
                raise ProblemError("malformed-body", f"a decision's batch section: {exc}") from None
        decided, refused = [], []
        for e in entries:
            h = by_id[e.batch_id]
            own = mine.get(e.batch_id)
            if own is None:
                own = h.verifier_share(record.study, seed)
            decided.append(h.stored.ids)
            if not batch_validity.accepts(h.plan, e.batch_id, [own, e.share]):
                refused.append(h.stored.ids)
        return b"".join(decided), b"".join(refused)

    @staticmethod
    def _repeat(record: "StudyRecord", rnd: Round, digest: bytes) -> Decision:
        if rnd.decided_hash != digest:
            raise ProblemError("verification-conflict", f"study {record.study_id} was decided on other "
                               f"verifier shares; a server decides each study once")
        return Decision(rnd.refused or b"", rnd.n_decided)

    # --- the commit's checks -----------------------------------------------------------------
    def require_decided(self, record: "StudyRecord") -> Round | None:
        """Before a validity study's commit: its round must have decided (409 verification-pending)."""
        if record.study.validity is None:
            return None
        rnd = self.round(record)
        if rnd is None or rnd.decided_at is None:
            raise ProblemError("verification-pending", f"study {record.study_id} has validity proofs and "
                               f"its verification round has not decided here: run verify/commit, reveal, "
                               f"query and decide first")
        return rnd

    def check_inclusion(self, record: "StudyRecord", hi: np.ndarray, lo: np.ndarray) -> None:
        """422 report-refused unless every included id was decided here and none was refused."""
        rnd = self.require_decided(record)
        if rnd is None:
            return
        dhi, dlo = rnd.halves("decided")
        undecided = int(np.count_nonzero(messages.locate(dhi, dlo, hi, lo) < 0))
        rhi, rlo = rnd.halves("refused")
        refused = int(np.count_nonzero(messages.locate(rhi, rlo, hi, lo) >= 0)) if len(rhi) else 0
        if undecided or refused:
            raise ProblemError(
                "report-refused", f"the inclusion set holds {refused} report(s) this server refused "
                f"(their proofs do not verify) and {undecided} it did not decide; commit the reports every "
                f"server accepted", extra={"refused": refused, "undecided": undecided})
