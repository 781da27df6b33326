"""A real PostgreSQL server for the tests of the Postgres store, started by the repo's own script.

scripts/ensure-postgres.sh installs Debian's ``postgresql`` when it is missing (root and apt-get)
and starts a throwaway cluster in a fresh directory (one per pytest process, so xdist workers do
not share one), listening on a free loopback port with a random password; the session stops it
again. Each test that asks for a Postgres store gets a database of its own (CREATE DATABASE), so
tests never see each other's studies.

Skipped only when PostgreSQL cannot be had: not installed and not root (nothing can install it),
or no apt-get. Under CI ($CI set) it is never skipped: a missing PostgreSQL fails the tests.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

from envguard import unavailable

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ensure-postgres.sh"


def _installed() -> bool:
    return any(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")) or shutil.which("pg_ctl") is not None


def cannot_run_reason() -> str | None:
    """Why no PostgreSQL server can be started here, or None."""
    if _installed():
        return None
    if os.geteuid() != 0:
        return "PostgreSQL is not installed and we are not root: cannot install it"
    if shutil.which("apt-get") is None:
        return "PostgreSQL is not installed and there is no apt-get to install Debian's postgresql"
    return None


class PostgresServer:
    """One running throwaway cluster: its superuser URL, and fresh databases on demand."""

    def __init__(self, directory: Path, admin_url: str):
        self.directory = directory
        self.admin_url = admin_url
        self.databases: list[str] = []

    def url_of(self, name: str) -> str:
        return self.admin_url.rsplit("/", 1)[0] + "/" + name

    def new_database(self, prefix: str = "t") -> str:
        """A new, empty database; returns its URL."""
        import psycopg

        name = f"{prefix}_{secrets.token_hex(6)}".lower()
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.databases.append(name)
        return self.url_of(name)

    def drop_databases(self) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            for name in self.databases:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.databases.clear()

    def pg_ctl(self, action: str) -> None:
        """Stop or start the cluster (fault tests: a database that goes away and comes back),
        on the same port and data directory."""
        port = self.admin_url.rsplit(":", 1)[1].split("/", 1)[0]
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
        pg_ctl = str(bins[-1]) if bins else shutil.which("pg_ctl")
        data = self.directory / "data"
        argv = [pg_ctl, "-D", str(data), "-w", "-t", "60", "-m", "fast"]
        if action == "start":
            argv += ["-l", str(self.directory / "server.log"), "-o",
                     f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={self.directory} "
                     f"-c max_connections=200 -c fsync=on -c synchronous_commit=on"]
        argv.append(action)
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        subprocess.run(argv, check=True, capture_output=True, timeout=120)


def start() -> PostgresServer:
    """Install if needed and start a cluster in a fresh directory (see the module docstring)."""
    reason = cannot_run_reason()
    if reason is not None:
        unavailable(reason)
    # under /tmp itself: the cluster's owner (postgres, when we are root) must reach the directory
    directory = Path(tempfile.mkdtemp(prefix="dpsketch-pg-", dir="/tmp"))
    out = subprocess.run(["bash", str(SCRIPT), str(directory)], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/ensure-postgres.sh failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return PostgresServer(directory, out.stdout.strip().splitlines()[-1])


def stop(server: PostgresServer) -> None:
    subprocess.run(["bash", str(SCRIPT), "--stop", str(server.directory)], capture_output=True, timeout=120)
