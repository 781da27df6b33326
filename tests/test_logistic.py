"""Logistic regression from released second moments (analyzer/analyses/logistic.py, docs/logistic.md).

Unit checks on exact (noise-free) sums against the surrogate computed directly from the rows,
then one end-to-end run over real processes: a gram study with a binary label, SDK uploads,
finalize, ``POST /analyses/logistic`` scored on held-out rows against scikit-learn, and the
refusals (422 / 409).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import expit

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.analyzer.analyses.logistic import LogisticRegression
from dpsketch.analyzer.release import GramSumRelease, release_from_values
from dpsketch.client_sdk import Client
from dpsketch.protocol import ProblemError, features
from dpsketch.protocol.study import design

FEATURES = ["x0", "x1", "x2", "x3"]
COLUMNS = FEATURES + ["y"]
NO_FLOOR = {"DPSKETCH_MAX_FLOOR_EPSILON": "none"}


def logistic_rows(n: int, seed: int, label_code: float = 0.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features of norm <= 0.8, labels from a logistic model; rows [x, label_code * y] fit B = 1."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(FEATURES))) @ np.diag([1.0, 0.8, 0.6, 0.4])
    y = (rng.uniform(size=n) < expit(x @ np.array([1.5, -1.0, 0.5, 0.0]) - 0.7)).astype(float)
    x = x * (0.8 / np.quantile(np.linalg.norm(x, axis=1), 0.99))
    x *= np.minimum(1.0, 0.8 / np.linalg.norm(x, axis=1))[:, None]
    return x, y, np.column_stack([x, label_code * y])


def exact_gram_release(rows: np.ndarray) -> GramSumRelease:
    """A gram release holding the exact sum of phi(a) (no noise drawn)."""
    study, _ = design(name="exact", columns=COLUMNS, label="y", servers=["s1", "s2"], expected_reports=len(rows),
                      kind="gram", seed="cd" * 32)
    return GramSumRelease(study=study, values=features.gram_features(rows).sum(axis=0), n_reports=len(rows))


def fit_exact(rows: np.ndarray, **kw) -> LogisticRegression:
    rel = exact_gram_release(rows)
    return LogisticRegression("y", **kw).fit(rel.gram(), columns=rel.columns, n_reports=rel.n_reports,
                                             row_sum=rel.row_sum)


# --- unit checks on exact sums ----------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.0, 25.0])
def test_taylor_fit_on_exact_sums_is_the_surrogate_minimiser(alpha):
    x, y, rows = logistic_rows(3000, 1)
    model = fit_exact(rows, classes=(0, 0.5), alpha=alpha, calibration="taylor")
    # the surrogate sum_i [log 2 - s_i / 2 + s_i^2 / 8] + alpha/8 ||w||^2, s_i = y_i (b + x_i.w), directly
    xt, ypm = np.column_stack([np.ones(len(y)), x]), 2 * y - 1

    def surrogate(beta):
        z = xt @ beta
        return np.sum(np.log(2) - ypm * z / 2 + z ** 2 / 8) + alpha / 8 * beta[1:] @ beta[1:]

    def grad(beta):
        z = xt @ beta
        return xt.T @ (-ypm / 2 + z / 4) + np.r_[0.0, alpha / 4 * beta[1:]]

    direct = minimize(surrogate, np.zeros(5), jac=grad, method="BFGS", options={"gtol": 1e-10}).x
    assert model.calibration_ == "taylor" and model.alpha_ == alpha and model.noise_scale_ == 0
    np.testing.assert_allclose(np.r_[model.intercept_, model.coef_[0]], direct, rtol=1e-6, atol=1e-8)


def test_gaussian_calibration_on_exact_sums_is_lda_along_the_surrogate_direction():
    x, y, rows = logistic_rows(4000, 2)
    taylor = fit_exact(rows, classes=(0, 0.5), alpha=0.0, calibration="taylor")
    model = fit_exact(rows, classes=(0, 0.5), alpha=0.0)
    assert model.calibration_ == "gaussian"
    u = taylor.coef_[0]
    z, n1 = x @ u, y.sum()
    m1, m0 = z[y == 1].mean(), z[y == 0].mean()
    v = (np.sum((z[y == 1] - m1) ** 2) + np.sum((z[y == 0] - m0) ** 2)) / (len(y) - 2)
    a = (m1 - m0) / v
    np.testing.assert_allclose(model.coef_[0], a * u, rtol=1e-8)
    np.testing.assert_allclose(model.intercept_[0], np.log(n1 / (len(y) - n1)) - a * (m1 + m0) / 2, rtol=1e-8)
    # same direction (AUC), and on this data as good as scikit-learn's maximum likelihood fit
    from sklearn.linear_model import LogisticRegression as SkLogistic
    from sklearn.metrics import log_loss, roc_auc_score

    xt, _, _ = logistic_rows(20000, 3)
    yt = (np.random.default_rng(4).uniform(size=20000) < expit(xt @ model.coef_[0])).astype(float)
    sk = SkLogistic(C=1e6).fit(x, y)
    assert roc_auc_score(yt, model.decision_function(xt)) == pytest.approx(
        roc_auc_score(yt, taylor.decision_function(xt)), abs=1e-12)
    assert np.corrcoef(model.coef_[0], sk.coef_[0])[0, 1] > 0.999
    assert log_loss(y, model.predict_proba(x)[:, 1]) < log_loss(y, taylor.predict_proba(x)[:, 1])
    assert log_loss(y, model.predict_proba(x)[:, 1]) < log_loss(y, sk.predict_proba(x)[:, 1]) + 0.005


def test_predictions_are_consistent():
    x, _, rows = logistic_rows(2000, 5)
    model = fit_exact(rows, classes=(0, 0.5))
    z = model.decision_function(x)
    proba = model.predict_proba(x)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    np.testing.assert_allclose(proba[:, 1], expit(z))
    np.testing.assert_allclose(model.predict_log_proba(x), np.log(proba), atol=1e-12)
    np.testing.assert_array_equal(model.predict(x), np.where(proba[:, 1] > 0.5, 0.5, 0.0))
    np.testing.assert_allclose(z, x @ model.coef_[0] + model.intercept_[0])
    assert model.coef_.shape == (1, 4) and model.intercept_.shape == (1,)
    assert list(model.classes_) == [0.0, 0.5] and model.feature_names_ == FEATURES
    assert model.decision_function(x[0]).shape == (1,)  # one row


@pytest.mark.parametrize("calibration", ["gaussian", "taylor"])
def test_label_codings_give_the_same_model(calibration):
    x, y, _ = logistic_rows(2500, 6)
    models = [fit_exact(np.column_stack([x, lo + (hi - lo) * y]), classes=(lo, hi), calibration=calibration)
              for lo, hi in [(0, 1), (-1, 1), (0, 0.5), (-0.3, 0.6)]]
    for m in models[1:]:
        np.testing.assert_allclose(m.coef_, models[0].coef_, rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(m.intercept_, models[0].intercept_, rtol=1e-7, atol=1e-9)
    # swapping the classes flips the model
    flipped = fit_exact(np.column_stack([x, y]), classes=(1, 0), calibration=calibration)
    np.testing.assert_allclose(flipped.coef_, -models[0].coef_, rtol=1e-7)


def test_intercept_column_gives_the_gram_kinds_model_and_the_sketch_needs_it():
    x, y, rows = logistic_rows(2000, 7, label_code=0.4)
    ref = fit_exact(rows, classes=(0, 0.4))
    with_const = np.column_stack([rows, np.full(len(y), 0.3)])
    cols = COLUMNS + ["const"]
    m = LogisticRegression("y", classes=(0, 0.4), intercept_column="const").fit(
        with_const.T @ with_const, columns=cols, n_reports=len(y))
    np.testing.assert_allclose(m.coef_, ref.coef_, rtol=1e-8)
    np.testing.assert_allclose(m.intercept_, ref.intercept_, rtol=1e-8)
    assert m.feature_names_ == FEATURES
    # a sketch release has no row sum: without an intercept column, a clear refusal
    study, _ = design(name="sk", columns=cols, label="y", servers=["s1", "s2"], expected_reports=100_000,
                      kind="sketch", seed="ef" * 32)
    release = release_from_values(study, np.zeros((study.k, study.d)), 100_000)
    with pytest.raises(ValueError, match="intercept_column"):
        LogisticRegression("y").fit(release)
    LogisticRegression("y", intercept_column="const").fit(
        release_from_values(study, np.full((study.k, study.d), 50.0), 100_000))  # runs


@pytest.mark.parametrize("kw, match", [
    ({"classes": (1, 1)}, "classes"), ({"classes": ("a", "b")}, "classes"), ({"classes": (0, 1, 2)}, "classes"),
    ({"classes": (0, float("nan"))}, "classes"), ({"classes": 5}, "classes"),
    ({"label": "nope"}, "label 'nope'"), ({"features": ["x0", "y"]}, "label cannot also be a feature"),
    ({"alpha": -1.0}, "alpha"), ({"calibration": "newton"}, "calibration"),
    ({"intercept_column": "zz"}, "intercept_column 'zz'"), ({"features": []}, "at least one feature"),
])
def test_bad_inputs_raise_value_error_naming_the_problem(kw, match):
    _, _, rows = logistic_rows(200, 8)
    rel = exact_gram_release(rows)
    with pytest.raises(ValueError, match=match):
        LogisticRegression(**{"label": "y", **kw}).fit(rel)


def test_a_bare_gram_needs_columns_and_a_count():
    _, _, rows = logistic_rows(200, 9)
    with pytest.raises(ValueError, match="columns and n_reports"):
        LogisticRegression("y").fit(rows.T @ rows)


# --- end to end over real processes -----------------------------------------------------------


def test_logistic_over_rest_matches_sklearn_on_held_out_rows(servers):
    """A gram study (no server noise, epsilon = 1) of n = 12,000 rows uploaded through the SDK.

    Tolerance: the REST model's held-out AUC within 0.02 of scikit-learn's non-private model on
    the same training rows (measured gap at n = 10^4, d = 10, epsilon = 1: 0.003-0.013,
    docs/logistic.md; here d = 4)."""
    from sklearn.linear_model import LogisticRegression as SkLogistic
    from sklearn.metrics import roc_auc_score

    from conftest import Cluster

    c = Cluster(servers, 3, api_token="tok-" + "l" * 16, server_env={s: NO_FLOOR for s in ("s1", "s2", "s3")})
    n = 12_000
    x, y, rows = logistic_rows(n + 20_000, 10)
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name="logit", columns=COLUMNS, label="y", expected_reports=n, min_reports=n,
                                  kind="gram", epsilon=1.0, epsilon_floor=None)
        sid = created["study_id"]
        with pytest.raises(ProblemError) as early:
            an.logistic(sid)
        assert early.value.status == 409, early.value
        with Client(c.server_urls) as client:
            client.submit_many(sid, rows[:n], batch_size=6000)
        assert an.finalize(sid)["n_reports"] == n
        out = an.logistic(sid, classes=[0, 0.5])
        view = an.sketch(sid)
        # the refusals: unknown label, classes not two distinct numbers, a histogram study
        for body in ({"label": "nope"}, {"classes": [1, 1]}, {"classes": [0, 1, 2]}, {"classes": ["a", "b"]},
                     {"intercept_column": "zz"}, {"alpha": -1}):
            with pytest.raises(ProblemError) as bad:
                an.logistic(sid, **body)
            assert bad.value.status == 422, (body, bad.value)
        hist = an.create_study(name="h", kind="histogram", expected_reports=50, min_reports=50, epsilon_floor=None,
                               histogram={"axes": [{"column": "a", "edges": [0, 1]}]})
        with Client(c.server_urls) as client:
            client.submit_many(hist["study_id"], np.full((50, 1), 0.5))
        an.finalize(hist["study_id"])
        with pytest.raises(ProblemError) as not_gram:
            an.logistic(hist["study_id"])
        assert not_gram.value.status == 422 and "histogram study" in not_gram.value.detail
    assert out["features"] == FEATURES and out["classes"] == [0.0, 0.5] and out["n_reports"] == n
    assert out["calibration"] == "gaussian"
    # the answer is the estimator on the released values (pure post-processing, deterministic)
    release = release_from_values(__import__("dpsketch").protocol.Study.model_validate(created["study"]),
                                  np.asarray(view["sketch"]), n)
    local = LogisticRegression("y", classes=(0, 0.5)).fit(release)
    np.testing.assert_allclose(out["coef"], local.coef_[0], rtol=1e-9)
    assert out["intercept"] == pytest.approx(local.intercept_[0], rel=1e-9)
    # accuracy on held-out rows against scikit-learn's non-private model
    xt, yt = x[n:], y[n:]
    sk = SkLogistic(max_iter=1000).fit(x[:n], y[:n])
    auc_sk = roc_auc_score(yt, sk.decision_function(xt))
    auc = roc_auc_score(yt, xt @ np.asarray(out["coef"]) + out["intercept"])
    assert auc > auc_sk - 0.02, (auc, auc_sk)
    acc = np.mean(((xt @ np.asarray(out["coef"]) + out["intercept"]) > 0) == (yt > 0.5))
    assert acc > np.mean(sk.predict(xt) == yt) - 0.03
    # and the CLI says the same
    cli = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "study", "--analyzer", c.analyzer.url, "--token",
                          c.api_token, "logistic", sid, "--classes", "0,0.5"], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["coef"] == out["coef"]
    bad = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "study", "--analyzer", c.analyzer.url, "--token",
                          c.api_token, "logistic", sid, "--classes", "0,x"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--classes" in bad.stderr
