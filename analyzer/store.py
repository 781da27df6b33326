"""The analyzer's durable state: studies it created, the inclusion set it chose, the release.

The inclusion set is written here *before* any server is asked to commit, so an analyzer that
crashes mid-finalization resumes with the same set and no server is ever asked for two.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpsketch.protocol import Study, messages

SCHEMA = """
CREATE TABLE IF NOT EXISTS studies (
    study_id     TEXT PRIMARY KEY,
    study_json   TEXT NOT NULL,
    explanation  TEXT NOT NULL,
    created_at   REAL NOT NULL,
    inclusion    BLOB,              -- files written before: the inclusion set (now in inclusions)
    inclusion_hash TEXT,            -- set with the inclusion set, before the first commit
    ring_sum     BLOB,              -- k*d uint64, the reconstructed sum of the N aggregate shares
    n_reports    INTEGER,
    released_at  REAL
);
-- sorted 16-byte ids, fixed before the first commit. A table of its own: SQLite rewrites a
-- whole row on UPDATE, so the release's update of a studies row holding its 16 MB set (10^6
-- reports) wrote the set again (0.13-0.2 s of a finalization, issue 46).
CREATE TABLE IF NOT EXISTS inclusions (
    study_id     TEXT PRIMARY KEY,
    ids          BLOB NOT NULL
);
-- a validity study's verification round, once every server decided (VerificationSummary JSON):
-- written before the inclusion set is fixed, shown with the study and its progress
CREATE TABLE IF NOT EXISTS verifications (
    study_id     TEXT PRIMARY KEY,
    summary      TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class StudyRecord:
    study: Study
    explanation: list[str]
    created_at: float
    inclusion_hash: str | None
    n_reports: int | None
    released_at: float | None
    ring_sum: np.ndarray | None
    #: a validity study's round, once decided (VerificationSummary as JSON members); else None
    verification: dict | None = None

    @property
    def state(self) -> str:
        if self.released_at is not None:
            return "released"
        if self.inclusion_hash is not None:
            return "finalizing"
        return "collecting"


class AnalyzerStore:
    def __init__(self, path: str | Path):
        self.path = str(path)
        self._lock = threading.Lock()
        if self.path != ":memory:":  # created owner-only (SQLite gives its WAL and SHM files the same mode)
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        #: SQLite's automatic checkpoint (pages of log), off for a finalization's writes
        self._autocheckpoint = int(self._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    def add_study(self, study: Study, explanation: list[str]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO studies (study_id, study_json, explanation, created_at) "
                "VALUES (?, ?, ?, ?)",
                (study.study_id, study.model_dump_json(), json.dumps(explanation), time.time()),
            )

    def forget_unprovisioned(self, study_id: str) -> None:
        """Drop a study that a server refused at provisioning; one with an inclusion set or a
        release is never dropped."""
        with self._lock:
            self._db.execute("DELETE FROM studies WHERE study_id = ? AND inclusion_hash IS NULL "
                             "AND released_at IS NULL", (study_id,))

    def _record(self, row: tuple) -> StudyRecord:
        study_json, explanation, created_at, inclusion_hash, ring_sum, n_reports, released_at, summary = row
        study = Study.model_validate_json(study_json)
        ring = None
        if ring_sum is not None:
            ring = messages.decode_aggregate(ring_sum, study.k, study.width)
        return StudyRecord(study, json.loads(explanation), created_at, inclusion_hash, n_reports,
                           released_at, ring, None if summary is None else json.loads(summary))

    _COLUMNS = ("s.study_json, s.explanation, s.created_at, s.inclusion_hash, s.ring_sum, s.n_reports, "
                "s.released_at, v.summary")
    _FROM = "studies s LEFT JOIN verifications v ON v.study_id = s.study_id"

    def get(self, study_id: str) -> StudyRecord | None:
        with self._lock:
            row = self._db.execute(
                f"SELECT {self._COLUMNS} FROM {self._FROM} WHERE s.study_id = ?", (study_id,)
            ).fetchone()
        return self._record(row) if row else None

    def list(self) -> list[StudyRecord]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {self._COLUMNS} FROM {self._FROM} ORDER BY s.created_at"
            ).fetchall()
        return [self._record(r) for r in rows]

    def record_verification(self, study_id: str, summary: dict) -> None:
        """Keep what a validity study's round decided (the last round run wins: every rerun of
        an idempotent round answers the same)."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO verifications (study_id, summary) VALUES (?, ?)",
                             (study_id, json.dumps(summary, sort_keys=True)))

    def fix_inclusion(self, study_id: str, sorted_ids: bytes, inclusion_hash: str | None = None) -> bytes:
        """Record the inclusion set (a sorted id list) once; return the set on record (an
        earlier one wins). ``inclusion_hash``: its hash, if the caller has it (SHA-256 of 16 MB
        at 10^6 reports, otherwise computed here)."""
        with self._lock, self._no_automatic_checkpoint():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute(
                    "SELECT inclusion_hash FROM studies WHERE study_id = ?", (study_id,)
                ).fetchone()
                if row is None:
                    raise KeyError(study_id)
                if row[0] is None:
                    self._db.execute("INSERT OR REPLACE INTO inclusions (study_id, ids) VALUES (?, ?)",
                                     (study_id, sorted_ids))
                    self._db.execute("UPDATE studies SET inclusion_hash = ? WHERE study_id = ?",
                                     (inclusion_hash or messages.inclusion_hash(sorted_ids), study_id))
                    self._db.execute("COMMIT")
                    return sorted_ids
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        earlier = self.inclusion(study_id)
        assert earlier is not None
        return earlier

    @contextlib.contextmanager
    def _no_automatic_checkpoint(self) -> Iterator[None]:
        """A write (caller holds ``_lock``) whose commit does not copy the log into the database
        file: SQLite's automatic checkpoint runs in the commit that finds 1000 pages or more in
        the log, and the inclusion set alone is 16 MB at 10^6 reports (4000 pages), so fixing
        it copied and synced it twice on the finalization's path (issue 46). The log is copied
        after the release instead (:meth:`_checkpoint_soon`), or by the next other write."""
        self._db.execute("PRAGMA wal_autocheckpoint = 0")
        try:
            yield
        finally:
            self._db.execute(f"PRAGMA wal_autocheckpoint = {self._autocheckpoint}")

    def _checkpoint_soon(self) -> None:
        """Copy the log into the database file, on a connection of its own in the background:
        after a release (:meth:`release`), whose finalization wrote its inclusion set, 16 MB at
        10^6 reports, to the log; not while the servers commit, whose syncs it would compete
        with for the disk, nor while the analyst waits for the release (issue 46)."""
        if self.path == ":memory:":
            return

        def run() -> None:
            try:
                conn = sqlite3.connect(self.path, isolation_level=None)
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                finally:
                    conn.close()
            except sqlite3.Error:  # the next automatic checkpoint does it
                pass

        threading.Thread(target=run, name="dpsketch-analyzer-checkpoint", daemon=True).start()

    def clear_inclusion(self, study_id: str) -> None:
        """Forget an inclusion set that no server committed (its certificate was refused)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cleared = self._db.execute(
                    "UPDATE studies SET inclusion = NULL, inclusion_hash = NULL "
                    "WHERE study_id = ? AND released_at IS NULL",
                    (study_id,),
                ).rowcount
                if cleared:
                    self._db.execute("DELETE FROM inclusions WHERE study_id = ?", (study_id,))
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def inclusion(self, study_id: str) -> bytes | None:
        """The inclusion set on record (a sorted id list), if one was fixed (in a file written
        before the inclusions table, in its studies row)."""
        with self._lock:
            row = self._db.execute("SELECT ids FROM inclusions WHERE study_id = ?", (study_id,)).fetchone()
            if row is None:
                row = self._db.execute(
                    "SELECT inclusion FROM studies WHERE study_id = ? AND inclusion_hash IS NOT NULL", (study_id,)
                ).fetchone()
        if row is None or row[0] is None:
            return None
        return bytes(row[0])

    def release(self, study_id: str, ring_sum: np.ndarray, n_reports: int) -> None:
        """Record the release; then copy the log (the inclusion set, written before the
        servers committed) into the database file in the background. Without SQLite's
        automatic checkpoint at this write: it would copy the 16 MB of a set at 10^6 reports
        while the analyst waits (0.13-0.24 s of a finalization, issue 46)."""
        with self._lock, self._no_automatic_checkpoint():
            self._db.execute(
                "UPDATE studies SET ring_sum = ?, n_reports = ?, released_at = ? "
                "WHERE study_id = ? AND released_at IS NULL",
                (messages.encode_aggregate(ring_sum), n_reports, time.time(), study_id),
            )
        self._checkpoint_soon()
