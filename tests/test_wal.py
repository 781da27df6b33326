"""The WAL checkpoints beside the writer (services/wal.py), on real SQLite files: the log stays
bounded while the writer commits without pause, the writer's own commits copy nothing back,
and a process killed mid-stream loses no committed row."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from dpsketch.services import db
from dpsketch.services.backend import SqliteBackend

ROOT = Path(__file__).resolve().parent.parent
ROW_BYTES = 200_000  # about 6 pages of 32 KiB a transaction


def _wal_bytes(path: Path) -> int:
    try:
        return os.stat(f"{path}-wal").st_size
    except FileNotFoundError:
        return 0


def _write_rows(backend: SqliteBackend, conn: sqlite3.Connection, n: int, *, after_writes: bool,
                sizes: list[int]) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS scratch (k INTEGER PRIMARY KEY, v BLOB)")
    for _ in range(n):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO scratch (v) VALUES (?)", (os.urandom(ROW_BYTES),))
        conn.execute("COMMIT")
        if after_writes:
            backend.after_writes(conn)
        sizes.append(_wal_bytes(backend.path))
        time.sleep(0.002)  # a writer with the time between groups the checkpointer needs


def test_the_log_stays_bounded_and_the_writer_copies_nothing_back(tmp_path):
    path = tmp_path / "s.sqlite3"
    backend = SqliteBackend(path, 5.0)
    conn = backend.initialise()
    checkpointer = backend.checkpointer
    assert checkpointer is not None
    checkpointer.interval_s = 0.02
    checkpointer.restart_pages = 24  # 768 KiB: the log is rewound once it holds this much
    assert conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    sizes: list[int] = []
    _write_rows(backend, conn, 150, after_writes=True, sizes=sizes)  # 30 MB in all
    # the checkpointer copied the log back while the writer went on; the writer rewound it
    assert checkpointer.runs >= 5, checkpointer.runs
    assert checkpointer.rewinds >= 2, checkpointer.rewinds
    # the log's file (its high-water mark) stayed a fraction of what went through it: the
    # threshold plus what the writer committed in a checkpointer's interval (the control below
    # keeps all of it)
    assert max(sizes) < 150 * ROW_BYTES / 4, (max(sizes), 150 * ROW_BYTES)
    assert max(sizes) >= checkpointer.restart_pages * db.PAGE_SIZE  # ... and it was reached
    # and the database file itself holds the rows (copied back), not only the log
    assert os.stat(path).st_size > 100 * ROW_BYTES
    backend.close(conn)
    assert not checkpointer._thread.is_alive()
    fresh = sqlite3.connect(path)
    assert fresh.execute("SELECT count(*), sum(length(v)) FROM scratch").fetchone() == (150, 150 * ROW_BYTES)
    assert fresh.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    fresh.close()


def test_without_the_checkpointer_the_log_holds_every_transaction(tmp_path):
    """The control for the test above: a writer with automatic checkpoints off and nobody copying
    keeps every transaction in the log (so the bound measured above is the checkpointer's doing)."""
    path = tmp_path / "s.sqlite3"
    backend = SqliteBackend(path, 5.0)
    conn = backend.initialise()
    backend.checkpointer.stop()  # as if there were none
    sizes: list[int] = []
    _write_rows(backend, conn, 60, after_writes=False, sizes=sizes)
    assert sizes[-1] >= 60 * ROW_BYTES
    conn.close()


_KILLED_WRITER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from dpsketch.services.backend import SqliteBackend
    backend = SqliteBackend(Path(sys.argv[1]), 5.0)
    conn = backend.initialise()
    backend.checkpointer.interval_s = 0.01
    backend.checkpointer.restart_pages = 16
    conn.execute("CREATE TABLE scratch (k INTEGER PRIMARY KEY, v BLOB)")
    n = 0
    while True:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO scratch (v) VALUES (?)", (os.urandom(100_000),))
        conn.execute("COMMIT")
        n += 1
        backend.after_writes(conn)
        print(n, backend.checkpointer.runs, backend.checkpointer.rewinds, flush=True)
""")


def test_a_writer_killed_while_the_log_is_copied_loses_no_committed_row(tmp_path):
    path = tmp_path / "s.sqlite3"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    committed = runs = rewinds = 0
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (committed >= 300 and runs >= 3 and rewinds >= 2):
            line = proc.stdout.readline()
            assert line, "the writer process ended"
            committed, runs, rewinds = map(int, line.split())
    finally:
        proc.send_signal(signal.SIGKILL)  # mid-stream: a checkpoint may be copying right now
        proc.wait()
    assert committed >= 300 and runs >= 3 and rewinds >= 2
    conn = sqlite3.connect(path)
    held = conn.execute("SELECT count(*) FROM scratch").fetchone()[0]
    assert held >= committed  # every committed row (one more may have committed after the print)
    assert conn.execute("SELECT count(*) FROM scratch WHERE length(v) != 100000").fetchone()[0] == 0
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


def test_a_delete_of_bytes_that_are_not_secret_writes_no_zeros(tmp_path):
    """backend.delete_unerased (a committed study's checkpointed report index, 24 MB at 10^6
    reports): the freed pages are not overwritten, whatever the connection's secure_delete (on
    by default in Debian's SQLite, where the commit wrote and synced 24 MB of zeros), and the
    connection keeps its setting; a plain DELETE with secure_delete on writes them all."""
    path = tmp_path / "s.sqlite3"
    backend = SqliteBackend(path, 5.0)
    conn = backend.initialise()
    conn.execute("CREATE TABLE scratch (k INTEGER PRIMARY KEY, v BLOB)")
    blob = 4 << 20
    for setting, unerased in ((1, True), (2, True), (0, True), (1, False)):
        conn.execute("INSERT INTO scratch (k, v) VALUES (1, ?)", (os.urandom(blob),))
        busy, _pages, _copied = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        assert not busy and _wal_bytes(path) == 0
        conn.execute(f"PRAGMA secure_delete = {'FAST' if setting == 2 else setting}")
        conn.execute("BEGIN IMMEDIATE")
        if unerased:
            backend.delete_unerased(conn, "DELETE FROM scratch WHERE k = ?", (1,))
        else:
            conn.execute("DELETE FROM scratch WHERE k = ?", (1,))
        conn.execute("COMMIT")
        assert conn.execute("PRAGMA secure_delete").fetchone()[0] == setting
        if unerased:
            assert _wal_bytes(path) < blob // 8, (setting, _wal_bytes(path))
        else:  # the control: every freed page written again, as zeros
            assert _wal_bytes(path) > blob, _wal_bytes(path)
    backend.close(conn)
