"""Batch proof uploads (docs/protocol.md section 4d): ``POST /v1/studies/{id}/batches`` with
``application/x-dpsketch-proof-batch`` (the leader's record) or
``application/x-dpsketch-proof-batch-seed`` (a helper's), for a study with ``batch_proofs``.

Why a module of its own: the other batch uploads carry one record per report, judged record by
record; a batch proof is one record for m rows, judged whole, in the order section 4d gives
("What a server does with a record, in order"), each check before anything that costs more:

1. the header (``batch_records.read_header``: 415 for a study without batch_proofs, 400 for a
   malformed one), then the upload token's quota (403) and ``max_reports`` (409) judged on the
   m rows *before* the batch's circuit is built or a helper's seed expanded. The rows a request
   would add are counted from the batch id, which the header and the parts give by two hashes
   (no circuit: the wrap seed hashes the header's first 36 bytes), so a batch sent again costs
   its token nothing, as a re-sent report does;
2. ``batch_records.receive`` (400 / 422 as ``BatchRecordError.problem`` says), the row ids, the
   rows' coordinate shares halved as a validity report's (``validity.split_words``) and hashed
   by their row ids: all of it in a worker thread, never on the event loop;
3. the writer stores the record and its rows as one batch row (services/batches.py) in the group
   transaction of every upload, after judging duplicates and conflicts on the record's bytes
   (services/writer.py, ``Writer._classify_proof``), and the quota and ``max_reports`` again,
   race-free. Nothing is stored on any refusal.

A sealed record (``application/x-dpsketch-sealed``, content 0x05 or 0x06; docs/sealing.md
section 3b) is judged first on what needs no key (:func:`sealed_precheck`: its layout, key id and
some quota left), opened, and then goes through steps 1 to 3 as the plaintext record of the media
type its content names, its clear id checked against the batch id in step 2.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi.concurrency import run_in_threadpool

from dpsketch.protocol import batch_records, batch_validity, envelope, validity
from dpsketch.protocol.messages import IdList, UploadResult
from dpsketch.protocol.problems import ProblemError

from . import idsets
from .uploads import sealed_header
from .writer import quota_problem

if TYPE_CHECKING:  # pragma: no cover
    from .state import StudyRecord
    from .store import Store

MEDIA_TYPES = batch_records.MEDIA_TYPES


def _problem(exc: batch_records.BatchRecordError) -> ProblemError:
    return exc.problem()


def header_row_ids(header: batch_records.Header, body: bytes) -> bytes:
    """The row ids (concatenated) a record whose header passed ``read_header`` names, from its
    batch id (``batch_records.batch_id_of``: two hashes, no circuit). A header whose T is not the
    plan's gives ids no stored batch has; the record is refused at ``decode`` right after."""
    bid = batch_records.batch_id_of(body, header.n_servers)
    return batch_validity.row_ids(bid, header.m).tobytes()


def precheck(store: "Store", record: "StudyRecord", position: int, media_type: str, body: bytes,
             token: bytes | None) -> batch_records.Header:
    """Step 1 of the module docstring: the header, then the quota and max_reports on m."""
    try:
        header = batch_records.read_header(record.study, position, media_type, body)
    except batch_records.BatchRecordError as exc:
        raise _problem(exc) from None
    granted = record.upload_tokens.get(token) if token is not None else None
    room = granted.room() if granted is not None else None
    held = store.held(record)
    over_quota = token is not None and (granted is None or (room is not None and header.m > room))
    if over_quota or held + header.m > record.study.max_reports:
        new = store.count_new(record, header_row_ids(header, body))  # a batch sent again adds none
        if token is not None and (granted is None or (room is not None and new > room)):
            raise quota_problem(room, record.study_id, new)
        if held + new > record.study.max_reports:
            raise ProblemError("capacity-exceeded", f"study {record.study_id} cannot take {new} more reports: "
                               f"it would exceed max_reports = {record.study.max_reports}; nothing of this "
                               f"request was stored")
    return header


def parse(record: "StudyRecord", position: int, media_type: str, body: bytes,
          clear_id: bytes | None = None) -> dict[str, Any]:
    """Step 2 of the module docstring (worker thread): what the writer's job carries. ``clear_id``:
    a sealed record's id in the clear, which must be the batch id (422 binding-refused)."""
    study = record.study
    try:
        _rec, plan, batch = batch_records.receive(study, position, media_type, body)
        if clear_id is not None:
            batch_records.check_sealed_id(clear_id, batch)
    except batch_records.BatchRecordError as exc:
        raise _problem(exc) from None
    joined = batch_validity.row_ids(batch.batch_id, plan.m).tobytes()
    ids = IdList(joined)
    rows, signs = study.hash_report_ids(ids, joined)
    addends = validity.split_words(batch_validity.coordinate_shares(plan, batch))
    return {"ids": ids, "rows": rows, "signs": signs, "addends": np.ascontiguousarray(addends),
            "sorted_ids": idsets.SortedIds(joined), "proof_record": bytes(body), "proof_position": position,
            "shares": np.frombuffer(body, dtype=np.uint8).reshape(1, -1)}


def sealed_precheck(store: "Store", record: "StudyRecord", body: bytes, token: bytes | None) -> envelope.BatchHeader:
    """What a sealed record (docs/sealing.md section 3b) is judged on before any decryption: its
    layout and length (``envelope.parse_record``: 400), a key id of this server (422
    sealed-share-refused), and some quota left for the upload token (its m is sealed): a token
    with no room left is refused (403) unless this server holds row 0 of the batch its clear id
    names (a batch sent again, which costs the token nothing; its rows are judged exactly after
    opening, and the clear id checked against the opened record). Returns the parsed header,
    which :func:`open_sealed` then need not parse again."""
    study = record.study
    header = sealed_header(store, lambda: envelope.parse_record(body, batch_records.helper_length(study.n_servers)))
    if token is not None:
        granted = record.upload_tokens.get(token)
        room = granted.room() if granted is not None else 0
        if room is not None and room < 1:
            first_row = batch_validity.row_ids(envelope.record_clear_id(body, header), 1).tobytes()
            if granted is None or store.count_new(record, first_row):
                raise quota_problem(room, record.study_id, 1)
    return header


def open_sealed(record: "StudyRecord", server_id: str, body: bytes, keys,
                header: envelope.BatchHeader | None = None) -> tuple[str, bytes, bytes]:
    """A sealed record opened (worker thread): its media type, clear id and record (``header``:
    :func:`sealed_precheck`'s, not parsed again)."""
    try:
        return batch_records.open_sealed(record.study, server_id, body, keys.private_key_for, header)
    except batch_records.BatchRecordError as exc:
        raise _problem(exc) from None


def is_sealed_record(record: "StudyRecord", body: bytes) -> bool:
    """Whether a sealed body is a batch proof's record for this study (content 0x05 or 0x06 to a
    study with batch_proofs); such content to another study is refused as malformed by the
    share path (``envelope.parse_batch``)."""
    return record.study.batch_proofs and envelope.content_of(body) in envelope.RECORD_CONTENTS


async def upload(store: "Store", record: "StudyRecord", server_id: str, media_type: str, body: bytes,
                 token: bytes | None, keys=None) -> UploadResult:
    """A batch proof stored, or the refusal raised (nothing stored): the module docstring. With
    ``keys`` (this server's key ring) ``body`` is a sealed record (docs/sealing.md section 3b,
    ``media_type`` the sealed one): judged by :func:`sealed_precheck`, opened, then handled as the
    plaintext record of the media type its content names (0x05 a leader's, 0x06 a helper's: a
    server of the other role refuses it as that record, 400), its clear id checked against the
    batch id (422 binding-refused). What is stored is the opened record, as for a plaintext upload."""
    position = record.study.servers.index(server_id)
    clear_id = None
    if keys is not None:
        header = await run_in_threadpool(sealed_precheck, store, record, body, token)
        media_type, clear_id, body = await run_in_threadpool(open_sealed, record, server_id, body, keys, header)
    await run_in_threadpool(precheck, store, record, position, media_type, body, token)
    job = await run_in_threadpool(parse, record, position, media_type, body, clear_id)
    return await asyncio.wrap_future(store.submit_upload(
        record, job["ids"], job["shares"], job["rows"], job["signs"], token, sorted_ids=job["sorted_ids"],
        addends=job["addends"], proof_record=job["proof_record"], proof_position=job["proof_position"]))
