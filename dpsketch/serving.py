"""Run an ASGI app under uvicorn the way both services need: bounded graceful shutdown, exit 0,
and a bounded hold on connections for clients that are slow or too many.

Shared by ``dpsketch server`` (services/__main__.py) and ``dpsketch analyzer``
(analyzer/__main__.py), so both stop the same way:

* SIGTERM or Ctrl-C: stop accepting connections, let in-flight requests finish, then run the
  application's shutdown (the share server commits its queued writes there).
* The wait is bounded by ``--graceful-timeout`` (uvicorn's ``timeout_graceful_shutdown``), and
  idle TLS keep-alive connections do not wait at all: asyncio closes a TLS connection by sending
  close_notify and waiting up to 30 s for the peer's, which an idle client never sends, so they
  are aborted (nothing is pending on them: ``_GuardedConnection.shutdown``). Requests still
  running when the bound expires are cancelled; their clients got no answer and retry (uploads
  are idempotent by report id), and the application's shutdown still runs.
* A shutdown asked for by SIGTERM exits with status 0 (uvicorn would re-raise the signal after
  its clean shutdown, so the process would die "killed by SIGTERM"); docker, systemd and
  supervisors then see a clean stop.

Slow and excess connections ("slowloris"): uvicorn keeps a connection that never finishes its
request headers open forever, so 1,100 such connections made a server unreachable at the usual
1,024 open files (accept() fails with EMFILE; new clients are dropped). So, in the style of
Apache's mod_reqtimeout, a connection must complete a request's headers within
``--header-timeout`` seconds of opening or of its previous response, and the body within
``--body-timeout`` seconds of the headers; each deadline moves 1 s later per ``--min-rate`` bytes
received, so slow but steady clients finish. On expiry the connection is closed (after a 408
``request-timeout`` if part of a request head had arrived; a stalled body's response belongs to
the application, which sees the client disconnect). A client address holding
``--max-connections-per-ip`` connections has further ones closed as soon as they are accepted,
before anything is read; ``--max-connections`` caps all of them, and the requests in the
application at once (:class:`InFlightLimit`, 503 ``unavailable``). Every answer of this layer is
problem JSON, as the services' own are: so is uvicorn's 400 to bytes that are not HTTP
(``malformed-request``). At startup the soft RLIMIT_NOFILE is raised to the hard limit, and the global cap is
kept 64 below it for the database, logs and outgoing connections.

Garbage collection: once the app is built (modules, the framework's routes and models, the
store's studies), :func:`serve` collects, then freezes what is left (``gc.freeze``: it lives as
long as the process, so the collector stops scanning it) and makes young collections rarer
(:data:`GC_THRESHOLDS`). With the defaults, each full collection walked the 140,000 objects of
a started share server: under 64 clients uploading single reports the collector took a tenth of
the server's time and its pauses were the slowest answers (p99 about 150 ms, 60 ms with these
settings; docs/operations.md). Requests allocate and free their objects by reference counting;
only reference cycles wait for the collector.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import gc
import json
import logging
import math
import os
import signal
import struct
import termios
import time
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

from dpsketch.protocol.messages import PROBLEM_MEDIA_TYPE
from dpsketch.protocol.problems import ProblemError

DEFAULT_GRACEFUL_TIMEOUT = 5.0
STARTUP_FAILURE = 3  # uvicorn's own exit status when the application fails to start

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_MIN_RATE = 500.0  # bytes per second
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_CONNECTIONS_PER_IP = 256
#: Under pressure (every connection slot taken) a new connection evicts the one that has waited
#: longest for its client, if it has waited at least this long (a client in the middle of
#: sending a request is not cut off by a newcomer).
DEFAULT_EVICT_AFTER = 1.0
FD_HEADROOM = 64  # descriptors kept free below RLIMIT_NOFILE: SQLite files, logs, outgoing calls
#: gc thresholds while serving (Python's default: 700, 10, 10): a young collection every 7,000
#: net allocations of container objects rather than every 700 (module docstring).
GC_THRESHOLDS = (7000, 10, 10)

log = logging.getLogger("uvicorn.error")  # uvicorn's --log-level and handler apply


def add_graceful_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--graceful-timeout", type=float, default=DEFAULT_GRACEFUL_TIMEOUT, metavar="SECONDS",
        help="on SIGTERM/Ctrl-C, wait at most this long for in-flight requests before shutting "
             "down anyway (idle keep-alive connections, TLS too, are closed at once); requests "
             "still running then are cancelled (default: %(default)s)")


def check_graceful_timeout(parser: argparse.ArgumentParser, value: float) -> None:
    if not value > 0:
        parser.error("--graceful-timeout must be > 0")


def _non_negative(kind: type, what: str, minimum: float = 0):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not (value >= minimum and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} >= {minimum}")
        return value
    parse.__name__ = what
    return parse


def _env(name: str, default: Any) -> Any:
    """The variable's text if set (argparse then parses and checks it like the flag), else default."""
    value = os.environ.get(name, "").strip()
    return value if value else default


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of :func:`serve`'s slow/excess connection defense; each reads the environment
    variable shown when it is not given."""
    g = parser.add_argument_group(
        "slow and excess connections",
        "Close connections that hold the server without sending a request (slowloris) and\n"
        "cap how many connections one client address and all clients together may hold.\n"
        "Each flag also reads the environment variable shown.")  # \n: the server's help is raw
    seconds = _non_negative(float, "a number of seconds")
    g.add_argument("--header-timeout", type=seconds, metavar="SECONDS",
                   default=_env("DPSKETCH_HEADER_TIMEOUT", DEFAULT_HEADER_TIMEOUT),
                   help="close a connection that has not sent a complete request head (request "
                        "line and headers) this long after it opened or after its previous "
                        "response; 0 disables ($DPSKETCH_HEADER_TIMEOUT; default: %(default)s)")
    g.add_argument("--body-timeout", type=seconds, metavar="SECONDS",
                   default=_env("DPSKETCH_BODY_TIMEOUT", DEFAULT_BODY_TIMEOUT),
                   help="close a connection whose request body has not fully arrived this long "
                        "after its headers; 0 disables ($DPSKETCH_BODY_TIMEOUT; default: %(default)s)")
    g.add_argument("--min-rate", type=_non_negative(float, "a rate"), metavar="BYTES_PER_SECOND",
                   default=_env("DPSKETCH_MIN_RATE", DEFAULT_MIN_RATE),
                   help="each this many bytes received move the header or body deadline 1 s "
                        "later, so a slow client that keeps sending at this rate is not cut off; "
                        "0: fixed deadlines ($DPSKETCH_MIN_RATE; default: %(default)s)")
    g.add_argument("--max-connections", type=_non_negative(int, "a count", 1), metavar="N",
                   default=_env("DPSKETCH_MAX_CONNECTIONS", None),
                   help="most connections open at once; more are closed as soon as they are "
                        "accepted, and a request gets 503 once this many are in progress. Always kept "
                        f"{FD_HEADROOM} below the open-files limit (whose soft value is raised to "
                        f"the hard one at startup) ($DPSKETCH_MAX_CONNECTIONS; default: "
                        f"{DEFAULT_MAX_CONNECTIONS}, or that limit minus {FD_HEADROOM} if smaller)")
    g.add_argument("--max-connections-per-ip", type=_non_negative(int, "a count"), metavar="N",
                   default=_env("DPSKETCH_MAX_CONNECTIONS_PER_IP", DEFAULT_MAX_CONNECTIONS_PER_IP),
                   help="most connections one client address may hold; more are closed as soon "
                        "as they are accepted, before anything is read. Behind a reverse proxy "
                        "every client has the proxy's address: raise it or give 0 (no per-address "
                        "cap) ($DPSKETCH_MAX_CONNECTIONS_PER_IP; default: %(default)s)")


def raise_open_files_limit() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return (soft before, soft now, hard).

    Every connection is a file descriptor, and services are still often started with a soft
    limit of 1,024 while the hard limit is far higher: the soft one is ours to raise."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:  # Linux refuses more than fs.nr_open
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target, target
        except (ValueError, OSError):  # e.g. macOS allows less than its hard limit says
            pass  # the startup log line shows both figures
    return soft, soft, target


@dataclass
class _Guard:
    """Limits and live counts shared by all connections of one server (one :func:`serve`)."""

    header_timeout: float
    body_timeout: float
    min_rate: float
    max_connections: int
    max_per_ip: int  # 0: no per-address cap
    nofile: int = 0  # the open-files limit the caps were fitted under,
    nofile_before: int = 0  # the soft limit found at startup
    nofile_hard: int = 0  # and the hard one
    asked: int | None = None  # --max-connections as given
    total: int = 0  # connections open now
    report_every: float = 10.0
    evict_after: float = DEFAULT_EVICT_AFTER

    def __post_init__(self) -> None:
        self.per_ip: collections.Counter[str] = collections.Counter()
        #: connections waiting for their client (a request head or body to arrive), oldest
        #: first: when the phase began (loop time); the candidates for eviction
        self.waiting: dict[Any, float] = {}
        self.evicted = 0  # connections evicted for newcomers, since the start
        self.events: collections.Counter[str] = collections.Counter()  # not yet logged
        self.latest: str | None = None
        self.pending: Any = None  # the timer of the next summary

    def log_figures(self) -> None:
        if self.asked is not None and self.asked > self.max_connections:
            log.warning("--max-connections %d lowered to %d: the open-files limit is %d", self.asked,
                        self.max_connections, self.nofile)
        raised = (f" (raised from {self.nofile_before})" if self.nofile != self.nofile_before
                  else f" (could not raise it to the hard limit {self.nofile_hard})"
                  if self.nofile < self.nofile_hard else "")
        log.info("Open files limit %d%s; at most %d connections, %s per client address; request "
                 "headers within %gs, bodies within %gs, each +1 s per %g bytes received", self.nofile,
                 raised, self.max_connections, self.max_per_ip or "no cap", self.header_timeout,
                 self.body_timeout, self.min_rate)

    def admit(self, ip: str | None, loop: Any) -> bool:
        if ip is not None and self.max_per_ip and self.per_ip[ip] >= self.max_per_ip:
            self.note("refused: address at --max-connections-per-ip", ip, loop)
            return False
        if self.total >= self.max_connections and not self.evict_oldest(loop):
            self.note("refused: server at --max-connections", ip, loop)
            return False
        self.total += 1
        if ip is not None:
            self.per_ip[ip] += 1
        return True

    def evict_oldest(self, loop: Any) -> bool:
        """Make room for a newcomer: close the connection that has waited longest for its
        client, if it waited at least ``evict_after``; whether one was closed. Why: the caps per
        address do not stop a flood from many addresses (issue 41: 18 loopback addresses x 240
        slow-header connections filled the 4,096 slots and a legitimate client got 0 of 8
        answers); a slot held by a client that sends nothing is the cheapest to give back, and
        a flood that keeps every slot busy must now open a connection per slot per
        ``evict_after`` seconds, where before it only had to hold them."""
        for conn, since in self.waiting.items():  # oldest first: if this one is too young, all are
            if loop.time() - since < self.evict_after:
                return False
            conn.evict()
            self.evicted += 1
            return True
        return False

    def release(self, ip: str | None) -> None:
        self.total -= 1
        if ip is not None:
            self.per_ip[ip] -= 1
            if not self.per_ip[ip]:
                del self.per_ip[ip]  # no entry per address ever seen

    def note(self, event: str, ip: str | None, loop: Any) -> None:
        """Count a refusal or timeout for the log. The first after a quiet spell is logged at
        once, then one summary per ``report_every`` seconds while they last: a flood of
        thousands of connections costs a few log lines, not thousands."""
        self.events[event] += 1
        self.latest = ip
        if self.pending is None:
            self._report()
            self.pending = loop.call_later(self.report_every, self._report_later, loop)

    def _report_later(self, loop: Any) -> None:
        self.pending = None
        if self.events:
            self._report()
            self.pending = loop.call_later(self.report_every, self._report_later, loop)

    def _report(self) -> None:
        summary = ", ".join(f"{n} {what}" for what, n in self.events.items())
        self.events.clear()
        log.warning("Slow or excess connections (latest from %s): %s", self.latest, summary)


class _GuardedConnection:
    """Mixed in before uvicorn's HTTP protocol class: admission by the caps, and the
    header/body read deadlines.

    The deadline runs only while the server waits for the client: in the "headers" phase (from
    the connection opening, or from the previous response completing, to the end of the next
    request head) and the "body" phase (from the end of the head to the end of the body). While
    the application works on a complete request there is none: a slow handler is not the
    client's fault. One timer per connection, set when the phase changes; bytes received only
    move ``_deadline`` later and the timer re-arms itself when it fires early.
    """

    guard: _Guard  # set on the subclass made by guarded_protocol()
    loop: Any  # these come from uvicorn's protocol class
    transport: Any
    flow: Any
    cycle: Any
    _admitted = False
    _evicted = False
    _phase: str | None = None
    _timer: Any = None
    _deadline = 0.0
    _phase_bytes = 0

    # --- what the parser-specific subclass tells us
    def _reading_body(self) -> bool:
        raise NotImplementedError

    # --- uvicorn's protocol interface
    def connection_made(self, transport: Any) -> None:
        peer = transport.get_extra_info("peername")
        self._ip = peer[0] if isinstance(peer, (tuple, list)) and peer else None  # unix socket: None
        if not self.guard.admit(self._ip, self.loop):
            # Before super(): uvicorn never sees it, and not one byte of it is read.
            transport.abort()
            return
        self._admitted = True
        super().connection_made(transport)  # type: ignore[misc]
        self._sync_phase()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted and not self._evicted:  # refused in connection_made (or handed over to websockets)
            return
        self._release()
        super().connection_lost(exc)  # type: ignore[misc]

    def evict(self) -> None:
        """Close this connection for a newcomer (the guard chose it: it waited longest for its
        client). Its slot is free at once; a client that had sent part of a request head is told
        why (503 with Retry-After), an idle one is closed silently as a keep-alive timeout does."""
        self.guard.note("evicted: waited longest, for a new connection at --max-connections", self._ip, self.loop)
        if self._phase == "headers" and self._phase_bytes:
            self.transport.write(closing_problem(ProblemError.unavailable(
                "the server is at its connection limit and this connection had waited longest for "
                "its request; reconnect and send it again", 1)))
        self._evicted = True
        self._release()
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        # Bytes count for the phase they arrive in; the chunk that ends the headers starts the
        # body phase with its full timeout (body bytes in that chunk earn no extra time).
        if self._phase is not None:
            self._phase_bytes += len(data)
            if self.guard.min_rate:
                self._deadline += len(data) / self.guard.min_rate
        super().data_received(data)  # type: ignore[misc]
        self._sync_phase()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._sync_phase()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive timeout, unless the client's next request is already waiting in
        the socket. Under uvloop (libuv) a loop iteration runs its due timers before it polls for
        input, so after this server's own loop stalled past the keep-alive timeout (a stopped
        process, a long GC or GIL hold, a starved CPU) the timer fired first and closed a
        connection whose request had arrived in the meantime: the kernel answers unread bytes
        with a reset, and the client saw a ReadError for a request it sent in time. The bytes
        are read in this same iteration's poll (data_received cancels keep-alive); the timer is
        re-armed in case they never make a request."""
        if _bytes_waiting(self.transport):
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)  # type: ignore[attr-defined]
            return
        super().timeout_keep_alive_handler()  # type: ignore[misc]

    def shutdown(self) -> None:
        """At a graceful shutdown: an idle TLS connection is aborted, not closed. close() sends
        close_notify and waits (up to 30 s) for the peer's, which an idle keep-alive client never
        sends, so every stop of a server that had served an analyzer or an SDK over TLS waited the
        whole --graceful-timeout (and under load, docker's stop_grace_period ran out first: the
        store's clean shutdown never ran). Nothing is pending on such a connection (its last
        response is complete and written out), so the client sees it end as at a keep-alive
        timeout and reconnects. Anything else is uvicorn's shutdown: a request in flight
        finishes; plain TCP closes at once anyway."""
        idle = self.cycle is None or self.cycle.response_complete
        if (idle and self._admitted and self.transport.get_extra_info("ssl_object") is not None
                and not self.transport.get_write_buffer_size()):
            self.transport.abort()
            return
        super().shutdown()  # type: ignore[misc]

    def handle_websocket_upgrade(self, *args: Any) -> None:
        # The transport goes to a websocket protocol whose connection_lost we never see:
        # free the slot now rather than leak it (no dpsketch route accepts websockets).
        self._release()
        super().handle_websocket_upgrade(*args)  # type: ignore[misc]

    # --- deadlines
    def _release(self) -> None:
        if self._admitted:
            self._admitted = False
            self.guard.release(self._ip)
        self._phase = None
        self.guard.waiting.pop(self, None)
        self._cancel_timer()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timeout(self, phase: str | None) -> float:
        return {"headers": self.guard.header_timeout, "body": self.guard.body_timeout}.get(phase, 0.0)

    def _sync_phase(self) -> None:
        """After anything that may move the request along: start the clock of the phase the
        connection is now in, if that changed."""
        if not self._admitted or self.transport.is_closing():
            return
        cycle = self.cycle  # the latest request parsed
        if self._reading_body():
            phase = "body"
        elif cycle is None or cycle.response_complete:
            phase = "headers"  # idle, or a next request head arriving
        else:
            phase = None  # the application has a complete request
        if phase == self._phase:
            return
        self._phase, self._phase_bytes = phase, 0
        waiting = self.guard.waiting
        waiting.pop(self, None)
        if phase is not None:  # waiting for the client from now: the newest candidate for eviction
            waiting[self] = self.loop.time()
        self._cancel_timer()
        timeout = self._timeout(phase)
        if timeout:
            self._deadline = self.loop.time() + timeout
            self._timer = self.loop.call_at(self._deadline, self._check_deadline)

    def _check_deadline(self) -> None:
        self._timer = None
        if self._phase is None or not self._admitted or self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:
            # uvicorn holds the client's bytes back (a pipelined request waits for the one
            # before it, or the application is behind on the body): not the client's delay.
            self._deadline = now + self._timeout(self._phase)
        if now < self._deadline:  # bytes arrived since the timer was set: sleep on
            self._timer = self.loop.call_at(self._deadline, self._check_deadline)
            return
        if _bytes_waiting(self.transport):
            # they arrived while this loop was stalled and are read in this iteration's poll
            # (timers run first: see timeout_keep_alive_handler); judge the phase after that
            self._timer = self.loop.call_later(_STALL_RECHECK_S, self._check_deadline)
            return
        self.guard.note(f"closed: no complete request {self._phase} in time", self._ip, self.loop)
        if self._phase == "headers" and self._phase_bytes:
            # Part of a request came and no response is under way (headers phase): say why.
            # An idle keep-alive connection is closed silently, as uvicorn's keep-alive does.
            self.transport.write(closing_problem(ProblemError(
                "request-timeout", f"the request head did not arrive within {self.guard.header_timeout:g} s "
                f"(+1 s per {self.guard.min_rate:g} bytes received); reconnect and send it again")))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to bytes that are not an HTTP/1.1 request (its text/plain 400), as
        # problem JSON like every other error of the services.
        self.transport.write(closing_problem(ProblemError("malformed-request", msg)))
        self.transport.close()


_STALL_RECHECK_S = 0.05


def _bytes_waiting(transport: Any) -> bool:
    """Whether the kernel holds bytes from the peer that this process has not read yet
    (FIONREAD on the connection's socket; TLS records count as they arrived)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0] > 0
    except (OSError, ValueError):  # closed meanwhile (fileno -1), or not a stream socket
        return False


def closing_problem(err: ProblemError) -> bytes:
    """A whole HTTP/1.1 answer with ``err`` as problem JSON that closes the connection, for the
    connection layer's own answers (written to the transport: no request reached the app)."""
    body = json.dumps(err.body()).encode()
    reason = HTTPStatus(err.status).phrase.encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (err.status, reason, PROBLEM_MEDIA_TYPE.encode(), len(body), body))


class InFlightLimit:
    """Pure ASGI wrapper: at most ``limit`` requests in the application at once; one more is
    answered 503 ``unavailable`` with Retry-After and the connection closed. It takes the place
    of uvicorn's ``limit_concurrency``, whose answer is a text/plain 503: the connection guard
    caps the connections, this the requests that outlive theirs (an application still working
    on a request whose client went away)."""

    def __init__(self, app: Any, limit: int, retry_after_s: int = 1, report_every_s: float = 10.0):
        self.app = app
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.refused = 0  # since the last log line: one per report_every_s while refusals last
        self.report_every_s = report_every_s
        self._logged_at = -math.inf

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            from dpsketch.problem_http import send_problem

            self.refused += 1
            now = time.monotonic()
            if now - self._logged_at >= self.report_every_s:
                log.warning("refused %d request(s) with 503: %d requests in progress, the limit "
                            "(--max-connections)", self.refused, self.in_flight)
                self.refused, self._logged_at = 0, now
            await send_problem(scope, send, ProblemError(
                "unavailable", f"the server is working on {self.in_flight} requests, its limit; retry "
                f"after {self.retry_after_s} s", headers={"Retry-After": str(self.retry_after_s)}), close=True)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class _HttpToolsHooks(_GuardedConnection):
    """httptools reports the request's progress by callbacks: follow them."""

    _in_body = False

    def _reading_body(self) -> bool:
        return self._in_body

    def on_headers_complete(self) -> None:
        self._in_body = True
        super().on_headers_complete()  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._in_body = False
        super().on_message_complete()  # type: ignore[misc]


class _H11Hooks(_GuardedConnection):
    """h11 keeps the client's side of the exchange as a state: read it."""

    def _reading_body(self) -> bool:
        import h11

        return self.conn.their_state is h11.SEND_BODY  # type: ignore[attr-defined]


def guarded_protocol(guard: _Guard, http: str = "auto") -> type:
    """uvicorn's HTTP/1.1 protocol class ("auto": httptools if installed, else h11) with the caps
    and deadlines of ``guard``; give it to ``uvicorn.Config(http=...)``."""
    if http == "auto":
        try:
            import httptools  # noqa: F401
            http = "httptools"
        except ImportError:
            http = "h11"
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        hooks: type = _HttpToolsHooks
    elif http == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
        hooks = _H11Hooks
    else:
        raise ValueError(f"http must be 'auto', 'httptools' or 'h11', not {http!r}")
    return type(f"Guarded{base.__name__}", (hooks, base), {"guard": guard})


def connection_guard(*, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                     body_timeout: float = DEFAULT_BODY_TIMEOUT, min_rate: float = DEFAULT_MIN_RATE,
                     max_connections: int | None = None,
                     max_connections_per_ip: int = DEFAULT_MAX_CONNECTIONS_PER_IP) -> _Guard:
    """Raise the open-files limit and fit the global cap under it."""
    before, nofile, hard = raise_open_files_limit()
    allowed = max(1, nofile - FD_HEADROOM)
    wanted = DEFAULT_MAX_CONNECTIONS if max_connections is None else max_connections
    return _Guard(header_timeout, body_timeout, min_rate, min(wanted, allowed), max_connections_per_ip,
                  nofile=nofile, nofile_before=before, nofile_hard=hard, asked=max_connections)


def serve(app: Any, *, graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT,
          header_timeout: float = DEFAULT_HEADER_TIMEOUT, body_timeout: float = DEFAULT_BODY_TIMEOUT,
          min_rate: float = DEFAULT_MIN_RATE, max_connections: int | None = None,
          max_connections_per_ip: int = DEFAULT_MAX_CONNECTIONS_PER_IP, **config: Any) -> int:
    """``uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=..., **config)).run()``
    with the slow/excess connection defense; returns 0 after a clean shutdown asked for by
    SIGTERM or SIGINT. ``config["http"]`` may be "auto", "httptools" or "h11"."""
    import uvicorn

    guard = connection_guard(header_timeout=header_timeout, body_timeout=body_timeout, min_rate=min_rate,
                             max_connections=max_connections,
                             max_connections_per_ip=max_connections_per_ip)
    config["http"] = guarded_protocol(guard, config.get("http", "auto"))
    limited = InFlightLimit(app, config.pop("limit_concurrency", None) or guard.max_connections)
    server = uvicorn.Server(uvicorn.Config(limited, timeout_graceful_shutdown=graceful_timeout, **config))
    from dpsketch.observability import attach_server

    attach_server(app, server, guard)  # readiness sees the shutdown, metrics the open connections
    guard.log_figures()  # after Config, which installs the uvicorn log handlers
    error_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _IdlePeersAtShutdown) for f in error_log.filters):
        error_log.addFilter(_IdlePeersAtShutdown())
    # uvicorn installs its own handlers while it runs, restores the ones it found, then re-raises
    # the signal it caught. With uvicorn's own handler as the one it finds, that re-raise only
    # sets a flag again, so run() returns; a signal before run() starts still stops the server.
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGTERM, signal.SIGINT)}
    settle_garbage_collector()
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else STARTUP_FAILURE


def settle_garbage_collector() -> None:
    """Collect, freeze what the started app holds, and set :data:`GC_THRESHOLDS` (module docstring)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class _IdlePeersAtShutdown(logging.Filter):
    """uvicorn logs ``ERROR Cancel 0 running task(s)`` when the graceful timeout ends with only
    idle keep-alive peers left: nothing was cancelled, so say that at INFO instead of alarming
    operators on every routine stop. A real cancellation (count > 0) stays an ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (isinstance(record.msg, str) and record.msg.startswith("Cancel %s running task(s)")
                and record.args and record.args[0] == 0):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = "Graceful shutdown timeout reached with only idle connections open; closing them"
            record.args = ()
        return True
