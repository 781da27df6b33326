"""The share server's side of relayed uploads (docs/protocol.md section 7b): many devices' sealed
batches in one request, each with its own upload token's id and MAC.

Each entry is judged as the same sealed batch would be alone on ``POST .../batches`` with that
token as its bearer, in the same order (services/uploads.py: the layout, the key id and the quota
before any decryption, then the one KEM and AEAD, then every record's binding), and gets its own
outcome: one device's refused entry does not refuse its neighbours'. Two checks come first, both
before any decryption: the entry is addressed to this server, and its MAC is its token's, so a
sender without a token (the relay, or anyone) cannot make this server do a KEM for a study that
requires tokens. The bundle's checked entries then go to the writer together, which commits them
as one group (services/writer.py), so a relay's bundle of 64 devices costs one durable commit,
not 64.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from fastapi.concurrency import run_in_threadpool

from dpsketch.protocol import envelope, proved_shares, relayed
from dpsketch.protocol.messages import SEALED_MEDIA_TYPE, RelayedOutcome, RelayedResults, UploadResult
from dpsketch.protocol.problems import ProblemError

from .uploads import parse_batch, sealed_precheck
from .writer import Acknowledgement, Unbound

log = logging.getLogger("dpsketch.server")

if TYPE_CHECKING:
    from .metrics import ServerMetrics
    from .state import StudyRecord
    from .store import Store


def refusal(record: "StudyRecord") -> str | None:
    """Why a study takes no relayed uploads (None: it takes them), worded for a problem's detail
    (the rule is :func:`dpsketch.protocol.relayed.unrelayable`)."""
    study = record.study
    why = relayed.unrelayable(study)
    if why == "parties":
        return (f"study {study.study_id} has parties: each uploads its blocks to each server as "
                f"application/x-dpsketch-sealed; party=NAME batches, not through a relay")
    if why == "batch proofs":
        return (f"study {study.study_id} has batch proofs: each batch comes with its proof record "
                f"(docs/protocol.md section 4d), not through a relay")
    return None


def _token(store: "Store", record: "StudyRecord", entry: relayed.Entry) -> tuple[bytes | None, bytes | None]:
    """The digest of the entry's upload token, if the study requires one (401 otherwise: an
    unknown, revoked or missing token id, or a MAC that is not the token's), and the transcript
    its MAC was checked over (None without a token), which opens the batch too."""
    named = entry.token_id != relayed.NO_TOKEN_ID
    digest = record.digest_by_token_id(entry.token_id) if named else None
    if named and digest is None and store.shared:  # issued by another replica? (before judging
        store.refresh_tokens(record)               # upload_required, as the bearer path does)
        digest = record.digest_by_token_id(entry.token_id)
    if not record.upload_required:
        return None, None
    if not named:
        raise ProblemError("unauthorized", f"study {record.study_id} takes uploads only with one of its "
                           f"upload tokens: this entry names none (token id zero)")
    if digest is None:
        raise ProblemError("unauthorized", f"token id {entry.token_id.hex()} is not a valid upload token "
                           f"of this study (unknown, or revoked)")
    transcript = relayed.entry_transcript(record.study_id, entry.server_id, entry.batch)
    if not relayed.verify_mac(digest, record.study_id, entry.server_id, entry, transcript):
        raise ProblemError("unauthorized", f"the entry's MAC is not that of upload token "
                           f"{entry.token_id.hex()} over this batch (made without the token, or moved "
                           f"from another batch, server or study)")
    return digest, transcript


def _checked(store: "Store", record: "StudyRecord", server_id: str, entry: relayed.Entry):
    """One entry checked and opened (worker thread): (token digest, parse_batch's tuple), or the
    ProblemError it gets."""
    try:
        if entry.server_id != server_id:
            raise ProblemError("sealed-share-refused", f"this entry is addressed to server "
                               f"{entry.server_id!r}, and this is {server_id!r}: nothing of it was opened")
        try:
            digest, transcript = _token(store, record, entry)
        except envelope.SealError as exc:
            raise ProblemError("sealed-share-refused", str(exc)) from None
        except ValueError as exc:  # not a version 4 batch: its header cannot be read
            raise ProblemError("malformed-body", str(exc)) from None
        header = sealed_precheck(store, record, entry.batch, digest)
        study = record.study
        if _one_share(entry.batch) and not proved_shares.is_proved(study):
            # a one-row device's batch: opened here, then stored as a single report is, so the
            # writer checks the bindings of a group of them at once (services/uploads.py); its
            # header is not parsed again, nor its transcript hashed again after the MAC's
            try:
                upload = envelope.open_batch(entry.batch, study.width, study.n_servers, study.study_id,
                                             server_id, store.keys.private_key_for, header=header,
                                             transcript=transcript)
            except envelope.SealError as exc:
                raise ProblemError("sealed-share-refused", str(exc)) from None
            except ValueError as exc:
                raise ProblemError("malformed-body", str(exc)) from None
            return digest, (upload.joined, upload.proofs.tobytes(), upload.payloads.tobytes())
        return digest, parse_batch(entry.batch, study, SEALED_MEDIA_TYPE, server_id, store.keys,
                                   header=header, transcript=transcript)
    except ProblemError as exc:
        return exc


def _one_share(batch: bytes) -> bool:
    """Whether a sealed batch holds one record of a share (content 0x01, count 1): read from its
    clear header, which the checks before have parsed."""
    at = envelope.BATCH_ID_BYTES + envelope.KEY_ID_BYTES + 8
    return batch[at] == envelope.CONTENT_SHARE and batch[at + 1:at + 5] == b"\x00\x00\x00\x01"


def _unbound(value):
    """The writer's refusal of a single report whose share its id does not commit to, as the
    batch path words it (422 binding-refused; nothing of it was stored)."""
    if isinstance(value, Unbound):
        return ProblemError("binding-refused", "the sealed batch's share is not the one its report id "
                            "commits to at this server (docs/protocol.md section 4a)")
    if isinstance(value, Acknowledgement):  # a single report's answer: UploadResult's fields
        return UploadResult(accepted=value.accepted, duplicates=value.duplicates, report_count=value.report_count)
    return value


def _outcome(value) -> RelayedOutcome:
    if isinstance(value, UploadResult):
        return RelayedOutcome(status=200, result=value)
    if not isinstance(value, ProblemError):  # the writer's future failed otherwise: a server fault
        log.error("relayed entry: unexpected failure while storing it: %r", value)
        value = ProblemError.unavailable(f"the entry could not be stored ({type(value).__name__})")
    return RelayedOutcome(status=value.status, problem=value.body())


async def upload(store: "Store", metrics: "ServerMetrics", record: "StudyRecord", server_id: str,
                 body: bytes) -> tuple[RelayedResults, UploadResult]:
    """Every entry of a bundle judged, opened and stored (or refused) on its own: the outcomes
    in the bundle's order, and their sum (what the resend gate weighs: services/resend_gate.py).
    A bundle that does not parse is refused whole (400 malformed-body), as is a study that takes
    no relayed uploads (415)."""
    why = refusal(record)
    if why is not None:
        raise ProblemError("unsupported-media-type", why)
    try:
        entries = relayed.decode(body)
    except ValueError as exc:
        raise ProblemError("malformed-body", str(exc)) from None

    def check_all() -> list:
        return [_checked(store, record, server_id, e) for e in entries]

    checked = await run_in_threadpool(check_all)
    loop = asyncio.get_running_loop()
    pending: list = []
    for item in checked:
        if isinstance(item, ProblemError):
            pending.append(item)
            continue
        digest, parsed = item
        try:
            waiter = loop.create_future()  # the writer settles a group's waiters in one loop callback
            if len(parsed) == 3:  # one share: the writer's single reports (report id, proof, share)
                store.submit_single(record, *parsed, digest, waiter)
            else:
                ids, shares, rows, signs, sorted_ids, seeds, addends = parsed
                store.submit_upload(record, ids, shares, rows, signs, digest, waiter=waiter, sorted_ids=sorted_ids,
                                    seeds=seeds, addends=addends)
            pending.append(waiter)
        except ProblemError as exc:
            pending.append(exc)
    futures = [p for p in pending if not isinstance(p, ProblemError)]
    done = iter(await asyncio.gather(*futures, return_exceptions=True))
    outcomes = [p if isinstance(p, ProblemError) else _unbound(next(done)) for p in pending]
    total = UploadResult(accepted=0, duplicates=0)
    for value in outcomes:
        if isinstance(value, UploadResult):
            metrics.uploaded(record.study_id, value)
            total = UploadResult(accepted=total.accepted + value.accepted,
                                 duplicates=total.duplicates + value.duplicates,
                                 report_count=value.report_count)
    return RelayedResults(results=[_outcome(v) for v in outcomes]), total

