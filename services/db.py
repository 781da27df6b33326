"""The SQLite file of one share server: schema, connection setup and error mapping.

Why these choices:

* WAL mode with ``synchronous=FULL``: every COMMIT fsyncs the log, so an acknowledged report
  survives a crash or power loss; readers (listing, commit computation) never block the writer.
* ``reports`` is a plain rowid table whose rowids the single writer assigns itself. Report-id
  uniqueness per study is enforced by that writer (it holds every open study's ids in memory,
  see ``state.py``) instead of a unique B-tree index: random 16-byte keys make every insert
  touch a random index page, which measured 4x slower than the appends (about 10^5 vs 4x10^5
  rows/s at 10^6 rows) and rewrote most of the index into the WAL on every commit. A rebuild
  checks uniqueness again. The index on ``study`` is append-only (rowids grow).
* 32 KiB pages: rows are mostly share blobs of 8d bytes; bigger pages measured faster.
* Errors: a busy/locked database or a full disk must become 503 ``unavailable`` with
  Retry-After, never a half-written store; SQLite's transactions give the atomicity and
  :func:`unavailable` gives the answer.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from dpsketch.protocol.problems import ProblemError

PAGE_SIZE = 32768
SCHEMA_VERSION = 2  # 2: protocol dpsketch/2 studies; upload tokens with quotas

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
CREATE TABLE IF NOT EXISTS reports (
    id        INTEGER PRIMARY KEY,          -- assigned by the writer, increasing
    study     INTEGER NOT NULL REFERENCES studies(seq),
    report_id BLOB NOT NULL CHECK (length(report_id) = 16),
    share     BLOB NOT NULL,                -- d little-endian uint64 (a block: the party's columns)
    pseudonym BLOB,                         -- a study with parties: the individual's pseudonym
    party     INTEGER                       -- ... and the index of the party whose block it is
);
CREATE INDEX IF NOT EXISTS reports_by_study ON reports(study);
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

#: One INSERT for many rows: the ids and shares travel as two blobs and SQLite cuts them up,
#: so the whole insert runs inside one sqlite3_step with the GIL released (executemany binds
#: every row from Python and measured 3x slower).
INSERT_REPORTS = """
WITH RECURSIVE i(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM i WHERE n + 1 < :m)
INSERT INTO reports (id, study, report_id, share)
SELECT :base + n, :study, substr(:ids, n * 16 + 1, 16), substr(:shares, n * :width + 1, :width)
FROM i
"""

#: One party's blocks (studies with parties): as INSERT_REPORTS, with the pseudonyms and the party.
INSERT_BLOCKS = """
WITH RECURSIVE i(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM i WHERE n + 1 < :m)
INSERT INTO reports (id, study, report_id, share, pseudonym, party)
SELECT :base + n, :study, substr(:ids, n * 16 + 1, 16), substr(:shares, n * :width + 1, :width),
       substr(:pseudonyms, n * 16 + 1, 16), :party
FROM i
"""

#: Blocks by rowid (studies with parties), as SELECT_SHARES_BY_ROWID with pseudonym and party.
SELECT_BLOCKS_BY_ROWID = (
    "SELECT id, report_id, share, pseudonym, party FROM reports "
    "WHERE id IN (SELECT value FROM json_each(?)) ORDER BY id"
)

#: Columns added after schema version 2 first shipped: added in place to older files.
_ADDED_COLUMNS = {"reports": {"pseudonym": "BLOB", "party": "INTEGER"}, "upload_tokens": {"party": "TEXT"}}

#: Rows by rowid, for a list of rowids passed as one JSON array.
SELECT_SHARES_BY_ROWID = (
    "SELECT id, report_id, share FROM reports WHERE id IN (SELECT value FROM json_each(?))"
)


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
            if column not in have:  # a file made before parties: nullable, so nothing to fill in
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}")
    conn.execute(
        "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
    )
    version = int(conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
    if version != SCHEMA_VERSION:
        raise RuntimeError(f"{path} has schema version {version} (protocol dpsketch/{version}); this "
                           f"server reads {SCHEMA_VERSION}: finish its studies with the server version "
                           f"that made it, then start this one on a new file")
    return conn


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
