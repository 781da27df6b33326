"""The one-row client path that benchmarks/peer_flower.py times (issue 46), held against fake
servers (httpx.MockTransport): what a plaintext one-row client sends (a study request and an
upload per server, no /v1/info unless it seals), that a study's JSON is checked once per process
yet a copy that differs in anything is checked in full and refused, that a server naming another
server id is refused before any share leaves, and the client's TLS setup."""

from __future__ import annotations

import json
import ssl

import httpx
import pytest

from dpsketch.client_sdk import Client, StudyMismatch, verified
from dpsketch.client_sdk.client import _tls_context
from dpsketch.protocol.study import Study, design

SERVERS = ["s1", "s2", "s3"]


@pytest.fixture(scope="module")
def study():
    return design(name="one-row", columns=["a", "b"], label=None, servers=SERVERS, expected_reports=1000,
                  kind="sketch", k=1, s=1, min_reports=100, epsilon=1.0, delta=1e-6)[0]


class Fakes:
    """Three share servers at s1.test, s2.test, s3.test; every request recorded."""

    def __init__(self, study: Study):
        self.study = study
        self.requests: list[tuple[str, str, str]] = []
        self.tamper: dict[str, dict] = {}  # host -> members replaced in its study JSON
        self.names: dict[str, str] = {}  # host -> the server id it claims

    def handler(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        self.requests.append((host, request.method, path))
        sid = self.names.get(host, host.split(".")[0])
        if path == "/v1/info":
            return httpx.Response(200, json={"server_id": sid, "protocol": self.study.protocol, "version": "x"})
        if path == f"/v1/studies/{self.study.study_id}" and request.method == "GET":
            body = {**self.study.model_dump(mode="json"), **self.tamper.get(host, {})}
            return httpx.Response(200, json={"study_id": self.study.study_id, "server_id": sid, "status": "open",
                                             "report_count": 0, "study": body})
        if path == f"/v1/studies/{self.study.study_id}/reports" and request.method == "POST":
            return httpx.Response(200, json={"accepted": 1, "duplicates": 0, "report_count": 1})
        return httpx.Response(404, json={"type": "about:blank", "title": "no", "status": 404})

    def client(self) -> Client:
        return Client([f"http://{s}.test" for s in SERVERS], token=[f"t-{s}" for s in SERVERS], journal=False,
                      allow_insecure_http=True,
                      max_retries=0, transport=httpx.MockTransport(self.handler))

    def posts(self) -> list:
        return [r for r in self.requests if r[1] == "POST"]


def test_a_one_row_client_sends_each_server_its_study_request_then_its_share(study):
    fakes = Fakes(study)
    with fakes.client() as client:
        client.submit(study.study_id, [0.1, 0.2])
    per_server = {h: [(m, p) for host, m, p in fakes.requests if host == h] for h in (f"{s}.test" for s in SERVERS)}
    sid = study.study_id
    assert all(reqs == [("GET", f"/v1/studies/{sid}"), ("POST", f"/v1/studies/{sid}/reports")]
               for reqs in per_server.values()), per_server


def test_a_study_is_checked_once_per_process_and_a_changed_copy_in_full(study, monkeypatch):
    checks = []
    real = Study.model_validate

    def counting(raw, *args, **kwargs):
        checks.append(raw.get("sigma") if isinstance(raw, dict) else None)
        return real(raw, *args, **kwargs)

    monkeypatch.setattr(verified.Study, "model_validate", counting)
    verified.forget()
    fakes = Fakes(study)
    for _ in range(3):  # three clients, three servers each: the same JSON nine times, one check
        with fakes.client() as client:
            assert client.study(study.study_id) == study
    assert checks == [study.sigma]
    # one server lowers sigma: those bytes are new, so they are checked (and fail), every time
    fakes.tamper["s2.test"] = {"sigma": study.sigma / 10}
    for _ in range(2):
        with fakes.client() as client, pytest.raises(StudyMismatch, match="fail the protocol's checks"):
            client.study(study.study_id)
    assert checks == [study.sigma, study.sigma / 10, study.sigma / 10]
    # a copy that passes the checks but is another study (another name): refused by its hash
    fakes.tamper["s2.test"] = {"name": "another"}
    with fakes.client() as client, pytest.raises(StudyMismatch, match="holds different parameters"):
        client.study(study.study_id)
    assert fakes.posts() == []
    verified.forget()  # forgetting costs a check, nothing else
    fakes.tamper.clear()
    with fakes.client() as client:
        assert client.study(study.study_id) == study
    assert len(checks) == 5


def test_a_server_naming_another_server_gets_no_share_without_asking_info(study):
    fakes = Fakes(study)
    fakes.names["s3.test"] = "s1"  # the third URL is the first server again (an alias)
    with fakes.client() as client, pytest.raises(StudyMismatch, match="URL 3 .* is server 's1'"):
        client.submit(study.study_id, [0.1, 0.2])
    assert fakes.posts() == []
    assert not any(p == "/v1/info" for _, _, p in fakes.requests)


def test_a_sealing_client_still_reads_each_servers_keys_from_info(study):
    fakes = Fakes(study)  # these fakes publish no HPKE key: a sealing client must refuse
    with Client([f"http://{s}.test" for s in SERVERS], encrypt=True, journal=False, max_retries=0,
                transport=httpx.MockTransport(fakes.handler)) as client, pytest.raises(Exception, match="HPKE key"):
        client.submit(study.study_id, [0.1, 0.2])
    assert sorted(h for h, _, p in fakes.requests if p == "/v1/info") == [f"{s}.test" for s in SERVERS]
    assert fakes.posts() == []


def test_one_tls_context_per_client_and_none_for_http():
    http = _tls_context(["http://127.0.0.1:1", "http://localhost:2"], True)
    assert http is _tls_context(["http://a.test", "http://b.test"], "/no/such/ca.pem")  # never loaded
    assert http.verify_mode == ssl.CERT_NONE  # used by no handshake: http URLs, no redirects followed
    https = _tls_context(["https://a.test", "http://b.test"], True)
    assert https is not http and https.verify_mode == ssl.CERT_REQUIRED and https.check_hostname
    own = ssl.create_default_context()
    assert _tls_context(["https://a.test"], own) is own


def test_requests_handed_to_the_transport_carry_what_httpx_client_sent(study):
    """The SDK hands each request straight to its transport (Client._send), without
    httpx.Client's layers: the requests must carry the same headers (each server's own token, the
    client's User-Agent, httpx's defaults, the body's type), the client's timeout, and the body."""
    seen: dict[str, list[httpx.Request]] = {}
    fakes = Fakes(study)

    def recording(request: httpx.Request) -> httpx.Response:
        seen.setdefault(request.url.host, []).append(request)
        request.read()
        return fakes.handler(request)

    with Client([f"http://{s}.test" for s in SERVERS], token=[f"t-{s}" for s in SERVERS], journal=False,
                allow_insecure_http=True, max_retries=0, timeout=7.5,
                transport=httpx.MockTransport(recording)) as client:
        reference = httpx.Client(headers=client._http[0].headers).build_request("GET", "http://s1.test/x")
        client.submit(study.study_id, [0.1, 0.2])
    for s in SERVERS:
        get, post = seen[f"{s}.test"]
        for request in (get, post):
            assert request.headers["authorization"] == f"Bearer t-{s}"
            assert request.headers["user-agent"].startswith("dpsketch-client/")
            for name in ("accept", "accept-encoding", "connection"):  # httpx's defaults, as before
                assert request.headers[name] == reference.headers[name]
            assert request.extensions["timeout"] == httpx.Timeout(7.5).as_dict()
        assert post.headers["content-type"] == "application/json"
        body = json.loads(post.content)
        assert set(body) == {"report_id", "proof", "share"} and int(post.headers["content-length"]) == len(post.content)
