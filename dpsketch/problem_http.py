"""FastAPI glue for the error catalogue: every error of every dpsketch service is problem JSON.

Installs handlers for :class:`ProblemError`, request validation errors, Starlette's own
404/405/413, and anything unexpected (logged, answered as a 500 problem without internals).
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dpsketch.protocol.messages import PROBLEM_MEDIA_TYPE, Problem
from dpsketch.protocol.problems import ProblemError

log = logging.getLogger("dpsketch")

_STATUS_SLUGS = {
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

#: For the OpenAPI document: every route may answer these with a Problem body.
PROBLEM_RESPONSES = {
    status: {"model": Problem, "content": {PROBLEM_MEDIA_TYPE: {}}}
    for status in (400, 401, 403, 404, 409, 413, 415, 422, 503)
}


def problem_response(error: ProblemError, request: Request | None = None) -> JSONResponse:
    return JSONResponse(
        error.body(instance=str(request.url.path) if request else None),
        status_code=error.status,
        headers=error.headers,
        media_type=PROBLEM_MEDIA_TYPE,
    )


def _validation_detail(exc: RequestValidationError) -> tuple[str, str]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return "malformed-body", "the body is not valid JSON"
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "invalid-request", "; ".join(parts) or "invalid request"


def install(app: FastAPI) -> None:
    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError):
        return problem_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        slug, detail = _validation_detail(exc)
        return problem_response(ProblemError(slug, detail), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        slug = _STATUS_SLUGS.get(exc.status_code, "invalid-request" if exc.status_code < 500 else "internal-error")
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return problem_response(ProblemError(slug, detail, status=exc.status_code,
                                             headers=dict(exc.headers or {})), request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return problem_response(ProblemError("internal-error", "unexpected server error; see the server log"), request)
