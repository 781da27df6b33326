"""The share server's HTTP API (docs/protocol.md section 6): a thin layer over the store.

Handlers parse and check requests, hash uploaded report ids off the event loop, hand the work to
:class:`services.store.Store` and translate its answers. Every refusal is a
:class:`ProblemError`, rendered as problem JSON by ``errors.install``.
"""

from __future__ import annotations

import asyncio
import re
import logging
import signal
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, Request, Response, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError

import dpsketch

from dpsketch.protocol import binding, envelope, inclusion, proved_shares, relayed
from dpsketch.protocol.messages import (
    AGGREGATE_MEDIA_TYPE,
    BLOCK_INDEX_MEDIA_TYPE,
    BLOCK_SEEDS_MEDIA_TYPE,
    BLOCKS_MEDIA_TYPE,
    INCLUSION_HASH_HEADER,
    REPORT_IDS_MEDIA_TYPE,
    SEALED_MEDIA_TYPE,
    SEEDS_MEDIA_TYPE,
    SHARES_MEDIA_TYPE,
    CommitResult,
    HpkeKeys,
    IssuedUploadTokens,
    IssueUploadTokens,
    PopulationLedger,
    RelayedResults,
    Report,
    ServerInfo,
    StudyInfo,
    Upload,
    UploadResult,
    UploadTokenList,
    decode_blocks,
    party_of_media_type,
)
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.study import PROTOCOL, Study

from dpsketch import problem_http as errors
from dpsketch.problem_http import problem_responses, summarize_errors
from dpsketch import observability, pld_cache
from . import policy, proof_uploads, relayed_uploads, verify_api
from .admission import Admission, UploadAdmission
from .auth import TokenRegistry, digest_of, matches, upload_token_id
from .metrics import ServerMetrics
from .settings import Settings
from .store import Store
from .resend_gate import ResendGate, hold_route_answer
from .study_route import FastStudy
from .uploads import (FastReports, checked_report, json_response, parse_batch, sealed_precheck, stored_report,
                      upload_token, verified_shares)

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


#: the commit and a validity study's decision: bodies bounded by what the study holds instead
_COMMIT_PATH = re.compile(r"^/v1/studies/[^/]+/(commit|verify/decide)$")


def _is_commit(scope) -> bool:
    return scope.get("method") == "POST" and _COMMIT_PATH.fullmatch(scope.get("path", "")) is not None


def commit_body_limit(held: int, media_type: str, settings: Settings) -> int:
    """The largest commit body this server reads: a report-id list (16 bytes an included id)
    only up to the general --max-body-bytes (64 MiB, about 4 x 10^6 ids), the compact bitmap
    (dpsketch/protocol/inclusion.py) exactly the size of one over the ``held`` ids (a bit an id:
    1.25 MB at 10^7), whatever the study's max_reports. Before issue 41 a commit body could be
    16 bytes x max_reports, up to the memory budget, read into memory whole. The analyst's
    token is checked before a byte of it is read."""
    if media_type == inclusion.MEDIA_TYPE:
        return inclusion.body_bytes(held)
    return settings.max_body_bytes


def commit_memory(held: int, body_bytes: int, media_type: str) -> int:
    """What a commit holds in memory beyond the study's totals and index while it is worked on
    (measured: benchmarks/commit_memory.py): for a bitmap, the body, its bits unpacked and the
    rowids it selects or leaves out (about 10 bytes a held id) and a 16 MiB hashing buffer; for
    a report-id list, the body, its copy and halves and the matches (about 5 bytes a body byte
    and 10 a held id)."""
    if media_type == inclusion.MEDIA_TYPE:
        return 2 * body_bytes + 10 * held + (32 << 20)
    return 5 * body_bytes + 10 * held


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

    def require(self, *roles: str):
        """A dependency admitting a token of any of ``roles``."""
        wanted = " or ".join(roles)

        async def check(creds: HTTPAuthorizationCredentials | None = Security(self.scheme)) -> None:
            challenge = {"WWW-Authenticate": "Bearer"}
            if creds is None or not creds.credentials:
                raise ProblemError("unauthorized", f"this endpoint needs the {wanted} bearer token",
                                   headers=challenge)
            given = digest_of(creds.credentials)
            held = [r for r in ("operator", "analyst") if matches(self.registry.digests(r), given)]
            if any(r in roles for r in held):
                return
            if held:
                raise ProblemError("forbidden", f"the {held[0]} token may not do this; it needs the {wanted} token")
            raise ProblemError("unauthorized", "the bearer token is not valid here", headers=challenge)

        return check

    def trusted(self):
        """A dependency telling whether the request carries a valid operator or analyst token
        (public endpoints answer it more: exact counts of add/remove studies)."""

        async def check(creds: HTTPAuthorizationCredentials | None = Security(self.scheme)) -> bool:
            return self.is_trusted(creds.credentials if creds is not None else None)

        return check

    def is_trusted(self, credentials: str | None) -> bool:
        """Whether bearer ``credentials`` are a valid operator or analyst token."""
        if not credentials:
            return False
        given = digest_of(credentials)
        return any(matches(self.registry.digests(r), given) for r in ("operator", "analyst"))


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


def _parse_blocks(body: bytes, study: Study, party: int, server_id: str, keys=None,
                  seeds: bool = False, header: envelope.BatchHeader | None = None) -> tuple[Upload, np.ndarray]:
    """Decode one party's block batch (``seeds``: a block seed batch; or, with this server's key
    ring ``keys``, open a sealed one: docs/sealing.md section 3a, its ``header`` as
    sealed_precheck parsed it) and check every block's binding (worker thread); the upload and
    what the server keeps of its records (a validity study's: the leader's n_j + P_j values,
    checked < p, or the helper's seeds as words)."""
    width = proved_shares.upload_width(study, party)  # a validity study's leader: input and proof shares
    try:
        if keys is not None:
            upload = envelope.open_batch(body, width, study.n_servers, study.study_id, server_id,
                                         keys.private_key_for, party, header=header)
        else:
            upload = decode_blocks(body, party, width, study.n_servers, seeds)
    except envelope.SealError as exc:
        raise ProblemError("sealed-share-refused", str(exc)) from None
    except ValueError as exc:
        raise ProblemError("malformed-body", str(exc)) from None
    if upload.content == binding.CONTENT_SEED and not proved_shares.is_proved(study):
        raise ProblemError("malformed-body", f"study {study.study_id} has no validity proofs: each of its "
                           f"servers takes a party's blocks as shares (content 0x03), not seeds (0x04)")
    return upload, verified_shares(upload, study, server_id, party=party)


def _block_party(study: Study, content_type: str, token_party: str | None) -> int:
    """The party a block batch is for (its media type's ``party``), checked against the study and
    the upload token: a party's token uploads only that party's blocks (403 wrong-party)."""
    if study.parties is None:  # the media type is the wrong one for this study: 415, as any other
        raise ProblemError("unsupported-media-type", f"study {study.study_id} has no parties: it takes "
                           f"{SHARES_MEDIA_TYPE}, {SEEDS_MEDIA_TYPE} or {SEALED_MEDIA_TYPE} batches, "
                           f"not a party's blocks ({BLOCKS_MEDIA_TYPE} or {SEALED_MEDIA_TYPE} with party=NAME)")
    name = party_of_media_type(content_type)
    if name is None:
        raise ProblemError("unsupported-media-type", f"a block batch names its party: Content-Type "
                           f"{BLOCKS_MEDIA_TYPE}; party=NAME, or {SEALED_MEDIA_TYPE}; party=NAME "
                           f"(parties: {[p.name for p in study.parties]})")
    try:
        index, _ = study.party(name)
    except ValueError as exc:
        raise ProblemError("invalid-request", str(exc)) from None
    if token_party is not None and token_party != name:
        raise ProblemError("wrong-party", f"this upload token uploads the blocks of party "
                           f"{token_party!r}, not of {name!r}; nothing of this request was stored")
    return index


class ShareServerAPI(FastAPI):
    """FastAPI with the server's own pure ASGI middlewares *outside* the framework's stack.

    FastAPI puts middlewares added with ``add_middleware`` inside its own outer layers (the
    server-error handler, its telemetry check and body-limit wrapper); a request pays for those
    layers before reaching ours. The middlewares given to :meth:`add_outer_middleware` wrap the
    whole app instead, so the single-upload fast path (services/uploads.py) answers without
    entering FastAPI at all, while every other request passes through them into FastAPI's
    stack as before. They still see every answer: the error handler's 500 problem JSON is sent
    through them (and its exception re-raised to uvicorn, as it always was)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._outer_specs: list[tuple[type, dict[str, Any]]] = []
        self._outer: Any = None
        #: called as each HTTP request arrives (the store's idle clock: Store.note_request)
        self.on_request: Callable[[], None] | None = None

    def add_outer_middleware(self, cls: type, **options: Any) -> None:
        """As ``add_middleware``: the last one added is the outermost."""
        if self._outer is not None:
            raise RuntimeError("cannot add middleware after the app has started")
        self._outer_specs.insert(0, (cls, options))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan (and websockets, which no route takes)
            await super().__call__(scope, receive, send)
            return
        if self.on_request is not None:
            self.on_request()
        outer = self._outer
        if outer is None:
            outer = super().__call__
            for cls, options in reversed(self._outer_specs):
                outer = cls(outer, **options)
            self._outer = outer
        await outer(scope, receive, send)


def create_app(settings: Settings) -> FastAPI:
    """Open the store and build the app; the store closes when the app shuts down."""
    pld_cache.install()  # the population ledger's built PLDs on disk (docs/ledger.md)
    store = Store(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await run_in_threadpool(store.close)

    app = ShareServerAPI(
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
    app.on_request = store.note_request
    errors.install(app)
    admission = Admission.from_env()
    # re-sends' answers wait while fresh uploads arrive (services/resend_gate.py)
    gate = ResendGate.from_env(admission)
    app.state.resend_gate = gate
    metrics = ServerMetrics(store, app, admission, gate)
    app.state.metrics = metrics
    # Outside FastAPI's own layers (ShareServerAPI), outermost last:
    # inside the body limit: it reads upload bodies through it, then admits or refuses (503)
    app.add_outer_middleware(UploadAdmission, admission=admission)
    # the commit's body is bounded by what the study can hold instead (commit_body_limit)
    app.add_outer_middleware(errors.BodyLimit, limit=settings.max_body_bytes, exempt=_is_commit)
    # times and counts every answer, the admission and body-limit refusals included
    app.add_outer_middleware(observability.MetricsMiddleware, metrics=metrics.http,
                             on_complete=metrics.on_complete)
    # outermost: well-formed single uploads answered without the layers above and FastAPI's
    # routing and dependency solving, passing the same checks and counted the same way;
    # everything else goes on to them and the routes below (services/uploads.py)
    app.add_outer_middleware(FastReports, store=store, metrics=metrics, server_id=settings.server_id,
                             admission=admission, max_body_bytes=settings.max_body_bytes, gate=gate)
    roles = Roles(settings)
    # beside it: a client's read of an open study answered from cached bytes (services/study_route.py)
    app.add_outer_middleware(FastStudy, store=store, metrics=metrics, is_trusted=roles.is_trusted)
    if settings.cors_origins:
        # outermost of all: a browser's preflight (OPTIONS) is answered before anything else, and
        # every answer to an allowed page carries Access-Control-Allow-Origin (data owners' pages
        # submitting rows from the TypeScript client; clients/typescript/README.md)
        app.add_outer_middleware(errors.cors_middleware(), allow_origins=list(settings.cors_origins),
                                 allow_methods=["GET", "POST", "PUT", "DELETE"],
                                 allow_headers=["Authorization", "Content-Type"],
                                 expose_headers=["Retry-After", "Location"], allow_credentials=False,
                                 max_age=600)
    if settings.tokens_file is not None:
        _install_sighup(roles.registry)
    operator = Depends(roles.require("operator"))
    analyst = Depends(roles.require("analyst"))
    provisioner = Depends(roles.require("operator", "analyst"))
    trusted = roles.trusted()
    auth_errors = (401, 403)

    @app.get("/healthz", tags=["meta"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers (restart it if not). Says nothing about its database."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["meta"], response_class=Response,
             responses={200: {"description": "ready", "content": {"application/json": {"schema": {
                 "type": "object", "properties": {"status": {"type": "string", "enum": ["ready"]}},
                 "required": ["status"]}}}}, **problem_responses(503)})
    async def readyz() -> Response:
        """Readiness (send traffic here?): 503 while the database cannot answer within 2 s, while
        the server is shutting down, or while uploads in flight are at their admission limit
        (docs/operations.md). Public, like /healthz: it tells nothing about any study."""
        reasons = []
        if observability.shutting_down(app) or store.writer.stopping:
            reasons.append("shutting down")
        try:
            await asyncio.wait_for(run_in_threadpool(store.ping), timeout=2.0)
        except asyncio.TimeoutError:
            reasons.append("the database did not answer within 2 s")
        except ProblemError as exc:
            reasons.append(f"the database cannot answer ({exc.detail})")
        if admission.saturated():
            reasons.append("saturated: uploads in flight are at the admission limit")
        return observability.ready_answer(reasons)

    @app.get("/metrics", tags=["meta"], dependencies=[operator], response_class=Response,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}},
                        **problem_responses(*auth_errors)})
    async def prometheus_metrics() -> Response:
        """Prometheus metrics (operator token: per-study counts of an add/remove study tell
        membership, docs/trust.md); every metric is listed in docs/operations.md."""
        return observability.metrics_response(metrics.registry)

    @app.get("/v1/info", response_model=ServerInfo, tags=["meta"])
    async def info() -> ServerInfo:
        return ServerInfo(server_id=settings.server_id, protocol=PROTOCOL, version=dpsketch.__version__,
                          policy=policy.describe(settings), hpke=store.keys.describe())

    @app.post("/v1/keys", response_model=HpkeKeys, status_code=201, tags=["meta"],
              dependencies=[operator], responses=problem_responses(*auth_errors, 503))
    async def rotate_key() -> HpkeKeys:
        """Rotate the HPKE keys (operator): a new key of each suite, classical and post-quantum,
        becomes current (clients seal to it from their next GET /v1/info on); every older key
        still opens shares until retired."""
        return await run_in_threadpool(store.rotate_key)

    @app.delete("/v1/keys/{key_id}", response_model=HpkeKeys, tags=["meta"], dependencies=[operator],
                responses=problem_responses(*auth_errors, 404, 409, 503))
    async def retire_key(key_id: str) -> HpkeKeys:
        """Retire (erase) a superseded HPKE key of either suite (operator). Refused with 409
        key-in-use for a current key and while any study provisioned before it was superseded is
        still open."""
        return await run_in_threadpool(store.retire_key, key_id)

    @app.put(
        "/v1/studies/{study_id}", response_model=StudyInfo, tags=["studies"],
        dependencies=[provisioner],
        responses={200: {"description": "already held", "model": StudyInfo},
                   201: {"description": "provisioned", "model": StudyInfo},
                   **problem_responses(400, *auth_errors, 409, 413, 422, 503)},
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": Study.model_json_schema()}}}},
    )
    async def provision(study_id: str, request: Request) -> JSONResponse:
        """Provision a study (operator or analyst: the server's own policy decides what it accepts,
        so the analyzer needs no operator token). Idempotent: the same study again answers 200."""
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

    @app.get("/v1/populations/{population}/ledger", response_model=PopulationLedger, tags=["studies"],
             responses=problem_responses(422))
    async def population_ledger(population: str) -> PopulationLedger:
        """The privacy ledger of a population at this server (public: clients decide with it):
        every study charged to it, their composition with dp-accounting at the budget's delta,
        the naive sum of their epsilons and this server's budget (docs/ledger.md). A population
        with no study yet has an empty ledger."""
        import re

        from dpsketch.protocol.study import POPULATION_PATTERN

        if not re.fullmatch(POPULATION_PATTERN, population):
            raise ProblemError("invalid-request", f"a population id matches {POPULATION_PATTERN}; got "
                                                  f"{population[:80]!r}")
        return await run_in_threadpool(store.ledger, population)

    @app.get("/v1/studies", response_model=list[StudyInfo], tags=["studies"])
    async def list_studies(is_trusted: bool = Depends(trusted)) -> list[StudyInfo]:
        return store.infos(is_trusted)

    @app.get("/v1/studies/{study_id}", response_model=StudyInfo, tags=["studies"],
             responses=problem_responses(404))
    async def get_study(study_id: str, is_trusted: bool = Depends(trusted)) -> StudyInfo:
        """A study's parameters and progress (report_count); public, except the exact counts of an
        add/remove study (report_count and commit are null without an operator or analyst token:
        a count that moves by one tells membership)."""
        record = store.record(study_id)
        if store.shared:  # another replica may have taken reports or committed it
            record = await run_in_threadpool(store.refresh, record)
        return store.info(record, is_trusted)

    upload_scheme = HTTPBearer(auto_error=False, description="one of the study's upload tokens (issued "
                               "by this server's operator; required by default)")

    async def upload_allowed(study_id: str,
                             creds: HTTPAuthorizationCredentials | None = Security(upload_scheme)) -> bytes | None:
        """The upload token's digest, if the study requires one (services/uploads.py)."""
        return await upload_token(store, study_id, creds.credentials if creds is not None else None)

    @app.post("/v1/studies/{study_id}/upload-tokens", status_code=201, tags=["studies"],
              dependencies=[operator], response_model=IssuedUploadTokens,
              responses=problem_responses(*auth_errors, 404, 409, 422, 503))
    async def create_upload_tokens(study_id: str, request: Request) -> JSONResponse:
        """Issue upload tokens for the study (operator only: the analyst must not mint its own, or
        it could upload Sybil reports without bound). Body (optional) ``{"count", "quota",
        "population"}``: by default one token good for one report, for the server's default
        population. The population is the operator's: the first token of a population for a
        study charges the study to that population's ledger (409 budget-exceeded past its
        budget, docs/ledger.md). Only digests are stored; from the first token on, uploads to
        the study need one of its tokens."""
        store.record(study_id)
        body = await request.body()
        try:
            ask = IssueUploadTokens.model_validate_json(body) if body.strip() else IssueUploadTokens()
        except ValidationError as exc:
            raise ProblemError("invalid-request", summarize_errors(exc.errors())) from None
        tokens, active, population = await run_in_threadpool(
            store.add_upload_tokens, study_id, ask.count, ask.quota, ask.party, ask.population)
        ids = [upload_token_id(digest_of(t)) for t in tokens]
        out = IssuedUploadTokens(study_id=study_id, tokens=tokens, token_ids=ids, quota=ask.quota,
                                 upload_tokens=active, token=tokens[0], token_id=ids[0], population=population)
        return JSONResponse(out.model_dump(mode="json"), status_code=201, headers={"Cache-Control": "no-store"})

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

    @app.delete("/v1/studies/{study_id}", tags=["studies"], dependencies=[operator],
                responses=problem_responses(*auth_errors, 404, 409, 503))
    async def drop_study(study_id: str) -> dict:
        """Drop an open study (operator; idempotent): its shares are deleted, it takes no more
        reports and never releases, its memory is freed and its population charges are refunded
        (it released nothing). Logged as an audit record. 409 study-closed for a committed study
        (what it released is spent; DELETE .../shares removes its shares)."""
        return await run_in_threadpool(store.close_study, study_id, "dropped", "the operator")

    @app.delete("/v1/studies/{study_id}/shares", tags=["finalization"], dependencies=[operator],
                responses=problem_responses(*auth_errors, 404, 409, 503))
    async def delete_shares(study_id: str) -> dict:
        """Retention (operator): delete a committed study's individual shares. The commit, the
        released aggregate and the report-id list are unchanged. Idempotent; 409 before commit."""
        return await run_in_threadpool(store.delete_shares, study_id)

    @app.post("/v1/studies/{study_id}/reports", response_model=UploadResult, tags=["reports"],
              responses=problem_responses(400, 401, 403, 404, 409, 413, 422, 503))
    async def upload_report(study_id: str, report: Report, request: Request,
                            token: bytes | None = Depends(upload_allowed)) -> Response:
        """Upload one report's share with its proof; acknowledged once it is durable.
        (A well-formed upload is answered by the same functions before it reaches this route:
        services/uploads.py.)"""
        record, ids, shares = checked_report(store, settings.server_id, study_id, report)
        result = await stored_report(store, metrics, study_id, record, ids, shares, token)
        await hold_route_answer(gate, request.scope, result)
        return json_response(result)

    @app.post("/v1/studies/{study_id}/batches", response_model=UploadResult, tags=["reports"],
              responses=problem_responses(400, 401, 403, 404, 409, 413, 415, 422, 503),
              openapi_extra={"requestBody": {
                  "required": True,
                  "description": f"{SHARES_MEDIA_TYPE}: m records of a 16-byte report id, the "
                                 f"16 N-byte proof binding the share to the id (docs/protocol.md "
                                 f"section 4a) and width little-endian uint64 (the share); or "
                                 f"{SEEDS_MEDIA_TYPE}: m records of id, proof and a 32-byte seed, "
                                 f"which the server expands to the share (ChaCha20, section 4); or "
                                 f"{SEALED_MEDIA_TYPE}: m records of a proof and a share or seed "
                                 f"sealed to this server with HPKE (section 7a: one version 4 "
                                 f"batch, one HPKE seal and one AEAD per batch, classical or "
                                 f"post-quantum, the only sealed layout; docs/sealing.md); or, for a study "
                                 f"with parties, {BLOCKS_MEDIA_TYPE}; party=NAME: m records of a "
                                 f"16-byte block id, 16-byte pseudonym, proof and the share of "
                                 f"the party's columns (section 2d), or its blocks sealed as "
                                 f"{SEALED_MEDIA_TYPE}; party=NAME (docs/sealing.md section 3a); a "
                                 f"study with parties and validity proofs takes each block's seed at a "
                                 f"helper as {BLOCK_SEEDS_MEDIA_TYPE}; party=NAME (section 4c); a study "
                                 f"with batch_proofs takes a batch proof's record, the leader's as "
                                 f"{proof_uploads.MEDIA_TYPES[0]}, a helper's as {proof_uploads.MEDIA_TYPES[1]} "
                                 f"(section 4d), or either sealed as {SEALED_MEDIA_TYPE} (content 0x05 or "
                                 f"0x06, docs/sealing.md section 3b)",
                  "content": {SHARES_MEDIA_TYPE: {"schema": BINARY_SCHEMA},
                              SEEDS_MEDIA_TYPE: {"schema": BINARY_SCHEMA},
                              SEALED_MEDIA_TYPE: {"schema": BINARY_SCHEMA},
                              BLOCKS_MEDIA_TYPE: {"schema": BINARY_SCHEMA},
                              BLOCK_SEEDS_MEDIA_TYPE: {"schema": BINARY_SCHEMA},
                              **{t: {"schema": BINARY_SCHEMA} for t in proof_uploads.MEDIA_TYPES}}}})
    async def upload_batch(study_id: str, request: Request,
                           token: bytes | None = Depends(upload_allowed)) -> Response:
        """Upload many reports at once, as full shares, as seeds (expanded to the same shares
        before anything else, so duplicates are judged on the share bytes) or sealed to this
        server with HPKE (opened first, then the same); all-or-nothing, acknowledged once durable."""
        media_type = require_media_type(request, SHARES_MEDIA_TYPE, SEEDS_MEDIA_TYPE, SEALED_MEDIA_TYPE,
                                        BLOCKS_MEDIA_TYPE, BLOCK_SEEDS_MEDIA_TYPE, *proof_uploads.MEDIA_TYPES)
        record = store.record(study_id)
        if not record.is_open:
            raise ProblemError("study-closed", f"study {study_id} is "
                               f"{'committed' if record.commit is not None else record.closure.reason}; "
                               f"it takes no more reports")
        if media_type in proof_uploads.MEDIA_TYPES:  # a batch proof (docs/protocol.md section 4d)
            body = await request.body()
            result = await proof_uploads.upload(store, record, settings.server_id, media_type, body, token)
            metrics.uploaded(study_id, result)
            await hold_route_answer(gate, request.scope, result)
            return json_response(result)
        content_type = request.headers.get("content-type", "")
        if media_type in (BLOCKS_MEDIA_TYPE, BLOCK_SEEDS_MEDIA_TYPE) or (media_type == SEALED_MEDIA_TYPE and (
                record.study.parties is not None or party_of_media_type(content_type) is not None)):
            granted = record.upload_tokens.get(token) if token is not None else None
            party = _block_party(record.study, content_type, granted.party if granted is not None else None)
            if media_type == BLOCK_SEEDS_MEDIA_TYPE and not proved_shares.is_proved(record.study):
                raise ProblemError("unsupported-media-type", f"study {study_id} has no validity proofs: its "
                                   f"parties upload {BLOCKS_MEDIA_TYPE}; party=NAME batches, not block seeds")
            body = await request.body()
            sealed = media_type == SEALED_MEDIA_TYPE
            header = (await run_in_threadpool(sealed_precheck, store, record, body, token, party)
                      if sealed else None)  # parsed once: the opening below reuses it
            upload, kept = await run_in_threadpool(_parse_blocks, body, record.study, party, settings.server_id,
                                                   store.keys if sealed else None,
                                                   media_type == BLOCK_SEEDS_MEDIA_TYPE, header)
            result = await asyncio.wrap_future(store.submit_upload(
                record, upload.ids, kept, None, None, token, upload.pseudonyms, party))
            metrics.uploaded(study_id, result)
            await hold_route_answer(gate, request.scope, result)
            return json_response(result)
        if record.study.parties is not None:
            raise ProblemError("unsupported-media-type", f"study {study_id} has parties: each uploads "
                               f"its blocks as {BLOCKS_MEDIA_TYPE}; party=NAME or {SEALED_MEDIA_TYPE}; "
                               f"party=NAME batches")
        body = await request.body()
        if media_type == SEALED_MEDIA_TYPE and proof_uploads.is_sealed_record(record, body):
            # a batch proof's record sealed (content 0x05 or 0x06, docs/sealing.md section 3b)
            result = await proof_uploads.upload(store, record, settings.server_id, media_type, body, token,
                                                store.keys)
            metrics.uploaded(study_id, result)
            await hold_route_answer(gate, request.scope, result)
            return json_response(result)
        header = (await run_in_threadpool(sealed_precheck, store, record, body, token)
                  if media_type == SEALED_MEDIA_TYPE else None)  # parsed once: the opening reuses it
        ids, shares, rows, signs, sorted_ids, seeds, addends = await run_in_threadpool(
            parse_batch, body, record.study, media_type, settings.server_id, store.keys, header=header)
        result = await asyncio.wrap_future(store.submit_upload(record, ids, shares, rows, signs, token,
                                                               sorted_ids=sorted_ids, seeds=seeds,
                                                               addends=addends))
        metrics.uploaded(study_id, result)
        await hold_route_answer(gate, request.scope, result)
        return json_response(result)

    @app.post("/v1/studies/{study_id}/relayed", response_model=RelayedResults, tags=["reports"],
              responses=problem_responses(400, 403, 404, 409, 413, 415, 503),
              openapi_extra={"requestBody": {
                  "required": True,
                  "description": f"{relayed.MEDIA_TYPE}: a bundle of entries, each one device's "
                                 f"version 4 sealed batch for this server with its upload token's id "
                                 f"and MAC (docs/protocol.md section 7b); sent by a relay "
                                 f"(dpsketch relay) for many devices at once",
                  "content": {relayed.MEDIA_TYPE: {"schema": BINARY_SCHEMA}}}})
    async def upload_relayed(study_id: str, request: Request) -> Response:
        """Many devices' sealed batches in one request (a relay's bundle). No bearer token: each
        entry carries its own upload token's id and a MAC only that token's holder can make.
        Each entry gets its own outcome, in order (200 with the results, whatever they are);
        a body that is not a bundle is refused whole."""
        if not settings.relayed_uploads:
            raise ProblemError("forbidden", f"server {settings.server_id} takes no relayed uploads "
                               f"(--relayed-uploads off): send each batch to it directly")
        require_media_type(request, relayed.MEDIA_TYPE)
        record = store.record(study_id)
        if not record.is_open:
            raise ProblemError("study-closed", f"study {study_id} is "
                               f"{'committed' if record.commit is not None else record.closure.reason}; "
                               f"it takes no more reports")
        body = await request.body()
        results, total = await relayed_uploads.upload(store, metrics, record, settings.server_id, body)
        await hold_route_answer(gate, request.scope, total)
        return json_response(results)

    @app.get("/v1/studies/{study_id}/report-ids", tags=["finalization"], dependencies=[analyst],
             response_class=Response,
             responses={200: _binary_response(REPORT_IDS_MEDIA_TYPE, "sorted 16-byte report ids"),
                        **problem_responses(*auth_errors, 404, 503)})
    async def report_ids(study_id: str) -> Response:
        """The ids of every report this server holds for the study (analyst)."""
        chunks = await run_in_threadpool(store.report_ids, study_id)
        return StreamingResponse(iterate_in_threadpool(chunks), media_type=REPORT_IDS_MEDIA_TYPE)

    @app.get("/v1/studies/{study_id}/blocks", tags=["finalization"], dependencies=[analyst],
             response_class=Response,
             responses={200: _binary_response(BLOCK_INDEX_MEDIA_TYPE, "33-byte records: block id, "
                                              "pseudonym, party index; by block id"),
                        **problem_responses(*auth_errors, 404, 422, 503)})
    async def blocks(study_id: str) -> Response:
        """A study with parties: every block this server holds, by id, with its individual's
        pseudonym and its party (analyst); never a share."""
        body = await run_in_threadpool(store.block_index, study_id)
        return Response(body, media_type=BLOCK_INDEX_MEDIA_TYPE)

    @app.post("/v1/studies/{study_id}/commit", response_model=CommitResult, tags=["finalization"],
              dependencies=[analyst],
              responses=problem_responses(400, *auth_errors, 404, 409, 413, 415, 422, 503),
              openapi_extra={"requestBody": {
                  "required": True,
                  "description": f"the inclusion set: {inclusion.MEDIA_TYPE} (a bit per id this "
                                 f"server holds, in its sorted order, after the held count and the "
                                 f"inclusion hash: docs/protocol.md section 7) or "
                                 f"{REPORT_IDS_MEDIA_TYPE} (16-byte ids in ascending order, at most "
                                 f"the server's general body limit)",
                  "content": {inclusion.MEDIA_TYPE: {"schema": BINARY_SCHEMA},
                              REPORT_IDS_MEDIA_TYPE: {"schema": BINARY_SCHEMA}}}})
    async def commit(study_id: str, request: Request) -> CommitResult:
        """Commit the study to one inclusion set, after the certificate (analyst). The body's
        size is bounded (commit_body_limit) and the memory working on it is reserved against
        the memory budget before a byte is read (409 capacity-exceeded if it does not fit)."""
        media_type = require_media_type(request, inclusion.MEDIA_TYPE, REPORT_IDS_MEDIA_TYPE)
        record = store.record(study_id)
        held = store.held(record)
        limit = commit_body_limit(held, media_type, settings)
        declared = request.headers.get("content-length", "")
        size = min(int(declared), limit) if declared.isdigit() else limit
        with store.reserve(commit_memory(held, size, media_type), "this commit"):
            body = await errors.read_within(request, limit, "the largest inclusion set this server reads "
                                            "in this form (a bitmap: one bit per held report)")
            with metrics.timed(metrics.commit_seconds):
                return await run_in_threadpool(store.commit, study_id, body, media_type == inclusion.MEDIA_TYPE)

    @app.get("/v1/studies/{study_id}/aggregate", tags=["finalization"], dependencies=[analyst],
             response_class=Response,
             responses={200: _binary_response(
                 AGGREGATE_MEDIA_TYPE, "k x d little-endian uint64, row-major",
                 {INCLUSION_HASH_HEADER: {"schema": {"type": "string"},
                                          "description": "SHA-256 of the sorted inclusion set"}}),
                 **problem_responses(*auth_errors, 404, 409, 503)})
    async def aggregate(study_id: str) -> Response:
        """The released aggregate share: only after commit, identical on every call (analyst)."""
        with metrics.timed(metrics.aggregate_seconds):
            body, ihash = await run_in_threadpool(store.aggregate, study_id)
        return Response(body, media_type=AGGREGATE_MEDIA_TYPE, headers={INCLUSION_HASH_HEADER: ihash})

    # a validity study's verification round (docs/protocol.md section 6d)
    verify_api.add_routes(app, store, settings, analyst, auth_errors)
    return app
