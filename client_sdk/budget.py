"""A data owner's own privacy limit, kept in a local file (docs/ledger.md, "The SDK's limit").

The share servers keep a ledger per population, but a data owner may contribute to studies of
several populations, or not trust the servers' budgets. :class:`PrivacyLimit` keeps the owner's
running total: every study it contributed to, as a :class:`~dpsketch.protocol.ledger.Charge`
in a JSON file, composed with dp-accounting exactly as the servers compose theirs. Given to
``Client(..., privacy_limit=...)``, it refuses (:class:`PrivacyLimitExceeded`, before any share
is sent) a study that would take the total past the limit, and records a study once the owner's
rows are held by every server (an upload that reached only some servers releases nothing: a
report counts only when every server holds its share).

The file is written atomically (a temporary file in the same directory, fsynced, renamed over
it) with mode 0600, under an exclusive lock (``fcntl``, where available) so two processes of the
same owner do not lose each other's entries. A file that cannot be parsed is refused, never
overwritten: losing the record of what was spent would reset the limit.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from dpsketch import pld_cache
from dpsketch.protocol import ledger
from dpsketch.protocol.study import Study

from .errors import SDKError

FORMAT = "dpsketch-privacy-ledger/1"


class PrivacyLimitExceeded(SDKError):
    """The study would take this data owner's running total past its own limit."""

    def __init__(self, message: str, verdict: ledger.Verdict):
        super().__init__(message)
        self.verdict = verdict


class LedgerFileError(SDKError):
    """The local ledger file cannot be read or written (it is left as it was)."""


class PrivacyLimit:
    """(epsilon, delta) over every study this owner contributes to, in ``neighbouring``."""

    def __init__(self, epsilon: float, delta: float, ledger_file: str | os.PathLike,
                 neighbouring: str = "replace-one"):
        try:
            self.budget = ledger.Budget(float(epsilon), float(delta), neighbouring)
        except ValueError as exc:
            raise ValueError(f"privacy limit: {exc}") from None
        self.path = Path(ledger_file)
        self._lock = threading.Lock()
        pld_cache.install()  # its checks' built PLDs on disk, shared with the owner's other processes

    # --- the file ------------------------------------------------------------------------------
    def entries(self) -> list[dict]:
        """The recorded studies: ``{"charge": {...}, "recorded_at": t}`` in recording order."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise LedgerFileError(f"cannot read the privacy ledger {self.path}: {exc}") from None
        try:
            body = json.loads(text)
            if body.get("format") != FORMAT or not isinstance(body.get("studies"), list):
                raise ValueError(f"not a {FORMAT} file")
            for e in body["studies"]:
                ledger.Charge.model_validate(e["charge"])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise LedgerFileError(f"the privacy ledger {self.path} is unreadable ({exc}); refusing to "
                                  f"go on without it (it records what this data owner has spent)") from None
        return body["studies"]

    def charges(self) -> list[ledger.Charge]:
        return [ledger.Charge.model_validate(e["charge"]) for e in self.entries()]

    def spent(self) -> ledger.Composition:
        """The running total, composed at the limit's delta."""
        return ledger.compose(self.charges(), self.budget.notion, self.budget.delta)

    # --- the hooks the Client calls ------------------------------------------------------------
    def check(self, study: Study) -> ledger.Verdict:
        """Raise :class:`PrivacyLimitExceeded` unless ``study`` fits (a recorded study always does)."""
        verdict = ledger.check(self.charges(), ledger.Charge.of(study), self.budget)
        if not verdict.fits:
            raise PrivacyLimitExceeded(
                f"study {study.study_id[:12]}... ({study.name!r}): refusing to submit: "
                + verdict.explain(self.budget, f"this data owner ({self.path})"), verdict)
        return verdict

    def record(self, study: Study) -> bool:
        """Add ``study`` to the file (idempotent per study id); True if it was new."""
        charge = ledger.Charge.of(study)
        with self._lock, self._file_lock():
            entries = self.entries()
            if any(e["charge"]["study_id"] == charge.study_id for e in entries):
                return False
            entries.append({"charge": charge.model_dump(mode="json"), "recorded_at": time.time()})
            self._write({"format": FORMAT, "studies": entries})
            return True

    @contextlib.contextmanager
    def _file_lock(self):
        """An exclusive lock on ``<file>.lock`` (POSIX), so concurrent owners' processes serialise."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: the thread lock only
            yield
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.path) + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, body: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise LedgerFileError(f"cannot write the privacy ledger {self.path}: {exc}") from None
            raise
        with contextlib.suppress(OSError):  # the rename itself durable too
            dirfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dirfd)
            finally:
                os.close(dirfd)
