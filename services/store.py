"""The durable store of one share server and the study logic on top of it.

Everything a client can change goes through the single writer thread (``writer.py``) and is
acknowledged only after its transaction committed durably (SQLite: WAL + ``synchronous=FULL``;
PostgreSQL: ``synchronous_commit = on``; the database sits behind ``backend.py``). Reads use
read-only connections (SQLite: one per thread; PostgreSQL: a pool). The in-memory running totals
(``state.py``) make a commit over 10^6 reports cost a subtraction of the excluded reports and one
k x k eigenvalue problem.

Privacy rules enforced here, not in the HTTP layer:
* nothing about shares leaves the server before the study is committed, and afterwards only the
  aggregate over the committed inclusion set (the same bytes on every call);
* a study commits to exactly one inclusion set, and only if the set is held, has between
  min_reports and max_reports entries, leaves out at most ``max_excluded_fraction`` of what this
  server holds (the batch rule) and meets the certificate lambda_min(S S^T) - t >= lambda_star;
* before it is stored the released aggregate gets this server's own noise, N(0, server_sigma^2)
  per cell from the CSPRNG, drawn once (the floor, docs/trust.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import threadpoolctl

from dpsketch.protocol import accounting, kernels, ledger, noise, parties, privacy, proved_shares, sketch
from dpsketch.protocol.messages import (
    CommitResult,
    HpkeKeys,
    IdList,
    LedgerEntry,
    PopulationLedger,
    StudyInfo,
    UploadTokenInfo,
    UploadTokenList,
    encode_aggregate,
    encode_block_index,
    encode_report_ids,
    inclusion_hash,
)
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.sketch import REPORT_ID_BYTES
from dpsketch.protocol.study import Study

from . import backend as backends
from . import batches, checkpoint, idsets, lifecycle, policy, verification
from dpsketch.protocol import inclusion
from .idsets import SortedIds
from .auth import digest_of, upload_token_id
from .keys import KeyRing
from dpsketch.protocol.sketch import accumulate as add_into
from .settings import Settings
from .state import StudyRecord, StudyState, UploadToken, load_state, new_state
from .writer import CallJob, SingleUpload, UploadJob, Writer

log = logging.getLogger("dpsketch.server")

_FETCH_CHUNK = 50_000
_ID_CHUNK = 1 << 16
_STUDY_ID = re.compile(r"[0-9a-f]{64}")
#: Seconds without a request after which a started server imports dp-accounting (Store._warm).
WARM_WHEN_IDLE_S = 2.0



def _unavailable_on_db_error(fn):
    """Reads that fail in the database (SQLite busy during WAL recovery, an I/O error, PostgreSQL
    unreachable) answer 503, not 500."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except self.backend.errors as exc:
            log.warning("read failed in %s: %s", fn.__name__, exc)
            raise self.backend.unavailable(exc) from None

    return wrapper


class InclusionSet(IdList):
    """A commit's inclusion set: the body's strictly ascending 16-byte ids as their uint64
    halves (``hi``, ``lo``), never 10^6 Python objects; still a sequence of ``bytes`` (cut from
    the body on access, messages.IdList) for the few callers that want ids one by one."""

    __slots__ = ("hi", "lo")

    def __init__(self, body: bytes, hi: np.ndarray, lo: np.ndarray):
        super().__init__(body)
        self.hi, self.lo = hi, lo


def parse_inclusion(body: bytes) -> InclusionSet:
    """The inclusion set of a commit body: 400 if not whole ids, 422 if not strictly ascending
    (the checks of ``messages.decode_report_ids``, on arrays)."""
    if len(body) % REPORT_ID_BYTES:
        raise ProblemError("malformed-body",
                           f"a report-id list is a whole number of {REPORT_ID_BYTES}-byte ids; got {len(body)} bytes")
    hi, lo = idsets.halves(body)
    if not idsets.strictly_ascending(hi, lo):
        raise ProblemError("invalid-request", "report ids must be in strictly ascending bytewise order")
    return InclusionSet(bytes(body), hi, lo)


class BitmapInclusion:
    """A commit's inclusion set as a bitmap over this server's sorted held ids
    (dpsketch/protocol/inclusion.py): resolved against the study's report index under its lock,
    never as one Python object (or 16 bytes) per id."""

    def __init__(self, body: bytes):
        try:
            self.mask, digest = inclusion.decode(body)
        except ValueError as exc:
            raise ProblemError("malformed-body", str(exc)) from None
        self.ihash = digest.hex()
        self.n = int(np.count_nonzero(self.mask))
        self._run = None

    def __len__(self) -> int:
        return self.n

    def resolve(self, state: StudyState):
        """Check the bitmap against what this server holds (caller holds ``state.lock``):
        409 inclusion-stale unless it was made over exactly the held ids, 422 unless the ids it
        selects hash to the declared inclusion hash. Returns (rowids of the included ids,
        rowids of the excluded ones), both ascending by id."""
        run = state.ids.consolidate()
        if len(run) != len(self.mask):
            raise ProblemError(
                "inclusion-stale", "the inclusion bitmap was made over a different list of held "
                "reports (more arrived since): fetch GET .../report-ids again and rebuild it")
        actual = inclusion.hash_selected(run.hi, run.lo, self.mask)
        if actual.hex() != self.ihash:
            raise ProblemError("invalid-request", f"the reports the bitmap selects here hash to "
                               f"{actual.hex()}, not to the inclusion hash it declares ({self.ihash})")
        self._run = run
        return run.rowid[self.mask], run.rowid[~self.mask]

    def certify_ids(self):
        """The included ids, for a certificate that hashes them (an l1 study): 16 bytes an id."""
        run = self._run
        return IdList(idsets.join_halves(run.hi[self.mask], run.lo[self.mask]))


def _match(state: StudyState, ids: InclusionSet):
    """The held ids against an inclusion set (caller holds ``state.lock``): the rowid of each
    included id (-1: not held), the rowids of the held ids outside it, how many included ids
    are not held, and the first of those (or None)."""
    rowid_of, excluded = state.ids.match(ids.hi, ids.lo)
    missing = np.flatnonzero(rowid_of < 0)
    first = ids[int(missing[0])] if missing.size else None
    return rowid_of, excluded, int(missing.size), first


def warm_kernels() -> bool:
    """Load every compiled loop a server uses, compiling into numba's cache where it is cold:
    in a background thread when a server opens a large study (Store._warm_sketch_for), and
    ahead of time by scripts/install.sh and deploy/Dockerfile, so that no process on that
    install pays the compile (about 18 s of CPU). Whether all of them are available."""
    ready = kernels.warm_up_all()
    return idsets.MERGE.warm_up() and ready


def warm_install() -> bool:
    """Every compiled loop a server of this install may run, compiled into numba's cache: the
    ones :func:`warm_kernels` loads, and the field arithmetic of validity proofs
    (dpsketch/protocol/_field_kernel.py), which a server loads only when it holds a validity
    study. Compiling that one costs about 32 s of CPU (session 53, load 1), which a server
    without it in its cache paid at its first proved batch, and every fresh container of an
    image whose cache its user cannot write. scripts/install.sh runs this; deploy/Dockerfile
    compiles the same loops from their sources alone (deploy/image-role.py kernels; tests/
    test_images.py checks the list) and runs this on the installed package to check that none
    compiles again. A running server never compiles the field loops ahead (warm_kernels)."""
    from dpsketch.protocol import field

    ready = warm_kernels()
    return field.warm_up() and ready


def warm_charges() -> bool:
    """The privacy loss distributions of design()'s default targets (a signed study of epsilon 1
    and floor 4 at delta 1e-6, replace-one), built into the PLD disk cache
    (dpsketch/pld_cache.py, $DPSKETCH_PLD_CACHE; installed here as the ledger's store). Every
    such study, whatever its columns, reports and servers, rounds to the same two radii (``ledger.RADIUS_STEP``), so a server whose
    cache holds these two charges its first token without building anything, where a fresh one
    (a new container's empty cache) spent 5-9 s of CPU on them. deploy/Dockerfile ships them in the
    server image; scripts/install.sh builds them for a checkout. False: no disk cache, or no
    file in it afterwards (it could not be written)."""
    from dpsketch import pld_cache
    from dpsketch.protocol.study import design

    pld_cache.install()
    where = pld_cache.cache_dir()
    if where is None:
        return False
    study = design(name="warm", columns=["a", "b"], label=None, servers=["s1", "s2"], expected_reports=1000)[0]
    ledger.check([], ledger.Charge.of(study), ledger.Budget(4.0, study.delta, floor_epsilon=12.0))
    return len(list(where.glob("replace-*.npz"))) >= 2


@functools.cache
def _blas() -> threadpoolctl.ThreadpoolController:
    """The BLAS libraries loaded (at the first commit, or when a study opens: numpy's, whatever
    else by then)."""
    return threadpoolctl.ThreadpoolController()


def _warm_release(study: Study) -> None:
    """What a commit would otherwise do first, in the background when a study opens: the floor
    noise's sampler table (0.06-0.15 s, noise.prepare) and the BLAS libraries' controller (0.02-
    0.08 s, a walk of every loaded library); a finalization then waits for neither (issue 46)."""
    try:
        _blas()
        noise.prepare(study.server_noise_std, study.noise_grid)
    except Exception:  # pragma: no cover - the commit builds them itself
        log.exception("could not prepare the release of study %s", study.study_id)


class Store:
    def __init__(self, settings: Settings):
        self.settings = settings
        #: SQLite file or PostgreSQL database (services/backend.py)
        self.backend = backends.for_settings(settings)
        self._conn = self.backend.initialise()
        self.backend.create_table(self._conn, checkpoint.SCHEMA)
        self.backend.create_table(self._conn, checkpoint.SEGMENTS_SCHEMA)
        for schema in lifecycle.SCHEMAS:
            self.backend.create_table(self._conn, schema)
        self.backend.create_table(self._conn, verification.SCHEMA)
        #: validity studies' verification rounds (services/verification.py)
        self.verification = verification.Rounds(self)
        self.verification.load(self._conn)
        #: other replicas of this server may write to the same database (PostgreSQL): catch up
        #: under the study's row lock before deciding anything (``_catch_up``)
        self.shared = self.backend.shared
        self.keys = KeyRing(self._conn, self.backend.file_path, self.backend)  # HPKE keys
        self._records: dict[str, StudyRecord] = {}
        self._reserved = 0  # memory the commits being worked on hold (reserve)
        self._charge_warmer = ThreadPoolExecutor(1, thread_name_prefix="dpsketch-charge-warm")
        #: study_id -> its background PLD build on the charge-warm thread, until it ends (_warm_charge)
        self._charge_builds: dict[str, Future] = {}
        self._charge_builds_lock = threading.Lock()
        self._reserve_lock = threading.Lock()
        self._sketch_warming = False
        self._load_records()
        #: population -> [(charge, charged_at)] in charging order (the ledger table, in memory)
        self._ledger: dict[str, list[tuple[ledger.Charge, float]]] = {}
        self._load_ledger(self._conn)
        self.writer = Writer(self._conn, settings, self.ensure_state, self.memory_in_use, self.backend,
                             catch_up=self._catch_up_uploads if self.shared else None)
        self._expiry_from = self._expiry_counts_from() if settings.study_expiry_s is not None else 0.0
        self._closed = False
        self._closing = threading.Event()
        self._sweep_wake = threading.Event()
        #: when the last HTTP request reached this server (``note_request``; monotonic seconds)
        self.last_request_at = time.monotonic()
        if settings.warm_start:
            threading.Thread(target=self._warm, name="dpsketch-warm", daemon=True).start()
        if settings.retention_after_commit_s is not None or settings.study_expiry_s is not None:
            threading.Thread(target=self._sweeper, name="dpsketch-retention", daemon=True).start()
        if self.shared:
            threading.Thread(target=self._follow_keys, name="dpsketch-keys", daemon=True).start()

    # --- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued writes, then close every connection (clean shutdown on SIGTERM)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._sweep_wake.set()
        self._charge_warmer.shutdown(wait=False, cancel_futures=True)
        self.writer.stop()
        self._checkpoint_all()
        self.verification.close()
        self.backend.close(self._conn)

    def _checkpoint_all(self) -> None:
        """At a clean shutdown: a checkpoint of every open study that grew since its last one, so
        the next start does not re-read its shares (services/checkpoint.py)."""
        for record in list(self._records.values()):
            state = record.state
            if state is not None and checkpoint.due(record, state, growth=0.0):
                checkpoint.save(self._conn, self.backend, record, state)

    def _reading(self):
        """A read-only connection for the duration of a ``with`` block (SQLite: this thread's;
        PostgreSQL: one from the pool)."""
        return self.backend.reading()

    def _load_ledger(self, conn, population: str | None = None) -> None:
        """The ledger table in memory (one population's charges: re-read under the provisioning
        lock when other replicas may have charged it)."""
        where, params = ("WHERE population = ? ", (population,)) if population is not None else ("", ())
        charges: dict[str, list[tuple[ledger.Charge, float]]] = {}
        for name, charge, charged_at in conn.execute(
                f"SELECT population, charge, charged_at FROM ledger {where}ORDER BY {self.backend.LEDGER_ORDER}",
                params).fetchall():
            charges.setdefault(name, []).append((ledger.Charge.model_validate_json(charge), float(charged_at)))
        if population is None:
            self._ledger = charges
        else:
            self._ledger[population] = charges.get(population, [])

    def _load_records(self, conn=None, study_id: str | None = None) -> None:
        """Every stored study into memory at start; or one study another replica provisioned."""
        conn = conn if conn is not None else self._conn
        where, params = ("WHERE s.study_id = ? ", (study_id,)) if study_id is not None else ("", ())
        rows = conn.execute(
            "SELECT s.seq, s.canonical, s.report_count, c.result, c.committed_at, r.shares_deleted_at, "
            "s.created_at, x.reason, x.closed_at, x.reports, x.refunded "
            "FROM studies s LEFT JOIN commits c ON c.study = s.seq "
            "LEFT JOIN retention r ON r.study = s.seq "
            f"LEFT JOIN closures x ON x.study = s.seq {where}ORDER BY s.seq", params
        ).fetchall()
        if study_id is not None and not rows:
            return
        only = "WHERE study = ? " if study_id is not None else ""
        seq_param = (rows[0][0],) if study_id is not None else ()
        tokens: dict[int, dict[bytes, UploadToken]] = {}
        issued: set[int] = set()
        revoked = {(seq, bytes(digest)) for seq, digest in
                   conn.execute(f"SELECT study, digest FROM upload_token_revocations {only}", seq_param).fetchall()}
        populations = {(seq, bytes(digest)): population for seq, digest, population in conn.execute(
            f"SELECT study, digest, population FROM token_populations {only}", seq_param).fetchall()}
        for seq, digest, quota, used, party in conn.execute(
                f"SELECT study, digest, quota, used, party FROM upload_tokens {only}ORDER BY created_at",
                seq_param).fetchall():
            issued.add(seq)
            if (seq, bytes(digest)) not in revoked:
                tokens.setdefault(seq, {})[bytes(digest)] = UploadToken(
                    quota, int(used), party, populations.get((seq, bytes(digest))))
        for (seq, canonical, count, result, committed_at, deleted_at, created_at, reason, closed_at, held,
             refunded) in rows:
            study = Study.model_validate_json(bytes(canonical))
            commit = CommitResult.model_validate_json(result) if result is not None else None
            if study.study_id in self._records:  # a request of this replica loaded it meanwhile
                continue
            closure = (lifecycle.Closure(reason, float(closed_at), int(held), refunded)
                       if reason is not None else None)
            self._records[study.study_id] = StudyRecord(
                seq, study, int(count), commit, committed_at=committed_at,
                upload_tokens=tokens.get(seq, {}),
                upload_required=seq in issued or self.settings.upload_auth == "tokens",
                shares_deleted_at=deleted_at, created_at=float(created_at), closure=closure)
            if commit is None and closure is None:
                self._warm_sketch_for(study)

    def _warm_sketch_for(self, study: Study) -> None:
        """Load the compiled sketch, seed-expansion and binding-hash loops
        (dpsketch/protocol/kernels.py) in the background, once, when this server opens a study that cannot release
        before it holds thousands of reports: from ``kernels.MIN_ROWS`` ids they run
        several times faster than hashlib, scipy and a ``cryptography`` cipher per seed, and
        loading them costs about a second of CPU (numba's import), which a server that holds
        only small studies never needs. Until they are loaded, uploads take the other paths (a
        batch of kernels.MIN_ROWS ids or more loads them itself): none waits."""
        if study.server_sigma > 0:  # the release's own fixed costs, off its path
            threading.Thread(target=_warm_release, args=(study,), name="dpsketch-release-warm", daemon=True).start()
        if self._sketch_warming or study.min_reports < kernels.MIN_ROWS:
            return
        self._sketch_warming = True

        # the sketch's, seed expansion's (ring.expand_seeds), the binding check's
        # (uploads.verified_shares) and the report index's (idsets.MERGE) loops: one numba import
        threading.Thread(target=warm_kernels, name="dpsketch-hash-warm", daemon=True).start()

    def _warm(self) -> None:
        """At startup: rebuild every open study's totals, import what checking a replace-one
        study needs, then, once the server has been idle for WARM_WHEN_IDLE_S, dp-accounting
        (add/remove studies and the population ledger: accounting.warm_up). A fresh server's
        first provisioning then waits for no import, while a server started into work (a restart
        with clients retrying, a replacement replica) does not spend 1.4-2.1 s of CPU and the
        GIL on an import while its first requests wait; a study that needs dp-accounting before
        then imports it itself."""
        for record in list(self._records.values()):
            if self._closed:
                return
            if not record.report_count:  # an empty study's totals are made at its first report
                continue
            try:
                self.ensure_state(record)
            except Exception:  # pragma: no cover - logged; the first request retries the load
                log.exception("could not rebuild study %s", record.study_id)
        accounting.warm_up(dp_accounting=False)
        while not self._closing.is_set():
            idle = time.monotonic() - self.last_request_at
            if idle >= WARM_WHEN_IDLE_S:
                accounting.warm_up()
                return
            self._closing.wait(min(0.5, WARM_WHEN_IDLE_S - idle))

    def note_request(self) -> None:
        """An HTTP request arrived (the app calls this for each): the idle warm-up waits."""
        self.last_request_at = time.monotonic()

    def ensure_state(self, record: StudyRecord) -> StudyState | None:
        """The running totals of an open study, rebuilt from the database on first use."""
        if not record.is_open:
            return None
        state = record.state
        if state is not None:
            return state
        with record.load_lock:
            if record.state is None and record.is_open:
                with self._reading() as conn:
                    state = new_state(record.study)
                    if checkpoint.load(conn, record, state):  # then only the reports stored after it
                        load_state(conn, record, self.settings.load_chunk_rows, self.backend, into=state)
                        log.info("study %s: %d reports from its checkpoint, %d stored after it",
                                 record.study_id, state.checkpointed, len(state.ids) - state.checkpointed)
                    else:
                        state = load_state(conn, record, self.settings.load_chunk_rows, self.backend)
                record.report_count = state.report_count
                record.state = state
        return record.state

    def ping(self) -> None:
        """Raise if the database cannot answer a query now (readiness: a server whose store is
        unreachable must not be sent traffic); return quickly otherwise."""
        try:
            self.backend.ping()
        except self.backend.errors as exc:
            raise self.backend.unavailable(exc) from exc

    def size_bytes(self) -> int | None:
        """The store's size on disk (None if it cannot be read now; metrics only)."""
        try:
            return self.backend.size_bytes()
        except self.backend.errors:
            return None

    def records(self) -> list[StudyRecord]:
        """Every study this server holds (a snapshot of the list; metrics and listings)."""
        return list(self._records.values())

    # --- reads -------------------------------------------------------------------------------
    def record(self, study_id: str) -> StudyRecord:
        record = self._records.get(study_id)
        if record is None and self.shared:  # another replica may have provisioned it
            record = self._find(study_id)
        if record is None:
            raise ProblemError("unknown-study", f"this server holds no study {study_id[:80]!r}")
        return record

    @_unavailable_on_db_error
    def _find(self, study_id: str) -> StudyRecord | None:
        if not _STUDY_ID.fullmatch(study_id):  # not a study id (the SHA-256 of a canonical study)
            return None
        with self._reading() as conn:
            self._load_records(conn, study_id)
        return self._records.get(study_id)

    # --- replicas sharing the store ------------------------------------------------------------
    def _adopt_commit(self, conn, record: StudyRecord) -> None:
        """Another replica committed the study: take its result, drop the totals."""
        row = conn.execute("SELECT result, committed_at FROM commits WHERE study = ?", (record.seq,)).fetchone()
        if row is None or record.commit is not None:
            return
        record.committed_at = float(row[1])
        record.commit = CommitResult.model_validate_json(row[0])
        record.state = None

    @_unavailable_on_db_error
    def refresh(self, record: StudyRecord) -> StudyRecord:
        """A shared store: what other replicas changed in the study that this answer shows (its
        commit and report count); one query. Without replicas: nothing to do."""
        if not self.shared or record.commit is not None:
            return record
        with self._reading() as conn:
            row = conn.execute("SELECT report_count, status FROM studies WHERE seq = ?", (record.seq,)).fetchone()
            if row[1] == "committed":
                self._adopt_commit(conn, record)
            elif record.study.parties is None:  # blocks count differently (complete individuals)
                record.report_count = int(row[0])
        return record

    @_unavailable_on_db_error
    def refresh_tokens(self, record: StudyRecord) -> None:
        """A shared store: upload tokens another replica issued or revoked."""
        if not self.shared:
            return
        with self._reading() as conn:
            self._tokens_from(conn, record, None)

    def _tokens_from(self, conn, record: StudyRecord, digests: set[bytes] | None) -> None:
        """Re-read the study's upload tokens (only ``digests``, when given) from the database."""
        where, params = "t.study = ?", [record.seq]
        if digests is not None:
            where += " AND t.digest = ANY(?)"
            params.append(list(digests))
        rows = conn.execute(
            "SELECT t.digest, t.quota, t.used, t.party, r.revoked_at FROM upload_tokens t "
            "LEFT JOIN upload_token_revocations r ON r.study = t.study AND r.digest = t.digest "
            f"WHERE {where}", tuple(params)).fetchall()
        active = dict(record.upload_tokens) if digests is not None else {}
        for digest in digests or ():
            active.pop(digest, None)
        for digest, quota, used, party, revoked_at in rows:
            if revoked_at is None:
                active[bytes(digest)] = UploadToken(quota, int(used), party)
        issued = bool(rows) or (digests is not None and bool(conn.execute(
            "SELECT 1 FROM upload_tokens WHERE study = ? LIMIT 1", (record.seq,)).fetchone()))
        record.upload_tokens = active
        if issued:
            record.upload_required = True

    def _catch_up(self, conn, record: StudyRecord, tokens: set[bytes]) -> None:
        """Before the writer decides on uploads to a study in a store shared with other replicas:
        lock the study's row (until this transaction ends), take a commit another replica made,
        fold in the reports the others stored since this replica last looked (rowids above the
        largest it knows: they grow in commit order, services/pg.py) and re-read the upload
        tokens the uploads use (issued, revoked or charged elsewhere)."""
        row = self.backend.lock_study(conn, record.seq)
        if row is None:
            return
        count, status = int(row[0]), row[1]
        if status == "committed":
            self._adopt_commit(conn, record)
            return
        if record.upload_required or tokens:
            self._tokens_from(conn, record, tokens)
        elif conn.execute("SELECT 1 FROM upload_tokens WHERE study = ? LIMIT 1", (record.seq,)).fetchone():
            record.upload_required = True
        state = self.ensure_state(record)
        if state is None:
            return
        with state.lock:
            if count != len(state.ids):
                before = len(state.ids)
                load_state(conn, record, self.settings.load_chunk_rows, self.backend, into=state)
                record.report_count = state.report_count
                log.debug("study %s: caught up on %d reports stored by other replicas",
                          record.study_id, len(state.ids) - before)

    def _catch_up_uploads(self, conn, record: StudyRecord, tokens: set[bytes]) -> None:
        """The writer's catch-up before it decides on uploads (replicas): :meth:`_catch_up`, then
        a refusal of the whole group if another replica closed the study for its verification
        round (services/verification.py): raised, so the writer stores none of the group and
        answers each request 503 (retried, they meet this replica's gate: 409 uploads-closed)."""
        self._catch_up(conn, record, tokens)
        if self.verification.closed_in(conn, record):
            raise ProblemError("uploads-closed", f"study {record.study_id} is being verified: it takes no more reports")

    def _follow_keys(self) -> None:
        """A shared store: keys rotated or retired by another replica reach this one within
        ``key_refresh_s``."""
        while not self._closing.wait(self.settings.key_refresh_s):
            try:
                with self._reading() as conn:
                    self.keys.refresh(conn)
            except self.backend.errors as exc:
                log.warning("could not re-read the HPKE keys: %s", exc)

    def info(self, record: StudyRecord, trusted: bool = True) -> StudyInfo:
        """A study's info; ``trusted`` is False for a caller without an operator or analyst token,
        who gets no exact counts of an add/remove study (they tell membership, docs/trust.md)."""
        hide = not trusted and record.study.neighbouring == "add-remove"
        state = record.state
        party_counts = None
        if record.study.parties is not None and state is not None and not hide:
            party_counts = {p.name: n for p, n in zip(record.study.parties, state.party_counts)}
        elif record.study.parties is not None and record.is_open and not record.report_count and not hide:
            party_counts = {p.name: 0 for p in record.study.parties}  # its state is made at its first block
        return StudyInfo(
            party_counts=party_counts,
            study_id=record.study_id,
            server_id=self.settings.server_id,
            status=("committed" if record.commit is not None else
                    record.closure.reason if record.closure is not None else "open"),
            report_count=None if hide else record.report_count,
            study=record.study,
            commit=None if hide else record.commit,
            hpke=self.keys.describe(),
            populations=self.charged_to(record.study_id),
        )

    def charged_to(self, study_id: str) -> list[str]:
        """The populations whose ledger here charges ``study_id`` (sorted)."""
        return sorted(p for p, entries in list(self._ledger.items())
                      if any(c.study_id == study_id for c, _ in entries))

    def infos(self, trusted: bool = True) -> list[StudyInfo]:
        return [self.info(r, trusted) for r in list(self._records.values())]

    def memory_in_use(self) -> int:
        """What the memory budget counts now: every open study's totals and report index, and
        what the commits being worked on reserved (:meth:`reserve`)."""
        return sum(r.memory_bytes() for r in list(self._records.values())) + self._reserved

    @contextlib.contextmanager
    def reserve(self, nbytes: int, what: str):
        """Hold ``nbytes`` of the memory budget for the ``with`` block (a commit's working
        memory), or refuse (409 capacity-exceeded) if it does not fit beside what is in use."""
        with self._reserve_lock:
            in_use = self.memory_in_use()
            if in_use + nbytes > self.settings.memory_budget:
                raise ProblemError(
                    "capacity-exceeded",
                    f"{what} needs about {nbytes} bytes of working memory and this server's open "
                    f"studies use {in_use} of its memory_budget = {self.settings.memory_budget}; "
                    f"commit with the compact inclusion bitmap ({inclusion.MEDIA_TYPE}), or retry "
                    f"once other commits finished")
            self._reserved += nbytes
        try:
            yield
        finally:
            with self._reserve_lock:
                self._reserved -= nbytes

    def count_new(self, record: StudyRecord, joined: bytes) -> int:
        """How many distinct ids of ``joined`` (concatenated 16-byte ids) the study does not hold:
        what a request would charge to its upload token (the writer decides; this lets a route
        refuse a request before working on it)."""
        ids = np.unique(np.frombuffer(joined, dtype="S16"))
        state = self.ensure_state(record)
        if state is None or not len(ids):
            return len(ids)
        unique = ids.tobytes()
        with state.lock:
            return int(np.count_nonzero(state.ids.lookup(unique, IdList(unique)) < 0))

    def held(self, record: StudyRecord) -> int:
        """How many ids this server holds for the study (reports, or blocks of a study with
        parties): the length of its GET .../report-ids list."""
        state = record.state
        return len(state.ids) if state is not None else record.report_count

    @_unavailable_on_db_error
    def report_ids(self, study_id: str) -> Iterator[bytes]:
        """The ids of every report held for the study, sorted (ids only, never shares), in
        chunks. An open study's come from its report index (numpy arrays, already sorted: the
        order a compact inclusion bitmap refers to), a chunk of 2^16 ids at a time, never one
        Python object per id (issue 46); a committed study's, or any with replicas sharing the
        store, from the database."""
        record = self.record(study_id)
        state = self.ensure_state(record) if not self.shared else None
        if state is not None:
            with state.lock:
                run = state.ids.consolidate()  # its arrays never change once made: read them unlocked

            def chunks() -> Iterator[bytes]:
                for start in range(0, len(run), _ID_CHUNK):
                    yield idsets.join_halves(run.hi[start:start + _ID_CHUNK], run.lo[start:start + _ID_CHUNK])

            return chunks()
        with self._reading() as conn:
            ids = batches.joined_ids(conn, record.seq)
        return iter([encode_report_ids(ids)])

    @_unavailable_on_db_error
    def block_index(self, study_id: str) -> bytes:
        """A study with parties: (block id, pseudonym, party) of every block held, by block id
        (never a share): what the analyzer needs to find the individuals complete everywhere."""
        record = self.record(study_id)
        if record.study.parties is None:
            raise ProblemError("invalid-request", f"study {study_id} has no parties: list its "
                               f"report ids (GET .../report-ids) instead")
        with self._reading() as conn:
            bids, pseudonyms, parties = batches.blocks(conn, record.seq)
        return encode_block_index(bids, pseudonyms, parties)

    @_unavailable_on_db_error
    def aggregate(self, study_id: str) -> tuple[bytes, str]:
        """The released aggregate share: only after commit, always the same bytes."""
        record = self.refresh(self.record(study_id))
        if record.commit is None:
            raise ProblemError("study-open", f"study {study_id} is not committed; nothing is released")
        if record.aggregate is None:
            with self._reading() as conn:
                row = conn.execute("SELECT aggregate FROM commits WHERE study = ?", (record.seq,)).fetchone()
            record.aggregate = bytes(row[0])
        return record.aggregate, record.commit.inclusion_hash

    def charges(self, population: str) -> list[ledger.Charge]:
        return [c for c, _ in self._ledger.get(population, [])]

    def ledger(self, population: str) -> PopulationLedger:
        """The population's ledger as published (GET /v1/populations/{population}/ledger): the
        composed certified guarantees and the composed floors, against this server's budget."""
        budget = policy.population_budget(self.settings)
        notion = self.settings.population_neighbouring
        delta = self.settings.population_delta
        entries = list(self._ledger.get(population, []))
        charges = [c for c, _ in entries]
        total = ledger.compose(charges, notion, delta)
        floors = ledger.compose(charges, notion, delta, floor=True)
        bound, floor_bound = self.settings.population_epsilon, self.settings.population_floor_epsilon

        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return PopulationLedger(
            population=population, server_id=self.settings.server_id, neighbouring=notion, delta=delta,
            epsilon=finite(total.epsilon), naive_epsilon=finite(total.naive_epsilon),
            naive_delta=total.naive_delta,
            budget_epsilon=bound, budget_delta=budget.delta if budget else delta,
            remaining_epsilon=finite(bound - total.epsilon) if bound is not None else None,
            studies=[LedgerEntry(charge=c, charged_epsilon=finite(c.epsilon_in(notion)), charged_at=at,
                                 charged_floor_epsilon=finite(c.floor_epsilon_in(notion)))
                     for c, at in entries],
            floor_epsilon=finite(floors.epsilon), budget_floor_epsilon=floor_bound,
            remaining_floor_epsilon=finite(floor_bound - floors.epsilon) if floor_bound is not None else None)

    # --- writes ------------------------------------------------------------------------------
    def provision(self, study: Study) -> tuple[StudyInfo, bool]:
        """Store a study (idempotent). Returns its info and whether it was new.

        Nothing is charged to a population here: populations belong to the operator, and a study
        is charged to one when the operator issues its first upload token of that population for
        it (:meth:`add_upload_tokens`). Only a server taking uploads without tokens (upload_auth
        "open") charges the study to its default population now, since any report may then
        arrive (409 budget-exceeded stores nothing). The study's own ``population`` member is
        not read: the analyst writes it (docs/ledger.md). Memory is charged as reports arrive
        (StudyRecord.memory_for), so an empty study costs nothing but its slot among the
        ``max_open_studies``."""
        study_id = study.study_id
        existing = self._records.get(study_id)
        if existing is not None:
            return self.info(existing), False
        population = self.settings.default_population if self.settings.upload_auth == "open" else None
        if population is not None:  # outside the writer first: warms the PLD caches, refuses early
            self._precheck_population(population, study)

        def fn(conn):
            if self.shared:  # another replica may have provisioned it, or charged the population
                self.backend.lock_provisioning(conn)
                self._load_records(conn, study_id)
                if population is not None:
                    self._load_ledger(conn, population)
            if study_id in self._records:  # a concurrent PUT of the same study won
                return (self._records[study_id], False), None
            opened = sum(1 for r in list(self._records.values()) if r.is_open)
            if opened >= self.settings.max_open_studies:
                raise ProblemError(
                    "invalid-study",
                    f"this server holds {opened} open studies, its max_open_studies; commit open "
                    f"studies first (uncommitted ones expire {self._expiry_text()} after they were "
                    f"provisioned), or ask the operator to drop some",
                    extra={"policy_rule": "max_open_studies"})
            now = time.time()
            charge = None
            if population is not None:  # again, race-free: the writer orders every charge
                policy.check_population(self.charges(population), study, self.settings, population)
                charge = ledger.Charge.of(study)
            seq = self.backend.insert_id(
                conn, "INSERT INTO studies (study_id, canonical, created_at) VALUES (?, ?, ?)",
                (study_id, study.canonical(), now))
            if charge is not None:
                conn.execute("INSERT INTO ledger (population, study_id, charge, charged_at) VALUES (?, ?, ?, ?)",
                             (population, study_id, charge.model_dump_json(), now))
            # its running totals are made at its first report (ensure_state): nothing to hold yet
            record = StudyRecord(seq, study, 0, upload_required=self.settings.upload_auth == "tokens",
                                 created_at=now)

            def apply() -> None:
                self._records[study_id] = record
                if charge is not None:
                    self._ledger.setdefault(population, []).append((charge, now))

            return (record, True), apply

        record, created = self.writer.submit(CallJob(fn)).result()
        if created:
            self._warm_sketch_for(study)
            if population is None:  # else its check above built its PLDs
                self._warm_charge(study)
        return self.info(record), created

    def _warm_charge(self, study: Study) -> None:
        """Build the study's privacy loss distributions (its guarantee's and its floor's) in the
        background, one study at a time, so that its first upload token of a population is not
        kept waiting for them (a signed study's take seconds of CPU, once per radius: they are
        also kept on disk, dpsketch/protocol/ledger.py). A token's check does not queue behind
        these builds (:meth:`_precheck_population`): it takes its study's own build over if it
        has not started, and waits only for the PLDs it needs that a build is making."""
        budget = policy.population_budget(self.settings)
        if budget is None:
            return
        study_id = study.study_id

        def build() -> None:
            try:
                ledger.check([], ledger.Charge.of(study), budget)
            except Exception:  # pragma: no cover - only a cache; the token's own check decides
                log.exception("could not build the privacy loss distributions of study %s", study_id)

        def ended(job: Future) -> None:
            with self._charge_builds_lock:
                if self._charge_builds.get(study_id) is job:
                    del self._charge_builds[study_id]

        try:
            job = self._charge_warmer.submit(build)
        except RuntimeError:  # the store is closing
            return
        with self._charge_builds_lock:
            self._charge_builds[study_id] = job
        job.add_done_callback(ended)

    def _precheck_population(self, population: str, study: Study) -> None:
        """The budget check before the writer's (which decides), on the calling thread: it builds
        the PLDs it needs (the study's and those of the population's charges), and refuses early.
        It waits for no other study's build: the study's own background build, if still queued on
        the charge-warm thread behind other studies', is cancelled (this check makes the same
        PLDs); a PLD another thread is building (the study's own build if it is running, or one
        of another study of the same targets: the same rounded radii) is waited for rather than
        made again (``ledger._BuiltOnce``: each PLD built once, whoever asks; two threads building
        the same one at once took more than twice as long). The writer's check then finds every
        PLD built."""
        with self._charge_builds_lock:
            job = self._charge_builds.pop(study.study_id, None)
        if job is not None:
            job.cancel()  # does nothing once it runs: then this check waits for the PLDs it builds
        policy.check_population(self.charges(population), study, self.settings, population)

    def _expiry_text(self) -> str:
        expiry = self.settings.study_expiry_s
        return "never" if expiry is None else f"{expiry:g} s"

    def submit_upload(self, record: StudyRecord, ids: Sequence[bytes], shares: np.ndarray,
                      rows: np.ndarray | None = None, signs: np.ndarray | None = None,
                      token: bytes | None = None, pseudonyms: list[bytes] | None = None,
                      party: int | None = None, waiter: Any = None, sorted_ids: SortedIds | None = None,
                      seeds: np.ndarray | None = None, addends: np.ndarray | None = None,
                      proof_record: bytes | None = None, proof_position: int | None = None) -> Future:
        """Queue parsed reports (hashed, or not: then the writer hashes them) for the writer; the
        future resolves to an UploadResult once they are durable (or to a ProblemError).
        ``token`` is the digest of the upload token they came with (its quota is charged).
        Blocks of a study with parties come with their ``pseudonyms`` and ``party`` index.
        ``waiter``: an asyncio future of the calling event loop, given the same outcome (the
        writer wakes the loop once per group of uploads rather than once per future).
        ``sorted_ids``: the ids sorted (idsets.SortedIds), which spares the writer sorting them.
        ``seeds``: what to store in place of the shares they expand to (services/batches.py).
        ``addends``: a study with validity proofs, what they add to the running totals
        (proved_shares.addends; the writer makes them if not given). ``proof_record``, ``proof_position``:
        a batch proof's record and the position it came to, ``ids`` its rows (services/proof_uploads.py)."""
        if record.commit is not None:
            raise ProblemError("study-closed", f"study {record.study_id} is committed; it takes no more reports")
        return self.verification.admit(record, lambda: self.writer.submit(UploadJob(
            record, ids, shares, rows, signs, token=token, pseudonyms=pseudonyms, party=party,
            required=record.upload_required, waiter=waiter, sorted_ids=sorted_ids, seeds=seeds,
            addends=addends, proof_record=proof_record, proof_position=proof_position)))

    def submit_single(self, record: StudyRecord, report_id: bytes, proof: bytes, share: bytes,
                      token: bytes | None, waiter: Any) -> SingleUpload:
        """Queue one single report of the fast path (services/uploads.py), its fields decoded and
        their lengths checked, its binding not yet: the writer checks a group's bindings at
        once and refuses an unbound one with writer.Unbound. ``waiter`` (an asyncio future of
        the calling loop) gets the outcome: an UploadResult, or the refusal as an exception."""
        if record.commit is not None:
            raise ProblemError("study-closed", f"study {record.study_id} is committed; it takes no more reports")
        job = SingleUpload(record, report_id, proof, share, token, waiter)
        self.verification.admit(record, lambda: self.writer.submit(job))
        return job

    @_unavailable_on_db_error
    def commit(self, study_id: str, body: bytes, bitmap: bool = False) -> CommitResult:
        """Commit the study to the inclusion set and release its aggregate, or refuse. The body
        is the report-id list (sorted 16-byte ids) or, with ``bitmap``, the compact form: a bit
        per held id (dpsketch/protocol/inclusion.py). Idempotent for the same set; any other
        set is refused forever."""
        record = self.record(study_id)
        if record.closure is not None:
            raise self._closed_problem(record)
        if record.commit is None:  # a validity study commits only after its round decided
            self.verification.require_decided(record)
        if bitmap:
            ids: InclusionSet | BitmapInclusion = BitmapInclusion(body)
            ihash = ids.ihash
        else:
            ids = parse_inclusion(body)
            # The body is the concatenation of the sorted ids, so hashing it in one piece is the
            # inclusion hash (and 5x faster than feeding 10^6 ids one by one).
            ihash = inclusion_hash(body)
        if self.shared:
            # replicas: decide under the study's row lock, over everything every replica stored,
            # so the study commits once whichever replica is asked (and no upload slips in)
            def locked(conn):
                self._catch_up(conn, record, set())
                if record.commit is not None:
                    return self._repeat(record, ihash), None
                return self._release(record, record.state, ids, ihash)(conn)

            return self.writer.submit(CallJob(locked)).result()
        state = self.ensure_state(record)
        if state is None:
            return self._repeat(record, ihash)
        return self.writer.submit(CallJob(self._release(record, state, ids, ihash))).result()

    def _release(self, record: StudyRecord, state: StudyState, ids: InclusionSet, ihash: str):
        """Sum the inclusion set, certify it, add this server's noise; returns the writer job
        (``fn(conn)``) that stores the release, or raises the refusal."""
        study = record.study
        if study.parties is not None:
            aggregate, gram, ids = self._sum_blocks(record, state, ids)
        else:
            aggregate, gram = self._sum_reports(record, state, ids)
        n = len(ids)
        # one BLAS thread for the k x k eigenvalue problem: threads fighting on a busy 2-core
        # machine made it 100x slower (1.6-3.3 s against 0.012 s at k = 400), and it gains
        # nothing from them at that size
        certified = ids.certify_ids() if isinstance(ids, BitmapInclusion) and study.kind == "l1" else ids
        with _blas().limit(limits=1, user_api="blas"):
            cert = privacy.certify_study(study, gram, certified)
        if not cert.ok:
            what = (f"the largest leverage of a report is {1 / cert.lambda_min if cert.lambda_min else math.inf:.6g} "
                    f"over {n} reports (t = {study.t} included), above 1 / lambda_star = "
                    f"{1 / study.lambda_star:.6g}: some report sits in too empty a bucket"
                    if study.kind == "l1" else
                    f"lambda_min(S S^T) = {cert.lambda_min:.6g} over {n} reports; lambda_min - t = "
                    f"{cert.lambda_min - study.t:.6g} is below lambda_star = {study.lambda_star:.6g}")
            raise ProblemError(
                "certificate-refused", what,
                extra={"lambda_min": cert.lambda_min, "lambda_star": study.lambda_star, "n_reports": n},
            )
        result = CommitResult(
            inclusion_hash=ihash, n_reports=n, lambda_min=cert.lambda_min,
            lambda_star=study.lambda_star, t=study.t, margin=cert.margin,
            server_sigma=study.server_sigma,
        )
        # this server's own noise: what protects its clients if every other report and every other
        # server is the adversary's (the floor). CSPRNG, on the ring grid, inside the study's
        # overflow bound (20 sigma cut, counted in Study.server_noise_bound); drawn once, stored.
        # A study with validity proofs: its running halves become its F_p share, the noise is
        # added in F_p (dpsketch/protocol/proved_shares.py)
        released = encode_aggregate(proved_shares.released(study, aggregate))

        now = time.time()

        def fn(conn):
            if record.commit is not None:  # a concurrent commit won the race
                return self._repeat(record, ihash), None
            if record.closure is not None:  # expired or dropped while this was summed
                raise self._closed_problem(record)
            conn.execute(
                "INSERT INTO commits (study, inclusion_hash, result, aggregate, committed_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (record.seq, ihash, result.model_dump_json(), released, now),
            )
            conn.execute("UPDATE studies SET status = 'committed' WHERE seq = ?", (record.seq,))
            checkpoint.delete_at_commit(conn, record.seq, self.backend)

            def apply() -> None:
                record.aggregate = released
                record.commit = result
                record.committed_at = now
                record.state = None  # the totals are no longer needed; free them
                if self.settings.retention_after_commit_s == 0:
                    self._sweep_wake.set()

            return result, apply

        return fn

    def _sum_reports(self, record: StudyRecord, state: StudyState,
                     ids: InclusionSet) -> tuple[np.ndarray, np.ndarray]:
        """The aggregate share and s S S^T over an inclusion set of reports: the running totals
        minus the excluded reports (or, when most are excluded, the included ones from scratch)."""
        study = record.study
        n = len(ids)
        with state.lock:
            n_held = len(state.ids)
            if isinstance(ids, BitmapInclusion):
                rowid_of, excluded = ids.resolve(state)
                n_missing, missing = 0, None
            else:
                rowid_of, excluded, n_missing, missing = _match(state, ids)
            if n_missing:
                raise ProblemError(
                    "unknown-reports",
                    f"{n_missing} of the {n} report ids are not held by this server "
                    f"(first: {missing.hex()}); commit the intersection of what every server holds",
                    extra={"unknown_count": n_missing},
                )
            self._check_count(study, n)
            self._check_exclusion(study, n, n_held)
            if study.validity is not None:  # only reports every check accepted here
                if isinstance(ids, BitmapInclusion):
                    run = state.ids.consolidate()
                    self.verification.check_inclusion(record, run.hi[ids.mask], run.lo[ids.mask])
                else:
                    self.verification.check_inclusion(record, ids.hi, ids.lo)
            from_scratch = n_held - n > n
            wanted = np.sort(rowid_of if from_scratch else excluded).tolist() if n_held != n else []
            aggregate = state.aggregate.copy()
            gram = state.gram.copy()
        sign = +1 if from_scratch else -1
        if from_scratch:
            aggregate[:] = 0
            gram[:] = 0
        for got in self._fetch(record.seq, wanted):
            shares = batches.study_addends(got, study)
            rows, signs = study.hash_report_ids(IdList(got.ids), got.ids)  # no Python bytes per id
            add_into(aggregate, rows, signs, shares, sign)
            sketch.accumulate_gram(gram, rows, signs, sign)
        return aggregate, gram

    def _sum_blocks(self, record: StudyRecord, state: StudyState,
                    block_ids: InclusionSet) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
        """A study with parties: the aggregate share and s S S^T over an inclusion set of blocks,
        summed from the store, and the pseudonyms of the individuals it includes. Refused unless
        every included individual has every party's block in the set (``incomplete-individuals``):
        a partial individual would be released without the certificate over its columns."""
        study = record.study
        n_parties = len(study.parties or ())
        with state.lock:
            if isinstance(block_ids, BitmapInclusion):
                rowid_of, _excluded = block_ids.resolve(state)
                n_missing, missing = 0, None
            else:
                rowid_of, _excluded, n_missing, missing = _match(state, block_ids)
            rowids = np.sort(rowid_of[rowid_of >= 0]).tolist()
            complete_here = state.complete
            if study.validity is not None and not n_missing:  # only blocks every check accepted here
                if isinstance(block_ids, BitmapInclusion):
                    run = state.ids.consolidate()
                    self.verification.check_inclusion(record, run.hi[block_ids.mask], run.lo[block_ids.mask])
                else:
                    self.verification.check_inclusion(record, block_ids.hi, block_ids.lo)
        if n_missing:
            raise ProblemError(
                "unknown-reports",
                f"{n_missing} of the {len(block_ids)} block ids are not held by this server (first: "
                f"{missing.hex()}); commit the blocks every server holds", extra={"unknown_count": n_missing})
        proved = proved_shares.is_proved(study)
        # a validity study: the low and the high halves of its F_p shares, w columns each
        aggregate = np.zeros((study.k, proved_shares.state_width(study)), dtype=np.uint64)
        gram = np.zeros((study.k, study.k), dtype=np.int64)
        columns = parties.slices(study.parties or [])
        blocks_of: dict[bytes, int] = {}
        for got in self._fetch(record.seq, rowids):  # a batch holds one party's blocks
            j = got.party
            pseudonyms = got.pseudonym_list()
            for p in pseudonyms:
                blocks_of[p] = blocks_of.get(p, 0) + 1
            hashed, signs = study.hash_report_ids(pseudonyms)
            if proved:  # the party's (m, 2 d_j) halves into its columns of each half
                halves = batches.study_addends(got, study)
                part = np.zeros((study.k, halves.shape[1]), dtype=np.uint64)
                add_into(part, hashed, signs, halves)
                d_j = halves.shape[1] // 2
                lo, hi = columns[j], slice(study.width + columns[j].start, study.width + columns[j].stop)
                aggregate[:, lo] += part[:, :d_j]
                aggregate[:, hi] += part[:, d_j:]
            else:
                shares = np.frombuffer(got.shares, dtype="<u8").reshape(len(got), -1)
                add_into(aggregate[:, columns[j]], hashed, signs, shares)
            if j == 0:  # one block per individual: S S^T counts each individual once
                sketch.accumulate_gram(gram, hashed, signs, +1)
        partial = sum(1 for count in blocks_of.values() if count != n_parties)
        if partial:
            raise ProblemError(
                "incomplete-individuals",
                f"{partial} individual(s) in the inclusion set lack some party's block in it; an "
                f"individual is released with all {n_parties} blocks or not at all",
                extra={"incomplete": partial})
        individuals = list(blocks_of)
        self._check_count(study, len(individuals))
        self._check_exclusion(study, len(individuals), complete_here)
        return aggregate, gram, individuals

    # --- upload tokens -----------------------------------------------------------------------
    def add_upload_tokens(self, study_id: str, count: int = 1, quota: int | None = 1,
                          party: str | None = None, population: str | None = None) -> tuple[list[str], int, str]:
        """``count`` fresh random upload tokens for the study, each good for ``quota`` new reports
        (None: no limit); only digests are stored. Returns the tokens, how many active tokens
        the study now has, and the population they charge. From the first one on, uploads need
        one. A study with parties issues tokens per party (``party`` required): each uploads
        only that party's blocks.

        ``population`` (default: the server's default_population) is the operator's: the tokens'
        reports are charged to it whatever the study says. The first token of a population for a
        study charges the study to that population's ledger, in the same transaction, after the
        budget check (409 budget-exceeded: no token is issued, nothing is charged); later ones
        cost nothing more. So no report reaches a study before its population paid for it."""
        record = self.record(study_id)
        if not record.is_open:
            raise ProblemError("study-closed", f"study {study_id} is "
                               f"{'committed' if record.commit is not None else record.closure.reason}; "
                               f"it takes no more reports, so no more upload tokens")
        if record.study.parties is not None:
            if party is None:
                raise ProblemError("invalid-request", f"study {study_id} has parties "
                                   f"{[p.name for p in record.study.parties]}: say which party's "
                                   f"blocks the tokens upload (party)")
            try:
                record.study.party(party)
            except ValueError as exc:
                raise ProblemError("invalid-request", str(exc)) from None
        elif party is not None:
            raise ProblemError("invalid-request", f"study {study_id} has no parties; issue tokens "
                               f"without one")
        population = population or self.settings.default_population
        study = record.study

        def charged() -> bool:
            return any(c.study_id == study_id for c, _ in self._ledger.get(population, []))

        if not charged():  # outside the writer first: warms the PLD caches, refuses early
            self._precheck_population(population, study)
        tokens = ["up-" + secrets.token_urlsafe(32) for _ in range(count)]
        digests = [digest_of(t) for t in tokens]
        now = time.time()

        def fn(conn):
            if self.shared:  # replicas: one charge at a time, over what every replica charged
                self.backend.lock_provisioning(conn)
                self._load_ledger(conn, population)
            if not record.is_open:
                raise ProblemError("study-closed", f"study {study_id} is closed; it takes no more upload tokens")
            charge = None
            if not charged():  # race-free: the writer orders every charge
                policy.check_population(self.charges(population), study, self.settings, population)
                charge = ledger.Charge.of(study)
                conn.execute("INSERT INTO ledger (population, study_id, charge, charged_at) VALUES (?, ?, ?, ?)",
                             (population, study_id, charge.model_dump_json(), now))
            conn.executemany("INSERT INTO upload_tokens (study, digest, created_at, quota, party) "
                             "VALUES (?, ?, ?, ?, ?)", [(record.seq, d, now, quota, party) for d in digests])
            conn.executemany("INSERT INTO token_populations (study, digest, population) VALUES (?, ?, ?)",
                             [(record.seq, d, population) for d in digests])
            active = dict(record.upload_tokens)
            active.update({d: UploadToken(quota, party=party, population=population) for d in digests})

            def apply() -> None:
                record.upload_tokens = active
                record.upload_required = True
                if charge is not None:
                    self._ledger.setdefault(population, []).append((charge, now))
                    log.info("study %s charged to population %r (its first upload token of it)",
                             study_id, population)

            return len(active), apply

        return tokens, self.writer.submit(CallJob(fn)).result(), population

    @_unavailable_on_db_error
    def list_upload_tokens(self, study_id: str) -> UploadTokenList:
        """The study's upload tokens by id (hex SHA-256(token)[:8]) with quota, reports added,
        issue and revocation times; never a token or a whole digest."""
        record = self.record(study_id)
        with self._reading() as conn:
            rows = conn.execute(
                "SELECT t.digest, t.created_at, r.revoked_at, t.quota, t.used, t.party, p.population "
                "FROM upload_tokens t "
                "LEFT JOIN upload_token_revocations r ON r.study = t.study AND r.digest = t.digest "
                "LEFT JOIN token_populations p ON p.study = t.study AND p.digest = t.digest "
                "WHERE t.study = ? ORDER BY t.created_at", (record.seq,)).fetchall()
        tokens = []
        for d, c, r, quota, used, party, population in rows:
            live = record.upload_tokens.get(bytes(d))  # memory may be ahead of this read
            tokens.append(UploadTokenInfo(token_id=upload_token_id(bytes(d)), created_at=c, revoked_at=r,
                                          quota=quota, used=live.used if live else int(used), party=party,
                                          population=population))
        return UploadTokenList(study_id=study_id, required=record.upload_required,
                               active=sum(t.revoked_at is None for t in tokens), tokens=tokens)

    def revoke_upload_token(self, study_id: str, token_id: str) -> UploadTokenList:
        """Revoke one upload token (idempotent); from the commit on, it is refused. The study
        keeps requiring an upload token even when none is left."""
        record = self.record(study_id)

        def fn(conn):
            rows = conn.execute("SELECT digest FROM upload_tokens WHERE study = ?", (record.seq,)).fetchall()
            match = [bytes(d) for (d,) in rows if upload_token_id(bytes(d)) == token_id]
            if not match:
                raise ProblemError("not-found", f"study {study_id} has no upload token {token_id[:40]!r}")
            conn.execute("INSERT INTO upload_token_revocations (study, digest, revoked_at) "
                         "VALUES (?, ?, ?) ON CONFLICT DO NOTHING", (record.seq, match[0], time.time()))
            active = {d: t for d, t in record.upload_tokens.items() if d != match[0]}

            def apply() -> None:
                record.upload_tokens = active

            return None, apply

        self.writer.submit(CallJob(fn)).result()
        log.info("study %s: upload token %s revoked", study_id, token_id)
        return self.list_upload_tokens(study_id)

    # --- HPKE keys ---------------------------------------------------------------------------
    def rotate_key(self) -> HpkeKeys:
        """A new current HPKE key; older keys keep opening shares until retired."""
        def rotate(conn):
            self.backend.lock_provisioning(conn)  # replicas: one rotation at a time, one current key
            return self.keys.rotate(conn)

        self.writer.submit(CallJob(rotate)).result()
        return self.keys.describe()

    def retire_key(self, key_id: str) -> HpkeKeys:
        """Erase a superseded key (409 key-in-use while an open study may still need it)."""
        self.writer.submit(CallJob(lambda conn: self.keys.retire(conn, key_id))).result()
        return self.keys.describe()

    # --- retention ---------------------------------------------------------------------------
    def delete_shares(self, study_id: str) -> dict:
        """Delete the individual shares of a committed study (idempotent). The report ids, the
        CommitResult and the released aggregate stay, so every later answer is unchanged."""
        record = self.record(study_id)
        if record.commit is None:
            raise ProblemError("study-open", f"study {study_id} is not committed; its shares are still needed")
        if record.shares_deleted_at is None:
            def fn(conn):
                if record.shares_deleted_at is not None:
                    return record.shares_deleted_at, None
                deleted = batches.delete_shares(conn, record.seq)
                now = time.time()
                conn.execute("INSERT INTO retention (study, shares_deleted_at, deleted) VALUES (?, ?, ?) "
                             "ON CONFLICT (study) DO UPDATE SET shares_deleted_at = excluded.shares_deleted_at, "
                             "deleted = excluded.deleted", (record.seq, now, deleted))

                def apply() -> None:
                    record.shares_deleted_at = now

                log.info("study %s: deleted %d individual shares (retention)", study_id, deleted)
                return now, apply

            self.writer.submit(CallJob(fn)).result()
        return {"study_id": study_id, "shares_deleted": True, "shares_deleted_at": record.shares_deleted_at}

    def due_for_retention(self, now: float | None = None) -> list[str]:
        """Committed studies whose shares are kept past ``retention_after_commit_s``."""
        keep = self.settings.retention_after_commit_s
        if keep is None:
            return []
        now = time.time() if now is None else now
        return [r.study_id for r in list(self._records.values())
                if r.commit is not None and r.shares_deleted_at is None
                and r.committed_at is not None and r.committed_at + keep <= now]

    def sweep_retention(self) -> list[str]:
        """Delete the shares of every study due; returns their ids."""
        done = []
        for study_id in self.due_for_retention():
            if self._closed:
                break
            try:
                self.delete_shares(study_id)
                done.append(study_id)
            except Exception:  # logged; retried at the next sweep
                log.exception("retention: could not delete the shares of study %s", study_id)
        return done

    def _sweeper(self) -> None:
        intervals = [self.settings.retention_sweep_s]
        if self.settings.retention_after_commit_s is not None:
            intervals.append(max(self.settings.retention_after_commit_s, 1.0))
        if self.settings.study_expiry_s is not None:  # a study expires at most a quarter late
            intervals.append(max(self.settings.study_expiry_s / 4, 0.25))
        interval = min(intervals)
        while not self._closed:
            self.sweep_retention()
            self.sweep_expiry()
            self._sweep_wake.wait(interval)
            self._sweep_wake.clear()

    # --- studies that end without a release (services/lifecycle.py) ----------------------------
    def _expiry_counts_from(self) -> float:
        """When this store first ran a server that expires studies (kept in ``meta``, written only
        by such a server): a study provisioned before that counts its time from then, so turning
        expiry on (or upgrading to it) never expires, at its first start, a study that was still
        collecting under a server without expiry."""
        def fn(conn):
            conn.execute("INSERT INTO meta (key, value) VALUES ('expiry_counts_from', ?) ON CONFLICT DO NOTHING",
                         (repr(time.time()),))
            return float(conn.execute("SELECT value FROM meta WHERE key = 'expiry_counts_from'").fetchone()[0]), None

        return self.writer.submit(CallJob(fn)).result()

    def due_for_expiry(self, now: float | None = None) -> list[str]:
        """Open studies provisioned more than ``study_expiry_s`` ago (whatever they hold; a study
        from before this store's first server with expiry counts from then)."""
        expiry = self.settings.study_expiry_s
        if expiry is None:
            return []
        now = time.time() if now is None else now
        return [r.study_id for r in list(self._records.values())
                if r.is_open and max(r.created_at, self._expiry_from) + expiry <= now]

    def sweep_expiry(self) -> list[str]:
        """Close every study due to expire; returns their ids."""
        done = []
        for study_id in self.due_for_expiry():
            if self._closed:
                break
            try:
                self.close_study(study_id, "expired")
                done.append(study_id)
            except ProblemError:  # committed meanwhile
                pass
            except Exception:  # logged; retried at the next sweep
                log.exception("expiry: could not close study %s", study_id)
        return done

    def close_study(self, study_id: str, reason: str, who: str = "expiry") -> dict:
        """End an open study without a release (``reason``: "expired" or "dropped"): delete its
        shares, free its running totals, refuse its uploads and commits from now on, and refund
        its population charges (it released nothing). Idempotent; a committed study is refused
        (409 study-closed: what it released is spent, its charges stay; its shares go with
        DELETE .../shares). Logged at WARNING as an audit record (who, study, reports, refunds)."""
        record = self.record(study_id)

        def refuse_committed() -> ProblemError:
            return ProblemError("study-closed", f"study {study_id} is committed: it released, so it "
                                f"cannot be dropped and its population charges stay; delete its "
                                f"individual shares with DELETE /v1/studies/{study_id}/shares")

        if record.commit is not None:
            raise refuse_committed()
        if record.closure is None:
            now = time.time()

            def fn(conn):
                if self.shared:
                    self._catch_up(conn, record, set())
                if record.commit is not None:
                    raise refuse_committed()
                if record.closure is not None:
                    return None, None
                held = int(conn.execute("SELECT report_count FROM studies WHERE seq = ?",
                                        (record.seq,)).fetchone()[0])
                deleted = batches.delete_shares(conn, record.seq)
                checkpoint.delete(conn, record.seq)
                refunded = sorted(p for p, entries in self._ledger.items()
                                  if any(c.study_id == study_id for c, _ in entries))
                conn.execute("DELETE FROM ledger WHERE study_id = ?", (study_id,))
                closure = lifecycle.Closure(reason, now, held, ",".join(refunded))
                conn.execute("INSERT INTO closures (study, reason, closed_at, reports, refunded) "
                             "VALUES (?, ?, ?, ?, ?)", (record.seq, reason, now, held, closure.refunded))

                def apply() -> None:
                    record.closure = closure
                    self.verification.forget(record)  # its kept query answer, if any
                    with record.load_lock:
                        record.state = None  # the totals are no longer needed; free them
                    for population in refunded:
                        self._ledger[population] = [e for e in self._ledger.get(population, [])
                                                    if e[0].study_id != study_id]
                    log.warning("AUDIT study %s %s by %s: %d reports held (%d shares deleted), "
                                "nothing released; population charges refunded: %s", study_id, reason,
                                who, held, deleted, ", ".join(refunded) or "none")

                return None, apply

            self.writer.submit(CallJob(fn)).result()
        closure = record.closure
        assert closure is not None
        return {"study_id": study_id, "status": closure.reason, "closed_at": closure.closed_at,
                "reports_deleted": closure.reports,
                "refunded_populations": [p for p in closure.refunded.split(",") if p]}

    @staticmethod
    def _check_count(study: Study, n: int) -> None:
        if n < study.min_reports:
            raise ProblemError(
                "certificate-refused",
                f"the inclusion set has {n} reports; the study releases nothing over fewer than "
                f"min_reports = {study.min_reports}",
                extra={"n_reports": n, "min_reports": study.min_reports},
            )
        if n > study.max_reports:
            raise ProblemError(
                "certificate-refused",
                f"the inclusion set has {n} reports, more than max_reports = {study.max_reports}",
                extra={"n_reports": n, "max_reports": study.max_reports},
            )

    def _check_exclusion(self, study: Study, n: int, n_held: int) -> None:
        """The batch rule: an inclusion set may leave out at most max_excluded_fraction of what
        this server acknowledged, so an analyst cannot commit a victim among its own reports."""
        excluded = n_held - n
        allowed = int(self.settings.max_excluded_fraction * n_held)
        if excluded > allowed:
            raise ProblemError(
                "inclusion-refused",
                f"the inclusion set leaves out {excluded} of the {n_held} reports this server holds; "
                f"its policy allows at most max_excluded_fraction = "
                f"{self.settings.max_excluded_fraction:g} ({allowed}). Commit (nearly) everything "
                f"every server holds; if a server lost reports, re-upload them there first",
                extra={"excluded": excluded, "held": n_held, "allowed": allowed})

    @staticmethod
    def _closed_problem(record: StudyRecord) -> ProblemError:
        assert record.closure is not None
        return ProblemError("study-closed", f"study {record.study_id} was {record.closure.reason} "
                            f"before it was committed: its shares are deleted and it releases nothing")

    def _repeat(self, record: StudyRecord, ihash: str) -> CommitResult:
        assert record.commit is not None
        if record.commit.inclusion_hash == ihash:
            return record.commit
        raise ProblemError(
            "inclusion-conflict",
            f"study {record.study_id} is committed to inclusion set {record.commit.inclusion_hash}; "
            f"a second release over a different set is refused",
        )

    def _fetch(self, seq: int, rowids: list[int]) -> Iterator[batches.Stored]:
        """The stored reports with these rowids (ascending), a few batches at a time, each chunk
        of ``_FETCH_CHUNK`` rowids on one read connection."""
        heads = None
        for start in range(0, len(rowids), _FETCH_CHUNK):
            part = rowids[start:start + _FETCH_CHUNK]
            with self._reading() as conn:
                if heads is None:  # once: a stored batch's header never changes
                    heads = batches.headers(conn, seq)
                got = list(batches.read(conn, self.backend, seq, part, heads))
            if sum(len(g) for g in got) != len(part):  # never: rowids come from the writer's own inserts
                raise RuntimeError(f"store inconsistent: {len(part) - sum(len(g) for g in got)} held reports missing")
            yield from got
