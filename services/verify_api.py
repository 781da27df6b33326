"""The HTTP routes of a validity study's verification round (docs/protocol.md section 6d): thin
handlers over services/verification.py, each with the analyst token, as the commit's.

Why the analyst's token: the round is part of finalization, which the analyst drives; a server
decides every report for itself whatever the analyst sends (a lying analyst can make it refuse
honest reports, which the batch rule bounds, never make it accept an invalid one into a release
of honest servers' shares that the analyst does not control)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import iterate_in_threadpool

from dpsketch import problem_http as errors
from dpsketch.problem_http import problem_responses, summarize_errors
from dpsketch.protocol import validity
from dpsketch.protocol.messages import REPORT_IDS_MEDIA_TYPE
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.sketch import REPORT_ID_BYTES
from dpsketch.protocol.verification import (
    DECIDED_HEADER,
    QUERY_SEED_HEADER,
    REFUSED_HEADER,
    VERIFIERS_MEDIA_TYPE,
    Commitment,
    Contribution,
    QueryRequest,
    RevealRequest,
)

from .settings import Settings
from .store import Store

_BINARY = {"type": "string", "format": "binary"}


def decide_body_limit(held: int, verifier_len: int) -> int:
    """The largest decision a server reads: a verifier message over every report it holds
    (16 + 16 V bytes a report, after the 4-byte count), whatever the general body limit; a study
    with batch_proofs adds its batch section over every held batch (Rounds.batch_section_limit)."""
    return 4 + held * (REPORT_ID_BYTES + 16 * verifier_len)


def decide_memory(body_bytes: int, held: int) -> int:
    """What a decision holds beyond the body while it is worked on: the decoded shares (a view
    of the body), the ids' halves and rowids (about 40 bytes a report), one chunk's payloads and
    verifier shares (services/verification.py CHUNK_BYTES, a few times over)."""
    return body_bytes + 40 * held + (128 << 20)


class _ClosingStream(StreamingResponse):
    """A streamed answer whose generator is closed when the response ends, however it ends: a
    client that leaves mid-answer stops the stream with an exception and the generator would
    otherwise wait for the garbage collector, keeping the query's half-written cache file
    (services/verify_cache.py) on disk until then."""

    def __init__(self, chunks: Iterator[bytes], **kw: Any):
        super().__init__(iterate_in_threadpool(chunks), **kw)
        self._chunks = chunks

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await run_in_threadpool(self._close)

    def _close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            try:
                close()
            except ValueError:  # still running in a worker thread: it ends on its own
                pass


def _json(model_type: Any, body: bytes) -> Any:
    try:
        return model_type.model_validate_json(body or b"{}")
    except ValidationError as exc:
        raise ProblemError("invalid-request", summarize_errors(exc.errors())) from None


def add_routes(app: FastAPI, store: Store, settings: Settings, analyst: Any, auth_errors: tuple[int, ...]) -> None:
    """The four routes of the round, on ``app``."""
    rounds = store.verification
    tags = ["verification"]

    @app.post("/v1/studies/{study_id}/verify/commit", response_model=Commitment, tags=tags,
              dependencies=[analyst], responses=problem_responses(*auth_errors, 404, 409, 422, 503))
    async def verify_commit(study_id: str) -> Commitment:
        """Close a validity study to uploads and commit to this server's contribution to the
        query seed (stored before the answer; the same commitment on every repeat)."""
        record = store.record(study_id)
        return await run_in_threadpool(rounds.commit, record)

    @app.post("/v1/studies/{study_id}/verify/reveal", response_model=Contribution, tags=tags,
              dependencies=[analyst], responses=problem_responses(400, *auth_errors, 404, 409, 422, 503))
    async def verify_reveal(study_id: str, request: Request) -> Contribution:
        """Store every server's commitment (once) and reveal this server's contribution."""
        record = store.record(study_id)
        ask = _json(RevealRequest, await request.body())
        return await run_in_threadpool(rounds.reveal, record, ask.as_bytes())

    @app.post("/v1/studies/{study_id}/verify/query", tags=tags, dependencies=[analyst],
              response_class=Response,
              responses={200: {"description": "the verifier share of every report held, by id",
                               "content": {VERIFIERS_MEDIA_TYPE: {"schema": _BINARY}}},
                         **problem_responses(400, *auth_errors, 404, 409, 422, 503)})
    async def verify_query(study_id: str, request: Request) -> Response:
        """Fix the query seed from every server's contribution and answer this server's
        verifier share of every report it holds (streamed, computed a chunk at a time)."""
        record = store.record(study_id)
        ask = _json(QueryRequest, await request.body())
        count, seed, chunks = await run_in_threadpool(rounds.query, record, ask.as_bytes())
        return _ClosingStream(chunks, media_type=VERIFIERS_MEDIA_TYPE,
                              headers={QUERY_SEED_HEADER: seed.hex(), DECIDED_HEADER: str(count)})

    @app.post("/v1/studies/{study_id}/verify/decide", tags=tags, dependencies=[analyst],
              response_class=Response,
              responses={200: {"description": "the refused report ids (sorted); counts in headers",
                               "content": {REPORT_IDS_MEDIA_TYPE: {"schema": _BINARY}}},
                         **problem_responses(400, *auth_errors, 404, 409, 413, 415, 422, 503)},
              openapi_extra={"requestBody": {
                  "required": True,
                  "description": "the sum of the other servers' verifier shares of the reports to "
                                 "decide (sorted ids), in the verifier message format",
                  "content": {VERIFIERS_MEDIA_TYPE: {"schema": _BINARY}}}})
    async def verify_decide(study_id: str, request: Request) -> Response:
        """Add this server's verifier shares to the others' sum, decide every report named,
        store the refused ones (a commit then leaves them out) and answer them."""
        given = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if given != VERIFIERS_MEDIA_TYPE:
            raise ProblemError("unsupported-media-type", f"this endpoint takes Content-Type "
                               f"{VERIFIERS_MEDIA_TYPE}, got {given[:100] or 'none'!r}")
        record = store.record(study_id)
        if record.study.validity is None:
            raise ProblemError("invalid-request", f"study {study_id} has no validity proofs: it has no "
                               f"verification round")
        held = store.held(record)
        limit = decide_body_limit(held, validity.verifier_len(record.study))
        limit += await run_in_threadpool(rounds.batch_section_limit, record)  # batch_proofs: every held batch
        with store.reserve(decide_memory(limit, held), "this decision"):
            body = await errors.read_within(request, limit, "a verifier message over every report this "
                                            "server holds")
            decision = await run_in_threadpool(rounds.decide, record, body)
        return Response(decision.refused, media_type=REPORT_IDS_MEDIA_TYPE,
                        headers={DECIDED_HEADER: str(decision.decided), REFUSED_HEADER: str(decision.n_refused)})
