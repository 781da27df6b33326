"""The privacy accounting of one honest report, recomputed independently.

The product computes add/remove epsilon with dp-accounting's privacy-loss distributions
(``accounting.add_remove_epsilon``: a pessimistic discretisation of the loss). Here the same
pair of Gaussians, P = N(M e_1, r I_w) with the report and Q = N(0, I_w) without it, is worked
out a second way: the privacy loss is an affine function of a non-central chi-square under
either hypothesis, so delta(epsilon) has a closed form in scipy's ``ncx2``; and once more by
Monte Carlo straight from the two Gaussian densities. Designed studies of both kinds and both
neighbouring notions, small n and large d included, must meet their epsilon by that independent
computation, and the floor theirs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import ncx2, norm

from dpsketch.protocol import accounting, design, features, privacy

DELTA = 1e-6


def ncx2_delta(eps: float, shift: float, ratio: float, width: int) -> float:
    """max over both directions of the hockey-stick divergence, in closed form.

    ln p/q (y) = a T + C with T = (y_1 + M/(r-1))^2 + sum_{i>1} y_i^2, a = (r-1)/2r,
    C = -M^2 / 2(r-1) - (w/2) ln r. Under Q, T ~ ncx2(w, (M/(r-1))^2); under P, T/r ~
    ncx2(w, M^2 r/(r-1)^2)."""
    r, m, w = ratio, shift, width
    a = (r - 1) / (2 * r)
    c = -m * m / (2 * (r - 1)) - w / 2 * math.log(r)
    nc_q, nc_p = (m / (r - 1)) ** 2, m * m * r / (r - 1) ** 2
    t_remove = (eps - c) / a
    t_add = (-eps - c) / a
    remove = ncx2.sf(t_remove / r, w, nc_p) - math.exp(eps) * ncx2.sf(t_remove, w, nc_q)
    add = ncx2.cdf(t_add, w, nc_q) - math.exp(eps) * ncx2.cdf(t_add / r, w, nc_p)
    return max(remove, add)


def ncx2_epsilon(shift: float, ratio: float, width: int, delta: float = DELTA) -> float:
    if ncx2_delta(0.0, shift, ratio, width) <= delta:
        return 0.0
    hi = 1.0
    while ncx2_delta(hi, shift, ratio, width) > delta:
        hi *= 2
    return brentq(lambda e: ncx2_delta(e, shift, ratio, width) - delta, 0.0, hi, xtol=1e-7)


def gaussian_epsilon(mu: float, delta: float = DELTA) -> float:
    """Balle and Wang's analytic Gaussian mechanism, solved with scipy alone."""
    def d(eps: float) -> float:
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
    if d(0.0) <= delta:
        return 0.0
    hi = 1.0
    while d(hi) > delta:
        hi *= 2
    return brentq(lambda e: d(e) - delta, 0.0, hi, xtol=1e-9)


def independent_epsilon(study, honest_lambda: float) -> float:
    """The report's epsilon from the study's noise by the module docstring's closed forms."""
    s2, t2 = study.sigma ** 2, study.server_sigma ** 2
    if study.neighbouring == "replace-one":
        delta_ro = privacy.sensitivity(study.row_bound, "replace-one", study.kind)
        return gaussian_epsilon(delta_ro / math.sqrt(s2 * max(1.0, honest_lambda) + t2), study.delta)
    var = s2 * max(0.0, honest_lambda - 1.0) + t2
    if var == 0:
        return math.inf
    shift = privacy.sensitivity(study.row_bound, "add-remove", study.kind) / math.sqrt(var)
    ratio = 1.0 + s2 / var
    if ratio == 1.0:
        return gaussian_epsilon(shift, study.delta)
    return ncx2_epsilon(shift, ratio, study.width, study.delta)


@pytest.mark.parametrize("shift,ratio,width", [
    (0.3, 1.02, 11), (0.3, 1.02, 5151), (1.0, 1.2, 66), (0.2, 1.0001, 66), (0.5, 1.005, 33153), (2.0, 1.5, 1),
])
def test_add_remove_pld_matches_the_noncentral_chi_square_closed_form(shift, ratio, width):
    fine = accounting.add_remove_epsilon(shift, ratio, width, DELTA, grid=1e-4)
    exact = ncx2_epsilon(shift, ratio, width)
    assert exact <= fine <= exact + 5e-4  # pessimistic, tight to the grid
    default = accounting.add_remove_epsilon(shift, ratio, width, DELTA)
    assert fine <= default <= exact + 5e-3


def test_add_remove_loss_law_matches_a_monte_carlo_from_the_densities():
    """At delta = 0.05 the hockey stick is large enough to estimate by sampling P and Q and
    evaluating their Gaussian log densities directly (no formula of the product involved)."""
    rng = np.random.default_rng(11)
    shift, ratio, width, delta = 0.8, 1.3, 20, 0.05
    eps = accounting.add_remove_epsilon(shift, ratio, width, delta, grid=1e-4)
    m = 400_000
    mean = np.zeros(width)
    mean[0] = shift

    def log_ratio(y):  # ln p(y) - ln q(y), p = N(mean, r I), q = N(0, I)
        return (-np.sum((y - mean) ** 2, axis=1) / (2 * ratio) - width / 2 * math.log(ratio)
                + np.sum(y ** 2, axis=1) / 2)

    y_p = mean + math.sqrt(ratio) * rng.standard_normal((m, width))
    y_q = rng.standard_normal((m, width))
    remove = np.mean(np.maximum(0.0, 1 - np.exp(eps - log_ratio(y_p))))
    add = np.mean(np.maximum(0.0, 1 - np.exp(eps + log_ratio(y_q))))
    estimate = max(remove, add)
    assert estimate == pytest.approx(delta, rel=0.05)


def test_a_larger_leverage_never_costs_less_and_scaling_the_noise_helps():
    """The two monotonicities the calibration rests on: epsilon grows with l (shift and variance
    ratio together) and falls when client and server noise are scaled up together."""
    eps = [accounting.add_remove_epsilon(0.5 * math.sqrt(l), 1 + l, 30, DELTA) for l in (0.05, 0.1, 0.2, 0.4)]
    assert all(a < b for a, b in zip(eps, eps[1:]))
    by_scale = [accounting.report_epsilon("add-remove", "gram", 1.0, 0.3 * g, 2.0 * g, 200.0, 66, DELTA)
                for g in (1.0, 1.5, 2.0, 4.0)]
    assert all(a > b for a, b in zip(by_scale, by_scale[1:]))


# Designed studies: both kinds, both notions, small n and large d, with and without a floor.
DESIGNS = [
    ("gram", 10, 51, None), ("gram", 100, 51, None), ("gram", 256, 181, None), ("gram", 10, 9000, None),
    ("sketch", 10, 1000, None), ("sketch", 100, 100_000, None),
    ("gram", 10, 51, 4.0), ("gram", 100, 1000, 4.0), ("sketch", 10, 100_000, 4.0), ("sketch", 20, 20_000, 1.0),
    # histogram studies: d is the number of cells (one axis of d - 1 edges)
    ("histogram", 12, 51, None), ("histogram", 4096, 200, None), ("histogram", 144, 100_000, 4.0),
    # l1 studies: lambda_star stands for 1 / the largest leverage (docs/protocol.md section 2c)
    ("l1", 7, 100_000, None), ("l1", 7, 20_000, 4.0),
]


def _design(kind, d, n, neighbouring, floor):
    if kind == "histogram":
        spec = {"axes": [{"column": "x", "edges": list(range(d - 1))}]}
        study = design(name="acc", columns=[], label=None, servers=["a", "b", "c"], expected_reports=n,
                       min_reports=n, kind=kind, neighbouring=neighbouring, epsilon_floor=floor,
                       histogram=spec)[0]
        assert study.width == d
        return study
    columns = [f"x{i}" for i in range(d - 1)] + ["y"]
    # the Gaussian mechanism this file recomputes independently: without the secret sign (whose
    # mixture is checked by Monte Carlo and interval arithmetic in tests/test_secret_sign.py)
    return design(name="acc", columns=columns, label="y", servers=["a", "b", "c"], expected_reports=n,
                  min_reports=n, kind=kind, neighbouring=neighbouring, epsilon_floor=floor,
                  secret_sign=False)[0]


@pytest.mark.parametrize("neighbouring", ["replace-one", "add-remove"])
@pytest.mark.parametrize("kind,d,n,floor", DESIGNS, ids=lambda v: str(v))
def test_designed_studies_meet_their_epsilon_and_floor_by_an_independent_computation(kind, d, n, floor,
                                                                                      neighbouring):
    study = _design(kind, d, n, neighbouring, floor)
    eps = independent_epsilon(study, study.lambda_star)
    assert eps <= study.epsilon * (1 + 1e-4)
    # calibrated, not drowned: within 30 % of the target (a floor can force more noise)
    assert eps >= study.epsilon * (0.7 if floor is None else 0.3)
    floor_eps = independent_epsilon(study, 1.0)
    if floor is not None:
        assert floor_eps <= floor * (1 + 1e-4)
    g = study.guarantees()
    assert g["epsilon"] == pytest.approx(eps, abs=2e-3)
    if math.isfinite(floor_eps):
        assert g["floor_epsilon"] == pytest.approx(floor_eps, rel=1e-2)
    else:
        assert g["floor_epsilon"] == math.inf


@pytest.mark.parametrize("d,n,was", [(10, 51, 1.31), (100, 51, 5.26), (256, 181, 3.59)])
def test_the_old_add_remove_calibration_was_off_and_the_new_one_is_not(d, n, was):
    """Before: sigma = Delta_ar / (mu_star sqrt(lambda)), the report's own noise ignored; the exact
    epsilon of such gram studies designed for epsilon = 1 (the table of the trust issue)."""
    width = features.width("gram", d)
    old_sigma = privacy.local_sigma(1.0, DELTA, 1.0, "add-remove", "gram") / math.sqrt(n)
    shift = math.sqrt(1 + 1 + 1) / (old_sigma * math.sqrt(n - 1))
    before = ncx2_epsilon(shift, 1 + 1 / (n - 1), width)
    assert before == pytest.approx(was, abs=0.02)
    after = _design("gram", d, n, "add-remove", None)
    assert independent_epsilon(after, after.lambda_star) <= 1.0 + 1e-4
