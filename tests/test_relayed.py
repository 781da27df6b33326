"""Relayed uploads (docs/protocol.md section 7b): devices through a real relay process to three real
share servers that require upload tokens, and a relay played by an adversary.

What must hold: the release is exactly the ring sum of the shares the devices prepared; a device
sends one request; the relay, which sees every entry, can neither spend a token on a batch of its
own, nor move a MAC or a batch to another device, server or study, nor make a server do a KEM
without a token; what it repeats is a duplicate and charges no quota twice; a relay killed with
SIGKILL loses nothing a device was told is stored, and the device's retry through a new relay
stores each report once.
"""

from __future__ import annotations

import contextlib
import http.server
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.client_sdk.relayed import Enrolment, RelayClient, enrol
from dpsketch.protocol import envelope, relayed, ring
from dpsketch.protocol.messages import RelayedResults
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.study import Study
from dpsketch.services.admin import ServerAdmin
from dpsketch.tools.cluster import relay as relay_process
from conftest import NO_BUDGET, cluster_for_module
from test_e2e import NO_FLOOR_POLICY

D = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three servers that require upload tokens (their default) and take floor-less studies, an
    analyzer, and a relay in front of the servers."""
    env = {**NO_FLOOR_POLICY, **NO_BUDGET, "DPSKETCH_MIN_REPORTS": "2"}  # synthetic rows: nobody's data
    with cluster_for_module(tmp_path_factory, "relayed", open_uploads=False,
                            server_env={f"s{j + 1}": env for j in range(3)}) as c:
        proc = relay_process({s.server_id: p.url for s, p in zip(c.specs, c.procs)},
                             c.procs[0].log_path.parent, None, "--window", "20").start()
        c.relay = proc
        try:
            yield c
        finally:
            proc.stop()
            for p in (proc, *c.procs):  # nothing unforeseen in the relay or a server
                log = p.log_path.read_text(errors="replace")
                assert "Traceback" not in log, (p.name, log[-3000:])


def _study(c, n: int, name: str) -> Study:
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name=name, columns=[f"x{i}" for i in range(D)], label=None,
                                  expected_reports=n, min_reports=n, kind="sketch", k=1, s=1,
                                  epsilon=1.0, delta=1e-6, row_bound=1.0, epsilon_floor=None)
    return Study.model_validate(created["study"])


def _tokens(c, study_id: str, count: int, quota: int | None = 1) -> list[list[str]]:
    """tokens[i][j]: device i's token at server j."""
    per_server = []
    for spec, proc in zip(c.specs, c.procs):
        with ServerAdmin(proc.url, spec.operator_token) as admin:
            per_server.append(admin.issue_upload_tokens(study_id, count, quota).tokens)
    return [list(t) for t in zip(*per_server)]


def _enrolment(c, study_id: str) -> Enrolment:
    with Client(c.server_urls, encrypt=True) as client:
        return enrol(client, study_id)


def _count(url: str, study_id: str) -> int:
    return httpx.get(f"{url}/v1/studies/{study_id}").json()["report_count"]


def _counts(c, study_id: str) -> list[int]:
    return [_count(u, study_id) for u in c.server_urls]


class _Capture:
    """Every batch the SDK prepares in this process (the test adds up their shares)."""

    def __init__(self, monkeypatch):
        import dpsketch.client_sdk.relayed as relayed_sdk

        self.batches, self.lock = [], threading.Lock()
        real = relayed_sdk.prepare_batch

        def wrapped(*args, **kwargs):
            batch = real(*args, **kwargs)
            with self.lock:
                self.batches.append(batch)
            return batch

        monkeypatch.setattr(relayed_sdk, "prepare_batch", wrapped)

    def ring_sum(self, n_servers: int) -> np.ndarray:
        shares = [sum((b.share(j).astype(np.uint64) for b in self.batches), np.zeros(D, np.uint64))
                  for j in range(n_servers)]
        return sum(shares, np.zeros(D, np.uint64))


# --- the format --------------------------------------------------------------------------------


def test_bundle_round_trip_and_malformed_bundles_are_named():
    e = relayed.Entry("s1", b"\x01" * 8, b"\x02" * 32, b"\x03" * 150)
    f = relayed.Entry("server-two", relayed.NO_TOKEN_ID, relayed.NO_MAC, b"\x04" * 7)
    body = relayed.encode([e, f])
    assert body[:4] == (2).to_bytes(4, "big") and len(body) == 4 + (1 + 2 + 8 + 32 + 4 + 150) + (1 + 10 + 44 + 7)
    assert relayed.decode(body) == [e, f]
    assert relayed.by_server([e, f, e]) == {"s1": [0, 2], "server-two": [1]}
    for bad, why in [(b"", "entry count"), (bytes(4), "1 to"), (body[:-1], "runs past"),
                     (body + b"x", "1 bytes follow"), ((3).to_bytes(4, "big") + body[4:], "missing"),
                     ((1).to_bytes(4, "big") + b"\x00" + body[6:], "empty server id")]:
        with pytest.raises(ValueError, match=why):
            relayed.decode(bad)


def test_the_mac_binds_token_study_server_and_batch():
    """The MAC is HMAC-SHA256 over the batch's transcript, keyed from the token's digest: any
    other token, study, server or batch header gives another MAC."""
    pk = envelope.public_key_of(envelope.generate_private_key())
    study_id, other_study = "ab" * 32, "cd" * 32
    batch = envelope.seal(envelope.Recipient("s1", pk), study_id, b"\x05" * 16, envelope.CONTENT_SEED,
                          b"\x06" * (16 * 3 + 32))
    again = envelope.seal(envelope.Recipient("s1", pk), study_id, b"\x05" * 16, envelope.CONTENT_SEED,
                          b"\x06" * (16 * 3 + 32))
    entry = relayed.make_entry("token-a" * 5, study_id, "s1", batch)
    digest = relayed.token_digest("token-a" * 5)
    assert entry.token_id == digest[:8] and relayed.verify_mac(digest, study_id, "s1", entry)
    assert not relayed.verify_mac(relayed.token_digest("token-b" * 5), study_id, "s1", entry)
    assert not relayed.verify_mac(digest, other_study, "s1", entry)
    assert not relayed.verify_mac(digest, study_id, "s2", relayed.Entry("s2", entry.token_id, entry.mac, batch))
    # the same plaintext sealed again has a fresh batch id and encapsulation: the MAC does not move
    assert not relayed.verify_mac(digest, study_id, "s1", relayed.Entry("s1", entry.token_id, entry.mac, again))
    assert relayed.make_entry(None, study_id, "s1", batch).mac == relayed.NO_MAC
    with pytest.raises(envelope.MalformedSealedBatch):
        relayed.make_entry("t" * 40, study_id, "s1", b"\x00" * 40)


# --- real servers, a real relay ------------------------------------------------------------------


def test_devices_through_a_relay_release_exactly_their_ring_sum(cluster, monkeypatch):
    """40 devices, 8 at a time, each its own RelayClient with its own tokens, one request each
    through the relay: the servers store every report once, the relay forwarded far fewer
    requests than devices sent, and the release is exactly the ring sum of the shares."""
    n = 40
    study = _study(cluster, n, "relayed-e2e")
    tokens = _tokens(cluster, study.study_id, n)
    enrolment = Enrolment.from_json(_enrolment(cluster, study.study_id).to_json())  # as a device stores it
    capture = _Capture(monkeypatch)
    rows = np.random.default_rng(7).uniform(-0.4, 0.4, size=(n, D))
    posts = []

    class Count(httpx.HTTPTransport):
        def handle_request(self, request):
            posts.append(request.url.port)
            return super().handle_request(request)

    def device(i: int) -> str:
        with RelayClient(cluster.relay.url, enrolment, tokens[i], transport=Count()) as rc:
            return rc.submit(rows[i])

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(device, range(n)))
    assert len(set(ids)) == n
    assert posts == [cluster.relay.port] * n  # one request per device, to the relay only
    assert _counts(cluster, study.study_id) == [n] * 3
    with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as an:
        fin = an.finalize(study.study_id)
        released = np.asarray(an.sketch(study.study_id)["sketch"], dtype=np.float64).reshape(-1)
    assert fin["n_reports"] == n
    exact = ring.decode(capture.ring_sum(3)[None, :], study.frac_bits).reshape(-1)
    np.testing.assert_array_equal(released, exact)
    assert np.max(np.abs(released - rows.sum(axis=0))) < 6 * np.sqrt(n) * study.sigma


def _entries(c, study: Study, token_row: list[str]) -> tuple[bytes, list[relayed.Entry]]:
    with RelayClient(c.relay.url, _enrolment(c, study.study_id), token_row) as rc:
        return rc.entries(np.full(D, 0.1))


def _post_server(url: str, study_id: str, entries) -> httpx.Response:
    return httpx.post(f"{url}/v1/studies/{study_id}/relayed", content=relayed.encode(entries),
                      headers={"Content-Type": relayed.MEDIA_TYPE}, timeout=30)


def _outcomes(r: httpx.Response) -> list[tuple[int, str | None]]:
    assert r.status_code == 200, r.text
    return [(o.status, o.problem["type"].rsplit(":", 1)[-1] if o.problem else None)
            for o in RelayedResults.model_validate_json(r.content).results]


def test_an_adversarial_relay_cannot_spend_move_or_misroute_and_changes_nothing(cluster):
    """The relay as attacker, at the servers directly: every forgery is refused with its own
    outcome, the honest entries beside it are stored, and nothing else changes."""
    study = _study(cluster, 10, "relayed-adversary")
    sid = study.study_id
    tokens = _tokens(cluster, sid, 3, quota=1)
    _, a = _entries(cluster, study, tokens[0])
    _, b = _entries(cluster, study, tokens[1])
    url0 = cluster.server_urls[0]
    honest = a[0]
    forged = [
        # a batch of its own under device b's token id, with a made-up MAC (it holds no token)
        relayed.Entry("s1", b[0].token_id, bytes(32), b[0].batch),
        # device a's MAC moved onto device b's batch
        relayed.Entry("s1", a[0].token_id, a[0].mac, b[0].batch),
        # device b's entry for server 2 delivered to server 1 as it is
        b[1],
        # ... and relabelled for server 1 (its MAC and its HPKE context name server 2)
        relayed.Entry("s1", b[1].token_id, b[1].mac, b[1].batch),
        # no token at all
        relayed.Entry("s1", relayed.NO_TOKEN_ID, relayed.NO_MAC, b[0].batch),
        # an id that is no token of the study
        relayed.Entry("s1", b"\x07" * 8, b[0].mac, b[0].batch),
        # not a sealed batch
        relayed.Entry("s1", b[0].token_id, b[0].mac, b"\x00" * 30),
    ]
    before = _counts(cluster, sid)
    got = _outcomes(_post_server(url0, sid, [honest, *forged]))
    assert got == [(200, None), (401, "unauthorized"), (401, "unauthorized"), (422, "sealed-share-refused"),
                   (401, "unauthorized"), (401, "unauthorized"), (401, "unauthorized"), (400, "malformed-body")]
    assert _counts(cluster, sid) == [before[0] + 1, before[1], before[2]]
    # a repeated entry is a duplicate, and charges no quota (device a's token has quota 1)
    assert _outcomes(_post_server(url0, sid, [honest, honest])) == [(200, None), (200, None)]
    assert _counts(cluster, sid)[0] == before[0] + 1
    # device b's honest entry still goes in: the forgeries spent nothing of its quota
    assert _outcomes(_post_server(url0, sid, [b[0]])) == [(200, None)]
    # and a second report under device a's token is past its quota of 1
    _, a2 = _entries(cluster, study, tokens[0])
    assert _outcomes(_post_server(url0, sid, [a2[0]])) == [(403, "upload-quota-exceeded")]
    # whole-bundle refusals: not a bundle, wrong media type, another study
    r = httpx.post(f"{url0}/v1/studies/{sid}/relayed", content=b"\x00\x00", headers={"Content-Type": relayed.MEDIA_TYPE})
    assert r.status_code == 400 and r.json()["type"].endswith("malformed-body")
    r = httpx.post(f"{url0}/v1/studies/{sid}/relayed", content=relayed.encode([honest]),
                   headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 415
    other = _study(cluster, 10, "relayed-adversary-other")
    assert _outcomes(_post_server(url0, other.study_id, [honest]))[0][0] == 401  # its tokens are not the study's
    assert _counts(cluster, sid)[0] == before[0] + 2 and _count(url0, other.study_id) == 0


def test_a_relay_killed_mid_flight_loses_nothing_and_a_retry_stores_once(cluster, tmp_path):
    """A relay that holds its group for 2 s is SIGKILLed with a device's request in it: the device
    is told nothing was stored; it sends the same entries through a new relay, and every server
    holds the report once."""
    study = _study(cluster, 10, "relayed-kill")
    sid = study.study_id
    tokens = _tokens(cluster, sid, 1)
    servers = {s.server_id: p.url for s, p in zip(cluster.specs, cluster.procs)}
    slow = relay_process(servers, tmp_path, None, "--window", "2000", name="slow-relay").start()
    enrolment = _enrolment(cluster, sid)
    rc = RelayClient(slow.url, enrolment, tokens[0], max_retries=0)
    report_id, entries = rc.entries(np.full(D, 0.2))
    failed = []

    def send():
        try:
            rc.send(entries)
        except Exception as exc:  # noqa: BLE001
            failed.append(exc)

    t = threading.Thread(target=send)
    t.start()
    import time

    time.sleep(0.5)
    slow.proc.send_signal(signal.SIGKILL)
    t.join(10)
    assert failed and "relay could not be reached" in str(failed[0])
    assert _counts(cluster, sid) == [0, 0, 0]  # nothing forwarded, nothing stored
    with RelayClient(cluster.relay.url, enrolment, tokens[0]) as again:
        outcomes = again.send(entries)
        outcomes2 = again.send(entries)  # and once more: duplicates, quota 1 not exceeded
    assert [o.result.accepted for o in outcomes] == [1, 1, 1]
    assert [o.result.duplicates for o in outcomes2] == [1, 1, 1]
    assert _counts(cluster, sid) == [1, 1, 1]
    rc.close()


def test_refusals_reach_the_device_as_problems(cluster):
    """A device whose token is spent gets the servers' refusal as a ProblemError naming the
    server; a relay asked to forward to a server it does not know refuses the request (4xx)."""
    study = _study(cluster, 10, "relayed-refusals")
    tokens = _tokens(cluster, study.study_id, 1, quota=1)
    enrolment = _enrolment(cluster, study.study_id)
    with RelayClient(cluster.relay.url, enrolment, tokens[0]) as rc:
        rc.submit(np.zeros(D))
        with pytest.raises(ProblemError) as info:
            rc.submit(np.zeros(D))
    assert info.value.status == 403 and info.value.slug == "upload-quota-exceeded"
    assert info.value.server_id in study.servers
    stray = relayed.Entry("nobody", relayed.NO_TOKEN_ID, relayed.NO_MAC, b"\x01" * 40)
    r = httpx.post(f"{cluster.relay.url}/v1/studies/{study.study_id}/relayed", content=relayed.encode([stray]),
                   headers={"Content-Type": relayed.MEDIA_TYPE})
    assert r.status_code == 422 and "nobody" in r.json()["detail"]
    r = httpx.post(f"{cluster.relay.url}/v1/studies/not-a-study/relayed", content=b"x",
                   headers={"Content-Type": relayed.MEDIA_TYPE})
    assert r.status_code == 422
    r = httpx.post(f"{cluster.relay.url}/v1/studies/{study.study_id}/relayed", content=b"\x00\x00\x00\x01",
                   headers={"Content-Type": relayed.MEDIA_TYPE})
    assert r.status_code == 400
    # past the relay's device limit (4 MiB by default): 413, refused unread, the connection closed
    r = httpx.post(f"{cluster.relay.url}/v1/studies/{study.study_id}/relayed", content=bytes(5 << 20),
                   headers={"Content-Type": relayed.MEDIA_TYPE})
    assert r.status_code == 413 and r.json()["type"].endswith("payload-too-large")
    assert r.headers.get("connection") == "close"
    assert httpx.get(f"{cluster.relay.url}/healthz").status_code == 200  # and the relay serves on


def test_a_study_id_with_a_trailing_newline_is_refused_not_forwarded(cluster):
    """A device's honest entries posted to ``.../studies/{id}%0A/relayed``: the relay refuses the
    path's study id (422: a study id is 64 hex characters and nothing after), before anything is
    forwarded, where ``re.match``'s ``$`` let "id\n" through and the relay forwarded it (its
    servers' 502s answered with 200); the same entries under the right path are then stored once."""
    study = _study(cluster, 10, "relayed-newline")
    tokens = _tokens(cluster, study.study_id, 1)
    _, entries = _entries(cluster, study, tokens[0])
    forwarded = httpx.get(f"{cluster.relay.url}/v1/relay").json()["bundles_forwarded"]
    r = httpx.post(f"{cluster.relay.url}/v1/studies/{study.study_id}%0A/relayed", content=relayed.encode(entries),
                   headers={"Content-Type": relayed.MEDIA_TYPE})
    assert r.status_code == 422 and r.json()["type"].endswith("invalid-request"), r.text
    assert httpx.get(f"{cluster.relay.url}/v1/relay").json()["bundles_forwarded"] == forwarded
    assert _counts(cluster, study.study_id) == [0, 0, 0]
    r = httpx.post(f"{cluster.relay.url}/v1/studies/{study.study_id}/relayed", content=relayed.encode(entries),
                   headers={"Content-Type": relayed.MEDIA_TYPE})
    assert r.status_code == 200 and [o for o, _ in _outcomes(r)] == [200, 200, 200], r.text
    assert _counts(cluster, study.study_id) == [1, 1, 1]


def test_names_and_ids_are_matched_whole_not_up_to_a_trailing_newline(tmp_path):
    """A column, a party and a server id that end in a newline are refused (``$`` under
    re.match also matched before a final newline: a study the TypeScript client and JSON Schema
    refuse validated here); the same names without it pass."""
    from dpsketch.protocol.parties import Party
    from dpsketch.services.settings import Settings

    tokens = {"operator_token": "operator-secret", "analyst_token": "analyst-secret"}
    made = Study.model_validate({**_plain_study_doc(), "columns": ["x0", "x1"]})
    assert made.columns == ["x0", "x1"]
    with pytest.raises(ValueError, match="column name"):
        Study.model_validate({**_plain_study_doc(), "columns": ["x0", "x1\n"]})
    with pytest.raises(ValueError, match="server id"):
        Study.model_validate({**_plain_study_doc(), "servers": ["a", "b\n"]})
    assert Party(name="a", columns=["x0"], row_bound=1.0).name == "a"
    with pytest.raises(ValueError, match="party name"):
        Party(name="a\n", columns=["x0"], row_bound=1.0)
    with pytest.raises(ValueError, match="server id"):
        Settings(server_id="s1\n", db_path=tmp_path / "s.sqlite3", **tokens)
    assert Settings(server_id="s1", db_path=tmp_path / "s.sqlite3", **tokens).server_id == "s1"


def _plain_study_doc() -> dict:
    from studies import make_study

    return make_study(["x0", "x1"], 100).model_dump(mode="json")


async def _first_bundle_out(window_s: float):
    """A Relay (services/relay.py) driven directly, with device 1's entry already out as bundle 1:
    its window timers fire only when the test calls them (held in ``timers`` as (callback,
    args); timers[0], group 1's, has fired), and its forward is a stand-in that records each
    bundle's size in ``sent``, holds bundle 1 until ``back`` is set, and stores every entry.
    ``first`` is device 1's submission; ``entry`` another device's entry of the same study.
    ``del loop.call_later`` gives the loop its own timers back."""
    import asyncio
    from types import SimpleNamespace

    from dpsketch.services.relay import Relay

    loop = asyncio.get_running_loop()
    timers: list = []
    real_call_later = loop.call_later

    def held_timer(delay, callback, *args):  # fires when the test says so, not by the clock
        timers.append((callback, args))
        return real_call_later(3600.0, lambda: None)

    loop.call_later = held_timer  # type: ignore[method-assign]
    relay = Relay({"s1": "http://127.0.0.1:9"}, window_s=window_s, max_entries=256)
    back = asyncio.Event()
    sent: list[int] = []

    async def forward(study_id, server_id, entries):
        sent.append(len(entries))
        if len(sent) == 1:
            await back.wait()
        return [{"status": 200, "result": {"accepted": 1, "duplicates": 0}, "problem": None}] * len(entries)

    relay._post = forward  # type: ignore[method-assign]
    study_id = "a" * 64
    entry = relayed.Entry("s1", relayed.NO_TOKEN_ID, relayed.NO_MAC, b"\x01" * 40)
    first = asyncio.ensure_future(relay.submit(study_id, [entry]))
    await asyncio.sleep(0)
    callback, args = timers[0]
    callback(*args)  # group 1's window is over: bundle 1 goes out
    await asyncio.sleep(0)
    assert sent == [1]
    return SimpleNamespace(loop=loop, relay=relay, timers=timers, back=back, sent=sent, first=first,
                           study_id=study_id, entry=entry)


def test_a_window_that_ends_a_hair_early_while_a_bundle_is_out_still_sends_its_group():
    """The relay's grouping (services/relay.py, driven directly; its forward a stand-in): bundle 1
    is out when group 2's window timer fires, a hair before group 2's due time by the loop's clock
    (uvloop fires timers up to 0.5 ms early), and bundle 1 comes back within that hair. Group 2
    must go when bundle 1 is back. It did not: the returning bundle compared the clock with the
    due time, the timer had already fired, and the group waited until devices' retries filled it
    to max_entries (in the benchmark: all 64 devices unanswered for 3 x 30 s, 3 runs in about
    35). The timers here fire only when the test fires them."""
    import asyncio

    async def scenario() -> tuple[list[int], list]:
        t = await _first_bundle_out(window_s=0.05)
        second = asyncio.ensure_future(t.relay.submit(t.study_id, [t.entry]))
        await asyncio.sleep(0)
        callback, args = t.timers[1]
        callback(*args)  # group 2's timer, before its due time, while bundle 1 is out: it cannot go yet
        assert t.sent == [1]
        del t.loop.call_later  # the loop's own timers again (wait_for's below)
        t.back.set()  # bundle 1 back within that hair
        await asyncio.wait_for(t.first, 10)
        outcomes = await asyncio.wait_for(second, 10)  # old code: never answered
        return t.sent, outcomes

    sent, outcomes = asyncio.run(scenario())
    assert sent == [1, 1] and outcomes[0]["status"] == 200


def test_a_window_whose_timer_fires_after_the_bundle_is_back_sends_its_group_then():
    """The other order (services/relay.py, driven directly as above): group 2's due time passes
    while bundle 1 is out (a zero window), but its timer has not fired when bundle 1 comes back
    (a loop running late). The returning bundle leaves it (it judges by the timer's flag, not the
    clock), and its timer, which is still set, sends it when it fires: the group is never held
    past its timer. Fails if the timer's wake-up does not send a group after its server's bundle
    is back."""
    import asyncio

    async def scenario() -> tuple[list[int], list]:
        t = await _first_bundle_out(window_s=0.0)
        second = asyncio.ensure_future(t.relay.submit(t.study_id, [t.entry]))
        await asyncio.sleep(0)
        assert t.relay._groups[(t.study_id, "s1")].due <= t.loop.time()  # group 2's window is over by the clock
        t.back.set()  # bundle 1 back before group 2's timer fired
        await asyncio.wait_for(t.first, 10)
        callback, args = t.timers[1]
        del t.loop.call_later  # the loop's own timers again (wait_for's below)
        callback(*args)  # group 2's timer, late
        outcomes = await asyncio.wait_for(second, 10)
        return t.sent, outcomes

    sent, outcomes = asyncio.run(scenario())
    assert sent == [1, 1] and outcomes[0]["status"] == 200


def test_an_enrolment_refuses_keys_that_do_not_match_the_study():
    """An enrolment is one key per server of the study, in its order, no key twice."""
    from test_server_unit import make_study

    study = make_study()
    keys = [envelope.public_key_of(envelope.generate_private_key()) for _ in study.servers]
    ok = Enrolment(study, tuple(envelope.Recipient(s, k) for s, k in zip(study.servers, keys)))
    assert Enrolment.from_json(ok.to_json()) == ok
    with pytest.raises(ValueError, match="one key per server"):
        Enrolment(study, tuple(envelope.Recipient(s, k) for s, k in zip(reversed(study.servers), keys)))
    with pytest.raises(ValueError, match="share a public key"):
        Enrolment(study, tuple(envelope.Recipient(s, keys[0]) for s in study.servers))



def test_a_server_with_relayed_uploads_off_refuses_every_bundle_and_stores_nothing(servers):
    """``--relayed-uploads off`` (here its environment variable): a bundle of good entries gets 403
    forbidden whole, nothing is stored, and /v1/info's policy says so; the same batch sent
    directly with its bearer token is stored."""
    from conftest import NO_BUDGET as no_budget
    from studies import make_study, provision_with_token

    spec = servers.spec("a")  # make_study's servers are "a" and "b"
    proc = servers.start(spec, extra_env={"DPSKETCH_RELAYED_UPLOADS": "off", "DPSKETCH_MAX_FLOOR_EPSILON": "none",
                                          **no_budget}, open_uploads=False)
    study = make_study([f"x{i}" for i in range(D)], 100, epsilon_floor=None)
    token = provision_with_token(proc.url, spec.operator_token, study)
    info = httpx.get(f"{proc.url}/v1/info").json()
    assert info["policy"]["relayed_uploads"] is False
    hpke = info["hpke"]
    key = next(bytes.fromhex(k["public_key"]) for k in hpke["keys"] if k["key_id"] == hpke["current"])
    from dpsketch.client_sdk import prepare, sealing

    batch = prepare.prepare_batch(study, np.full((1, D), 0.1))
    body, _ = sealing.wire(envelope.Recipient("a", key), study, study.study_id, batch.body(0), batch.media_type(0))
    entry = relayed.make_entry(token, study.study_id, "a", bytes(body))
    r = _post_server(proc.url, study.study_id, [entry])
    assert r.status_code == 403 and r.json()["type"].endswith("forbidden") and "relayed-uploads off" in r.json()["detail"]
    assert _count(proc.url, study.study_id) == 0
    r = httpx.post(f"{proc.url}/v1/studies/{study.study_id}/batches", content=bytes(body),
                   headers={"Content-Type": "application/x-dpsketch-sealed", "Authorization": f"Bearer {token}"})
    assert r.status_code == 200 and _count(proc.url, study.study_id) == 1


def test_a_relay_splits_groups_past_its_entry_and_byte_caps(cluster, tmp_path):
    """A relay whose window holds 12 devices' entries but whose bundles take at most 5 entries and
    1 byte sends each entry in a bundle of its own (a bundle always holds one), and one of at most
    5 entries when only the count binds: every report is stored once either way."""
    servers = {s.server_id: p.url for s, p in zip(cluster.specs, cluster.procs)}
    for name, args, most in [("byte-capped", ("--max-bundle-bytes", "1"), 1), ("entry-capped", ("--max-entries", "5"), 5)]:
        study = _study(cluster, 12, f"relayed-{name}")
        tokens = _tokens(cluster, study.study_id, 12)
        enrolment = _enrolment(cluster, study.study_id)
        proc = relay_process(servers, tmp_path, None, "--window", "300", *args, name=name).start()
        try:
            from concurrent.futures import ThreadPoolExecutor

            def device(i: int, url=proc.url, enrolment=enrolment, tokens=tokens) -> str:
                with RelayClient(url, enrolment, tokens[i]) as rc:
                    return rc.submit(np.full(D, 0.05 * i))

            with ThreadPoolExecutor(12) as pool:
                assert len(set(pool.map(device, range(12)))) == 12
            stats = httpx.get(f"{proc.url}/v1/relay").json()
        finally:
            proc.stop()
        assert stats["entries_forwarded"] == 36
        assert stats["bundles_forwarded"] >= -(-36 // most)  # no bundle past its cap (uncapped: about 3)
        assert _counts(cluster, study.study_id) == [12, 12, 12]


def test_a_device_whose_share_is_not_bound_to_its_id_is_refused_alone(cluster):
    """A malicious device seals, and MACs with its own token, a share other than the one its
    report id commits to: that entry gets 422 binding-refused and is not stored, and an honest
    device's entry in the same bundle is (the one-share entries go through the writer's group
    binding check, services/relayed_uploads.py)."""
    from dpsketch.client_sdk import prepare, sealing

    study = _study(cluster, 10, "relayed-unbound")
    sid = study.study_id
    tokens = _tokens(cluster, sid, 2)
    enrolment = _enrolment(cluster, sid)
    batch = prepare.prepare_batch(study, np.full((1, D), 0.3))
    body = bytearray(batch.body(0))
    body[-1] ^= 0x01  # the share's last byte: the id no longer commits to it
    sealed, _ = sealing.wire(enrolment.recipients[0], study, sid, bytes(body), batch.media_type(0))
    forged = relayed.make_entry(tokens[0][0], sid, "s1", bytes(sealed))
    _, honest = _entries(cluster, study, tokens[1])
    got = _outcomes(_post_server(cluster.server_urls[0], sid, [forged, honest[0]]))
    assert got == [(422, "binding-refused"), (200, None)]
    assert _count(cluster.server_urls[0], sid) == 1


def test_a_validity_study_through_the_relay_verifies_and_releases(cluster):
    """A study with validity proofs (docs/protocol.md section 4c) takes relayed entries as it takes
    sealed batches: the leader's share with its proof share, the helpers' seeds. 20 devices through
    the relay; the servers' verification round accepts every report and the analyzer releases all
    20, within the noise of the rows' sum."""
    n = 20
    with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as an:
        created = an.create_study(name="relayed-validity", columns=[f"x{i}" for i in range(D)], label=None,
                                  expected_reports=n, min_reports=n, kind="sketch", k=1, s=1, epsilon=1.0,
                                  delta=1e-6, row_bound=1.0, epsilon_floor=None, validity=True)
    study = Study.model_validate(created["study"])
    assert study.validity is not None
    tokens = _tokens(cluster, study.study_id, n)
    enrolment = _enrolment(cluster, study.study_id)
    rows = np.random.default_rng(11).uniform(-0.4, 0.4, size=(n, D))
    for i in range(n):
        with RelayClient(cluster.relay.url, enrolment, tokens[i]) as rc:
            rc.submit(rows[i])
    assert _counts(cluster, study.study_id) == [n] * 3
    with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as an:
        fin = an.finalize(study.study_id)
        released = np.asarray(an.sketch(study.study_id)["sketch"], dtype=np.float64).reshape(-1)
    assert fin["state"] == "released" and fin["n_reports"] == n, fin
    assert np.max(np.abs(released - rows.sum(axis=0))) < 6 * np.sqrt(n) * study.sigma


class _StandInRelay(http.server.BaseHTTPRequestHandler):
    """A relay played by a real socket server, for RelayClient's own behaviour: each test's
    subclass says what a POST gets; :meth:`stored` answers a device's 3 entries as stored."""

    def stored(self) -> None:
        payload = RelayedResults(results=[{"status": 200, "result": None, "problem": None}] * 3).model_dump_json()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload.encode())

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _serving(handler: type[_StandInRelay]):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_busy_relay_is_waited_out_for_as_long_as_its_retry_after_says(cluster):
    """A relay that answers 503 with Retry-After (it holds too many bytes, services/relay.py) is
    asked again no sooner than it said, with the same bytes; backoff 0 leaves Retry-After the only
    reason to wait."""
    study = _study(cluster, 50, "relayed-retry-after")
    bodies: list[tuple[float, bytes]] = []

    class Busy(_StandInRelay):
        def do_POST(self):  # noqa: N802  (http.server's name)
            bodies.append((time.monotonic(), self.rfile.read(int(self.headers["Content-Length"]))))
            if len(bodies) > 1:
                self.stored()
                return
            self.send_response(503)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()

    with _serving(Busy) as url, RelayClient(url, _enrolment(cluster, study.study_id), backoff=0.0,
                                            max_retries=2) as rc:
        rc.submit(np.full(D, 0.1))
    assert len(bodies) == 2 and bodies[0][1] == bodies[1][1]
    assert bodies[1][0] - bodies[0][0] >= 1.0


def test_a_kept_connection_the_relay_closed_is_replaced_without_a_retry(cluster):
    """RelayClient keeps its connection between requests; a relay that closed it while idle (its
    keep-alive timeout) costs no attempt: with max_retries=0 the second submission still goes,
    on a new connection. The stand-in answers HTTP/1.1 without 'Connection: close' and then
    closes, as an idle timeout does."""
    study = _study(cluster, 50, "relayed-kept-connection")
    peers: list[int] = []

    class ClosesWhenIdle(_StandInRelay):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802  (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            peers.append(self.client_address[1])
            self.stored()
            self.close_connection = True  # after the answer, without telling the client

    with _serving(ClosesWhenIdle) as url, RelayClient(url, _enrolment(cluster, study.study_id),
                                                      max_retries=0) as rc:
        rc.submit(np.full(D, 0.1))
        rc.submit(np.full(D, 0.2))
    assert len(peers) == 2 and peers[0] != peers[1]  # two connections, no attempt lost
