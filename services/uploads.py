"""What the upload routes share, and the fast path of the hot one (POST /v1/studies/{study_id}/reports).

Both upload routes (services/app.py) check the study's upload token with :func:`upload_token`
and every record's binding with :func:`verified_shares`; a single report is then stored by
:func:`stored_report` and answered as JSON, whichever way the request came (the answer held
while fresh uploads arrive if it was a re-send: services/resend_gate.py).

Why a fast path: a single report is a few hundred bytes, so per request the framework costs more
than the work. Under 64 concurrent clients FastAPI's routing, dependency solving and request
validation took about half of the server's CPU per upload, and the event loop's thread was the
limit (docs/operations.md, "Single uploads"). :class:`FastReports`, a pure ASGI middleware
outside every other one, answers a *well-formed* single upload itself: it parses the body (the
SDK's plain JSON directly, messages.report_fields, anything else with the same pydantic model,
:class:`Report`), checks the token with the same function and the lengths, and hands the
report's bytes to the same writer, which checks the bindings of a whole group of single reports
at once (services/writer.py, ``Writer._bind_singles``: one vectorised check instead of two
hashlib calls and two numpy arrays per request on the event loop, the server's busiest
thread); then it answers the same bytes. Being outermost, it also does for such an upload
what the layers it skips do, with their objects: the body limit (a Content-Length or body over
it), upload admission (the same :class:`~services.admission.Admission` counts, held until the
answer) and the HTTP and upload metrics (observability.count_answer, as the metrics middleware
counts); a layer per request, each with its own wrappers of receive and send, cost the event
loop more than the work.

Anything it does not accept as it stands goes, untouched, to those layers and the FastAPI route:
a body past the limit or one the admission refuses (they answer 413 or 503, as always), a
refusal before the writer (bad JSON, a body the model refuses, an unknown study, a missing or
wrong token, a study with parties or one already committed, a wrong length), another
Content-Type, a body cut short, and a report whose binding the writer found not to hold (it
stored nothing of it: writer.Unbound). The route then answers it exactly as it always did: the same
checks in the same order, the same problem JSON, so nothing about a refusal depends on which
path saw the request first (nothing is stored before the writer, so checking twice changes
nothing). A request handed on after this layer admitted it keeps that admission (the admission
layer lets it pass: ADMITTED_KEY), and its latency is measured from its head (START_KEY).
Refusals by the writer (study-closed, quota-exceeded, report-conflict, unavailable) and its
acknowledgement are answered here, rendered by the same functions the route uses; a writer too
busy to queue the report (503 unavailable) answers before its binding is checked, as upload
admission does. The route
stays in the OpenAPI document, which describes the endpoint either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from time import perf_counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi.concurrency import run_in_threadpool
from fastapi.security.utils import get_authorization_scheme_param
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from dpsketch.observability import START_KEY, count_answer, problem_slug
from dpsketch.problem_http import problem_response
from dpsketch.protocol import binding, envelope, proved_shares
from dpsketch.protocol.messages import (SEALED_MEDIA_TYPE, SEEDS_MEDIA_TYPE, SHARES_MEDIA_TYPE, Report, Upload, UploadResult,
                                        decode_upload, report_fields, report_upload)
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.study import Study

from . import idsets
from .admission import ADMITTED_BYTES_KEY, ADMITTED_KEY, ROUTE_KEY, Admission, read_body, replaying
from .auth import digest_of
from .resend_gate import ResendGate
from .writer import Unbound, quota_problem

if TYPE_CHECKING:
    from .metrics import ServerMetrics
    from .store import Store

log = logging.getLogger("dpsketch")

#: The single-upload route, as FastAPI declares it (services/app.py) and labels its metrics.
REPORTS_ROUTE = "/v1/studies/{study_id}/reports"
#: Starlette's match for that template: a ``str`` path parameter is ``[^/]+``.
_REPORTS_PATH = re.compile(r"^/v1/studies/(?P<study_id>[^/]+)/reports$")
_JSON = b"application/json"
#: Authorization headers whose token digest FastReports keeps (a few hundred bytes each)
_DIGESTS_KEPT = 4096


def json_response(model) -> Response:
    """Serialize a response model directly (the upload paths skip FastAPI's re-validation)."""
    return Response(model.model_dump_json(), media_type="application/json")


def result_json(result: UploadResult) -> bytes:
    """``result.model_dump_json()``'s bytes, written directly (three integers, the last one
    maybe null: pydantic's compact JSON of them, in field order); ``result`` may be the
    writer's Acknowledgement, which has the same fields."""
    count = result.report_count
    return b'{"accepted":%d,"duplicates":%d,"report_count":%s}' % (
        result.accepted, result.duplicates, b"null" if count is None else b"%d" % count)


def verified_shares(upload: Upload, study: Study, server_id: str, study_id: str | None = None,
                    party: int | None = None) -> np.ndarray:
    """The shares of an upload whose every record is bound to its report id at this server
    (422 binding-refused otherwise: a substituted, corrupted or misdirected share is never stored).
    ``study_id``: the study's id if the caller has it (the store's key of the study), which
    spares hashing the study's canonical form again. A study with validity proofs: the records
    as it keeps them (proved_shares.payload_rows; a leader's value >= p: 400 malformed-body);
    ``party``: one party's blocks (its index), proved with that party's plan."""
    seeded = upload.content == binding.CONTENT_SEED
    proved = proved_shares.is_proved(study)
    bound = upload if not proved else dataclasses.replace(
        upload, payloads=proved_shares.bound_part(study, upload.payloads, seeded, party))
    try:
        bound.verify(study_id or study.study_id, study.n_servers, study.servers.index(server_id))
    except binding.BindingError as exc:
        raise ProblemError("binding-refused", str(exc)) from None
    if not proved:
        return upload.shares(study.width)
    try:
        return proved_shares.payload_rows(study, upload.payloads, seeded)
    except ValueError as exc:  # field.FieldError: a value that is no F_p element
        raise ProblemError("malformed-body", str(exc)) from None


async def upload_token(store: "Store", study_id: str, credentials: str | None) -> bytes | None:
    """A study that requires upload tokens (the server's policy, or one was issued) takes
    uploads only with one of them (401 otherwise); returns the token's digest, whose quota
    the upload is charged to. ``credentials``: the bearer token presented, if any."""
    record = store.record(study_id)
    if store.shared and credentials and digest_of(credentials) not in record.upload_tokens:
        await run_in_threadpool(store.refresh_tokens, record)  # issued by another replica?
    if not record.upload_required:
        return None
    if not credentials:
        raise ProblemError("unauthorized", f"study {study_id} takes uploads only with one of its upload "
                           f"tokens, issued by this server's operator",
                           headers={"WWW-Authenticate": "Bearer"})
    given = digest_of(credentials)
    # a dict lookup, not a constant-time scan: the keys are SHA-256 digests of 256-bit random
    # tokens, so lookup timing says nothing usable about a token, and a study may hold 10^6
    if given not in record.upload_tokens:
        raise ProblemError("unauthorized", "the bearer token is not a valid upload token of this "
                           "study (unknown, or revoked)",
                           headers={"WWW-Authenticate": "Bearer"})
    return given


def checked_report(store: "Store", server_id: str, study_id: str, report: Report | tuple[bytes, bytes, bytes]):
    """The record and the verified one-record upload of a single report (the route's checks
    after the token, in its order); raises the route's ProblemError otherwise. ``report``: the
    model, or its decoded fields (messages.report_fields)."""
    from dpsketch.protocol.messages import BLOCKS_MEDIA_TYPE

    record = store.record(study_id)
    study = record.study
    if study.parties is not None:
        raise ProblemError("invalid-request", f"study {study_id} has parties: each uploads its "
                           f"blocks as {BLOCKS_MEDIA_TYPE} batches")
    if proved_shares.is_proved(study):
        raise ProblemError("unsupported-media-type", single_report_refusal(study_id, study))
    try:
        upload = (report.upload(study.width, study.n_servers) if isinstance(report, Report)
                  else report_upload(*report, study.width, study.n_servers))
    except ValueError as exc:
        raise ProblemError("invalid-request", str(exc)) from None
    shares = verified_shares(upload, study, server_id, study_id)
    return record, upload.ids, shares


def sealed_header(store: "Store", parse: Callable[[], Any]) -> Any:
    """A sealed body's clear header, judged before any decryption (docs/sealing.md section 3):
    ``parse()`` (envelope.parse_batch or parse_record) with its refusals as problems (a suite
    this server does not know: 422 sealed-share-refused; a malformed layout or length: 400), then
    its key id one of this server's (422 sealed-share-refused)."""
    try:
        header = parse()
    except envelope.SealError as exc:
        raise ProblemError("sealed-share-refused", str(exc)) from None
    except ValueError as exc:
        raise ProblemError("malformed-body", str(exc)) from None
    if store.keys.private_key_for(header.key_id) is None:
        raise ProblemError("sealed-share-refused", f"sealed batch {header.batch_id.hex()}: unknown key id "
                           f"{header.key_id.hex()} (not a key of this server, or retired); fetch /v1/info "
                           f"and seal again")
    return header


def single_report_refusal(study_id: str, study: Study) -> str:
    """Why a study with validity proofs takes no single-report JSON upload (415)."""
    return (f"study {study_id} proves every report valid ({study.validity}): its reports travel only "
            f"in binary batches, the leader's F_p input and proof shares as {SHARES_MEDIA_TYPE} and "
            f"each helper's seed as {SEEDS_MEDIA_TYPE} (or sealed), never as single-report JSON "
            f"(docs/protocol.md section 4c); nothing was stored")


async def stored_report(store: "Store", metrics: "ServerMetrics", study_id: str, record, ids: list[bytes],
                        shares: np.ndarray, token: bytes | None) -> UploadResult:
    """Hand a checked report to the writer (which hashes single reports in bulk) and return its
    acknowledgement once it is durable; the writer's refusals are raised as ProblemError."""
    waiter = asyncio.get_running_loop().create_future()
    future = store.submit_upload(record, ids, shares, None, None, token, waiter=waiter)
    try:
        result = await waiter
    except asyncio.CancelledError:  # the client went away: not stored if the writer has not begun
        future.cancel()
        raise
    metrics.uploaded(study_id, result)
    return result


def bearer_credentials(scope: Scope) -> str | None:
    """The bearer token of the request's first Authorization header, as FastAPI's HTTPBearer
    (auto_error off) reads it: None when absent, empty or of another scheme."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization = value.decode("latin-1")
            scheme, credentials = get_authorization_scheme_param(authorization)
            if not (authorization and scheme and credentials) or scheme.lower() != "bearer":
                return None
            return credentials
    return None


class _Refer(Exception):
    """The request is for the FastAPI route to answer (see the module docstring)."""


class FastReports:
    """Pure ASGI middleware, outermost: the single-upload fast path (module docstring).

    ``app`` is the rest of the server (the metrics middleware, the body limit, upload
    admission, FastAPI), which answers everything this hands on; ``admission`` and
    ``max_body_bytes`` are the objects and the limit of those layers, whose checks a request
    answered here passes as it would there."""

    def __init__(self, app: ASGIApp, store: "Store", metrics: "ServerMetrics", server_id: str,
                 admission: Admission, max_body_bytes: int, gate: ResendGate | None = None):
        self.app = app
        self.gate = gate
        self.store = store
        self.metrics = metrics
        self.server_id = server_id
        self.admission = admission
        self.limit = max_body_bytes
        self._digests: dict[bytes, bytes | None] = {}  # Authorization header -> digest (_digest)
        #: study id -> (no parties, share bytes, proof bytes): a study's parameters never change
        self._shapes: dict[str, tuple[bool, int, int]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = perf_counter()
        match = None
        if scope["type"] == "http" and scope.get("method") == "POST" and not scope.get("root_path"):
            match = _REPORTS_PATH.fullmatch(scope["path"])
        authorization = None if match is None else self._head(scope)
        if authorization is None:
            await self.app(scope, receive, send)
            return
        http = self.metrics.http
        http.in_flight_now += 1  # as the metrics middleware counts it, from the head on
        try:
            messages, body, gone = await read_body(receive)
        except BaseException:
            http.in_flight_now -= 1
            raise
        size = len(body)
        admission = self.admission
        if gone or not body or size > self.limit or not admission.admits(size):
            # the layers inside answer it as they always did, from the same messages (nothing
            # ran in between: the admission check there sees what this one saw)
            await self._hand_on(scope, start, replaying(messages, receive), send)
            return
        # admitted, as UploadAdmission admits (one event loop: nothing runs between check and update)
        admission.requests += 1
        admission.bytes += size
        try:
            study_id = match["study_id"]
            try:
                if self.store.shared:
                    record, fields, token = await self._checked_shared(scope, study_id, body)
                else:
                    record, fields, token = self._checked(study_id, body, authorization)
            except Exception:  # _Refer, a ProblemError, pydantic's ValidationError, bad JSON, ...
                # the route answers it, from the same bytes (a refusal: nothing was stored), as it
                # answers every request: a refusal of its own, or its 500 for what nobody foresaw.
                # It keeps this admission: the admission layer lets it pass (ADMITTED_KEY).
                scope[ADMITTED_KEY] = True
                scope[ADMITTED_BYTES_KEY] = size
                await self._hand_on(scope, start, replaying(messages, receive), send)
                return
            await self._store(scope, receive, send, start, messages, study_id, record, fields, token, size)
        finally:
            admission.requests -= 1
            admission.bytes -= size

    def _head(self, scope: Scope) -> bytes | None:
        """None unless this path takes the request: Content-Type exactly application/json (the
        first such header, as the route reads it), and no Content-Length over the body limit
        (the body limit answers that, as problem_http.BodyLimit reads them: every such header,
        a non-number as no length). Else the first Authorization header's value (b"" without
        one), read in the same pass."""
        content_type = authorization = None
        for name, value in scope["headers"]:
            if name == b"content-type":
                if content_type is None:
                    content_type = value
            elif name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    continue
                if declared > self.limit:
                    return None
            elif name == b"authorization" and authorization is None:
                authorization = value
        if content_type != _JSON:
            return None
        return b"" if authorization is None else authorization

    async def _hand_on(self, scope: Scope, start: float, receive: Receive, send: Send) -> None:
        self.metrics.http.in_flight_now -= 1  # the metrics middleware counts it from here
        scope[START_KEY] = start
        await self.app(scope, receive, send)

    async def _store(self, scope: Scope, receive: Receive, send: Send, start: float, messages: list,
                     study_id: str, record, fields: tuple[bytes, bytes, bytes], token: bytes | None,
                     size: int) -> None:
        """Hand the report to the writer, which checks its binding with the others of its group,
        and answer, counted as the metrics middleware counts; an unbound report goes to the
        route instead (it answers 422 binding-refused, or an earlier refusal of its order)."""
        try:
            waiter = asyncio.get_running_loop().create_future()
            job = self.store.submit_single(record, *fields, token, waiter)
            try:
                result = await waiter
            except asyncio.CancelledError:  # the client went away: not stored if the writer has not begun
                job.future.cancel()
                raise
        except Unbound:  # nothing was stored: the route answers it, keeping this admission
            scope[ADMITTED_KEY] = True
            scope[ADMITTED_BYTES_KEY] = size
            await self._hand_on(scope, start, replaying(messages, receive), send)
            return
        except BaseException as exc:
            await self._refused(scope, receive, send, start, study_id, size, exc)
            return
        acknowledged = False
        try:
            if self.gate is not None:  # a re-send's answer waits while fresh uploads arrive
                await self.gate.answered(result, size, counted=True)
            # what json_response(result) sends (starlette's Response: the same headers, in its order)
            body = result_json(result)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"%d" % len(body)), (b"content-type", _JSON)]})
            await send({"type": "http.response.body", "body": body})
            acknowledged = True
        finally:
            metrics = self.metrics
            metrics.http.in_flight_now -= 1
            if acknowledged:  # what count_answer, ServerMetrics.on_complete and .uploaded count
                metrics.single_acknowledged(study_id, REPORTS_ROUTE, size, perf_counter() - start,
                                            result.accepted, result.duplicates)
            else:
                self._count_as_route(scope, study_id)
                count_answer(metrics.http, metrics.on_complete, scope, start, 200, size, None)

    async def _refused(self, scope: Scope, receive: Receive, send: Send, start: float, study_id: str, size: int,
                       exc: BaseException) -> None:
        """Answer the writer's refusal as the route's error handler renders it; anything else as
        FastAPI's server-error layer does (dpsketch/problem_http.py: 500, then re-raised);
        counted as the metrics middleware counts."""
        metrics = self.metrics
        self._count_as_route(scope, study_id)
        status, slug = 500, None
        try:
            if isinstance(exc, ProblemError):
                response = problem_response(exc, Request(scope))
            elif isinstance(exc, Exception):
                log.exception("unexpected error on %s %s", scope["method"], scope["path"], exc_info=exc)
                response = problem_response(ProblemError("internal-error", "unexpected server error"),
                                            Request(scope))
            else:  # cancelled, or the loop stopping: nobody to answer
                raise exc
            status, slug = response.status_code, problem_slug(response.body)
            await response(scope, receive, send)
        finally:
            metrics.http.in_flight_now -= 1
            count_answer(metrics.http, metrics.on_complete, scope, start, status, size, slug)
        if not isinstance(exc, ProblemError):
            raise exc

    @staticmethod
    def _count_as_route(scope: Scope, study_id: str) -> None:
        """Label an answer made here as the route's (no route matched, for the metrics)."""
        scope[ROUTE_KEY] = REPORTS_ROUTE
        scope["path_params"] = {"study_id": study_id}

    def _checked(self, study_id: str, body: bytes, authorization: bytes) -> tuple[Any, tuple[bytes, bytes, bytes],
                                                                                  bytes | None]:
        """The study's record, the report's decoded fields and the upload token's digest, for a
        report that passes every check of the route before its binding; raises otherwise (the
        route then answers; any refusal here: the route says which). What this accepts FastAPI
        accepts as the same report (json.loads, then the model: the same fields and validators;
        a repeated key: the last one, both ways). The SDK's plain JSON is read without
        pydantic, each field decoded once. ``authorization``: the header's value (b"": none)."""
        fields = report_fields(body) or Report.model_validate_json(body).fields()
        record = self.store.record(study_id)
        token = None
        if record.upload_required:  # as upload_token decides
            token = self._digest(authorization)
            if token is None or token not in record.upload_tokens:
                raise _Refer
        shape = self._shapes.get(study_id)
        if shape is None:
            study = record.study
            # a study with parties or validity proofs takes no single report: the route refuses it
            shape = self._shapes[study_id] = (study.parties is None and not proved_shares.is_proved(study),
                                              8 * study.width,
                                              binding.proof_bytes(study.n_servers))
        if record.commit is not None or not shape[0] or len(fields[2]) != shape[1] or len(fields[1]) != shape[2]:
            raise _Refer  # the route's study-closed or invalid-request, in its order
        return record, fields, token

    async def _checked_shared(self, scope: Scope, study_id: str, body: bytes) -> tuple[Any, tuple, bytes | None]:
        """:meth:`_checked` when replicas share the store: a token this process does not know
        yet may have been issued by another replica (upload_token refreshes them)."""
        fields = report_fields(body) or Report.model_validate_json(body).fields()
        token = await upload_token(self.store, study_id, bearer_credentials(scope))
        record = self.store.record(study_id)
        study = record.study
        if (record.commit is not None or study.parties is not None or proved_shares.is_proved(study)
                or len(fields[2]) != 8 * study.width
                or len(fields[1]) != binding.proof_bytes(study.n_servers)):
            raise _Refer
        return record, fields, token

    def _digest(self, authorization: bytes) -> bytes | None:
        """digest_of the bearer credentials in this Authorization header value (as
        bearer_credentials reads them; None without any), remembered per header: a client
        sends the same token with every upload, and reading the header and hashing the token
        were a tenth of this path's work. The memory holds at most _DIGESTS_KEPT headers and is
        emptied when full; it never says whether a token is valid (the record does)."""
        digests = self._digests
        try:
            return digests[authorization]
        except KeyError:
            pass
        credentials = bearer_credentials({"headers": [(b"authorization", authorization)]}) if authorization else None
        digest = None if credentials is None else digest_of(credentials)
        if len(digests) >= _DIGESTS_KEPT:
            digests.clear()
        digests[authorization] = digest
        return digest


def parse_batch(body: bytes, study: Study, media_type: str, server_id: str, keys, *,
                header: envelope.BatchHeader | None = None, transcript: bytes | None = None):
    """Decode a share batch (or a seed batch, expanded to the same shares; or a sealed batch,
    opened with this server's key ring ``keys``), check every record's binding and hash its ids
    (CPU work, run in a worker thread), and sort them for the writer's report index; the seeds
    too, which the writer stores instead of the shares where they are smaller (services/batches.py).
    A sealed batch judged first (:func:`sealed_precheck`) passes its ``header`` (and a relayed
    entry its ``transcript``), which envelope.open_batch then does not compute again."""
    width = proved_shares.upload_width(study)  # a validity study's leader: input and proof shares
    try:
        if media_type == SEALED_MEDIA_TYPE:
            upload = envelope.open_batch(body, width, study.n_servers, study.study_id, server_id,
                                         keys.private_key_for, header=header, transcript=transcript)
        else:
            upload = decode_upload(body, media_type, width, study.n_servers)
    except envelope.SealError as exc:
        raise ProblemError("sealed-share-refused", str(exc)) from None
    except ValueError as exc:
        raise ProblemError("malformed-body", str(exc)) from None
    shares = verified_shares(upload, study, server_id)
    rows, signs = study.hash_report_ids(upload.ids, upload.joined)
    seeds = upload.payloads if upload.content == binding.CONTENT_SEED else None  # stored in place of the share?
    addends = (proved_shares.addends(study, shares, seeds is not None) if proved_shares.is_proved(study)
               else None)  # a validity study's: what the running totals fold (made off the writer's thread)
    return upload.ids, shares, rows, signs, idsets.SortedIds(upload.joined), seeds, addends


def sealed_precheck(store: Store, record, body: bytes, token: bytes | None, party: int | None = None) -> envelope.BatchHeader:
    """What a sealed batch is judged on before any decryption work (issue 41): its layout and
    length (a body of the dropped per-record versions 1 and 2, or a malformed one: 400), that it
    is addressed to a key this server holds (422 sealed-share-refused), and that its upload
    token may add its new reports, read from the records' report ids, which travel in the clear
    (403 upload-quota-exceeded). Only then are its one KEM and its one AEAD run; each record's
    binding is inside its ciphertext, so it is checked after opening, before anything is stored.
    ``party``: a sealed block batch of that party (its block ids are the clear ids). Returns the
    parsed header, which envelope.open_batch then need not parse again."""
    study = record.study
    width = proved_shares.upload_width(study, party)  # a validity study's leader: input and proof shares
    header = sealed_header(store, lambda: envelope.parse_batch(body, width, study.n_servers, party))
    if token is not None:
        granted = record.upload_tokens.get(token)
        room = granted.room() if granted is not None else 0
        if room is not None and header.count > room:  # retries cost nothing: count the new ones
            new = store.count_new(record, envelope.record_ids(body, header, width, study.n_servers))
            if new > room:
                raise quota_problem(room, record.study_id, new)
    return header
