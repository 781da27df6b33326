"""Browser pages on other origins at a relay (``dpsketch relay --cors-origins``, docs/relay.md),
over real processes: one real share server, a relay listing a page's origin and a relay with
the default (none) before it.

What must hold: a listed page's preflight for a device's POST is answered (its origin, POST and
Content-Type allowed, no credentials); another origin's preflight, or one for a method or header
the relay does not take, is refused in the problem format (403 origin-not-allowed) and forwards
nothing; every answer of the device route to a listed page carries Access-Control-Allow-Origin,
a forwarded 200 and each refusal made before forwarding (400, 413, 415, 422) alike, so a page can
read why it was refused, and a full relay's 503 (over a stand-in server that holds a bundle);
``GET /v1/relay`` publishes the origins. Without the option the relay
answers no page on another origin (no header, no preflight), and a malformed origin stops it at
start with one line and a non-zero exit, as the share server's setting does (tests/test_cors.py).
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from dpsketch.protocol import relayed
from dpsketch.tools.cluster import relay as relay_process
from dpsketch.tools.cluster import share_server, start_all
from conftest import Servers

PAGE = "https://survey.example.org"
OTHER_LISTED = "http://127.0.0.1:9"
STUDY = "ab" * 32  # no study of this id at the server: its outcome is the server's 404
MAX_DEVICE_BYTES = 4096


@pytest.fixture(scope="module")
def relays(tmp_path_factory):
    """(listed, default): relays before one real share server "s1", the first allowing PAGE
    (and another origin), the second with no --cors-origins."""
    pool = Servers(tmp_path_factory.mktemp("relay-cors"))
    spec = pool.spec("s1")
    server = share_server(spec, pool.workdir)
    servers = {"s1": server.url}
    listed = relay_process(servers, pool.workdir, None, "--window", "5", "--max-device-bytes",
                           str(MAX_DEVICE_BYTES), "--cors-origins", f"{PAGE}, {OTHER_LISTED}/", name="cors-relay")
    default = relay_process(servers, pool.workdir, None, "--window", "5", name="plain-relay")
    pool.started.extend([server, listed, default])
    try:
        start_all(pool.started)
        yield listed, default
    finally:
        pool.stop_all()
    for proc in (listed, default):
        log = proc.log_path.read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]


def _preflight(url: str, origin: str, method: str = "POST", headers: str = "content-type") -> httpx.Response:
    return httpx.options(f"{url}/v1/studies/{STUDY}/relayed",
                         headers={"Origin": origin, "Access-Control-Request-Method": method,
                                  "Access-Control-Request-Headers": headers})


def _forwarded(url: str) -> tuple[int, int]:
    info = httpx.get(f"{url}/v1/relay").json()
    return info["bundles_forwarded"], info["entries_forwarded"]


def _bundle() -> bytes:
    """A device's well-formed bundle, one entry for s1 (its batch opens nowhere: the server
    refuses it, which the relay forwards back as that entry's outcome)."""
    return relayed.encode([relayed.Entry("s1", relayed.NO_TOKEN_ID, relayed.NO_MAC, bytes(64))])


def _post(url: str, origin: str | None, body: bytes, study: str = STUDY,
          content_type: str = relayed.MEDIA_TYPE) -> httpx.Response:
    headers = {"Content-Type": content_type} | ({"Origin": origin} if origin else {})
    return httpx.post(f"{url}/v1/studies/{study}/relayed", content=body, headers=headers, timeout=30)


def _slug(r: httpx.Response) -> str:
    assert r.headers["content-type"] == "application/problem+json", r.text
    return r.json()["type"].rsplit(":", 1)[-1]


def test_a_listed_page_is_answered_and_others_are_refused_forwarding_nothing(relays):
    listed, _ = relays
    info = httpx.get(f"{listed.url}/v1/relay", headers={"Origin": PAGE})
    assert info.status_code == 200 and info.headers["access-control-allow-origin"] == PAGE
    assert info.json()["cors_origins"] == [PAGE, OTHER_LISTED]  # the trailing slash dropped
    # a GET's answer may be cached: without Origin it still says it varies by Origin
    plain = httpx.get(f"{listed.url}/v1/relay")
    assert "access-control-allow-origin" not in plain.headers and "Origin" in plain.headers["vary"]
    before = _forwarded(listed.url)

    ok = _preflight(listed.url, PAGE)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
    assert "POST" in {m.strip() for m in ok.headers["access-control-allow-methods"].split(",")}
    assert "content-type" in {h.strip().lower() for h in ok.headers["access-control-allow-headers"].split(",")}
    assert "access-control-allow-credentials" not in ok.headers  # nothing but the bundle: no cookies
    assert ok.headers["access-control-max-age"] == "600"
    assert _preflight(listed.url, OTHER_LISTED).headers["access-control-allow-origin"] == OTHER_LISTED

    for origin, method, hdrs in (("https://evil.example", "POST", "content-type"),
                                 (f"{PAGE}:8443", "POST", "content-type"),  # another port, another origin
                                 (PAGE, "PUT", "content-type"), (PAGE, "POST", "authorization")):
        refused = _preflight(listed.url, origin, method, hdrs)
        assert refused.status_code == 403, (origin, method, hdrs, refused.text)
        assert _slug(refused) == "origin-not-allowed"
        assert "--cors-origins" in refused.json()["detail"]  # names the relay's setting, not the server's
    assert _forwarded(listed.url) == before  # a preflight reaches no server

    # a device's POST from an unlisted page is served as any device's, but its page cannot read it
    other = _post(listed.url, "https://evil.example", b"\x00")
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_every_device_answer_to_a_listed_page_carries_the_header(relays):
    listed, _ = relays
    before = _forwarded(listed.url)
    refusals = [  # each refused whole by the relay, before forwarding anything
        (_post(listed.url, PAGE, b"\x00\x00\x00\x01"), 400, "malformed-body"),
        (_post(listed.url, PAGE, bytes(MAX_DEVICE_BYTES + 1)), 413, "payload-too-large"),
        (_post(listed.url, PAGE, _bundle(), content_type="application/json"), 415, "unsupported-media-type"),
        (_post(listed.url, PAGE, _bundle(), study="not-a-study"), 422, "invalid-request"),
        (_post(listed.url, PAGE, relayed.encode([relayed.Entry("s9", relayed.NO_TOKEN_ID, relayed.NO_MAC,
                                                               bytes(64))])), 422, "invalid-request"),
    ]
    for r, status, slug in refusals:
        assert (r.status_code, _slug(r)) == (status, slug), r.text
        assert r.headers["access-control-allow-origin"] == PAGE, (status, r.headers)
    assert _forwarded(listed.url) == before

    forwarded = _post(listed.url, PAGE, _bundle())  # forwarded to s1, which refuses its entry
    assert forwarded.status_code == 200 and forwarded.headers["access-control-allow-origin"] == PAGE
    assert "retry-after" in forwarded.headers["access-control-expose-headers"].lower()
    (outcome,) = forwarded.json()["results"]
    assert outcome["status"] == 404 and outcome["problem"]["type"].endswith(":unknown-study"), outcome
    assert _forwarded(listed.url) == (before[0] + 1, before[1] + 1)
    # a device that is no browser (no Origin) gets the same answer through no CORS layer (a
    # POST's answer is cached nowhere: no Vary either)
    native = _post(listed.url, None, _bundle())
    assert native.status_code == 200 and native.json() == forwarded.json()
    assert not any(k.startswith("access-control-") for k in native.headers) and "vary" not in native.headers


def test_no_page_on_another_origin_by_default(relays):
    _, default = relays
    info = httpx.get(f"{default.url}/v1/relay", headers={"Origin": PAGE})
    assert info.status_code == 200 and "access-control-allow-origin" not in info.headers
    assert info.json()["cors_origins"] == []
    before = _forwarded(default.url)
    preflight = _preflight(default.url, PAGE)
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers
    assert _slug(preflight) == "method-not-allowed"
    refused = _post(default.url, PAGE, b"\x00\x00\x00\x01")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    assert _forwarded(default.url) == before


@pytest.mark.parametrize("given", ["survey.example.org/form", "https://survey.example.org/form"])
def test_a_malformed_origin_stops_the_relay_with_one_line(given, tmp_path):
    r = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "relay", "--server", "s1=http://127.0.0.1:9",
                        "--port", "0", "--cors-origins", f"{PAGE},{given}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = (r.stderr + r.stdout).strip().splitlines()
    assert lines == [f"dpsketch relay: CORS origin {given!r} is not an origin (scheme://host[:port], no path) "
                     f"nor '*' (dpsketch relay --cors-origins)"], lines


def test_a_full_relay_answers_a_listed_page_503_it_can_read(tmp_path):
    """A relay holding more than --max-pending-bytes of entries (waiting for the servers) answers
    a device 503 ``unavailable`` with ``Retry-After``, forwarding nothing of it; to a listed page
    that 503 carries Access-Control-Allow-Origin (and exposes Retry-After), or the page could
    read neither why nor when to send again. The relay is a real process; its server is a
    stand-in socket that takes the first bundle and holds it unanswered, so the relay is full
    exactly while the test asks (no timing: the stand-in says when the bundle is out)."""
    import socket
    import threading

    from dpsketch.tools.cluster import stop_all

    listener = socket.create_server(("127.0.0.1", 0))
    out, release = threading.Event(), threading.Event()

    def hold_one_bundle() -> None:  # accept the relay's forward, read its headers, answer nothing
        conn, _ = listener.accept()
        with conn:
            seen = b""
            while b"\r\n\r\n" not in seen:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                seen += chunk
            out.set()
            release.wait(300)
        listener.close()  # the relay's forward fails (502 for that entry), and any retry is refused

    holder = threading.Thread(target=hold_one_bundle, daemon=True)
    holder.start()
    server_url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    proc = relay_process({"s1": server_url}, tmp_path, None, "--window", "0", "--max-pending-bytes", "1",
                         "--timeout", "300", "--cors-origins", PAGE, name="full-relay")
    first: dict = {}
    try:
        start_all([proc])
        # the first entry is always taken (a relay holding nothing is never full); it goes at once
        sender = threading.Thread(target=lambda: first.update(r=httpx.post(
            f"{proc.url}/v1/studies/{STUDY}/relayed", content=_bundle(),
            headers={"Content-Type": relayed.MEDIA_TYPE}, timeout=300)))
        sender.start()
        assert out.wait(120), proc.log_tail()
        full = _post(proc.url, PAGE, _bundle())
        assert (full.status_code, _slug(full)) == (503, "unavailable"), full.text
        assert full.headers["retry-after"] == "1"
        assert full.headers["access-control-allow-origin"] == PAGE, full.headers
        assert "retry-after" in full.headers["access-control-expose-headers"].lower()
        release.set()
        sender.join(120)
        # the held bundle's device is answered: its entry's server could not be reached (502)
        (outcome,) = first["r"].json()["results"]
        assert first["r"].status_code == 200 and outcome["status"] == 502, first["r"].text
        # and the relay counts it as failed, not forwarded: what its operator watches
        stats = httpx.get(f"{proc.url}/v1/relay", timeout=30).json()
        assert (stats["bundles_forwarded"], stats["entries_forwarded"]) == (0, 0), stats
        assert (stats["bundles_failed"], stats["entries_failed"]) == (1, 1), stats
    finally:
        release.set()
        stop_all([proc])
        listener.close()
    assert "Traceback" not in proc.log_path.read_text(errors="replace")
