"""The single writer thread: group commit of uploads, and every other write, in order.

Why one thread: SQLite allows one writer at a time anyway, and a single owner of every write
makes the in-memory checks (duplicate, conflict, capacity, study closed) race-free. PostgreSQL
would take concurrent writers; the store keeps the one thread per process there too (same
checks, same order). Replicas of one server sharing a PostgreSQL database each have their own
writer: a group first locks the rows of its studies (in study order, so two replicas cannot
deadlock) and catches up on what the other replicas stored (``catch_up``, store.py), so the same
checks hold across replicas; the database's unique constraints back them (services/pg.py). Why group
commit: an fsync per report caps a disk at a few hundred reports/s; instead the thread drains
whatever requests queued up while the previous transaction was syncing, stores them all in one
transaction (one fsync) and only then acknowledges each. A request is all-or-nothing: it is
validated completely in memory before any of its rows is written, and refused requests in a
group do not affect the others. If the transaction fails (locked, disk full, database down)
every request in it gets 503 and nothing in memory changes.

Single uploads from the ASGI fast path (uploads.py, FastReports) come as ``SingleUpload``
jobs: the raw report, not yet bound. The writer checks a group's bindings in one call
(``_bind_singles``: one compiled loop instead of two hashlib calls per request on the event
loop), leaves out a report whose binding fails (its ``Outcome`` gets ``Unbound``, so the route
answers 422 as it always did, nothing of it stored) and answers the others with an
``Acknowledgement`` tuple.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from dpsketch.protocol import binding, proved_shares
from dpsketch.protocol.messages import IdList, UploadResult, joined_ids
from dpsketch.protocol.problems import ProblemError

from . import backend as backends
from . import batches, checkpoint, idsets
from .idsets import SortedIds
from .settings import Settings
from .state import StudyRecord, StudyState

log = logging.getLogger("dpsketch.server")


@dataclass
class UploadJob:
    """One upload request: m reports of one study, already parsed and hashed."""

    record: StudyRecord
    ids: Sequence[bytes]  # a list, or an IdList over a batch body's ids
    shares: np.ndarray  # (m, d) uint64
    rows: np.ndarray | None  # from Study.hash_report_ids; None: the writer hashes
    signs: np.ndarray | None
    token: bytes | None = None  # digest of the upload token it came with; charged for new reports
    #: blocks of one party (a study with parties): each record's pseudonym, and the party index
    pseudonyms: list[bytes] | None = None
    party: int | None = None
    #: whether the study required an upload token when the request was checked (HTTP layer)
    required: bool = True
    future: Future = field(default_factory=Future)
    #: an asyncio future of the event loop waiting for this job (None: the caller waits on
    #: ``future``); the writer settles the waiters of a whole group with one loop callback
    waiter: Any = None
    #: the ids sorted, by the worker thread that checked a batch (None: the writer sorts)
    sorted_ids: SortedIds | None = None
    #: a batch that came as seeds: each report's (m, 32) uint8 seed, stored instead of its share
    #: where that is smaller (services/batches.py, ``stores_seeds``)
    seeds: np.ndarray | None = None
    #: a study with validity proofs: what each report adds to the running totals, (m, 2 w)
    #: (proved_shares.addends of ``shares``, made by the worker thread that checked the batch)
    addends: np.ndarray | None = None
    #: a batch proof (docs/protocol.md section 4d; not a single upload's binding ``proof``): its
    #: record as received, stored whole as one batch row whose reports are its m rows (``ids``:
    #: the row ids; ``addends``: what they fold; ``shares``: the record as one uint8 row, what the
    #: writer's queue counts), and the position it was received at (services/batches.py).
    #: Duplicates and conflicts are judged on the record's bytes (Writer._classify_proof).
    proof_record: bytes | None = None
    proof_position: int | None = None

    @functools.cached_property
    def joined(self) -> bytes:
        """The ids concatenated (for the report index and the INSERT), built once."""
        return joined_ids(self.ids)

    def slots(self) -> list[bytes]:
        """The (pseudonym, party) slot of each block: one block per individual and party."""
        tag = bytes((self.party or 0,))
        return [p + tag for p in self.pseudonyms or ()]


class Outcome:
    """What the writer answers one single upload: the part of a ``concurrent.futures.Future``'s
    API that the writer and the event loop use, without its Condition and callbacks. Why: a
    Future per single upload (a Condition and a lock made, notified and called back) cost more
    than the upload's share of a group commit. Only the writer thread settles it, and the event
    loop reads it after the writer's wake-up (Writer._wake); starting and cancelling, which race
    between the two threads, take one lock shared by every Outcome."""

    __slots__ = ("_state", "_result", "_exception")
    _transition = threading.Lock()

    def __init__(self) -> None:
        self._state = _PENDING
        self._result: Any = None
        self._exception: BaseException | None = None

    def set_running_or_notify_cancel(self) -> bool:
        with Outcome._transition:
            if self._state == _CANCELLED:
                return False
            self._state = _RUNNING
            return True

    def cancel(self) -> bool:
        with Outcome._transition:
            if self._state != _PENDING:
                return False
            self._state = _CANCELLED
            return True

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def done(self) -> bool:
        return self._state == _FINISHED or self._state == _CANCELLED

    def set_result(self, result: Any) -> None:
        self._result, self._state = result, _FINISHED

    def set_exception(self, exception: BaseException) -> None:
        self._exception, self._state = exception, _FINISHED

    def exception(self) -> BaseException | None:
        return self._exception

    def result(self) -> Any:
        if self._exception is not None:
            raise self._exception
        return self._result


_PENDING, _RUNNING, _FINISHED, _CANCELLED = range(4)


class Acknowledgement(NamedTuple):
    """A stored single upload's answer (UploadResult's fields; a tuple costs a fifth of the
    model, and the fast path writes its JSON itself: services/uploads.result_json)."""

    accepted: int
    duplicates: int
    report_count: int | None


class Unbound(Exception):
    """A single upload whose share is not the one its report id commits to: nothing of it is
    stored, and the fast path hands it to the route, which answers it in its own order."""


class SingleUpload(UploadJob):
    """One single report from the fast path (services/uploads.py), its binding not yet checked:
    the writer checks the bindings of a group's single reports at once
    (:meth:`Writer._bind_singles`; vectorised, not two hashlib calls and two numpy arrays per
    request on the event loop). Made field by field, without the dataclass's __init__ and
    without a ``concurrent.futures.Future`` (an :class:`Outcome` instead)."""

    def __init__(self, record: StudyRecord, report_id: bytes, proof: bytes, share: bytes,
                 token: bytes | None, waiter: Any) -> None:
        self.record = record
        self.ids = [report_id]
        self.joined = report_id  # the cached_property's value, set at once
        self.proof = proof
        self.share = share
        self.shares = None  # type: ignore[assignment]  # a (1, width) row once bound
        self.rows = self.signs = None
        self.token = token
        self.pseudonyms = None
        self.party = None
        self.required = record.upload_required
        self.future = Outcome()  # type: ignore[assignment]
        self.waiter = waiter
        self.sorted_ids = None


@dataclass
class CallJob:
    """Any other write: ``fn(conn)`` runs inside its own transaction and returns
    ``(result, apply)``; ``apply()`` (may be None) updates memory after COMMIT succeeded."""

    fn: Callable[[Any], tuple[Any, Callable[[], None] | None]]  # a database connection
    future: Future = field(default_factory=Future)


_STOP = object()
#: requests of at most this many reports are checked together (Writer._plan_singles)
_SINGLES_MAX_IDS = 8
_NONE: frozenset[bytes] = frozenset()


def quota_problem(room: int | None, study_id: str, n_new: int) -> ProblemError:
    """The refusal of a request with more new reports than its upload token may still add."""
    return ProblemError(
        "upload-quota-exceeded",
        f"this upload token may add {max(room or 0, 0)} more report(s) to study {study_id}, and the "
        f"request has {n_new} new ones (revoked, or its quota is used up); nothing of it was stored; "
        f"ask the server's operator for a token")


@dataclass
class _Plan:
    """An accepted request: which of its rows are new (``new`` is None when all are)."""

    job: UploadJob
    new: np.ndarray | None
    duplicates: int
    report_count: int
    _new_ids: set[bytes] | None  # None: made when asked for (a large request accepted whole)
    new_slots: set[bytes] = field(default_factory=set)  # blocks: the slots this request fills
    _rows_by_id: dict[bytes, int] | None = None
    memory: int = 0  # what it adds to the memory budget's count (StudyRecord.memory_growth)

    @property
    def n_new(self) -> int:
        return len(self.job.ids) if self.new is None else len(self.new)

    @property
    def new_ids(self) -> set[bytes]:
        """The ids this request adds (a set, made on first use)."""
        if self._new_ids is None:
            self._new_ids = set(self.take_ids())
        return self._new_ids

    @property
    def sorted_whole(self) -> SortedIds | None:
        """The request's ids sorted, when it is accepted whole and has them (a large request):
        the group's later requests are checked against these arrays, not a set."""
        return self.job.sorted_ids if self.new is None else None

    def row_of(self, rid: bytes) -> int:
        """Row of a new id in this request (built only when a later request repeats one)."""
        if self._rows_by_id is None:
            rows = range(len(self.job.ids)) if self.new is None else self.new.tolist()
            self._rows_by_id = {self.job.ids[i]: i for i in rows}
        return self._rows_by_id[rid]

    def take(self, array: np.ndarray) -> np.ndarray:
        return array if self.new is None else array[self.new]

    def take_ids(self) -> list[bytes]:
        return self.job.ids if self.new is None else [self.job.ids[i] for i in self.new.tolist()]

    def take_pseudonyms(self) -> list[bytes]:
        p = self.job.pseudonyms or []
        return p if self.new is None else [p[i] for i in self.new.tolist()]


class Writer:
    def __init__(self, conn: Any, settings: Settings,
                 ensure_state: Callable[[StudyRecord], StudyState | None],
                 memory_in_use: Callable[[], int] = lambda: 0, backend: Any = None,
                 catch_up: Callable[[Any, StudyRecord, set[bytes]], None] | None = None):
        """``catch_up(conn, record, token_digests)``: a store shared with other replicas locks
        the study's row and brings this process's view of it up to date (store.py)."""
        self.conn = conn
        #: SQLite or PostgreSQL (services/backend.py): how a transaction begins, which errors mean 503
        self.backend = backend if backend is not None else backends.SqliteBackend(settings.db_path,
                                                                                  settings.busy_timeout_s)
        self.db_errors = self.backend.errors
        self.settings = settings
        self.ensure_state = ensure_state
        self.memory_in_use = memory_in_use
        self.catch_up = catch_up
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # C put and get: no Condition per job
        self.next_rowid = batches.next_rowid(conn)
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self._stopping = False
        self._running = True  # until _loop returns (a flag: Thread.is_alive costs a lock per upload)
        self.thread = threading.Thread(target=self._loop, name="dpsketch-writer", daemon=True)
        self.thread.start()

    # --- API ---------------------------------------------------------------------------------
    def submit(self, job: UploadJob | CallJob) -> Future:
        """Queue a job, or refuse with 503 when saturated (bounded memory) or stopping."""
        single = type(job) is SingleUpload
        size = (len(job.share) if single else job.shares.nbytes + (0 if job.addends is None else job.addends.nbytes)
                if isinstance(job, UploadJob) else 0)
        with self._lock:
            if self._stopping or not self._running:
                raise ProblemError("unavailable", "the server is shutting down", headers={"Retry-After": "5"})
            if (self.queue.qsize() >= self.settings.max_queued_jobs
                    or (self._queued_bytes and self._queued_bytes + size > self.settings.max_queued_bytes)):
                raise ProblemError("unavailable", "the server is saturated with writes; retry shortly",
                                   headers={"Retry-After": "1"})
            self._queued_bytes += size
            self.queue.put(job)
        if not single:  # a single upload's bytes are released when the writer takes it (_loop)
            job.future.add_done_callback(lambda _f: self._release(size))
        return job.future

    def _release(self, size: int) -> None:
        with self._lock:
            self._queued_bytes -= size

    @property
    def queued_bytes(self) -> int:
        """Share bytes waiting for the writer (refused with 503 at max_queued_bytes)."""
        return self._queued_bytes

    @property
    def stopping(self) -> bool:
        """Whether the writer takes no new work (the server is shutting down)."""
        return self._stopping

    def stop(self, timeout: float = 30.0) -> None:
        """Finish every queued job, then end the thread; refuse anything submitted after."""
        with self._lock:
            self._stopping = True
            self.queue.put(_STOP)
        self.thread.join(timeout)

    # --- loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            self._running = False

    def _serve(self) -> None:
        held: Any = None
        while True:
            job = held if held is not None else self.queue.get()
            held = None
            if job is _STOP:
                return
            if type(job) is SingleUpload:
                self._release(len(job.share))
            if not job.future.set_running_or_notify_cancel():
                continue  # the client went away before we started: nothing stored, nothing owed
            if isinstance(job, CallJob):
                self._guarded(self._run_call, job)
                self.backend.after_writes(self.conn)
                continue
            group = [job]
            rows = len(job.ids)
            freed = 0  # the bytes of the single uploads taken from the queue below
            while rows < self.settings.max_group_rows and len(group) < self.settings.max_group_jobs:
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(nxt, UploadJob):
                    held = nxt  # keep the order: finish this group first
                    break
                if type(nxt) is SingleUpload:
                    freed += len(nxt.share)
                if nxt.future.set_running_or_notify_cancel():
                    group.append(nxt)
                    rows += len(nxt.ids)
            if freed:
                self._release(freed)
            self._guarded(self._run_uploads, group)
            self._wake(group)  # the failure paths' waiters (the acknowledged ones are woken already)
            self.backend.after_writes(self.conn)  # the WAL's checkpoints (services/wal.py)

    def _guarded(self, fn: Callable, arg: Any) -> None:
        """Never let the writer thread die: an unexpected error fails the affected requests, and
        the running totals of the studies involved are rebuilt from the database on next use
        (the transaction may have committed before the error)."""
        try:
            fn(arg)
        except Exception as exc:  # pragma: no cover - defensive
            log.exception("writer: unexpected error")
            self.backend.rollback_quietly(self.conn)
            jobs = arg if isinstance(arg, list) else [arg]
            for job in jobs:
                if isinstance(job, UploadJob):
                    with job.record.load_lock:
                        job.record.state = None
                if not job.future.done():
                    job.future.set_exception(self.backend.unavailable(exc))
            try:
                self.next_rowid = batches.next_rowid(self.conn)
            except self.db_errors:
                pass

    @staticmethod
    def _wake(jobs: list[UploadJob]) -> None:
        """Settle the asyncio waiters of finished jobs: one callback per event loop for the whole
        group, not one per job (a cross-thread wake-up costs the loop more than the answer)."""
        by_loop: dict[Any, list[tuple[Any, Future]]] = {}
        for job in jobs:
            waiter = job.waiter
            if waiter is not None and job.future.done():
                job.waiter = None
                by_loop.setdefault(waiter.get_loop(), []).append((waiter, job.future))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle, pairs)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _run_call(self, job: CallJob) -> None:
        try:
            self.backend.begin(self.conn)
            result, apply = job.fn(self.conn)
            self.conn.execute("COMMIT")
        except ProblemError as exc:
            self.backend.rollback_quietly(self.conn)
            job.future.set_exception(exc)
            return
        except self.db_errors as exc:
            self.backend.rollback_quietly(self.conn)
            log.warning("writer: transaction failed: %s", exc)
            job.future.set_exception(self.backend.unavailable(exc))
            return
        if apply is not None:
            apply()
        job.future.set_result(result)

    # --- uploads -----------------------------------------------------------------------------
    def _bind_singles(self, group: list[UploadJob]) -> list[UploadJob]:
        """Check the bindings of the group's single uploads, per study at once (binding.unbound),
        and give each bound one its share row; the unbound are refused with :class:`Unbound`
        and left out of what the group stores. Returns the group without them."""
        by_study: dict[int, list[SingleUpload]] = {}
        for job in group:
            if type(job) is SingleUpload:
                by_study.setdefault(job.record.seq, []).append(job)
        if not by_study:
            return group
        refused: set[int] = set()
        for jobs in by_study.values():
            study = jobs[0].record.study
            m, width = len(jobs), study.width
            proofs = np.frombuffer(b"".join([job.proof for job in jobs]), dtype=np.uint8).reshape(m, -1)
            shares = np.frombuffer(b"".join([job.share for job in jobs]), dtype="<u8").reshape(m, width).copy()
            wrong = binding.unbound(study.study_id, study.n_servers, study.servers.index(self.settings.server_id),
                                    binding.CONTENT_SHARE, [job.ids[0] for job in jobs], proofs, shares)
            for i, job in enumerate(jobs):
                job.shares = shares[i:i + 1]
            for i in wrong.tolist():
                jobs[i].future.set_exception(Unbound())
                refused.add(id(jobs[i]))
        return [job for job in group if id(job) not in refused] if refused else group

    def _run_uploads(self, group: list[UploadJob]) -> None:
        group = self._bind_singles(group)
        if not group:
            return
        plans: list[_Plan] = []
        pending: dict[int, list[_Plan]] = {}  # per study: accepted requests of this group
        charged: dict[tuple[int, bytes], int] = {}  # (study, token) -> new reports in this group
        taken: dict[int, tuple[set[bytes], set[bytes]]] = {}  # per study: the new ids and slots so far
        budget = self.settings.memory_budget - self.memory_in_use()
        try:
            self.backend.begin(self.conn)
            if self.catch_up is not None:  # lock the studies in one order: no deadlock between replicas
                records = {job.record.seq: job.record for job in group}
                for seq in sorted(records):
                    self.catch_up(self.conn, records[seq],
                                  {job.token for job in group if job.record.seq == seq and job.token is not None})
            singles = self._plan_singles(group, budget)
            if singles is not None:  # every request new and within every limit: one check for all
                plans = singles
                pending[group[0].record.seq] = singles
                for plan in singles:
                    if plan.job.token is not None:
                        key = (plan.job.record.seq, plan.job.token)
                        charged[key] = charged.get(key, 0) + plan.n_new
            for job in group if singles is None else ():
                plan = self._plan(job, pending, charged, budget, taken)
                if plan is not None:
                    plans.append(plan)
                    pending.setdefault(job.record.seq, []).append(plan)
                    ids_so_far, slots_so_far = taken.setdefault(job.record.seq, (set(), set()))
                    if plan.sorted_whole is None:  # a large request whole: checked by its arrays
                        ids_so_far.update(plan.new_ids)
                    slots_so_far.update(plan.new_slots)
                    budget -= plan.memory
                    if job.token is not None and plan.n_new:
                        key = (job.record.seq, job.token)
                        charged[key] = charged.get(key, 0) + plan.n_new
            inserted = self._insert(pending)
            self.conn.executemany("UPDATE upload_tokens SET used = used + ? WHERE study = ? AND digest = ?",
                                  [(n, seq, digest) for (seq, digest), n in charged.items()])
            self.conn.execute("COMMIT")
        except self.db_errors as exc:
            self.backend.rollback_quietly(self.conn)
            log.warning("writer: group of %d requests failed: %s", len(group), exc)
            for job in group:
                if not job.future.done():
                    job.future.set_exception(self.backend.unavailable(exc))
            return
        for record, base, ids, joined, shares, rows, signs, parts in inserted:
            self.next_rowid = max(self.next_rowid, base + len(ids))
            state = record.state
            assert state is not None
            with state.lock:
                if isinstance(shares, _Blocks):
                    state.add_blocks(shares.party, ids, range(base, base + len(ids)), shares.pseudonyms, joined)
                else:
                    state.add(record.study, ids, range(base, base + len(ids)), shares, rows, signs, joined, parts)
                record.report_count = state.report_count
        for plan in plans:
            token = plan.job.record.upload_tokens.get(plan.job.token) if plan.job.token else None
            if token is not None:
                token.used += plan.n_new
        for plan in plans:
            hide = plan.job.record.study.neighbouring == "add-remove"  # the count tells membership
            # a single upload's acknowledgement is read by the fast path only: a tuple, not a model
            result = Acknowledgement if type(plan.job) is SingleUpload else UploadResult
            plan.job.future.set_result(result(accepted=plan.n_new, duplicates=plan.duplicates,
                                              report_count=None if hide else plan.report_count))
        self._wake(group)
        for record, *_ in inserted:  # after the acknowledgements: a checkpoint delays no client
            self._checkpoint_if_due(record)

    def _checkpoint_if_due(self, record: StudyRecord) -> None:
        """A checkpoint of the study's state once it grew enough (services/checkpoint.py), in its
        own transaction after the uploads' one: a failure costs only restart time."""
        state = record.state
        if state is not None and checkpoint.due(record, state):
            checkpoint.save(self.conn, self.backend, record, state)

    def _plan(self, job: UploadJob, pending: dict[int, list[_Plan]],
              charged: dict[tuple[int, bytes], int] | None = None, budget: int | None = None,
              taken: dict[int, tuple[set[bytes], set[bytes]]] | None = None) -> _Plan | None:
        """Validate one request against what is stored and what this group stores before it.
        Refusals resolve the job's future and return None; nothing of it is written.
        ``taken``: per study, the union of the new ids and slots of ``pending`` (one set lookup
        per id rather than one per earlier request of the group)."""
        record = job.record
        if record.commit is not None:
            job.future.set_exception(ProblemError(
                "study-closed", f"study {record.study_id} is committed; it takes no more reports"))
            return None
        if record.closure is not None:
            job.future.set_exception(ProblemError(
                "study-closed", f"study {record.study_id} was {record.closure.reason} (it released "
                f"nothing); it takes no more reports"))
            return None
        if self.catch_up is not None and record.upload_required and not job.required and job.token is None:
            # a replica: another one issued the study's first upload token since the HTTP check
            job.future.set_exception(ProblemError(
                "unauthorized", f"study {record.study_id} takes uploads only with one of its upload "
                f"tokens, issued by this server's operator", headers={"WWW-Authenticate": "Bearer"}))
            return None
        state = self.ensure_state(record)
        assert state is not None
        earlier = pending.get(record.seq, [])
        ids = job.ids
        mine = job.sorted_ids if not job.pseudonyms else None  # a large request: arrays, no set
        as_set = None if mine is not None else set(ids)
        repeats = mine.repeats() if mine is not None else len(as_set) != len(ids)
        slots = job.slots()
        slot_set = set(slots)
        with state.lock:  # a commit's match may be merging the index's runs meanwhile
            held_any = state.ids.any_held(job.joined, ids, job.sorted_ids)
        # the earlier requests of the group: large ones accepted whole by their sorted ids, the
        # rest by the union of their new ids (``taken``)
        large = [p.sorted_whole for p in earlier if p.sorted_whole is not None]
        if taken is not None:
            group_ids, group_slots = taken.get(record.seq, (_NONE, _NONE))
            new_in_group = ((group_ids.isdisjoint(as_set) if as_set is not None else not _any_of(group_ids, mine))
                            and group_slots.isdisjoint(slot_set)
                            and not any(_overlap(other, mine, job.joined) for other in large))
        else:
            new_in_group = (all(p.new_ids.isdisjoint(ids) for p in earlier)
                            and all(p.new_slots.isdisjoint(slot_set) for p in earlier))
        if (not repeats and not held_any and new_in_group
                and len(slot_set) == len(slots) and state.slots.keys().isdisjoint(slot_set)):
            new, duplicates, new_ids, new_slots = None, 0, as_set, slot_set
        else:
            outcome = (self._classify(job, state, earlier) if job.proof_record is None
                       else self._classify_proof(job, state, earlier))
            if isinstance(outcome, ProblemError):
                job.future.set_exception(outcome)
                return None
            new, duplicates = outcome
            new_ids = {ids[i] for i in new.tolist()}
            new_slots = {slots[i] for i in new.tolist()} if slots else set()
        n_new = len(ids) if new is None else len(new)
        held = earlier[-1].report_count if earlier else len(state.ids)
        # The token's quota first: a refusal a client can cause must not depend on what the
        # study holds (the capacity check below does), or a quota-1 token posting an oversized
        # batch would read the count, and so membership (issue 41). Neither detail names a count.
        if job.token is not None and n_new:
            token = record.upload_tokens.get(job.token)
            room = None if token is None else token.room()
            if room is not None:
                room -= (charged or {}).get((record.seq, job.token), 0)
            if token is None or (room is not None and n_new > room):
                job.future.set_exception(quota_problem(room, record.study_id, n_new))
                return None
        room = record.study.max_reports * max(1, state.n_parties)
        if held + n_new > room:
            what = "blocks" if state.n_parties else "reports"
            limit = (f"max_reports = {record.study.max_reports} per party" if state.n_parties
                     else f"max_reports = {record.study.max_reports}")
            job.future.set_exception(ProblemError(
                "capacity-exceeded",
                f"study {record.study_id} cannot take {n_new} more {what}: it would exceed {limit}; "
                f"nothing of this request was stored"))
            return None
        growth = record.memory_growth(held, n_new)
        if budget is not None and growth > budget:
            job.future.set_exception(ProblemError(
                "capacity-exceeded",
                f"this server's memory_budget ({self.settings.memory_budget} bytes) is used up by its "
                f"open studies; {n_new} more reports do not fit. Commit open studies or ask the operator"))
            return None
        return _Plan(job, new, duplicates, held + n_new, new_ids, new_slots, memory=growth)

    def _plan_singles(self, group: list[UploadJob], budget: int) -> list[_Plan] | None:
        """The plans of a group of small requests to one study (single uploads) when every one
        of them is accepted, checked once for the group; None when the group is of another kind
        or any request would be refused or conflict: then :meth:`_plan` decides request by
        request, as it would anyway. Why: one lookup of all the group's ids instead of one per
        request (each a few index searches, and under load each of them may wait for the event
        loop to hand the GIL back).

        Re-sends (ids already held) stay on this path (issue 46: in a retry storm almost every
        group held one, and each group fell to :meth:`_plan`, 2.2-3.2x the writer's CPU per
        request of a group of fresh uploads; 1.05-1.4x now, benchmarks/resend_groups.py): the stored copies of every held id of the group are read
        in one pass and compared byte for byte, as :meth:`_classify` does; a held id counts as a
        duplicate when its bytes are the same, and anything else (different bytes, a copy
        deleted by retention, an id new here twice in the group) leaves the group to :meth:`_plan`."""
        first = group[0]
        record = first.record
        if (len(group) < 2 or self.catch_up is not None or not record.is_open
                or record.study.parties is not None):
            return None
        if any(job.record is not record or len(job.ids) > _SINGLES_MAX_IDS or job.pseudonyms
               or job.proof_record is not None for job in group):
            return None
        ids = [rid for job in group for rid in job.ids]
        state = self.ensure_state(record)
        if state is None:
            return None
        with state.lock:
            at = state.ids.lookup(b"".join(ids), ids) if len(state.ids) else np.full(len(ids), -1, dtype=np.int64)
        known = (at >= 0).tolist()  # Python bools: a group is tens of requests of one id
        fresh_ids = [rid for rid, k in zip(ids, known) if not k]
        if len(set(fresh_ids)) != len(fresh_ids):
            return None
        if len(fresh_ids) != len(ids) and not self._same_as_stored(group, at):
            return None
        n_new = len(fresh_ids)
        held = len(state.ids)
        if held + n_new > record.study.max_reports or record.memory_growth(held, n_new) > budget:
            return None
        plans = []
        per_token: dict[bytes, int] = {}
        start = 0
        for job in group:
            mine = known[start:start + len(job.ids)]
            start += len(job.ids)
            if not any(mine):
                new, duplicates = None, 0
            else:
                new = np.array([i for i, k in enumerate(mine) if not k], dtype=np.int64)
                duplicates = sum(mine)
            n = len(job.ids) - duplicates
            if job.token is not None and n:
                per_token[job.token] = per_token.get(job.token, 0) + n
            held += n
            plans.append(_Plan(job, new, duplicates, held, None if new is not None else set(job.ids)))
        for digest, n in per_token.items():
            token = record.upload_tokens.get(digest)
            room = None if token is None else token.room()
            if token is None or (room is not None and n > room):
                return None
        return plans

    def _same_as_stored(self, group: list[UploadJob], at: np.ndarray) -> bool:
        """Whether every held id of the group (``at``: the rowid of each of the group's ids in
        order, -1 where not held) is held with the bytes its request sends, read from the store
        in one pass (not for a study with validity proofs, whose records :meth:`_classify`
        compares as stored)."""
        study = group[0].record.study
        if proved_shares.is_proved(study):
            return False
        wanted = np.unique(at[at >= 0])
        width = group[0].shares.shape[1]
        stored: dict[int, bytes] = {}
        for got in batches.read(self.conn, self.backend, group[0].record.seq, wanted):
            if not got.holds_shares_of(width):
                return False  # deleted (retention): a conflict, which _plan answers
            for rowid, share in zip(got.rowids.tolist(), got.share_matrix(width)):
                stored[rowid] = share.tobytes()
        start = 0
        for job in group:
            for i in range(len(job.ids)):
                rowid = int(at[start + i])
                if rowid >= 0 and stored.get(rowid) != job.shares[i].tobytes():
                    return False
            start += len(job.ids)
        return True

    def _classify(self, job: UploadJob, state: StudyState, earlier: list[_Plan]):
        """Slow path when some ids are already known: (new indices, duplicates) or a conflict."""
        ids = job.ids
        mine = job.shares
        stored_rowids: dict[int, int] = {}  # row in job -> rowid of the stored copy
        first: dict[bytes, int] = {}
        new: list[int] = []
        duplicates = 0
        conflicts: list[int] = []
        slots = job.slots()
        taken: set[bytes] = set()  # slots filled by earlier new blocks of this request

        def same(i: int, stored: np.ndarray) -> None:
            nonlocal duplicates
            if stored.tobytes() == mine[i].tobytes():
                duplicates += 1
            else:
                conflicts.append(i)

        with state.lock:
            held = state.ids.lookup(job.joined, ids).tolist()
        for i, rid in enumerate(ids):
            if held[i] >= 0:
                stored_rowids[i] = held[i]
                continue
            plan = next((p for p in earlier if rid in p.new_ids), None)
            if plan is not None:
                same(i, plan.job.shares[plan.row_of(rid)])
            elif rid in first:
                same(i, mine[first[rid]])
            elif slots and (slots[i] in state.slots or slots[i] in taken
                            or any(slots[i] in p.new_slots for p in earlier)):
                conflicts.append(i)  # another block for the same individual and party
            else:
                first[rid] = i
                new.append(i)
                if slots:
                    taken.add(slots[i])
        if stored_rowids:
            stored: dict[int, bytes] = {}
            wanted = sorted(set(stored_rowids.values()))
            study = job.record.study
            proved = proved_shares.is_proved(study)
            # a validity study: its records as it stores them (leader's values or a helper's seed)
            width = proved_shares.upload_width(study, job.party) if proved else mine.shape[1]
            for got in batches.read(self.conn, self.backend, job.record.seq, wanted):
                if not got.holds_shares_of(width):
                    continue  # deleted (retention): nothing to be the same as, so a conflict
                held_shares = batches.study_payloads(got, study)[0] if proved else got.share_matrix(width)
                for j, share in enumerate(held_shares):
                    stored[int(got.rowids[j])] = share.tobytes()
            for i, rowid in stored_rowids.items():
                if stored.get(rowid) == mine[i].tobytes():
                    duplicates += 1
                else:
                    conflicts.append(i)
        if conflicts:
            first_conflict = ids[min(conflicts)].hex()
            if slots:
                return ProblemError(
                    "report-conflict",
                    f"{len(conflicts)} block(s) conflict with a different block held for the same "
                    f"individual and party, or a block id held with different bytes (first: "
                    f"{first_conflict}); a party uploads one block per individual: resend the same "
                    f"bytes (duplicates are fine), never a re-prepared block. Nothing of this "
                    f"request was stored")
            return ProblemError(
                "report-conflict",
                f"{len(conflicts)} report id(s) are held with different bytes (first: {first_conflict}); "
                f"nothing of this request was stored")
        return np.asarray(new, dtype=np.int64), duplicates

    def _classify_proof(self, job: UploadJob, state: StudyState, earlier: list[_Plan]):
        """A batch proof some of whose rows are known: (no new rows, m duplicates) when it is the
        same batch again with the same record bytes (held, or earlier in this group), else a
        conflict (the same batch id with other bytes, or rows that collide with other reports)."""
        ids, m = job.ids, len(job.ids)
        with state.lock:
            held = state.ids.lookup(job.joined, ids)
        same = np.zeros(0, dtype=np.int64), m
        if not np.any(held >= 0):
            twin = next((p for p in earlier if p.job.proof_record is not None and p.job.joined == job.joined), None)
            if twin is not None and twin.job.proof_record == job.proof_record:
                return same
        elif np.array_equal(held, held[0] + np.arange(m)):  # every row held, as one batch's
            for got in batches.read(self.conn, self.backend, job.record.seq, held[:1]):
                if got.proof_position is not None and got.first == int(held[0]) and got.shares == job.proof_record:
                    return same
        return ProblemError(
            "report-conflict",
            f"batch proof with rows {bytes(ids[0])[:12].hex()}...: its batch id is held with different bytes, or "
            f"its rows collide with reports held here; nothing of this request was stored")

    @staticmethod
    def _hash_missing(record: StudyRecord, group: list[_Plan]) -> None:
        """Hash the ids of requests that came without (single uploads) in one call: per-call
        overhead, not the hash, dominates for one id, and the event loop stays free."""
        missing = [p.job for p in group if p.job.rows is None]
        if not missing:
            return
        study = record.study
        rows, signs = study.hash_report_ids([rid for job in missing for rid in job.ids])
        start = 0
        for job in missing:
            end = start + len(job.ids)
            job.rows, job.signs = rows[start:end], signs[start:end]
            start = end

    def _insert(self, pending: dict[int, list[_Plan]]) -> list[tuple]:
        """Write the new rows of every accepted request, one INSERT per study."""
        out: list[tuple] = []
        base = self.backend.rowid_base(self.conn, self.next_rowid)
        for seq, group in pending.items():
            group = [p for p in group if p.n_new]
            if not group:
                continue
            record = group[0].job.record
            if record.study.parties is not None:
                base = self._insert_blocks(record, group, base, out)
                continue
            self._hash_missing(record, group)
            held = len(record.state.ids)
            for plan in [p for p in group if p.job.proof_record is not None]:  # a batch proof: a row of its own
                base = self._insert_proof(record, plan, base, out)
                held += len(out[-1][2])
            group = [p for p in group if p.job.proof_record is None]
            # one batch row of shares and one of seeds: a row holds one kind (services/batches.py)
            width = proved_shares.upload_width(record.study)
            seeded = [batches.stores_seeds(width) and p.job.seeds is not None for p in group]
            for seeds in (False, True):
                run = [p for p, s in zip(group, seeded) if s is seeds]
                if run:
                    base = self._insert_run(record, run, base, out, seeds)
                    held += len(out[-1][2])
            self.conn.execute("UPDATE studies SET report_count = ? WHERE seq = ?", (held, seq))
        return out

    def _insert_run(self, record: StudyRecord, group: list[_Plan], base: int, out: list[tuple],
                    seeds: bool) -> int:
        """Write the new rows of requests of one study as one batch row: their shares, or
        (``seeds``) the seeds every one of them came with."""

        def cat(parts: list):
            return parts[0] if len(parts) == 1 else np.concatenate(parts)

        shares = _coalesced([np.ascontiguousarray(p.take(p.job.shares), dtype="<u8") for p in group])
        # what the running totals fold: the shares, or a validity study's addends (state.StudyState.add)
        folded = shares if not proved_shares.is_proved(record.study) else _coalesced(
            [np.ascontiguousarray(p.take(self._addends(record, p.job))) for p in group])
        rows = cat([p.take(p.job.rows) for p in group])
        signs = cat([p.take(p.job.signs) for p in group])
        joined = b"".join(p.job.joined if p.new is None else b"".join(p.take_ids()) for p in group)
        # the ids one by one only for a small group (the index keeps few ids in a dict)
        ids = (group[0].take_ids() if len(group) == 1 else IdList(joined) if len(joined) > 1024
               else [rid for p in group for rid in p.take_ids()])
        # each request's ids as the worker sorted them, when every one is stored whole
        parts = ([p.job.sorted_ids for p in group]
                 if all(p.new is None and p.job.sorted_ids is not None for p in group) else None)
        stored = _coalesced([np.ascontiguousarray(p.take(p.job.seeds)) for p in group]) if seeds else shares
        batches.insert(self.conn, self.backend, base, record.seq, joined, stored)
        out.append((record, base, ids, joined, folded, rows, signs, parts))
        return base + len(ids)

    def _insert_proof(self, record: StudyRecord, plan: _Plan, base: int, out: list[tuple]) -> int:
        """Write a batch proof as one batch row: its rows' ids and its record as received
        (services/batches.py); what the running totals fold are its rows' addends."""
        job = plan.job
        assert job.proof_record is not None and job.addends is not None and plan.new is None
        batches.insert(self.conn, self.backend, base, record.seq, job.joined, job.proof_record,
                       proof_position=job.proof_position)
        parts = [job.sorted_ids] if job.sorted_ids is not None else None
        out.append((record, base, job.ids, job.joined, [job.addends], job.rows, job.signs, parts))
        return base + len(job.ids)

    @staticmethod
    def _addends(record: StudyRecord, job: UploadJob) -> np.ndarray:
        """What a validity study's request adds to the running totals (made here if the caller
        did not: proved_shares.addends)."""
        if job.addends is None:
            job.addends = proved_shares.addends(record.study, job.shares, job.seeds is not None)
        return job.addends

    def _insert_blocks(self, record: StudyRecord, group: list[_Plan], base: int, out: list[tuple]) -> int:
        """Write the new blocks of each accepted request (one party each), one INSERT per request."""
        for plan in group:
            ids, pseudonyms = plan.take_ids(), plan.take_pseudonyms()
            shares = np.ascontiguousarray(plan.take(plan.job.shares), dtype="<u8")
            joined = b"".join(ids)
            batches.insert(self.conn, self.backend, base, record.seq, joined, shares, b"".join(pseudonyms),
                           plan.job.party)
            out.append((record, base, ids, joined, _Blocks(plan.job.party, pseudonyms), None, None, None))
            base += len(ids)
        held = len(record.state.ids) + sum(plan.n_new for plan in group)
        self.conn.execute("UPDATE studies SET report_count = ? WHERE seq = ?", (held, record.seq))
        return base


#: a request's shares (or seeds) of fewer bytes are joined with their neighbours in a group
_SMALL_PART_BYTES = 1 << 16


def _coalesced(parts: list[np.ndarray]) -> list[np.ndarray]:
    """A group's shares (or seeds) request by request, as the store writes them and the running
    totals fold them. Large requests' stay as they came: joining them copied megabytes into fresh
    memory every group, 13 % of the writer's time at d = 100 (docs/operations.md, "How reports
    are stored"). Runs of small ones (single uploads) are joined: a write and a fold per row
    would cost more than their copy."""
    out: list[np.ndarray] = []
    run: list[np.ndarray] = []
    for part in [*parts, None]:
        if part is not None and part.nbytes < _SMALL_PART_BYTES:
            run.append(part)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else np.concatenate(run))
            run = []
        if part is not None:
            out.append(part)
    return out


def _any_of(ids: set[bytes], sorted_ids: SortedIds) -> bool:
    """Whether any of ``ids`` (a few) is among ``sorted_ids``."""
    return bool(ids) and _overlap(sorted_ids, None, b"".join(ids))


def _overlap(sorted_ids: SortedIds, other: SortedIds | None, joined: bytes) -> bool:
    """Whether any of ``other``'s ids (or, without it, of the concatenated ``joined``) is among
    ``sorted_ids``: a binary search of each in the sorted high halves, then both halves."""
    if other is not None:
        hi, lo = other.hi, other.lo
    else:
        hi, lo = idsets.halves(joined)
    n = len(sorted_ids.hi)
    if n == 0 or len(hi) == 0:
        return False
    left = np.searchsorted(sorted_ids.hi, hi, side="left")
    right = np.searchsorted(sorted_ids.hi, hi, side="right")
    for i in np.flatnonzero(right > left).tolist():  # a shared high half: compare the low halves
        if bool(np.any(sorted_ids.lo[left[i]:right[i]] == lo[i])):
            return True
    return False


def _settle(pairs: list[tuple[Any, Future]]) -> None:
    """On the event loop: copy each finished job's outcome to its waiter (unless the waiting
    request was cancelled meanwhile)."""
    for waiter, future in pairs:
        if waiter.done():
            continue
        if future.cancelled():
            waiter.cancel()
            continue
        exc = future.exception()
        if exc is not None:
            waiter.set_exception(exc)
        else:
            waiter.set_result(future.result())


@dataclass
class _Blocks:
    """What the index of a study with parties needs of inserted blocks."""

    party: int
    pseudonyms: list[bytes]
