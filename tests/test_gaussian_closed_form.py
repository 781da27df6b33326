"""accounting.gaussian_epsilon, every replace-one study's guarantee check, is written out
(the exact Gaussian curve of Balle and Wang, solved by bisection) so that a client checking a
study does not import dp-accounting and scipy for it (issue 46). Held here against dp-accounting's
own ``get_epsilon_gaussian`` over the range studies use and beyond, and at the edges."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import get_epsilon_gaussian

from dpsketch.protocol import accounting


@pytest.mark.parametrize("delta", [0.1, 1e-3, 1e-6, 1e-9, 1e-12, 1e-20])
def test_matches_dp_accounting_across_mu(delta):
    worst = 0.0
    for mu in np.geomspace(1e-3, 40.0, 60):
        ours = accounting.gaussian_epsilon(float(mu), delta)
        theirs = float(get_epsilon_gaussian(1.0 / float(mu), delta))
        assert ours >= theirs - 1e-11  # never understated beyond the library's own tolerance
        worst = max(worst, abs(ours - theirs) / max(1.0, theirs))
    assert worst < 1e-10, worst


def test_edges_and_the_studies_own_check():
    assert accounting.gaussian_epsilon(0.0, 1e-6) == 0.0
    assert accounting.gaussian_epsilon(math.inf, 1e-6) == math.inf
    assert accounting.gaussian_epsilon(1.0, 0.0) == math.inf
    assert accounting.gaussian_epsilon(1.0, 1.0) == 0.0
    assert accounting.gaussian_epsilon(1e-4, 0.5) == 0.0  # (0, delta)-DP already
    # larger shifts cost more, and the curve is monotone in delta
    eps = [accounting.gaussian_epsilon(mu, 1e-6) for mu in (0.1, 0.5, 1.0, 2.0, 5.0)]
    assert eps == sorted(eps) and len(set(eps)) == 5
    assert accounting.gaussian_epsilon(1.0, 1e-9) > accounting.gaussian_epsilon(1.0, 1e-6)
    # mu = 1 at delta = 1e-5: 4.377 (dp-accounting gives the same to 1e-10)
    assert accounting.gaussian_epsilon(1.0, 1e-5) == pytest.approx(
        float(get_epsilon_gaussian(1.0, 1e-5)), rel=1e-10)
