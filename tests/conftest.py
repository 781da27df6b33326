"""Shared fixtures: real share-server processes on loopback ports with real SQLite files, or
databases on a real PostgreSQL server (tests/pg.py).

Tests of the store's guarantees run against both stores: they take the ``store_kind`` fixture
parametrised with ``@BOTH_STORES`` (``servers`` and ``store_location`` follow it); every other
test runs SQLite only.

The servers run their default policy except for upload authentication and population budgets:
tests of other features start them with ``DPSKETCH_UPLOAD_AUTH=open`` and no budget
(``OPEN_UPLOADS``) so that every upload need not carry a token; tests/test_trust.py and
tests/test_upload_tokens.py run the default (tokens).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpsketch.tools.cluster import ManagedProcess, ServerSpec, share_server, stop_all

#: The environment that lets a test server take uploads without upload tokens, and provision
#: studies without charging a population budget (tests of other features put more studies on a
#: server than a population's default budget takes: docs/ledger.md; the budget's own tests,
#: tests/test_population_budget.py and tests/test_ledger.py, run the defaults).
#: No population budget (tests of other features that put many studies on one server).
NO_BUDGET = {"DPSKETCH_POPULATION_EPSILON": "none", "DPSKETCH_POPULATION_FLOOR_EPSILON": "none"}
OPEN_UPLOADS = {"DPSKETCH_UPLOAD_AUTH": "open", **NO_BUDGET}

def _share_httpx_default_ssl_context() -> None:
    """Every top-level ``httpx.get``/``post`` call and every ``httpx.Client()`` without ``verify``
    builds an SSL context that loads certifi's CA bundle: 56 ms of CPU each on this 2-core
    machine, a fifth of test_batch_server's time (py-spy), for connections that are plain HTTP
    on loopback. Tests build that default context once (the SDK does the same for its pools:
    client_sdk.client._tls_context). Tests of TLS pass contexts of their own, which are
    untouched; nothing in the suite reaches a server that certifi's roots would verify."""
    from httpx._transports import default as transports  # private: a speed-up only, so guarded

    make = getattr(transports, "create_ssl_context", None)
    if make is None:
        return
    shared = make()

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None:
            return shared
        return make(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context


_share_httpx_default_ssl_context()


def _keep_plds_on_disk() -> None:
    """Tests charge studies in their own process (``ledger.check``, a ``Store``) as the share
    server and the SDK do, and keep the signed studies' built PLDs on disk as they do
    (dpsketch/pld_cache.py, $DPSKETCH_PLD_CACHE): each test process then reads what an earlier
    one built instead of rebuilding it (2-9 s of CPU each). The ledger's own default, no store,
    is tested with it removed (tests/test_ledger_cache.py)."""
    from dpsketch import pld_cache

    pld_cache.install()


_keep_plds_on_disk()

STORES = ["sqlite", "postgres"]
#: Run a test against both stores (it takes ``store_kind``, or fixtures that follow it).
BOTH_STORES = pytest.mark.parametrize("store_kind", STORES, indirect=True)


@pytest.fixture(scope="session", autouse=True)
def _servers_forked_from_an_imported_parent() -> Iterator[None]:
    """Share servers and analyzers start as forks of a parent that has imported them
    (tests/forkstart.py): a tenth of an exec'd start's CPU. Started here, before any test sets
    its own environment. ``DPSKETCH_TEST_FORK=0`` execs every process instead."""
    import forkstart

    from dpsketch.tools import cluster

    if not forkstart.enabled():
        yield
        return
    forkstart.start()
    cluster.launch = forkstart.launch
    try:
        yield
    finally:
        cluster.launch = cluster.popen


@pytest.fixture(autouse=True)
def _submission_journals(tmp_path_factory, monkeypatch):
    """Each test's SDK journals (client_sdk/journal.py) in a directory of its own, never in the
    home directory: a test that submits the same rows to the same study as another test (or an
    earlier run) must not find that submission already complete."""
    monkeypatch.setenv("DPSKETCH_SUBMISSIONS_DIR", str(tmp_path_factory.mktemp("journals")))


@pytest.fixture(scope="session")
def postgres():
    """One real PostgreSQL server for this pytest process (tests/pg.py), stopped at the end."""
    import pg

    server = pg.start()
    try:
        yield server
    finally:
        pg.stop(server)


@pytest.fixture
def store_kind(request) -> str:
    """Which store the test's servers use: "sqlite" unless parametrised with BOTH_STORES."""
    return getattr(request, "param", "sqlite")


@pytest.fixture
def store_location(request, store_kind, tmp_path):
    """``new(name)``: a fresh store location of the test's kind: a SQLite file under tmp_path,
    or the URL of a new PostgreSQL database. Databases are dropped after the test."""
    if store_kind == "sqlite":
        yield lambda name: tmp_path / f"{name}.sqlite3"
        return
    server = request.getfixturevalue("postgres")
    try:
        yield lambda name: server.new_database(name)
    finally:
        server.drop_databases()


class Servers:
    """Starts real share servers; stops (or has already killed) every one at teardown."""

    def __init__(self, workdir: Path, new_store=None):
        """``new_store(name)``: the store of a new server (default: a SQLite file in workdir)."""
        self.workdir = workdir
        self.new_store = new_store or (lambda name: workdir / f"{name}.sqlite3")
        self.started: list[ManagedProcess] = []

    def spec(self, server_id: str) -> ServerSpec:
        return ServerSpec(
            server_id=server_id,
            operator_token="op-" + secrets.token_hex(8),
            analyst_token="an-" + secrets.token_hex(8),
            db_path=self.new_store(server_id),
        )

    def start(self, spec: ServerSpec, extra_env: dict[str, str] | None = None,
              open_uploads: bool = True) -> ManagedProcess:
        env = {**(OPEN_UPLOADS if open_uploads else {}), **(extra_env or {})}
        proc = share_server(spec, self.workdir, env).start()
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        stop_all(self.started)


@pytest.fixture
def servers(tmp_path: Path, store_location) -> Iterator[Servers]:
    pool = Servers(tmp_path, store_location)
    try:
        yield pool
    finally:
        pool.stop_all()


class Cluster:
    """N real share servers plus a real analyzer process configured for them."""

    def __init__(self, pool: Servers, n: int = 3, api_token: str | None = None,
                 server_env: dict[str, dict[str, str]] | None = None, open_uploads: bool = True):
        """``server_env`` maps a server id to extra environment (e.g. its policy variables)."""
        import json

        from dpsketch.tools.cluster import analyzer, start_all

        self.specs = [pool.spec(f"s{j + 1}") for j in range(n)]
        base = OPEN_UPLOADS if open_uploads else {}
        self.procs = [share_server(spec, pool.workdir, {**base, **(server_env or {}).get(spec.server_id, {})})
                      for spec in self.specs]
        pool.started.extend(self.procs)
        start_all(self.procs)
        self.api_token = api_token
        config = {  # analyst tokens only, as an operator should configure an analyzer
            "servers": [
                {"server_id": s.server_id, "url": p.url, "analyst_token": s.analyst_token}
                for s, p in zip(self.specs, self.procs)
            ],
            "api_token": api_token,
        }
        path = pool.workdir / "cluster.json"
        path.write_text(json.dumps(config))
        self.analyzer = analyzer(path, pool.workdir / "analyzer.sqlite3", pool.workdir).start()
        pool.started.append(self.analyzer)

    @property
    def server_urls(self) -> list[str]:
        return [p.url for p in self.procs]

    def upload_tokens(self, study_id: str, quota: int | None = None, party: str | None = None,
                      population: str | None = None) -> list[str]:
        """One upload token per server for one data owner (or party), issued by each server's
        operator for ``population`` (None: each server's default population)."""
        from dpsketch.services.admin import issue_for_data_owner

        return issue_for_data_owner([(p.url, s.operator_token) for s, p in zip(self.specs, self.procs)],
                                    study_id, quota, party=party, population=population)


@pytest.fixture
def live_cluster(servers: Servers) -> Cluster:
    return Cluster(servers, 3, api_token="analyst-api-token")


@contextlib.contextmanager
def cluster_for_module(tmp_path_factory, name: str = "cluster", n: int = 3,
                       api_token: str | None = "analyst-api-token", **kwargs) -> Iterator[Cluster]:
    """A cluster in its own directory, for a module-scoped fixture: every test of the module
    that leaves nothing behind the others could see (each makes its own study) shares it, so
    the suite pays a cluster's start-up (about 3 s of CPU per process, most of it imports and
    the first study's calibration) once per module instead of once per test. ``kwargs`` as
    :class:`Cluster` (``server_env``, ``open_uploads``)."""
    pool = Servers(tmp_path_factory.mktemp(name))
    try:
        yield Cluster(pool, n, api_token=api_token, **kwargs)
    finally:
        pool.stop_all()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """One cluster for a whole module of tests that leave no state behind (bad-input checks)."""
    with cluster_for_module(tmp_path_factory) as cluster:
        yield cluster
