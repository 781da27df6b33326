"""``dpsketch relay``: one request per device in, one request per share server out
(docs/protocol.md section 7b, docs/relay.md).

A device sends its relayed bundle (one version 4 sealed batch per server, each with its upload
token's id and MAC) to ``POST /v1/studies/{study_id}/relayed`` here. The relay groups the
entries of the devices that arrive within ``--window`` (or until ``--max-entries`` wait for one
server) and forwards each server its entries as one bundle, at the same path on that server.
At most ``MAX_IN_FLIGHT`` bundles per server and study are on their way at once; a group goes
once it has waited its window and one has come back, so the groups grow with the load (as a
database's group commit does: a server's cost per bundle, one request and one durable commit, is
spread over more devices) and a quiet relay adds no more than the window.
It answers each device, once every server has answered, with its own entries' outcomes in its
order: the relay is synchronous and keeps nothing. A relay that dies loses no acknowledged
report; its devices see a broken connection and send again (reports are idempotent by id).

Why a relay at all: a one-row device otherwise sends a request to each of N servers, and each
server then pays a request, a token check and a durable commit per device. Through a relay the
device sends one request and each server one per group of devices (issue 46; docs/peer.md).

What the relay can do, and cannot (docs/trust.md): it sees server ids, token ids, report ids and
lengths; never a share, a salt or a token. It can drop, delay or repeat an entry, or answer a
device falsely (a device that must know its report is stored asks the servers, as
``dpsketch submit`` does with ``report_counts``); it cannot open, alter, move or spend one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response

import dpsketch
from dpsketch import problem_http
from dpsketch.origins import check_origins, split_origins
from dpsketch.protocol import relayed
from dpsketch.protocol.messages import RelayedResults
from dpsketch.protocol.problems import ProblemError

log = logging.getLogger("dpsketch.relay")

STUDY_ID = re.compile(r"^[0-9a-f]{64}$")

DEFAULT_WINDOW_S = 0.05
DEFAULT_MAX_ENTRIES = 256
#: a device's request: one sealed batch per server (a one-row batch is a few hundred bytes)
DEFAULT_MAX_DEVICE_BYTES = 4 << 20
#: entries waiting to be forwarded, all servers together; past it a device gets 503 (retry)
DEFAULT_MAX_PENDING_BYTES = 64 << 20
#: one bundle to a server: under a share server's default body limit, whatever the entries' size
DEFAULT_MAX_BUNDLE_BYTES = 8 << 20
RETRY_AFTER_S = 1
#: bundles on their way to one server for one study at once (more entries wait and go together)
MAX_IN_FLIGHT = 1


@dataclass
class _Group:
    """One server's entries of one study waiting to be forwarded, with each device's future."""

    entries: list[bytes] = field(default_factory=list)
    futures: list[asyncio.Future] = field(default_factory=list)
    size: int = 0
    timer: asyncio.TimerHandle | None = None
    due: float = 0.0  # the event loop's time at which it has waited its window (a rest's timer: call_at)
    #: its window's timer has fired (while a bundle of its server was out, it could not go then):
    #: what tells the returning bundle to send it, since the timer can fire before ``due`` by the
    #: loop's clock (uvloop rounds to the millisecond: up to 0.5 ms early in 28 % of 2,000 timers)
    expired: bool = False


class Relay:
    """The grouping and forwarding, apart from HTTP routing (tests drive it directly)."""

    def __init__(self, servers: dict[str, str], *, window_s: float = DEFAULT_WINDOW_S,
                 max_entries: int = DEFAULT_MAX_ENTRIES, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
                 max_bundle_bytes: int = DEFAULT_MAX_BUNDLE_BYTES, timeout: float = 30.0,
                 verify: bool | str = True):
        if not servers:
            raise ValueError("a relay forwards to at least one share server")
        self.servers = {sid: url.rstrip("/") for sid, url in servers.items()}
        self.window_s = window_s
        self.max_entries = max(1, min(max_entries, relayed.MAX_ENTRIES))
        self.max_pending_bytes = max_pending_bytes
        self.max_bundle_bytes = max_bundle_bytes
        self.timeout = timeout
        self.verify = verify
        self.pending_bytes = 0
        self.forwarded = 0  # bundles a server answered, and the entries in them (GET /v1/relay)
        self.entries_forwarded = 0
        #: bundles (and their entries) no server answer came back for, whose devices got 502
        #: upstream-failure: an unreachable server, a timeout, or an answer that was not one
        #: outcome per entry (GET /v1/relay: what an operator watches for a server gone away)
        self.failed = 0
        self.entries_failed = 0
        self._groups: dict[tuple[str, str], _Group] = {}
        self._in_flight: dict[tuple[str, str], int] = {}
        self._http: httpx.AsyncHTTPTransport | None = None
        self._timeouts: dict = {}
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        # the transport alone: the AsyncClient's own layers (URL merging, cookies, auth and
        # redirect hooks, none of which a forward uses) were a third of httpx's cost a bundle; it
        # connects to the servers directly, through no proxy the environment names
        self._http = httpx.AsyncHTTPTransport(verify=self.verify,
                                              limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
        self._timeouts = httpx.Timeout(self.timeout).as_dict()

    async def close(self) -> None:
        for key in list(self._groups):
            self._flush(key, force=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()

    async def submit(self, study_id: str, entries: Sequence[relayed.Entry]) -> list[dict]:
        """A device's entries queued to their servers; their outcomes (RelayedOutcome's JSON
        members, as the server sent them), in its order, once every server answered (or failed:
        502 upstream-failure for that server's entries)."""
        unknown = sorted({e.server_id for e in entries} - set(self.servers))
        if unknown:
            raise ProblemError("invalid-request", f"this relay forwards to servers {', '.join(sorted(self.servers))}; "
                               f"not to {', '.join(map(repr, unknown))}")
        encoded = [e.encode() for e in entries]
        size = sum(map(len, encoded))
        if self.pending_bytes and self.pending_bytes + size > self.max_pending_bytes:
            raise ProblemError("unavailable", f"the relay holds {self.pending_bytes} bytes waiting for the "
                               f"servers; retry after {RETRY_AFTER_S} s (nothing was forwarded)",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        loop = asyncio.get_running_loop()
        futures = []
        for entry, data in zip(entries, encoded):
            key = (study_id, entry.server_id)
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = _Group(due=loop.time() + self.window_s)
                group.timer = loop.call_later(self.window_s, self._expire, key)
            future = loop.create_future()
            group.entries.append(data)
            group.futures.append(future)
            group.size += len(data)
            self.pending_bytes += len(data)
            futures.append(future)
            if len(group.entries) >= self.max_entries:
                self._flush(key)
        return list(await asyncio.gather(*futures))

    def _expire(self, key: tuple[str, str]) -> None:
        """A group's window is over: send it now, or, if a bundle of its server is still out, as
        soon as that one comes back (``_forward``)."""
        group = self._groups.get(key)
        if group is not None:
            group.expired = True
        self._flush(key)

    def _flush(self, key: tuple[str, str], force: bool = False) -> None:
        """Send the group of ``key`` now, unless MAX_IN_FLIGHT of its bundles are on their way
        (then it goes when one comes back); ``force``: whatever is on its way (closing). A group
        past ``max_entries`` or ``max_bundle_bytes`` goes as several bundles."""
        loop = asyncio.get_running_loop()
        while key in self._groups and (force or self._in_flight.get(key, 0) < MAX_IN_FLIGHT):
            group = self._groups.pop(key)
            if group.timer is not None:
                group.timer.cancel()
            cut, size = 0, 0
            while cut < len(group.entries) and cut < self.max_entries and (
                    cut == 0 or size + len(group.entries[cut]) <= self.max_bundle_bytes):
                size += len(group.entries[cut])
                cut += 1
            if cut < len(group.entries):  # the rest waits for the next turn, its window and timer kept
                rest = self._groups[key] = _Group(group.entries[cut:], group.futures[cut:], group.size - size,
                                                  due=group.due, expired=group.expired)
                rest.timer = loop.call_at(group.due, self._expire, key)  # a no-op if it went first
                group = _Group(group.entries[:cut], group.futures[:cut], size)
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
            task = loop.create_task(self._forward(key, group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _forward(self, key: tuple[str, str], group: _Group) -> None:
        study_id, server_id = key
        try:
            outcomes = await self._post(study_id, server_id, group.entries)
            self.forwarded += 1
            self.entries_forwarded += len(group.entries)
        except Exception as exc:  # noqa: BLE001  the device must get an answer whatever happened
            self.failed += 1
            self.entries_failed += len(group.entries)
            log.warning("relay: forwarding %d entries to %s failed: %s", len(group.entries), server_id, exc)
            problem = ProblemError("upstream-failure", f"server {server_id} could not be reached through "
                                   f"the relay ({type(exc).__name__}); send again (reports are idempotent "
                                   f"by id)", headers={"Retry-After": str(RETRY_AFTER_S)})
            outcomes = [{"status": 502, "result": None, "problem": problem.body()}] * len(group.entries)
        finally:
            self.pending_bytes -= group.size
            self._in_flight[key] -= 1
            waiting = self._groups.get(key)
            if waiting is not None and (waiting.expired or len(waiting.entries) >= self.max_entries):
                # its window's timer fired (or it filled up) while this bundle was out: that
                # timer will not fire again, so this is the only wake-up it gets. Judged by the
                # flag alone, not the clock: a timer firing a hair before ``due`` with this bundle
                # back within that hair left the group waiting until devices' retries filled it
                # to max_entries (about 90 s with 64 devices, each waiting 30 s three times); and
                # a group whose timer has not fired yet still has it, which sends it when it
                # fires, now that this bundle is back
                self._flush(key)
        for future, outcome in zip(group.futures, outcomes):
            if not future.done():
                future.set_result(outcome)

    async def _post(self, study_id: str, server_id: str, entries: list[bytes]) -> list[dict]:
        """One bundle to one server; each entry's outcome as the server wrote it (the relay checks
        only the answer's shape: the device validates what it gets, client_sdk/relayed.py)."""
        assert self._http is not None, "Relay.start() first"
        request = httpx.Request("POST", f"{self.servers[server_id]}/v1/studies/{study_id}/relayed",
                                content=relayed.encode(entries), headers=_FORWARD_HEADERS,
                                extensions={"timeout": self._timeouts})
        resp = await self._http.handle_async_request(request)
        try:
            await resp.aread()
        finally:
            await resp.aclose()
        if resp.status_code == 200:
            results = json.loads(resp.content).get("results")
            if not isinstance(results, list) or len(results) != len(entries) or not all(
                    isinstance(r, dict) and isinstance(r.get("status"), int) for r in results):
                raise ValueError(f"server {server_id} did not answer one outcome per entry ({len(entries)})")
            return results
        problem = ProblemError.from_http(resp.status_code, resp.content)
        return [{"status": resp.status_code, "result": None, "problem": problem.body()}] * len(entries)


_FORWARD_HEADERS = {"Content-Type": relayed.MEDIA_TYPE, "User-Agent": f"dpsketch-relay/{dpsketch.__version__}"}

_DEVICE_PATH = re.compile(r"^/v1/studies/(?P<study_id>[^/]+)/relayed$")


class DeviceUploads:
    """Pure ASGI, outside FastAPI: a device's ``POST /v1/studies/{study_id}/relayed``, the one
    request the relay exists for, answered without FastAPI's routing and middleware (which cost
    the relay's event loop more than the request's work: services/uploads.py says the same of a
    share server's single upload). Everything else goes to the FastAPI app, whose route of the
    same path documents it in OpenAPI and answers it identically (it calls :func:`answer`)."""

    def __init__(self, app: Any, relay: Relay, max_device_bytes: int):
        self.app = app
        self.relay = relay
        self.max_device_bytes = max_device_bytes

    async def __call__(self, scope, receive, send) -> None:
        match = _DEVICE_PATH.fullmatch(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        try:
            body = await _read_body(receive, headers, self.max_device_bytes)
            status, payload = 200, await answer(self.relay, match["study_id"],
                                                headers.get(b"content-type", b"").decode("latin-1"), body)
        except ProblemError as exc:  # a body refused unread (413) leaves the connection unusable
            await problem_http.send_problem(scope, send, exc, close=exc.status == 413)
            return
        except Exception:  # noqa: BLE001  outside FastAPI's handlers: still problem JSON
            log.exception("relay: a device's request failed")
            await problem_http.send_problem(scope, send, ProblemError("internal-error", "unexpected relay error"),
                                            close=True)
            return
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


async def _read_body(receive, headers: dict, limit: int) -> bytes:
    declared = headers.get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        raise ProblemError("payload-too-large", f"a device's relayed bundle is at most {limit} bytes")
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ProblemError("malformed-body", "the request body was cut short")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ProblemError("payload-too-large", f"a device's relayed bundle is at most {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


async def answer(relay: Relay, study_id: str, content_type: str, body: bytes) -> bytes:
    """A device's request judged and forwarded: the RelayedResults JSON it gets (ProblemError
    for a request refused whole: a bad study id or media type, a body that is no bundle, a
    server the relay does not know, or a relay full)."""
    if not STUDY_ID.fullmatch(study_id):
        raise ProblemError("invalid-request", "a study id is 64 lower-case hex characters")
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind != relayed.MEDIA_TYPE:
        raise ProblemError("unsupported-media-type", f"a relay takes {relayed.MEDIA_TYPE} bodies, "
                           f"not {kind or 'none'!r}")
    try:
        entries = relayed.decode(body)
    except ValueError as exc:
        raise ProblemError("malformed-body", str(exc)) from None
    outcomes = await relay.submit(study_id, entries)
    return json.dumps({"results": outcomes}, separators=(",", ":")).encode()


def create_app(relay: Relay, max_device_bytes: int = DEFAULT_MAX_DEVICE_BYTES,
               cors_origins: Sequence[str] = ()) -> Any:
    """The relay's HTTP API, an ASGI app: DeviceUploads in front of the FastAPI app (``.app``),
    ``POST /v1/studies/{study_id}/relayed`` (a device's bundle in, its outcomes out), ``GET
    /healthz`` and ``GET /v1/relay`` (the servers it forwards to). ``cors_origins``: the web
    pages (exact origins, or ``*``) allowed to call it from a browser; ValueError naming one that
    is not an origin. With none, no CORS layer at all (every device's request pays nothing);
    with some, it wraps everything, so the device route's every answer carries the header."""
    cors_origins = check_origins(cors_origins, "dpsketch relay --cors-origins")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await relay.start()
        try:
            yield
        finally:
            await relay.close()

    app = FastAPI(title="dpsketch relay", version=dpsketch.__version__, lifespan=lifespan)
    problem_http.install(app)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/relay")
    async def info() -> dict[str, Any]:
        """The share servers this relay forwards to, by server id (public: a device checks
        nothing here; its shares are sealed to keys it holds from its enrolment)."""
        return {"servers": relay.servers, "window_s": relay.window_s, "max_entries": relay.max_entries,
                "bundles_forwarded": relay.forwarded, "entries_forwarded": relay.entries_forwarded,
                "bundles_failed": relay.failed, "entries_failed": relay.entries_failed,
                "cors_origins": list(cors_origins)}

    @app.post("/v1/studies/{study_id}/relayed", response_model=RelayedResults,
              responses=problem_http.problem_responses(400, 413, 415, 422, 503))
    async def upload(study_id: str, request: Request) -> Response:
        """A device's bundle forwarded; 200 with one outcome per entry, in its order (an outcome
        with a status of 502 or 503 is worth sending again). Answered by DeviceUploads before
        FastAPI; documented here."""
        body = await problem_http.read_within(request, max_device_bytes, "a device's relayed bundle")
        payload = await answer(relay, study_id, request.headers.get("content-type", ""), body)
        return Response(payload, media_type="application/json")

    # outside the FastAPI app, not one of its middlewares: inside, every device's request went
    # through Starlette's error and body-limit layers and their wrapped send, a fifth of the
    # relay's CPU (py-spy, 1,000 devices, session 62)
    uploads = DeviceUploads(app, relay, max_device_bytes)
    if not cors_origins:
        return uploads
    # outermost: a browser's preflight is answered before anything else (nothing is forwarded
    # for it), and every answer to a listed page, a device's problem answers included, carries
    # Access-Control-Allow-Origin; a request without Origin passes after one header lookup
    return problem_http.cors_middleware("relay", "dpsketch relay --cors-origins")(
        uploads, allow_origins=list(cors_origins), allow_methods=["GET", "POST"], allow_headers=["Content-Type"],
        expose_headers=["Retry-After"], allow_credentials=False, max_age=600)


def parse_servers(values: Sequence[str]) -> dict[str, str]:
    """``ID=URL`` pairs; ValueError naming a malformed or repeated one."""
    out: dict[str, str] = {}
    for value in values:
        sid, sep, url = value.partition("=")
        if not sep or not sid or not url.startswith(("http://", "https://")):
            raise ValueError(f"--server takes ID=URL (the server id its study names, and its base URL), not {value!r}")
        if sid in out:
            raise ValueError(f"server {sid!r} is given twice")
        out[sid] = url
    return out


DESCRIPTION = """\
Run a dpsketch relay: devices send it one request each (every server's sealed batch, with their
upload tokens' MACs: docs/protocol.md section 7b), and it forwards each server the entries of the
devices that arrived within --window as one request. It answers each device with its entries'
outcomes once the servers answered, and keeps nothing: a relay that dies loses no acknowledged
report. It sees no share and no token (docs/trust.md, docs/relay.md).
"""


def main(argv: Sequence[str] | None = None) -> int:
    from dpsketch import serving

    parser = argparse.ArgumentParser(prog="dpsketch relay", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, metavar="ID=URL",
                        help="a share server to forward to: the id its studies name and its base URL "
                             "(repeat for each server)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--window", type=float, default=DEFAULT_WINDOW_S * 1000, metavar="MS",
                        help=f"how long the first entry for a server waits for others before the "
                             f"group is forwarded (default {DEFAULT_WINDOW_S * 1000:g} ms)")
    parser.add_argument("--max-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                        help=f"forward a server's group as soon as it holds this many entries "
                             f"(default {DEFAULT_MAX_ENTRIES})")
    parser.add_argument("--max-bundle-bytes", type=int, default=DEFAULT_MAX_BUNDLE_BYTES,
                        help=f"the largest bundle sent to a server (default {DEFAULT_MAX_BUNDLE_BYTES >> 20} MiB; keep "
                             f"it under the servers' --max-body-bytes)")
    parser.add_argument("--max-pending-bytes", type=int, default=DEFAULT_MAX_PENDING_BYTES,
                        help="entries waiting for the servers, in bytes, past which devices get 503 "
                             f"and retry (default {DEFAULT_MAX_PENDING_BYTES >> 20} MiB)")
    parser.add_argument("--max-device-bytes", type=int, default=DEFAULT_MAX_DEVICE_BYTES,
                        help=f"the largest device request (default {DEFAULT_MAX_DEVICE_BYTES >> 20} MiB; 413 past it)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a server (default 30)")
    parser.add_argument("--access-log", action="store_true",
                        help="log every request (off by default: a relay takes one request per device)")
    parser.add_argument("--ca-bundle", default=None, help="CA bundle to verify the servers' TLS with")
    parser.add_argument("--cors-origins", type=split_origins, default=(), metavar="ORIGIN,...",
                        help="web pages allowed to call this relay from a browser (CORS), e.g. "
                             "https://survey.example.org, comma-separated, or '*' for any page "
                             "(default: none, a page on another origin is refused)")
    serving.add_graceful_argument(parser)
    serving.add_connection_arguments(parser)
    args = parser.parse_args(argv)
    try:
        servers = parse_servers(args.server)
    except ValueError as exc:
        parser.error(str(exc))
    if args.window < 0 or args.max_entries < 1:
        parser.error("--window is >= 0 ms and --max-entries >= 1")
    serving.check_graceful_timeout(parser, args.graceful_timeout)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded bundle otherwise
    relay = Relay(servers, window_s=args.window / 1000, max_entries=args.max_entries,
                  max_pending_bytes=args.max_pending_bytes, max_bundle_bytes=args.max_bundle_bytes,
                  timeout=args.timeout,
                  verify=args.ca_bundle or True)
    try:
        app = create_app(relay, args.max_device_bytes, args.cors_origins)
    except ValueError as exc:  # one line, as the share server's settings errors
        raise SystemExit(f"dpsketch relay: {exc}") from None
    return serving.serve(app, graceful_timeout=args.graceful_timeout, host=args.host, port=args.port, workers=1,
                         access_log=args.access_log, proxy_headers=False, server_header=False, header_timeout=args.header_timeout,
                         body_timeout=args.body_timeout, min_rate=args.min_rate,
                         max_connections=args.max_connections, max_connections_per_ip=args.max_connections_per_ip)


if __name__ == "__main__":
    sys.exit(main())
