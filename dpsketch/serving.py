"""Run an ASGI app under uvicorn the way both services need: bounded graceful shutdown, exit 0.

Shared by ``dpsketch server`` (services/__main__.py) and ``dpsketch analyzer``
(analyzer/__main__.py), so both stop the same way:

* SIGTERM or Ctrl-C: stop accepting connections, let in-flight requests finish, then run the
  application's shutdown (the share server commits its queued writes there).
* The wait is bounded by ``--graceful-timeout`` (uvicorn's ``timeout_graceful_shutdown``). Without
  a bound, TLS makes every idle keep-alive peer hold the shutdown: asyncio closes a TLS connection
  by sending close_notify and waiting up to 30 s for the peer's, which an idle client never reads.
  Requests still running when the bound expires are cancelled; their clients got no answer and
  retry (uploads are idempotent by report id), and the application's shutdown still runs.
* A shutdown asked for by SIGTERM exits with status 0 (uvicorn would re-raise the signal after
  its clean shutdown, so the process would die "killed by SIGTERM"); docker, systemd and
  supervisors then see a clean stop.
"""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

DEFAULT_GRACEFUL_TIMEOUT = 5.0
STARTUP_FAILURE = 3  # uvicorn's own exit status when the application fails to start


def add_graceful_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--graceful-timeout", type=float, default=DEFAULT_GRACEFUL_TIMEOUT, metavar="SECONDS",
        help="on SIGTERM/Ctrl-C, wait at most this long for in-flight requests and open "
             "connections (idle TLS keep-alive peers included) before shutting down anyway; "
             "requests still running then are cancelled (default: %(default)s)")


def check_graceful_timeout(parser: argparse.ArgumentParser, value: float) -> None:
    if not value > 0:
        parser.error("--graceful-timeout must be > 0")


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


def serve(app: Any, *, graceful_timeout: float = DEFAULT_GRACEFUL_TIMEOUT, **config: Any) -> int:
    """``uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=..., **config)).run()``;
    returns 0 after a clean shutdown asked for by SIGTERM or SIGINT."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=graceful_timeout, **config))
    error_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _IdlePeersAtShutdown) for f in error_log.filters):
        error_log.addFilter(_IdlePeersAtShutdown())
    # uvicorn installs its own handlers while it runs, restores the ones it found, then re-raises
    # the signal it caught. With uvicorn's own handler as the one it finds, that re-raise only
    # sets a flag again, so run() returns; a signal before run() starts still stops the server.
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else STARTUP_FAILURE
