"""The single-upload fast path (services/uploads.py) answers exactly as the FastAPI route does.

The fast path takes only ``Content-Type: application/json`` exactly; the route takes any JSON
media type, so ``application/json; charset=utf-8`` is answered by the route itself (the
documented behaviour). Each request below is sent both ways to a real server process over
loopback HTTP and the answers must be identical byte for byte: status, headers (but the date)
and body. Good uploads, every kind of bad input (never a 500) and the writer's refusals are
covered, then the metrics of fast-path answers and the OpenAPI entry of the route. An in-process
check shows that a well-formed upload really is answered without entering FastAPI, and a bad one
is handed to it.
"""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from dpsketch.protocol.messages import Report
from dpsketch.services.app import create_app
from dpsketch.services.uploads import FastReports
from conftest import NO_BUDGET
from studies import provision_with_token
from test_server_unit import bound, make_study, settings_for

FAST = "application/json"
ROUTE = "application/json; charset=utf-8"
#: make_study's studies carry no server noise: no floor required, hence no population budget
FLOORLESS = {"DPSKETCH_MAX_FLOOR_EPSILON": "none", **NO_BUDGET}


def answer(r: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """Everything a client sees of an answer but the Date header (it moves with the clock)."""
    return r.status_code, [(k, v) for k, v in r.headers.multi_items() if k.lower() != "date"], r.content


@pytest.fixture
def server(servers):
    """A real server (default policy: upload tokens) holding one study; its upload token."""
    spec = servers.spec("s1")
    proc = servers.start(spec, extra_env=FLOORLESS, open_uploads=False)
    study = make_study()
    token = provision_with_token(proc.url, spec.operator_token, study)
    http = httpx.Client(base_url=proc.url, timeout=30)
    try:
        yield http, spec, study, token
    finally:
        http.close()
        log = proc.log_path.read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]  # nothing unforeseen on either path


def post(http: httpx.Client, path: str, body: bytes, content_type: str, token: str | None,
         authorization: str | None = None) -> httpx.Response:
    headers = {"Content-Type": content_type}
    if authorization is not None:
        headers["Authorization"] = authorization
    elif token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return http.post(path, content=body, headers=headers)


def both(http, path, body, token, authorization=None):
    """The fast path's answer and the route's, after checking they are the same."""
    fast = post(http, path, body, FAST, token, authorization)
    route = post(http, path, body, ROUTE, token, authorization)
    assert answer(fast) == answer(route), (fast.text, route.text)
    assert fast.status_code < 500, fast.text
    return fast


def as_json(reports, i: int = 0, **changes) -> bytes:
    data = reports.report(i)
    data.update(changes)
    return json.dumps(data).encode()


def test_good_uploads_and_duplicates_answer_the_same_bytes(server):
    http, _spec, study, token = server
    path = f"/v1/studies/{study.study_id}/reports"
    rs = bound(study, 3)
    first = post(http, path, as_json(rs, 0), FAST, token)
    assert first.status_code == 200, first.text
    assert first.content == b'{"accepted":1,"duplicates":0,"report_count":1}'
    second = post(http, path, as_json(rs, 1), ROUTE, token)
    assert second.content == b'{"accepted":1,"duplicates":0,"report_count":2}'
    assert answer(first)[:2] == answer(second)[:2]  # the same status and headers
    # the same report again, both ways: acknowledged as a duplicate, nothing counted twice
    dup = both(http, path, as_json(rs, 0), token)
    assert dup.status_code == 200 and dup.json() == {"accepted": 0, "duplicates": 1, "report_count": 2}
    # compact JSON, keys in another order, a lower-case scheme: the same report, both ways
    body = json.dumps(dict(reversed(list(rs.report(2).items()))), separators=(",", ":")).encode()
    r = post(http, path, body, FAST, None, authorization=f"bearer {token}")
    assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
    assert both(http, path, body, None, authorization=f"bearer  {token}").json()["duplicates"] == 1
    # a UTF-16 JSON body: the route's json.loads reads it, so the fast path hands it over
    more = bound(study, 1)
    r = post(http, path, json.dumps(more.report(0)).encode("utf-16"), FAST, token)
    assert r.status_code == 200 and r.json() == {"accepted": 1, "duplicates": 0, "report_count": 4}, r.text
    assert http.get(f"/v1/studies/{study.study_id}").json()["report_count"] == 4


def test_bad_uploads_answer_the_same_problem_both_ways(server):
    http, spec, study, token = server
    path = f"/v1/studies/{study.study_id}/reports"
    rs = bound(study, 2)
    good = rs.report(0)
    share = base64.b64decode(good["share"])
    proof = base64.b64decode(good["proof"])
    cases = {
        "not JSON": (b"{", 400, "malformed-body"),
        "no body": (b"", 422, "invalid-request"),
        "a list": (b"[]", 422, "invalid-request"),
        "a string": (b'"x"', 422, "invalid-request"),
        "a field missing": (json.dumps({k: v for k, v in good.items() if k != "proof"}).encode(), 422,
                            "invalid-request"),
        "an extra field": (as_json(rs, 0, extra=1), 422, "invalid-request"),
        "an upper-case id": (as_json(rs, 0, report_id=good["report_id"].upper()), 422, "invalid-request"),
        "a number for the share": (as_json(rs, 0, share=7), 422, "invalid-request"),
        "not base64": (as_json(rs, 0, share="!!!!"), 422, "invalid-request"),
        "a short share": (as_json(rs, 0, share=base64.b64encode(share[:-8]).decode()), 422, "invalid-request"),
        "a short proof": (as_json(rs, 0, proof=base64.b64encode(proof[:-1]).decode()), 422, "invalid-request"),
        "a substituted share": (json.dumps(rs.substituted(1, "share").report(0)).encode(), 422, "binding-refused"),
        "a substituted proof": (json.dumps(rs.substituted(1, "proof", 3).report(0)).encode(), 422,
                                "binding-refused"),
        "another record's id": (as_json(rs, 0, report_id=rs.ids[1].hex()), 422, "binding-refused"),
        "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, 400, "malformed-body"),
        "not UTF-8": (b'{"report_id": "\xff\xfe"}', 400, "malformed-body"),
        "a lone surrogate": (as_json(rs, 0, share="QUFB\\ud800").replace(b"\\\\", b"\\"), 422, "invalid-request"),
        "trailing bytes": (as_json(rs, 0) + b" x", 400, "malformed-body"),
        "NaN": (as_json(rs, 0, share=float("nan")), 422, "invalid-request"),
    }
    for what, (body, status, slug) in cases.items():
        r = both(http, path, body, token)
        assert r.status_code == status and r.headers["content-type"] == "application/problem+json", (what, r.text)
        assert r.json()["type"] == f"urn:dpsketch:problem:{slug}", (what, r.text)
        assert r.json()["instance"] == path
    # tokens: none, unknown, another scheme, an operator's token (not an upload token)
    body = as_json(rs, 0)
    for authorization in ("", "Bearer", f"Basic {token}", "Bearer nope", f"Bearer {spec.operator_token}",
                          f"Token {token}"):
        r = both(http, path, body, None, authorization=authorization)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (authorization, r.text)
    r = both(http, path, body, None)
    assert r.status_code == 401 and r.json()["type"].endswith(":unauthorized")
    # an unknown study, and a study id that is not one
    for other in ("0" * 64, "not-a-study", "%3F", "x" * 300):
        r = both(http, f"/v1/studies/{other}/reports", body, token)
        assert r.status_code == 404 and r.json()["type"].endswith(":unknown-study"), (other, r.text)
    # over the body limit (64 MiB): refused before anything is read
    r = both(http, path, b" " * (64 * 2**20 + 1), token)
    assert r.status_code == 413
    # nothing of all that was stored
    assert http.get(f"/v1/studies/{study.study_id}").json()["report_count"] == 0


def test_writer_refusals_answer_the_same_bytes(server):
    """The writer refuses a report past its token's quota: the fast path renders that refusal
    itself (the request passed every check before), as the route's error handler does."""
    http, spec, study, _token = server
    path = f"/v1/studies/{study.study_id}/reports"
    r = http.post(f"/v1/studies/{study.study_id}/upload-tokens", json={"count": 1, "quota": 1},
                  headers={"Authorization": f"Bearer {spec.operator_token}"})
    limited = r.json()["token"]
    rs = bound(study, 3)
    assert post(http, path, as_json(rs, 0), FAST, limited).status_code == 200
    fast = post(http, path, as_json(rs, 1), FAST, limited)
    route = post(http, path, as_json(rs, 1), ROUTE, limited)
    assert answer(fast) == answer(route)
    assert fast.status_code == 403 and fast.json()["type"].endswith(":upload-quota-exceeded"), fast.text
    assert http.get(f"/v1/studies/{study.study_id}").json()["report_count"] == 1


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_fast_answers_move_the_metrics(server):
    http, spec, study, token = server
    path = f"/v1/studies/{study.study_id}/reports"
    route = "/v1/studies/{study_id}/reports"
    scrape = lambda: http.get("/metrics", headers={"Authorization": f"Bearer {spec.operator_token}"}).text  # noqa: E731
    before = scrape()
    rs = bound(study, 4)
    sent = 0
    for i in range(3):
        body = as_json(rs, i)
        sent += len(body)
        assert post(http, path, body, FAST, token).status_code == 200
    refused = json.dumps(rs.substituted(3, "share").report(0)).encode()
    assert post(http, path, refused, FAST, token).status_code == 422
    after = scrape()

    def delta(name, **labels):
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("dpsketch_http_requests_total", route=route, method="POST", status="200") == 3
    assert delta("dpsketch_http_requests_total", route=route, method="POST", status="422") == 1
    assert delta("dpsketch_http_request_duration_seconds_count", route=route, method="POST") == 4
    assert delta("dpsketch_http_problems_total", route=route, type="binding-refused") == 1
    assert delta("dpsketch_http_request_body_bytes_total", route=route) == sent + len(refused)
    assert delta("dpsketch_upload_requests_total", study_id=study.study_id, outcome="acknowledged") == 3
    assert delta("dpsketch_upload_requests_total", study_id=study.study_id, outcome="binding-refused") == 1
    assert delta("dpsketch_upload_bytes_total", study_id=study.study_id) == sent
    assert delta("dpsketch_reports_total", study_id=study.study_id, outcome="accepted") == 3


def test_the_route_stays_in_the_openapi_document(server):
    http, *_ = server
    doc = http.get("/openapi.json").json()
    op = doc["paths"]["/v1/studies/{study_id}/reports"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/Report")
    assert {"200", "401", "404", "422", "503"} <= set(op["responses"])


def test_well_formed_uploads_skip_fastapi_and_the_rest_reach_it(tmp_path):
    """In process: count the requests the fast path hands on to FastAPI."""
    app = create_app(settings_for(tmp_path / "s1.sqlite3"))
    study = make_study()
    with TestClient(app) as client:
        client.put(f"/v1/studies/{study.study_id}", content=study.canonical(),
                   headers={"Authorization": "Bearer operator-token-0123456789", "Content-Type": FAST})
        layer = app._outer
        while not isinstance(layer, FastReports):
            layer = layer.app
        handed = []
        inner = layer.app

        async def counting(scope, receive, send):
            handed.append(scope["path"])
            await inner(scope, receive, send)

        layer.app = counting
        path = f"/v1/studies/{study.study_id}/reports"
        rs = bound(study, 2)
        r = client.post(path, content=as_json(rs, 0), headers={"Content-Type": FAST})
        assert r.status_code == 200 and handed == []
        r = client.post(path, content=as_json(rs, 1), headers={"Content-Type": ROUTE})
        assert r.status_code == 200 and handed == [path]
        r = client.post(path, content=b"{", headers={"Content-Type": FAST})
        assert r.status_code == 400 and handed == [path, path]
        assert client.get("/healthz").status_code == 200 and handed[-1] == "/healthz"


def test_report_json_of_the_sdk_is_what_the_fast_path_parses():
    """The SDK's body (Report.of, pydantic's JSON) parses the same through json.loads and
    through model_validate_json, which the fast path uses."""
    study = make_study()
    rs = bound(study, 1)
    body = Report.of(rs.ids[0], rs.proofs[0], rs.shares[0]).model_dump_json().encode()
    assert Report.model_validate_json(body) == Report.model_validate(json.loads(body))


def test_plain_report_json_reads_as_the_model_reads_it():
    """messages.report_fields (the fast path's parser of the SDK's JSON) accepts only bodies
    the model accepts, with the same decoded values; any other body it leaves to the model."""
    import random

    from dpsketch.protocol.messages import report_fields

    study = make_study()
    rs = bound(study, 1)
    sdk = Report.of(rs.ids[0], rs.proofs[0], rs.shares[0])
    plain = sdk.model_dump_json().encode()

    def model_fields(body: bytes):
        try:
            r = Report.model_validate_json(body)
        except ValueError:
            return None
        return bytes.fromhex(r.report_id), base64.b64decode(r.proof), base64.b64decode(r.share)

    want = (rs.ids[0], bytes(rs.proofs[0]), rs.shares[0].astype("<u8").tobytes())
    assert report_fields(plain) == model_fields(plain) == want
    spaced = json.dumps(sdk.model_dump(), indent=2).encode()
    assert report_fields(spaced) == want and report_fields(b" \r\n" + spaced + b"\t") == want
    d = sdk.model_dump()
    others = [
        json.dumps({k: d[k] for k in ("share", "proof", "report_id")}).encode(),  # another order
        json.dumps({**d, "extra": 1}).encode(), plain.replace(b'"proof"', b'"pro\\u006ff"'),
        json.dumps({**d, "report_id": d["report_id"].upper()}).encode(),
        json.dumps({**d, "share": d["share"][:-1]}).encode(), json.dumps({**d, "proof": "A===" + d["proof"]}).encode(),
        json.dumps({**d, "share": d["share"] + "\n"}).encode(), plain + b"x", b"\x0c" + plain, plain[:-1],
        json.dumps({**d, "share": ""}).encode(),  # taken, then refused for its length by both paths
    ]
    rng = random.Random(7)
    for _ in range(3000):  # random edits of the plain body: never accepted other than the model does
        b = bytearray(plain)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(b))
            op = rng.randrange(3)
            if op == 0:
                b[i] = rng.choice(b' \t\n\r"\\,:{}=+/Aa0f\x00\xff')
            elif op == 1:
                del b[i]
            else:
                b.insert(i, rng.choice(b' \t\n\r"=Aa0'))
        others.append(bytes(b))
    for body in others:
        got = report_fields(body)
        assert got is None or got == model_fields(body), body


def test_the_fast_path_keeps_the_admission_limit_and_counts(servers):
    """Single uploads answered by the fast path are admitted as every upload is: with room for
    one upload at a time, a flood of them gets 503 + Retry-After (the admission's answer), every
    acknowledged report is held and nothing else, the metrics count every answer once, and the
    counts of uploads in flight go back to zero. A bad report the fast path hands on to the route
    keeps its own admission (the route refuses it; it is not refused as a second upload)."""
    import asyncio

    spec = servers.spec("s1")
    proc = servers.start(spec, extra_env={**FLOORLESS, "DPSKETCH_MAX_INFLIGHT_UPLOADS": "1"}, open_uploads=False)
    study = make_study()
    token = provision_with_token(proc.url, spec.operator_token, study)
    path = f"/v1/studies/{study.study_id}/reports"
    rs = bound(study, 200)
    with httpx.Client(base_url=proc.url, timeout=30) as http:
        bad = json.dumps(rs.substituted(1, "share").report(0)).encode()
        r = both(http, path, bad, token)
        assert r.status_code == 422 and r.json()["type"].endswith(":binding-refused"), r.text

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=proc.url, timeout=30,
                                     limits=httpx.Limits(max_connections=40)) as client:
            async def one(i: int) -> httpx.Response:
                return await client.post(path, content=as_json(rs, i),
                                         headers={"Content-Type": FAST, "Authorization": f"Bearer {token}"})
            return await asyncio.gather(*(one(i) for i in range(200)))

    answers = asyncio.run(flood())
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 503}, statuses
    refused = [r for r in answers if r.status_code == 503]
    assert refused and all(r.headers["retry-after"] == "1" and r.json()["type"].endswith(":unavailable")
                           for r in refused)
    with httpx.Client(base_url=proc.url, timeout=30) as http:
        assert http.get(f"/v1/studies/{study.study_id}").json()["report_count"] == statuses.count(200)
        text = http.get("/metrics", headers={"Authorization": f"Bearer {spec.operator_token}"}).text
    route = "/v1/studies/{study_id}/reports"
    assert _metric(text, "dpsketch_http_requests_total", route=route, status="200") == statuses.count(200)
    assert _metric(text, "dpsketch_http_requests_total", route=route, status="503") == len(refused)
    assert _metric(text, "dpsketch_http_requests_total", route=route, status="422") == 2  # bad, both ways
    assert _metric(text, "dpsketch_http_request_duration_seconds_count", route=route) == 202
    assert _metric(text, "dpsketch_http_problems_total", route=route, type="unavailable") == len(refused)
    assert _metric(text, "dpsketch_upload_requests_total", outcome="acknowledged") == statuses.count(200)
    assert "\ndpsketch_uploads_in_flight 0.0\n" in text and "\ndpsketch_upload_bytes_in_flight 0.0\n" in text
    assert "\ndpsketch_http_requests_in_flight 1.0\n" in text  # the scrape itself


def test_the_acknowledgement_is_the_models_json():
    from dpsketch.protocol.messages import UploadResult
    from dpsketch.services.uploads import result_json
    from dpsketch.services.writer import Acknowledgement

    for accepted, duplicates, count in [(1, 0, 1), (0, 1, None), (1, 0, 10**12), (0, 0, 0), (7, 3, None)]:
        result = UploadResult(accepted=accepted, duplicates=duplicates, report_count=count)
        assert result_json(result) == result.model_dump_json().encode()
        assert result_json(Acknowledgement(accepted, duplicates, count)) == result.model_dump_json().encode()


def test_forged_reports_among_concurrent_singles_are_refused_alone(server):
    """The writer checks the bindings of a group of fast-path uploads at once; an attacker's
    forged reports (a substituted share or proof, another record's id, a held id with a new
    share) sent among honest clients' reports, 32 requests at a time over loopback, each get
    the route's 422 binding-refused and store nothing, while every honest report is stored
    exactly once and acknowledged: held ids are exactly the honest ones and the metrics count the
    answers (tests/test_server_unit.py checks the running totals of such a group)."""
    import asyncio

    http, spec, study, token = server
    path = f"/v1/studies/{study.study_id}/reports"
    honest = bound(study, 120)
    forged_rs = bound(study, 40)
    forged = []
    for i in range(40):
        kind = i % 4
        if kind == 0:
            forged.append(json.dumps(forged_rs.substituted(i, "share", i % 8).report(0)).encode())
        elif kind == 1:
            forged.append(json.dumps(forged_rs.substituted(i, "proof", i % 16).report(0)).encode())
        elif kind == 2:
            forged.append(as_json(forged_rs, i, report_id=honest.ids[i].hex()))  # an honest report's id
        else:
            forged.append(as_json(forged_rs, i, report_id=honest.ids[0].hex(), share=honest.report(1)["share"]))
    bodies = [(as_json(honest, i), True) for i in range(120)] + [(b, False) for b in forged]
    np.random.default_rng(5).shuffle(bodies)

    async def send_all() -> list[tuple[httpx.Response, bool]]:
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=30,
                                     limits=httpx.Limits(max_connections=32)) as client:
            async def one(body: bytes, good: bool) -> tuple[httpx.Response, bool]:
                r = await client.post(path, content=body,
                                      headers={"Content-Type": FAST, "Authorization": f"Bearer {token}"})
                return r, good
            return await asyncio.gather(*(one(b, g) for b, g in bodies))

    answers = asyncio.run(send_all())
    for r, good in answers:
        if good:
            assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
        else:
            assert r.status_code == 422 and r.json()["type"].endswith(":binding-refused"), r.text
            assert r.json()["instance"] == path
    held = http.get(f"/v1/studies/{study.study_id}/report-ids",
                    headers={"Authorization": f"Bearer {spec.analyst_token}"}).content
    assert held == b"".join(sorted(honest.ids))
    text = http.get("/metrics", headers={"Authorization": f"Bearer {spec.operator_token}"}).text
    route = "/v1/studies/{study_id}/reports"
    assert _metric(text, "dpsketch_http_requests_total", route=route, status="200") == 120
    assert _metric(text, "dpsketch_http_problems_total", route=route, type="binding-refused") == 40
    assert _metric(text, "dpsketch_reports_total", outcome="accepted") == 120


def test_a_revoked_token_is_refused_though_its_digest_is_remembered(server):
    """The fast path remembers each Authorization header's token digest (FastReports._digest),
    never whether the token is valid: after the operator revokes a token its next upload is
    refused (the route's 401, both ways) and nothing is stored; a new token works at once."""
    http, spec, study, token = server
    path = f"/v1/studies/{study.study_id}/reports"
    operator = {"Authorization": f"Bearer {spec.operator_token}"}
    rs = bound(study, 4)
    assert post(http, path, as_json(rs, 0), FAST, token).status_code == 200
    assert post(http, path, as_json(rs, 1), FAST, token).status_code == 200  # the digest remembered
    listing = http.get(f"/v1/studies/{study.study_id}/upload-tokens", headers=operator).json()
    for t in listing["tokens"]:
        r = http.delete(f"/v1/studies/{study.study_id}/upload-tokens/{t['token_id']}", headers=operator)
        assert r.status_code == 200, r.text
    r = both(http, path, as_json(rs, 2), token)
    assert r.status_code == 401 and r.json()["type"].endswith(":unauthorized"), r.text
    fresh = http.post(f"/v1/studies/{study.study_id}/upload-tokens", json={"count": 1, "quota": None},
                      headers=operator).json()["token"]
    assert post(http, path, as_json(rs, 3), FAST, fresh).json() == {"accepted": 1, "duplicates": 0,
                                                                    "report_count": 3}
    assert http.get(f"/v1/studies/{study.study_id}").json()["report_count"] == 3
