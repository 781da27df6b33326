"""The SDK's errors, and what an incomplete upload hands back to resend.

A protocol refusal from a server is a ``ProblemError`` (dpsketch/protocol/problems.py); these are
what the client itself concludes: the servers disagree on the study, one stays unreachable, an
answer breaks the protocol, the study's floor is weaker than the owner allows, or a bulk upload
ended with some batches missing somewhere (:class:`IncompleteUpload`, with the exact bytes).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from dpsketch.plain_errors import unreachable_reason  # noqa: F401 (the SDK's name for it)
from dpsketch.protocol import messages
from dpsketch.protocol.problems import ProblemError


class SDKError(Exception):
    """Base class of the SDK's own errors (protocol errors are ``ProblemError``)."""


class StudyMismatch(SDKError):
    """The servers do not agree on the study, or the URL list does not match its servers.

    Raised before any share is sent: submitting would break the privacy promise.
    """


class ServerUnreachable(SDKError):
    """A server could not be reached (or kept failing) after all retries; the message names
    the URL tried."""

    def __init__(self, url: str, message: str):
        self.url = url
        super().__init__(f"{url}: {message}")


class InputChanged(SDKError):
    """The input differs from the one an unfinished submission to the same study started with
    (client_sdk/journal.py): resuming would mix two inputs, starting anew would count the rows
    already stored twice, so nothing is sent until the caller chooses."""


class ResumeMismatch(SDKError):
    """A rerun of a submission would build other reports than the run that started it (another
    SDK version, say): resuming would count rows twice, so nothing is sent
    (client_sdk/journal.py)."""


class UploadInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM in ``dpsketch submit``) stopped a bulk upload: how far it got.

    A ``KeyboardInterrupt``, so code that stops on Ctrl-C still does. ``rows_stored``: rows of
    the submission held by every server (this run's and earlier runs'); ``rows_partial``: rows
    some servers hold and others not (they count nowhere until completed); ``journal``: the
    submission's journal file (None without one). Rerunning the same submission completes it,
    storing each row once (client_sdk/journal.py)."""

    def __init__(self, rows_stored: int, rows_partial: int, journal: str | None):
        self.rows_stored, self.rows_partial, self.journal = rows_stored, rows_partial, journal
        rerun = ("rerun the same command to complete" if journal is not None else
                 "they were sent without a journal, so a rerun does not resume them")
        super().__init__(f"{rows_stored} rows stored at every server, {rows_partial} partly; {rerun}")


def cert_error(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure behind a transport error, if that is its cause."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class FloorTooWeak(SDKError):
    """The study's floor (its guarantee with no other honest report) is weaker than the data
    owner's own limit (``Client(max_floor_epsilon=...)``); nothing was sent."""


class ServerProtocolError(SDKError):
    """A server answered 2xx with a body that does not follow docs/protocol.md."""


class NotRelayable(SDKError):
    """A study whose reports cannot go through a relay (``client_sdk.relayed.enrol``, docs/relay.md):
    the servers would refuse every bundle, so nothing is enrolled and the rows are uploaded to
    the servers directly instead.

    ``reason`` says why: ``"parties"`` or ``"batch proofs"``, the study's own
    (:func:`dpsketch.protocol.relayed.unrelayable`: the servers answer 415), or
    ``"relayed uploads off"``: server ``server_id`` at ``url`` publishes ``relayed_uploads``
    false in its ``/v1/info`` policy (``dpsketch server --relayed-uploads off``: it answers 403).
    ``server_id`` and ``url`` are None for the study's own reasons."""

    def __init__(self, study_id: str, reason: str, server_id: str | None = None, url: str | None = None):
        self.study_id, self.reason, self.server_id, self.url = study_id, reason, server_id, url
        if server_id is not None:
            why = (f"server {server_id} ({url}) takes no relayed uploads (its /v1/info policy says "
                   f"relayed_uploads false: dpsketch server --relayed-uploads off, so it refuses every "
                   f"relayed bundle with 403): upload to the servers directly (Client.submit or "
                   f"Client.submit_many), or ask its operator to turn relayed uploads on")
        elif reason == "parties":
            why = (f"study {study_id[:12]}... has parties: a relay cannot carry them (each party uploads "
                   f"its blocks to the servers directly under its own token: Client.submit_blocks)")
        else:  # "batch proofs" (or a reason a later protocol adds)
            why = (f"study {study_id[:12]}... has {reason}: a relay cannot carry them (upload the rows to "
                   f"the servers directly with Client.submit_many)")
        super().__init__(f"{why}; nothing enrolled (docs/relay.md)")


@dataclass
class PendingUpload:
    """One batch that server ``server_index`` does not hold yet, with the exact bytes to resend."""

    server_index: int
    server_id: str
    batch_index: int
    first_row: int
    n_rows: int
    body: bytes = field(repr=False)
    #: ``application/x-dpsketch-shares`` or, for a seed-compressed batch, ``-seeds``; with
    #: ``Client(encrypt=True)`` ``-sealed`` (the bytes are then the sealed records)
    media_type: str = messages.SHARES_MEDIA_TYPE


@dataclass
class BatchFailure:
    """Why server ``server_index`` does not hold batch ``batch_index`` (rows first_row..)."""

    server_index: int
    server_id: str
    url: str
    batch_index: int
    first_row: int
    n_rows: int
    error: BaseException

    def __str__(self) -> str:
        return (f"batch {self.batch_index} (rows {self.first_row}..{self.first_row + self.n_rows - 1}) "
                f"at server {self.server_id} ({self.url}): {self.error}")


class IncompleteUpload(SDKError):
    """Some reports are held by some servers but not all: they will not count until resent.

    * ``failures``: what went wrong, per batch and server;
    * ``pending``: every (server, batch) not stored, with its bytes: pass to ``Client.resend``
      (resending is idempotent: already-held reports are acknowledged as duplicates), or simply
      run the same ``submit_many`` again: with its journal (the default) it regenerates the same
      reports, skips the batches every server holds and completes the others;
    * ``report_ids``: hex ids of every report this call created (if ids were kept);
    * ``rows_prepared``: input rows consumed; rows from this index on were sent nowhere;
    * ``journal``: the submission's journal file, if it has one (client_sdk/journal.py).
    """

    def __init__(self, failures: list[BatchFailure], pending: list[PendingUpload],
                 report_ids: list[str], rows_prepared: int, journal: str | None = None):
        self.failures = failures
        self.journal = journal
        self.pending = pending
        self.report_ids = report_ids
        self.rows_prepared = rows_prepared
        batches = {p.batch_index: p.n_rows for p in pending}
        servers = sorted({p.server_id for p in pending})
        first = failures[0] if failures else None
        super().__init__(
            f"upload incomplete: {sum(batches.values())} rows in {len(batches)} batch(es) are "
            f"missing at server(s) {', '.join(servers) or '-'} and will not count until resent; "
            f"input rows from index {rows_prepared} on were not sent"
            + (f"; first failure: {first}" if first else "")
            + (f"; run the same submission again to complete it (each row is stored once; "
               f"journal {journal})" if journal else "")
        )

    @property
    def problem(self) -> ProblemError | None:
        """The first protocol error a server returned, if any."""
        return next((f.error for f in self.failures if isinstance(f.error, ProblemError)), None)


class UploadCancelled(SDKError):
    """Another server failed (so this upload run stops retrying), or the client was closed."""

    def __init__(self) -> None:
        super().__init__("cancelled: the upload run was aborted or the client closed")
