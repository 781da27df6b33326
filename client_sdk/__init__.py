"""dpsketch client SDK: submit rows to a study's share servers, privately.

Each row is clipped to the study's norm bound, given exact discrete Gaussian noise from a ChaCha20
keystream keyed from os.urandom, encoded in Z_(2^64) and split into N additive shares, one per
server; no server (nor any N-1 of them) learns anything about the row. See docs/protocol.md.

    from dpsketch.client_sdk import Client
    with Client(["https://a.example", "https://b.example", "https://c.example"]) as c:
        c.study(study_id)                 # verified at every server
        c.submit(study_id, [0.3, 1.2, 5.0])
        c.submit_many(study_id, "rows.csv", progress=bar.update)
"""

from dpsketch.protocol.problems import ProblemError

from .client import Client, SubmitResult
from .errors import (
    BatchFailure,
    FloorTooWeak,
    IncompleteUpload,
    InputChanged,
    NotRelayable,
    PendingUpload,
    ResumeMismatch,
    SDKError,
    ServerProtocolError,
    ServerUnreachable,
    StudyMismatch,
    UploadInterrupted,
)
from .budget import PrivacyLimit, PrivacyLimitExceeded
from .prepare import PreparedBatch, ProofBatch, prepare_batch, prepare_proof_batch
from .data import InvalidDataError, read_csv

__all__ = [
    "PrivacyLimit",
    "PrivacyLimitExceeded",
    "BatchFailure",
    "Client",
    "FloorTooWeak",
    "IncompleteUpload",
    "InputChanged",
    "InvalidDataError",
    "NotRelayable",
    "PendingUpload",
    "PreparedBatch",
    "ProofBatch",
    "ResumeMismatch",
    "ProblemError",
    "SDKError",
    "ServerProtocolError",
    "ServerUnreachable",
    "StudyMismatch",
    "SubmitResult",
    "UploadInterrupted",
    "prepare_batch",
    "prepare_proof_batch",
    "read_csv",
]
