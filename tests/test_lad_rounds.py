"""The product's robust regression: Huber rounds of gram or moments studies (analyzer.lad_rounds,
docs/lad.md). Unit-level and fast: exact (noise-free) releases and the budget arithmetic."""

import math

import numpy as np
import pytest

from analyzer import lad_evaluation
from analyzer.lad_rounds import RobustRegression, RoundWeights, huber_weights, round_budget, weighted_rows
from analyzer.release import GramSumRelease
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
