"""Checkpoints of an open study's in-memory state, so a restart does not re-read every share.

A restart used to rebuild each open study's running totals by streaming all its stored shares
through the sketch (about 6 s per 10^6 reports at d = 100, more on a busy disk). A checkpoint is
that state as of one rowid: the running aggregate and s S S^T, and the report index (the ids in
ascending order and their rowids, as two contiguous blobs). Loading one costs reading those
blobs, which become the index's sorted arrays (services/idsets.py; about 0.1 s per 10^6
reports), after checking there is no repeated id; the reports stored after it (rowids above
``last_rowid``) are then folded in from the store as before.

Incremental: a checkpoint's ids are a *base* and *segments* (``checkpoint_segments``), its totals
a ``checkpoints`` row: a later checkpoint rewrites only the totals and
appends the ids stored since the previous one, as one segment in the order they were stored (the
state keeps them as they come, ``StudyState.since_checkpoint``: taking them from the sorted index
meant sorting the whole index and scanning it, each time). Rewriting the whole index
each time wrote about five times the final index over a study's life (one checkpoint per 25% of
growth) and was a sixth of the writer's time in a bulk upload. A checkpoint is written whole again
(base replaced, segments deleted) when the segments would hold more than ``COMPACT_AFTER`` times
the base, or number more than ``MAX_SEGMENTS``: about 2.3 times the final index in all, and a load
sorts the parts together (a stable radix sort, about 0.1 s per 10^6 ids). The base is the first
segment row, written in the same transaction as the totals row, whose ids stay empty (SQLite rewrites
a row whole, so a base held beside the totals was read and written again at every later
checkpoint); a base in the totals row, as servers before issue 46 wrote it, is read as before.

Why it is sound: a study's rowids grow in the order its transactions committed (SQLite: the single
writer counts them; PostgreSQL: per-transaction blocks taken under the study's row lock,
services/pg.py), and the state a checkpoint is taken from holds exactly the study's rows up to its
``last_rowid``. A segment holds the study's ids with rowids above the previous checkpoint's
``last_rowid`` and at most its own, and is written in the transaction that moves the totals row
from the one to the other: a compare-and-set on ``last_rowid`` and the count, so a replica that
did not write the previous checkpoint writes a whole one instead. A checkpoint that does not parse
(or disagrees with the study's shape, or whose parts do not add up to its count) is ignored and the
study is rebuilt from the store: it only ever saves time, it is never the truth. Studies with
parties keep no totals and are not checkpointed; a commit deletes the study's checkpoint.

When: the writer takes one after a group of uploads once the study holds ``CHECKPOINT_GROWTH``
more than at the last one (and at least ``CHECKPOINT_MIN_REPORTS``), so the cost of writing them
is a bounded fraction of ingest; and a clean shutdown takes one of every open study.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpsketch.protocol.sketch import REPORT_ID_BYTES

from . import idsets
from .state import StudyRecord, StudyState

log = logging.getLogger("dpsketch.server")

#: A new checkpoint once the study grew by this fraction since the last one ...
CHECKPOINT_GROWTH = 0.25
#: ... and only for studies at least this large (a smaller one rebuilds in well under a second).
CHECKPOINT_MIN_REPORTS = 50_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    study        BIGINT PRIMARY KEY,
    last_rowid   BIGINT NOT NULL,
    report_count BIGINT NOT NULL,
    aggregate    BLOB NOT NULL,
    gram         BLOB NOT NULL,
    ids          BLOB NOT NULL,
    rowids       BLOB NOT NULL,
    written_at   REAL NOT NULL
)"""

#: The ids of later checkpoints (module docstring); a segment's last_rowid is its checkpoint's.
SEGMENTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoint_segments (
    study      BIGINT NOT NULL,
    last_rowid BIGINT NOT NULL,
    ids        BLOB NOT NULL,
    rowids     BLOB NOT NULL,
    PRIMARY KEY (study, last_rowid)
)"""

#: A whole checkpoint again once the segments would hold more than this many times the base ...
COMPACT_AFTER = 3.0
#: ... or number more than this.
MAX_SEGMENTS = 16

# A replica whose view is behind never replaces a newer checkpoint (services/store.py, replicas).
_UPSERT = """
INSERT INTO checkpoints (study, last_rowid, report_count, aggregate, gram, ids, rowids, written_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (study) DO UPDATE SET last_rowid = excluded.last_rowid,
    report_count = excluded.report_count, aggregate = excluded.aggregate, gram = excluded.gram,
    ids = excluded.ids, rowids = excluded.rowids, written_at = excluded.written_at
WHERE excluded.last_rowid > checkpoints.last_rowid
"""

_INSERT_SEGMENT = "INSERT INTO checkpoint_segments (study, last_rowid, ids, rowids) VALUES (?, ?, ?, ?)"

# An incremental checkpoint: the totals move from the previous checkpoint (the one this state
# knows) to this one, or nothing changes (another replica wrote one meanwhile).
_ADVANCE = """
UPDATE checkpoints SET last_rowid = ?, report_count = ?, aggregate = ?, gram = ?, written_at = ?
WHERE study = ? AND last_rowid = ? AND report_count = ?
"""


def due(record: StudyRecord, state: StudyState, growth: float = CHECKPOINT_GROWTH) -> bool:
    """Whether the study should be checkpointed now: it grew by ``growth`` since the last one
    (0 at a clean shutdown: any growth)."""
    if record.study.parties is not None or record.commit is not None:
        return False
    held = len(state.ids)
    return (held >= CHECKPOINT_MIN_REPORTS and held > state.checkpointed
            and held >= (1 + growth) * state.checkpointed)


def save(conn: Any, backend: Any, record: StudyRecord, state: StudyState) -> bool:
    """Take a checkpoint of the study in its own transaction on the writer's connection, a
    segment on top of the last one where it can (module docstring); False (logged) if the
    database refused: a missing checkpoint costs only restart time."""
    with state.lock:
        snap = snapshot(state)
        taken = len(state.since_checkpoint)  # the writer is the only thread that adds: none since
    try:
        backend.begin(conn)
        written = write(conn, record.seq, snap)
        conn.execute("COMMIT")
    except backend.errors as exc:
        backend.rollback_quietly(conn)
        log.warning("study %s: no checkpoint (the next restart reads more): %s", record.study_id, exc)
        return False
    state.checkpointed = snap.count
    del state.since_checkpoint[:taken]
    if written == "segment":
        state.checkpoint_rowid = snap.last_rowid
        state.checkpoint_segments.append(snap.n_ids)
    elif written == "whole":
        state.checkpoint_rowid, state.checkpoint_base, state.checkpoint_segments = snap.last_rowid, snap.n_ids, []
    else:  # another replica's is newer, or moved on from ours: the next one is written whole
        state.checkpoint_rowid = 0
    return True


@dataclass
class Snapshot:
    """What one checkpoint writes: the totals and either the whole index (``previous`` None) or
    the ids stored since the checkpoint at rowid ``previous`` (which held ``previous_count``)."""

    last_rowid: int
    count: int
    aggregate: bytes
    gram: bytes
    ids: bytes
    rowids: bytes
    previous: int | None = None
    previous_count: int = 0

    @property
    def n_ids(self) -> int:
        return len(self.ids) // REPORT_ID_BYTES


def snapshot(state: StudyState, incremental: bool = True) -> Snapshot:
    """A checkpoint of ``state`` (caller holds ``state.lock``; copies, so the write can happen
    after the lock is released): a segment of the ids stored since the last checkpoint when
    there is one and the segments stay small enough, else the whole index."""
    totals = (state.last_rowid, len(state.ids), state.aggregate.astype("<u8").tobytes(),
              state.gram.astype("<i8").tobytes())
    if incremental and state.checkpoint_rowid and state.checkpointed:
        n_new = sum(len(rowids) for _, rowids in state.since_checkpoint)
        if (len(state.checkpoint_segments) < MAX_SEGMENTS
                and sum(state.checkpoint_segments) + n_new <= COMPACT_AFTER * state.checkpoint_base
                and state.checkpointed + n_new == len(state.ids)):
            ids = b"".join(joined for joined, _ in state.since_checkpoint)
            rowids = (np.concatenate([r for _, r in state.since_checkpoint]) if state.since_checkpoint
                      else np.zeros(0, np.int64))
            if bool(np.all(rowids > state.checkpoint_rowid)):  # as they must be: else write it whole
                return Snapshot(*totals, ids, rowids.astype("<i8").tobytes(),
                                previous=state.checkpoint_rowid, previous_count=state.checkpointed)
    hi, lo, rowids = state.ids.sorted()
    return Snapshot(*totals, idsets.join_halves(hi, lo), rowids.astype("<i8").tobytes())


def write(conn: Any, seq: int, snap: Snapshot) -> str | None:
    """Store a snapshot (inside the caller's transaction): "segment" or "whole", or None when
    the stored checkpoint is newer, or is not the one the segment continues (another replica's)."""
    now = time.time()
    if snap.previous is not None:
        advanced = conn.execute(_ADVANCE, (snap.last_rowid, snap.count, snap.aggregate, snap.gram, now,
                                           seq, snap.previous, snap.previous_count)).rowcount
        if advanced != 1:
            return None
        conn.execute(_INSERT_SEGMENT, (seq, snap.last_rowid, snap.ids, snap.rowids))
        return "segment"
    # the base's ids go in a segment row of their own, the totals row keeps empty ones: every later
    # checkpoint rewrites the totals row, and SQLite rewrites a row whole, so a base held there was
    # read and written again each time (250-590 ms a checkpoint at a base of 2.5 x 10^5-10^6 ids on
    # this VM, against 49-94 ms without; docs/operations.md)
    stored = conn.execute(_UPSERT, (seq, snap.last_rowid, snap.count, snap.aggregate, snap.gram, b"", b"",
                                    now)).rowcount
    if stored != 1:
        return None
    conn.execute("DELETE FROM checkpoint_segments WHERE study = ?", (seq,))
    conn.execute(_INSERT_SEGMENT, (seq, snap.last_rowid, snap.ids, snap.rowids))
    return "whole"


def delete(conn: Any, seq: int) -> None:
    """Delete the checkpoint of a study dropped before its release: its shares go too, so its
    segments (report ids and rowids) are erased as the connection erases what it deletes."""
    conn.execute("DELETE FROM checkpoints WHERE study = ?", (seq,))
    conn.execute("DELETE FROM checkpoint_segments WHERE study = ?", (seq,))


def delete_at_commit(conn: Any, seq: int, backend: Any) -> None:
    """Delete a committed study's checkpoint. Its totals row (the running aggregate share) goes
    as the connection deletes secrets; its segments, report ids and rowids that the study's
    stored batches keep anyway, go without zeroing their pages (``backend.delete_unerased``:
    24 MB of zeros at 10^6 reports were a commit's largest write)."""
    conn.execute("DELETE FROM checkpoints WHERE study = ?", (seq,))
    backend.delete_unerased(conn, "DELETE FROM checkpoint_segments WHERE study = ?", (seq,))


def load(conn: Any, record: StudyRecord, state: StudyState) -> bool:
    """Fill an empty ``state`` from the study's checkpoint (its base and segments); False (state
    untouched) when there is none or it does not fit the study."""
    if record.study.parties is not None:
        return False
    row = conn.execute("SELECT last_rowid, report_count, aggregate, gram, ids, rowids FROM checkpoints "
                       "WHERE study = ?", (record.seq,)).fetchone()
    if row is None:
        return False
    last_rowid, count, aggregate, gram, ids, rowids = row
    segments = conn.execute("SELECT ids, rowids FROM checkpoint_segments WHERE study = ? AND last_rowid <= ? "
                            "ORDER BY last_rowid", (record.seq, last_rowid)).fetchall()
    k, d = state.k, state.d
    count = int(count)
    parts = [(bytes(ids), bytes(rowids))] + [(bytes(i), bytes(r)) for i, r in segments]
    if not parts[0][0] and len(parts) > 1:  # the base in the first segment (``write``), not in the totals row
        parts = parts[1:]
    sizes = [len(i) // REPORT_ID_BYTES for i, _ in parts]
    if (len(aggregate) != 8 * k * d or len(gram) != 8 * k * k or sum(sizes) != count
            or any(len(i) != REPORT_ID_BYTES * n or len(r) != 8 * n for (i, r), n in zip(parts, sizes))):
        log.error("study %s: its checkpoint does not fit the study; rebuilding from the store", record.study_id)
        return False
    joined = parts[0][0] if len(parts) == 1 else b"".join(i for i, _ in parts)
    hi, lo = idsets.halves(joined)
    rowid_array = np.frombuffer(b"".join(r for _, r in parts), dtype="<i8").astype(np.int64)
    if not state.ids.restore(hi, lo, rowid_array):
        log.error("study %s: its checkpoint repeats a report id; rebuilding from the store", record.study_id)
        return False
    state.aggregate[:] = np.frombuffer(bytes(aggregate), dtype="<u8").reshape(k, d)
    state.gram[:] = np.frombuffer(bytes(gram), dtype="<i8").reshape(k, k)
    state.last_rowid = int(last_rowid)
    state.checkpointed = count
    state.checkpoint_rowid, state.checkpoint_base, state.checkpoint_segments = int(last_rowid), sizes[0], sizes[1:]
    state.since_checkpoint = []
    return True
