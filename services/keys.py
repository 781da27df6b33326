"""The share server's HPKE key pairs for sealed shares (docs/protocol.md section 7a,
docs/sealing.md), one ring per suite: classical X25519 and post-quantum MLKEM768-X25519.

* At first start (or the first start of a version that knows the suite) the server generates a
  key pair of each suite and stores it in its SQLite file (the raw private key, next to the
  shares it protects: the file is made mode 0600 when a key is created; protect it, and its
  backups, like the shares themselves). Classical keys live in ``hpke_keys``, post-quantum keys
  in ``hpke_pq_keys`` (created here, so a database made before the suite needs no migration).
* ``GET /v1/info`` publishes every key the server still holds, marking the current one of each
  suite (``hpke``: classical; ``hpke.post_quantum``), and the sealed layouts it opens
  (``hpke.versions``: 3, the one batch layout; versions 1 and 2 were dropped, issue 41); clients
  seal to a current key.
* Rotation (``POST /v1/keys``, operator): a new key of every suite becomes current; the previous
  ones still open shares, because clients that fetched them earlier may still be uploading. Both
  suites rotate together: what prompts a rotation (a schedule, a suspected leak of the database
  file) concerns every key the file holds.
* Retirement (``DELETE /v1/keys/{key_id}``, operator) erases a superseded key of either suite,
  and is refused (409 ``key-in-use``) while any study provisioned before the key was superseded
  is still open: such a study may still receive shares sealed to it. Once every such study is
  committed no upload can reach it anyway (409 ``study-closed``), so nothing is lost.

Key ids are SHA-256 of the public key, and the two suites' public keys differ in length, so one
id names one key across both rings; a batch whose suite is not its key's is refused by
``envelope.open_batch`` (never tried).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpsketch.protocol import envelope
from dpsketch.protocol.envelope import SealingSuite
from dpsketch.protocol.messages import HpkeKey, HpkeKeys
from dpsketch.protocol.problems import ProblemError

log = logging.getLogger("dpsketch.server")

#: Where each suite's keys are stored.
TABLES = {envelope.CLASSICAL.name: "hpke_keys", envelope.POST_QUANTUM.name: "hpke_pq_keys"}

#: The post-quantum ring's table (the classical one is in services/db.py's schema).
PQ_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS hpke_pq_keys (
    key_id        BLOB PRIMARY KEY CHECK (length(key_id) = 8),
    private_key   BLOB NOT NULL CHECK (length(private_key) = {envelope.POST_QUANTUM.private_key_bytes}),
    public_key    BLOB NOT NULL CHECK (length(public_key) = {envelope.POST_QUANTUM.public_key_bytes}),
    created_at    REAL NOT NULL,
    superseded_at REAL
)"""


@dataclass(frozen=True)
class _Key:
    key_id: bytes
    private: Any  # a loaded private key of ``suite``
    public: bytes
    created_at: float
    superseded_at: float | None
    suite: SealingSuite


def _restrict_permissions(db_path: Path) -> None:
    """Make the database (and its WAL/SHM files) readable by the owner only: it holds a
    private key. Best effort: a file we do not own, or a filesystem without modes, is logged."""
    for suffix in ("", "-wal", "-shm"):
        path = Path(str(db_path) + suffix)
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
            if mode & 0o077:
                os.chmod(path, mode & 0o700)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not make %s private (it holds the HPKE private key): %s", path, exc)


def _select(conn: Any, suite: SealingSuite):
    return conn.execute(f"SELECT key_id, private_key, public_key, created_at, superseded_at "
                        f"FROM {TABLES[suite.name]} ORDER BY created_at").fetchall()


class KeyRing:
    """The keys of both suites in memory (replaced as a whole on every change, so readers need
    no lock)."""

    def __init__(self, conn: Any, db_path: Path | None, backend: Any = None):
        """``conn``: the writer's connection; ``db_path``: the SQLite file whose mode is made
        private when a key is stored (None for PostgreSQL: its files are the server's own);
        ``backend``: services/backend.py's (None: SQLite)."""
        if backend is None:
            from .backend import SqliteBackend

            backend = SqliteBackend(db_path, 5.0)
        self.backend = backend
        self._keys: dict[bytes, _Key] = {}
        self._current: dict[str, bytes] = {}
        #: moves whenever the keys are set (read, rotated, retired): what describe() says changed
        self.generation = 0
        rows = {}
        created = []
        backend.begin(conn)
        try:  # one transaction, under the provisioning lock: replicas starting at once make one key
            backend.lock_provisioning(conn)
            conn.execute(backend.ddl(PQ_SCHEMA))
            for suite in envelope.SUITES.values():
                rows[suite.name] = _select(conn, suite)
                if rows[suite.name]:
                    continue
                row = self._new_row(suite, time.time())
                conn.execute(f"INSERT INTO {TABLES[suite.name]} (key_id, private_key, public_key, "
                             f"created_at, superseded_at) VALUES (?, ?, ?, ?, NULL)", row)
                rows[suite.name] = [(*row, None)]
                created.append((suite.name, row[0]))
            conn.execute("COMMIT")
        except backend.errors:
            backend.rollback_quietly(conn)
            raise
        for name, kid in created:
            if db_path is not None:
                _restrict_permissions(db_path)
            log.info("generated this server's first %s HPKE key %s", name, kid.hex())
        self._set(rows)

    @staticmethod
    def _new_row(suite: SealingSuite, now: float) -> tuple[bytes, bytes, bytes, float]:
        private = suite.generate_private_key()
        public = suite.public_key_of(private)
        return envelope.key_id(public), private, public, now

    def _set(self, rows_by_suite) -> None:
        keys: dict[bytes, _Key] = {}
        current: dict[str, bytes] = {}
        for name, rows in rows_by_suite.items():
            suite = envelope.SUITES[name]
            for kid, private, public, created, superseded in rows:
                kid = bytes(kid)
                keys[kid] = _Key(kid, suite.load_private_key(bytes(private)), bytes(public),
                                 float(created), superseded, suite)
                if superseded is None:
                    current[name] = kid
            if name not in current:  # cannot happen (one row always has NULL); never publish no key
                raise RuntimeError(f"{TABLES[name]} has no current key")
        self._keys, self._current = keys, current
        self.generation += 1

    # --- reads -------------------------------------------------------------------------------
    def private_key_for(self, key_id: bytes):
        """The loaded private key (of either suite) a record's key id names, or None."""
        key = self._keys.get(bytes(key_id))
        return key.private if key is not None else None

    @property
    def current_public_key(self) -> bytes:
        """The current classical public key."""
        return self._keys[self._current[envelope.CLASSICAL.name]].public

    def _describe(self, suite: SealingSuite) -> HpkeKeys:
        keys = sorted((k for k in self._keys.values() if k.suite is suite), key=lambda k: k.created_at)
        return HpkeKeys(
            kem_id=suite.kem_id, kdf_id=suite.kdf_id, aead_id=suite.aead_id, suite=suite.description,
            current=self._current[suite.name].hex(), name=suite.name,
            keys=[HpkeKey(key_id=k.key_id.hex(), public_key=k.public.hex(), created_at=k.created_at,
                          superseded_at=k.superseded_at) for k in keys])

    def describe(self) -> HpkeKeys:
        """The classical keys, with the post-quantum ones under ``post_quantum`` and the sealed
        layouts this server opens under ``versions``."""
        out = self._describe(envelope.CLASSICAL)
        out.versions = list(envelope.VERSIONS)
        if envelope.POST_QUANTUM.name in envelope.SUITES:  # else this backend has no ML-KEM
            out.post_quantum = self._describe(envelope.POST_QUANTUM)
        return out

    def refresh(self, conn: Any) -> None:
        """Re-read every key (replicas sharing a store: another one rotated or retired)."""
        self._set({suite.name: _select(conn, suite) for suite in envelope.SUITES.values()})

    # --- writes (run by the store's writer thread, inside its transaction) -------------------
    def _reload(self, conn: Any):
        rows = {suite.name: _select(conn, suite) for suite in envelope.SUITES.values()}
        return lambda: self._set(rows)

    def rotate(self, conn: Any):
        """A new current key of every suite; the previous current keys are marked superseded
        (they still open)."""
        now = time.time()
        for suite in envelope.SUITES.values():
            table = TABLES[suite.name]
            conn.execute(f"UPDATE {table} SET superseded_at = ? WHERE superseded_at IS NULL", (now,))
            row = self._new_row(suite, now)
            conn.execute(f"INSERT INTO {table} (key_id, private_key, public_key, created_at, superseded_at) "
                         f"VALUES (?, ?, ?, ?, NULL)", row)
            log.info("HPKE key rotated: %s %s is current", suite.name, row[0].hex())
        apply = self._reload(conn)
        return None, apply

    def retire(self, conn: Any, key_id_hex: str):
        """Erase a superseded key of either suite, unless an open study may still hold shares
        sealed to it."""
        try:
            kid = bytes.fromhex(key_id_hex)
        except ValueError:
            kid = b""
        row, table, suite = None, "", envelope.CLASSICAL
        if len(kid) == envelope.KEY_ID_BYTES:
            for suite in envelope.SUITES.values():
                table = TABLES[suite.name]
                row = conn.execute(f"SELECT superseded_at FROM {table} WHERE key_id = ?", (kid,)).fetchone()
                if row is not None:
                    break
        if row is None:
            raise ProblemError("not-found", f"this server holds no HPKE key {key_id_hex[:40]!r}")
        superseded_at = row[0]
        if superseded_at is None:
            raise ProblemError("key-in-use", f"this is the current {suite.name} key; rotate "
                                             f"(POST /v1/keys) first")
        still_open = conn.execute(
            "SELECT count(*), min(study_id) FROM studies s WHERE s.created_at < ? "
            "AND NOT EXISTS (SELECT 1 FROM commits c WHERE c.study = s.seq)", (superseded_at,)).fetchone()
        if still_open[0]:
            raise ProblemError(
                "key-in-use",
                f"{still_open[0]} open stud{'y' if still_open[0] == 1 else 'ies'} (e.g. {still_open[1]}) "
                f"existed while this key was current and may still receive shares sealed to it; "
                f"retire it once they are committed", extra={"open_studies": int(still_open[0])})
        self.backend.erase_and_delete(conn, table, "private_key", suite.private_key_bytes, "key_id = ?", (kid,))
        log.info("%s HPKE key %s retired", suite.name, kid.hex())
        apply = self._reload(conn)
        return None, apply
