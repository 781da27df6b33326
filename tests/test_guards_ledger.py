"""The privacy ledger at exactly its budget and 0.1 % over it (issue 47).

A population's studies compose (dp-accounting PLDs, ``ledger.compose``); a server refuses a study
whose composition would pass the population's budget (``ledger.check``, ``policy.check_population``).
The hand mutation run found a ledger that accepted a study 1 % over budget passing every test, so
here the budget is set to the composed epsilon itself (admitted) and to it / 1.001 (refused), in
the protocol module, at an in-process share server and in a data owner's SDK ledger.
"""

from __future__ import annotations

import pytest

from dpsketch.protocol import ledger
from dpsketch.protocol.study import Study, design
from test_server_unit import Server, assert_problem

DELTA = 1e-6


def _study(name: str, epsilon: float, population: str = "clinic-a", neighbouring: str = "replace-one") -> Study:
    return design(name=name, columns=["a", "b", "c"], label=None, servers=["s1", "s2"], expected_reports=2000,
                  k=8, s=2, epsilon=epsilon, population=population, neighbouring=neighbouring, secret_sign=False,
                  epsilon_floor=None)[0]


def _composed(*studies: Study, notion: str = "replace-one") -> float:
    return ledger.compose([ledger.Charge.of(s) for s in studies], notion, DELTA).epsilon


@pytest.mark.parametrize("notion", ["replace-one", "add-remove"])
def test_check_admits_at_exactly_the_budget_and_refuses_a_thousandth_over(notion):
    first, second = _study("one", 1.0, neighbouring=notion), _study("two", 0.7, neighbouring=notion)
    charges = [ledger.Charge.of(first)]
    needed = _composed(first, second, notion=notion)
    assert needed < ledger.Charge.of(first).epsilon_in(notion) + ledger.Charge.of(second).epsilon_in(notion)
    at = ledger.check(charges, ledger.Charge.of(second), ledger.Budget(needed, DELTA, notion))
    assert at.fits and at.needed.epsilon == pytest.approx(needed, rel=1e-12)
    over = ledger.check(charges, ledger.Charge.of(second), ledger.Budget(needed / 1.001, DELTA, notion))
    assert not over.fits
    assert over.spent.studies == 1 and over.needed.studies == 2
    # the first study alone, at its own composed epsilon
    alone = _composed(first, notion=notion)
    assert ledger.check([], ledger.Charge.of(first), ledger.Budget(alone, DELTA, notion)).fits
    assert not ledger.check([], ledger.Charge.of(first), ledger.Budget(alone / 1.001, DELTA, notion)).fits
    # a study already charged costs nothing more, even past the budget
    again = ledger.check(charges, ledger.Charge.of(first), ledger.Budget(alone / 1.001, DELTA, notion))
    assert again.fits and again.study_epsilon == 0.0 and again.needed == again.spent


def test_an_empty_ledger_composes_to_zero_and_one_study_to_its_own_promise():
    one = _study("one", 1.0)
    assert ledger.compose([], "replace-one", DELTA).epsilon == 0.0
    own = ledger.Charge.of(one).epsilon  # at the study's delta (1e-6 by default)
    assert _composed(one) == pytest.approx(own, rel=2e-3)  # the PLD's pessimistic grid


def _provision_both(srv: Server, first: Study, second: Study):
    assert srv.provision(first).status_code == 201
    return srv.provision(second)


@pytest.mark.parametrize("over", [False, True])
def test_server_admits_at_exactly_the_population_budget_and_refuses_a_thousandth_over(tmp_path, over):
    """Provisioning the second study of a population: admitted when the server's
    population_epsilon is the pair's composed epsilon, refused (409 budget-exceeded, with the
    numbers, and not stored) when it is that / 1.001. The test server takes open uploads, so it
    charges each study to its operator's default population at provisioning (issue 41: the
    population is the operator's, never the study's own word)."""
    first, second = _study("one", 1.0), _study("two", 0.7)
    needed = _composed(first, second)
    budget = needed / 1.001 if over else needed
    srv = Server(tmp_path / "ledger.db", population_epsilon=budget, population_delta=DELTA,
                 default_population="clinic-a")
    try:
        r = _provision_both(srv, first, second)
        if not over:
            assert r.status_code == 201, r.text
            book = srv.client.get("/v1/populations/clinic-a/ledger").json()
            assert book["epsilon"] == pytest.approx(needed, rel=1e-9) and book["budget_epsilon"] == budget
        else:
            body = assert_problem(r, 409, "budget-exceeded")
            assert body["budget_epsilon"] == budget and body["studies_charged"] == 1
            assert body["needed_epsilon"] == pytest.approx(needed, rel=1e-9)
            assert srv.client.get(f"/v1/studies/{second.study_id}").status_code == 404
    finally:
        srv.close()


def test_a_data_owners_limit_admits_at_the_limit_and_refuses_past_it(tmp_path):
    """client_sdk's own limit (the same ledger.check on the owner's file): at the composed epsilon
    the second study is admitted; 0.1 % under it, refused with PrivacyLimitExceeded."""
    from dpsketch.client_sdk.budget import PrivacyLimit, PrivacyLimitExceeded

    first, second = _study("one", 1.0), _study("two", 0.7)
    needed = _composed(first, second)
    for limit, fits in ((needed, True), (needed / 1.001, False)):
        book = PrivacyLimit(limit, DELTA, tmp_path / f"{fits}.json")
        book.check(first)
        assert book.record(first)
        if fits:
            assert book.check(second).fits
        else:
            with pytest.raises(PrivacyLimitExceeded):
                book.check(second)


def test_the_naive_sum_reported_beside_the_composition_is_each_studys_own_epsilon():
    """The ledger also reports the naive sum of the studies' epsilons (for comparison): each
    study's epsilon in the ledger's notion - its own promise in its own notion, the replace-one
    loss of the same noise for an add/remove study in a replace-one ledger, unbounded for a
    replace-one study in an add/remove ledger."""
    r1, r2 = _study("one", 1.0), _study("two", 0.7)
    a1 = _study("three", 0.8, neighbouring="add-remove")
    c = [ledger.Charge.of(s) for s in (r1, r2, a1)]
    assert c[0].epsilon_in("replace-one") == c[0].epsilon and c[2].epsilon_in("add-remove") == c[2].epsilon
    assert c[0].epsilon_in("add-remove") == float("inf")
    cross = c[2].epsilon_in("replace-one")
    assert c[2].epsilon < cross < 2.5 * c[2].epsilon  # replacing moves twice the row: more loss
    both = ledger.compose(c[:2], "replace-one", DELTA)
    assert both.naive_epsilon == pytest.approx(c[0].epsilon + c[1].epsilon, rel=1e-12)
    assert both.naive_delta == pytest.approx(c[0].delta + c[1].delta, rel=1e-12)
    assert both.studies == 2 and both.epsilon < both.naive_epsilon
    mixed = ledger.compose(c, "replace-one", DELTA)
    assert mixed.naive_epsilon == pytest.approx(c[0].epsilon + c[1].epsilon + cross, rel=1e-12)
    unbounded = ledger.compose(c, "add-remove", DELTA)
    assert unbounded.epsilon == float("inf") and unbounded.naive_epsilon == float("inf")
    empty = ledger.compose([], "replace-one", DELTA)
    assert (empty.epsilon, empty.naive_epsilon, empty.naive_delta, empty.studies) == (0.0, 0.0, 0.0, 0)
    with pytest.raises(ValueError):
        ledger.compose(c, "replace", DELTA)


def test_a_charge_serialises_the_sign_only_when_set_and_validates_its_fields():
    """A charge without the secret sign serialises without the member (ids and stored ledgers
    of such studies unchanged); each field's range is enforced at its edge."""
    plain = ledger.Charge.of(_study("one", 1.0))
    assert "secret_sign" not in plain.model_dump() and "secret_sign" not in plain.model_dump_json()
    signed = plain.model_copy(update={"secret_sign": True})
    assert signed.model_dump()["secret_sign"] is True
    base = plain.model_dump()
    ok = {"row_bound": 1e-12, "sigma": 0.0, "server_sigma": 0.0, "width": 1, "lambda_star": 1.0,
          "delta": 1e-300, "epsilon": 0.0}
    bad = {"row_bound": 0.0, "sigma": -1e-12, "server_sigma": -1e-12, "width": 0, "lambda_star": 0.999,
           "delta": 0.0, "epsilon": -1e-12}
    for name, value in ok.items():
        ledger.Charge.model_validate({**base, name: value})
    for name, value in bad.items():
        with pytest.raises(ValueError):
            ledger.Charge.model_validate({**base, name: value})
    for name in ("epsilon", "row_bound", "sigma"):
        with pytest.raises(ValueError):  # no infinity or NaN in a charge
            ledger.Charge.model_validate({**base, name: float("inf")})
    with pytest.raises(ValueError):
        ledger.Charge.model_validate({**base, "delta": 1.0})
    with pytest.raises(ValueError):  # frozen: a charge cannot be edited once made
        plain.epsilon = 0.0
    assert hash(plain) == hash(ledger.Charge.model_validate(plain.model_dump()))


@pytest.mark.parametrize("epsilon,delta,notion", [(0.0, 1e-6, "replace-one"), (-1.0, 1e-6, "replace-one"),
                                                  (float("inf"), 1e-6, "replace-one"), (1.0, 0.0, "replace-one"),
                                                  (1.0, 1.0, "replace-one"), (1.0, 1e-6, "replace")])
def test_a_budget_must_be_a_privacy_target(epsilon, delta, notion):
    with pytest.raises(ValueError):
        ledger.Budget(epsilon, delta, notion)


def test_composition_is_every_studys_pld_composed_once():
    """ledger.compose against dp-accounting's own composition of the charges' PLDs (each study
    once, in any order), at the ledger's delta; three studies of different epsilons."""
    studies = [_study("one", 1.0), _study("two", 0.7), _study("three", 0.4)]
    charges = [ledger.Charge.of(s) for s in studies]
    grid = max(c.grid("replace-one") for c in charges)
    plds = [c.pld("replace-one", grid) for c in charges]
    direct = plds[2].compose(plds[1]).compose(plds[0]).get_epsilon_for_delta(DELTA)
    got = ledger.compose(charges, "replace-one", DELTA)
    assert got.epsilon == pytest.approx(direct, rel=1e-6)
    assert got.studies == 3
    # each study counts: dropping any one lowers the total
    for i in range(3):
        assert ledger.compose(charges[:i] + charges[i + 1:], "replace-one", DELTA).epsilon < got.epsilon * 0.99


def test_the_budget_tolerance_is_inclusive():
    """check() admits needed <= budget * (1 + 1e-9): a budget whose tolerance lands exactly on the
    needed epsilon admits, the next float below refuses."""
    import numpy as np

    first, second = _study("one", 1.0), _study("two", 0.7)
    needed = ledger.compose([ledger.Charge.of(first), ledger.Charge.of(second)], "replace-one", DELTA).epsilon
    b = needed / (1 + 1e-9)
    exact = None
    for _ in range(64):
        if b * (1 + 1e-9) == needed:
            exact = b
            break
        b = np.nextafter(b, np.inf) if b * (1 + 1e-9) < needed else np.nextafter(b, -np.inf)
    assert exact is not None
    charges = [ledger.Charge.of(first)]
    assert ledger.check(charges, ledger.Charge.of(second), ledger.Budget(float(exact), DELTA)).fits
    below = float(np.nextafter(exact, -np.inf))
    assert below * (1 + 1e-9) < needed
    assert not ledger.check(charges, ledger.Charge.of(second), ledger.Budget(below, DELTA)).fits


def test_a_budget_charges_every_study_whatever_it_names_and_names_an_unbounded_need_as_null(tmp_path):
    """A study that names no population is charged all the same (to the operator's default
    population: omitting the name escapes nothing); under an add/remove budget a replace-one study
    is unbounded: refused, with needed_epsilon null in the problem (JSON has no infinity), and not
    stored."""
    srv = Server(tmp_path / "ar.db", population_epsilon=0.01, population_delta=DELTA,
                 population_neighbouring="add-remove")
    try:
        for population in (None, "clinic-a"):
            study = _study(f"p{population}", 1.0, population=population)
            body = assert_problem(srv.provision(study), 409, "budget-exceeded")
            assert body["needed_epsilon"] is None and body["study_epsilon"] is None
            assert body["spent_epsilon"] == 0.0
            assert srv.client.get(f"/v1/studies/{study.study_id}").status_code == 404
    finally:
        srv.close()


def test_the_analyzer_shows_the_ledger_the_servers_charge_a_study_to():
    """issue 41: the study's own population is advisory; the analyzer's study ledger follows what
    the servers say they charge it to (StudyInfo.populations), the study's name only as a tie-break
    or before any charge."""
    from dpsketch.analyzer.app import charged_population

    assert charged_population("clinic", [["clinic", "other"], ["clinic"]]) == "clinic"
    assert charged_population("renamed", [["clinic"], ["clinic", "z"]]) == "clinic"  # a name escapes nothing
    assert charged_population("renamed", [["a"], ["b"]]) == "renamed"  # nowhere in common: not charged
    assert charged_population("clinic", [[], []]) == "clinic"  # before the first token
    assert charged_population(None, [["default"], []]) == "default"
    assert charged_population(None, [[], []]) is None and charged_population(None, []) is None
