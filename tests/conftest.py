"""Shared fixtures: real share-server processes on loopback ports with real SQLite files."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpsketch.cluster import ManagedProcess, ServerSpec, share_server


class Servers:
    """Starts real share servers; stops (or has already killed) every one at teardown."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.started: list[ManagedProcess] = []

    def spec(self, server_id: str) -> ServerSpec:
        return ServerSpec(
            server_id=server_id,
            operator_token="op-" + secrets.token_hex(8),
            analyst_token="an-" + secrets.token_hex(8),
            db_path=self.workdir / f"{server_id}.sqlite3",
        )

    def start(self, spec: ServerSpec, extra_env: dict[str, str] | None = None) -> ManagedProcess:
        proc = share_server(spec, self.workdir, extra_env).start()
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.started:
            proc.stop()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Servers]:
    pool = Servers(tmp_path)
    try:
        yield pool
    finally:
        pool.stop_all()
