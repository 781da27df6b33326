"""The study-read fast path (services/study_route.py) answers exactly as the FastAPI route does.

The fast path takes ``GET /v1/studies/{id}`` without a query string; with one (``?via=route``,
which the route ignores) the same request is answered by the route itself. Each read below is
sent both ways to a real server process over loopback HTTP and the answers must be identical
byte for byte (status, headers but the date, body) while the study's state moves: reports
uploaded, the HPKE keys rotated, the study dropped, an unknown id, an add/remove study read
with and without the operator's token. Then the metrics of fast answers, and in process, that
a client's read of an open study never enters FastAPI.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from dpsketch.services.app import create_app
from dpsketch.services.study_route import FastStudy
from studies import provision_with_token
from test_fast_uploads import FAST, FLOORLESS, _metric, answer, as_json, post
from test_server_unit import OP, bound, make_study, settings_for


@pytest.fixture
def server(servers):
    """A real server (upload tokens required) holding one study; its upload token."""
    spec = servers.spec("s1")
    proc = servers.start(spec, extra_env=FLOORLESS, open_uploads=False)
    http = httpx.Client(base_url=proc.url, timeout=30)
    try:
        yield http, spec
    finally:
        http.close()
        log = proc.log_path.read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]


def read_both(http: httpx.Client, study_id: str, token: str | None = None) -> httpx.Response:
    """The fast path's answer and the route's, after checking they are the same bytes."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    fast = http.get(f"/v1/studies/{study_id}", headers=headers)
    route = http.get(f"/v1/studies/{study_id}", params={"via": "route"}, headers=headers)
    assert answer(fast) == answer(route), (fast.text[:500], route.text[:500])
    assert fast.status_code < 500, fast.text
    return fast


def test_reads_answer_the_routes_bytes_as_the_study_moves(server):
    http, spec = server
    study = make_study()
    token = provision_with_token(str(http.base_url), spec.operator_token, study)
    sid = study.study_id
    first = read_both(http, sid)
    assert first.json()["report_count"] == 0 and first.json()["status"] == "open"
    assert read_both(http, sid, token).content == first.content  # an upload token changes nothing
    rs = bound(study, 3)
    for i in range(3):  # the count moves with every upload; the cached rest does not go stale
        assert post(http, f"/v1/studies/{sid}/reports", as_json(rs, i), FAST, token).status_code == 200
        assert read_both(http, sid, token).json()["report_count"] == i + 1
    # a new HPKE key: the answer carries it at once (a client seals to the keys it reads)
    keys = http.post("/v1/keys", headers={"Authorization": f"Bearer {spec.operator_token}"})
    assert keys.status_code == 201, keys.text
    rotated = read_both(http, sid)
    assert rotated.json()["hpke"]["current"] == keys.json()["current"] != first.json()["hpke"]["current"]
    # dropped: the route answers (status "dropped"), and the study takes no more uploads
    dropped = http.delete(f"/v1/studies/{sid}", headers={"Authorization": f"Bearer {spec.operator_token}"})
    assert dropped.status_code == 200, dropped.text
    assert read_both(http, sid).json()["status"] == "dropped"
    more = bound(study, 1)
    assert post(http, f"/v1/studies/{sid}/reports", as_json(more), FAST, token).status_code == 409


def test_unknown_studies_are_refused_as_the_route_refuses_them(server):
    http, spec = server
    before = http.get("/v1/studies").json()
    for sid in ("0" * 64, "not-a-study-id", "A" * 64):
        r = read_both(http, sid)
        assert r.status_code == 404 and r.json()["type"] == "urn:dpsketch:problem:unknown-study", r.text
        assert r.headers["content-type"] == "application/problem+json"
    assert http.get("/v1/studies").json() == before == []  # nothing made by a read


def test_add_remove_counts_stay_hidden_except_from_operator_and_analyst(server):
    http, spec = server
    study = make_study(neighbouring="add-remove", name="add-remove")
    token = provision_with_token(str(http.base_url), spec.operator_token, study)
    rs = bound(study, 2)
    for i in range(2):
        assert post(http, f"/v1/studies/{study.study_id}/reports", as_json(rs, i), FAST, token).status_code == 200
    for who in (None, token, "not-a-token"):  # the fast path: no count, however often it moved
        assert read_both(http, study.study_id, who).json()["report_count"] is None
    for who in (spec.operator_token, spec.analyst_token):  # the route: the exact count
        assert read_both(http, study.study_id, who).json()["report_count"] == 2


def test_fast_reads_move_the_metrics(server):
    http, spec = server
    study = make_study()
    provision_with_token(str(http.base_url), spec.operator_token, study)
    scrape = lambda: http.get("/metrics", headers={"Authorization": f"Bearer {spec.operator_token}"}).text  # noqa: E731
    before = scrape()
    for _ in range(3):
        assert http.get(f"/v1/studies/{study.study_id}").status_code == 200
    assert http.get(f"/v1/studies/{'0' * 64}").status_code == 404
    after = scrape()
    route = "/v1/studies/{study_id}"

    def delta(name, **labels):
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("dpsketch_http_requests_total", route=route, method="GET", status="200") == 3
    assert delta("dpsketch_http_requests_total", route=route, method="GET", status="404") == 1
    assert delta("dpsketch_http_request_duration_seconds_count", route=route, method="GET") == 4


def test_a_clients_read_of_an_open_study_skips_fastapi(tmp_path):
    """In process: count the reads the fast path hands on to FastAPI."""
    app = create_app(settings_for(tmp_path / "s1.sqlite3"))
    study = make_study()
    with TestClient(app) as client:
        r = client.put(f"/v1/studies/{study.study_id}", content=study.canonical(),
                       headers={"Authorization": f"Bearer {OP}", "Content-Type": FAST})
        assert r.status_code == 201, r.text
        layer = app._outer
        while not isinstance(layer, FastStudy):
            layer = layer.app
        handed, inner = [], layer.app

        async def counting(scope, receive, send):
            handed.append((scope["path"], scope["query_string"]))
            await inner(scope, receive, send)

        layer.app = counting
        path = f"/v1/studies/{study.study_id}"
        fast = client.get(path)
        assert fast.status_code == 200 and handed == []
        assert client.get(path, headers={"Authorization": "Bearer some-upload-token"}).content == fast.content
        assert handed == []
        assert client.get(path, headers={"Authorization": f"Bearer {OP}"}).status_code == 200
        assert handed == [(path, b"")]  # the operator's read: the route
        assert client.get(path + "?via=route").content == fast.content and handed[-1] == (path, b"via=route")
