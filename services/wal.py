"""SQLite's WAL checkpoints, run beside the writer instead of inside its commits.

Why: SQLite copies the write-ahead log back into the database file (a checkpoint) from within
the COMMIT that takes the log past ``wal_autocheckpoint`` pages (1,000 by default: 32 MiB at this
store's 32 KiB pages). That COMMIT then also writes the log's pages a second time and fsyncs the
database file, and the writer thread, which every upload waits for, waits for it: under a
sustained bulk upload a checkpoint ran every dozen batches, and py-spy put a third of the writer's
time in COMMIT. The share server's second core was mostly idle meanwhile.

So the writer's connection has automatic checkpoints off, and :class:`Checkpointer`, a thread
with a connection of its own, runs PASSIVE checkpoints: after every ``interval_s`` in which the
writer committed, it copies what the log holds into the database file (both synced, as
``synchronous=FULL`` does at a checkpoint: the log before the copy, the file after). A PASSIVE
checkpoint never waits for, nor blocks, the writer or a reader; it copies the frames nobody still
needs and leaves the rest for the next one.

What it cannot do is start the log over: SQLite rewinds the log only when a write transaction
begins while everything in it has been copied, and with the writer committing without pause the
checkpointer is always a little behind. So once the log holds ``restart_pages`` the writer runs a
PASSIVE checkpoint itself between two transactions (little is left to copy by then) and its next
transaction rewinds the log. The log's file thus stays within about ``restart_pages`` pages plus
what the writer commits in one ``interval_s`` (170 MiB measured under a bulk upload, against
about 65 MiB with automatic checkpoints: docs/operations.md).

Durability does not change: a COMMIT still fsyncs the log before the writer acknowledges anything
(``synchronous=FULL``, services/db.py), and a checkpoint, whoever runs it, syncs the log before
copying it and the database after. A crash at any point leaves a log SQLite recovers from on the
next open, as it would after a crash inside an automatic checkpoint.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

from . import db

log = logging.getLogger("dpsketch.server")

#: how often the checkpointer copies the log while the writer commits (seconds)
DEFAULT_INTERVAL_S = 0.25
#: log pages at which the writer rewinds the log itself (4x SQLite's default autocheckpoint:
#: 128 MiB at 32 KiB pages)
DEFAULT_RESTART_PAGES = 4000


class Checkpointer:
    """The checkpoint thread of one SQLite file (module docstring); ``writer_conn`` must be the
    only connection that writes, with automatic checkpoints off (:meth:`attach`)."""

    def __init__(self, path: Path, busy_timeout_s: float, *, interval_s: float = DEFAULT_INTERVAL_S,
                 restart_pages: int = DEFAULT_RESTART_PAGES):
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self.interval_s = interval_s
        self.restart_pages = restart_pages
        #: pages in the log when it was last checkpointed (by either thread)
        self.log_pages = 0
        #: checkpoints run by the thread, and by the writer to rewind the log (for tests and metrics)
        self.runs = 0
        self.rewinds = 0
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dpsketch-wal-checkpoint", daemon=True)
        self._thread.start()

    @staticmethod
    def attach(writer_conn: sqlite3.Connection) -> None:
        """Turn the writer connection's automatic checkpoints off (this thread runs them)."""
        writer_conn.execute("PRAGMA wal_autocheckpoint = 0")

    def committed(self, writer_conn: sqlite3.Connection) -> None:
        """Called by the writer thread after its transactions, outside any: wake the
        checkpointer, and rewind the log if it grew past ``restart_pages``."""
        self._dirty.set()
        if self.log_pages >= self.restart_pages:
            try:
                busy, pages, copied = writer_conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except sqlite3.Error as exc:  # the next transaction reports a broken store
                log.warning("WAL checkpoint by the writer failed: %s", exc)
                return
            self.rewinds += 1
            # all copied: the next transaction starts the log over; else a reader holds old
            # pages, and the checkpointer's next run says how far the log got
            self.log_pages = 0 if not busy and copied == pages else pages

    def _loop(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            while not self._stop.is_set():
                self._dirty.wait()
                if self._stop.wait(self.interval_s):
                    break
                self._dirty.clear()
                try:
                    if conn is None:
                        conn = db.connect(self.path, self.busy_timeout_s)
                    busy, pages, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error as exc:  # e.g. the disk is full: the writer's next COMMIT says so
                    log.warning("WAL checkpoint failed: %s", exc)
                    continue
                self.runs += 1
                self.log_pages = pages
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        """End the thread (before the writer's connection closes)."""
        self._stop.set()
        self._dirty.set()
        self._thread.join()
