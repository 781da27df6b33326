"""The writer's fast path takes a request whole only when nothing in it is held twice (issue 47).

The writer (services/writer.py ``_plan``) stores a request without classifying its reports one by
one when none of its ids repeats inside it, none is held, and none is among the earlier requests
of its group. The mutation campaign found two of those checks untested for large requests (the
ones that arrive with their ids sorted, ``idsets.SortedIds``, as every HTTP batch does): a
request repeating an id of its own, and one repeating ids of an earlier large request in the same
writer group. Either mistake would store a report twice, so both are built here, the group held
together by a call that keeps the writer busy until both requests are queued, and the stored
count, each request's reply and the released aggregate are checked exactly.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from dpsketch.protocol.problems import ProblemError
from dpsketch.services import idsets
from dpsketch.services.writer import CallJob
from test_server_unit import Reports, Server, _assert_released, make_study


def _submit(store, record, part: Reports):
    """As the HTTP layer queues a batch: with its ids sorted."""
    return store.submit_upload(record, part.ids, part.shares, sorted_ids=idsets.SortedIds(b"".join(part.ids)))


def _held_group(store, record, parts: list[Reports]):
    """Queue ``parts`` while a call holds the writer, so that it takes them as one group."""
    gate = threading.Event()
    held = store.writer.submit(CallJob(lambda conn: (gate.wait(30), None)))
    queued = [_submit(store, record, part) for part in parts]
    gate.set()
    assert held.result(30) is True
    return [f.result(30) for f in queued]


@contextlib.contextmanager
def _study_holding_ten(db, m: int):
    """A provisioned study whose first 10 of ``m`` reports are stored (its state exists):
    (server, study, reports, its store, its record)."""
    srv = Server(db)
    st = make_study()
    rs = srv.reports(st, m)
    try:
        assert srv.provision(st).status_code == 201
        store = srv.app.state.store
        assert srv.batch(st, rs[:10]).json()["accepted"] == 10
        yield srv, st, rs, store, store.record(st.study_id)
    finally:
        srv.close()


def test_a_large_request_repeating_its_own_id_stores_it_once(tmp_path):
    with _study_holding_ten(tmp_path / "repeat.db", 300) as (srv, st, rs, store, record):
        twice = rs[list(range(10, 200)) + [42, 150]]  # two reports sent twice in one request
        (reply,) = _held_group(store, record, [twice])
        assert (reply.accepted, reply.duplicates) == (190, 2)
        assert srv.count(st) == 200
        _assert_released(srv, st, rs.ids[:200], rs.shares[:200])


def test_a_large_request_overlapping_an_earlier_one_of_its_group_stores_the_overlap_once(tmp_path):
    with _study_holding_ten(tmp_path / "overlap.db", 400) as (srv, st, rs, store, record):
        first, second = rs[10:250], rs[200:400]  # 50 reports in both, neither held before the group
        replies = _held_group(store, record, [first, second])
        assert [(r.accepted, r.duplicates) for r in replies] == [(240, 0), (150, 50)]
        assert srv.count(st) == 400
        _assert_released(srv, st, rs.ids, rs.shares)


def test_disjoint_large_requests_of_a_group_are_taken_whole_without_classifying_a_report(tmp_path, monkeypatch):
    """The other side of the same checks: requests with nothing in common take the fast path (no
    report-by-report classification, which is what keeps ingest at the sketch's speed, issue 46),
    and the overlap of the previous test is found by the arrays of an earlier request taken whole."""
    from dpsketch.services.writer import Writer

    classified: list[int] = []
    real = Writer._classify

    def counting(self, job, state, earlier):
        classified.append(len(job.ids))
        return real(self, job, state, earlier)

    monkeypatch.setattr(Writer, "_classify", counting)
    with _study_holding_ten(tmp_path / "whole.db", 600) as (srv, st, rs, store, record):
        classified.clear()
        replies = _held_group(store, record, [rs[10:200], rs[200:400]])
        assert [(r.accepted, r.duplicates) for r in replies] == [(190, 0), (200, 0)]
        assert classified == []  # both taken whole
        replies = _held_group(store, record, [rs[400:500], rs[450:600]])
        assert [(r.accepted, r.duplicates) for r in replies] == [(100, 0), (100, 50)]
        assert classified == [150]  # only the overlapping one, found by the first one's arrays
        assert srv.count(st) == 600
        _assert_released(srv, st, rs.ids, rs.shares)


def _counting_plan(monkeypatch) -> list[int]:
    """Record the ids of every request the writer plans one by one (Writer._plan)."""
    from dpsketch.services.writer import Writer

    planned: list[int] = []
    real = Writer._plan

    def counting(self, job, *args, **kwargs):
        planned.append(len(job.ids))
        return real(self, job, *args, **kwargs)

    monkeypatch.setattr(Writer, "_plan", counting)
    return planned


def _held_singles(store, record, parts: list[Reports]):
    """Queue one-report requests while a call holds the writer: one group of single uploads."""
    gate = threading.Event()
    held = store.writer.submit(CallJob(lambda conn: (gate.wait(30), None)))
    queued = [store.submit_upload(record, part.ids, part.shares) for part in parts]
    gate.set()
    assert held.result(30) is True
    return [f.result(30) for f in queued]


def test_a_group_of_single_uploads_with_resends_is_checked_at_once_and_counts_each_report_once(tmp_path, monkeypatch):
    """Issue 46's retry storm: a group of single uploads holding re-sends of stored reports (one of
    them twice) stays on the grouped path (no request planned one by one); every re-send with the
    same bytes is a duplicate, every fresh report is stored once, the released aggregate is
    exactly theirs."""
    planned = _counting_plan(monkeypatch)
    with _study_holding_ten(tmp_path / "resend.db", 200) as (srv, st, rs, store, record):
        planned.clear()
        order = [10, 3, 11, 12, 7, 3, 13, 0, 14]  # 3, 7, 0 held; 3 twice
        replies = _held_singles(store, record, [rs[[i]] for i in order])
        assert [(r.accepted, r.duplicates) for r in replies] == [(0, 1) if i < 10 else (1, 0) for i in order]
        assert planned == []  # one check for the whole group
        assert [r.report_count for r in replies if r.accepted] == [11, 12, 13, 14, 15]
        assert srv.count(st) == 15
        assert srv.batch(st, rs[15:]).json()["accepted"] == 185  # up to min_reports, to release
        _assert_released(srv, st, rs.ids, rs.shares)


def test_a_resend_with_other_bytes_in_a_group_is_refused_alone(tmp_path, monkeypatch):
    """A re-sent id with different bytes leaves the grouped path: each request is planned on its
    own, the conflicting one refused (409 report-conflict), the rest of the group stored."""
    planned = _counting_plan(monkeypatch)
    with _study_holding_ten(tmp_path / "conflict.db", 200) as (srv, st, rs, store, record):
        changed = rs[[4]]
        changed.shares = changed.shares.copy()
        changed.shares[0, 0] += np.uint64(1)
        planned.clear()
        gate = threading.Event()
        held = store.writer.submit(CallJob(lambda conn: (gate.wait(30), None)))
        queued = [store.submit_upload(record, part.ids, part.shares) for part in (rs[[10]], rs[[5]], changed, rs[[11]])]
        gate.set()
        assert held.result(30) is True
        with pytest.raises(ProblemError) as refused:
            queued[2].result(30)
        assert refused.value.slug == "report-conflict"
        assert [(f.result(30).accepted, f.result(30).duplicates) for f in (queued[0], queued[1], queued[3])] \
            == [(1, 0), (0, 1), (1, 0)]
        assert planned == [1, 1, 1, 1]
        assert srv.count(st) == 12
        assert srv.batch(st, rs[12:]).json()["accepted"] == 188
        _assert_released(srv, st, rs.ids, rs.shares)  # the stored copy of report 4, not the changed one
