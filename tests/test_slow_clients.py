"""Slow and excess connections ("slowloris") against a real share-server process.

A server kept every connection that never finished its request headers open forever: 1,100
such connections from one address made it unreachable at 1,024 open files (accept() fails with
EMFILE, new clients are dropped). Now (dpsketch/serving.py) a connection must send its request
head within --header-timeout and its body within --body-timeout, each extended 1 s per
--min-rate bytes received, and one address may hold at most --max-connections-per-ip
connections: the excess is closed as soon as it is accepted.

The flood test reproduces the original failure: the server runs with RLIMIT_NOFILE 1024 for
both the soft and the hard limit (so raising soft to hard at startup gains nothing) and 1,100
connections from 127.0.0.2 each send part of a request head and then nothing. Settings come
from the DPSKETCH_* environment fallbacks of the flags; timeouts are short so the file runs in
seconds. ``pytest -s`` prints the measured figures.
"""

from __future__ import annotations

import os
import resource
import selectors
import signal
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import Servers
from dpsketch.tools.cluster import ManagedProcess, share_server
from envguard import unavailable

FLOOD = 1100
NOFILE = 1024  # the server's soft and hard RLIMIT_NOFILE in the flood test
PER_IP = 100
HEADER_TIMEOUT = 2.0
DEFAULT_MIN_RATE = 500.0
PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"  # a request head that never ends
#: "closed at once": a refused connection is closed this long before the held ones' deadline at the
#: latest (the refusals were measured at 0.0-0.57 s on a machine at load 13-19, the deadline is 2.06 s)
AT_ONCE_BEFORE_DEADLINE = 1.0
EARLY = 0.05  # clock slack: a deadline may not be met earlier than this
LATE = 1.0  # and not later than this (timer, scheduling, a busy CI machine)
LEGIT_BOUND = 2.0  # a legitimate GET /healthz during the flood answers within this
LEGIT_DURING_HOLD = 3  # at least this many are answered while the held connections are open

# Server for the slow-client tests: 1 s for a request head, 1.5 s for a body, 5 B/s min rate
# (each byte received buys 0.2 s).
SLOW_HEADER, SLOW_BODY, SLOW_RATE = 1.0, 1.5, 5.0

# Runs the server under a fixed RLIMIT_NOFILE: set it, then exec the real command (same pid).
_EXEC_WITH_NOFILE = ("import os, resource, sys; n = int(sys.argv[1]); "
                     "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
                     "os.execv(sys.argv[2], sys.argv[2:])")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def start_server(servers: Servers, env: dict[str, str], nofile: int | None = None) -> ManagedProcess:
    proc = share_server(servers.spec("s1"), servers.workdir, env)
    if nofile is not None:
        proc.argv = [sys.executable, "-c", _EXEC_WITH_NOFILE, str(nofile), *proc.argv]
    servers.started.append(proc)
    return proc.start()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((source, 0))  # Linux routes all of 127/8 to lo
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def get_healthz(port: int) -> tuple[int | None, float]:
    """GET /healthz on a fresh connection from 127.0.0.1, as a new client would: (status, seconds)."""
    t = time.monotonic()
    try:
        with connect(port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
        status: int | None = int(response.split(b" ", 2)[1])
    except (OSError, IndexError, ValueError):
        status = None
    return status, time.monotonic() - t


def ms(latencies: list[float]) -> str:
    return f"p50 {statistics.median(latencies) * 1000:.2f} ms, max {max(latencies) * 1000:.2f} ms"


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length body, read from a blocking socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def wait_closed(socks: list[socket.socket],
                until: float) -> tuple[dict[socket.socket, float], dict[socket.socket, bytes]]:
    """Read every socket until the server closes it (EOF or reset) or ``until``; return when
    each was closed (time.monotonic) and what the server sent on it."""
    sel = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
    closed: dict[socket.socket, float] = {}
    got = {sock: b"" for sock in socks}
    try:
        while sel.get_map() and (left := until - time.monotonic()) > 0:
            for key, _ in sel.select(timeout=left):
                sock = key.fileobj
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionError:
                    data = b""
                if data:
                    got[sock] += data
                    continue
                closed[sock] = time.monotonic()
                sel.unregister(sock)
    finally:
        sel.close()
    return closed, got


@pytest.fixture
def many_fds() -> Iterator[None]:
    """The flood needs more descriptors than the usual soft limit of 1,024 in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        unavailable(f"needs RLIMIT_NOFILE >= {need} for the client side (hard limit {hard})")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_slowloris_flood_from_one_address_leaves_the_server_reachable(servers, many_fds):
    proc = start_server(servers, {"DPSKETCH_HEADER_TIMEOUT": str(HEADER_TIMEOUT),
                                  "DPSKETCH_MAX_CONNECTIONS_PER_IP": str(PER_IP)}, nofile=NOFILE)
    pid = proc.proc.pid
    base_fds = open_fds(pid)
    quiet = sorted(get_healthz(proc.port)[1] for _ in range(20))  # latency without the flood

    peak = [base_fds]
    stop = threading.Event()

    def sample_fds() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], open_fds(pid))
            time.sleep(0.002)

    legit: list[tuple[int | None, float]] = []
    legit_ends: list[float] = []  # when each legitimate request was answered

    def legit_client() -> None:
        for _ in range(20):
            legit.append(get_healthz(proc.port))
            legit_ends.append(time.monotonic())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample_fds, daemon=True)
    sampler.start()
    flood: dict[socket.socket, float] = {}
    try:
        t0 = time.monotonic()
        for _ in range(FLOOD):
            sock = connect(proc.port, "127.0.0.2")
            flood[sock] = time.monotonic()
            try:
                sock.sendall(PARTIAL)
            except OSError:  # already refused by the server: counted below
                pass
        opened = time.monotonic() - t0
        client = threading.Thread(target=legit_client, daemon=True)
        client.start()
        closed, got = wait_closed(list(flood), until=time.monotonic() + HEADER_TIMEOUT + 5)
        client.join(30)
        stop.set()
        sampler.join()

        after = [closed[s] - t for s, t in flood.items() if s in closed]
        # held (within the per-IP cap) or refused is told by what the server sent, not by a
        # timing threshold a loaded machine can cross: a held connection is answered 408 at its
        # header deadline, a refused one is closed without a word
        held = {s for s in flood if got[s].startswith(b"HTTP/1.1 408 ")}
        at_once = [closed[s] - t for s, t in flood.items() if s in closed and s not in held]
        kept = [closed[s] - t for s, t in flood.items() if s in closed and s in held]
        expected = HEADER_TIMEOUT + len(PARTIAL) / DEFAULT_MIN_RATE  # the deadline, bytes included
        answered_408 = len(held)
        latencies = [lat for _, lat in legit]
        print(f"\nflood: {FLOOD} connections from 127.0.0.2 opened in {opened:.2f}s against RLIMIT_NOFILE "
              f"{NOFILE}:{NOFILE}; closed at once (per-IP cap {PER_IP}): {len(at_once)}, "
              f"kept: {len(kept)}, never closed: {FLOOD - len(after)}")
        if kept:
            print(f"kept ones closed after {min(kept):.3f}..{max(kept):.3f}s (deadline {expected:.3f}s = "
                  f"header timeout {HEADER_TIMEOUT}s + {len(PARTIAL)} B / {DEFAULT_MIN_RATE:g} B/s); "
                  f"408 first: {answered_408}")
        print(f"server fds: {base_fds} before, peak {peak[0]} during the flood")
        print(f"legit GET /healthz (new connection each) during the flood: {len(legit)} requests, "
              f"statuses {sorted(set(s for s, _ in legit), key=str)}, latency {ms(latencies)} "
              f"(without the flood: {ms(quiet)})")

        assert all(status == 200 for status, _ in legit), legit
        assert max(latencies) < LEGIT_BOUND, latencies
        assert len(after) == FLOOD, "the server left flood connections open past the header timeout"
        assert len(kept) == PER_IP and len(at_once) == FLOOD - PER_IP
        assert max(at_once) <= expected - AT_ONCE_BEFORE_DEADLINE, max(at_once)  # refused, not held
        # answered while the flood held its connections (until the last held one was closed):
        # counted, not timed as a whole (all 20 inside the 1.6 s window after the flood opened is
        # a rate a loaded machine may miss; CI once took 1.8 s for them)
        during_hold = sum(end < max(closed[s] for s in held) for end in legit_ends)
        assert during_hold >= LEGIT_DURING_HOLD, (during_hold, "the legitimate requests must run while the flood is held")
        assert expected - EARLY <= min(kept) and max(kept) <= expected + LATE, (min(kept), max(kept))
        assert answered_408 == PER_IP  # each had sent part of a request: told why
        assert peak[0] <= base_fds + PER_IP + 16, (base_fds, peak[0])
    finally:
        stop.set()
        for sock in flood:
            sock.close()

    assert httpx.get(proc.url + "/healthz", timeout=5).status_code == 200
    deadline = time.monotonic() + 5
    while open_fds(pid) > base_fds + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"after the flood: GET /healthz 200, server fds {open_fds(pid)}")
    assert open_fds(pid) <= base_fds + 2


MANY_ADDRESSES, PER_ADDRESS = 18, 240  # issue 41's flood: 4,320 connections, each address under its cap


def test_a_flood_from_many_addresses_leaves_a_legitimate_client_answered(servers):
    """Issue 41: per-address caps do not stop a flood from many addresses. 18 loopback addresses
    x 240 connections (each under the per-address cap of 256) that send part of a request head
    and stop filled the 4,096 slots, and a legitimate client got 0 of 8 answers. Now a newcomer
    at the cap evicts the connection that has waited longest for its client (at least 1 s):
    the legitimate client is answered 8 times of 8 while the flood is held."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = MANY_ADDRESSES * PER_ADDRESS + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        unavailable(f"needs RLIMIT_NOFILE >= {need} for the client side (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(need, soft), hard))
    proc = start_server(servers, {"DPSKETCH_HEADER_TIMEOUT": "30"})  # the flood stays held throughout
    pid = proc.proc.pid
    flood: list[socket.socket] = []
    refused = 0
    try:
        t0 = time.monotonic()
        for a in range(MANY_ADDRESSES):
            for _ in range(PER_ADDRESS):
                try:
                    sock = connect(proc.port, f"127.0.1.{a + 1}")
                    sock.sendall(PARTIAL)
                    flood.append(sock)
                except OSError:
                    refused += 1
        opened = time.monotonic() - t0
        time.sleep(1.5)  # the oldest flood connections have now waited past the eviction age
        held = open_fds(pid)
        legit = [get_healthz(proc.port) for _ in range(8)]
        latencies = [lat for _, lat in legit]
        log = proc.log_path.read_text(errors="replace")
        print(f"\nflood: {len(flood)} of {MANY_ADDRESSES * PER_ADDRESS} connections from {MANY_ADDRESSES} "
              f"addresses opened in {opened:.2f} s ({refused} refused), server fds {held}; legit GET "
              f"/healthz: {sum(s == 200 for s, _ in legit)} of 8 answered 200, {ms(latencies)}")
        assert [s for s, _ in legit] == [200] * 8, legit
        assert max(latencies) < LEGIT_BOUND, latencies
        assert held <= 4096 + 64  # the cap holds: the flood did not get more slots
        # the server logs the first refusal at once and then one summary per period (a flood
        # costs a few lines), so the evictions appear at the next summary: wait for it
        deadline = time.monotonic() + 15
        while "evicted: waited longest" not in log and time.monotonic() < deadline:
            time.sleep(0.25)
            log = proc.log_path.read_text(errors="replace")
        assert "evicted: waited longest" in log
        # the flood is still held (evictions took the oldest only): most connections still open
        closed, _ = wait_closed(flood, until=time.monotonic() + 0.5)
        assert len(closed) < len(flood) // 2
    finally:
        for sock in flood:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory) -> Iterator[tuple[ManagedProcess, str]]:
    pool = Servers(tmp_path_factory.mktemp("slow"))
    spec = pool.spec("s1")
    env = {"DPSKETCH_HEADER_TIMEOUT": str(SLOW_HEADER), "DPSKETCH_BODY_TIMEOUT": str(SLOW_BODY),
           "DPSKETCH_MIN_RATE": str(SLOW_RATE)}
    try:
        yield pool.start(spec, env), spec.operator_token
    finally:
        pool.stop_all()


def test_a_stalled_body_is_closed_after_the_body_timeout(slow_server):
    proc, token = slow_server
    head = (f"PUT /v1/studies/{'0' * 64} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    stalled, paced = connect(proc.port), connect(proc.port)
    stalled.sendall(head)
    sent = {stalled: time.monotonic()}
    paced.sendall(head)
    sent[paced] = time.monotonic()
    time.sleep(0.2)
    paced.sendall(b"12345")  # 5 body bytes at 5 B/s: 1 s more
    try:
        closed, got = wait_closed([stalled, paced], until=time.monotonic() + SLOW_BODY + 5)
        took = {s: closed[s] - sent[s] for s in closed}
        print(f"\nbody of 1000 B announced, none sent: closed after {took.get(stalled, -1):.3f}s "
              f"(body timeout {SLOW_BODY}s); 5 B sent: closed after {took.get(paced, -1):.3f}s "
              f"(+5 B / {SLOW_RATE:g} B/s = {SLOW_BODY + 5 / SLOW_RATE}s)")
        assert stalled in closed and paced in closed, "a connection with a stalled body was left open"
        assert SLOW_BODY - EARLY <= took[stalled] <= SLOW_BODY + LATE
        assert SLOW_BODY + 5 / SLOW_RATE - EARLY <= took[paced] <= SLOW_BODY + 5 / SLOW_RATE + LATE
        assert got[stalled] == b"" and got[paced] == b""  # the application owns that response: no 408
    finally:
        stalled.close()
        paced.close()
    assert httpx.get(proc.url + "/healthz", timeout=5).status_code == 200


def test_a_slow_client_that_keeps_pace_is_served_and_one_that_stops_is_cut(slow_server):
    proc, _ = slow_server
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    steady, stopper = connect(proc.port), connect(proc.port)
    steady_result: dict[str, object] = {}

    def send_steadily() -> None:
        # One byte every 0.2 s (5 B/s, the min rate: each byte buys 0.2 s) for 3 s, three
        # header timeouts; then the rest of the head at once.
        t = time.monotonic()
        try:
            for i in range(15):
                steady.sendall(request[i:i + 1])
                time.sleep(0.2)
            steady.sendall(request[15:])
            steady.settimeout(5)
            response = b""
            while chunk := steady.recv(65536):
                response += chunk
            steady_result["response"] = response
        except OSError as exc:
            steady_result["error"] = exc
        steady_result["took"] = time.monotonic() - t

    sender = threading.Thread(target=send_steadily)
    sender.start()
    stopper.sendall(request[:7])  # 7 bytes, then nothing: 1 s + 7 / 5 s
    sent = time.monotonic()
    try:
        closed, got = wait_closed([stopper], until=sent + SLOW_HEADER + 7 / SLOW_RATE + 5)
        sender.join(15)
        expected = SLOW_HEADER + 7 / SLOW_RATE
        took = closed[stopper] - sent if stopper in closed else -1.0
        print(f"\nslow head: 7 B then nothing: closed after {took:.3f}s (deadline {expected}s), "
              f"answer {got[stopper][:24]!r}; 1 B / 0.2 s for 3 s: "
              f"{steady_result.get('response', steady_result.get('error', b''))[:15]!r} "
              f"after {steady_result.get('took', -1):.2f}s")
        assert "error" not in steady_result, steady_result
        assert steady_result["response"].startswith(b"HTTP/1.1 200 ")
        assert steady_result["took"] > 3 * SLOW_HEADER  # outlived the bare header timeout
        assert expected - EARLY <= took <= expected + LATE
        assert_closing_problem(got[stopper], 408, "request-timeout")
    finally:
        steady.close()
        stopper.close()


def assert_closing_problem(answer: bytes, status: int, slug: str) -> dict:
    """``answer`` (the raw bytes a connection got before it closed) is one HTTP answer with
    ``status`` and a problem JSON body of ``slug``, announcing the close; returns the body."""
    import json

    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith(f"HTTP/1.1 {status} "), lines[0]
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    assert headers["content-type"] == "application/problem+json", headers
    assert headers["connection"] == "close" and int(headers["content-length"]) == len(body), headers
    problem = json.loads(body)
    assert problem["type"] == f"urn:dpsketch:problem:{slug}" and problem["status"] == status, problem
    assert problem["title"] and problem["detail"], problem
    return problem


@pytest.mark.parametrize("garbage", [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40),  # TLS to plain HTTP
                                     b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n",  # a header without a colon
                                     b"POST /v1/info HTTP/1.1\r\nContent-Length: -5\r\n\r\n"])
def test_bytes_that_are_not_http_get_problem_json(slow_server, garbage):
    """uvicorn answers a request it cannot parse itself, before any application code: that
    answer too is problem JSON (``malformed-request``), and the server goes on serving."""
    proc, _ = slow_server
    sock = connect(proc.port)
    try:
        sock.sendall(garbage)
        closed, got = wait_closed([sock], until=time.monotonic() + 5)
        assert sock in closed
        assert_closing_problem(got[sock], 400, "malformed-request")
    finally:
        sock.close()
    assert httpx.get(proc.url + "/healthz", timeout=5).status_code == 200


#: uvicorn's keep-alive timeout (its default; the services do not change it)
KEEP_ALIVE_S = 5.0


def test_a_request_that_arrived_while_the_server_was_stalled_is_answered(slow_server):
    """A server whose own loop stalls (here SIGSTOP; in the field a long GC or GIL hold, a
    starved or paused VM) past both its idle deadlines must still answer the requests that
    arrived meanwhile. Under uvloop the due timers run before the poll that reads them, and the
    keep-alive timeout and the idle-head deadline closed those connections with the request
    unread: the kernel sent a reset and the client saw ReadError for a request it sent in time
    (test_faults' 64-client load test met it under CI load). A connection that sent nothing is
    still closed, without a reset."""
    proc, _ = slow_server
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    waiting, idle = connect(proc.port), connect(proc.port)
    try:
        for sock in (waiting, idle):  # both keep-alive connections with one answered request
            sock.sendall(request)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(0.5)  # the server back in its poll with both timers armed (stopped mid-response
        # it would read the request before any timer ran, and the test would show nothing)
        os.kill(proc.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(KEEP_ALIVE_S + 1)  # past the keep-alive timeout and the 1 s head deadline
            waiting.sendall(request)
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        closed, got = wait_closed([waiting, idle], until=time.monotonic() + KEEP_ALIVE_S + 5)
        assert got[waiting].startswith(b"HTTP/1.1 200 "), got[waiting]  # answered: not a reset
        assert idle in closed and got[idle] == b""  # the idle one closed as before
    finally:
        waiting.close()
        idle.close()


def test_requests_past_the_in_flight_limit_get_problem_json():
    """serving.InFlightLimit (in place of uvicorn's text/plain 503): the requests inside the
    application at once are capped; one more gets 503 ``unavailable`` with Retry-After and the
    connection closed, and once one finishes the next is served. Unit level: the ASGI wrapper
    driven directly, with requests held inside the application."""
    import asyncio
    import json

    from dpsketch.serving import InFlightLimit

    async def main() -> list:
        release = asyncio.Event()
        entered = []

        async def app(scope, receive, send):
            entered.append(scope["path"])
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        limited = InFlightLimit(app, limit=3, retry_after_s=2)
        answers: dict[str, list] = {}

        def call(path: str):
            sent = answers.setdefault(path, [])

            async def send(message):
                sent.append(message)

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            return asyncio.create_task(limited({"type": "http", "path": path, "headers": []}, receive, send))

        held = [call(f"/held/{i}") for i in range(3)]
        await asyncio.sleep(0.01)
        await call("/one-more")
        assert limited.in_flight == 3 and entered == ["/held/0", "/held/1", "/held/2"]
        release.set()
        await asyncio.gather(*held)
        await call("/after")
        assert limited.in_flight == 0
        return [answers["/one-more"], answers["/after"], entered]

    refused, after, entered = asyncio.run(main())
    start, body = refused
    headers = dict(start["headers"])
    assert start["status"] == 503 and headers[b"retry-after"] == b"2" and headers[b"connection"] == b"close"
    assert headers[b"content-type"] == b"application/problem+json"
    problem = json.loads(body["body"])
    assert problem["type"] == "urn:dpsketch:problem:unavailable" and problem["status"] == 503
    assert after[0]["status"] == 200 and entered[-1] == "/after"
