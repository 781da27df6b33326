"""The fast path of the hot read: ``GET /v1/studies/{study_id}`` of an open study, for clients.

Why: every one-row client reads its study at each of the N servers before it uploads (the
server's ``server_id`` in the answer is what tells the client that URL j is server j, before a
share leaves; docs/trust.md). Through FastAPI that read cost a server several times what the
upload itself costs (services/uploads.py answers those without the framework): routing,
dependency solving, a ``StudyInfo`` model built and validated again as the response model, then
turned into JSON, per request, for bytes that hardly change. Measured under 1,000 one-row clients
64 at a time (issue 46): the FastAPI study route took about 58 % of each server's CPU for
requests, the single uploads the rest.

:class:`FastStudy`, a pure ASGI middleware outside every other one (beside the upload fast path),
answers such a read itself with the same bytes the route sends: the answer of an open study
without parties differs between requests only in ``report_count``, so it is rendered once by
the route's own serialisation (:func:`render_info`, the ``StudyInfo`` that ``Store.info`` makes)
and cut around that number; it is rendered again when anything else in it changes (the HPKE keys,
the populations charged, the study's status). Anything else goes, untouched, to the layers
inside and the FastAPI route, which answers it as always: an unknown study (404), a study
committed, closed or with parties, a store shared by replicas (the route refreshes the record),
a request with a query string, and a request carrying an operator or analyst token (the route
gives those exact counts of an add/remove study). It counts its answers as the metrics
middleware does (observability.count_answer, under the route's template), and the OpenAPI
document still describes the route.
"""

from __future__ import annotations

import re
from time import perf_counter
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from dpsketch.observability import count_answer
from dpsketch.protocol.problems import ProblemError

from .uploads import bearer_credentials

if TYPE_CHECKING:
    from .metrics import ServerMetrics
    from .store import Store

#: The study route, as FastAPI declares it (services/app.py) and labels its metrics.
STUDY_ROUTE = "/v1/studies/{study_id}"
#: Starlette's match for that template: a ``str`` path parameter is ``[^/]+``.
_STUDY_PATH = re.compile(r"^/v1/studies/(?P<study_id>[^/]+)$")
_JSON = b"application/json"
#: stands for report_count while an answer is rendered, then cut out (no study JSON holds it:
#: a number in an integer member is rendered as digits only)
_COUNT_MARK = -7_310_925_551_864_101_237


def render_info(info: Any) -> bytes:
    """A StudyInfo as the route sends it (FastAPI renders a response model with pydantic's own
    JSON serialiser, by alias: compact, floats as pydantic writes them, 1e-6 not 1e-06)."""
    return info.model_dump_json(by_alias=True).encode("utf-8")


class FastStudy:
    """Pure ASGI middleware, outermost: GET of an open study answered from cached bytes
    (module docstring). ``is_trusted(credentials)`` says whether a bearer token is an operator or
    analyst token (services/app.Roles), whose requests the route answers."""

    def __init__(self, app: ASGIApp, store: "Store", metrics: "ServerMetrics", is_trusted):
        self.app = app
        self.store = store
        self.metrics = metrics
        self.is_trusted = is_trusted
        #: study id -> (what the answer depends on besides report_count, head, tail)
        self._answers: dict[str, tuple[tuple, bytes, bytes]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = None
        if (scope["type"] == "http" and scope.get("method") == "GET" and not scope.get("query_string")
                and not scope.get("root_path")):
            match = _STUDY_PATH.fullmatch(scope["path"])
        body = None if match is None else self._answer(scope, match["study_id"])
        if body is None:
            await self.app(scope, receive, send)
            return
        start = perf_counter()
        http = self.metrics.http
        http.in_flight_now += 1
        status = 500
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", b"%d" % len(body)), (b"content-type", _JSON)]})
            await send({"type": "http.response.body", "body": body})
            status = 200
        finally:
            http.in_flight_now -= 1
            scope["dpsketch.route"] = STUDY_ROUTE  # the metrics' label (no route matched here)
            scope["path_params"] = {"study_id": match["study_id"]}
            count_answer(http, self.metrics.on_complete, scope, start, status, 0, None)

    def _answer(self, scope: Scope, study_id: str) -> bytes | None:
        """The route's answer, or None for the route to answer (module docstring)."""
        store = self.store
        if store.shared:
            return None
        try:
            record = store.record(study_id)
        except ProblemError:  # unknown: the route answers 404
            return None
        if not record.is_open or record.study.parties is not None:
            return None
        credentials = bearer_credentials(scope)
        if credentials and self.is_trusted(credentials):
            return None
        hide = record.study.neighbouring == "add-remove"  # untrusted: no exact count
        depends = (store.keys.generation, tuple(store.charged_to(study_id)), hide)
        cached = self._answers.get(study_id)
        if cached is None or cached[0] != depends:
            info = store.info(record, trusted=False)
            if info.status != "open" or info.party_counts is not None or info.commit is not None:
                return None
            if not hide:
                info.report_count = _COUNT_MARK
            text = render_info(info)
            mark = b'"report_count":%d' % _COUNT_MARK
            if hide:
                head, tail = text, b""
            elif text.count(mark) != 1:
                return None  # pragma: no cover - the mark is a number no study member holds
            else:
                head, tail = text.split(mark)
                head += b'"report_count":'
            cached = self._answers[study_id] = (depends, head, tail)
        if hide:
            return cached[1]
        return b"%s%d%s" % (cached[1], record.report_count, cached[2])
