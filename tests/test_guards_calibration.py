"""The calibration's building blocks against first principles (issue 47).

What a client's and a server's noise is calibrated from: each kind's L2 sensitivity (the worst
pair of rows, constructed here and measured), the analytic Gaussian mechanism's unit noise (the
Balle-Wang delta at mu = 1 / unit_sigma must be the target delta, from scipy's normal CDF), and
the delta the 20-sigma tail cut may cost. Each is checked at the values where its formula
changes (B^2 = 1/2 for the gram row; mp = 1 for the truncation), with refusals of what is out of
range.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dpsketch.protocol import privacy


def _gram_distance(a: np.ndarray, b: np.ndarray) -> float:
    """||phi(a) - phi(b)|| for phi(a) = [a, a a^T (Frobenius), 1]: the count cancels."""
    return math.sqrt(float(np.sum((a - b) ** 2) + np.sum((np.outer(a, a) - np.outer(b, b)) ** 2)))


@pytest.mark.parametrize("B", [0.3, math.sqrt(0.5), 0.9, 1.0, 2.5])
def test_sensitivity_of_every_kind_is_its_worst_pair(B):
    assert privacy.sensitivity(B, "replace-one", "sketch") == 2 * B
    assert privacy.sensitivity(B, "add-remove", "sketch") == B
    assert privacy.sensitivity(B, "replace-one", "l1") == 2 * B
    assert privacy.sensitivity(B, "add-remove", "l1") == B
    # histogram: the row bound is sqrt(m) for m ones (1 for one-hot); replacing moves B^2 ones
    assert privacy.sensitivity(B, "replace-one", "histogram") == pytest.approx(math.sqrt(2) * B, rel=1e-15)
    assert privacy.sensitivity(B, "add-remove", "histogram") == B
    # moments: u(a a^T) moves by ||a a^T - b b^T||_F, worst at orthogonal rows of norm B
    e1, e2 = np.eye(3)[0] * B, np.eye(3)[1] * B
    assert privacy.sensitivity(B, "replace-one", "moments") == pytest.approx(
        float(np.linalg.norm(np.outer(e1, e1) - np.outer(e2, e2))), rel=1e-12)
    assert privacy.sensitivity(B, "add-remove", "moments") == pytest.approx(B * B, rel=1e-12)
    # gram: the worst replace-one pair has norms B and a . b = -1/2 (or b = -a when B^2 < 1/2)
    c = -0.5 if B * B >= 0.5 else -B * B
    theta = math.acos(c / (B * B))
    a, b = np.array([B, 0.0, 0.0]), np.array([B * math.cos(theta), B * math.sin(theta), 0.0])
    worst = _gram_distance(a, b)
    assert privacy.sensitivity(B, "replace-one", "gram") == pytest.approx(worst, rel=1e-9)
    rng = np.random.default_rng(1)
    for _ in range(2000):  # no pair of rows in the ball moves phi further
        x, y = rng.normal(size=(2, 3))
        x *= B * rng.uniform() ** 0.3 / np.linalg.norm(x)
        y *= B * rng.uniform() ** 0.3 / np.linalg.norm(y)
        assert _gram_distance(x, y) <= worst * (1 + 1e-9)
    assert privacy.sensitivity(B, "add-remove", "gram") == pytest.approx(math.sqrt(B ** 2 + B ** 4 + 1), rel=1e-12)
    for bad in (lambda: privacy.sensitivity(B, "replace", "sketch"), lambda: privacy.sensitivity(B, "add-remove", "x")):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("epsilon,delta", [(0.1, 1e-6), (1.0, 1e-6), (1.0, 1e-9), (4.0, 1e-5), (10.0, 1e-3)])
def test_unit_sigma_gives_exactly_the_target_delta(epsilon, delta):
    """Balle-Wang: delta(mu) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) at mu = 1/unit_sigma
    equals the target (relative 1e-3), and 1 % less noise gives a larger delta."""
    sigma = privacy.unit_sigma(epsilon, delta)

    def bw(mu):
        return stats.norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2)

    assert bw(1 / sigma) == pytest.approx(delta, rel=1e-3)
    assert bw(1 / (0.99 * sigma)) > delta * 1.01
    assert privacy.gaussian_sigma(epsilon, delta, 3.0) == 3.0 * sigma
    assert privacy.local_sigma(epsilon, delta, 2.0, "replace-one") == pytest.approx(4.0 * sigma, rel=1e-15)
    assert privacy.local_sigma(epsilon, delta, 1.0, "add-remove", "histogram") == pytest.approx(sigma, rel=1e-15)
    assert privacy.local_sigma(epsilon, delta, 2.0, "add-remove", "histogram") == pytest.approx(2.0 * sigma, rel=1e-15)


@pytest.mark.parametrize("epsilon,delta", [(0.0, 1e-6), (-1.0, 1e-6), (math.inf, 1e-6), (math.nan, 1e-6),
                                           (1.0, 0.0), (1.0, 1.0), (1.0, -1e-6)])
def test_unit_sigma_refuses_what_is_not_a_privacy_target(epsilon, delta):
    with pytest.raises(ValueError):
        privacy.unit_sigma(epsilon, delta)


def test_the_tail_cut_costs_what_conditioning_costs():
    """(e^eps + 1) mp / (1 - mp), infinite from mp = 1 on; tail_delta's mp is m erfc(T / sqrt 2)."""
    for eps, mp in ((1.0, 1e-12), (0.5, 0.25), (3.0, 0.999999)):
        assert privacy.truncation_delta(eps, mp) == pytest.approx((math.exp(eps) + 1) * mp / (1 - mp), rel=1e-12)
    assert privacy.truncation_delta(1.0, 1.0) == math.inf
    assert privacy.truncation_delta(1.0, 2.0) == math.inf
    # epsilon is capped at 700 before exp (finite below exp's overflow at 709.78)
    assert privacy.truncation_delta(800.0, 1e-300) == (math.exp(700.0) + 1.0) * 1e-300 / (1 - 1e-300)
    assert privacy.truncation_delta(700.5, 1e-300) == (math.exp(700.0) + 1.0) * 1e-300 / (1 - 1e-300)
    m, T = 10 ** 6, 6.0
    p = math.erfc(T / math.sqrt(2))
    assert privacy.tail_delta(1.0, m, T) == pytest.approx((math.e + 1) * m * p / (1 - m * p), rel=1e-12)
    assert privacy.tail_delta(1.0, m, 20.0) < 1e-80
