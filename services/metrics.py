"""Every Prometheus metric of the share server, in one place (docs/operations.md lists them).

The app only calls :meth:`ServerMetrics.uploaded` after an acknowledged upload and times commit
and aggregate with :meth:`ServerMetrics.timed`; the HTTP side (latency by route template,
problems by type, bytes, in-flight) comes from dpsketch/observability.py's middleware, and
everything that is a level rather than an event (store size, reports held, open connections,
the writer's queue, uploads in flight) is read from the live objects at scrape time by
:class:`_LiveCollector`, so no code path has to remember to update a gauge.

Per-study labels carry only ids of studies this server holds (provisioned by its operator or
analyst): a client sending random study ids creates no series. Counts per study of an
add/remove study tell membership (docs/trust.md), which is why GET /metrics needs the operator
token.
"""

from __future__ import annotations

import time
from threading import get_ident
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import Scope

from dpsketch.observability import HttpMetrics, open_connections
from dpsketch.protocol.messages import UploadResult

#: The routes whose answers count as uploads of a study.
UPLOAD_ROUTES = frozenset({"/v1/studies/{study_id}/reports", "/v1/studies/{study_id}/batches"})

#: Commit over 10^6 reports takes seconds; aggregate after commit answers from memory.
SLOW_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, store: Any, app: Any, admission: Any = None, gate: Any = None):
        self.store = store
        self.registry = CollectorRegistry()
        self.http = HttpMetrics(self.registry)
        r = self.registry
        self.reports = Counter(
            "dpsketch_reports_total", "Reports of acknowledged uploads, by study and outcome: accepted "
            "(newly stored) or duplicate (already held with the same bytes, acknowledged again)",
            ["study_id", "outcome"], registry=r)
        self.upload_requests = Counter(
            "dpsketch_upload_requests_total", "Upload requests (single reports and batches) to a held "
            "study, by outcome: acknowledged, or the problem type that refused it (report-conflict: "
            "a report id held with different bytes; nothing of a refused request is stored)",
            ["study_id", "outcome"], registry=r)
        self.upload_bytes = Counter(
            "dpsketch_upload_bytes_total", "Request body bytes of acknowledged uploads, by study",
            ["study_id"], registry=r)
        self.commit_seconds = Histogram(
            "dpsketch_commit_duration_seconds", "Time the store took to answer a commit (certificate, "
            "batch rule, noise, durable write), by outcome (ok or the problem type)",
            ["outcome"], buckets=SLOW_BUCKETS, registry=r)
        self.aggregate_seconds = Histogram(
            "dpsketch_aggregate_duration_seconds", "Time the store took to answer an aggregate request",
            ["outcome"], buckets=SLOW_BUCKETS, registry=r)
        r.register(_LiveCollector(store, app, admission, gate))
        tally = self.http.tally  # updates per upload, added to the series when scraped
        self.reports_of = tally.counter(self.reports)
        self.upload_requests_of = tally.counter(self.upload_requests)
        self.upload_bytes_of = tally.counter(self.upload_bytes)
        #: (thread, study) -> that thread's cells of the series a single upload's answer counts
        self._single_cells: dict[tuple[int, str], tuple] = {}

    def uploaded(self, study_id: str, result: UploadResult) -> None:
        """After an acknowledged upload (the handler's only metrics call)."""
        if result.accepted:
            self.reports_of(study_id, "accepted").inc(result.accepted)
        if result.duplicates:
            self.reports_of(study_id, "duplicate").inc(result.duplicates)

    @contextmanager
    def timed(self, histogram: Histogram) -> Iterator[None]:
        """Observe the block's duration under outcome "ok", or the problem slug it raised."""
        from dpsketch.protocol.problems import ProblemError

        start = time.perf_counter()
        outcome = "ok"
        try:
            yield
        except ProblemError as exc:
            outcome = exc.slug
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            histogram.labels(outcome).observe(time.perf_counter() - start)

    def on_complete(self, scope: Scope, route: str, status: int, received: int, problem: str | None) -> None:
        """Per-study upload outcomes, from the middleware (it sees answers no handler made)."""
        if route not in UPLOAD_ROUTES:
            return
        study_id = scope.get("path_params", {}).get("study_id")
        if not isinstance(study_id, str) or not self._held(study_id):
            return  # unknown ids get no series of their own (dpsketch_http_problems_total counts them)
        if 200 <= status < 300:
            self.acknowledged(study_id, received)
        else:
            self.upload_requests_of(study_id, problem or f"http-{status}").inc()

    def single_acknowledged(self, study_id: str, route: str, received: int, seconds: float, accepted: int,
                            duplicates: int) -> None:
        """Everything an acknowledged single upload counts, as the metrics middleware
        (count_answer), :meth:`on_complete` and :meth:`uploaded` count it (services/uploads.py,
        the fast path): the latency, the 200, the body bytes, the upload and its reports. One
        call with the calling thread's cells of the study found once, not one per series
        (nine cell lookups and updates were a tenth of the fast path's work)."""
        key = (get_ident(), study_id)
        cells = self._single_cells.get(key)
        if cells is None:
            http = self.http
            cells = self._single_cells[key] = (
                http.duration_of(route, "POST"), http.requests_of(route, "POST", "200"), http.received_of(route),
                self.upload_requests_of(study_id, "acknowledged"), self.upload_bytes_of(study_id),
                self.reports_of(study_id, "accepted"), self.reports_of(study_id, "duplicate"))
        duration, requests, body_bytes, uploads, upload_bytes, reports, duplicate = cells
        duration.observe(seconds)
        requests.total += 1
        body_bytes.total += received
        uploads.total += 1
        upload_bytes.total += received
        if accepted:
            reports.total += accepted
        if duplicates:
            duplicate.total += duplicates

    def acknowledged(self, study_id: str, received: int) -> None:
        """An upload to a held study was acknowledged (its body: ``received`` bytes)."""
        self.upload_requests_of(study_id, "acknowledged").inc()
        self.upload_bytes_of(study_id).inc(received)

    def _held(self, study_id: str) -> bool:
        from dpsketch.protocol.problems import ProblemError

        try:
            self.store.record(study_id)
        except ProblemError:
            return False
        return True


class _LiveCollector:
    """Levels read at scrape time from the store, the writer, the admission limits and uvicorn."""

    def __init__(self, store: Any, app: Any, admission: Any, gate: Any = None):
        self.store, self.app, self.admission, self.gate = store, app, admission, gate

    def describe(self) -> list:
        return []  # metrics are produced at collect time only (no registration-time scrape)

    def collect(self):
        store = self.store
        records = store.records()
        held = GaugeMetricFamily("dpsketch_store_reports", "Reports (or blocks) the store holds, by study",
                                 labels=["study_id", "status"])
        for rec in records:
            held.add_metric([rec.study_id, "committed" if rec.commit is not None else "open"],
                            float(rec.report_count))
        yield held
        size = store.size_bytes()
        if size is not None:
            yield GaugeMetricFamily("dpsketch_store_bytes", "Bytes on disk of the store (SQLite: the "
                                    "file, WAL and shared-memory index; PostgreSQL: pg_database_size)",
                                    value=float(size))
        try:
            in_use = float(store.memory_in_use())
        except Exception:  # pragma: no cover - never fail a scrape
            in_use = float("nan")
        yield GaugeMetricFamily("dpsketch_store_memory_bytes", "Memory the open studies' running "
                                "totals and report index take (what memory_budget limits)", value=in_use)
        rounds = getattr(store, "verification", None)
        if rounds is not None:
            decided = CounterMetricFamily("dpsketch_verify_decisions", "Validity decisions this process "
                                          "stored, by where its own verifier shares came from: the query's "
                                          "kept answer (cache) or computed again (recomputed; "
                                          "--verify-cache-dir)", labels=["source"])
            for source, count in rounds.decided_from.items():
                decided.add_metric([source], float(count))
            yield decided
        writer = getattr(store, "writer", None)
        if writer is not None:
            yield GaugeMetricFamily("dpsketch_writer_queued_jobs", "Write requests waiting for the "
                                    "single writer (refused with 503 at max_queued_jobs)",
                                    value=float(writer.queue.qsize()))
            yield GaugeMetricFamily("dpsketch_writer_queued_bytes", "Share bytes waiting for the writer "
                                    "(refused with 503 at max_queued_bytes)",
                                    value=float(writer.queued_bytes))
        wal = getattr(getattr(store, "backend", None), "checkpointer", None)  # SQLite only
        if wal is not None:
            runs = CounterMetricFamily("dpsketch_wal_checkpoints", "SQLite WAL checkpoints (services/wal.py), "
                                       "by who ran them: the checkpoint thread after commits, or the writer "
                                       "to start the log over", labels=["by"])
            runs.add_metric(["checkpointer"], float(wal.runs))
            runs.add_metric(["writer"], float(wal.rewinds))
            yield runs
            yield GaugeMetricFamily("dpsketch_wal_log_pages", "Pages in the SQLite WAL when it was last "
                                    "checkpointed (the writer starts it over at 4,000)", value=float(wal.log_pages))
        if self.admission is not None:
            yield GaugeMetricFamily("dpsketch_uploads_in_flight", "Uploads admitted (body received) and not "
                                    "yet answered (more are refused with 503 at $DPSKETCH_MAX_INFLIGHT_UPLOADS)",
                                    value=float(self.admission.requests))
            yield GaugeMetricFamily("dpsketch_upload_bytes_in_flight", "Body bytes of the uploads in flight "
                                    "(more are refused with 503 at $DPSKETCH_MAX_INFLIGHT_UPLOAD_BYTES)",
                                    value=float(self.admission.bytes))
        gate = self.gate
        if gate is not None:
            yield GaugeMetricFamily("dpsketch_resends_held", "Answers to re-sent uploads held now while fresh "
                                    "uploads arrive (at most $DPSKETCH_RESEND_HOLD_MAX; services/resend_gate.py)",
                                    value=float(gate.held))
            yield GaugeMetricFamily("dpsketch_resends_held_peak", "Most answers to re-sent uploads held at once "
                                    "since start", value=float(gate.peak))
            answers = CounterMetricFamily("dpsketch_resend_answers", "Answers to re-sent uploads that would "
                                          "have been held, by whether they were (held: fresh uploads arriving) or "
                                          "were answered at once because a cap was reached (over_cap)",
                                          labels=["outcome"])
            answers.add_metric(["held"], float(gate.held_total))
            answers.add_metric(["over_cap"], float(gate.over_cap))
            yield answers
        conns = open_connections(self.app)
        if conns is not None:
            yield GaugeMetricFamily("dpsketch_open_connections", "Client connections open now (capped "
                                    "by --max-connections)", value=float(conns))
