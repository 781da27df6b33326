"""What one honest report's privacy actually is, for both neighbouring notions, with client noise,
server noise, and however many other honest reports there are (docs/trust.md, "Accounting").

One honest report i enters the release as S_i (x_i + g_i) in every column, where x_i is what the
client shares (its clipped row, or phi(a) in a gram study), g_i its own N(0, sigma^2) noise, and
||S_i|| = 1. What the adversary cannot remove is the noise of the other honest reports H - i and
the N(0, tau^2) noise of one honest server (the others may collude and reveal theirs); per
column it has covariance sigma^2 S_{H-i} S_{H-i}^T + tau^2 I. Whitened by it, everything the
report changes lies along one direction per column, of squared length

    l = S_i^T (sigma^2 S_{H-i} S_{H-i}^T + tau^2 I)^-1 S_i  <=  1 / (sigma^2 lambda_rest + tau^2),

where lambda_rest is a lower bound on lambda_min(S_{H-i} S_{H-i}^T): lambda - 1 when the
certificate gives lambda_min(S_H S_H^T) >= lambda (Weyl: removing a unit column), and 0 when no
other honest report may be assumed (the floor).

* **replace-one**: the report's own noise g_i is there in both worlds, so it joins the
  covariance: l = 1 / (sigma^2 max(1, lambda) + tau^2) and the release is a Gaussian mechanism
  with mu = Delta_replace sqrt(l) (closed form, Balle and Wang 2018, via dp-accounting).
* **add/remove**: the report's noise leaves with the report. Per column the two worlds are
  N(sqrt(l) x_c, 1 + sigma^2 l) and N(0, 1) along the report's direction, identical elsewhere:
  over the width w columns the pair P = N(M e_1, r I_w), Q = N(0, I_w) with M = ||x|| sqrt(l),
  r = 1 + sigma^2 l. Its privacy loss is exactly L1 + L2: L1 the one-dimensional shift-and-scale
  part, L2 = (r - 1)/2 chi^2_{w-1} - (w - 1)/2 ln r the variance change of the other w - 1
  coordinates. Both laws are known in closed form (a quadratic of a Gaussian, a scaled
  chi-square); they are discretised pessimistically (every loss rounded up to a grid of 10^-3)
  into dp-accounting privacy-loss distributions, composed, and epsilon read off at delta in
  both directions (adding and removing). The result is an upper bound that is tight to the grid.

Both losses grow with l (a smaller l is a post-processing of a larger one: scale by
sqrt(l'/l) and add independent noise), so the bounds on l above are worst cases.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

import numpy as np

from . import features, privacy

#: a loss law: (lo, hi, masses), where masses(bin edges) gives the mass of each bin between them
LossLaw = tuple[float, float, Callable[[np.ndarray], np.ndarray]]

#: Loss grid of the add/remove computation: epsilon comes out at most about this much too high
#: (1e-3: 40 ms a computation; the tests check 1e-4 against an independent closed form).
LOSS_GRID = 1e-3
#: The calibration searches on this coarser grid (a multiple of LOSS_GRID: epsilon only grows),
#: then checks its answer on LOSS_GRID.
SEARCH_GRID = 1e-2
#: Most grid points of one discretised loss law; a wider law gets a coarser grid.
MAX_GRID_POINTS = 400_000
#: Probability left out at each end of a loss law (the upper end counts as infinite loss).
TAIL_MASS = 1e-18


def warm_up(dp_accounting: bool = True) -> None:
    """Import now what calibrating or checking a study imports on first use, so that a study
    waits for no import; nothing is computed. Services call it in a background thread.

    ``dp_accounting=False`` imports only what checking a replace-one study needs (scipy's
    special functions, the secret-sign and l1 accountings: about 0.3-0.5 s of CPU).
    dp-accounting itself, with the scipy.stats and scipy.signal it imports, is what add/remove
    studies, the population ledger and the analyzer's calibration need: about 1.4-2.1 s of CPU
    more on the 2-core VM (``python -c "import dp_accounting"``), which a share server imports
    only once it is idle (services/store.py, ``Store._warm``)."""
    import scipy.special  # noqa: F401

    from . import l1sketch, secret_sign  # noqa: F401

    if dp_accounting:
        import dp_accounting as _dp_accounting  # noqa: F401
        import scipy.stats  # noqa: F401
        from dp_accounting.pld import pld_pmf, privacy_loss_distribution  # noqa: F401


@dataclass(frozen=True)
class Mechanism:
    """The noise that protects one honest report, in release units (the 1/sqrt(s) applied)."""

    neighbouring: privacy.Neighbouring
    kind: features.Kind
    row_bound: float
    sigma: float  # each client's noise per coordinate
    server_sigma: float  # each server's noise per aggregate cell
    width: int  # coordinates per report
    #: each client multiplies its row by a secret sign before its noise (secret_sign.py)
    secret_sign: bool = False

    @property
    def replace_sensitivity(self) -> float:
        return privacy.sensitivity(self.row_bound, "replace-one", self.kind)

    @property
    def presence_norm(self) -> float:
        """max ||x||: how far one report's presence moves the release (add/remove sensitivity)."""
        return privacy.sensitivity(self.row_bound, "add-remove", self.kind)

    def epsilon(self, honest_lambda: float, delta: float) -> float:
        """epsilon at delta for one honest report when lambda_min(S_H S_H^T) >= honest_lambda
        over the honest reports H (itself included); honest_lambda = 1 is the floor: no other
        honest report at all (every other report the adversary's)."""
        return report_epsilon(self.neighbouring, self.kind, self.row_bound, self.sigma,
                              self.server_sigma, max(1.0, float(honest_lambda)), self.width, delta,
                              secret_sign=self.secret_sign)


@lru_cache(maxsize=4096)
def report_epsilon(neighbouring: str, kind: str, row_bound: float, sigma: float, server_sigma: float,
                   honest_lambda: float, width: int, delta: float, grid: float = LOSS_GRID,
                   secret_sign: bool = False) -> float:
    """See :meth:`Mechanism.epsilon` (cached: studies are validated wherever they are parsed).
    ``grid``: the add/remove loss grid (a multiple of LOSS_GRID gives a larger upper bound).
    ``secret_sign``: the mixture accounting of secret_sign.py (a sketch study only), or the
    plain Gaussian accounting of the same noise where that is smaller: the signed experiment is a
    post-processing of the unsigned one (docs/secret_sign.md section 2, Lemma 0), and the mixture's
    certified bound loses its edge at large epsilon (above about 30, where tanh(epsilon / 2)
    rounds to 1 in floating point)."""
    if secret_sign:
        from . import secret_sign as _sign

        signed = _sign.report_epsilon(neighbouring, row_bound, sigma, server_sigma, honest_lambda,
                                      width, delta, grid)
        plain = report_epsilon(neighbouring, kind, row_bound, sigma, server_sigma, honest_lambda, width,
                               delta, grid)
        return min(signed, plain)
    s2, t2 = float(sigma) ** 2, float(server_sigma) ** 2
    if neighbouring == "replace-one":
        mu = _replace_mu(kind, row_bound, s2, t2, honest_lambda)
        return math.inf if mu is None else gaussian_epsilon(mu, delta)
    if neighbouring != "add-remove":
        raise ValueError(f"unknown neighbouring notion {neighbouring!r}")
    shift, ratio = _presence_pair(kind, row_bound, s2, t2, honest_lambda)
    if shift is None:
        return math.inf  # nothing but the report's own noise: presence shows
    return add_remove_epsilon(shift, ratio, int(width), delta, grid)


def _replace_mu(kind: str, row_bound: float, s2: float, t2: float, honest_lambda: float) -> float | None:
    """mu = Delta_replace / sqrt(sigma^2 max(1, lambda) + tau^2), or None if there is no noise."""
    var = s2 * max(1.0, float(honest_lambda)) + t2
    if var <= 0:
        return None
    return privacy.sensitivity(row_bound, "replace-one", cast("features.Kind", kind)) / math.sqrt(var)


def _presence_pair(kind: str, row_bound: float, s2: float, t2: float, honest_lambda: float):
    """(shift, ratio) of the add/remove pair (module docstring), or (None, None) if unbounded."""
    var = s2 * max(0.0, float(honest_lambda) - 1.0) + t2
    if var <= 0:
        return None, None
    return privacy.sensitivity(row_bound, "add-remove", cast("features.Kind", kind)) / math.sqrt(var), 1.0 + s2 / var


def gaussian_epsilon(mu: float, delta: float) -> float:
    """epsilon of a mu-GDP mechanism (a Gaussian shift of mu standard deviations) at delta.

    The exact curve of Balle and Wang (2018, Theorem 8), delta(epsilon) = Phi(mu/2 - epsilon/mu)
    - e^epsilon Phi(-mu/2 - epsilon/mu), solved for epsilon in log space by bisection, as
    dp-accounting's ``get_epsilon_gaussian`` solves it (tests/test_gaussian_closed_form.py holds
    the two within 1e-10 of each other). Written out because it is every replace-one study's
    check, which every client runs on the study it fetched: importing dp-accounting for it (which
    imports scipy.optimize, scipy.stats and scipy.signal) cost a fresh client process 1.2-2.0 s
    of CPU on this 2-core machine at load 14, more than the rest of its one-row submission."""
    if mu <= 0 or delta >= 1:
        return 0.0
    if not math.isfinite(mu) or delta <= 0:
        return math.inf
    log_delta = math.log(delta)
    if _gaussian_log_delta(mu, 0.0) < log_delta:
        return 0.0  # (0, delta)-DP
    lo, hi = 0.0, 1.0
    while _gaussian_log_delta(mu, hi) > log_delta:
        lo, hi = hi, hi * 10
    while hi - lo > 1e-13 * max(1.0, hi):  # the curve decreases in epsilon
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if _gaussian_log_delta(mu, mid) > log_delta:
            lo = mid
        else:
            hi = mid
    return hi  # the upper end: epsilon is never understated


def _log_ndtr(x: float) -> float:
    """log Phi(x), accurate in the far lower tail (where Phi underflows) by its asymptotic series."""
    if x > -20.0:
        return math.log(0.5 * math.erfc(-x / math.sqrt(2.0)))
    # Phi(x) = phi(x)/(-x) (1 - 1/x^2 + 3/x^4 - 15/x^6 + ...): 12 terms reach 1e-17 from x = -20 on
    inv, term, series = 1.0 / (x * x), 1.0, 1.0
    for k in range(1, 13):
        term *= -(2 * k - 1) * inv
        series += term
    return -0.5 * x * x - math.log(-x) - 0.5 * math.log(2.0 * math.pi) + math.log(series)


def _gaussian_log_delta(mu: float, eps: float) -> float:
    """log delta(eps) of the mu-GDP curve (-inf where it is 0)."""
    a = _log_ndtr(mu / 2.0 - eps / mu)
    b = eps + _log_ndtr(-mu / 2.0 - eps / mu)
    return a + math.log1p(-math.exp(b - a)) if b < a else -math.inf


def add_remove_epsilon(shift: float, ratio: float, width: int, delta: float,
                       grid: float = LOSS_GRID) -> float:
    """epsilon at delta between P = N(shift e_1, ratio I_width) and Q = N(0, I_width), both ways.

    ``ratio`` = 1 is the plain Gaussian shift (closed form). Otherwise the loss ln p/q is
    L1 + L2 (module docstring), each discretised pessimistically and composed with dp-accounting.
    """
    if ratio < 1.0:
        raise ValueError("the variance ratio of the report's own noise is at least 1")
    if ratio == 1.0 or width < 1:
        return gaussian_epsilon(shift, delta)
    from dp_accounting.pld import privacy_loss_distribution as pld

    remove = _loss_pmf(shift, ratio, width, upper=True, grid=grid)
    add = _loss_pmf(shift, ratio, width, upper=False, grid=grid)
    return float(pld.PrivacyLossDistribution(remove, add).get_epsilon_for_delta(delta))


def _loss_pmf(shift: float, ratio: float, width: int, *, upper: bool, grid: float):
    """The pessimistic PLD pmf of ln p/q under P (``upper``: the report is there, the remove
    direction) or of ln q/p under Q (the add direction)."""
    one, rest = _loss_parts(shift, ratio, width, upper)
    grid = max(grid, _parts_span(one, rest) / MAX_GRID_POINTS)
    pmf = _discretise(*one, grid)
    return pmf.compose(_discretise(*rest, grid)) if rest else pmf


def _loss_parts(shift: float, ratio: float, width: int, upper: bool) -> tuple[LossLaw, LossLaw | None]:
    """The two loss laws L1 (shift and scale) and L2 (variance change, None for width 1)."""
    one = _shift_scale_loss(shift, ratio, upper)
    return one, (_variance_loss(ratio, width - 1, upper) if width > 1 else None)


def _parts_span(one, rest) -> float:
    return (one[1] - one[0]) + ((rest[1] - rest[0]) if rest else 0.0)


def _interval(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """P[lo < Z <= hi] for a standard normal Z, accurate in both tails."""
    from scipy.special import ndtr

    lo, hi = np.broadcast_arrays(np.asarray(lo, float), np.asarray(hi, float))
    right = lo > 0  # both in the upper tail: use survival functions
    out = np.where(right, ndtr(-lo) - ndtr(-hi), ndtr(hi) - ndtr(lo))
    return np.maximum(out, 0.0)


def _shift_scale_loss(shift: float, ratio: float, upper: bool) -> LossLaw:
    """(lo, hi, masses-of-bins function) of the one-coordinate loss
    L1(y) = a y^2 + b y + c with a = (r-1)/2r, b = M/r, c = -M^2/2r - ln(r)/2, under
    y ~ N(M, r) (upper) or of -L1 under y ~ N(0, 1)."""
    r, m = float(ratio), float(shift)
    a, b, c = (r - 1.0) / (2.0 * r), m / r, -m * m / (2.0 * r) - 0.5 * math.log(r)
    mean, sd = (m, math.sqrt(r)) if upper else (0.0, 1.0)
    sign = 1.0 if upper else -1.0
    z = 9.5  # P[|Z| > 9.5] ~ 2e-21
    vertex = -b / (2.0 * a)
    ys = [mean - z * sd, mean + z * sd]
    values = [a * y * y + b * y + c for y in ys]
    if ys[0] < vertex < ys[1]:
        values.append(a * vertex * vertex + b * vertex + c)
    lo, hi = sign * min(values), sign * max(values)
    if not upper:
        lo, hi = hi, lo

    def roots(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """y- <= y+ with a y^2 + b y + c = x (NaN where L1 never reaches x)."""
        disc = b * b - 4.0 * a * (c - x)
        ok = disc >= 0
        sq = np.sqrt(np.where(ok, disc, 0.0))
        q = -0.5 * (b + sq)
        with np.errstate(divide="ignore", invalid="ignore"):
            r1 = np.where(q != 0, q / a, -np.inf)
            r2 = np.where(q != 0, (c - x) / q, np.inf)
        return np.where(ok, np.minimum(r1, r2), np.nan), np.where(ok, np.maximum(r1, r2), np.nan)

    def mass_below(x: np.ndarray) -> np.ndarray:
        """Masses of the bins (x[j-1], x[j]] of the loss (x ascending), in standard units."""
        if upper:  # L1 <= x  <=>  y in [y-(x), y+(x)]
            ym, yp = roots(x)
            zm = (np.nan_to_num(ym, nan=vertex) - mean) / sd
            zp = (np.nan_to_num(yp, nan=vertex) - mean) / sd
            # y+ rises and y- falls with x: a bin's mass is two thin intervals
            return _interval(zp[:-1], zp[1:]) + _interval(zm[1:], zm[:-1])
        # -L1 <= x  <=>  L1 >= -x  <=>  y outside (y-(-x), y+(-x)); as x grows the hole shrinks
        ym, yp = roots(-x)
        zm = (np.nan_to_num(ym, nan=vertex) - mean) / sd
        zp = (np.nan_to_num(yp, nan=vertex) - mean) / sd
        return _interval(zm[:-1], zm[1:]) + _interval(zp[1:], zp[:-1])

    return lo, hi, mass_below


def _variance_loss(ratio: float, dof: int, upper: bool) -> LossLaw:
    """(lo, hi, masses) of L2 = (r-1)/2 X - dof/2 ln r with X ~ chi^2_dof (upper), or of -L2 with
    L2 = (r-1)/2r X - dof/2 ln r, X ~ chi^2_dof."""
    from scipy.stats import chi2

    r = float(ratio)
    alpha = (r - 1.0) / 2.0 if upper else (r - 1.0) / (2.0 * r)
    beta = -0.5 * dof * math.log(r)
    x_lo, x_hi = chi2.ppf(TAIL_MASS, dof), chi2.isf(TAIL_MASS, dof)
    if upper:
        lo, hi = alpha * x_lo + beta, alpha * x_hi + beta
    else:
        lo, hi = -(alpha * x_hi + beta), -(alpha * x_lo + beta)

    def masses(x: np.ndarray) -> np.ndarray:
        # the chi-square value at each loss edge (increasing in x for upper, decreasing otherwise)
        edges = (x - beta) / alpha if upper else (-x - beta) / alpha
        cdf = chi2.cdf(edges, dof)
        sf = chi2.sf(edges, dof)
        # a bin's mass, from whichever tail function keeps precision
        tail_hi = np.where(edges[:-1] > dof, sf[:-1] - sf[1:], cdf[1:] - cdf[:-1])
        tail_lo = np.where(edges[1:] > dof, sf[1:] - sf[:-1], cdf[:-1] - cdf[1:])
        return np.maximum(tail_hi if upper else tail_lo, 0.0)

    return lo, hi, masses


def _discretise(lo: float, hi: float, masses, grid: float):
    """A pessimistic dp-accounting pmf: the mass of the loss in ((j-1) g, j g] placed at j g; what
    lies outside [lo, hi] (under 1e-17 by the choice of lo and hi) counts as infinite loss."""
    from dp_accounting.pld import pld_pmf

    first = math.floor(lo / grid)
    last = math.ceil(hi / grid)
    if last - first > 4 * MAX_GRID_POINTS:
        raise ValueError("loss law too wide for the grid")
    edges = np.arange(first, last + 1, dtype=np.float64) * grid
    probs = np.concatenate([[0.0], masses(edges)])
    infinity = max(0.0, 1.0 - float(np.sum(probs)))
    return pld_pmf.DensePLDPmf(grid, first, probs, infinity, pessimistic_estimate=True)


# --- calibration -----------------------------------------------------------------------------

#: Calibrated noise meets its targets with this much to spare (relative), so that a client or
#: server recomputing the accounting with another build of numpy/scipy agrees.
CALIBRATION_MARGIN = 1e-6


@dataclass(frozen=True)
class Calibration:
    """The noise a study asks of each client (sigma) and of each server (server_sigma)."""

    sigma: float
    server_sigma: float


def calibrate(neighbouring: privacy.Neighbouring, kind: features.Kind, row_bound: float, epsilon: float,
              delta: float, honest_lambda: float, width: int,
              epsilon_floor: float | None = None, secret_sign: bool = False) -> Calibration:
    """Client and server noise for an (epsilon, delta) study whose certificate guarantees
    lambda_min(S_H S_H^T) >= honest_lambda, and, with ``epsilon_floor``, an (epsilon_floor, delta)
    guarantee for every report even when no other report is honest.

    Why this split. The floor can only come from a server (an honest report's own noise is all
    it has, and each of the N servers adds the same noise, one of which is honest); the release
    then carries N servers' noise, while the client noise is shrunk by the sum over about
    lambda reports. So servers add just what the floor needs beyond the report's own noise, and
    clients what the LTM target needs beyond one server's noise. For replace-one, with
    A = (Delta sigma_unit(epsilon))^2 and A_f the same at epsilon_floor, that is

        sigma^2 = A / lambda, tau = 0                       if A / lambda >= A_f (floor met anyway)
        sigma^2 = (A - A_f) / (lambda - 1), tau^2 = A_f - sigma^2   otherwise,

    which minimises the release noise (sigma^2 n/k + N tau^2 per cell) for N >= 2 servers;
    epsilon_floor = epsilon gives sigma = 0: the servers' noise alone (the DAP model). For
    add/remove the same split is the starting point and both are scaled up together until the
    exact accounting (variance change included) meets both targets. When a report's own noise
    would give its presence away whatever the scale (few reports, many values per report), the
    clients' share is halved, and so on, the servers taking over, down to servers' noise alone,
    which always works (a plain Gaussian mechanism).

    ``secret_sign`` (a sketch study whose clients sign their rows, secret_sign.py): replace-one
    takes A = B^2 / r(epsilon, delta)^2, r the mixture's radius, instead of (Delta / mu_star)^2;
    add/remove starts the same search from a sixteenth of that and uses the mixture's epsilon.
    """
    if epsilon_floor is not None and epsilon_floor < epsilon:
        raise ValueError(f"epsilon_floor = {epsilon_floor:g} is below epsilon = {epsilon:g}: the "
                         f"floor holds with no other honest report, so it cannot be the stronger one")
    lam = max(1.0, float(honest_lambda))
    unit = privacy.unit_sigma(epsilon, delta) * (1.0 + CALIBRATION_MARGIN)
    unit_f = (privacy.unit_sigma(epsilon_floor, delta) * (1.0 + CALIBRATION_MARGIN)
              if epsilon_floor is not None else None)
    if secret_sign:
        from . import secret_sign as _sign

        # the mixture's need, or the plain Gaussian's where smaller (Lemma 0 of docs/secret_sign.md:
        # the signed experiment is a post-processing of the unsigned one)
        delta_ro = privacy.sensitivity(row_bound, "replace-one", kind)

        def need(e: float) -> float:
            plain = (delta_ro * privacy.unit_sigma(e, delta)) ** 2
            # beyond the mixture's computed range (MAX_EPSILON, MAX_RADIUS): the plain Gaussian's
            if e > _sign.MAX_EPSILON or _sign.replace_radius(e, delta) >= _sign.MAX_RADIUS:
                return plain * (1.0 + CALIBRATION_MARGIN) ** 2
            return min(_sign.variance_needed(row_bound, e, delta), plain) * (1.0 + CALIBRATION_MARGIN) ** 2

        a, a_f = need(epsilon), (None if epsilon_floor is None else need(epsilon_floor))
        if neighbouring == "replace-one":
            return _split(a, a_f, lam)
        a, a_f = a / 16.0, (None if a_f is None else a_f / 16.0)
    elif neighbouring == "replace-one":
        delta_ro = privacy.sensitivity(row_bound, "replace-one", kind)
        return _split(delta_ro ** 2 * unit ** 2, None if unit_f is None else delta_ro ** 2 * unit_f ** 2, lam)
    if neighbouring != "add-remove":
        raise ValueError(f"unknown neighbouring notion {neighbouring!r}")
    if not secret_sign:
        norm = privacy.sensitivity(row_bound, "add-remove", kind)
        a, a_f = norm ** 2 * unit ** 2, (None if unit_f is None else norm ** 2 * unit_f ** 2)
    # client noise sigma0 as if the variance change were free; then less of it, the servers
    # taking over, until the report's own noise no longer gives its presence away
    s0 = math.sqrt(max(0.0, a - (a_f or 0.0)) / (lam - 1.0)) if lam > 1.0 else 0.0
    for share in (1.0, 0.5, 0.25, 0.125, 0.0625, 0.0):
        s2 = (share * s0) ** 2
        tau2 = a_f or 0.0 if share == 1.0 else max(a_f or 0.0, a - s2 * (lam - 1.0))
        found = _scale_until(Calibration(math.sqrt(s2), math.sqrt(tau2)), neighbouring, kind,
                             row_bound, epsilon, delta, lam, width, epsilon_floor, secret_sign)
        if found is not None:
            return found
    # The servers' noise alone is a Gaussian mechanism, feasible at some scale; only a scale
    # beyond the search's 10^6-fold range ends here (epsilon or delta vanishingly small).
    raise ValueError(f"no noise scale meets epsilon = {epsilon:g}, delta = {delta:g} under add/remove "
                     f"(at most 10^6 times the replace-one scale is searched): raise epsilon or delta")


def _split(a: float, a_f: float | None, lam: float) -> Calibration:
    if a_f is None or a / lam >= a_f:
        return Calibration(math.sqrt(a / lam), 0.0)
    s2 = (a - a_f) / (lam - 1.0)  # lam > 1 here: a / lam < a_f <= a
    return Calibration(math.sqrt(s2), math.sqrt(max(0.0, a_f - s2)))


def _scale_until(start: Calibration, neighbouring, kind, row_bound, epsilon, delta, lam, width,
                 epsilon_floor, secret_sign: bool = False) -> Calibration | None:
    """The smallest gamma >= 1 (to 0.1 %) with gamma * start meeting both targets exactly, or None
    if no gamma does. Scaling both noises keeps the variance ratio r and shrinks the shift, so
    the loss falls monotonically towards that of the variance change alone."""
    target = epsilon * (1.0 - CALIBRATION_MARGIN)
    floor_target = None if epsilon_floor is None else epsilon_floor * (1.0 - CALIBRATION_MARGIN)

    def ok(gamma: float, grid: float = SEARCH_GRID) -> bool:
        sigma, tau = gamma * start.sigma, gamma * start.server_sigma
        if report_epsilon(neighbouring, kind, row_bound, sigma, tau, lam, width, delta, grid,
                          secret_sign=secret_sign) > target:
            return False
        return floor_target is None or report_epsilon(
            neighbouring, kind, row_bound, sigma, tau, 1.0, width, delta, grid,
            secret_sign=secret_sign) <= floor_target

    # search on a coarse grid (a coarser pessimistic rounding only overstates epsilon), then make
    # sure of the result on the grid the study is validated with
    if not ok(1e6):
        return None
    lo, hi = 1.0, 1.0
    while not ok(hi):
        lo, hi = hi, hi * 2.0
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    while not ok(hi, LOSS_GRID):  # practically never: the coarse bound is the larger one
        hi *= 1.001
    lo = hi / 1.03  # the coarse grid overstates epsilon by up to ~1 %: take back what it cost
    if ok(lo, LOSS_GRID):
        return Calibration(lo * start.sigma, lo * start.server_sigma)
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(mid, LOSS_GRID) else (mid, hi)
    return Calibration(hi * start.sigma, hi * start.server_sigma)


# --- privacy loss distributions for the ledger (docs/ledger.md) --------------------------------


def study_pld(neighbouring: str, kind: str, row_bound: float, sigma: float, server_sigma: float,
              honest_lambda: float, width: int, notion: str | None = None, grid: float = LOSS_GRID,
              secret_sign: bool = False):
    """The pessimistic dp-accounting PrivacyLossDistribution of one honest report under a study's
    noise at ``honest_lambda`` (its certificate: lambda_star), for the neighbouring ``notion``
    (default: the study's own), or None when that notion's loss is unbounded.

    It is the distribution :func:`report_epsilon` reads its epsilon from, so a study's charge in
    the ledger is what the study promises (within the grid): replace-one a Gaussian shift of
    mu = Delta_replace / sqrt(sigma^2 max(1, lambda) + tau^2); add/remove the shift-and-scale
    pair of the module docstring. The other notion, for the same noise (docs/ledger.md):

    * replace-one of an add/remove study: replacing the row keeps the report, and its own noise,
      in both worlds, so it is exactly the replace-one Gaussian of the same noise (tighter than
      group privacy over its add/remove promise);
    * add/remove of a replace-one study: None (unbounded). A replace-one study publishes its
      exact report count, so whether a report is there shows.

    The add/remove loss law may need a coarser grid than ``grid`` (:func:`pld_grid`); PLDs
    compose only on a common grid, so pass the largest grid of the PLDs to be composed.
    ``secret_sign``: the mixture's PLD (secret_sign.study_pld).
    """
    from dp_accounting.pld import privacy_loss_distribution as pld

    notion = notion or neighbouring
    if secret_sign:
        from . import secret_sign as _sign

        # beyond the mixture's evaluated radius the plain Gaussian's PLD (Lemma 0 of
        # docs/secret_sign.md: it dominates the signed experiment too)
        if not (notion == "replace-one" and _sign.replace_radius_of(
                row_bound, sigma, server_sigma, honest_lambda) > _sign.MAX_RADIUS):
            return _sign.study_pld(neighbouring, row_bound, sigma, server_sigma, honest_lambda, width,
                                   notion, grid)
    s2, t2 = float(sigma) ** 2, float(server_sigma) ** 2
    if notion == "replace-one":
        mu = _replace_mu(kind, row_bound, s2, t2, honest_lambda)
        if mu is None:
            return None
        return pld.from_gaussian_mechanism(1.0 / mu, value_discretization_interval=grid,
                                           pessimistic_estimate=True)
    if notion != "add-remove":
        raise ValueError(f"unknown neighbouring notion {notion!r}")
    if neighbouring != "add-remove":
        return None
    shift, ratio = _presence_pair(kind, row_bound, s2, t2, honest_lambda)
    if shift is None:
        return None
    if ratio == 1.0 or width < 1:
        return pld.from_gaussian_mechanism(1.0 / shift, value_discretization_interval=grid,
                                           pessimistic_estimate=True)
    grid = max(grid, _span(shift, ratio, int(width)) / MAX_GRID_POINTS)
    remove = _loss_pmf(shift, ratio, int(width), upper=True, grid=grid)
    add = _loss_pmf(shift, ratio, int(width), upper=False, grid=grid)
    return pld.PrivacyLossDistribution(remove, add)


def pld_grid(neighbouring: str, kind: str, row_bound: float, sigma: float, server_sigma: float,
             honest_lambda: float, width: int, notion: str | None = None, grid: float = LOSS_GRID,
             secret_sign: bool = False) -> float:
    """The loss grid :func:`study_pld` would use with ``grid``: ``grid``, or coarser for an
    add/remove loss law too wide for MAX_GRID_POINTS points."""
    if secret_sign:
        from . import secret_sign as _sign

        return _sign.pld_grid(neighbouring, row_bound, sigma, server_sigma, honest_lambda, width,
                              notion, grid)
    notion = notion or neighbouring
    if notion != "add-remove" or neighbouring != "add-remove":
        return grid
    shift, ratio = _presence_pair(kind, row_bound, float(sigma) ** 2, float(server_sigma) ** 2, honest_lambda)
    if shift is None or ratio == 1.0 or width < 1:
        return grid
    return max(grid, _span(shift, ratio, int(width)) / MAX_GRID_POINTS)


def _span(shift: float, ratio: float, width: int) -> float:
    """The widest loss range of both directions (what :func:`_loss_pmf` sizes its grid by)."""
    return max(_parts_span(*_loss_parts(shift, ratio, width, upper)) for upper in (True, False))
