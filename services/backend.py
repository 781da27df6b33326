"""The seam between the store's logic (store.py, writer.py, state.py, keys.py) and its database:
SQLite (a file, the default) or PostgreSQL (a ``postgresql://`` URL, services/pg.py).

Why a seam and not two stores: every guarantee (durable before acknowledgement, idempotence by
report id, conflicts refused, one inclusion set per study committed atomically, the same
aggregate bytes on every call, retention) lives in the study logic and the single writer, which
both databases share unchanged. What differs is small and listed here: how to connect, how a
write transaction begins, a few statements (storing a batch, reading slices of one, a secure
erase), and which exceptions mean "the database cannot answer now" (503).
"""

from __future__ import annotations

import re
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from dpsketch.protocol.problems import ProblemError

from . import batches, db
from .wal import Checkpointer


def is_url(location: str | Path | None) -> bool:
    """A PostgreSQL URL (``postgresql://`` or ``postgres://``), as opposed to a SQLite file."""
    return isinstance(location, str) and location.split("://", 1)[0].lower() in ("postgresql", "postgres")


def redact(url: str) -> str:
    """A URL without its password, for logs and error messages."""
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


class SqliteBackend:
    """The SQLite file (services/db.py): WAL, synchronous=FULL, one writer, per-thread readers."""

    name = "sqlite"
    #: one server process owns the file (SQLite has one writer): nothing to catch up on
    shared = False
    LEDGER_ORDER = "charged_at, rowid"
    errors: tuple[type[BaseException], ...] = (sqlite3.Error,)

    def __init__(self, path: Path, busy_timeout_s: float):
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        #: runs the WAL's checkpoints beside the writer (services/wal.py), once initialised
        self.checkpointer: Checkpointer | None = None

    @property
    def location(self) -> str:
        return str(self.path)

    @property
    def file_path(self) -> Path | None:
        """The database file (its mode is restricted when it gets a private key)."""
        return self.path

    def initialise(self) -> sqlite3.Connection:
        conn = db.initialise(self.path, self.busy_timeout_s)
        Checkpointer.attach(conn)
        self.checkpointer = Checkpointer(self.path, self.busy_timeout_s)
        return conn

    def after_writes(self, writer: sqlite3.Connection) -> None:
        """The writer thread, between transactions: let the WAL be checkpointed (services/wal.py)."""
        if self.checkpointer is not None:
            self.checkpointer.committed(writer)

    def ping(self) -> None:
        """Raise ``sqlite3.Error`` unless a *new* read-only connection can read the file now (an
        open one answers from its descriptor after the file is gone: observability.sqlite_reachable)."""
        from dpsketch.observability import sqlite_reachable

        sqlite_reachable(self.path)

    def size_bytes(self) -> int | None:
        """Bytes on disk: the file, its WAL and its shared-memory index."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            try:
                total += os.stat(f"{self.path}{suffix}").st_size
            except OSError:
                pass
        return total

    @contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        """This thread's read-only connection (kept open: cheap to reuse, WAL readers never block)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = db.connect(self.path, self.busy_timeout_s, readonly=True)
            self._local.conn = conn
            with self._readers_lock:
                self._readers.append(conn)
        yield conn

    @staticmethod
    def begin(conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")  # take the write lock now, not at the first write

    @staticmethod
    def insert_batch(conn: sqlite3.Connection, params: dict) -> None:
        """The batch row; its shares (``params["shares"]``: byte buffers, in order) written in
        place when large (db.INSERT_BATCH_IN_PLACE), so that no buffer of their size is made."""
        parts = params["shares"]
        total = sum(part.nbytes for part in parts)
        if total < db.IN_PLACE_BYTES:
            conn.execute(db.INSERT_BATCH, {**params, "shares": batches.one_buffer(parts)})
            return
        conn.execute(db.INSERT_BATCH_IN_PLACE, {**params, "share_bytes": total})  # :shares unused
        with conn.blobopen("batches", "shares", params["first"]) as blob:
            for part in parts:
                blob.write(part)

    @staticmethod
    def read_slices(conn: sqlite3.Connection, first: int, m: int,
                    offsets: list[int]) -> tuple[bytes, bytes, bytes | None, int | None]:
        """(ids, shares, pseudonyms, party) of the reports at ``offsets`` of the batch stored
        under ``first``, read by incremental blob I/O: only the pages holding them."""
        has_pseudonyms, party = conn.execute("SELECT pseudonyms IS NOT NULL, party FROM batches WHERE first = ?",
                                             (first,)).fetchone()

        def take(column: str, width: int | None) -> bytes:
            with conn.blobopen("batches", column, first, readonly=True) as blob:
                width = len(blob) // m if width is None else width
                if len(offsets) * batches.SLICE_READ_BYTES >= len(blob):
                    # dense enough: one read of the column and a numpy pick costs less than a
                    # Python seek + read per record (about 1-2 us each: 0.09 s of a 10^6-report
                    # commit's 0.2 s of CPU when it read back 3 % excluded records one by one)
                    return batches.pick(blob.read(), np.asarray(offsets, dtype=np.int64), width)
                out = bytearray()
                for o in offsets:
                    blob.seek(o * width)
                    out += blob.read(width)
            return bytes(out)

        return (take("ids", 16), take("shares", None), take("pseudonyms", 16) if has_pseudonyms else None,
                None if party is None else int(party))

    @staticmethod
    def lock_study(conn: sqlite3.Connection, seq: int) -> tuple[int, str] | None:
        """(report_count, status) of a study; BEGIN IMMEDIATE already holds the file's write lock."""
        return conn.execute("SELECT report_count, status FROM studies WHERE seq = ?", (seq,)).fetchone()

    @staticmethod
    def rowid_base(conn: sqlite3.Connection, next_rowid: int) -> int:
        """The first rowid of a transaction's inserts: the single writer counts them itself."""
        return next_rowid

    @staticmethod
    def lock_provisioning(conn: sqlite3.Connection) -> None:
        """Serialise study provisioning (and ledger charges): the single writer already does."""

    @staticmethod
    def insert_id(conn: sqlite3.Connection, sql: str, params: tuple) -> int:
        return int(conn.execute(sql, params).lastrowid)

    @staticmethod
    def ddl(sql: str) -> str:
        return sql

    def create_table(self, conn: sqlite3.Connection, sql: str) -> None:
        """``CREATE TABLE IF NOT EXISTS`` (one writer: nothing can race it)."""
        conn.execute(self.ddl(sql))

    @staticmethod
    def erase_and_delete(conn: sqlite3.Connection, table: str, column: str, size: int, where: str,
                         params: tuple) -> None:
        """Overwrite a secret with zeros, then delete its row, leaving no copy in free pages."""
        conn.execute("PRAGMA secure_delete = ON")
        try:
            conn.execute(f"UPDATE {table} SET {column} = zeroblob(?) WHERE {where}", (size, *params))
            conn.execute(f"DELETE FROM {table} WHERE {where}", params)
        finally:
            conn.execute("PRAGMA secure_delete = OFF")

    @staticmethod
    def delete_unerased(conn: sqlite3.Connection, sql: str, params: tuple) -> None:
        """Run a DELETE of bytes that are not secret without overwriting the pages it frees. A
        SQLite built with SECURE_DELETE on by default (Debian's, for one) zeroes every freed
        page: for a study's checkpointed report index, 24 MB at 10^6 reports written and synced
        in its commit's transaction (issue 46). The connection's own setting is kept."""
        prior = int(conn.execute("PRAGMA secure_delete").fetchone()[0])
        conn.execute("PRAGMA secure_delete = OFF")
        try:
            conn.execute(sql, params)
        finally:
            conn.execute(f"PRAGMA secure_delete = {'FAST' if prior == 2 else prior}")

    @staticmethod
    def unavailable(exc: BaseException, retry_after_s: int = 1) -> ProblemError:
        return db.unavailable(exc, retry_after_s)

    @staticmethod
    def rollback_quietly(conn: sqlite3.Connection) -> None:
        db.rollback_quietly(conn)

    def close(self, writer: sqlite3.Connection) -> None:
        with self._readers_lock:
            for conn in self._readers:
                try:
                    conn.close()
                except sqlite3.Error:
                    pass
            self._readers.clear()
        if self.checkpointer is not None:
            self.checkpointer.stop()
        try:
            writer.execute("PRAGMA wal_checkpoint(PASSIVE)")
            writer.close()
        except sqlite3.Error:
            pass


class PostgresBackend:
    """A PostgreSQL database (services/pg.py): one writer connection, a pool of readers."""

    name = "postgres"
    #: several replicas of one organisation's server may share the database (docs/operations.md)
    shared = True

    def __init__(self, url: str, busy_timeout_s: float, wait_s: float = 0.0):
        from . import pg

        self.pg = pg
        self.url = url
        self.busy_timeout_s = busy_timeout_s
        self.wait_s = wait_s
        self.LEDGER_ORDER = "charged_at, n"
        self.errors = pg.ERRORS
        self._pool = None

    @property
    def location(self) -> str:
        return redact(self.url)

    @property
    def file_path(self) -> Path | None:
        return None

    def initialise(self):
        self.pg.wait_until_reachable(self.url, self.wait_s)
        conn = self.pg.initialise(self.url, self.busy_timeout_s)
        self._pool = self.pg.ReadPool(self.url, self.busy_timeout_s)
        return conn

    @staticmethod
    def after_writes(writer) -> None:
        """Nothing: PostgreSQL checkpoints in its own processes."""

    def reading(self):
        return self._pool.connection()

    def ping(self) -> None:
        """One query on a pooled connection (the pool checks an idle connection before reuse)."""
        with self.reading() as conn:
            conn.execute("SELECT 1").fetchone()

    def size_bytes(self) -> int | None:
        """The database's size as PostgreSQL reports it (tables, indexes, TOAST)."""
        with self.reading() as conn:
            return int(conn.execute("SELECT pg_database_size(current_database())").fetchone()[0])

    @staticmethod
    def begin(conn) -> None:
        conn.execute("BEGIN")

    def insert_batch(self, conn, params: dict) -> None:
        """The batch, and its report keys in ``reports`` (the database's own uniqueness check)."""
        params = {**params, "shares": batches.one_buffer(params["shares"])}
        conn.execute(self.pg.INSERT_BATCH, params)
        conn.execute(self.pg.INSERT_REPORT_KEYS, params)

    @staticmethod
    def read_slices(conn, first: int, m: int, offsets: list[int]) -> tuple[bytes, bytes, bytes | None, int | None]:
        """As SqliteBackend.read_slices, by its rule (batches.SLICE_READ_BYTES), column by column:
        a column whose records wanted are many for its size is fetched whole, in one read of its
        TOAST chunks, and picked with numpy; the others by ``substring`` of their uncompressed
        values (STORAGE EXTERNAL), which reads only the chunks holding each record. Issue 46: a
        10^6-report commit on PostgreSQL read back its 2-3 % excluded reports as two substrings
        each (tens of thousands of lookups into the TOAST table a server), about half of the
        writer's time in a commit (py-spy); a batch's 16-byte ids, or a server's 32-byte seeds,
        take fewer bytes whole than that many substrings cost."""
        octets, has_pseudonyms, party = conn.execute(
            "SELECT octet_length(shares), pseudonyms IS NOT NULL, party FROM batches WHERE first = ?",
            (first,)).fetchone()
        widths = {"ids": 16, "shares": int(octets) // m if m else 0, **({"pseudonyms": 16} if has_pseudonyms else {})}
        whole = [c for c, w in widths.items() if len(offsets) * batches.SLICE_READ_BYTES >= w * m]
        sliced = [c for c in widths if c not in whole]
        out: dict[str, bytes] = {}
        if whole:
            row = conn.execute(f"SELECT {', '.join(whole)} FROM batches WHERE first = ?", (first,),
                               binary=True).fetchone()
            at = np.asarray(offsets, dtype=np.int64)
            out.update((c, batches.pick(bytes(value), at, widths[c])) for c, value in zip(whole, row))
        if sliced:  # the widths are integers this query computed from the row itself
            rows = conn.execute(
                "SELECT " + ", ".join(f"substring({c} FROM o * {widths[c]} + 1 FOR {widths[c]})" for c in sliced)
                + " FROM batches, unnest(CAST(? AS integer[])) AS o WHERE first = ? ORDER BY o", (offsets, first),
                binary=True).fetchall()
            out.update((c, b"".join(bytes(r[i]) for r in rows)) for i, c in enumerate(sliced))
        return out["ids"], out["shares"], out.get("pseudonyms"), None if party is None else int(party)

    @staticmethod
    def lock_study(conn, seq: int) -> tuple[int, str] | None:
        """(report_count, status) of a study, with its row locked until the transaction ends:
        every write that changes what a study holds (uploads, tokens, the commit) takes this lock
        first, so replicas sharing the database change a study one at a time."""
        return conn.execute("SELECT report_count, status FROM studies WHERE seq = ? FOR UPDATE",
                            (seq,)).fetchone()

    def rowid_base(self, conn, next_rowid: int) -> int:
        """The first of 2^32 rowids reserved for this transaction alone (services/pg.py, taken
        after the study locks: a study's rowids then grow in commit order)."""
        return int(conn.execute(f"SELECT nextval('{self.pg.ROWID_BLOCKS}')").fetchone()[0])

    def lock_provisioning(self, conn) -> None:
        """Serialise study provisioning and ledger charges across replicas, until COMMIT."""
        conn.execute(f"SELECT pg_advisory_xact_lock({self.pg.PROVISION_LOCK_KEY})")

    @staticmethod
    def insert_id(conn, sql: str, params: tuple) -> int:
        return int(conn.execute(sql + " RETURNING seq", params).fetchone()[0])

    @staticmethod
    def ddl(sql: str) -> str:
        """A table written in SQLite's types (services/keys.py) in PostgreSQL's."""
        return sql.replace("BLOB", "BYTEA").replace("REAL", "DOUBLE PRECISION")

    def create_table(self, conn, sql: str) -> None:
        """``CREATE TABLE IF NOT EXISTS`` under the schema lock: replicas starting together would
        otherwise race on PostgreSQL's catalog (a unique violation in pg_type for the loser)."""
        conn.execute("BEGIN")
        try:
            conn.execute(f"SELECT pg_advisory_xact_lock({self.pg.SCHEMA_LOCK_KEY})")
            conn.execute(self.ddl(sql))
            conn.execute("COMMIT")
        except BaseException:
            self.rollback_quietly(conn)
            raise

    @staticmethod
    def erase_and_delete(conn, table: str, column: str, size: int, where: str, params: tuple) -> None:
        """Overwrite, then delete. PostgreSQL keeps dead row versions until VACUUM reclaims them,
        so the overwrite narrows, but does not close, the window in which the old bytes are on
        disk; a VACUUM of the table afterwards (an operator's job) finishes it."""
        conn.execute(f"UPDATE {table} SET {column} = ? WHERE {where}", (bytes(size), *params))
        conn.execute(f"DELETE FROM {table} WHERE {where}", params)

    @staticmethod
    def delete_unerased(conn, sql: str, params: tuple) -> None:
        """A plain DELETE: PostgreSQL does not overwrite the rows it frees in any case."""
        conn.execute(sql, params)

    def unavailable(self, exc: BaseException, retry_after_s: int = 1) -> ProblemError:
        return self.pg.unavailable(exc, retry_after_s)

    def rollback_quietly(self, conn) -> None:
        self.pg.rollback_quietly(conn)

    def close(self, writer) -> None:
        if self._pool is not None:
            self._pool.close()
        try:
            writer.close()
        except self.pg.ERRORS:
            pass


def for_settings(settings) -> SqliteBackend | PostgresBackend:
    if settings.db_url is not None:
        return PostgresBackend(settings.db_url, settings.busy_timeout_s, settings.db_wait_s)
    return SqliteBackend(settings.db_path, settings.busy_timeout_s)
