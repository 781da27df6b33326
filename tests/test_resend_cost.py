"""A retry costs what a fresh upload costs (issue 46): a re-sent report that the server already
holds is found through the report index, and only the one stored batch that holds it is read to
compare its bytes, never every batch header of the study.

Measured as work done, not time: the SQLite virtual-machine steps the writer's connection runs
for one re-send (a progress handler called at every step), with a study of few stored batches
and of ten times more. Before, the re-send read every batch header of the study (``batches.read``
without the caller's headers), so its steps grew with the number of batches stored; now they do
not. The re-send must still be compared byte for byte: the same bytes are a duplicate, other
bytes a conflict.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.study import design
from dpsketch.services.settings import Settings
from dpsketch.services.store import Store
from dpsketch.services.writer import CallJob

D = 3


def _store(tmp_path: Path) -> Store:
    return Store(Settings(server_id="s1", db_path=tmp_path / "s1.sqlite3", operator_token="operator-token-0123456789",
                          analyst_token="analyst-token-0123456789", upload_auth="open", max_floor_epsilon=None,
                          warm_start=False))


def _upload(store: Store, record, ids: list[bytes], shares: np.ndarray):
    return store.submit_upload(record, ids, shares).result(30)


class Steps:
    """The writer connection's VM steps and statements while ``counting``: installed and removed
    by jobs that run on the writer's own thread (sqlite3 connections are bound to theirs)."""

    def __init__(self, store: Store):
        self.store, self.steps, self.statements, self.counting = store, 0, [], False

    def _tick(self) -> int:
        if self.counting:
            self.steps += 1
        return 0

    def _trace(self, sql: str) -> None:
        if self.counting:
            self.statements.append(sql)

    def install(self) -> None:
        def fn(conn):
            conn.set_progress_handler(self._tick, 1)
            conn.set_trace_callback(self._trace)
            return None, None
        self.store.writer.submit(CallJob(fn)).result(30)

    def remove(self) -> None:
        def fn(conn):
            conn.set_progress_handler(None, 1)
            conn.set_trace_callback(None)
            return None, None
        self.store.writer.submit(CallJob(fn)).result(30)

    def of(self, action) -> tuple[int, list[str]]:
        self.steps, self.statements, self.counting = 0, [], True
        try:
            action()
        finally:
            self.counting = False
        return self.steps, list(self.statements)


def test_a_resent_report_reads_its_own_batch_not_every_header(tmp_path):
    study = design(name="resend", columns=["a", "b", "c"], label=None, servers=["s1", "s2"], expected_reports=5000,
                   k=8, s=2, min_reports=100, epsilon_floor=None)[0]
    store = _store(tmp_path)
    try:
        store.provision(study)
        record = store.record(study.study_id)
        rng = np.random.default_rng(4)
        stored: list[tuple[bytes, np.ndarray]] = []

        def add_batches(count: int) -> None:  # one stored batch row each (one writer group each)
            for _ in range(count):
                ids = [os.urandom(16) for _ in range(4)]
                shares = rng.integers(0, 2**63, size=(4, D), dtype=np.uint64)
                assert _upload(store, record, ids, shares).accepted == 4
                stored.append((ids[1], shares[1:2].copy()))

        steps = Steps(store)
        steps.install()

        def resend_cost(i: int) -> tuple[int, list[str]]:
            rid, share = stored[i]
            got: list = []
            cost = steps.of(lambda: got.append(_upload(store, record, [rid], share)))
            assert (got[0].accepted, got[0].duplicates) == (0, 1)  # recognised, counted once
            return cost

        add_batches(20)
        few, _ = resend_cost(10)
        add_batches(200)
        many, statements = resend_cost(110)
        # the study's headers were read before: steps grew with the 220 batches (about 10x)
        assert not any("first > ?" in sql or ("SELECT first, m FROM batches WHERE study" in sql) for sql in statements), \
            statements
        assert many <= 1.5 * few + 50, (few, many)
        # a fresh upload of one report at the same stored count, for scale: the re-send is of its order
        fresh, _ = steps.of(lambda: _upload(store, record, [os.urandom(16)], rng.integers(0, 2**63, size=(1, D),
                                                                                          dtype=np.uint64)))
        assert many <= 2 * fresh + 100, (fresh, many)
        # its bytes are still compared with the stored ones: other bytes under the same id conflict
        rid, share = stored[150]
        with pytest.raises(ProblemError) as refused:
            _upload(store, record, [rid], share ^ np.uint64(1))
        assert refused.value.slug == "report-conflict"
        steps.remove()
        assert store.held(record) == 4 * 220 + 1
    finally:
        store.close()
