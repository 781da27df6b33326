"""The share server's HTTP API (docs/protocol.md section 6): a thin layer over the store.

Handlers parse and check requests, hash uploaded report ids off the event loop, hand the work to
:class:`services.store.Store` and translate its answers. Every refusal is a
:class:`ProblemError`, rendered as problem JSON by ``errors.install``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request, Response, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError

import dpsketch
from dpsketch.protocol import envelope, ring, sketch
from dpsketch.protocol.messages import (
    AGGREGATE_MEDIA_TYPE,
    INCLUSION_HASH_HEADER,
    REPORT_IDS_MEDIA_TYPE,
    SEALED_MEDIA_TYPE,
    SEEDS_MEDIA_TYPE,
    SHARES_MEDIA_TYPE,
    CommitResult,
    HpkeKeys,
    Report,
    ServerInfo,
    StudyInfo,
    UploadResult,
    UploadTokenList,
    decode_upload,
)
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.study import PROTOCOL, Study

from dpsketch import problem_http as errors
from dpsketch.problem_http import problem_responses, summarize_errors
from . import policy
from .auth import TokenRegistry, digest_of, matches, upload_token_id
from .settings import Settings
from .store import Store

log = logging.getLogger("dpsketch.server")

BINARY_SCHEMA = {"type": "string", "format": "binary"}


def _binary_body(media_type: str, description: str) -> dict[str, Any]:
    return {"requestBody": {"required": True, "description": description,
                            "content": {media_type: {"schema": BINARY_SCHEMA}}}}


def _binary_response(media_type: str, description: str, headers: dict | None = None) -> dict:
    out: dict[str, Any] = {"description": description, "content": {media_type: {"schema": BINARY_SCHEMA}}}
    if headers:
        out["headers"] = headers
    return out


def require_media_type(request: Request, expected: str, *also: str) -> str:
    """415 unless the Content-Type is ``expected`` or one of ``also`` (parameters such as
    charset are ignored); returns the media type given."""
    given = request.headers.get("content-type", "")
    media_type = given.split(";", 1)[0].strip().lower()
    if media_type != expected and media_type not in also:
        raise ProblemError("unsupported-media-type",
                           f"this endpoint takes Content-Type {' or '.join((expected, *also))}, "
                           f"got {given[:100] or 'none'!r}")
    return media_type


class Roles:
    """Bearer-token roles over SHA-256 digests (services/auth.py). The presented token's digest
    is compared with every digest of both roles (constant time), so a token of the other role is
    told apart from a wrong one: 403 versus 401."""

    scheme = HTTPBearer(auto_error=False, description="operator or analyst token")

    def __init__(self, settings: Settings):
        self.registry = TokenRegistry(
            {"operator": settings.operator_digests, "analyst": settings.analyst_digests},
            settings.tokens_file)

    def require(self, role: str):
        other = "analyst" if role == "operator" else "operator"

        async def check(creds: HTTPAuthorizationCredentials | None = Security(self.scheme)) -> None:
            challenge = {"WWW-Authenticate": "Bearer"}
            if creds is None or not creds.credentials:
                raise ProblemError("unauthorized", f"this endpoint needs the {role} bearer token",
                                   headers=challenge)
            given = digest_of(creds.credentials)
            is_role = matches(self.registry.digests(role), given)
            is_other = matches(self.registry.digests(other), given)
            if is_role:
                return
            if is_other:
                raise ProblemError("forbidden", f"the {other} token may not do this; it needs the {role} token")
            raise ProblemError("unauthorized", "the bearer token is not valid here", headers=challenge)

        return check


def _install_sighup(registry: TokenRegistry) -> None:
    """SIGHUP re-reads the tokens file (main thread only; chains any previous handler)."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGHUP)

    def on_hup(signum, frame):
        registry.request_reload()
        log.info("SIGHUP: the tokens file is re-read at the next request")
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGHUP, on_hup)


def _json(model) -> Response:
    """Serialize a response model directly (the hot upload paths skip FastAPI's re-validation)."""
    return Response(model.model_dump_json(), media_type="application/json")


def _parse_batch(body: bytes, study: Study, media_type: str = SHARES_MEDIA_TYPE, opener=None):
    """Decode a share batch (or a seed batch, expanded to the same shares; or a sealed batch,
    opened with ``opener`` = (server id, key ring)) and hash its ids (CPU work, run in a worker
    thread)."""
    try:
        if media_type == SEALED_MEDIA_TYPE:
            server_id, keys = opener
            ids, shares = envelope.open_batch(body, study.width, study.study_id, server_id,
                                              keys.private_key_for, ring.expand_seeds)
        else:
            ids, shares = decode_upload(body, media_type, study.width)
    except envelope.SealError as exc:
        raise ProblemError("sealed-share-refused", str(exc)) from None
    except ValueError as exc:
        raise ProblemError("malformed-body", str(exc)) from None
    rows, signs = sketch.hash_report_ids(study.seed_bytes, ids, study.k, study.s)
    return ids, shares, rows, signs


def create_app(settings: Settings) -> FastAPI:
    """Open the store and build the app; the store closes when the app shuts down."""
    store = Store(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await run_in_threadpool(store.close)

    app = FastAPI(
        title=f"dpsketch share server {settings.server_id}",
        version=dpsketch.__version__,
        description="One of the N share servers of dpsketch (docs/protocol.md section 6). Errors are "
                    "application/problem+json with a stable type urn:dpsketch:problem:<slug>.",
        lifespan=lifespan,
        # every route answers invalid input as problem JSON, not FastAPI's default 422 shape
        responses=problem_responses(422),
    )
    app.state.store = store
    app.state.settings = settings
    errors.install(app)
    app.add_middleware(errors.BodyLimit, limit=settings.max_body_bytes)
    roles = Roles(settings)
    if settings.tokens_file is not None:
        _install_sighup(roles.registry)
    operator = Depends(roles.require("operator"))
    analyst = Depends(roles.require("analyst"))
    auth_errors = (401, 403)

    @app.get("/healthz", tags=["meta"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/info", response_model=ServerInfo, tags=["meta"])
    async def info() -> ServerInfo:
        return ServerInfo(server_id=settings.server_id, protocol=PROTOCOL, version=dpsketch.__version__,
                          policy=policy.describe(settings), hpke=store.keys.describe())

    @app.post("/v1/keys", response_model=HpkeKeys, status_code=201, tags=["meta"],
              dependencies=[operator], responses=problem_responses(*auth_errors, 503))
    async def rotate_key() -> HpkeKeys:
        """Rotate the HPKE key (operator): a new key becomes current (clients seal to it from
        their next GET /v1/info on); every older key still opens shares until retired."""
        return await run_in_threadpool(store.rotate_key)

    @app.delete("/v1/keys/{key_id}", response_model=HpkeKeys, tags=["meta"], dependencies=[operator],
                responses=problem_responses(*auth_errors, 404, 409, 503))
    async def retire_key(key_id: str) -> HpkeKeys:
        """Retire (erase) a superseded HPKE key (operator). Refused with 409 key-in-use for the
        current key and while any study provisioned before it was superseded is still open."""
        return await run_in_threadpool(store.retire_key, key_id)

    @app.put(
        "/v1/studies/{study_id}", response_model=StudyInfo, tags=["studies"],
        dependencies=[operator],
        responses={200: {"description": "already held", "model": StudyInfo},
                   201: {"description": "provisioned", "model": StudyInfo},
                   **problem_responses(400, *auth_errors, 413, 422, 503)},
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": Study.model_json_schema()}}}},
    )
    async def provision(study_id: str, request: Request) -> JSONResponse:
        """Provision a study (operator). Idempotent: the same study again answers 200."""
        body = await request.body()
        try:
            study = Study.model_validate_json(body)
        except ValidationError as exc:
            if any(e.get("type") == "json_invalid" for e in exc.errors()):
                raise ProblemError("malformed-body", "the body is not valid JSON") from None
            raise ProblemError("invalid-study", summarize_errors(exc.errors())) from None
        try:
            actual_id = study.study_id
        except ValueError as exc:  # e.g. a non-finite number: no canonical encoding, no id
            raise ProblemError("invalid-study", f"the study has no canonical encoding: {exc}") from None
        if actual_id != study_id:
            raise ProblemError("invalid-study",
                               f"the study's id (SHA-256 of its canonical JSON) is {actual_id}, "
                               f"not the {study_id[:80]!r} of the path")
        if settings.server_id not in study.servers:
            raise ProblemError("invalid-study",
                               f"the study's servers {study.servers} do not include this server "
                               f"({settings.server_id})")
        if study.k > settings.max_k or study.k * study.width > settings.max_aggregate_cells:
            raise ProblemError("invalid-study",
                               f"this server accepts k <= {settings.max_k} and k * width <= "
                               f"{settings.max_aggregate_cells} (got k = {study.k}, width = {study.width})")
        policy.check(study, settings)
        info, created = await run_in_threadpool(store.provision, study)
        return JSONResponse(info.model_dump(mode="json"), status_code=201 if created else 200)

    @app.get("/v1/studies", response_model=list[StudyInfo], tags=["studies"])
    async def list_studies() -> list[StudyInfo]:
        return store.infos()

    @app.get("/v1/studies/{study_id}", response_model=StudyInfo, tags=["studies"],
             responses=problem_responses(404))
    async def get_study(study_id: str) -> StudyInfo:
        """A study's parameters and progress (report_count); public."""
        return store.info(store.record(study_id))

    upload_scheme = HTTPBearer(auto_error=False, description="the study's upload token, if it has any")

    async def upload_allowed(study_id: str,
                             creds: HTTPAuthorizationCredentials | None = Security(upload_scheme)) -> None:
        """A study with upload tokens takes uploads only with one of them (401 otherwise)."""
        record = store.record(study_id)
        digests = record.upload_digests
        if not record.upload_required:
            return
        if creds is None or not creds.credentials:
            raise ProblemError("unauthorized", f"study {study_id} takes uploads only with one of its upload tokens",
                               headers={"WWW-Authenticate": "Bearer"})
        if not matches(digests, digest_of(creds.credentials)):
            raise ProblemError("unauthorized", "the bearer token is not a valid upload token of this "
                               "study (unknown, or revoked)",
                               headers={"WWW-Authenticate": "Bearer"})

    uploader = Depends(upload_allowed)

    @app.post("/v1/studies/{study_id}/upload-tokens", status_code=201, tags=["studies"],
              dependencies=[operator], responses=problem_responses(*auth_errors, 404, 503))
    async def create_upload_token(study_id: str) -> JSONResponse:
        """Issue a fresh upload token for the study (operator). Only its digest is stored; from
        the first token on, uploads to the study need one of its tokens."""
        token, count = await run_in_threadpool(store.add_upload_token, study_id)
        return JSONResponse({"study_id": study_id, "token": token, "upload_tokens": count,
                             "token_id": upload_token_id(digest_of(token))},
                            status_code=201, headers={"Cache-Control": "no-store"})

    @app.get("/v1/studies/{study_id}/upload-tokens", response_model=UploadTokenList, tags=["studies"],
             dependencies=[operator], responses=problem_responses(*auth_errors, 404, 503))
    async def list_upload_tokens(study_id: str) -> UploadTokenList:
        """The study's upload tokens (operator): ids, issue and revocation times, never a token."""
        return await run_in_threadpool(store.list_upload_tokens, study_id)

    @app.delete("/v1/studies/{study_id}/upload-tokens/{token_id}", response_model=UploadTokenList,
                tags=["studies"], dependencies=[operator],
                responses=problem_responses(*auth_errors, 404, 503))
    async def revoke_upload_token(study_id: str, token_id: str) -> UploadTokenList:
        """Revoke one upload token (operator; idempotent): refused from this answer on. The
        study keeps requiring an upload token, even if none is left."""
        return await run_in_threadpool(store.revoke_upload_token, study_id, token_id)

    @app.delete("/v1/studies/{study_id}/shares", tags=["finalization"], dependencies=[operator],
                responses=problem_responses(*auth_errors, 404, 409, 503))
    async def delete_shares(study_id: str) -> dict:
        """Retention (operator): delete a committed study's individual shares. The commit, the
        released aggregate and the report-id list are unchanged. Idempotent; 409 before commit."""
        return await run_in_threadpool(store.delete_shares, study_id)

    @app.post("/v1/studies/{study_id}/reports", response_model=UploadResult, tags=["reports"],
              dependencies=[uploader], responses=problem_responses(400, 401, 404, 409, 413, 422, 503))
    async def upload_report(study_id: str, report: Report) -> Response:
        """Upload one report's share; acknowledged once it is durable."""
        record = store.record(study_id)
        study = record.study
        try:
            shares = report.share_values(study.width).reshape(1, study.width)
        except ValueError as exc:
            raise ProblemError("invalid-request", str(exc)) from None
        ids = [bytes.fromhex(report.report_id)]  # the writer hashes single reports in bulk
        result = await asyncio.wrap_future(store.submit_upload(record, ids, shares, None, None))
        return _json(result)

    @app.post("/v1/studies/{study_id}/batches", response_model=UploadResult, tags=["reports"],
              dependencies=[uploader], responses=problem_responses(400, 401, 404, 409, 413, 415, 422, 503),
              openapi_extra={"requestBody": {
                  "required": True,
                  "description": f"{SHARES_MEDIA_TYPE}: m records of a 16-byte report id and d "
                                 f"little-endian uint64 (the share); or {SEEDS_MEDIA_TYPE}: m records "
                                 f"of a 16-byte report id and a 32-byte seed, which the server expands "
                                 f"to the d-value share (ChaCha20, docs/protocol.md section 4); or "
                                 f"{SEALED_MEDIA_TYPE}: m records of a share or seed sealed to this "
                                 f"server with HPKE (docs/protocol.md section 7a)",
                  "content": {SHARES_MEDIA_TYPE: {"schema": BINARY_SCHEMA},
                              SEEDS_MEDIA_TYPE: {"schema": BINARY_SCHEMA},
                              SEALED_MEDIA_TYPE: {"schema": BINARY_SCHEMA}}}})
    async def upload_batch(study_id: str, request: Request) -> Response:
        """Upload many reports at once, as full shares, as seeds (expanded to the same shares
        before anything else, so duplicates are judged on the share bytes) or sealed to this
        server with HPKE (opened first, then the same); all-or-nothing, acknowledged once durable."""
        media_type = require_media_type(request, SHARES_MEDIA_TYPE, SEEDS_MEDIA_TYPE, SEALED_MEDIA_TYPE)
        record = store.record(study_id)
        if record.commit is not None:
            raise ProblemError("study-closed", f"study {study_id} is committed; it takes no more reports")
        body = await request.body()
        ids, shares, rows, signs = await run_in_threadpool(_parse_batch, body, record.study, media_type,
                                                           (settings.server_id, store.keys))
        return _json(await asyncio.wrap_future(store.submit_upload(record, ids, shares, rows, signs)))

    @app.get("/v1/studies/{study_id}/report-ids", tags=["finalization"], dependencies=[analyst],
             response_class=Response,
             responses={200: _binary_response(REPORT_IDS_MEDIA_TYPE, "sorted 16-byte report ids"),
                        **problem_responses(*auth_errors, 404, 503)})
    async def report_ids(study_id: str) -> Response:
        """The ids of every report this server holds for the study (analyst)."""
        body = await run_in_threadpool(store.report_ids, study_id)
        return Response(body, media_type=REPORT_IDS_MEDIA_TYPE)

    @app.post("/v1/studies/{study_id}/commit", response_model=CommitResult, tags=["finalization"],
              dependencies=[analyst],
              responses=problem_responses(400, *auth_errors, 404, 409, 413, 415, 422, 503),
              openapi_extra=_binary_body(REPORT_IDS_MEDIA_TYPE,
                                         "the inclusion set: 16-byte ids in ascending order"))
    async def commit(study_id: str, request: Request) -> CommitResult:
        """Commit the study to one inclusion set, after the certificate (analyst)."""
        require_media_type(request, REPORT_IDS_MEDIA_TYPE)
        store.record(study_id)
        body = await request.body()
        return await run_in_threadpool(store.commit, study_id, body)

    @app.get("/v1/studies/{study_id}/aggregate", tags=["finalization"], dependencies=[analyst],
             response_class=Response,
             responses={200: _binary_response(
                 AGGREGATE_MEDIA_TYPE, "k x d little-endian uint64, row-major",
                 {INCLUSION_HASH_HEADER: {"schema": {"type": "string"},
                                          "description": "SHA-256 of the sorted inclusion set"}}),
                 **problem_responses(*auth_errors, 404, 409, 503)})
    async def aggregate(study_id: str) -> Response:
        """The released aggregate share: only after commit, identical on every call (analyst)."""
        body, ihash = await run_in_threadpool(store.aggregate, study_id)
        return Response(body, media_type=AGGREGATE_MEDIA_TYPE, headers={INCLUSION_HASH_HEADER: ihash})

    return app
