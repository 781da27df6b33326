"""One bulk upload run: a worker thread per server, each draining a bounded queue.

``Client.submit_many`` prepares batches in the caller's thread (preparing overlaps sending) and
puts server j's body in queue j; each server's worker uploads in order, retrying through the
client's transport. Queues are bounded, so memory stays flat however long the input is. On a
permanent failure at any server the run aborts: no new batches are prepared, and every body not
yet stored somewhere is recorded as pending with its bytes, so the caller learns exactly what is
missing where (:class:`~client_sdk.errors.IncompleteUpload`).

A batch keeps its index in the input (``put(batch, first_row, index)``): a resumed submission
skips the batches an earlier run stored everywhere, and its journal records by that index each
batch every server acknowledged (``on_stored``; client_sdk/journal.py). An interrupted run
reports how many rows every server holds and how many only some do (:meth:`UploadRun.partial_rows`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpsketch.protocol import messages
from dpsketch.protocol.study import Study

from .errors import BatchFailure, IncompleteUpload, PendingUpload, UploadCancelled
from .prepare import PreparedBatch, ProofBatch

if TYPE_CHECKING:
    from .client import Client

#: called with the number of rows every server now holds, after each batch
Progress = Callable[[int], Any]
#: called with (batch index, rows) once every server acknowledged that batch
Stored = Callable[[int, int], Any]

#: the largest request body a default batch fills. A batch costs each server a request, a
#: transaction and an fsync whatever its size, so a few MiB per body amortise them: at d = 32 a
#: server ingested full shares 1.05-1.21 x and seeds 1.27-1.42 x faster in these batches than in
#: 10^4-row ones; at d = 100, 10^4 rows already fill 8 MiB (docs/operations.md, "How reports are
#: stored")
DEFAULT_BATCH_BYTES = 8 << 20
#: ... and no batch of more rows than this by default, so progress and a retry stay fine-grained
MAX_DEFAULT_BATCH_ROWS = 100_000
#: the client's own limit per request body (``Client(max_batch_bytes=)``)
MAX_BATCH_BYTES = 16 << 20


def default_batch_rows(width: int, n_servers: int) -> int:
    """The rows of the SDK's default batch of plaintext full shares of this width (what the
    benches send, so they measure the batches users send)."""
    return batch_rows(None, messages.record_bytes(messages.SHARES_MEDIA_TYPE, width, n_servers), MAX_BATCH_BYTES)


def batch_rows(batch_size: int | None, record_bytes: int, max_batch_bytes: int) -> int:
    """Rows per batch: ``batch_size`` if given, else as many as fill :data:`DEFAULT_BATCH_BYTES`
    of the largest record a batch sends (at most :data:`MAX_DEFAULT_BATCH_ROWS`); never a body
    over ``max_batch_bytes`` (servers refuse large ones with 413), never less than one row."""
    if batch_size is None:
        batch_size = min(MAX_DEFAULT_BATCH_ROWS, DEFAULT_BATCH_BYTES // record_bytes)
    elif batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    return max(1, min(batch_size, max_batch_bytes // record_bytes))


def proof_batch_rows(study: Study, batch_size: int | None, max_batch_bytes: int) -> int:
    """Rows per proved batch of a study with batch proofs (docs/protocol.md section 4d): a batch
    is one record a server, the leader's the large one (its input and proof shares: about 8 (w +
    5) bytes a row, 847 at d = 100, plus the batch's proof and wrap digits), and it cannot be cut
    on a 413. So ``batch_size`` if given, else about as many rows as keep the leader's record
    within :data:`DEFAULT_BATCH_BYTES` (at most :data:`MAX_DEFAULT_BATCH_ROWS`: 9,900 rows at
    d = 100, 69,292 at d = 10, three servers); never a leader's record over ``max_batch_bytes``
    and never more rows than a server takes in one batch (``batch_records.max_rows``:
    min(max_reports, 2^17)); at least one. "About": a batch cut to the limit drops the rows its
    excess would hold at 8 (w + g + 4) bytes each, a little more than it must (the batch's proof
    shrinks with it), so it ends within a few rows of the most that fit (within 1 %,
    tests/test_sdk_batch_proofs.py).

    The exact record length needs the batch's plan (its proof length P); the plans it builds are
    the ones ``batch_validity.study_plan`` caches for proving."""
    from dpsketch.protocol import batch_circuit, batch_records, batch_validity, validity

    if batch_size is not None and batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    limit = max_batch_bytes if batch_size is not None else min(DEFAULT_BATCH_BYTES, max_batch_bytes)
    p = validity.plan(study)
    per_row = batch_records.ELEMENT_BYTES * (p.w + batch_circuit.greedy_steps(p.bound) + batch_circuit.EXACT)
    m = min(batch_records.max_rows(study), MAX_DEFAULT_BATCH_ROWS if batch_size is None else batch_size,
            max(1, limit // per_row))
    while m > 1:
        excess = batch_records.leader_length(batch_validity.study_plan(study, m)) - limit
        if excess <= 0:
            break
        m = max(1, m - -(-excess // per_row))  # drop the rows the excess holds, rounded up
    return m


@dataclass
class _Batch:
    first_row: int
    n_rows: int
    ids: list[bytes]
    remaining: int


class UploadRun:
    """One ``submit_many`` (module docstring)."""

    def __init__(self, client: "Client", study: Study, study_id: str, progress: Progress | None,
                 keep_ids: bool, on_stored: Stored | None = None):
        self.client, self.study, self.study_id = client, study, study_id
        self.progress, self.keep_ids, self.on_stored = progress, keep_ids, on_stored
        n = study.n_servers
        self.queues: list[queue.Queue] = [queue.Queue(maxsize=client.queue_depth) for _ in range(n)]
        self.aborted = threading.Event()
        self.lock = threading.Lock()
        self.batches: dict[int, _Batch] = {}
        self.done_ids: dict[int, list[bytes]] = {}
        self.failures: list[BatchFailure] = []
        self.pending: list[PendingUpload] = []
        self.rows_done = 0
        self.stored_batches = 0
        self.report_counts: dict[str, int] = {}
        self.duplicates: dict[str, int] = {sid: 0 for sid in study.servers}
        self.finishing = False
        self.threads = [threading.Thread(target=self._worker, args=(j,), daemon=True,
                                         name=f"dpsketch-upload-{study.servers[j]}") for j in range(n)]
        for t in self.threads:
            t.start()

    def put(self, batch: PreparedBatch | ProofBatch, first_row: int, index: int) -> None:
        """Queue batch ``index`` (its rows start at input row ``first_row``) for every server: a
        batch of reports, or a proved batch's records (one a server)."""
        with self.lock:
            self.batches[index] = _Batch(first_row, len(batch), batch.report_ids, self.study.n_servers)
        for j, q in enumerate(self.queues):
            item = (index, *self.client._wire(self.study, self.study_id, j, batch.body(j),
                                              batch.media_type(j)))
            while True:
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    if self.aborted.is_set():
                        self._mark_pending(j, index, item[1], item[2])
                        break

    def _mark_pending(self, j: int, index: int, body: bytes,
                      media_type: str = messages.SHARES_MEDIA_TYPE) -> None:
        with self.lock:
            b = self.batches[index]
            self.pending.append(PendingUpload(j, self.study.servers[j], index, b.first_row,
                                              b.n_rows, body, media_type))

    def _worker(self, j: int) -> None:
        sid = self.study.servers[j]
        while True:
            item = self.queues[j].get()
            if item is None:
                return
            index, body, media_type = item
            if self.aborted.is_set():
                self._mark_pending(j, index, body, media_type)
                continue
            try:
                result = self.client._upload_batch(j, self.study, self.study_id, body, self.aborted,
                                                   media_type)
            except UploadCancelled:
                self._mark_pending(j, index, body, media_type)
                continue
            except Exception as exc:  # noqa: BLE001 - recorded, surfaced by submit_many
                with self.lock:
                    b = self.batches[index]
                    self.failures.append(BatchFailure(j, sid, self.client.urls[j], index,
                                                      b.first_row, b.n_rows, exc))
                self._mark_pending(j, index, body, media_type)
                self.aborted.set()
                continue
            with self.lock:
                self.stored_batches += 1
                if result.report_count is not None:
                    self.report_counts[sid] = max(self.report_counts.get(sid, 0), result.report_count)
                self.duplicates[sid] += result.duplicates
                b = self.batches[index]
                b.remaining -= 1
                if b.remaining == 0:
                    self.rows_done += b.n_rows
                    if self.keep_ids:
                        self.done_ids[index] = b.ids
                    del self.batches[index]
                    if self.on_stored is not None:
                        self.on_stored(index, b.n_rows)
                    if self.progress is not None:
                        self.progress(b.n_rows)

    def finish(self) -> None:
        """Let every worker drain its queue and stop; wait for them (again, if interrupted)."""
        if not self.finishing:
            self.finishing = True
            for q in self.queues:
                q.put(None)
        for t in self.threads:
            t.join()
        self.failures.sort(key=lambda f: (f.batch_index, f.server_index))

    def partial_rows(self) -> int:
        """Rows of batches some server acknowledged and another did not (after :meth:`finish`)."""
        with self.lock:
            n = self.study.n_servers
            return sum(b.n_rows for b in self.batches.values() if b.remaining < n)

    def ids(self) -> list[str]:
        with self.lock:
            out = {i: ids for i, ids in self.done_ids.items()}
            if self.keep_ids:
                out.update({i: b.ids for i, b in self.batches.items()})
            return [rid.hex() for i in sorted(out) for rid in out[i]]

    def incomplete(self, prepared: int, journal: str | None = None) -> IncompleteUpload:
        pending = sorted(self.pending, key=lambda p: (p.batch_index, p.server_index))
        return IncompleteUpload(list(self.failures), pending, self.ids(), prepared, journal)
