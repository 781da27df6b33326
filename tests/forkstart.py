"""Start the suite's share servers and analyzers by forking a parent that has imported them.

An exec'd server spends about 3.3 s of CPU before it is warm: the interpreter, numpy, scipy,
FastAPI and dp-accounting imported again by each of the suite's ~340 processes, a third of the
suite's CPU on 2 cores. multiprocessing's fork server imports them once per pytest worker and
forks a child per start, which is warm after about 0.35 s of CPU (3.31-3.60 s exec'd against
0.32-0.41 s forked, one share server from spawn to 8 s idle; docs/testing.md).

What stays as it was: each server is its own process in its own session (``os.killpg`` and
SIGKILL reach it as before), with its own environment, log file and working directory, running
``dpsketch.tools.cli.main`` exactly as ``python -m dpsketch.tools.cli`` would; its exit code is
what ``Popen.returncode`` would say (minus the signal for a signalled one). What a fork cannot
reproduce is decided at import time: the fork server imported every module under the worker's
environment, so a start whose environment differs from it outside :data:`RUN_TIME_PREFIXES`
is exec'd as before, as is anything but the CLI. The exec'd start stays covered: ``dpsketch
demo``, the CLI tests and the images start their processes the usual way.

``DPSKETCH_TEST_FORK=0`` turns this off for a run.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from typing import BinaryIO

from dpsketch.tools import cluster

#: What the fork server imports once: the two services' entry points and everything they load
#: before they are warm (uvicorn's protocol modules, dp-accounting, the analyzer's app).
PRELOAD = [
    "dpsketch.tools.cli",
    "dpsketch.services.__main__",
    "dpsketch.services.app",
    "dpsketch.analyzer.__main__",
    "dpsketch.analyzer.app",
    "uvicorn",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.auto",
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
    "dp_accounting",
]

#: Environment keys in which a child may differ from the fork server: the product reads its own
#: settings when it runs (services/settings.py, serving.py), never at import; pytest names the
#: running test in PYTEST_CURRENT_TEST; selenium's manager reads SE_* (tests/browser.py).
RUN_TIME_PREFIXES = ("DPSKETCH_", "PYTEST_CURRENT_TEST", "SE_")

_context = multiprocessing.get_context("forkserver")
_imported_under: dict[str, str] | None = None


def enabled() -> bool:
    return os.environ.get("DPSKETCH_TEST_FORK", "1") != "0"


def _cli_args(argv: list[str]) -> list[str] | None:
    """The CLI's arguments of ``python -m dpsketch.tools.cli ...``, else None (exec that)."""
    prefix = cluster._cli()  # how cluster.py spells a CLI start
    return argv[len(prefix):] if argv[:len(prefix)] == prefix else None


def _differs_at_import(env: dict[str, str]) -> bool:
    """Whether ``env`` differs from the fork server's, in a key an import may have read."""
    assert _imported_under is not None
    keys = set(env) | set(_imported_under)
    return any(env.get(k) != _imported_under.get(k) for k in keys if not k.startswith(RUN_TIME_PREFIXES))


def start() -> None:
    """Start the fork server (once): under the environment the worker has now, which the
    session's first fixture calls before any test's own settings."""
    global _imported_under
    if _imported_under is None:
        # Import here first: what an import puts in the environment (the share server sets
        # NUMPY_MADVISE_HUGEPAGE before numpy loads) is then in the fork server's from its start,
        # before its own imports, and in the environment children are compared against.
        for name in PRELOAD:
            importlib.import_module(name)
        _imported_under = dict(os.environ)
        _context.set_forkserver_preload(PRELOAD)
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _run_cli(args: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked child: what ``python -m dpsketch.tools.cli *args`` with ``env`` and its
    output in ``log_path`` would do (``start_new_session=True`` included)."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.argv = [sys.executable, *args]
    from dpsketch.tools import cli

    try:
        code = cli.main(args)
    finally:
        atexit._run_exitfuncs()  # an exec'd interpreter runs these at exit; multiprocessing does not
    sys.exit(code)


class ForkedProcess:
    """The part of ``subprocess.Popen`` a ManagedProcess and the tests use, for a forked child."""

    def __init__(self, args: list[str], env: dict[str, str], log: BinaryIO) -> None:
        self.args = args
        self.returncode: int | None = None
        self._process = _context.Process(target=_run_cli, args=(_cli_args(args), env, log.name), daemon=True)
        self._process.start()
        self.pid: int = self._process.pid
        # os.killpg(pid) needs the child's own session: wait the few ms until it has made it
        while self.poll() is None and _group_of(self.pid) != self.pid:
            time.sleep(0.001)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def launch(argv: list[str], env: dict[str, str], log: BinaryIO):
    """dpsketch.tools.cluster's launcher for the suite: fork what can be forked, exec the rest."""
    args = _cli_args(argv)
    if args is not None and enabled():
        start()
        if not _differs_at_import(env):
            return ForkedProcess(argv, env, log)

    return cluster.popen(argv, env, log)
