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

from services import idsets
from services.writer import CallJob
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
    from services.writer import Writer

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
