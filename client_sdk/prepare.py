"""The SDK's side of a batch before it travels: the data owner's rows checked, then the
protocol's report path (:mod:`dpsketch.protocol.report`, which holds the one implementation of
map, clip, features, sign, noise, share, bind and prove, and of a batch proof's records), and
batch bodies measured and cut for retries. ``PreparedBatch``, ``ProofBatch`` and
``signed_vectors`` are re-exported from the report path.
"""

from __future__ import annotations

import numpy as np

from dpsketch.protocol import envelope, messages, proved_shares, report
from dpsketch.protocol.histogram import HistogramValueError
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.report import PreparedBatch, ProofBatch, signed_vectors
from dpsketch.protocol.study import Study

from . import data as _data

__all__ = ["PreparedBatch", "ProofBatch", "count_records", "is_batch_record", "prepare_batch", "prepare_blocks",
           "prepare_proof_batch", "record_bytes", "signed_vectors", "split_body"]


def prepare_batch(study: Study, rows: np.ndarray, compress: bool = False, full: int | None = None,
                  stream: Keystream | None = None) -> PreparedBatch:
    """Check a data owner's rows (``data.check_rows``; a histogram study's raw values,
    ``data.check_values``: InvalidDataError naming the first bad one), then run the protocol's
    path on them (:func:`dpsketch.protocol.report.prepare`: map, clip, features, sign, noise,
    share, bind or prove; its docstring says what ``compress``, ``full`` and ``stream`` do)."""
    if study.histogram is not None:  # raw values: the bins decide what they mean
        values = _data.check_values(rows, study.d)
        try:
            return report.prepare(study, values, compress, full, stream)
        except HistogramValueError as exc:
            raise _data.InvalidDataError(str(exc)) from None
    return report.prepare(study, _data.check_rows(rows, study.d), compress, full, stream)


def prepare_proof_batch(study: Study, rows: np.ndarray, leader: int | None = None,
                        stream: Keystream | None = None) -> ProofBatch:
    """Check a data owner's rows (``data.check_rows``), then the protocol's path for a batch of a
    study with batch proofs (:func:`dpsketch.protocol.report.prepare_proof_batch`: the same noisy
    rows as :func:`prepare_batch` makes, proved at once, one record a server)."""
    return report.prepare_proof_batch(study, _data.check_rows(rows, study.d), stream, leader)


def prepare_blocks(study: Study, party: str, pseudonyms: list[bytes], rows: np.ndarray,
                   signs: np.ndarray | None = None, full: int | None = None) -> PreparedBatch:
    """Check one party's rows of m individuals, then the protocol's path for blocks
    (:func:`dpsketch.protocol.report.prepare_blocks`; ``signs`` for a signed study)."""
    _, declared = study.party(party)
    return report.prepare_blocks(study, party, pseudonyms, _data.check_rows(rows, declared.width), signs=signs,
                                 full=full)


def record_bytes(media_type: str, study: Study) -> int:
    """Bytes of one record of a plaintext batch body for this study (a block batch: of the
    party its media type names)."""
    party = messages.party_of_media_type(media_type)
    width = proved_shares.upload_width(study, None if party is None else study.party(party)[0])
    return messages.record_bytes(media_type, width, study.n_servers)


def is_batch_record(media_type: str, study: Study) -> bool:
    """Whether a body of this media type is a batch proof's record (docs/protocol.md section 4d):
    one proved batch, which cannot be cut (its proof covers all its rows)."""
    if not study.batch_proofs:  # only a study with batch proofs takes them (and pays the import)
        return False
    from dpsketch.protocol import batch_records

    return media_type in batch_records.MEDIA_TYPES


def count_records(body: bytes, media_type: str, study: Study) -> int:
    """Reports in a batch body of any of the upload media types (a batch proof's record: the
    rows its header names, each of which a server counts as a report)."""
    if is_batch_record(media_type, study):
        from dpsketch.protocol import batch_records

        return batch_records.HEADER.unpack_from(body)[0] if len(body) >= batch_records.HEADER_BYTES else 0
    if media_type == messages.SEALED_MEDIA_TYPE:
        return envelope.count_records(body, proved_shares.upload_width(study), study.n_servers)
    return len(body) // record_bytes(media_type, study)


def split_body(body: bytes, media_type: str, study: Study) -> tuple[bytes, bytes]:
    """Cut a batch body in two at the record boundary nearest its middle (never a batch proof's
    record: ValueError)."""
    if is_batch_record(media_type, study):
        raise ValueError("a batch proof's record is one proved batch: it cannot be cut")
    if media_type == messages.SEALED_MEDIA_TYPE:
        return envelope.split_body(body, proved_shares.upload_width(study), study.n_servers)
    record = record_bytes(media_type, study)
    half = (len(body) // record // 2) * record
    return body[:half], body[half:]
