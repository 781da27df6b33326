"""The share server's HPKE key pairs for sealed shares (docs/protocol.md section 7a).

* At first start the server generates an X25519 key pair and stores it in its SQLite file (the
  raw private key, next to the shares it protects: the file is made mode 0600 when the key is
  created; protect it, and its backups, like the shares themselves).
* ``GET /v1/info`` publishes every key the server still holds, marking the current one; clients
  seal to the current key.
* Rotation (``POST /v1/keys``, operator): a new key becomes current; the previous ones still open
  shares, because clients that fetched them earlier may still be uploading.
* Retirement (``DELETE /v1/keys/{key_id}``, operator) erases a superseded key, and is refused
  (409 ``key-in-use``) while any study provisioned before the key was superseded is still open:
  such a study may still receive shares sealed to it. Once every such study is committed no
  upload can reach it anyway (409 ``study-closed``), so nothing is lost.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import x25519

from dpsketch.protocol import envelope
from dpsketch.protocol.messages import HpkeKey, HpkeKeys
from dpsketch.protocol.problems import ProblemError

log = logging.getLogger("dpsketch.server")


@dataclass(frozen=True)
class _Key:
    key_id: bytes
    private: x25519.X25519PrivateKey
    public: bytes
    created_at: float
    superseded_at: float | None


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


class KeyRing:
    """The keys in memory (replaced as a whole on every change, so readers need no lock)."""

    def __init__(self, conn: sqlite3.Connection, db_path: Path):
        self._keys: dict[bytes, _Key] = {}
        self._current: bytes = b""
        rows = conn.execute("SELECT key_id, private_key, public_key, created_at, superseded_at "
                            "FROM hpke_keys ORDER BY created_at").fetchall()
        if not rows:
            row = self._new_row(time.time())
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("INSERT INTO hpke_keys (key_id, private_key, public_key, created_at, "
                             "superseded_at) VALUES (?, ?, ?, ?, NULL)", row)
                conn.execute("COMMIT")
            except sqlite3.Error:
                conn.execute("ROLLBACK")
                raise
            rows = [(*row, None)]
            _restrict_permissions(db_path)
            log.info("generated this server's first HPKE key %s", row[0].hex())
        self._set(rows)

    @staticmethod
    def _new_row(now: float) -> tuple[bytes, bytes, bytes, float]:
        private = envelope.generate_private_key()
        public = envelope.public_key_of(private)
        return envelope.key_id(public), private, public, now

    def _set(self, rows) -> None:
        keys = {}
        current = b""
        for kid, private, public, created, superseded in rows:
            kid = bytes(kid)
            keys[kid] = _Key(kid, x25519.X25519PrivateKey.from_private_bytes(bytes(private)),
                             bytes(public), float(created), superseded)
            if superseded is None:
                current = kid
        if not current:  # cannot happen (one row always has NULL); never publish no key
            raise RuntimeError("hpke_keys has no current key")
        self._keys, self._current = keys, current

    # --- reads -------------------------------------------------------------------------------
    def private_key_for(self, key_id: bytes) -> x25519.X25519PrivateKey | None:
        key = self._keys.get(bytes(key_id))
        return key.private if key is not None else None

    @property
    def current_public_key(self) -> bytes:
        return self._keys[self._current].public

    def describe(self) -> HpkeKeys:
        keys = sorted(self._keys.values(), key=lambda k: k.created_at)
        return HpkeKeys(
            kem_id=envelope.KEM_ID, kdf_id=envelope.KDF_ID, aead_id=envelope.AEAD_ID,
            suite=envelope.SUITE_NAME, current=self._current.hex(),
            keys=[HpkeKey(key_id=k.key_id.hex(), public_key=k.public.hex(), created_at=k.created_at,
                          superseded_at=k.superseded_at) for k in keys])

    # --- writes (run by the store's writer thread, inside its transaction) -------------------
    def _reload(self, conn: sqlite3.Connection):
        rows = conn.execute("SELECT key_id, private_key, public_key, created_at, superseded_at "
                            "FROM hpke_keys ORDER BY created_at").fetchall()
        return lambda: self._set(rows)

    def rotate(self, conn: sqlite3.Connection):
        """A new current key; the previous current key is marked superseded (still opens)."""
        now = time.time()
        conn.execute("UPDATE hpke_keys SET superseded_at = ? WHERE superseded_at IS NULL", (now,))
        row = self._new_row(now)
        conn.execute("INSERT INTO hpke_keys (key_id, private_key, public_key, created_at, superseded_at) "
                     "VALUES (?, ?, ?, ?, NULL)", row)
        log.info("HPKE key rotated: %s is current", row[0].hex())
        apply = self._reload(conn)
        return None, apply

    def retire(self, conn: sqlite3.Connection, key_id_hex: str):
        """Erase a superseded key, unless an open study may still hold shares sealed to it."""
        try:
            kid = bytes.fromhex(key_id_hex)
        except ValueError:
            kid = b""
        row = conn.execute("SELECT superseded_at FROM hpke_keys WHERE key_id = ?", (kid,)).fetchone() \
            if len(kid) == envelope.KEY_ID_BYTES else None
        if row is None:
            raise ProblemError("not-found", f"this server holds no HPKE key {key_id_hex[:40]!r}")
        superseded_at = row[0]
        if superseded_at is None:
            raise ProblemError("key-in-use", "this is the current key; rotate (POST /v1/keys) first")
        still_open = conn.execute(
            "SELECT count(*), min(study_id) FROM studies s WHERE s.created_at < ? "
            "AND NOT EXISTS (SELECT 1 FROM commits c WHERE c.study = s.seq)", (superseded_at,)).fetchone()
        if still_open[0]:
            raise ProblemError(
                "key-in-use",
                f"{still_open[0]} open stud{'y' if still_open[0] == 1 else 'ies'} (e.g. {still_open[1]}) "
                f"existed while this key was current and may still receive shares sealed to it; "
                f"retire it once they are committed", extra={"open_studies": int(still_open[0])})
        conn.execute("PRAGMA secure_delete = ON")
        try:
            conn.execute("UPDATE hpke_keys SET private_key = zeroblob(32) WHERE key_id = ?", (kid,))
            conn.execute("DELETE FROM hpke_keys WHERE key_id = ?", (kid,))
        finally:
            conn.execute("PRAGMA secure_delete = OFF")
        log.info("HPKE key %s retired", kid.hex())
        apply = self._reload(conn)
        return None, apply
