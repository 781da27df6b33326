"""What both services share for being watched: HTTP metrics, the /metrics answer, readiness checks.

Why one module for both: the share server and the analyzer must name their HTTP metrics alike
(an operator's dashboards and alerts then work for either job), label them by route *template*
(``/v1/studies/{study_id}/batches``, never the raw path: a client choosing paths must not be able
to create unbounded label values) and count refusals by the problem ``type`` each answer carries
(docs/protocol.md section 8), whatever raised it: a handler, FastAPI's validation, or a pure ASGI
middleware such as the body limit, which answers before any handler runs. So the counting is a
pure ASGI middleware outermost in each app, which sees every answer as it goes out.

Every app gets its own ``CollectorRegistry`` (tests run several apps in one process; the global
default registry would mix them and refuse the second registration of a name).
The service-specific metrics live next to the service (services/metrics.py for the share server);
docs/operations.md lists every metric with its labels.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dpsketch.protocol.messages import PROBLEM_MEDIA_TYPE
from dpsketch.protocol.problems import PREFIX

#: Latency buckets (seconds): single uploads answer in milliseconds, a 10k-row batch in about
#: 0.1 s, a commit over 10^6 reports in seconds; overload shows up as the tail past 1 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: The route label of a request that matched no route (404 on an unknown path): one value for
#: all of them, so that scanning random paths adds no series.
UNMATCHED = "unmatched"

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
_PROBLEM_TYPE = PROBLEM_MEDIA_TYPE.encode()
_MAX_PROBLEM_BYTES = 64 << 10  # problem JSON is small; never buffer more than this of an answer


def route_template(scope: Scope) -> str:
    """The path template of the route that served the request (FastAPI puts the matched route
    in the scope), or :data:`UNMATCHED`."""
    route = scope.get("route")
    path = getattr(route, "path", None) or scope.get("dpsketch.route")  # set by a middleware that refused
    return path if isinstance(path, str) else UNMATCHED


def problem_slug(body: bytes) -> str:
    """The slug of a problem JSON answer's ``type`` (``urn:dpsketch:problem:<slug>``)."""
    try:
        t = str(json.loads(body).get("type", ""))
    except (ValueError, AttributeError):
        return "unparsable"
    return t[len(PREFIX):] if t.startswith(PREFIX) else "other"


class Children:
    """A labelled metric's children by their label values, each made once: prometheus_client's
    ``labels()`` checks and locks on every call, which cost a tenth of the server's work for a
    single upload (the series are the same objects ``labels()`` returns)."""

    __slots__ = ("metric", "made")

    def __init__(self, metric: Any):
        self.metric = metric
        self.made: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self.made.get(values)
        if child is None:
            child = self.made[values] = self.metric.labels(*values)
        return child


class _Count:
    """A counter child's increments made on one thread, not yet added to it."""

    __slots__ = ("child", "total", "flushed")

    def __init__(self, child: Any):
        self.child, self.total, self.flushed = child, 0, 0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:  # as prometheus_client refuses it, at once
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.total += amount

    def flush(self) -> None:
        total = self.total  # the owning thread may add meanwhile: that goes in the next flush
        if total != self.flushed:
            self.child.inc(total - self.flushed)
            self.flushed = total


class _Observations:
    """A histogram child's observations made on one thread, not yet added to it: per bucket
    (the first upper bound >= the value, as prometheus_client counts) and their sum."""

    __slots__ = ("child", "bounds", "counts", "flushed", "sum", "sum_flushed")

    def __init__(self, child: Any):
        self.child = child
        self.bounds = list(child._upper_bounds)  # ends with +Inf
        self.counts = [0] * len(self.bounds)
        self.flushed = [0] * len(self.bounds)
        self.sum = self.sum_flushed = 0.0

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.counts[bisect_left(self.bounds, amount)] += 1

    def flush(self) -> None:
        for i, count in enumerate(self.counts):
            if count != self.flushed[i]:
                self.child._buckets[i].inc(count - self.flushed[i])
                self.flushed[i] = count
        total = self.sum
        if total != self.sum_flushed:
            self.child._sum.inc(total - self.sum_flushed)
            self.sum_flushed = total


class Tally:
    """Counter increments and histogram observations kept as plain numbers, one cell per
    thread and series, and added to the prometheus series when the registry is collected.

    Why: each update of a prometheus_client series takes a lock, and a single upload made
    about nine of them on the event loop's thread, the server's limit (docs/operations.md,
    "Single uploads"). Here an update is an addition to a cell only its own thread writes;
    :meth:`collect` (registered in the registry before any series it feeds, so every scrape
    and ``get_sample_value`` runs it first) adds what each cell gained since the last
    collection to its series, under a lock of its own. A scrape therefore sees every update
    made before it began, as before; an update racing with a scrape shows in the next one.
    """

    def __init__(self, registry: CollectorRegistry):
        self._local = threading.local()
        self._cells: list[Any] = []
        self._lock = threading.Lock()
        registry.register(self)

    def describe(self) -> list:
        return []  # no series of its own

    def collect(self) -> list:
        self.flush()
        return []

    def flush(self) -> None:
        with self._lock:
            for cell in self._cells:
                cell.flush()

    def counter(self, metric: Any) -> Callable[..., _Count]:
        """``f(*label_values)``: the calling thread's cell of that child of ``metric`` (a
        labelled Counter), with ``inc(amount=1)``."""
        return self._children(metric, _Count)

    def histogram(self, metric: Any) -> Callable[..., Any]:
        """As :meth:`counter`, for a labelled Histogram: cells with ``observe(amount)`` (the
        child itself, should prometheus_client not keep buckets the way _Observations adds to)."""
        return self._children(metric, _Observations)

    def _children(self, metric: Any, kind: type) -> Callable[..., Any]:
        children = Children(metric)
        local = self._local
        key = id(metric)

        def cell(*values: str) -> Any:
            try:
                mine = local.cells
            except AttributeError:
                mine = local.cells = {}
            found = mine.get((key, values))
            if found is None:
                found = mine[(key, values)] = self._new(kind, children(*values))
            return found

        return cell

    def _new(self, kind: type, child: Any) -> Any:
        if kind is _Observations and not all(hasattr(child, a) for a in ("_upper_bounds", "_buckets", "_sum")):
            return child  # pragma: no cover - another prometheus_client: update the child directly
        made = kind(child)
        with self._lock:
            self._cells.append(made)
        return made


class HttpMetrics:
    """The HTTP metrics every dpsketch service exports (same names in both jobs)."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.tally = Tally(registry)  # first in the registry: flushed before the series it feeds
        self.duration = Histogram(
            "dpsketch_http_request_duration_seconds",
            "Time from the request head to the end of the answer, by route template and method",
            ["route", "method"], buckets=LATENCY_BUCKETS, registry=registry)
        self.requests = Counter(
            "dpsketch_http_requests_total", "Requests answered, by route template, method and status",
            ["route", "method", "status"], registry=registry)
        self.problems = Counter(
            "dpsketch_http_problems_total",
            "Problem JSON answers (refusals and errors), by route template and problem type slug "
            "(the answer's type is urn:dpsketch:problem:<type>)",
            ["route", "type"], registry=registry)
        self.in_flight = Gauge(
            "dpsketch_http_requests_in_flight", "Requests being worked on now (head received, answer "
            "not yet complete)", registry=registry)
        self.in_flight_now = 0  # updated on the event loop only; the gauge reads it when scraped
        self.in_flight.set_function(lambda: self.in_flight_now)
        self.received = Counter(
            "dpsketch_http_request_body_bytes_total", "Request body bytes received, by route template",
            ["route"], registry=registry)
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, open fds, CPU seconds
        t = self.tally
        self.duration_of, self.requests_of = t.histogram(self.duration), t.counter(self.requests)
        self.problems_of, self.received_of = t.counter(self.problems), t.counter(self.received)


#: Called after each answer: (scope, route template, status, body bytes received, problem slug or None).
Completion = Callable[[Scope, str, int, int, "str | None"], None]

#: A layer outside the metrics middleware that timed a request first and then hands it on
#: (services/uploads.py FastReports) puts its start (time.perf_counter) here: the request's
#: latency still runs from its head.
START_KEY = "dpsketch.start"


def count_answer(m: HttpMetrics, on_complete: Completion | None, scope: Scope, start: float, status: int,
                 received: int, slug: str | None) -> None:
    """Count one answered request (what :class:`MetricsMiddleware` does after each answer; a
    layer that answers before it, outside, counts with the same function)."""
    route = route_template(scope)
    method = scope.get("method", "")
    method = method if method in _METHODS else "other"  # h11 takes any token as a method
    m.duration_of(route, method).observe(time.perf_counter() - start)
    m.requests_of(route, method, str(status)).inc()
    if received:
        m.received_of(route).inc(received)
    if slug is not None:
        m.problems_of(route, slug).inc()
    if on_complete is not None:
        on_complete(scope, route, status, received, slug)


class MetricsMiddleware:
    """Pure ASGI middleware (outermost) that times every request and counts its answer.

    It buffers only problem JSON answers (small, and at most 64 KiB), to read their ``type``;
    every other answer passes through untouched."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics, on_complete: Completion | None = None):
        self.app = app
        self.metrics = metrics
        self.on_complete = on_complete

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        m = self.metrics
        start = scope.get(START_KEY) or time.perf_counter()
        status = 500  # if the app raises before answering, the server answers 500
        received = 0
        problem: bytearray | None = None

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
            return message

        async def watching_send(message: Message) -> None:
            nonlocal status, problem
            if message["type"] == "http.response.start":
                status = int(message["status"])
                for name, value in message.get("headers", ()):
                    if name.lower() == b"content-type" and value.split(b";")[0].strip() == _PROBLEM_TYPE:
                        problem = bytearray()
            elif message["type"] == "http.response.body" and problem is not None:
                if len(problem) < _MAX_PROBLEM_BYTES:
                    problem += message.get("body", b"")[:_MAX_PROBLEM_BYTES]
            await send(message)

        m.in_flight_now += 1
        failed = False
        try:
            await self.app(scope, counting_receive, watching_send)
        except Exception:
            failed = True  # the server error middleware outside answers 500 internal-error
            raise
        finally:
            m.in_flight_now -= 1
            slug = problem_slug(bytes(problem)) if problem is not None else "internal-error" if failed else None
            count_answer(m, self.on_complete, scope, start, status, received, slug)


def metrics_response(registry: CollectorRegistry) -> Response:
    """The registry in Prometheus' text exposition format (what GET /metrics answers)."""
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST,
                    headers={"Cache-Control": "no-store"})


def sqlite_reachable(path: str | Path, timeout_s: float = 1.0) -> None:
    """Raise ``sqlite3.Error`` unless a *new* read-only connection to the SQLite file at ``path``
    can read its schema within ``timeout_s``.

    Why a new connection: a connection that is already open keeps answering ``SELECT 1`` from
    its file descriptor after the file or its directory is gone or unreadable, and it reads no
    page at all for ``SELECT 1``; readiness must tell whether the database can be reached now.
    """
    uri = f"file:{Path(path).resolve()}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=timeout_s, isolation_level=None)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    finally:
        conn.close()


def ready_answer(reasons: list[str]) -> Response:
    """200 ``{"status": "ready"}``, or 503 problem JSON (``unavailable``, Retry-After) naming why not."""
    from dpsketch.problem_http import problem_response
    from dpsketch.protocol.problems import ProblemError

    if not reasons:
        return Response(json.dumps({"status": "ready"}), media_type="application/json",
                        headers={"Cache-Control": "no-store"})
    return problem_response(ProblemError("unavailable", "not ready: " + "; ".join(reasons),
                                         headers={"Retry-After": "5", "Cache-Control": "no-store"}))


def attach_server(app: Any, server: Any, guard: Any) -> None:
    """Let the app see the uvicorn server running it (readiness answers 503 once it is shutting
    down) and the connection guard (its open-connection count is a metric); see serving.serve."""
    state = getattr(app, "state", None)
    if state is not None:
        state.uvicorn_server = server
        state.connection_guard = guard


def shutting_down(app: Any) -> bool:
    server = getattr(getattr(app, "state", None), "uvicorn_server", None)
    return bool(server is not None and getattr(server, "should_exit", False))


def open_connections(app: Any) -> int | None:
    guard = getattr(getattr(app, "state", None), "connection_guard", None)
    return None if guard is None else int(guard.total)
