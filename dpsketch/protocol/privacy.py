"""Sensitivities, the Gaussian mechanism's unit noise, and the release certificate (DESIGN.md,
"Noise calibration").

The release Y = S(A + G) + E is a Gaussian mechanism with correlated noise. What one honest
report's epsilon is, for both neighbouring notions and with the servers' noise E, and how the
noise is split between clients and servers, is :mod:`.accounting`; this module gives it the
building blocks (sensitivity, ``unit_sigma`` = 1/mu_star, the tail cost of the 20 sigma cut,
lambda_star) and the certificate the servers check on the exact inclusion set before they release
anything (:func:`certify`): lambda_min(S S^T) - t >= lambda_star, so the honest reports certify
lambda_star.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

from . import features

Neighbouring = Literal["replace-one", "add-remove"]

#: Relative tolerance when a client or server re-derives a study's sigma and compares.
SIGMA_RTOL = 1e-9


def sensitivity(row_bound: float, neighbouring: Neighbouring, kind: features.Kind = "sketch") -> float:
    """L2 sensitivity of what one client shares.

    sketch, l1: the clipped row; replacing it moves the data by up to 2B, removing it by B (the
    map's own scale is the leverage in the certificate, not part of Delta).
    gram: the feature vector [a, u(a a^T), 1] (:func:`features.gram_feature_sensitivity`).
    moments: u(a a^T) alone (:func:`features.moments_sensitivity`): sqrt(2) B^2 and B^2.
    histogram: a 0/1 vector of norm B (the study's row bound: 1 for a one-hot vector, sqrt(m)
    for a marginal histogram's m ones): replacing it moves at most B^2 ones to other cells,
    sqrt(2) B; removing it, B.
    """
    if neighbouring not in ("replace-one", "add-remove"):
        raise ValueError(f"unknown neighbouring notion {neighbouring!r}")
    replace_one = neighbouring == "replace-one"
    if kind in ("sketch", "l1"):
        return 2.0 * row_bound if replace_one else row_bound
    if kind == "gram":
        return features.gram_feature_sensitivity(row_bound, replace_one)
    if kind == "moments":
        return features.moments_sensitivity(row_bound, replace_one)
    if kind == "histogram":
        return math.sqrt(2.0) * row_bound if replace_one else float(row_bound)
    raise ValueError(f"unknown study kind {kind!r}")


@lru_cache(maxsize=256)
def unit_sigma(epsilon: float, delta: float) -> float:
    """1/mu_star: the analytic-Gaussian noise for sensitivity 1 at exactly (epsilon, delta).

    Balle & Wang (2018) through Google's dp-accounting package (imported on first use: it takes
    about a second to import, which every service start would otherwise pay).
    """
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError("epsilon must be a positive finite number")
    if not 0 < delta < 1:
        raise ValueError("delta must lie strictly between 0 and 1")
    from dp_accounting import get_sigma_gaussian

    return float(get_sigma_gaussian(epsilon, delta))


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Noise std of a central Gaussian mechanism with the given L2 sensitivity."""
    return sensitivity * unit_sigma(epsilon, delta)


def local_sigma(
    epsilon: float, delta: float, row_bound: float, neighbouring: Neighbouring, kind: features.Kind = "sketch"
) -> float:
    """sigma_local = Delta / mu_star: what each client would need without the servers' sum."""
    return gaussian_sigma(epsilon, delta, sensitivity(row_bound, neighbouring, kind))


def tail_delta(epsilon: float, noise_coordinates: int, tail_sigmas: float) -> float:
    """What redrawing noise beyond ``tail_sigmas`` sigma can add to delta.

    The truncated noise of all clients is the Gaussian conditioned on the event E that no
    coordinate is cut, P(not E) <= m p with p = erfc(T / sqrt 2) over m noise coordinates. For
    any output set, P'[S] <= P[S] / P(E) and P[S] <= P(E) P'[S] + P(not E), so an
    (epsilon, delta) Gaussian release becomes (epsilon, delta + (e^epsilon + delta) m p / (1 - m p))
    with truncation (at most (e^epsilon + 1) m p / (1 - m p), what this returns). Studies require this extra to be below 1e-6 delta (T = 20: p = 5.5e-89).
    """
    return truncation_delta(epsilon, float(noise_coordinates) * math.erfc(tail_sigmas / math.sqrt(2.0)))


def truncation_delta(epsilon: float, mp: float) -> float:
    """(e^epsilon + 1) mp / (1 - mp): what conditioning noise on no cut adds to delta, for a total
    cut probability mp over all noise values (:func:`tail_delta`'s argument)."""
    if mp >= 1.0:
        return math.inf
    return (math.exp(min(epsilon, 700.0)) + 1.0) * mp / (1.0 - mp)


def expected_lambda_min(n: int, k: int) -> float:
    """The Bai-Yin estimate (n/k)(1 - sqrt(k/n))^2 of lambda_min(S S^T) for n >> k reports.

    Only used to choose lambda_star; the certificate, not this estimate, guarantees privacy.
    """
    if n <= k:
        return 0.0
    return (n / k) * (1.0 - math.sqrt(k / n)) ** 2


#: Fraction of the Bai-Yin estimate that a study asks for as lambda_star when it has at least
#: LAMBDA_SAFETY_MIN_RATIO reports per sketch row at min_reports and min_reports is at most 0.9 of
#: the expected count (every default design does:
#: ``study.default_k`` keeps k <= n/100 and min_reports = 0.9 n). Measured lambda_min / Bai-Yin
#: for block OSNAP (s = 4, 400 draws each; docs/accuracy.md): mean 0.99-1.06, sd 0.7-2.6 %, below
#: 0.97 in 0 / 0.25 / 1.25 / 1.0 / 0 % of draws at n/k = 90 / 112 / 112 / 225 / 450. A draw below
#: it only makes the servers refuse to release (the certificate, not this estimate, guarantees
#: privacy), and only near n = min_reports: at the expected n, lambda_min exceeds lambda_star by
#: about 10 %. t is subtracted separately.
LAMBDA_SAFETY = 0.97
#: Below LAMBDA_SAFETY_MIN_RATIO reports per row (a k chosen by hand) the spectrum spreads more
#: (sd 1.7 % at n/k = 50, 2.7 % at 20: 0.97 would refuse 5-10 % of studies at min_reports), so
#: such a study asks for this fraction instead. Even this does not hold at a few reports per row:
#: a commit of exactly min_reports fresh ids under a fresh sketch seed was refused in 45 of 2,000
#: draws at k = 8, n = 100 (n/k = 12.5) and 3 of 1,000 at k = 16, n = 300 (session 55's test
#: audit); a few percent more reports than min_reports make it rare (0 of 4,000 at 1.4 min_reports).
LAMBDA_SAFETY_SMALL = 0.9
LAMBDA_SAFETY_MIN_RATIO = 90


def lambda_safety(min_reports: int, k: int, expected_reports: int | None = None) -> float:
    """The fraction of the Bai-Yin estimate :func:`choose_lambda_star` asks for: LAMBDA_SAFETY
    with at least LAMBDA_SAFETY_MIN_RATIO reports per row at min_reports and min_reports at most
    0.9 of the expected count (design()'s default: the count that arrives is then about 10 % above
    min_reports, and lambda_min with it), else LAMBDA_SAFETY_SMALL. A study whose min_reports is
    the expected count is committed at about min_reports, where 0.97 would refuse 1-2 % of them."""
    if min_reports < LAMBDA_SAFETY_MIN_RATIO * k:
        return LAMBDA_SAFETY_SMALL
    if expected_reports is not None and min_reports > 0.9 * expected_reports:
        return LAMBDA_SAFETY_SMALL
    return LAMBDA_SAFETY


def choose_lambda_star(min_reports: int, k: int, t: int, expected_reports: int | None = None) -> float:
    """A lambda_star that a study with at least ``min_reports`` reports will certify (with high
    probability; the servers' certificate decides, and refuses otherwise)."""
    if k == 1:
        # The plain sum: S S^T = n exactly, the certificate is n - t.
        return float(max(1, min_reports - t))
    estimate = lambda_safety(min_reports, k, expected_reports) * expected_lambda_min(min_reports, k) - t
    if estimate < 1.0:
        raise ValueError(
            f"min_reports={min_reports} is too small for k={k}: lambda_min(S S^T) would not "
            f"exceed 1 + t; use a smaller k or more reports"
        )
    return float(estimate)


@dataclass(frozen=True)
class Certificate:
    """The outcome of a server's check before it releases its aggregate share."""

    n_reports: int
    lambda_min: float
    t: int
    lambda_star: float

    @property
    def margin(self) -> float:
        return self.lambda_min - self.t - self.lambda_star

    @property
    def ok(self) -> bool:
        return self.margin >= 0.0


def lambda_min_of_gram(sst_unscaled: np.ndarray, s: int) -> float:
    """Smallest eigenvalue of S S^T given the integer matrix s * S S^T (sums of sign products)."""
    sst = np.asarray(sst_unscaled, dtype=np.float64) / float(s)
    return float(np.linalg.eigvalsh(sst)[0])


def certify(sst_unscaled: np.ndarray, s: int, n_reports: int, t: int, lambda_star: float) -> Certificate:
    return Certificate(
        n_reports=n_reports,
        lambda_min=lambda_min_of_gram(sst_unscaled, s),
        t=t,
        lambda_star=lambda_star,
    )


def certify_study(study, sst_unscaled: np.ndarray, report_ids) -> Certificate:
    """A server's check of an inclusion set, whatever the study's map.

    OSNAP (and the plain sum): lambda_min(S S^T) - t >= lambda_star from the running k x k total.
    l1 sketch: every report's leverage (with the bound for t colluders) <= 1 / lambda_star, from the
    same k x k total S S^T and the report ids' columns (l1sketch.py); the certificate then carries
    lambda_min = 1 / (largest leverage) and t = 0 (t is inside the leverage bound), so its margin
    has the same meaning for both maps."""
    n = len(report_ids)
    if study.kind != "l1":
        return certify(sst_unscaled, study.s, n, study.t, study.lambda_star)
    from . import l1sketch

    rows, signs = study.hash_report_ids(report_ids)
    lev = l1sketch.leverages(rows, signs, study.k, study.t, M=np.asarray(sst_unscaled, dtype=np.int64))
    worst = float(lev.max()) if n else math.inf
    return Certificate(n_reports=n, lambda_min=(1.0 / worst if worst > 0 else math.inf), t=0,
                       lambda_star=study.lambda_star)
