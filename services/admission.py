"""Admission control for uploads: refuse early (503 + Retry-After) rather than queue without bound.

Why here and not only in the writer: the writer refuses once ``max_queued_jobs`` requests or
``max_queued_bytes`` share bytes wait for it, but by then every request has been parsed, its
bindings checked and its ids hashed, and everything read waits in memory. Under an offered load
above capacity requests pile up *before* the writer (parse jobs waiting for a worker thread, the
event loop and the worker threads competing for the GIL), so latency grows with the backlog and
memory with the bodies. This pure ASGI middleware admits an upload once its body has arrived
and refuses it, before any parsing, when either limit would be passed:

* ``max_requests`` uploads being worked on (``$DPSKETCH_MAX_INFLIGHT_UPLOADS``, default 64:
  measured at twice capacity, 16 left a third of the capacity unused and 128 let p99 reach
  3 s, 64 kept accepted throughput at capacity with p99 under 1 s; docs/operations.md);
* ``max_bytes`` of their bodies (``$DPSKETCH_MAX_INFLIGHT_UPLOAD_BYTES``, default 128 MiB: two
  of the largest bodies). One upload is always admitted when none is being worked on, whatever
  its size (the body limit bounds it).

Why at the end of the body and not at the request head: a slot taken at the head would be held
by a client that sends its body slowly (up to --body-timeout), so 64 slow connections could shut
every other client out; slow and excess connections are the connection guard's business
(dpsketch/serving.py). The body is read here, through the body limit (413 past it), and handed
on to the app unchanged.

0 disables a limit. A refused client gets ``503 unavailable`` problem JSON with ``Retry-After``
(the SDK waits that long before retrying, client_sdk/client.py); nothing of the request was
parsed or stored, and a retry is safe (uploads are idempotent by report id). Only uploads are
limited: health, metrics, reads and the analyst's commit stay answerable under an upload flood.
The limits come from the environment; `dpsketch server --max-inflight-uploads` and
`--max-inflight-upload-bytes` set the same variables before the app starts (a flag wins over the
environment). docs/operations.md explains how to size them.
"""

from __future__ import annotations

import os
import re

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dpsketch.problem_http import send_problem
from dpsketch.protocol.problems import ProblemError

DEFAULT_MAX_REQUESTS = 64
DEFAULT_MAX_BYTES = 128 << 20
RETRY_AFTER_S = 1
#: Where a refusal leaves its route template (dpsketch.observability.route_template reads it).
ROUTE_KEY = "dpsketch.route"
#: Set by a layer outside that admitted the upload itself and hands it on (services/uploads.py
#: FastReports: it holds the upload's place in the counts until the answer): not counted again.
ADMITTED_KEY = "dpsketch.admitted"
#: The body size of an upload admitted by one of these layers (services/resend_gate.py moves it
#: out of the counts while the upload's answer is held).
ADMITTED_BYTES_KEY = "dpsketch.admitted_bytes"

_UPLOAD_PATH = re.compile(r"^/v1/studies/(?P<study_id>[^/]+)/(?P<kind>reports|batches|relayed)$")


def env_limit(name: str, default, kind=int):
    """A limit from the environment (unset or empty: ``default``), a whole number unless ``kind``
    is float, never negative (0 switches it off); ValueError naming the variable. The upload
    admission's and the re-send gate's variables (services/resend_gate.py)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        n = kind(value)
    except ValueError:
        raise ValueError(f"${name} = {value!r} is not a {'whole ' if kind is int else ''}number") from None
    if n < 0:
        raise ValueError(f"${name} must be >= 0 (0 switches it off)")
    return n


async def read_size(receive: Receive, first: Message | None = None) -> tuple[list[Message], int, bool]:
    """Receive a request's whole body: (the messages as they came, body bytes, whether the
    client went away first). The messages are kept, not joined: :func:`replaying` hands them on
    without a copy of the body. ``first``: a message the caller received already."""
    messages: list[Message] = []
    size = 0
    while True:
        message, first = (await receive() if first is None else first), None
        messages.append(message)
        if message["type"] != "http.request":  # the client went away: the app says so
            return messages, size, True
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return messages, size, False


async def read_body(receive: Receive) -> tuple[list[Message], bytes, bool]:
    """As :func:`read_size`, with the body's bytes (one chunk is not copied)."""
    first = await receive()
    if first["type"] == "http.request" and not first.get("more_body", False):  # the whole body at once
        return [first], first.get("body", b""), False
    messages, _, gone = await read_size(receive, first)
    chunks = [m.get("body", b"") for m in messages if m["type"] == "http.request"]
    return messages, chunks[0] if len(chunks) == 1 else b"".join(chunks), gone


def replaying(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that hands on ``messages`` first, then whatever ``receive`` brings."""
    pending = iter(messages)

    async def replay() -> Message:
        message = next(pending, None)
        return message if message is not None else await receive()

    return replay


class Admission:
    """The limits and the live counts of uploads being worked on (one per app; the middleware
    below updates it, readiness and the metrics read it)."""

    def __init__(self, max_requests: int = DEFAULT_MAX_REQUESTS, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0  # uploads admitted and not yet answered
        self.bytes = 0  # their body bytes
        self.refused = 0  # since start

    @classmethod
    def from_env(cls) -> "Admission":
        return cls(env_limit("DPSKETCH_MAX_INFLIGHT_UPLOADS", DEFAULT_MAX_REQUESTS),
                   env_limit("DPSKETCH_MAX_INFLIGHT_UPLOAD_BYTES", DEFAULT_MAX_BYTES))

    def admits(self, size: int) -> bool:
        if self.max_requests and self.requests >= self.max_requests:
            return False
        return not (self.max_bytes and self.requests and self.bytes + size > self.max_bytes)

    def saturated(self) -> bool:
        """At a limit now: the next upload would be refused (readiness says so)."""
        return bool((self.max_requests and self.requests >= self.max_requests)
                    or (self.max_bytes and self.requests and self.bytes >= self.max_bytes))


class UploadAdmission:
    """Pure ASGI middleware, inside the body limit: the upload limits (module docstring)."""

    def __init__(self, app: ASGIApp, admission: Admission):
        self.app = app
        self.state = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _UPLOAD_PATH.fullmatch(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope.get("method") != "POST" or scope.get(ADMITTED_KEY):
            await self.app(scope, receive, send)
            return
        try:
            messages, size, gone = await read_size(receive)
        except StarletteHTTPException as exc:  # the body limit, counting a streamed body
            self._name_route(scope, match)
            await send_problem(scope, send, ProblemError("payload-too-large", str(exc.detail)))
            return
        st = self.state
        if not gone and not st.admits(size):
            st.refused += 1
            self._name_route(scope, match)
            await send_problem(scope, send, ProblemError(
                "unavailable", f"the server is at its limit of uploads being worked on ({st.max_requests} "
                f"requests, {st.max_bytes} bytes); retry after {RETRY_AFTER_S} s (nothing of this request "
                f"was parsed or stored)", headers={"Retry-After": str(RETRY_AFTER_S)}))
            return
        admitted = not gone
        if admitted:
            # one event loop runs every request: nothing runs between the check and the update
            st.requests += 1
            st.bytes += size
            scope[ADMITTED_BYTES_KEY] = size
        try:
            await self.app(scope, replaying(messages, receive), send)
        finally:
            if admitted:
                st.requests -= 1
                st.bytes -= size

    @staticmethod
    def _name_route(scope: Scope, match: re.Match) -> None:
        """Answered before routing: name the route for the metrics middleware outside."""
        scope[ROUTE_KEY] = "/v1/studies/{study_id}/" + match["kind"]
        scope.setdefault("path_params", {"study_id": match["study_id"]})


