"""The privacy ledger of a population, enforced by the share servers (docs/ledger.md).

* The composition is dp-accounting's PLD composition of each study's own mechanism: checked
  against PLDs built here straight from dp-accounting and against the closed form of composed
  Gaussians (mu = sqrt(sum mu_i^2)), and far below the naive sum of epsilons.
* A real 3-server cluster with a population budget: studies are accepted until the budget, the
  next is refused at every server (409 budget-exceeded naming budget, spent and needed) and
  stored nowhere; the analyzer and ``dpsketch study ledger`` show the ledger.
* A SIGKILLed server restarts with the same ledger and still enforces it.
* The SDK's own limit refuses a study past it (nothing sent, its file untouched) and records one
  within it, once.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from dp_accounting import get_epsilon_gaussian
from dp_accounting.pld import privacy_loss_distribution as dp_pld
from pydantic import ValidationError

from dpsketch.analyzer.cli import main as study_cli
from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client, ProblemError
from dpsketch.client_sdk.budget import LedgerFileError, PrivacyLimit, PrivacyLimitExceeded
from dpsketch.protocol import design, ledger
from dpsketch.protocol.study import Study

from conftest import Cluster, cluster_for_module

SERVERS = ["s1", "s2", "s3"]
POP = "clinic-2024.enrolled"


def _study(i: int, epsilon: float = 1.0, population: str | None = POP, **kw) -> Study:
    """A study charged to POP. Unsigned unless ``secret_sign`` is given: the Gaussian charges this
    file recomputes from dp-accounting directly and the budgets below are set for (design()'s
    default signs a sketch study; the signed charges: test_a_signed_study_*, test_signed_*)."""
    args = dict(name=f"study {i}", columns=["a", "b"], label=None, servers=SERVERS, expected_reports=200,
                epsilon=epsilon, seed=f"{i + 1:064x}", secret_sign=False)
    args.update(kw)
    return design(population=population, **args)[0]


def _mu(study: Study, notion: str) -> float:
    """The Gaussian shift a study's report gets under ``notion``, from its public parameters
    (docs/trust.md): replace-one keeps the report's own noise in both worlds."""
    sens = {"sketch": 2.0 * study.row_bound, "histogram": math.sqrt(2.0)}[study.kind] if notion == "replace-one" \
        else study.row_bound
    lam = max(1.0, study.lambda_star) if notion == "replace-one" else study.lambda_star - 1.0
    noise = study.mechanism  # the discrete noise as the study accounts it: within 1e-5 of nominal
    assert noise.sigma == pytest.approx(study.sigma, rel=1e-5)
    assert noise.server_sigma == pytest.approx(study.server_sigma, rel=1e-5)
    return sens / math.sqrt(noise.sigma ** 2 * lam + noise.server_sigma ** 2)


# --- 1. composition -----------------------------------------------------------------------------


def test_composition_matches_dp_accounting_and_beats_the_naive_sum():
    epsilons = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5]
    studies = [_study(i, e) for i, e in enumerate(epsilons)]
    delta = 1e-6
    got = ledger.compose([ledger.Charge.of(s) for s in studies], "replace-one", delta)

    # the same PLDs built here from dp-accounting directly, composed
    independent = None
    for s in studies:
        one = dp_pld.from_gaussian_mechanism(1.0 / _mu(s, "replace-one"), value_discretization_interval=1e-3)
        independent = one if independent is None else independent.compose(one)
    assert got.epsilon == pytest.approx(independent.get_epsilon_for_delta(delta), rel=1e-9)
    # and the closed form: Gaussians compose to the Gaussian of mu = sqrt(sum mu_i^2); the
    # pessimistic PLD is an upper bound, tight to its grid
    exact = get_epsilon_gaussian(1.0 / math.sqrt(sum(_mu(s, "replace-one") ** 2 for s in studies)), delta)
    assert exact <= got.epsilon <= exact + 0.02
    # each study is charged what it promises
    for s in studies:
        assert ledger.compose([ledger.Charge.of(s)], "replace-one", s.delta).epsilon == pytest.approx(
            s.guarantees()["epsilon"], abs=2e-3)
    assert got.naive_epsilon == pytest.approx(sum(s.guarantees()["epsilon"] for s in studies), rel=1e-9)
    assert got.naive_delta == pytest.approx(10 * delta)
    assert got.epsilon < 0.45 * got.naive_epsilon  # tight composition, not a sum (about 3.5 vs 9.6)


def test_neighbouring_notions_and_kinds_are_charged_what_they_promise():
    # add/remove with the servers' noise only (epsilon_floor = epsilon: sigma = 0) is a Gaussian
    ar = [_study(i, 1.0, neighbouring="add-remove", epsilon_floor=1.0) for i in range(3)]
    assert all(s.sigma == 0 for s in ar)
    got = ledger.compose([ledger.Charge.of(s) for s in ar], "add-remove", 1e-6)
    exact = get_epsilon_gaussian(1.0 / math.sqrt(sum(_mu(s, "add-remove") ** 2 for s in ar)), 1e-6)
    assert exact <= got.epsilon <= exact + 0.02
    # an add/remove study with client noise in a replace-one ledger: the replace-one Gaussian of
    # the same noise
    mixed = _study(7, 1.0, neighbouring="add-remove")
    assert mixed.sigma > 0
    charge = ledger.Charge.of(mixed)
    one = ledger.compose([charge], "replace-one", 1e-6).epsilon
    assert get_epsilon_gaussian(1.0 / _mu(mixed, "replace-one"), 1e-6) == pytest.approx(one, abs=2e-3)
    # its own notion: exactly its promise
    assert ledger.compose([charge], "add-remove", mixed.delta).epsilon == pytest.approx(
        mixed.guarantees()["epsilon"], abs=2e-3)
    # a replace-one study publishes its exact count: unbounded under add/remove
    ro = ledger.compose([ledger.Charge.of(_study(8)), charge], "add-remove", 1e-6)
    assert math.isinf(ro.epsilon) and math.isinf(ro.naive_epsilon)
    # gram and histogram studies: the charge is the study's own mechanism
    gram = _study(9, 1.0, kind="gram")
    hist = design(name="h", columns=[], label=None, servers=SERVERS, expected_reports=200, kind="histogram",
                  histogram={"axes": [{"column": "age", "edges": [18, 30, 50]}]}, population=POP)[0]
    for s in (gram, hist):
        assert ledger.compose([ledger.Charge.of(s)], s.neighbouring, s.delta).epsilon == pytest.approx(
            s.guarantees()["epsilon"], abs=2e-3)
    assert get_epsilon_gaussian(1.0 / _mu(hist, "replace-one"), hist.delta) == pytest.approx(
        ledger.compose([ledger.Charge.of(hist)], "replace-one", hist.delta).epsilon, abs=2e-3)


#: A charge as the ledger stored it before the secret_sign member existed (a server's SQLite row,
#: an SDK ledger file): it must parse and re-serialise to the same bytes.
OLD_CHARGE = ('{"study_id":"adc1493353d157f0e5cb835264d8f0bcced1ad8c12bebe576eff491d40f73820","name":"study 1",'
              '"population":"clinic-2024.enrolled","neighbouring":"replace-one","kind":"sketch","row_bound":1.0,'
              '"sigma":1.5229146480560303,"server_sigma":1.838121056555668,"width":2,'
              '"lambda_star":29.325232921501144,"delta":1e-6,"epsilon":0.9999988939298807}')


def test_charges_without_the_sign_serialise_as_before():
    old = ledger.Charge.model_validate_json(OLD_CHARGE)
    assert not old.secret_sign
    assert old.model_dump_json() == OLD_CHARGE
    assert old.model_dump(mode="json") == json.loads(OLD_CHARGE)  # as the SDK's ledger file holds it
    plain = ledger.Charge.of(_study(1, secret_sign=False))
    assert "secret_sign" not in plain.model_dump(mode="json") and "secret_sign" not in plain.model_dump_json()
    signed = ledger.Charge.of(_study(1, secret_sign=True, expected_reports=2000))
    assert signed.model_dump(mode="json")["secret_sign"] is True
    assert ledger.Charge.model_validate_json(signed.model_dump_json()) == signed


def test_a_signed_study_is_charged_its_promise_and_composes_with_unsigned_ones():
    """A secret-sign study (docs/secret_sign.md) is charged the mixture's PLD, so its charge is
    its promise (not the plain Gaussian loss of its smaller noise, several times more), and it
    composes with Gaussian charges on a common grid."""
    from dpsketch.protocol import secret_sign

    delta = 1e-6
    signed = _study(50, secret_sign=True, expected_reports=20_000, columns=[f"c{j}" for j in range(6)])
    plain = _study(51, secret_sign=False, expected_reports=20_000, columns=[f"c{j}" for j in range(6)])
    assert signed.secret_sign and not plain.secret_sign and signed.sigma < 0.5 * plain.sigma
    cs, cp = ledger.Charge.of(signed), ledger.Charge.of(plain)
    assert cs.secret_sign and not cp.secret_sign
    promise = signed.guarantees()["epsilon"]
    alone = ledger.compose([cs], "replace-one", delta).epsilon
    print(f"signed study: promise {promise:.5f}, charged {alone:.5f}")
    assert promise - 1e-3 <= alone <= promise + 2.5e-3  # the PLD's grid and coarser cells
    # what the ledger charged before it knew the flag: the Gaussian shift of the smaller noise
    as_gaussian = ledger.compose([cs.model_copy(update={"secret_sign": False})], "replace-one", delta).epsilon
    assert as_gaussian > 2.5 * alone
    # the charge is the mixture's PLD of the study's noise, built here from secret_sign directly,
    # at the radius rounded up to ledger.RADIUS_STEP (shared by studies of one target: pessimistic)
    r = secret_sign.replace_radius_of(signed.row_bound, cs.sigma, cs.server_sigma, signed.lambda_star)
    exact = secret_sign.replace_pld(r).get_epsilon_for_delta(delta)
    direct = secret_sign.replace_pld(math.ceil(r / ledger.RADIUS_STEP) * ledger.RADIUS_STEP)
    assert alone == pytest.approx(direct.get_epsilon_for_delta(delta), rel=1e-12)
    assert exact <= alone <= exact + 1e-3
    # with an unsigned study: one grid, composed by dp-accounting, tighter than the naive sum
    both = ledger.compose([cs, cp], "replace-one", delta)
    gauss = dp_pld.from_gaussian_mechanism(1.0 / _mu(plain, "replace-one"), value_discretization_interval=1e-3)
    assert both.epsilon == pytest.approx(direct.compose(gauss).get_epsilon_for_delta(delta), rel=1e-9)
    assert max(alone, plain.guarantees()["epsilon"]) < both.epsilon < 0.8 * both.naive_epsilon
    assert both.naive_epsilon == pytest.approx(promise + plain.guarantees()["epsilon"], rel=1e-9)
    # a budget check sees the signed study's own cost
    verdict = ledger.check([cp], cs, ledger.Budget(1.6, delta))
    assert verdict.fits and verdict.study_epsilon == pytest.approx(alone)


def test_signed_add_remove_studies_in_both_notions():
    """An add/remove study with the sign: charged its own promise in an add/remove ledger (with
    an unsigned one: the grids differ, the coarser is taken); in a replace-one ledger the
    replace-one mixture of the same noise, about half the unsigned study's 2B Gaussian."""
    delta = 1e-6
    kw = dict(neighbouring="add-remove", expected_reports=20_000, columns=[f"c{j}" for j in range(6)])
    signed, plain = _study(60, secret_sign=True, **kw), _study(61, secret_sign=False, **kw)
    cs, cp = ledger.Charge.of(signed), ledger.Charge.of(plain)
    own = ledger.compose([cs], "add-remove", delta).epsilon
    assert own == pytest.approx(signed.guarantees()["epsilon"], abs=2e-3)
    both = ledger.compose([cs, cp], "add-remove", delta)
    assert max(own, ledger.compose([cp], "add-remove", delta).epsilon) < both.epsilon < both.naive_epsilon
    replace = ledger.compose([cs], "replace-one", delta).epsilon
    assert replace == pytest.approx(cs.epsilon_in("replace-one"), abs=2e-3)
    assert replace < 0.7 * ledger.compose([cp], "replace-one", delta).epsilon
    assert math.isinf(ledger.compose([ledger.Charge.of(_study(62, secret_sign=True, expected_reports=20_000)), cs],
                                     "add-remove", delta).epsilon)  # replace-one: unbounded there


def test_population_member_keeps_old_ids_and_is_validated():
    plain = _study(1, population=None)
    assert "population" not in plain.model_dump(mode="json")
    assert b"population" not in plain.canonical()
    same = Study.model_validate({**plain.model_dump(mode="json")})
    assert same.study_id == plain.study_id
    named = Study.model_validate({**plain.model_dump(mode="json"), "population": POP})
    assert named.study_id != plain.study_id and named.population == POP
    for bad in ("", "a b", "x/y", "é", "a" * 65, "-lead"):
        with pytest.raises(ValidationError):
            Study.model_validate({**plain.model_dump(mode="json"), "population": bad})


def test_budget_check_is_idempotent_per_study():
    charges = [ledger.Charge.of(_study(i)) for i in range(3)]
    budget = ledger.Budget(2.0, 1e-6)
    assert ledger.check(charges, charges[1], budget).fits  # already charged: costs nothing more
    fourth = ledger.check(charges, ledger.Charge.of(_study(3)), budget)
    assert not fourth.fits and fourth.spent.epsilon <= 2.0 < fourth.needed.epsilon


# --- 2. enforced by every server ----------------------------------------------------------------

#: An LTM budget alone (the floors: tests/test_population_budget.py), so the figures below are
#: those of the certified guarantees.
BUDGET = {"DPSKETCH_POPULATION_EPSILON": "2.0", "DPSKETCH_POPULATION_DELTA": "1e-6",
          "DPSKETCH_POPULATION_FLOOR_EPSILON": "none"}


def _put(cluster: Cluster, j: int, study: Study) -> httpx.Response:
    return httpx.put(f"{cluster.procs[j].url}/v1/studies/{study.study_id}", json=study.model_dump(mode="json"),
                     headers={"Authorization": f"Bearer {cluster.specs[j].analyst_token}"}, timeout=30)


def _enrol(cluster: Cluster, j: int, study: Study, population: str = POP) -> httpx.Response:
    """Server j's operator issues an upload token of ``population`` for the study: the first one
    charges the study to that population (docs/ledger.md)."""
    return httpx.post(f"{cluster.procs[j].url}/v1/studies/{study.study_id}/upload-tokens",
                      json={"population": population, "quota": 10},
                      headers={"Authorization": f"Bearer {cluster.specs[j].operator_token}"}, timeout=60)


def _ledger(cluster: Cluster, j: int, population: str = POP) -> dict:
    r = httpx.get(f"{cluster.procs[j].url}/v1/populations/{population}/ledger", timeout=30)  # public
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def budget_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """Servers (taking uploads with tokens only, the default) with a budget for every population,
    shared by the tests that charge populations no other test of the module charges (POP and
    "other-pop": test_servers_refuse_the_study_past_the_budget; OWNER_POP:
    test_sdk_limit_refuses_past_it_and_records_within)."""
    with cluster_for_module(tmp_path_factory, "budget", server_env={s: BUDGET for s in SERVERS},
                            open_uploads=False) as c:
        yield c


#: The members of a budget-exceeded problem (docs/protocol.md section 8), from a server or the analyzer.
BUDGET_MEMBERS = {"population", "neighbouring", "budget_epsilon", "budget_delta", "spent_epsilon",
                  "studies_charged", "needed_epsilon", "study_epsilon"}


def test_servers_refuse_the_study_past_the_budget(budget_cluster, capsys):
    c = budget_cluster
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = [an.create_study(name=f"q{i}", columns=["a", "b"], expected_reports=200, population=POP,
                                   secret_sign=False, kind="sketch")
                   for i in range(3)]
        ids = [v["study_id"] for v in created]
        view = an.ledger(study_id=ids[0])
        assert view["population"] == POP and view["charged"] is False  # provisioning charges nothing
        for sid in ids:  # each operator enrols its data owners of POP for the three studies
            c.upload_tokens(sid, population=POP)
        view = an.ledger(study_id=ids[0])
        assert view["charged"] is True and len(view["servers"]) == 3
        # a fourth naming POP would take it past epsilon = 2: the analyzer (advisory) asks no server
        with pytest.raises(ProblemError) as refused:
            an.create_study(name="q3", columns=["a", "b"], expected_reports=200, population=POP,
                            secret_sign=False, kind="sketch")
        assert refused.value.slug == "budget-exceeded" and refused.value.status == 409
        assert "nothing was provisioned" in refused.value.detail
        # its problem has every member a server's refusal has (section 8), and the server it names
        r = httpx.post(f"{c.analyzer.url}/v1/studies", headers={"Authorization": f"Bearer {c.api_token}"},
                       json={"name": "q3", "columns": ["a", "b"], "expected_reports": 200, "population": POP,
                             "secret_sign": False, "kind": "sketch"}, timeout=60)
        assert r.status_code == 409, r.text
        refusal = r.json()
        assert BUDGET_MEMBERS | {"server_id"} <= refusal.keys(), sorted(refusal)
        assert (refusal["population"], refusal["neighbouring"], refusal["studies_charged"]) == (POP, "replace-one", 3)
        assert refusal["server_id"] in SERVERS and refusal["spent_epsilon"] <= 2.0 < refusal["needed_epsilon"]
        # a study without a population is provisioned; the servers charge it when tokens are issued
        free = an.create_study(name="free", columns=["a", "b"], expected_reports=200, kind="sketch")
        # the analyzer signs a sketch study unless told not to (CreateStudy.secret_sign)
        assert free["study"]["secret_sign"] is True and free["guarantees"]["secret_sign"] is True
        assert all("secret_sign" not in v["study"] for v in created)
        assert an.ledger(study_id=free["study_id"]) == {"population": None, "study_id": free["study_id"],
                                                        "charged": False, "servers": []}
        with pytest.raises(ProblemError) as bad:
            an.create_study(name="bad", columns=["a"], expected_reports=200, population="no/slashes")
        assert bad.value.status == 422
    books = [_ledger(c, j) for j in range(3)]
    for book in books:
        assert [e["charge"]["study_id"] for e in book["studies"]] == ids
        assert book["budget_epsilon"] == 2.0 and book["neighbouring"] == "replace-one"
        assert 1.5 < book["epsilon"] <= 2.0 < book["naive_epsilon"]
        assert book["remaining_epsilon"] == pytest.approx(2.0 - book["epsilon"])

    # the next study, whatever population it names (here none), put to each server directly:
    # every one provisions it, and every operator's first POP token for it is refused
    nxt = _study(10, population=None)
    for j in range(3):
        assert _put(c, j, nxt).status_code == 201
        body = _enrol(c, j, nxt).json()
        assert body["type"] == "urn:dpsketch:problem:budget-exceeded" and body["status"] == 409
        assert BUDGET_MEMBERS <= body.keys() and body["studies_charged"] == 3
        assert body["budget_epsilon"] == 2.0 and body["spent_epsilon"] == pytest.approx(books[j]["epsilon"])
        assert {k: refusal[k] for k in ("population", "neighbouring", "budget_epsilon", "budget_delta",
                                        "studies_charged")} == {k: body[k] for k in ("population", "neighbouring",
                                                                                     "budget_epsilon", "budget_delta",
                                                                                     "studies_charged")}
        assert body["spent_epsilon"] <= 2.0 < body["needed_epsilon"]
        for word in ("budget", "spent", f"{body['needed_epsilon']:.4g}", POP):
            assert word in body["detail"]
        assert _ledger(c, j) == books[j]
        tokens = httpx.get(f"{c.procs[j].url}/v1/studies/{nxt.study_id}/upload-tokens", timeout=30,
                           headers={"Authorization": f"Bearer {c.specs[j].operator_token}"}).json()
        assert tokens["tokens"] == []  # no token was issued
    # tokens for a study already charged cost nothing; another population has its own budget
    assert _enrol(c, 0, Study.model_validate(created[0]["study"])).status_code == 201
    other = _study(11, population=POP)  # it names POP; the operator enrols it as other-pop
    assert all(_put(c, j, other).status_code == 201 for j in range(3))
    assert all(_enrol(c, j, other, "other-pop").status_code == 201 for j in range(3))
    assert _ledger(c, 0) == books[0] and len(_ledger(c, 0, "other-pop")["studies"]) == 1
    assert httpx.get(f"{c.procs[0].url}/v1/populations/a%20b/ledger").status_code == 422
    for url, headers in ((c.procs[0].url, {}), (c.analyzer.url, {"Authorization": f"Bearer {c.api_token}"})):
        paths = httpx.get(f"{url}/openapi.json", headers=headers).json()["paths"]
        assert "/v1/populations/{population}/ledger" in paths

    assert study_cli(["--analyzer", c.analyzer.url, "--token", c.api_token, "ledger", POP]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["servers"]) == 3 and "s3: 3 studies, epsilon = " in err


# --- 3. the ledger survives a crash -------------------------------------------------------------


def test_ledger_survives_sigkill_and_is_still_enforced(servers):
    no_budget = {"DPSKETCH_POPULATION_EPSILON": "none", "DPSKETCH_POPULATION_FLOOR_EPSILON": "none"}
    c = Cluster(servers, 3, api_token="analyst-api-token", server_env={"s1": BUDGET, "s2": no_budget},
                open_uploads=False)
    charged = [_study(20 + i) for i in range(3)]
    for s in charged:
        assert [_put(c, j, s).status_code for j in range(3)] == [201] * 3
        assert [_enrol(c, j, s).status_code for j in range(2)] == [201] * 2
    before = _ledger(c, 0)
    assert len(before["studies"]) == 3 and _ledger(c, 1)["budget_epsilon"] is None  # s2: no budget
    c.procs[0].kill()
    assert c.procs[0].proc.returncode == -9
    c.procs[0].start()  # the same file and port
    assert _ledger(c, 0) == before
    fourth = _study(30)
    assert _put(c, 0, fourth).status_code == 201
    r = _enrol(c, 0, fourth)
    assert r.status_code == 409 and r.json()["type"].endswith("budget-exceeded")
    assert _enrol(c, 0, charged[1]).status_code == 201  # charged already: not charged again
    assert _ledger(c, 0) == before
    assert _put(c, 1, fourth).status_code == 201 and _enrol(c, 1, fourth).status_code == 201  # s2: no budget
    assert len(_ledger(c, 1)["studies"]) == 4


# --- 4. the data owner's own limit --------------------------------------------------------------


#: The population of the SDK-limit test's first study: the budgeted servers it shares charge it
#: alone (a study of about epsilon 1 within a budget of 2), never POP, whose budget another test spends.
OWNER_POP = "sdk-owner.enrolled"


def test_sdk_limit_refuses_past_it_and_records_within(budget_cluster, tmp_path):
    c = budget_cluster
    first, second = _study(40, population=OWNER_POP), _study(41, population=None)  # the owner counts every study
    tokens = {}
    for s in (first, second):
        assert [_put(c, j, s).status_code for j in range(3)] == [201] * 3
        tokens[s.study_id] = c.upload_tokens(s.study_id, quota=None, population=OWNER_POP if s is first else "x")
    path = tmp_path / "owner" / "ledger.json"
    limit = PrivacyLimit(1.2, 1e-6, path)
    rows = np.random.default_rng(0).uniform(-0.5, 0.5, (5, 2))
    with Client(c.server_urls, privacy_limit=limit, token=tokens[first.study_id]) as client:
        client.submit_many(first.study_id, rows)
        client.submit_many(first.study_id, rows[:2])  # the same study again: recorded once
        assert [e["charge"]["study_id"] for e in limit.entries()] == [first.study_id]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        saved = path.read_bytes()
    with Client(c.server_urls, privacy_limit=limit, token=tokens[second.study_id]) as client:
        with pytest.raises(PrivacyLimitExceeded) as refused:
            client.submit_many(second.study_id, rows)
        assert refused.value.verdict.needed.epsilon > 1.2 >= refused.value.verdict.spent.epsilon
        assert path.read_bytes() == saved
        assert set(client.report_counts(second.study_id).values()) == {0}  # nothing was sent
    # a larger limit takes it, and records it
    with Client(c.server_urls, privacy_limit=PrivacyLimit(2.0, 1e-6, path), token=tokens[second.study_id]) as client:
        client.submit(second.study_id, rows[0])
    assert [e["charge"]["study_id"] for e in limit.entries()] == [first.study_id, second.study_id]
    assert limit.spent().epsilon == pytest.approx(
        ledger.compose([ledger.Charge.of(first), ledger.Charge.of(second)], "replace-one", 1e-6).epsilon)
    # a damaged file is refused, never overwritten
    path.write_text("{not json")
    with pytest.raises(LedgerFileError):
        PrivacyLimit(2.0, 1e-6, path).check(first)
    assert path.read_text() == "{not json"


def test_analyzer_passes_a_servers_budget_refusal_on_with_every_member(tmp_path):
    """A server that refuses at provisioning what the analyzer's pre-check let through (its
    ledger could not be read, or moved in between): the analyzer's 409 carries the server's own
    members and the server's id (docs/protocol.md section 6b), and forgets the study."""
    from types import SimpleNamespace

    from dpsketch.analyzer.coordinator import Coordinator, UpstreamError
    from dpsketch.analyzer.store import AnalyzerStore

    members = {"population": POP, "neighbouring": "replace-one", "budget_epsilon": 2.0, "budget_delta": 1e-6,
               "spent_epsilon": 1.9, "studies_charged": 3, "needed_epsilon": 2.6, "study_epsilon": 0.9}

    class Refusing:
        endpoint = SimpleNamespace(server_id="s2")

        def ledger(self, population):
            raise UpstreamError("s2", "unreachable")  # the pre-check cannot see this server's ledger

        def provision(self, study):
            raise UpstreamError("s2", "budget-exceeded: spent", ProblemError("budget-exceeded", "spent", extra=members))

    coordinator = object.__new__(Coordinator)
    coordinator.config = SimpleNamespace(server_ids=["s1", "s2"])
    coordinator.store = AnalyzerStore(tmp_path / "analyzer.db")
    coordinator.servers = [Refusing()]
    coordinator.log = lambda _msg: None
    with pytest.raises(ProblemError) as refused:
        coordinator.create_study(name="q", columns=["a", "b"], label=None, expected_reports=200, population=POP,
                                 secret_sign=False, kind="sketch")
    assert refused.value.slug == "budget-exceeded" and refused.value.status == 409
    assert refused.value.extra == {"server_id": "s2", **members}
    assert BUDGET_MEMBERS | {"server_id"} <= refused.value.body().keys()
    assert coordinator.store.list() == []  # forgotten: the study cannot run on this cluster
    coordinator.store.close()
