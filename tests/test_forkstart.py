"""The suite's forked server starts (tests/forkstart.py) behave as exec'd ones where the tests
look: a process of its own in its own session, the environment it was given (its tokens), its
exit code and output as ``Popen`` would report them, SIGKILL and SIGTERM as before; and a start
whose environment differs where an import may read it is exec'd, not forked."""

from __future__ import annotations

import os
import signal
import subprocess

import forkstart
import httpx
import pytest

from dpsketch.tools import cluster
from dpsketch.tools.cluster import ManagedProcess, ServerSpec, share_server

pytestmark = pytest.mark.skipif(not forkstart.enabled(), reason="DPSKETCH_TEST_FORK=0: every start is exec'd")


def _spec(tmp_path, server_id="s1") -> ServerSpec:
    return ServerSpec(server_id, "op-" + os.urandom(8).hex(), "an-" + os.urandom(8).hex(), tmp_path / f"{server_id}.db")


def test_a_forked_server_is_its_own_process_with_its_own_environment(tmp_path):
    spec, other = _spec(tmp_path, "s1"), _spec(tmp_path, "s2")
    procs = [share_server(s, tmp_path) for s in (spec, other)]
    cluster.start_all(procs)
    try:
        for proc, s in zip(procs, (spec, other)):
            assert isinstance(proc.proc, forkstart.ForkedProcess)
            assert os.getpgid(proc.proc.pid) == proc.proc.pid != os.getpid()  # its own session
            with httpx.Client(base_url=proc.url) as http:
                assert http.get("/v1/info").json()["server_id"] == s.server_id
                # each has the operator token of its own environment, not the other's
                assert http.get("/metrics", headers={"Authorization": f"Bearer {s.operator_token}"}).status_code == 200
                wrong = other if s is spec else spec
                assert http.get("/metrics", headers={"Authorization": f"Bearer {wrong.operator_token}"}).status_code == 401
        procs[0].kill()
        assert procs[0].proc.returncode == -signal.SIGKILL
        procs[1].stop()
        assert procs[1].proc.returncode == 0
        assert "Application shutdown complete" in procs[1].log_tail(200)
    finally:
        cluster.stop_all(procs)


def test_a_failed_start_reports_its_exit_code_and_its_message(tmp_path):
    proc = ManagedProcess("bad", cluster._cli("server", "--server-id", "s1", "--port", "not-a-port"),
                          dict(os.environ), 1, tmp_path / "bad.log").spawn()
    assert isinstance(proc.proc, forkstart.ForkedProcess)
    assert proc.proc.wait(60) == 2  # argparse's usage error, as `python -m` would exit
    assert "invalid int value: 'not-a-port'" in proc.log_tail()


def test_an_environment_an_import_may_read_is_exec_d(tmp_path):
    spec = _spec(tmp_path)
    proc = share_server(spec, tmp_path, {"NUMBA_OPT": "2"})
    proc.start()
    try:
        assert isinstance(proc.proc, subprocess.Popen)
        assert httpx.get(proc.url + "/v1/info").json()["server_id"] == "s1"
    finally:
        proc.stop()
