"""A process that never becomes healthy is stopped by the start that gave up on it
(tools/cluster.py ``ManagedProcess.start``, ``start_all``): the demo, the benchmarks and the
tests start real servers this way, and one left running after its start failed held its port,
its database file and a CPU's share until the machine was rebooted (the caller got an error and
held nothing to stop)."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest

from dpsketch.tools import cluster
from dpsketch.tools.cluster import ServerSpec, free_port, share_server


def _unreachable(tmp_path, server_id: str):
    """A real share server that listens on its own port while its health is asked at another,
    where nothing listens: it runs, and is never healthy."""
    spec = ServerSpec(server_id, "op-" + os.urandom(8).hex(), "an-" + os.urandom(8).hex(),
                      tmp_path / f"{server_id}.db")
    proc = share_server(spec, tmp_path)
    return dataclasses.replace(proc, port=free_port()), spec.port


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_start_that_times_out_stops_its_process(tmp_path):
    proc, listening = _unreachable(tmp_path, "s1")
    with pytest.raises(TimeoutError, match="s1 not healthy after 8"):
        proc.start(timeout=8)
    assert proc.proc is not None and proc.proc.poll() is not None, "the server was left running"
    assert _port_free(listening)


def test_start_all_stops_every_process_it_spawned_when_one_is_not_healthy(tmp_path):
    healthy = share_server(ServerSpec("s1", "op-" + os.urandom(8).hex(), "an-" + os.urandom(8).hex(),
                                      tmp_path / "s1.db"), tmp_path)
    stuck, listening = _unreachable(tmp_path, "s2")
    with pytest.raises(TimeoutError, match="s2 not healthy"):
        cluster.start_all([stuck, healthy], timeout=8)  # the other still starting, or started
    for proc in (healthy, stuck):
        assert proc.proc.poll() is not None, f"{proc.name} was left running"
    assert _port_free(healthy.port) and _port_free(listening)
