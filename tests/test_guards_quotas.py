"""Upload quotas and token requirements at their edges, including across replicas (issue 47).

A token good for q reports adds exactly q new ones; a replica that admitted a request before
another replica issued the study's first token must still refuse it in its writer (the HTTP check
it passed was stale). Both are what bounds Sybil reports (docs/trust.md).
"""

from __future__ import annotations

import pytest

from dpsketch.protocol.problems import ProblemError
from test_server_unit import OP, Server, assert_problem, bearer, make_study


def test_a_token_adds_exactly_its_quota(tmp_path):
    srv = Server(tmp_path / "q.db", upload_auth="tokens")
    st = make_study()
    try:
        assert srv.provision(st).status_code == 201
        r = srv.client.post(f"/v1/studies/{st.study_id}/upload-tokens", json={"quota": 3}, headers=bearer(OP))
        token = r.json()["token"]
        rs = srv.reports(st, 5)
        assert_problem(srv.batch(st, rs[:4], token=token), 403, "upload-quota-exceeded")  # 4 > 3, whole
        assert srv.count(st) == 0
        assert srv.batch(st, rs[:3], token=token).json()["accepted"] == 3  # exactly the quota
        assert srv.batch(st, rs[:3], token=token).json()["duplicates"] == 3  # retries are free
        assert_problem(srv.upload(st, rs[3], token=token), 403, "upload-quota-exceeded")
        assert srv.count(st) == 3
    finally:
        srv.close()


def test_a_replica_refuses_an_upload_admitted_before_another_issued_the_first_token(postgres):
    """Replicas A and B on one PostgreSQL database; the study is open, B has loaded it. A issues
    the study's first upload token; an upload without one then reaches B, whose memory still says
    'open': B's writer refuses it (401) and nothing is stored."""
    url = postgres.new_database("tok")
    a = Server(url)
    b = None
    try:
        st = make_study()
        assert a.provision(st).status_code == 201
        rs = a.reports(st, 10)
        assert a.batch(st, rs[:4]).status_code == 200
        b = Server(url)
        assert b.count(st) == 4
        r = a.client.post(f"/v1/studies/{st.study_id}/upload-tokens", json={"quota": None}, headers=bearer(OP))
        assert r.status_code == 201, r.text
        late = b.batch(st, rs[4:])
        assert late.status_code == 401, late.text
        assert a.count(st) == 4 and b.count(st) == 4
        token = r.json()["token"]
        assert b.batch(st, rs[4:], token=token).json()["accepted"] == 6
    finally:
        a.close()
        if b is not None:
            b.close()


def test_one_writer_group_charges_a_token_once_for_all_its_requests(tmp_path):
    """Two requests with the same token that reach the writer together (one transaction): the
    quota counts both, so with 3 left a second request of 2 new reports is refused whole."""
    import os
    import threading

    import numpy as np

    from dpsketch.services.auth import digest_of
    from dpsketch.services.writer import CallJob

    srv = Server(tmp_path / "group.db", upload_auth="tokens")
    st = make_study()
    try:
        assert srv.provision(st).status_code == 201
        token = srv.client.post(f"/v1/studies/{st.study_id}/upload-tokens", json={"quota": 3},
                                headers=bearer(OP)).json()["token"]
        store = srv.app.state.store
        record = store.record(st.study_id)
        shares = np.zeros((4, st.width), dtype=np.uint64)
        ids = [os.urandom(16) for _ in range(4)]
        gate = threading.Event()
        held = store.writer.submit(CallJob(lambda conn: (gate.wait(30), None)))
        first = store.submit_upload(record, ids[:2], shares[:2], token=digest_of(token))
        second = store.submit_upload(record, ids[2:], shares[2:], token=digest_of(token))
        gate.set()
        assert held.result(30) is True
        assert first.result(30).accepted == 2
        with pytest.raises(ProblemError) as refused:
            second.result(30)
        assert refused.value.slug == "upload-quota-exceeded"
        assert srv.count(st) == 2
    finally:
        srv.close()


def test_a_block_batch_with_two_blocks_of_one_individual_is_refused(tmp_path):
    """A party's batch holding two blocks for the same pseudonym would give an individual two
    rows of that party: refused, and nothing of it stored."""
    import numpy as np

    from dpsketch.client_sdk.prepare import prepare_blocks
    from dpsketch.protocol import messages, parties
    from dpsketch.protocol.study import design

    srv = Server(tmp_path / "dup.db")
    st = design(name="v", columns=[], label=None, servers=["s1", "s2"], expected_reports=200, k=8, s=2,
                epsilon_floor=None, parties=[{"name": "bank", "columns": ["a", "b"]},
                                             {"name": "shop", "columns": ["c"]}])[0]
    try:
        assert srv.provision(st).status_code == 201
        ps = parties.pseudonyms(parties.new_key(), st.study_id, ["x", "y"])
        batch = prepare_blocks(st, "bank", [ps[0], ps[1], ps[0]], np.zeros((3, 2)))
        r = srv.client.post(f"/v1/studies/{st.study_id}/batches", content=batch.body(0),
                            headers={"Content-Type": messages.blocks_media_type("bank")})
        assert 400 <= r.status_code < 500, r.text
        assert srv.app.state.store.record(st.study_id).report_count == 0
    finally:
        srv.close()
