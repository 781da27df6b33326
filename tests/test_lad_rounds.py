"""The product's robust regression: Huber rounds of gram or moments studies (analyzer.analyses.lad_rounds,
docs/lad.md). Unit-level and fast: exact (noise-free) releases and the budget arithmetic."""

import math

import numpy as np
import pytest

from research import lad_evaluation
from dpsketch.analyzer.analyses.lad_rounds import RobustRegression, RoundWeights, huber_weights, round_budget, weighted_rows
from dpsketch.analyzer.release import GramSumRelease
from dpsketch.protocol import features, privacy
from dpsketch.protocol.study import design

COLUMNS = ["x1", "x2", "y"]


def _exact(study, rows: np.ndarray) -> GramSumRelease:
    """The release without any noise (fit with debias=False): what the rounds converge on."""
    return GramSumRelease(study=study, values=features.client_vectors(study.kind, rows).sum(axis=0),
                          n_reports=len(rows))


def _outlier_data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, (n, 2))
    y = 0.5 + x @ np.array([1.0, -0.7]) + 0.3 * rng.normal(size=n)
    y[rng.random(n) < 0.1] = 20.0  # one-sided gross errors
    return np.column_stack([x, y])


@pytest.mark.parametrize("rounds", [1, 2, 3, 4])
def test_round_budget_composes_to_the_target_in_gaussian_dp(rounds):
    """sum of the rounds' mu_r^2 is the target's mu^2, for the clients' budget and the floor's."""
    eps, delta, floor = 1.0, 1e-6, 4.0
    budget = round_budget(eps, delta, rounds, epsilon_floor=floor)
    mu = lambda e: 1.0 / privacy.unit_sigma(e, delta)  # noqa: E731
    assert sum(mu(e) ** 2 for e, _ in budget) == pytest.approx(mu(eps) ** 2, rel=1e-6)
    assert sum(mu(f) ** 2 for _, f in budget) == pytest.approx(mu(floor) ** 2, rel=1e-6)
    assert all(0 < e < eps + 1e-12 for e, _ in budget)
    with pytest.raises(ValueError):
        round_budget(eps, delta, 2, shares=[0.5, 0.6])


def test_weighted_rows_stay_in_the_ball_and_carry_the_weight_in_the_constant():
    rows = _outlier_data(500, 1)
    bounds = ((-4.0, 4.0), (-4.0, 4.0), (-5.0, 25.0))
    w = RoundWeights(label="y", columns=tuple(COLUMNS), coef=(1.0, -0.7), intercept=0.5, scale=0.5,
                     bounds=bounds, map_scale=1.0 / 2.0)
    out = weighted_rows(rows, w)
    assert out.shape == (500, 4)
    assert np.all(np.linalg.norm(out, axis=1) <= 1.0 + 1e-12)  # B = 1: the sensitivity is unchanged
    clamped = np.clip(rows, [b[0] for b in bounds], [b[1] for b in bounds])
    resid = clamped[:, 2] - 0.5 - clamped[:, :2] @ np.array([1.0, -0.7])
    np.testing.assert_allclose(out[:, 3] / 0.5, np.sqrt(huber_weights(resid, 0.5)), rtol=1e-12)
    assert np.min(out[:, 3]) < 0.2 and np.max(out[:, 3]) == pytest.approx(0.5)  # outliers down-weighted
    back = RoundWeights.from_dict(w.to_dict())
    assert back == w
    assert RoundWeights.from_dict(RoundWeights.unweighted("y", COLUMNS, bounds, 0.5).to_dict()).scale == math.inf
    with pytest.raises(ValueError, match="expected rows of 3"):
        weighted_rows(rows[:, :2], w)


def test_exact_rounds_remove_the_outliers_bias_that_least_squares_keeps():
    """Noise-free releases: round 1 is least squares (biased by the +20 labels), each Huber round
    moves towards the clean line; three rounds cut the coefficient error by more than 5x."""
    n = 20_000
    rows = _outlier_data(n, 2)
    truth = np.array([1.0, -0.7, 0.5])
    bounds = ((-4.0, 4.0), (-4.0, 4.0), (-5.0, 25.0))
    weights = RoundWeights.unweighted("y", COLUMNS, bounds, 1.0 / 2.0)
    errors = []
    for r in range(4):
        study, _ = design(name="rounds", columns=weights.round_columns, label="y", servers=["s1", "s2"],
                          expected_reports=n, kind="moments", seed=f"{r:064x}")
        model = RobustRegression("y", weighted_by=weights, debias=False).fit(_exact(study, weighted_rows(rows, weights)))
        errors.append(float(np.linalg.norm(np.append(model.coef_, model.intercept_) - truth)))
        assert model.round_ == r + 1 and model.next_weights_.round == r + 2
        weights = model.next_weights_
    ls = np.linalg.lstsq(np.column_stack([rows[:, :2], np.ones(n)]), rows[:, 2], rcond=None)[0]
    assert errors[0] == pytest.approx(float(np.linalg.norm(ls - truth)), rel=1e-4)  # round 1 = LS (of the clamped rows)
    assert errors[0] > 1.0 and errors[1] < errors[0] and errors[3] < errors[0] / 5


def test_weights_for_another_label_or_columns_are_refused():
    n = 2000
    rows = _outlier_data(n, 3)
    weights = RoundWeights.unweighted("y", COLUMNS, None, 0.1)
    study, _ = design(name="rounds", columns=weights.round_columns, label="y", servers=["s1", "s2"],
                      expected_reports=n, kind="moments", seed="ab" * 32)
    rel = _exact(study, weighted_rows(rows * 0.05, weights))
    with pytest.raises(ValueError, match="computed for the label"):
        RobustRegression("x1", weighted_by=weights).fit(rel)
    other = RoundWeights.unweighted("y", ["a", "b", "y"], None, 0.1)
    with pytest.raises(ValueError, match="not the weights"):
        RobustRegression("y", weighted_by=other).fit(rel)
    with pytest.raises(ValueError, match="needs the weights"):
        RobustRegression("y").fit(rel)


def test_harness_rounds_beat_gram_least_squares_on_outliers():
    """One paired run of docs/lad.md's evaluation at n = 10^5, epsilon = 1 (default floor and
    min_reports): the rounds' coefficient error is well below the gram study's least squares."""
    recs = lad_evaluation.run_case(100_000, "outliers", [1.0], seed=0, mechanisms=("ltm_rounds", "ltm_gram_ls"))
    by = {r["mechanism"]: r for r in recs}
    assert by["ltm_rounds"]["coef_error"] < 0.5 * by["ltm_gram_ls"]["coef_error"]
    assert len(by["ltm_rounds"]["round_errors"]) == by["ltm_rounds"]["rounds"]


from test_e2e import no_floor_module_cluster  # noqa: E402, F401 (a fixture)


def test_two_rounds_over_real_servers_the_route_the_owners_cli_and_bad_input(no_floor_module_cluster, tmp_path):
    """Round 1 a moments study with bounds (the SDK maps the rows); the analyzer's lad route
    answers the Huber step and next_weights; the owner's `dpsketch study weight-rows` makes round
    2's rows (what weighted_rows makes, norms <= B); round 2 a moments study of the mapped columns
    and _1. Each answer is RobustRegression on the released values (post-processing, nothing
    else); weights that do not fit and l1-only parameters are 422 invalid-request."""
    import csv
    import json

    from dpsketch.analyzer.cli import main as study_cli
    from dpsketch.analyzer.client import AnalyzerClient
    from dpsketch.analyzer.release import release_from_values
    from dpsketch.client_sdk import Client
    from dpsketch.protocol import ProblemError, Study

    c = no_floor_module_cluster
    n = 3000
    rows = _outlier_data(n, 4)
    bounds = {"x1": [-4.0, 4.0], "x2": [-4.0, 4.0], "y": [-5.0, 25.0]}

    def local_fit(an, study_id, weights):
        study = Study.model_validate(an.study(study_id)["study"])
        rel = release_from_values(study, np.array(an.sketch(study_id)["sketch"]), n)
        return RobustRegression("y", weighted_by=weights).fit(rel)

    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        s1 = an.create_study(name="rounds-1", columns=COLUMNS, label="y", expected_reports=n, kind="moments",
                             bounds=bounds, min_reports=n, epsilon_floor=None)["study_id"]
        with Client(c.server_urls) as client:
            client.submit_many(s1, rows, batch_size=n)
        an.finalize(s1)
        r1 = an.lad(s1)
        mine = local_fit(an, s1, None)
        assert r1["method"] == "huber-rounds" and r1["round"] == 1 and r1["in_units"] is True
        np.testing.assert_allclose(r1["coef"], mine.coef_, rtol=1e-9)
        assert r1["intercept"] == pytest.approx(mine.intercept_, rel=1e-9)
        assert len(r1["stderr"]) == 3 and all(s > 0 for s in r1["stderr"])
        w = RoundWeights.from_dict(r1["next_weights"])
        assert w.round == 2 and w.columns == tuple(COLUMNS) and w.bounds is not None

        answer = tmp_path / "round1.json"
        answer.write_text(json.dumps(r1))
        raw = tmp_path / "rows.csv"
        with open(raw, "w", newline="") as fh:
            csv.writer(fh).writerows([COLUMNS, *rows.tolist()])
        out = tmp_path / "round2.csv"
        assert study_cli(["weight-rows", "--weights", str(answer), str(raw), str(out)]) == 0
        with open(out, newline="") as fh:
            lines = list(csv.reader(fh))
        assert lines[0] == w.round_columns
        mapped = np.array(lines[1:], dtype=float)
        np.testing.assert_allclose(mapped, weighted_rows(rows, w), rtol=1e-15)
        assert np.max(np.linalg.norm(mapped, axis=1)) <= 1.0 + 1e-12

        s2 = an.create_study(name="rounds-2", columns=w.round_columns, label="y", expected_reports=n,
                             kind="moments", min_reports=n, epsilon_floor=None)["study_id"]
        with Client(c.server_urls) as client:
            client.submit_many(s2, mapped, batch_size=n)
        an.finalize(s2)
        r2 = an.lad(s2, weights=r1["next_weights"])
        mine2 = local_fit(an, s2, w)
        assert r2["round"] == 2 and r2["features"] == ["x1", "x2"]
        np.testing.assert_allclose(r2["coef"], mine2.coef_, rtol=1e-9)

        refusals = []
        wrong = {**r1["next_weights"], "columns": ["a", "b", "y"]}
        for call in (lambda: an.lad(s2, weights=wrong), lambda: an.lad(s2), lambda: an.lad(s1, alpha=0.1),
                     lambda: an.lad(s2, weights={"label": "y"})):
            with pytest.raises(ProblemError) as err:
                call()
            refusals.append((err.value.status, err.value.slug))
    assert refusals == [(422, "invalid-request")] * 4
