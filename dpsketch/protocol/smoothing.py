"""Why discrete noise summed through the sketch is as private as the Gaussian the calibration
assumes, and what little it costs (docs/protocol.md, section 5a, gives the argument in full).

The accounting (``accounting.py``) treats the release noise of one column as a continuous
Gaussian with covariance sigma^2 S_H S_H^T + tau^2 I. The real noise is a sum of discrete
Gaussians on the grid h Z: each honest client's N_hZ(sigma_c) (sigma_c = t_c h >= sigma) pushed
through its sketch column, plus one honest server's N_hZ(tau_c) per cell. Two lattice facts
connect them:

1. Linear images (Genise, Micciancio, Peikert and Walter, PKC 2020, after Micciancio and
   Peikert 2012): the noise is M(g, T) with M = [S_H  I] and (g, T) a discrete Gaussian on
   h Z^(H + k). The kernel of M meets that lattice in the full-rank lattice spanned by the
   vectors h (e_i, -S_i), whose whitened lengths are at most beta = h sqrt(1 / sigma_c^2 +
   nnz / tau_c^2) (nnz: non-zeros per sketch column). By Gentry, Peikert and Vaikuntanathan
   (Lemma 3.1) its smoothing parameter is at most beta sqrt(ln(2 m (1 + 1/eps1)) / pi), and when
   that is at most 1 the image is within max-log distance ln((1 + eps1) / (1 - eps1)) of the
   discrete Gaussian on the image lattice with covariance sigma_c^2 S_H S_H^T + tau_c^2 I.
   Without server noise the same holds when every sketch column has one non-zero (gram,
   histogram, a sketch with s = 1): each row is then a plain sum, whose kernel is spanned by
   h (e_i - e_j) (whitened length sqrt 2 h / sigma_c), as Kairouz, Liu and Steinke (ICML 2021)
   use for the distributed discrete Gaussian.
2. Convolution (Peikert, CRYPTO 2010, Theorem 3.1, with a continuous first term): a discrete
   Gaussian on a lattice L with covariance Sigma is within statistical distance 8 eps2 of
   "draw y ~ N(0, Sigma - r^2 I) continuous, then round it randomly to L with parameter r",
   when r and the convolved parameter exceed the smoothing parameter eta_eps2(L) <= h
   sqrt(ln(2 k (1 + 1/eps2)) / pi). Rounding is a post-processing that does not depend on the
   data (every report lies on the same lattice), so the release is as private as the
   continuous Gaussian mechanism with covariance sigma_c^2 S_H S_H^T + (tau_c^2 - r^2) I.

So a study is accounted with sigma_c, with tau_c^2 - r^2 for the server noise (or, without
server noise, lambda - r^2 / sigma_c^2 for the honest lambda), and the two approximations are
added on top: over w columns epsilon grows by 2 w ln((1 + eps1)/(1 - eps1)) and delta by
8 w eps2 (1 + e^epsilon) (times e^(w ln((1+eps1)/(1-eps1)))). eps1 is at most 2^-100 for any
study this module calls covered and eps2 is 2^-300, so the slack is below 10^-25 even at
epsilon = 100; it is computed, not assumed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .noise import Grid

#: The linear-image error eps1 must be at most this (2^-100) for the argument to cover a study.
MAX_ERROR_LOG2 = -100.0
#: The rounding error eps2 the radius r is chosen for: 2^-300, so that 8 w eps2 (1 + e^epsilon)
#: stays negligible up to the schema's epsilon = 100 (e^100 < 2^145); r grows only as its root log.
ROUNDING_ERROR_LOG2 = -300.0
_LN2 = math.log(2.0)


@dataclass(frozen=True)
class Argument:
    """The discrete-noise argument for one study: whether it applies, and what it costs."""

    covered: bool
    reason: str
    spacing: float  # h: the grid step of noise and values
    client_std: float  # sigma_c = t_c h (0 without client noise)
    server_std: float  # tau_c = t_s h per unscaled cell (0 without server noise)
    rounding_radius: float  # r, unscaled value units
    linear_error_log2: float  # log2 eps1 (-inf: no linear map needed)
    rounding_error_log2: float  # log2 eps2
    columns: int

    @property
    def server_variance_kept(self) -> float:
        """tau_c^2 - r^2: the server variance the continuous mechanism may count."""
        return max(0.0, self.server_std ** 2 - self.rounding_radius ** 2) if self.server_std > 0 else 0.0

    @property
    def lambda_loss(self) -> float:
        """What the honest lambda loses when no server noise absorbs r^2: r^2 / sigma_c^2."""
        if self.server_std > 0 or self.client_std == 0:
            return 0.0
        return (self.rounding_radius / self.client_std) ** 2

    def epsilon_slack(self) -> float:
        """2 w ln((1 + eps1) / (1 - eps1)): the max-log distance of step 1, both ways."""
        eps1 = _exp2(self.linear_error_log2)
        return 2.0 * self.columns * math.log1p(2.0 * eps1 / (1.0 - eps1))

    def delta_slack(self, delta: float, epsilon: float) -> float:
        """What delta must leave for the approximations: (e^mu - 1) delta + e^mu 8 w eps2
        (1 + e^epsilon), mu = w ln((1 + eps1)/(1 - eps1))."""
        mu = self.epsilon_slack() / 2.0
        eps2 = _exp2(self.rounding_error_log2)
        return math.expm1(mu) * delta + math.exp(mu) * 8.0 * self.columns * eps2 * (
            1.0 + math.exp(min(epsilon, 700.0)))

    def describe(self) -> dict[str, float | bool | str]:
        return {"covered": self.covered, "reason": self.reason, "grid_step": self.spacing,
                "client_noise": self.client_std, "server_noise_per_cell": self.server_std,
                "rounding_radius": self.rounding_radius,
                "linear_error_log2": self.linear_error_log2,
                "rounding_error_log2": self.rounding_error_log2,
                "epsilon_slack": self.epsilon_slack()}


def _exp2(log2: float) -> float:
    return 0.0 if log2 == -math.inf else 2.0 ** log2


def smoothing_error_log2(beta: float, dimension: int) -> float:
    """log2 of the smallest eps with beta sqrt(ln(2 m (1 + 1/eps)) / pi) <= 1 (m = dimension):
    eps = 1 / (e^(pi / beta^2) / (2 m) - 1); +inf when no eps <= 1 does."""
    x = math.pi / beta ** 2 - math.log(2.0 * dimension)
    if x <= math.log(2.0):
        return math.inf
    if x > 700.0:
        return -x / _LN2
    return -math.log2(math.expm1(x))


def rounding_radius(spacing: float, k: int) -> float:
    """The radius r the grid's rounding argument is made for: 2 h sqrt(ln(2 k (1 + 1/eps2)) / pi),
    eps2 = 2^ROUNDING_ERROR_LOG2 (a study without server noise gives up r^2 of its clients'
    noise variance, Study.mechanism)."""
    eps2 = 2.0 ** ROUNDING_ERROR_LOG2
    return 2.0 * spacing * math.sqrt(math.log(2.0 * k * (1.0 + 1.0 / eps2)) / math.pi)


def argument(*, nonzeros: int, k: int, columns: int, max_reports: int, client_sigma: float,
             server_noise_std: float, grid: Grid, spacing_factor: float = 1.0) -> Argument:
    """The argument for a study whose sketch columns have ``nonzeros`` unit entries, k rows,
    ``columns`` released columns, with client noise ``client_sigma`` and per-cell server noise
    ``server_noise_std`` (unscaled) sampled on ``grid``. ``spacing_factor`` > 1 makes the
    argument for the grid that much coarser with the same noise (a gram validity study's strict
    upper triangle lies on sqrt(2) h in the release's units, with noise at least sigma there;
    both facts only get harder as the step grows, so that covers every coordinate)."""
    sigma_c = grid.scale(client_sigma) * grid.spacing if client_sigma > 0 else 0.0
    tau_c = grid.scale(server_noise_std) * grid.spacing if server_noise_std > 0 else 0.0
    h = grid.spacing * spacing_factor
    rounding_log2 = ROUNDING_ERROR_LOG2
    r = rounding_radius(h, k)

    def result(covered: bool, reason: str, linear_log2: float) -> Argument:
        return Argument(covered, reason, h, sigma_c, tau_c, r, linear_log2, rounding_log2, columns)

    if tau_c > 0:
        if sigma_c > 0:
            beta = h * math.sqrt(1.0 / sigma_c ** 2 + nonzeros / tau_c ** 2)
            linear = smoothing_error_log2(beta, max_reports + k)
        else:
            linear = -math.inf  # the servers' noise alone: no linear map
        smallest = tau_c
    elif sigma_c > 0 and nonzeros == 1:
        linear = smoothing_error_log2(math.sqrt(2.0) * h / sigma_c, max_reports)
        smallest = sigma_c
    elif sigma_c > 0:
        return result(False, f"sketch columns with {nonzeros} non-zeros and no server noise: the "
                             f"argument needs each server's noise to smooth the sum (server_sigma > 0)",
                      math.inf)
    else:
        return result(False, "no noise at all", math.inf)
    if linear > MAX_ERROR_LOG2:
        return result(False, f"the noise is too coarse on the grid (step {h:.3g}): the smoothing "
                             f"error 2^{linear:.1f} exceeds 2^{MAX_ERROR_LOG2:g}", linear)
    if smallest < 2.0 * r:
        return result(False, f"the noise ({smallest:.3g}) is below twice the rounding radius "
                             f"{r:.3g} of the grid", linear)
    return result(True, "server noise smooths the sketch" if tau_c > 0 else
                  "each row is a plain sum of client noise", linear)
