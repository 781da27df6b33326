"""A validity study's query answer kept on disk at one share server, for its decision
(docs/operations.md, "A validity study's verification round").

Why: a decision needs this server's verifier share of every report it decides, and that is
exactly what the query answered (a function of the stored shares and the query seed alone). So
the query writes the same bytes to a file as it streams them, and the decision reads them back
instead of computing them again, which was half of the round's work at a server. Recomputing is
always correct; this file is only a shortcut, taken only when it provably holds this server's
answer for this study, this seed and this held set:

* it is written under a temporary name and renamed only once the whole answer was written, so
  a crash or a client that leaves mid-answer leaves no complete file (a leftover temporary file
  is never read, and is removed at the next start);
* its header binds it to the server and study (a hash of both), the query seed, the number of
  reports held and the SHA-256 of their ids in order, and carries the SHA-256 of everything
  after it: a file of another server, study, seed or held set, a truncated one (a crash after
  the rename but before the data reached the disk: no fsync is needed) or one with a flipped
  bit is not used (and is removed); the decision then recomputes.

File: a header (``HEADER``), then the shares (m x V elements of F_(p^2), each c0 then c1 as
little-endian uint64: the query answer's bytes after its ids), then one byte a report (its
plan's index: its party's in a study with parties, else 0). At most one file per study and
server: it is removed once the decision is stored, when the study is dropped or expires, and at
start for every study not waiting for its decision. A file is not written when the disk would
keep less free space than the file's size after it.

Not for a study with ``batch_proofs`` (docs/protocol.md section 4d): its query answers the
report section over its per-report records only, then the batch section, and neither is kept;
its decision recomputes its own shares, reports and batches alike (services/verification.py).
Why: simpler and always correct; a batch's share is one verifier of its circuit, cheap beside
its m rows' re-derivation, and keeping report sections over a held set that is not the report
index's would need a key of its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("dpsketch.server")

MAGIC = b"DPSVC\x00\x00\x01"
#: magic, m, V, plans, query seed, SHA-256 of the held ids, SHA-256 of (server, study), SHA-256
#: of the rest of the file
HEADER = struct.Struct("<8sQII32s32s32s32s")
SUFFIX = ".verifiers"
#: a temporary file untouched this long is a dead writer's (a live one writes every chunk)
STALE_TMP_S = 600.0
_READ_BLOCK = 8 << 20


def default_dir(db_path: Path | None, db_url: str | None = None) -> Path | None:
    """Where the cache goes unless the operator says: beside a SQLite file, in a directory of its
    own (``<file>.verify-cache``: two servers' files in one directory keep apart); a PostgreSQL
    store's in the system's temporary directory, one per database
    (``dpsketch-verify-cache-<16 hex digits of the URL's hash, without its password>``: each
    machine or container has its own; replicas of one server on one machine share it, which is
    correct, since a file binds to the server, not the process)."""
    if db_path is None:
        from .backend import redact

        tag = hashlib.sha256(redact(db_url or "").encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"dpsketch-verify-cache-{tag}"
    if str(db_path) == ":memory:":
        return None
    return db_path.with_name(db_path.name + ".verify-cache")


def resolve(setting: str | Path | None, db_path: Path | None, db_url: str | None = None) -> Path | None:
    """The setting (``$DPSKETCH_VERIFY_CACHE_DIR`` / ``--verify-cache-dir``): "auto" (or empty)
    the default above, "off" or "none" no cache, anything else that directory."""
    if setting is None:
        return None
    text = str(setting).strip()
    if text.lower() in ("off", "none"):
        return None
    if text.lower() in ("", "auto"):
        return default_dir(db_path, db_url)
    return Path(text)


def _binding(server_id: str, study_id: str) -> bytes:
    return hashlib.sha256(f"dpsketch/verify-cache/1\0{server_id}\0{study_id}".encode()).digest()


@dataclass(frozen=True)
class Key:
    """What a cached answer must have been computed for."""

    server_id: str
    study_id: str
    seed: bytes
    count: int
    held_digest: bytes  # SHA-256 of the held ids, in ascending order, concatenated
    verifier_len: int
    plans: int

    def name(self) -> str:
        return f"{self.study_id}-{self.seed.hex()[:32]}-{self.server_id}{SUFFIX}"

    @property
    def share_bytes(self) -> int:
        return self.count * self.verifier_len * 16

    @property
    def size(self) -> int:
        return HEADER.size + self.share_bytes + self.count


class Cached:
    """A valid cached answer, mapped: this server's shares of the reports at given positions."""

    def __init__(self, path: Path, key: Key):
        self.path = path
        self._shares = np.memmap(path, dtype="<u8", mode="r", offset=HEADER.size,
                                 shape=(key.count, key.verifier_len, 2)) if key.count else None
        self._plans = np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER.size + key.share_bytes,
                                shape=(key.count,)) if key.count else None

    def take(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(len, V, 2) uint64 shares and each report's plan index, for these held positions."""
        assert self._shares is not None and self._plans is not None
        return (np.asarray(self._shares[positions], dtype=np.uint64),
                self._plans[positions].astype(np.int64))


class Writer:
    """One query's answer on its way to the cache; any I/O error drops the file, never the answer."""

    def __init__(self, cache: "VerifierCache", key: Key):
        self.cache, self.key = cache, key
        self.ids = hashlib.sha256()
        self._shares, self._plans = hashlib.sha256(), hashlib.sha256()
        self._fd: int | None = None
        self._tmp: str | None = None
        try:
            fd, self._tmp = tempfile.mkstemp(dir=cache.directory, prefix=f".{key.name()}.", suffix=".tmp")
            self._fd = fd
            os.ftruncate(fd, key.size)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        log.warning("verify cache: not kept for study %s (%s); its decision recomputes",
                    self.key.study_id, exc)
        self.abort()

    def add_ids(self, ids: bytes) -> None:
        self.ids.update(ids)

    def add_shares(self, start: int, shares: bytes, plans: np.ndarray) -> None:
        """The wire bytes of the shares of held reports start.. and their plan indices."""
        if self._fd is None:
            return
        self._shares.update(shares)
        row = plans.astype(np.uint8).tobytes()
        self._plans.update(row)
        try:
            os.pwrite(self._fd, shares, HEADER.size + start * self.key.verifier_len * 16)
            os.pwrite(self._fd, row, HEADER.size + self.key.share_bytes + start)
        except OSError as exc:
            self._fail(exc)

    def finish(self) -> Path | None:
        """The whole answer was written: its header, then the rename (the file now counts)."""
        if self._fd is None or self._tmp is None:
            return None
        key = self.key
        if self.ids.digest() != key.held_digest:  # never: the ids streamed are the held run's
            self.abort()
            return None
        content = hashlib.sha256(self._shares.digest() + self._plans.digest()).digest()
        header = HEADER.pack(MAGIC, key.count, key.verifier_len, key.plans, key.seed, key.held_digest,
                             _binding(key.server_id, key.study_id), content)
        final = self.cache.directory / key.name()
        try:
            os.pwrite(self._fd, header, 0)
            os.close(self._fd)
            self._fd = None
            os.replace(self._tmp, final)
            self._tmp = None
        except OSError as exc:
            self._fail(exc)
            return None
        self.cache.discard(key.server_id, key.study_id, keep=final)
        return final

    def abort(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass
            self._tmp = None


def _content_digest(path: Path, key: Key) -> bytes:
    shares, plans = hashlib.sha256(), hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(HEADER.size)
        left = key.share_bytes
        while left:
            block = f.read(min(_READ_BLOCK, left))
            if not block:
                break
            shares.update(block)
            left -= len(block)
        plans.update(f.read(key.count))
    return hashlib.sha256(shares.digest() + plans.digest()).digest()


class VerifierCache:
    """The cache directory of one server (None-directory: off)."""

    def __init__(self, directory: Path | None):
        #: None: off. A directory that exists is checked now (``_usable``); one that does not is
        #: created and checked by the first query that keeps an answer (``_ready``), so a server
        #: that never runs a round leaves no empty directory behind.
        self.directory = directory
        self._checked = False
        #: this process made the directory: it removes it at a clean shutdown if it is empty then
        #: (each PostgreSQL database has its own under the temporary directory)
        self._created = False
        if directory is not None and directory.exists():
            self._ready()

    def _ready(self, create: bool = True) -> Path | None:
        """The directory once checked (None: off, or not there and ``create`` is false)."""
        if self.directory is not None and not self._checked:
            existed = self.directory.exists()
            if not create and not existed:
                return None
            self.directory = self._usable(self.directory)
            self._created = self.directory is not None and not existed
            self._checked = True
        return self.directory

    @staticmethod
    def _usable(directory: Path | None) -> Path | None:
        """The directory, created 0700 if missing; None (and a warning) unless it is this user's
        and no one else may write to it: another local user's file must never be taken for this
        server's shares."""
        if directory is None:
            return None
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = directory.stat()
        except OSError as exc:
            log.warning("verify cache off: cannot use %s (%s); decisions recompute", directory, exc)
            return None
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            log.warning("verify cache off: %s is not this user's alone (owner %d, mode %o); decisions "
                        "recompute", directory, st.st_uid, st.st_mode & 0o777)
            return None
        return directory

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def writer(self, key: Key) -> Writer | None:
        """A writer for a query's answer, or None (off, or too little disk: leave at least the
        file's size free after it)."""
        if self._ready() is None:
            return None
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return None
        if free < 2 * key.size:
            log.warning("verify cache: %d bytes free in %s, the answer of study %s takes %d; not kept, "
                        "its decision recomputes", free, self.directory, key.study_id, key.size)
            return None
        return Writer(self, key)

    def open(self, key: Key) -> Cached | None:
        """The cached answer for exactly this key, checked whole; None if there is none or it is
        not this key's (removed then: it will never be)."""
        if self._ready(create=False) is None:
            return None
        path = self.directory / key.name()
        try:
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("verify cache: cannot read %s (%s); recomputing", path, exc)
            return None
        why = None
        if len(head) < HEADER.size or size != key.size:
            why = f"{size} bytes, not {key.size}"
        else:
            magic, count, v_len, plans, seed, held, binding, content = HEADER.unpack(head)
            if magic != MAGIC:
                why = "not a cache file"
            elif binding != _binding(key.server_id, key.study_id):
                why = "another server's or study's"
            elif seed != key.seed:
                why = "another query seed's"
            elif (count, held) != (key.count, key.held_digest):
                why = f"over another held set ({count} reports)"
            elif (v_len, plans) != (key.verifier_len, key.plans):
                why = "another circuit's"
            elif _content_digest(path, key) != content:
                why = "its content does not match its digest"
        if why is not None:
            log.warning("verify cache: %s not used (%s); recomputing the decision's shares", path.name, why)
            self._remove(path)
            return None
        return Cached(path, key)

    def close(self) -> None:
        """At a clean shutdown: the directory goes if this process made it and it is empty (a
        decision still waiting keeps its file, hence the directory). A replica that shares it and
        writes after this finds it gone, keeps no answer and recomputes its decision: the same
        decision, slower."""
        if self._created and self.directory is not None:
            try:
                self.directory.rmdir()
            except OSError:
                pass  # not empty, or already gone

    def discard(self, server_id: str, study_id: str, keep: Path | None = None) -> None:
        """Remove this server's files of a study (but ``keep``)."""
        if self._ready(create=False) is None:
            return
        for path in self.directory.glob(f"{study_id}-*-{server_id}{SUFFIX}"):
            if path != keep and self._parse(path.name) == (study_id, server_id):
                self._remove(path)

    def sweep(self, server_id: str, waiting: set[str]) -> None:
        """At start: remove this server's files of every study not in ``waiting`` (queried, not
        yet decided, open), and temporary files no writer touched for STALE_TMP_S."""
        if self._ready(create=False) is None:
            return
        now = time.time()
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return
        for path in entries:
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                try:
                    stale = now - path.stat().st_mtime > STALE_TMP_S
                except OSError:
                    continue
                if stale:
                    self._remove(path)
                continue
            parsed = self._parse(path.name)
            if parsed is not None and parsed[1] == server_id and parsed[0] not in waiting:
                self._remove(path)

    @staticmethod
    def _parse(name: str) -> tuple[str, str] | None:
        """(study id, server id) of a cache file's name (study 64 hex, seed 32 hex, server)."""
        if not name.endswith(SUFFIX) or len(name) <= 98 + len(SUFFIX) or name[64] != "-" or name[97] != "-":
            return None
        return name[:64], name[98:-len(SUFFIX)]

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("verify cache: cannot remove %s (%s)", path, exc)
