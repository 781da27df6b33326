"""Checkpoints of an open study's in-memory state, so a restart does not re-read every share.

A restart used to rebuild each open study's running totals by streaming all its stored shares
through the sketch (about 6 s per 10^6 reports at d = 100, more on a busy disk). A checkpoint is
that state as of one rowid: the running aggregate and s S S^T, and the report index (the ids in
ascending order and their rowids, as two contiguous blobs). Loading one costs reading those
blobs, which become the index's sorted arrays as they are (services/idsets.py; about 0.1 s per
10^6 reports), after checking they are strictly ascending; the reports stored after it (rowids
above ``last_rowid``) are then folded in from the store as before.

Why it is sound: a study's rowids grow in the order its transactions committed (SQLite: the single
writer counts them; PostgreSQL: per-transaction blocks taken under the study's row lock,
services/pg.py), and the state a checkpoint is taken from holds exactly the study's rows up to its
``last_rowid``. A checkpoint that does not parse (or disagrees with the study's shape) is ignored
and the study is rebuilt from the store: it only ever saves time, it is never the truth. Studies
with parties keep no totals and are not checkpointed; a commit deletes the study's checkpoint.

When: the writer takes one after a group of uploads once the study holds ``CHECKPOINT_GROWTH``
more than at the last one (and at least ``CHECKPOINT_MIN_REPORTS``), so the cost of writing them
is a bounded fraction of ingest; and a clean shutdown takes one of every open study.
"""

from __future__ import annotations

import logging
import time
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

# A replica whose view is behind never replaces a newer checkpoint (services/store.py, replicas).
_UPSERT = """
INSERT INTO checkpoints (study, last_rowid, report_count, aggregate, gram, ids, rowids, written_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (study) DO UPDATE SET last_rowid = excluded.last_rowid,
    report_count = excluded.report_count, aggregate = excluded.aggregate, gram = excluded.gram,
    ids = excluded.ids, rowids = excluded.rowids, written_at = excluded.written_at
WHERE excluded.last_rowid > checkpoints.last_rowid
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
    """Take a checkpoint of the study in its own transaction on the writer's connection; False
    (logged) if the database refused: a missing checkpoint costs only restart time."""
    with state.lock:
        snap = snapshot(state)
    try:
        backend.begin(conn)
        write(conn, record.seq, snap)
        conn.execute("COMMIT")
    except backend.errors as exc:
        backend.rollback_quietly(conn)
        log.warning("study %s: no checkpoint (the next restart reads more): %s", record.study_id, exc)
        return False
    state.checkpointed = snap[1]
    return True


def snapshot(state: StudyState) -> tuple:
    """The parameters of a checkpoint of ``state`` (caller holds ``state.lock``; copies, so the
    write can happen after the lock is released)."""
    hi, lo, rowids = state.ids.sorted()
    return (state.last_rowid, len(state.ids), state.aggregate.astype("<u8").tobytes(),
            state.gram.astype("<i8").tobytes(), idsets.join_halves(hi, lo), rowids.astype("<i8").tobytes())


def write(conn: Any, seq: int, snap: tuple) -> None:
    """Store a snapshot (inside the caller's transaction)."""
    conn.execute(_UPSERT, (seq, *snap, time.time()))


def delete(conn: Any, seq: int) -> None:
    conn.execute("DELETE FROM checkpoints WHERE study = ?", (seq,))


def load(conn: Any, record: StudyRecord, state: StudyState) -> bool:
    """Fill an empty ``state`` from the study's checkpoint; False (state untouched) when there is
    none or it does not fit the study."""
    if record.study.parties is not None:
        return False
    row = conn.execute("SELECT last_rowid, report_count, aggregate, gram, ids, rowids FROM checkpoints "
                       "WHERE study = ?", (record.seq,)).fetchone()
    if row is None:
        return False
    last_rowid, count, aggregate, gram, ids, rowids = row
    k, d = state.k, state.d
    count = int(count)
    ids, rowids = bytes(ids), bytes(rowids)
    if (len(aggregate) != 8 * k * d or len(gram) != 8 * k * k or len(ids) != REPORT_ID_BYTES * count
            or len(rowids) != 8 * count):
        log.error("study %s: its checkpoint does not fit the study; rebuilding from the store", record.study_id)
        return False
    hi, lo = idsets.halves(ids)
    rowid_array = np.frombuffer(rowids, dtype="<i8").astype(np.int64)
    if not state.ids.restore(hi, lo, rowid_array):
        log.error("study %s: its checkpoint repeats a report id; rebuilding from the store", record.study_id)
        return False
    state.aggregate[:] = np.frombuffer(bytes(aggregate), dtype="<u8").reshape(k, d)
    state.gram[:] = np.frombuffer(bytes(gram), dtype="<i8").reshape(k, k)
    state.last_rowid = int(last_rowid)
    state.checkpointed = count
    return True
