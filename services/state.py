"""What a server keeps in memory per study, and how it is rebuilt from the database.

For an open study the server holds the running aggregate Z = S X (k x d uint64) and the integer
matrix s * S S^T (k x k int64) over every report it stores, plus the map report id -> rowid.
Then a commit over an inclusion set only subtracts the (usually few) held reports outside the
set instead of re-reading every share, and duplicate/conflict checks need no index lookups.

The totals are changed only after the database transaction that stored the reports committed,
under ``StudyState.lock``; a commit computation snapshots them under the same lock. After a
crash nothing in memory matters: :func:`load_state` rebuilds it by streaming the reports table.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpsketch.protocol import sketch
from dpsketch.protocol.messages import CommitResult
from dpsketch.protocol.study import Study

from dpsketch.protocol.sketch import accumulate as add_into

log = logging.getLogger("dpsketch.server")

#: Memory the report index of an open study takes per held report: the id -> rowid map and the
#: contiguous id and rowid copies (109 bytes, tracemalloc over 2 x 10^5 reports) plus the 49-byte
#: id objects the map keeps. The memory budget counts it.
INDEX_BYTES_PER_REPORT = 160


@dataclass
class StudyState:
    """Running totals of an open study over all reports held (see module docstring)."""

    k: int
    d: int
    ids: dict[bytes, int] = field(default_factory=dict)  # report id (a block's id) -> rowid
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: a study with parties: how many parties; 0 for any other study
    n_parties: int = 0

    def __post_init__(self) -> None:
        self.aggregate = np.zeros((self.k, self.d), dtype=np.uint64)
        self.gram = np.zeros((self.k, self.k), dtype=np.int64)  # s * S S^T
        # The same ids and rowids as ``ids``, in the same order, as contiguous chunks: a commit
        # over 10^6 reports joins ~100 chunks instead of 10^6 scattered bytes objects.
        self._id_chunks: list[bytes] = []
        self._rowid_chunks: list[np.ndarray] = []
        # A study with parties keeps no running totals (a commit sums its blocks from the store)
        # but knows which block holds each (pseudonym, party) slot, for conflicts, and how many
        # blocks each individual has here, for completeness.
        self.slots: dict[bytes, bytes] = {}  # pseudonym + party byte -> block id
        self.blocks_of: dict[bytes, int] = {}  # pseudonym -> blocks held
        self.complete = 0  # individuals with every party's block here
        self.party_counts = [0] * self.n_parties
        #: the largest rowid folded in: a replica sharing its store catches up on rows above it
        #: (services/store.py, ``Store._catch_up``)
        self.last_rowid = 0
        #: reports held at the last checkpoint of this state (services/checkpoint.py)
        self.checkpointed = 0

    @property
    def report_count(self) -> int:
        """Reports held; for a study with parties, individuals whose every block is here."""
        return self.complete if self.n_parties else len(self.ids)

    def add(self, study: Study, report_ids: list[bytes], rowids: range | list[int],
            shares: np.ndarray, rows: np.ndarray | None = None, signs: np.ndarray | None = None,
            joined: bytes | None = None) -> None:
        """Fold newly stored reports into the totals (caller holds ``lock``)."""
        if rows is None or signs is None:
            rows, signs = study.hash_report_ids(report_ids)
        self._index(report_ids, rowids, joined)
        if len(self._id_chunks) > 1024:  # many small groups (single uploads): consolidate
            self._id_chunks = [b"".join(self._id_chunks)]
            self._rowid_chunks = [np.concatenate(self._rowid_chunks)]
        add_into(self.aggregate, rows, signs, shares)
        sketch.accumulate_gram(self.gram, rows, signs, +1)

    def add_blocks(self, party: int, block_ids: list[bytes], rowids: range | list[int],
                   pseudonyms: list[bytes], joined: bytes | None = None) -> None:
        """Index newly stored blocks of one party (caller holds ``lock``; the writer has checked
        that no slot is taken)."""
        self._index(block_ids, rowids, joined)
        tag = bytes((party,))
        for bid, p in zip(block_ids, pseudonyms):
            self.slots[p + tag] = bid
            held = self.blocks_of.get(p, 0) + 1
            self.blocks_of[p] = held
            if held == self.n_parties:
                self.complete += 1
        self.party_counts[party] += len(block_ids)

    def _index(self, report_ids: list[bytes], rowids: range | list[int], joined: bytes | None) -> None:
        self.ids.update(zip(report_ids, rowids))
        self._id_chunks.append(joined if joined is not None else b"".join(report_ids))
        as_array = np.asarray(rowids, dtype=np.int64)
        self._rowid_chunks.append(as_array)
        if len(as_array):
            self.last_rowid = max(self.last_rowid, int(as_array.max()))

    def restore_index(self, joined: bytes, rowids: np.ndarray, last_rowid: int) -> None:
        """The contiguous index of a checkpoint (``ids`` already holds the same map)."""
        self._id_chunks = [joined] if joined else []
        self._rowid_chunks = [rowids] if len(rowids) else []
        self.last_rowid = last_rowid

    def held(self) -> tuple[bytes, np.ndarray]:
        """All held ids concatenated, and their rowids, in one order (caller holds ``lock``)."""
        if len(self._id_chunks) > 1:
            self._id_chunks = [b"".join(self._id_chunks)]
            self._rowid_chunks = [np.concatenate(self._rowid_chunks)]
        if not self._id_chunks:
            return b"", np.zeros(0, dtype=np.int64)
        return self._id_chunks[0], self._rowid_chunks[0]


@dataclass
class StudyRecord:
    """One provisioned study: parameters, progress, and (if committed) what was released."""

    seq: int
    study: Study
    report_count: int
    commit: CommitResult | None = None
    aggregate: bytes | None = None  # cached released bytes, loaded on first GET
    state: StudyState | None = None  # None until loaded; dropped after commit
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    committed_at: float | None = None
    upload_tokens: dict[bytes, "UploadToken"] = field(default_factory=dict)  # digest -> token, not revoked
    upload_required: bool = False  # the policy demands tokens, or one was issued: uploads need one
    shares_deleted_at: float | None = None  # retention ran: individual shares are gone

    @property
    def study_id(self) -> str:
        return self.study.study_id

    @property
    def upload_digests(self) -> tuple[bytes, ...]:
        return tuple(self.upload_tokens)

    def memory_bytes(self) -> int:
        """What the budget counts for this study: its totals and report index while it is open
        (a study with parties: its blocks' index, slots and counts, about 2.5 x per block)."""
        if self.commit is not None:
            return 0
        blocks = 0
        if self.study.parties is not None and self.state is not None:
            blocks = len(self.state.ids) * INDEX_BYTES_PER_REPORT * 3 // 2
        return (8 * self.study.k * (self.study.width + self.study.k) + self.report_count * INDEX_BYTES_PER_REPORT
                + blocks)


@dataclass
class UploadToken:
    """An active upload token of a study: how many reports it may add, and how many it did."""

    quota: int | None  # None: no limit
    used: int = 0
    party: str | None = None  # a study with parties: the party whose blocks it may upload

    def room(self) -> int | None:
        return None if self.quota is None else max(0, self.quota - self.used)


def _chunks(conn: Any, sql: str, params: tuple, chunk_rows: int, backend: Any):
    """The rows of ``sql`` in chunks of ``chunk_rows``, streamed (never the whole table in memory)."""
    if backend is None:  # a SQLite connection (callers from before the backend seam)
        from .backend import SqliteBackend as backend
    return backend.stream(conn, sql, params, chunk_rows)


def _pages(conn: Any, columns: str, seq: int, after: int, chunk_rows: int):
    """The study's rows above rowid ``after`` in rowid order, a page at a time (keyset paging: a
    plain query per page, so it runs inside the writer's open transaction too)."""
    while True:
        page = conn.execute(f"SELECT {columns} FROM reports WHERE study = ? AND id > ? ORDER BY id LIMIT ?",
                            (seq, after, chunk_rows)).fetchall()
        if not page:
            return
        yield page
        after = page[-1][0]


def load_state(conn: Any, record: StudyRecord, chunk_rows: int, backend: Any = None,
               into: StudyState | None = None) -> StudyState:
    """Rebuild a study's running totals by streaming its stored reports in rowid order.
    ``conn`` is a read connection of ``backend`` (services/backend.py; None: SQLite).
    With ``into``: fold only the rows above ``into.last_rowid`` into it (a replica catching up on
    what the others stored, in the writer's transaction) and return it."""
    study = record.study
    if study.parties is not None:
        return _load_blocks(conn, record, chunk_rows, backend, into)
    state = into if into is not None else StudyState(k=study.k, d=study.width)
    width = 8 * study.width
    skipped = 0
    columns = "id, report_id, share"
    chunks = (_pages(conn, columns, record.seq, into.last_rowid, chunk_rows) if into is not None else
              _chunks(conn, f"SELECT {columns} FROM reports WHERE study = ? ORDER BY id",
                      (record.seq,), chunk_rows, backend))
    for chunk in chunks:
        rowids = [r[0] for r in chunk]
        ids = [bytes(r[1]) for r in chunk]
        blobs = [r[2] for r in chunk]
        sound = (all(len(b) == width for b in blobs) and len(set(ids)) == len(ids)
                 and state.ids.keys().isdisjoint(ids))
        if not sound:  # cannot happen with a single writer; never count a row twice
            keep = {}
            for i, (rid, blob) in enumerate(zip(ids, blobs)):
                if len(blob) == width and rid not in state.ids and rid not in keep:
                    keep[rid] = i
            skipped += len(ids) - len(keep)
            rowids = [rowids[i] for i in keep.values()]
            ids = list(keep)
            blobs = [blobs[i] for i in keep.values()]
        if ids:
            shares = np.frombuffer(b"".join(blobs), dtype="<u8").reshape(len(ids), study.width)
            state.add(study, ids, rowids, shares)
    if skipped:
        log.error("study %s: skipped %d malformed or repeated stored rows", record.study_id, skipped)
    if into is None:
        log.info("study %s: rebuilt totals over %d reports", record.study_id, len(state.ids))
    return state


def new_state(study: Study) -> StudyState:
    """The empty in-memory state of a study."""
    return StudyState(k=study.k, d=study.width, n_parties=len(study.parties or ()))


def _load_blocks(conn: Any, record: StudyRecord, chunk_rows: int, backend: Any = None,
                 into: StudyState | None = None) -> StudyState:
    """Rebuild the block index of a study with parties (it has no running totals); ``into`` as
    in :func:`load_state`."""
    study = record.study
    state = into if into is not None else new_state(study)
    widths = [8 * p.width for p in study.parties or ()]
    skipped = 0
    columns = "id, report_id, share, pseudonym, party"
    chunks = (_pages(conn, columns, record.seq, into.last_rowid, chunk_rows) if into is not None else
              _chunks(conn, f"SELECT {columns} FROM reports WHERE study = ? ORDER BY id",
                      (record.seq,), chunk_rows, backend))
    for chunk in chunks:
        by_party: dict[int, tuple[list, list, list]] = {}
        for rowid, bid, share, pseudonym, party in chunk:
            bid, pseudonym = bytes(bid), bytes(pseudonym or b"")
            sound = (party is not None and 0 <= party < len(widths) and len(share) == widths[party]
                     and len(pseudonym) == 16 and bid not in state.ids
                     and pseudonym + bytes((party,)) not in state.slots)
            if not sound:  # cannot happen with a single writer; never count a block twice
                skipped += 1
                continue
            rows, ids, pseudonyms = by_party.setdefault(party, ([], [], []))
            rows.append(rowid)
            ids.append(bid)
            pseudonyms.append(pseudonym)
            state.slots[pseudonym + bytes((party,))] = bid  # seen within this chunk too
        for party, (rows, ids, pseudonyms) in by_party.items():
            for p in pseudonyms:
                del state.slots[p + bytes((party,))]
            state.add_blocks(party, ids, rows, pseudonyms)
    if skipped:
        log.error("study %s: skipped %d malformed or repeated stored blocks", record.study_id, skipped)
    if into is None:
        log.info("study %s: rebuilt the index of %d blocks (%d complete individuals)", record.study_id,
                 len(state.ids), state.complete)
    return state
