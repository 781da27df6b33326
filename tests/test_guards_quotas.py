"""Upload quotas and token requirements at their edges, including across replicas (issue 47).

A token good for q reports adds exactly q new ones; a replica that admitted a request before
another replica issued the study's first token must still refuse it in its writer (the HTTP check
it passed was stale). Both are what bounds Sybil reports (docs/trust.md).
"""

from __future__ import annotations

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
