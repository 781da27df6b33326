"""The SQLite file of one share server: schema, connection setup and error mapping.

Why these choices:

* WAL mode with ``synchronous=FULL``: every COMMIT fsyncs the log, so an acknowledged report
  survives a crash or power loss; readers (listing, commit computation) never block the writer.
  The log is copied back into the file by a thread beside the writer, not inside its commits
  (services/wal.py).
* Reports are stored as they arrive, one row of ``batches`` per upload batch (a single upload's
  group of reports makes one too): the batch's ids, shares (and, for a study with parties, the
  pseudonyms) as one blob each, under the rowid of its first report; report ``first + i`` is the
  batch's i-th. A row per report cost a SQLite row and B-tree cell per report and measured 2.3x
  slower to write durably (0.70 vs 1.6 x 10^6 reports/s at d = 32 alone; the whole bulk upload
  gained 8-38 %, a rebuild 1.9x: docs/operations.md); the commit reads the few shares it needs by slice
  (``Connection.blobopen``), never a whole batch. Report-id uniqueness per study is enforced by
  the single writer (it holds every open study's ids in memory, see ``state.py``), not by an
  index: a unique B-tree on random 16-byte keys measured 4x slower than appends. A rebuild
  checks uniqueness again. Files written with a row per report (``reports``) are converted in
  place at start (:func:`_convert_reports`), each report a batch of one.
* 32 KiB pages: rows are mostly share blobs of 8d bytes; bigger pages measured faster.
* Errors: a busy/locked database or a full disk must become 503 ``unavailable`` with
  Retry-After, never a half-written store; SQLite's transactions give the atomicity and
  :func:`unavailable` gives the answer.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

from dpsketch.protocol.problems import ProblemError

log = logging.getLogger("dpsketch.server")

PAGE_SIZE = 32768
#: 2: protocol dpsketch/2 studies; upload tokens with quotas. 3: a batch of seeds may store the
#: seeds instead of the shares (services/batches.py). A version 2 file is marked 3 when opened
#: (nothing in it changes); a server that reads only 2 then refuses it rather than misreading seeds.
#: 4: a batch row may hold a batch proof's record (``proof_position``, services/batches.py); a
#: version 2 or 3 file is marked 4 when opened (the column is added, NULL in every row it had), so
#: an older server, which would read a proof record as shares, refuses it.
SCHEMA_VERSION = 4
#: the versions this server opens, and marks SCHEMA_VERSION
UPGRADES_FROM = (2, 3)

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS studies (
    seq          INTEGER PRIMARY KEY,
    study_id     TEXT NOT NULL UNIQUE,
    canonical    BLOB NOT NULL,             -- the study's canonical JSON (its id is its hash)
    report_count INTEGER NOT NULL DEFAULT 0,
    status       TEXT NOT NULL DEFAULT 'open' CHECK (status IN ('open', 'committed')),
    created_at   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    first      INTEGER PRIMARY KEY,         -- rowid of its first report (assigned by the writer)
    study      INTEGER NOT NULL REFERENCES studies(seq),
    m          INTEGER NOT NULL CHECK (m >= 1),
    ids        BLOB NOT NULL,               -- m report ids (or block ids), 16 bytes each
    shares     BLOB NOT NULL,               -- m shares of 8 x width bytes; empty once deleted
    pseudonyms BLOB,                        -- a study with parties: m pseudonyms, 16 bytes each
    party      INTEGER,                     -- ... and the index of the party whose blocks they are
    proof_position INTEGER                  -- a batch proof (docs/protocol.md section 4d): the position this
                                            -- server received it at; shares is then its record, ids its rows
);
CREATE INDEX IF NOT EXISTS batches_by_study ON batches(study);
CREATE TABLE IF NOT EXISTS commits (
    study          INTEGER PRIMARY KEY REFERENCES studies(seq),
    inclusion_hash TEXT NOT NULL,
    result         TEXT NOT NULL,           -- CommitResult JSON
    aggregate      BLOB NOT NULL,           -- the released k x d aggregate share, as served
    committed_at   REAL NOT NULL
);
-- Per-study client upload tokens (SHA-256 digests only). A study with any requires one. A token
-- adds at most quota new reports (NULL: no limit); used counts those it added.
CREATE TABLE IF NOT EXISTS upload_tokens (
    study      INTEGER NOT NULL REFERENCES studies(seq),
    digest     BLOB NOT NULL CHECK (length(digest) = 32),
    created_at REAL NOT NULL,
    quota      INTEGER CHECK (quota IS NULL OR quota >= 1),
    used       INTEGER NOT NULL DEFAULT 0,
    party      TEXT,                        -- a study with parties: whose blocks it uploads
    PRIMARY KEY (study, digest)
);
-- Revoked upload tokens (the digest stays in upload_tokens, so the study keeps requiring one).
CREATE TABLE IF NOT EXISTS upload_token_revocations (
    study      INTEGER NOT NULL REFERENCES studies(seq),
    digest     BLOB NOT NULL CHECK (length(digest) = 32),
    revoked_at REAL NOT NULL,
    PRIMARY KEY (study, digest)
);
-- The server's HPKE (X25519) key pairs for sealed shares (services/keys.py). The private key is
-- stored raw: whoever can read this file can open sealed shares (the file is made mode 0600).
-- superseded_at NULL marks the current key; a retired key's row is deleted (secure_delete).
CREATE TABLE IF NOT EXISTS hpke_keys (
    key_id        BLOB PRIMARY KEY CHECK (length(key_id) = 8),
    private_key   BLOB NOT NULL CHECK (length(private_key) = 32),
    public_key    BLOB NOT NULL CHECK (length(public_key) = 32),
    created_at    REAL NOT NULL,
    superseded_at REAL
);
-- The privacy ledger (docs/ledger.md): one row per study provisioned with a population, written
-- in the transaction that stores the study and never deleted (a study may have released).
CREATE TABLE IF NOT EXISTS ledger (
    population TEXT NOT NULL,
    study_id   TEXT NOT NULL REFERENCES studies(study_id),
    charge     TEXT NOT NULL,               -- dpsketch.protocol.ledger.Charge JSON
    charged_at REAL NOT NULL,
    PRIMARY KEY (population, study_id)
);
-- Retention: when a committed study's individual shares were deleted (the ids, the commit and
-- the released aggregate stay).
CREATE TABLE IF NOT EXISTS retention (
    study            INTEGER PRIMARY KEY REFERENCES studies(seq),
    shares_deleted_at REAL NOT NULL,
    deleted          INTEGER NOT NULL
);
"""

#: One upload batch (or a group of single uploads) of one study.
INSERT_BATCH = """
INSERT INTO batches (first, study, m, ids, shares, pseudonyms, party, proof_position)
VALUES (:first, :study, :m, :ids, :shares, :pseudonyms, :party, :proof_position)
"""

#: The same with the shares left as zeros, to be written in place by incremental blob I/O: a
#: bound blob is copied into a fresh buffer of its size first (Python binds with
#: SQLITE_TRANSIENT), and for a batch of megabytes that buffer is new memory every time, whose
#: page faults and zeroing cost the writer more than the copy (docs/operations.md).
INSERT_BATCH_IN_PLACE = INSERT_BATCH.replace(":shares", "zeroblob(:share_bytes)")

#: Shares at least this large are written in place (INSERT_BATCH_IN_PLACE); below, one bound copy.
IN_PLACE_BYTES = 1 << 18

#: Columns added after schema version 2 first shipped: added in place to older files.
_ADDED_COLUMNS = {"reports": {"pseudonym": "BLOB", "party": "INTEGER"}, "upload_tokens": {"party": "TEXT"},
                  "batches": {"proof_position": "INTEGER"}}


#: Page cache per connection, KiB. Readers stream (rebuild, listing) and need little.
WRITER_CACHE_KIB = 65536
READER_CACHE_KIB = 16384


def connect(path: Path, busy_timeout_s: float, *, readonly: bool = False) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit BEGIN/COMMIT)."""
    conn = sqlite3.connect(
        str(path), isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
    )
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    set_cache(conn, READER_CACHE_KIB if readonly else WRITER_CACHE_KIB)
    if readonly:
        conn.execute("PRAGMA query_only = ON")
    else:
        conn.execute("PRAGMA synchronous = FULL")
    return conn


def set_cache(conn: sqlite3.Connection, kib: int) -> None:
    conn.execute(f"PRAGMA cache_size = -{int(kib)}")


def initialise(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    """Open (creating if needed) the database and return the writer's connection."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # created owner-only before SQLite opens it (it gives the WAL and SHM files the database's
    # mode): the file holds shares and the HPKE private keys, and was 0644 until a key was made
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    conn = connect(path, busy_timeout_s)
    conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # effective only on a new file
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise RuntimeError(f"could not put {path} in WAL mode (got {mode})")
    conn.execute("PRAGMA synchronous = FULL")
    # Again, now that the page size is final: SQLite turns a KiB budget into a page count when
    # it is set, so a budget set at 4 KiB pages would allow 8x the memory at 32 KiB pages.
    set_cache(conn, WRITER_CACHE_KIB)
    conn.executescript(SCHEMA)
    for table, added in _ADDED_COLUMNS.items():
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        for column, sql_type in added.items():
            if have and column not in have:  # a file made before parties: nullable, nothing to fill in
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}")
    _convert_reports(conn, path)
    conn.execute(
        "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
    )
    version = int(conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
    if version in UPGRADES_FROM:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
    elif version != SCHEMA_VERSION:
        raise RuntimeError(f"{path} has schema version {version}; this server reads {SCHEMA_VERSION} "
                           f"(and {', '.join(map(str, UPGRADES_FROM))}): finish its studies with the server "
                           f"version that made it, then start this one on a new file")
    return conn


def _convert_reports(conn: sqlite3.Connection, path: Path) -> None:
    """A file written with a row per report (``reports``, before batches): every report becomes
    a batch of one under its rowid, in one transaction (a crash leaves the file as it was, and
    the next start converts it again). Rowids, and so checkpoints, stay valid."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'reports'").fetchone() is None:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        n = conn.execute(
            "INSERT INTO batches (first, study, m, ids, shares, pseudonyms, party) "
            "SELECT id, study, 1, report_id, share, pseudonym, party FROM reports ORDER BY id").rowcount
        conn.execute("DROP TABLE reports")
        conn.execute("COMMIT")
    except BaseException:
        rollback_quietly(conn)
        raise
    log.info("%s: converted %d stored reports to batches of one", path, n)


def unavailable(exc: BaseException, retry_after_s: int = 1) -> ProblemError:
    """The 503 answer for a store that cannot take a write now (locked, busy, disk full, I/O)."""
    text = str(exc).lower()
    if "locked" in text or "busy" in text:
        reason = "the database is locked by another process"
    elif "full" in text:
        reason = "the disk holding the database is full"
    else:
        reason = f"the database refused the write ({type(exc).__name__})"
    return ProblemError.unavailable(reason, retry_after_s)


def rollback_quietly(conn: sqlite3.Connection) -> None:
    """End any open transaction; after some errors SQLite has already rolled back."""
    try:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass
