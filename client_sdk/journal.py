"""The submission journal: why re-running a bulk submission stores each row exactly once.

A report counts once per report id, and a server acknowledges a report it already holds (same id,
same bytes) as a duplicate without counting it again or charging the upload token. A second run
of a submission therefore stores nothing twice *if it produces the same reports*: the same noise,
shares, seeds and salts, hence the same ids. Without a journal every run draws fresh randomness,
so a run interrupted at 22 % and started again would store those 22 % a second time under new ids.

So each submission of an input to a study gets a secret 256-bit key from ``os.urandom``, written
to a local journal file (mode 0600) *before* any share leaves the machine. Batch b of the
submission draws every random bit it needs from the ChaCha20 keystream keyed with
HMAC-SHA256(key, ``"dpsketch/submission-batch/1"`` || b as 8 bytes big-endian), and the journal
records the batch size (and share layout, and whether its batches are proved batches of a study
with batch proofs) used, so a later run cuts the input into the same batches and regenerates
them byte for byte. Rows are identified by where they are in the input,
which is why the journal is keyed by the study id and a fingerprint of the input (SHA-256 of a
CSV file's bytes, or of an in-memory input's checked rows in study order): another input is
another submission, and a file changed under an unfinished submission is refused
(:class:`~client_sdk.errors.InputChanged`) rather than mixed with it.

Privacy: the noise stays CSPRNG output. ChaCha20 keyed from a secret drawn from ``os.urandom``
is a CSPRNG (docs/protocol.md section 5: "any CSPRNG is conformant"); each batch has its own key
(HMAC-SHA256 is a PRF), and a batch is only ever *re*-generated identically, never extended or
re-keyed, so no server sees two different draws from one stream. But the key determines every
report's noise and every share: whoever holds it and any one server's shares can compute the
submitted rows without noise. It is as sensitive as the data it sits next to, kept with the same
care (mode 0600 in a 0700 directory), and dropped from the journal as soon as every server holds
every row of the submission. What stays is a small record "input F was fully submitted to study S"
(no key, no data), so that running the same command again sends nothing instead of counting
every row twice; delete it (or pass ``new_submission``) to submit the same rows again as new
reports. An unfinished submission keeps its key until it completes, or until its journal file is
deleted (or superseded by ``new_submission``).

A rerun must build exactly the reports the first run built, or it would count rows twice under
new ids (an SDK upgraded in between whose sampler draws differently from the same keystream, for
instance). So the journal also records a digest of batch 0's report ids, and every later run
rebuilds batch 0 first and refuses (:class:`~client_sdk.errors.ResumeMismatch`, before sending
anything) if its ids differ.

Batches acknowledged by every server are appended to the journal as they complete and skipped
by a later run; a batch held by some servers only is sent again whole (the servers that hold it
answer "duplicate"). The appends are flushed, not fsynced: a record lost to a power cut only
makes the next run resend that batch as duplicates. The key itself is fsynced (file and
directory) before the first upload, because a key lost after an upload would make the next run
a new submission.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpsketch import __version__
from dpsketch.protocol.keystream import KEY_BYTES, Keystream

from .errors import InputChanged, ResumeMismatch, SDKError

#: where journals are kept unless ``Client(journal_dir=...)`` or ``dpsketch submit --journal-dir``
#: say otherwise
ENV_DIR = "DPSKETCH_SUBMISSIONS_DIR"
DEFAULT_DIR = "~/.dpsketch/submissions"
FORMAT = "dpsketch-submission/1"
BATCH_KEY_LABEL = b"dpsketch/submission-batch/1"


def default_dir() -> Path:
    """``$DPSKETCH_SUBMISSIONS_DIR``, else ``~/.dpsketch/submissions``."""
    return Path(os.environ.get(ENV_DIR) or os.path.expanduser(DEFAULT_DIR))


def batch_key(key: bytes, index: int) -> bytes:
    """The ChaCha20 key of batch ``index`` of the submission with secret ``key``."""
    return hmac.new(key, BATCH_KEY_LABEL + index.to_bytes(8, "big"), hashlib.sha256).digest()


def fingerprint_file(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return "file:" + h.hexdigest()


def fingerprint_rows(chunks: Iterable[np.ndarray]) -> str:
    """SHA-256 of checked rows in study order, independent of how they are cut into chunks:
    float rows by their float64 bytes, raw values (a histogram study) by their text."""
    h = hashlib.sha256()
    for chunk in chunks:
        if chunk.dtype == object:
            for row in chunk:
                h.update(json.dumps([str(v) for v in row]).encode() + b"\n")
        else:
            h.update(np.ascontiguousarray(chunk, dtype=np.float64).tobytes())
    return "rows:" + h.hexdigest()


@dataclass
class Submission:
    """One submission of one input to one study, as its journal file records it."""

    file: Path
    study_id: str
    fingerprint: str
    source: str | None
    batch_size: int
    compress: bool
    key: bytes | None
    #: batch index -> rows, for every batch every server acknowledged
    done: dict[int, int] = field(default_factory=dict)
    complete: bool = False
    n_rows: int | None = None
    #: an earlier run's journal was found (False: this run started the submission)
    resumed: bool = False
    #: SHA-256 (hex) of batch 0's report ids, once a run built it
    first_ids: str | None = None
    #: the dpsketch version that started the submission
    version: str = __version__
    #: its batches are proved batches (a study with batch proofs; docs/protocol.md section 4d)
    batch_proofs: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def stored_rows(self) -> int:
        """Rows an earlier run (or this one) recorded as held by every server."""
        return self.n_rows if self.complete and self.n_rows is not None else sum(self.done.values())

    def stream(self, index: int) -> Keystream:
        """Batch ``index``'s keystream: the same bytes in every run of this submission."""
        if self.key is None:
            raise RuntimeError("this submission is complete: its key was deleted")
        return Keystream.from_key(batch_key(self.key, index))

    def check_first_batch(self, report_ids: list[bytes]) -> None:
        """Batch 0 as this run built it: recorded by the first run, compared by every later one
        (:class:`ResumeMismatch` if the ids differ: this SDK would not rebuild the same reports)."""
        digest = hashlib.sha256(b"".join(report_ids)).hexdigest()
        with self._lock:
            if self.first_ids is None:
                self.first_ids = digest
                self._append({"first": digest})
            elif self.first_ids != digest:
                raise ResumeMismatch(
                    f"this client builds other reports from the journal {self.file} than the one "
                    f"that started the submission (dpsketch {self.version}; this is {__version__}): "
                    f"resuming would count rows twice. Finish it with that version, or submit anew "
                    f"(dpsketch submit --new-submission, submit_many(new_submission=True))")

    def _append(self, record: dict) -> None:
        try:
            with open(self.file, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        except OSError:
            pass  # a record not written only makes a later run resend a batch (duplicates)

    def record_done(self, index: int, rows: int) -> None:
        """Every server acknowledged batch ``index``: append it (thread-safe, flushed)."""
        with self._lock:
            self.done[index] = rows
            self._append({"done": index, "rows": rows})

    def finish(self, n_rows: int) -> None:
        """Every row is held by every server: drop the key, keep the record that it was sent."""
        with self._lock:
            self.complete, self.n_rows, self.key, self.done = True, n_rows, None, {}
            write_atomic(self.file, self._header(completed_at=time.time()))

    def _header(self, **extra: object) -> dict:
        return {"format": FORMAT, "study_id": self.study_id, "fingerprint": self.fingerprint,
                "source": self.source, "batch_size": self.batch_size, "compress": self.compress,
                "key": self.key.hex() if self.key is not None else None, "complete": self.complete,
                "n_rows": self.n_rows, "version": self.version,
                **({"batch_proofs": True} if self.batch_proofs else {}), **extra}


def write_atomic(path: Path, header: dict, *, exclusive: bool = False) -> bool:
    """Replace ``path`` by a file (mode 0600) holding ``header`` as one JSON line, durably (file
    and directory fsynced): a submission's key must survive anything that the uploads it keys
    survive (the relayed submission's journal, client_sdk/relay_cli.py, writes its header with
    it too). ``exclusive``:
    only if ``path`` does not exist (False if another process made it first: two runs of one
    submission must not each draw a key)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (json.dumps(header) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    if exclusive:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
    else:
        os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return True


def _read(path: Path) -> Submission | None:
    """A journal file, or None if it is not one (a torn last line is ignored)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        header = json.loads(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        return None
    done: dict[int, int] = {}
    first = None
    for line in lines[1:]:
        try:
            entry = json.loads(line)
            if "first" in entry:
                first = first or str(entry["first"])
            else:
                done[int(entry["done"])] = int(entry["rows"])
        except (ValueError, KeyError, TypeError):
            continue  # a record cut short by a crash: that batch is simply sent again
    key = header.get("key")
    return Submission(path, header["study_id"], header["fingerprint"], header.get("source"),
                      int(header["batch_size"]), bool(header["compress"]),
                      bytes.fromhex(key) if key else None, done, bool(header.get("complete")),
                      header.get("n_rows"), resumed=True, first_ids=first,
                      version=str(header.get("version", "?")), batch_proofs=bool(header.get("batch_proofs")))


class Journal:
    """The journal files of one directory (one file per study and input)."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else default_dir()

    def path(self, study_id: str, fingerprint: str) -> Path:
        digest = hashlib.sha256(f"{study_id}:{fingerprint}".encode()).hexdigest()[:32]
        return self.directory / f"{study_id[:12]}-{digest}.json"

    def entries(self) -> list[Submission]:
        if not self.directory.is_dir():
            return []
        found = (_read(p) for p in sorted(self.directory.glob("*.json")))
        return [s for s in found if s is not None]

    def open(self, study_id: str, fingerprint: str, *, source: str | None, batch_size: int,
             compress: bool, new: bool = False, batch_proofs: bool = False) -> Submission:
        """The submission of this input to this study: the earlier run's (to resume, or already
        complete), or a new one whose key is on disk when this returns.

        ``source`` (a CSV file's absolute path) lets a changed file be told from another input:
        if an unfinished submission of the same path to the same study has another fingerprint,
        :class:`InputChanged` is raised unless ``new`` (then that unfinished submission is
        forgotten, its key with it). ``new`` also starts over a submission of this very input.
        """
        path = self.path(study_id, fingerprint)
        existing = _read(path) if path.exists() else None
        if path.exists() and existing is None and not new:
            raise SDKError(f"the submission journal {path} is unreadable: it may hold the key of an "
                           f"unfinished submission of this input, so nothing is sent (delete it, or "
                           f"pass new_submission / --new-submission, to submit anew)")
        if existing is not None and not new:
            return existing
        if source is not None:
            stale = [s for s in self.entries() if s.study_id == study_id and s.source == source
                     and s.fingerprint != fingerprint and not s.complete]
            if stale and not new:
                old = stale[0]
                raise InputChanged(
                    f"{source} changed since an unfinished submission of it to study "
                    f"{study_id[:12]}... started ({old.stored_rows} of its rows are stored at every "
                    f"server; journal {old.file}): rerun with the file as it was to complete that "
                    f"submission, or submit this file as a new submission (dpsketch submit "
                    f"--new-submission, submit_many(new_submission=True)); the rows already "
                    f"stored then stay counted and the partly stored ones stay excluded")
            for old in stale:
                old.file.unlink(missing_ok=True)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        submission = Submission(path, study_id, fingerprint, source, batch_size, compress,
                                os.urandom(KEY_BYTES), batch_proofs=batch_proofs)
        if not write_atomic(path, submission._header(created_at=time.time()), exclusive=not new):
            return self.open(study_id, fingerprint, source=source, batch_size=batch_size,
                             compress=compress, batch_proofs=batch_proofs)  # another run made it just now
        return submission
