"""A population budget check costs one PLD build per study, however many ask (docs/ledger.md).

* ``ledger.compose`` remembers its compositions and starts from the longest one remembered (a
  check composes the population's charges, then the same with the study; the writer's check asks
  again): every epsilon it gives is the plain left fold's to the bit, over studies of every kind
  and notion, with and without the sign, in any order.
* The ledger builds each PLD once at a time, whoever asks: a thread asking for one being built
  waits for that build, one asking for another builds it meanwhile.
* A share server's store: a first upload token issued while the study's provisioning is building
  its PLDs waits for that build instead of making them again (before: the token's request and the
  background build each made both of a signed study's mixture PLDs, seconds of CPU each, at
  once), and later tokens and studies of the same targets build nothing. A first token waits for
  no other study's background build (before: its check queued behind them on the one
  charge-warm thread), only for the PLDs its own check needs; what is charged and refused is
  unchanged.
* The default targets' PLDs built ahead (``warm_charges``, as the server image ships them) are
  read, not built, by a process with an empty cache of its own.
* The processes that charge studies keep the PLDs on disk: the share server and the SDK's
  privacy limit (in process), and a real analyzer process, whose budget check writes them to its
  own cache directory.
"""

from __future__ import annotations

import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dpsketch.protocol import ledger
from dpsketch.protocol import secret_sign as _sign
from dpsketch.protocol.study import design

DELTA = 1e-6


def _fold(charges: list[ledger.Charge], notion: str, floor: bool):
    """The composed PLD as ledger.compose made it before it remembered any (a left fold); None:
    unbounded."""
    grid = max(c.grid(notion, floor) for c in charges)
    plds = [(c.floor_pld if floor else c.pld)(notion, grid) for c in charges]
    if any(p is None for p in plds):
        return None
    total = plds[0]
    for p in plds[1:]:
        total = total.compose(p)
    return total


def _epsilon(pld, delta: float = DELTA) -> float:
    return math.inf if pld is None else float(pld.get_epsilon_for_delta(delta))


@functools.cache
def _charges() -> tuple[ledger.Charge, ...]:
    """Designed once for every test here (designing them takes seconds)."""
    def one(i: int, **kw) -> ledger.Charge:
        return ledger.Charge.of(design(name=f"c{i}", columns=["a", "b", "c"], label=None, servers=["s1", "s2"],
                                       expected_reports=2000, seed=f"{i + 1:064x}", **kw)[0])

    return (one(0),  # design()'s defaults: signed, epsilon 1, floor 4 (the mixture's PLDs)
            one(1, epsilon=0.7, secret_sign=False),
            one(2, epsilon=1.3, neighbouring="add-remove", secret_sign=False),
            one(3, kind="gram", epsilon=0.5, epsilon_floor=None),
            one(4, epsilon=0.9, neighbouring="add-remove", secret_sign=False, epsilon_floor=3.0),
            one(5, epsilon=0.6, secret_sign=False, epsilon_floor=None))


@pytest.fixture
def fresh_compositions():
    ledger._COMPOSED.clear()
    yield
    ledger._COMPOSED.clear()


@pytest.mark.parametrize("notion", ["replace-one", "add-remove"])
def test_remembered_compositions_are_the_fold_to_the_bit(notion, fresh_compositions):
    charges = list(_charges())
    for floor in (False, True):
        for k in (1, 2, len(charges) - 1, len(charges)):  # each a prefix of the next: started from it
            want = _fold(charges[:k], notion, floor)
            for delta in (DELTA, 1e-5, DELTA):  # the last one remembered
                assert ledger.compose(charges[:k], notion, delta, floor=floor).epsilon == _epsilon(want, delta)
        other = charges[3:] + charges[:3]  # another order: another fold, not a remembered one
        assert ledger.compose(other, notion, DELTA, floor=floor).epsilon == _epsilon(_fold(other, notion, floor))
    finite = [c for c in charges if c.neighbouring == notion]
    assert len(finite) >= 2 and all(math.isfinite(_epsilon(_fold([c], notion, False))) for c in finite)
    if notion == "add-remove":  # a replace-one study is unbounded there, remembered or not
        assert ledger.compose(charges, notion, DELTA).epsilon == math.inf


def test_a_verdict_is_the_fold_s_numbers(fresh_compositions):
    charges = list(_charges())
    budget = ledger.Budget(4.0, DELTA, "replace-one", floor_epsilon=12.0)
    for study in charges[:3]:
        spent = [c for c in charges if c is not study]
        want = [_epsilon(_fold(group, "replace-one", floor)) for floor in (False, True)
                for group in (spent, spent + [study], [study])]
        for _ in range(2):  # the check outside the writer, then the writer's
            v = ledger.check(spent, study, budget)
            assert [v.spent.epsilon, v.needed.epsilon, v.study_epsilon, v.floor_spent.epsilon,
                    v.floor_needed.epsilon, v.floor_study_epsilon] == want
            assert v.fits == (want[1] <= 4.0 * (1 + 1e-9) and want[4] <= 12.0 * (1 + 1e-9))


@pytest.fixture
def counted_builds(monkeypatch):
    """Every build of a signed study's replace-one PLD (``secret_sign.replace_pld``), recorded by
    radius; each returns the Gaussian PLD of that shift (cheap, and only this test sees it: the
    caches are emptied before and after, the disk cache is off). The first build waits (up to 5 s)
    for a second one to start: a second thread building at the same time is then always seen."""
    from dp_accounting.pld import privacy_loss_distribution as dp_pld

    builds: list[float] = []
    another = threading.Event()

    def build(r: float, grid: float = 1e-3):
        builds.append(r)
        if len(builds) == 1:
            another.wait(5.0)
        else:
            another.set()
        return dp_pld.from_gaussian_mechanism(1.0 / r, value_discretization_interval=grid,
                                              pessimistic_estimate=True)

    def forget() -> None:
        ledger._signed_replace_pld.cache_clear()
        ledger._pld.cache_clear()
        ledger._COMPOSED.clear()

    monkeypatch.setenv("DPSKETCH_PLD_CACHE", "none")
    monkeypatch.setattr(_sign, "replace_pld", build)
    forget()
    yield builds
    forget()


def test_a_study_s_plds_are_built_once_however_many_tokens_ask(tmp_path, counted_builds):
    from dpsketch.services.settings import Settings
    from dpsketch.services.store import Store

    store = Store(Settings(server_id="s1", db_path=tmp_path / "s1.sqlite3", operator_token="op-" + "1" * 16,
                           analyst_token="an-" + "2" * 16, warm_start=False))  # budgets on: the defaults
    try:
        first, same = (design(name=f"q{i}", columns=["a", "b"], label=None, servers=["s1", "s2"],
                              expected_reports=200, seed=f"{i + 1:064x}")[0] for i in range(2))
        assert first.secret_sign and ledger.Charge.of(first).secret_sign
        store.provision(first)  # starts building its PLDs in the background
        # at once, as an operator's script does: three first tokens of the population at a time
        with ThreadPoolExecutor(3) as pool:
            issued = list(pool.map(lambda _: store.add_upload_tokens(first.study_id, 1, 5, None, "clinic"),
                                   range(3)))
        assert [population for _, _, population in issued] == ["clinic"] * 3
        store.add_upload_tokens(first.study_id, 1, 5, None, "clinic")  # a later token: nothing to build
        store.provision(same)  # the same targets: the same radii, nothing to build
        store.add_upload_tokens(same.study_id, 1, 5, None, "clinic")
        assert [c.study_id for c in store.charges("clinic")] == [first.study_id, same.study_id]
        # its guarantee's radius and its floor's, once each (before: the token's request built
        # them again while the provisioning's background build was making them)
        radii = {_sign.replace_radius_of(first.row_bound, first.mechanism.sigma, first.mechanism.server_sigma, lam)
                 for lam in (first.lambda_star, 1.0)}
        assert len(radii) == 2
        assert len(counted_builds) == 2, counted_builds
        assert sorted(counted_builds) == pytest.approx(
            sorted(math.ceil(r / ledger.RADIUS_STEP) * ledger.RADIUS_STEP for r in radii), rel=1e-12)
    finally:
        store.close()


def test_one_pld_is_built_once_at_a_time_and_other_ones_do_not_wait(counted_builds, monkeypatch):
    """The ledger's builds (``_signed_replace_pld``: a signed study's mixture PLD by its rounded
    radius) are made once however many threads ask at once: a thread asking for a radius another
    one is building waits for that build and gets the same PLD; a thread asking for another radius
    builds it meanwhile, without waiting (before: every thread asking built it again)."""
    grid = 1e-3
    held, other = 412_345, 512_345  # radii 4.12345 and 5.12345 (counted_builds makes Gaussians of them)
    counted_builds.append(0.0)  # the fixture's first build does not wait for a second one here
    real = _sign.replace_pld
    running, release = threading.Event(), threading.Event()

    def build(r: float, grid: float = 1e-3):
        if r == pytest.approx(held * ledger.RADIUS_STEP):
            running.set()
            release.wait(60)
        return real(r, grid)

    monkeypatch.setattr(_sign, "replace_pld", build)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(ledger._signed_replace_pld, held, grid)
        assert running.wait(60)  # the first thread is building it
        second = pool.submit(ledger._signed_replace_pld, held, grid)
        meanwhile = pool.submit(ledger._signed_replace_pld, other, grid).result(60)  # not kept waiting
        assert not release.is_set() and not first.done()
        release.set()
        assert first.result(60) is second.result(60)  # one build, the same PLD
    assert meanwhile is not None
    assert sorted(counted_builds[1:]) == pytest.approx([held * ledger.RADIUS_STEP, other * ledger.RADIUS_STEP])


def test_a_first_token_waits_only_for_the_plds_its_own_study_needs(tmp_path, monkeypatch):
    """A real share server (its app under uvicorn on a loopback port) with a population budget
    and an empty PLD cache. Study B (signed, targets of its own: its PLDs are built) is
    provisioned, and its background build is held while it runs (the real build, behind an
    event); studies A (unsigned: Gaussian PLDs) and A2 (signed, B's targets: B's radii) are
    provisioned after it. A's first token is issued while B's build is still held: it waits for
    nothing of B's (before: its check was queued on the one charge-warm thread behind B's build and
    A2's). A2's first token needs B's PLDs: it waits for B's build rather than making them again
    (each radius built once). What is charged and refused is what the ledger's checks in order
    give: A, A2 and B charged, D refused past the floor budget (409 budget-exceeded)."""
    import uvicorn

    from dpsketch.services.app import create_app
    from dpsketch.services.settings import Settings
    from dpsketch.tools.cluster import free_ports

    monkeypatch.setenv("DPSKETCH_PLD_CACHE", str(tmp_path / "pld"))  # empty: B's PLDs are built
    monkeypatch.delenv("DPSKETCH_PLD_SHIPPED", raising=False)
    servers = ["s1", "s2"]

    def study(i: int, **kw):
        return design(name=f"w{i}", columns=["a", "b"] if i % 2 else ["a", "b", "c"], label=None, servers=servers,
                      expected_reports=200, delta=DELTA, seed=f"{i + 1:064x}", **kw)[0]

    a, a2, b, d = (study(0, secret_sign=False), study(1, epsilon=0.8, epsilon_floor=3.5),
                   study(2, epsilon=0.8, epsilon_floor=3.5), study(3, secret_sign=False))
    assert b.secret_sign and not a.secret_sign
    radii = sorted(math.ceil(_sign.replace_radius_of(b.row_bound, b.mechanism.sigma, b.mechanism.server_sigma, lam)
                             / ledger.RADIUS_STEP) * ledger.RADIUS_STEP for lam in (b.lambda_star, 1.0))
    held = radii[0]  # B's guarantee's radius, the first one its check builds
    events: list[tuple] = []
    real = _sign.replace_pld
    running, release = threading.Event(), threading.Event()

    def build(r: float, grid: float = 1e-3):  # the real build, B's first one held while it runs
        events.append(("start", r, threading.current_thread().name))
        if r == pytest.approx(held, rel=1e-12) and not running.is_set():
            running.set()
            release.wait(60)
        try:
            return real(r, grid)
        finally:
            events.append(("end", r))

    def forget() -> None:
        ledger._signed_replace_pld.cache_clear()
        ledger._pld.cache_clear()
        ledger._COMPOSED.clear()

    forget()
    monkeypatch.setattr(_sign, "replace_pld", build)
    budget = ledger.Budget(4.0, DELTA, floor_epsilon=7.2)  # A, A2, B compose to floor 6.48; with D 7.88
    operator, analyst = "op-" + "1" * 16, "an-" + "2" * 16
    app = create_app(Settings(server_id="s1", db_path=tmp_path / "s1.sqlite3", operator_token=operator,
                              analyst_token=analyst, warm_start=False, population_epsilon=budget.epsilon,
                              population_floor_epsilon=budget.floor_epsilon, population_delta=DELTA))
    (port,) = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=120) as client:
            for _ in range(1500):
                if server.started:
                    break
                threading.Event().wait(0.02)

            def put(s) -> None:
                r = client.put(f"/v1/studies/{s.study_id}", content=s.canonical(),
                               headers={"Authorization": f"Bearer {analyst}", "Content-Type": "application/json"})
                assert r.status_code == 201, r.text

            def token(s, name: str) -> httpx.Response:
                r = client.post(f"/v1/studies/{s.study_id}/upload-tokens", json={"quota": 5, "population": "clinic"},
                                headers={"Authorization": f"Bearer {operator}"})
                events.append(("token", name, r.status_code))
                return r

            put(b)
            assert running.wait(60)  # B's background build is running (held)
            put(a)
            put(a2)  # their builds queued behind B's
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(token, a, "A").result(120)
                assert first.status_code == 201, first.text
                assert not release.is_set()  # issued while B's build was still held
                shared = pool.submit(token, a2, "A2")
                release.set()
                assert shared.result(120).status_code == 201
            assert token(b, "B").status_code == 201
            put(d)
            refused = token(d, "D")
            published = client.get("/v1/populations/clinic/ledger").json()
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
        app.state.store.close()
    try:
        order = [e for e in events if e[0] in ("token", "end")]
        assert order.index(("token", "A", 201)) < order.index(("end", held)), events  # A did not wait for B
        assert order.index(("end", held)) < order.index(("token", "A2", 201)), events  # A2 needed it
        starts = sorted(r for kind, r, *_ in (e for e in events if e[0] == "start"))
        assert starts == pytest.approx(radii, rel=1e-12), events  # each of B's radii built once, A2 shares them
        # what is charged and refused: the ledger's checks in order, nothing else
        charges = [ledger.Charge.of(s) for s in (a, a2, b)]
        for k in range(3):
            assert ledger.check(charges[:k], charges[k], budget).fits
        verdict = ledger.check(charges, ledger.Charge.of(d), budget)
        assert not verdict.fits
        assert refused.status_code == 409 and refused.json()["type"].endswith("budget-exceeded"), refused.text
        want = verdict.problem_members(budget, "clinic")
        assert {k: refused.json()[k] for k in want} == want
        assert [e["charge"] for e in published["studies"]] == [c.model_dump(mode="json") for c in charges]
        assert published["epsilon"] == ledger.compose(charges, "replace-one", DELTA).epsilon
        assert published["floor_epsilon"] == ledger.compose(charges, "replace-one", DELTA, floor=True).epsilon
    finally:
        forget()


def test_the_default_targets_plds_built_ahead_are_read_not_built(tmp_path, monkeypatch, counted_builds):
    """What deploy/Dockerfile ships (services.store.warm_charges, read from $DPSKETCH_PLD_SHIPPED):
    a fresh process with an empty cache of its own charges a default study of any shape, and
    builds nothing."""
    from dpsketch.services.store import warm_charges

    monkeypatch.setenv("DPSKETCH_PLD_CACHE", str(tmp_path / "built"))
    counted_builds.append(0.0)  # the first build does not wait for a second one here
    assert warm_charges()
    shipped = sorted(p.name for p in (tmp_path / "built").glob("replace-*.npz"))
    assert len(counted_builds) == 3 and len(shipped) == 2
    # as a new container: the image's files, an empty cache in its volume
    monkeypatch.setenv("DPSKETCH_PLD_SHIPPED", str(tmp_path / "built"))
    monkeypatch.setenv("DPSKETCH_PLD_CACHE", str(tmp_path / "volume"))
    ledger._signed_replace_pld.cache_clear()
    ledger._COMPOSED.clear()
    other = design(name="other", columns=[f"c{j}" for j in range(10)], label=None, servers=["s1", "s2", "s3"],
                   expected_reports=100_000, seed="ab" * 32)[0]
    verdict = ledger.check([], ledger.Charge.of(other), ledger.Budget(4.0, DELTA, floor_epsilon=12.0))
    assert verdict.fits and verdict.floor_study_epsilon is not None
    assert len(counted_builds) == 3  # read from the shipped files, not built
    # a radius the image does not hold: built, and kept in the volume's cache, not the image's
    ledger.check([], ledger.Charge.of(design(name="x", columns=["a", "b"], label=None, servers=["s1", "s2"],
                                             expected_reports=1000, epsilon=0.8, epsilon_floor=3.5)[0]),
                 ledger.Budget(4.0, DELTA, floor_epsilon=12.0))
    assert len(counted_builds) == 5
    assert sorted(p.name for p in (tmp_path / "built").glob("replace-*.npz")) == shipped
    assert len(list((tmp_path / "volume").glob("replace-*.npz"))) == 2


@pytest.fixture
def no_pld_store():
    """No store installed for the test (whatever an earlier one in this process installed), the
    previous one back afterwards."""
    previous = ledger.keep_plds_in(None)
    yield
    ledger.keep_plds_in(previous)


def test_the_ledger_keeps_plds_only_in_an_installed_store(tmp_path, monkeypatch, counted_builds, no_pld_store):
    """The ledger (dpsketch/protocol/) does no file I/O: with no store installed a built PLD is
    neither written to $DPSKETCH_PLD_CACHE nor read from it; the disk store (dpsketch/pld_cache.py)
    writes it there, and a later build of the same radius reads it, to the same numbers."""
    from dpsketch import pld_cache

    cache = tmp_path / "cache"
    monkeypatch.setenv("DPSKETCH_PLD_CACHE", str(cache))
    counted_builds.append(0.0)  # the first build does not wait for a second one here
    ticks, grid = 123_456, 1e-3  # radius 1.23456

    built = ledger._signed_replace_pld(ticks, grid)
    assert len(counted_builds) == 2 and not cache.exists()

    ledger._signed_replace_pld.cache_clear()
    ledger.keep_plds_in(pld_cache.DiskPldStore())
    ledger._signed_replace_pld(ticks, grid)  # nothing on disk yet: built, and kept there
    assert len(counted_builds) == 3
    assert [p.name for p in cache.iterdir()] == [f"replace-{ticks}x{ledger.RADIUS_STEP:g}-grid{grid!r}-v1.npz"]

    ledger._signed_replace_pld.cache_clear()
    read = ledger._signed_replace_pld(ticks, grid)
    assert len(counted_builds) == 3  # read, not built
    for delta in (1e-6, 1e-9):
        assert float(read.get_epsilon_for_delta(delta)) == float(built.get_epsilon_for_delta(delta))

    ledger._signed_replace_pld.cache_clear()
    ledger.keep_plds_in(None)
    ledger._signed_replace_pld(ticks, grid)  # the file is there, but no store: built again
    assert len(counted_builds) == 4


def test_the_processes_that_charge_studies_install_the_disk_store(tmp_path, no_pld_store):
    """A share server (create_app) and a data owner's privacy limit keep the ledger's PLDs on disk."""
    from dpsketch import pld_cache
    from dpsketch.client_sdk.budget import PrivacyLimit
    from dpsketch.services.app import create_app
    from dpsketch.services.settings import Settings

    PrivacyLimit(1.0, 1e-6, tmp_path / "ledger.json")
    assert isinstance(ledger.pld_store(), pld_cache.DiskPldStore)

    ledger.keep_plds_in(None)
    app = create_app(Settings(server_id="s1", db_path=tmp_path / "s1.sqlite3", operator_token="op-" + "1" * 16,
                              analyst_token="an-" + "2" * 16, warm_start=False))
    try:
        assert isinstance(ledger.pld_store(), pld_cache.DiskPldStore)
    finally:
        app.state.store.close()
    mine = pld_cache.DiskPldStore()
    ledger.keep_plds_in(mine)
    PrivacyLimit(1.0, 1e-6, tmp_path / "ledger.json")
    assert ledger.pld_store() is mine  # an embedder's own store is left in place


def test_the_analyzer_keeps_its_budget_checks_plds_on_disk(tmp_path, monkeypatch):
    """The analyzer's install point (analyzer/__main__.py: ``pld_cache.install()`` in main), as it
    runs: a real analyzer process with a cache directory of its own, before two real share
    servers with a population budget. Creating a signed study makes the analyzer check the
    budget (Coordinator._check_budgets: ``ledger.check``), which builds the study's mixture PLDs;
    with the disk store installed they are kept in the analyzer's cache directory, without it
    nothing is written there. The servers keep theirs in the test run's own cache (they read it,
    not the analyzer's), and nothing is shipped ahead, so the analyzer's files are its own builds."""
    from conftest import Cluster, Servers
    from dpsketch import pld_cache
    from dpsketch.analyzer.client import AnalyzerClient

    shared = pld_cache.cache_dir()
    servers_cache = {"DPSKETCH_PLD_CACHE": str(shared) if shared is not None else "none"}
    analyzer_cache = tmp_path / "analyzer-pld"
    monkeypatch.setenv("DPSKETCH_PLD_CACHE", str(analyzer_cache))
    monkeypatch.delenv("DPSKETCH_PLD_SHIPPED", raising=False)
    pool = Servers(tmp_path)
    try:
        c = Cluster(pool, 2, api_token="analyst-api-token", open_uploads=False,  # the default budget
                    server_env={"s1": servers_cache, "s2": servers_cache})
        for url in c.server_urls:  # the servers' default population has a budget: the analyzer checks it
            assert httpx.get(f"{url}/v1/populations/default/ledger", timeout=30).json()["budget_epsilon"] is not None
        with AnalyzerClient(c.analyzer.url, c.api_token) as an:
            created = an.create_study(name="pld-cache", columns=["a", "b", "c"], label=None, expected_reports=2000,
                                      secret_sign=True, population="default")  # a study naming its population
        assert created["study"]["secret_sign"], created  # the mixture's PLDs, which the store keeps
    finally:
        pool.stop_all()
    kept = sorted(p.name for p in analyzer_cache.glob("replace-*.npz")) if analyzer_cache.exists() else []
    assert kept, f"no PLD kept in the analyzer's cache {analyzer_cache}"


def test_a_signed_add_remove_charge_s_loss_grid_is_made_once(monkeypatch):
    """A signed add/remove study's loss grid is read off the distributions of its presence pair
    (about 5 ms), and every composition asks it of every charge: six times a budget check, six
    more the writer's. Cached by the charge's key, it is made once per key, notion and floor
    however often the population is composed, and it is the grid accounting gives (before: made
    again for every charge of every composition; 10 such charges cost 51 ms a composition)."""
    from dpsketch.protocol import accounting

    studies = [design(name=f"g{i}", columns=["a", "b", "c"][:2 + i % 2], label=None, servers=["s1", "s2"],
                      expected_reports=200, delta=DELTA, seed=f"{i + 101:064x}", neighbouring="add-remove",
                      epsilon=0.5)[0] for i in range(4)]
    assert all(s.secret_sign and s.neighbouring == "add-remove" for s in studies)
    charges = [ledger.Charge.of(s) for s in studies]
    made = []
    real = accounting.pld_grid

    def counted(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)

    ledger._loss_grid.cache_clear()
    monkeypatch.setattr(accounting, "pld_grid", counted)
    for _ in range(3):
        for floor in (False, True):
            ledger.compose(charges, "add-remove", DELTA, floor=floor)
    distinct = {(c._floor_key if floor else c._key, floor) for c in charges for floor in (False, True)}
    assert len(distinct) == 4  # two shapes of study, each with its floor
    assert len(made) == len(distinct), len(made)  # once each, not once per charge and composition (24)
    monkeypatch.setattr(accounting, "pld_grid", real)
    for c in charges:
        for floor in (False, True):
            *key, signed = c._floor_key if floor else c._key
            if floor:
                key.insert(5, 1.0)
            assert c.grid("add-remove", floor) == real(*key, "add-remove", secret_sign=signed)
    ledger._loss_grid.cache_clear()
