"""Every error of every dpsketch service as RFC 9457 problem JSON with a documented slug (docs/protocol.md section 8).

FastAPI's own errors (validation, unknown path, wrong method, unparsable body) and anything
unexpected are translated here, so a client never sees FastAPI's default ``{"detail": ...}``
shape or an HTML page. :class:`BodyLimit` refuses oversized bodies before they are read: by
Content-Length when declared, and by counting streamed bytes otherwise.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dpsketch.protocol.messages import PROBLEM_MEDIA_TYPE, Problem
from dpsketch.protocol.problems import CATALOGUE, ProblemError, summarize_errors  # noqa: F401 (re-exported for services)

log = logging.getLogger("dpsketch")

#: Status codes FastAPI/Starlette raise by themselves, and the slug that names each.
SLUG_BY_STATUS = {
    400: "malformed-body",
    401: "unauthorized",
    403: "forbidden",
    404: "not-found",
    405: "method-not-allowed",
    413: "payload-too-large",
    415: "unsupported-media-type",
    422: "invalid-request",
    503: "unavailable",
}


def problem_response(err: ProblemError, request: Request | None = None) -> JSONResponse:
    instance = request.url.path if request is not None else None
    return JSONResponse(err.body(instance), status_code=err.status, headers=err.headers or None,
                        media_type=PROBLEM_MEDIA_TYPE)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into problem JSON."""

    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError) -> JSONResponse:
        return problem_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            err = ProblemError("malformed-body", "the body is not valid JSON")
        else:
            err = ProblemError("invalid-request", summarize_errors(errors))
        return problem_response(err, request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        slug = SLUG_BY_STATUS.get(exc.status_code)
        if slug is None:
            slug = "invalid-request" if exc.status_code < 500 else "unavailable"
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no resource at {request.url.path[:200]}"
        elif exc.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path[:200]}"
        err = ProblemError(slug, detail, status=exc.status_code, headers=dict(exc.headers or {}))
        return problem_response(err, request)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client went away mid-body (or a slow one was cut by the read deadline,
        # dpsketch/serving.py): routine, nothing was stored, and nobody reads this answer.
        log.info("client disconnected before the body of %s %s was complete", request.method,
                 request.url.path[:200])
        return problem_response(ProblemError("malformed-body", "the request body was cut short"), request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return problem_response(ProblemError("internal-error", "unexpected server error"), request)


class BodyLimit:
    """Pure ASGI middleware: 413 for bodies over ``limit`` bytes, checked before reading.
    ``exempt(scope)``: requests whose route applies a limit of its own (read_within) instead."""

    def __init__(self, app: ASGIApp, limit: int, exempt: Callable[[Scope], bool] | None = None):
        self.app = app
        self.limit = limit
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.exempt is not None and self.exempt(scope)):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.limit:
                    await self._refuse(scope, send, declared)
                    return
        received = 0
        limit = self.limit

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Raised inside the endpoint's body read; the HTTPException handler answers.
                    raise StarletteHTTPException(413, f"the request body exceeds {limit} bytes")
            return message

        await self.app(scope, limited, send)

    async def _refuse(self, scope: Scope, send: Send, declared: int) -> None:
        await send_problem(scope, send, ProblemError(
            "payload-too-large",
            f"the request body ({declared} bytes) exceeds this server's limit of {self.limit} bytes"), close=True)


async def send_problem(scope: Scope, send: Send, err: ProblemError, close: bool = False) -> None:
    """Answer ``err`` as problem JSON with plain ASGI messages, for the layers that answer before
    FastAPI (and its exception handlers) sees the request. ``close``: ask the server to close the
    connection afterwards (the request's body was not read, so the connection cannot be reused)."""
    body = json.dumps(err.body(scope.get("path"))).encode()
    headers = [(b"content-type", PROBLEM_MEDIA_TYPE.encode()), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in (err.headers or {}).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_within(request: Request, limit: int, what: str) -> bytes:
    """The request's body, refused with 413 ``payload-too-large`` once it is over ``limit`` bytes:
    by its Content-Length before anything is read, else while it streams in (for a route that
    :class:`BodyLimit` exempts, whose limit depends on what the request is for)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProblemError("payload-too-large", f"the request body ({declared} bytes) exceeds {what}: {limit} bytes")
    chunks, received = [], 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise ProblemError("payload-too-large", f"the request body exceeds {what}: {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


PROBLEM_SCHEMA = Problem.model_json_schema()


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the problem statuses an endpoint can answer."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        slugs = [slug for slug, (st, _title) in CATALOGUE.items() if st == status]
        out[status] = {
            "description": "Problem: " + ", ".join(slugs),
            "content": {PROBLEM_MEDIA_TYPE: {"schema": PROBLEM_SCHEMA}},
        }
    return out


def cors_middleware(service: str = "server", setting: str = "$DPSKETCH_CORS_ORIGINS"):
    """Starlette's CORS middleware, answering a refused preflight in the problem format (403
    origin-not-allowed) instead of its plain-text 400: what a browser page may call is a
    ``service`` setting (services/settings.py ``cors_origins``, the relay's ``--cors-origins``),
    and a refusal says which ``setting``."""
    from starlette.datastructures import Headers
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import Response

    class ProblemCORS(CORSMiddleware):
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            # a POST without Origin (every device that is no browser: the upload and relay hot
            # paths) goes straight through: Starlette's own layer wraps its send to add "Vary:
            # Origin" to every answer, 16 us of a relay's device request. A POST's answer is
            # stored by no cache, so it needs no Vary; a GET's still gets it (below)
            if scope["type"] == "http" and scope["method"] == "POST" and not any(
                    name == b"origin" for name, _ in scope["headers"]):
                await self.app(scope, receive, send)
                return
            await super().__call__(scope, receive, send)

        def preflight_response(self, request_headers: Headers) -> Response:
            response = super().preflight_response(request_headers)
            if response.status_code < 400:
                return response
            origin = request_headers.get("origin", "")
            err = ProblemError("origin-not-allowed",
                               f"a preflight from {origin[:100]!r} (or for a method or header this {service} "
                               f"does not take from pages): the {service}'s operator lists the allowed "
                               f"origins ({setting})")
            return problem_response(err)

    return ProblemCORS
