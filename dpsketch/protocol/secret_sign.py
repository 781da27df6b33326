"""The secret sign: each client of a sketch study multiplies its clipped row by t = +-1 from its
CSPRNG before it adds its noise, and never reveals t (docs/secret_sign.md has the argument).

What the adversary sees of one honest report (everything else known, the noise of the honest
clients and of one honest server unknown) is, whitened, along the report's direction in every
column, the symmetric mixture ``Mix(u) = 1/2 N(u, I) + 1/2 N(-u, I)`` with u = sqrt(l) x
instead of N(u, I). This module computes certified upper bounds on its privacy profile:

* **replace-one** (``replace_*``): Mix(u) against Mix(v) over every pair with ||u||, ||v|| <= r,
  r = B / sqrt(sigma^2 max(1, lambda) + tau^2). Padding both vectors with extra coordinates to
  norm r (a marginal is a post-processing) and rotating reduces every pair to the experiment
  E(a, b): X = t a + Z1, Y = h t b + Z2 (h = +1 against -1), a = r cos phi >= b = r sin phi. Its
  privacy loss is 2 artanh(tanh(aX) tanh(bY)), and its profile is
  ``delta(epsilon) = (1 + e^eps)/2 * E[(A_a A_b - tanh(eps/2))_+]``, A_a = tanh(a|X|), X ~ N(a, 1)
  (a binary symmetric experiment: every hockey-stick divergence is a stop-loss of A_a A_b). Over
  the quarter circle phi in [0, pi/4] the profile is bounded by a finite **cover**: on a piece
  [phi_j, phi_j+1], a <= r cos phi_j and b <= r sin phi_j+1, and E(a, b) only gets more informative
  as a or b grows (add noise to X or Y). Each corner's stop-loss is computed with every |X| cell
  rounded up (a pessimistic discretisation), from survival functions and sums of positive terms.
  The orthogonal pair (phi = pi/4) is the largest point found on the arc (conjectured worst,
  not proved); the cover bound exceeds it by the cover's slack (about 0.3 %).
* **add/remove** (``presence_*``): Mix(M e_1) with variance ratio R = 1 + sigma^2 l on every
  column against N(0, I): exactly a one-dimensional symmetric Gaussian mixture, whose loss is
  monotone in |y|, plus the variance change of the other columns (the same law as without the
  sign, ``accounting._variance_loss``), over width + 1 columns so that ||x|| < B is covered too.

Both give dp-accounting privacy loss distributions (``replace_pld``, ``presence_pld``), so a
ledger can compose them, and calibration (``replace_radius``): the largest r meeting (epsilon,
delta), from which the variance the study needs is B^2 / r^2.

Floating point: every quantity is a sum or product of positive terms computed from survival
functions (``scipy.special.ndtr``) and ``tanh`` rounded up, so its relative error is below
1e-11; bounds are inflated by ``FLOAT_ALLOWANCE`` (1e-9) to cover it. tests/test_secret_sign.py
recomputes sample points in interval arithmetic (python-flint's arb) and checks the bound
contains them.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
# at import, not in the functions: this module is imported on first use, often from one of a
# client's upload threads; a scipy import made inside a function by two threads at once could
# hand one of them a partially initialised scipy module (seen in CI with scipy.optimize), while
# the import of this module is serialised by its own import lock. Not scipy.optimize: its one
# root finder here is _decreasing_root, since importing scipy.optimize cost a fresh client
# checking a signed study 0.35-0.5 s of CPU more than the rest of scipy it needs.
from scipy.special import ndtr

if TYPE_CHECKING:
    from .accounting import LossLaw

#: Cell width of |X| in a factor A_a = tanh(a|X|) (0.004 overstates delta by about 1.3 %, 0.002
#: by 0.7 %: a fraction of a percent of sigma^2).
CELL = 0.004
#: The cell width of the ledger's PLD (:func:`replace_pld`): twice CELL, a quarter of the atom
#: pairs (about 3x faster); a single study's charged epsilon grows by about 1e-3.
PLD_CELL = 0.008
#: |X| beyond a + TAIL_SIGMAS lands in the top cell, A = 1 (P < 1e-41).
TAIL_SIGMAS = 13.5
#: Relative inflation of every computed stop-loss: covers floating-point rounding (< 1e-11).
FLOAT_ALLOWANCE = 1e-9
#: The cover of the arc: one piece [0, COVER_START], then pieces shrinking geometrically by
#: COVER_RATIO towards the orthogonal pair pi/4, the last of width COVER_LAST.
COVER_START = math.pi / 8
COVER_RATIO = 0.93
COVER_LAST = 1e-4
#: The PLD's cover takes a group of pieces whole when its corner is within this of the best
#: corner at every loss (fewer corners to evaluate; the PLD only gets more pessimistic).
PLD_SLACK = 0.05
#: Calibrated noise meets its target with this much to spare (relative, as accounting does).
CALIBRATION_MARGIN = 1e-6
#: The largest epsilon the mixture is calibrated for. Beyond it tanh(epsilon / 2) is within 1e-13
#: of 1, the stop-loss differences are lost to rounding (the bound stays an upper bound, but a
#: useless and erratic one), and a secret-sign study is calibrated with the plain Gaussian's noise
#: instead, which is valid for it (docs/secret_sign.md section 2, Lemma 0).
MAX_EPSILON = 30.0
#: The largest radius r = B / sqrt(sigma^2 max(1, lambda) + tau^2) at which the mixture is
#: evaluated. A corner's arrays grow like r (cells of width CELL up to r + TAIL_SIGMAS), and a
#: study with little noise and no floor has an enormous r at lambda = 1 (its floor): evaluating it
#: took gigabytes. Beyond this the replace-one accounting is the plain Gaussian's (valid by
#: Lemma 0; the mixture's epsilon there is far above MAX_EPSILON for any delta the studies use).
MAX_RADIUS = 20.0


# --- one factor A_a = tanh(a |X|), X ~ N(a, 1) -------------------------------------------------


class _Factor:
    """The law of A_a with each cell (x_i, x_i+1] of |X| put at its top, tanh(a x_i+1) (rounded up),
    and |X| > x_n at 1. ``alpha`` the atoms (non-decreasing, last 1), ``surv`` S_i = P(|X| > x_i),
    ``mass`` p_i = S_i - S_i+1, and ``tail[m]`` = sum_{i >= m} S_i (alpha_i - alpha_i-1), so the
    stop-loss E[(A - x)_+] = (alpha_j - x) S_j + tail[j+1], j the first atom above x."""

    def __init__(self, a: float, cell: float):
        self.a = a
        x = np.arange(0.0, a + TAIL_SIGMAS + cell, cell)
        # P(|X| > x) = P(X > x) + P(X < -x): two upper tails, each accurate in relative terms
        surv = ndtr(a - x) + ndtr(-a - x)
        surv[0] = 1.0
        alpha = np.nextafter(np.tanh(a * x[1:]), 2.0)  # rounded up
        self.alpha = np.minimum(np.append(alpha, 1.0), 1.0)
        self.surv = surv  # S_0 .. S_n, one per atom
        self.mass = np.append(surv[:-1] - surv[1:], surv[-1])
        steps = np.diff(np.concatenate([[0.0], self.alpha])) * surv
        self.tail = np.append(np.cumsum(steps[::-1])[::-1], 0.0)

    def stop_loss(self, x: np.ndarray) -> np.ndarray:
        """E[(A - x)_+] for 0 <= x (upper bounds: x is taken a hair low)."""
        x = np.nextafter(np.asarray(x, dtype=np.float64), -1.0)
        j = np.searchsorted(self.alpha, x, side="right")  # first atom strictly above x
        inside = j < len(self.alpha)
        jj = np.minimum(j, len(self.alpha) - 1)
        out = (self.alpha[jj] - x) * self.surv[jj] + self.tail[jj + 1]
        return np.where(inside, np.maximum(out, 0.0), 0.0)


@lru_cache(maxsize=2048)
def _factor(a: float, cell: float) -> _Factor:
    return _Factor(a, cell)


def pair_stop_loss(a: float, b: float, z, cell: float | None = None) -> np.ndarray:
    """Upper bounds on E[(A_a A_b - z)_+] for the experiment E(a, b), at each z in [0, 1), with
    cells of |X| of width ``cell`` (default CELL; any width gives an upper bound)."""
    z = np.atleast_1d(np.asarray(z, dtype=np.float64))
    if a <= 0 or b <= 0:
        return np.zeros_like(z)
    cell = float(CELL if cell is None else cell)
    fa, fb = _factor(float(a), cell), _factor(float(b), cell)
    weights = fa.mass * fa.alpha
    out = np.empty_like(z)
    for start in range(0, len(z), 64):
        chunk = z[start:start + 64]
        inner = fb.stop_loss(chunk[:, None] / fa.alpha[None, :])  # 0 where alpha <= z
        out[start:start + 64] = inner @ weights
    return out * (1.0 + FLOAT_ALLOWANCE)


def pair_delta(a: float, b: float, epsilon: float) -> float:
    """Upper bound on delta(epsilon) of E(a, b) (both directions: the experiment is symmetric)."""
    z = math.tanh(epsilon / 2.0)
    return 0.5 * (1.0 + math.exp(min(epsilon, 700.0))) * float(pair_stop_loss(a, b, z)[0])


# --- the cover of the arc a^2 + b^2 = r^2 ----------------------------------------------------------


@lru_cache(maxsize=1)
def cover_angles() -> tuple[float, ...]:
    """0 = phi_0 < phi_1 = COVER_START < ... < pi/4: the pieces of the arc."""
    quarter = math.pi / 4.0
    angles = [0.0, COVER_START]
    gap = quarter - COVER_START
    while gap > COVER_LAST:
        gap *= COVER_RATIO
        angles.append(quarter - gap)
    angles.append(quarter)
    return tuple(angles)


def cover(r: float) -> list[tuple[float, float]]:
    """The corners (r cos phi_j, r sin phi_j+1): every E(a, b) on the arc is dominated by one."""
    phi = cover_angles()
    return [(r * math.cos(phi[j]), r * math.sin(phi[j + 1])) for j in range(len(phi) - 1)]


def orthogonal(r: float) -> tuple[float, float]:
    """The orthogonal pair with norms r, as E(r/sqrt 2, r/sqrt 2) (the conjectured worst)."""
    return (r / math.sqrt(2.0), r / math.sqrt(2.0))


def _cover_sup(r: float, value, reached=None, slack: float = 0.0):
    """The largest ``value(a, b)`` over the cover's corners (elementwise for arrays), by branch and
    bound: the corner (r cos phi_i, r sin phi_k) of pieces i..k-1 dominates each of theirs, so a
    group whose corner stays at or below the best found so far (or ``reached``: below a
    threshold, where the caller only asks whether the threshold holds) needs no refinement. The
    result equals the maximum over all corners (or exceeds ``reached`` exactly when it does).
    With ``slack`` a group whose corner is within that relative slack of the best so far is
    taken whole (its corner joins the maximum): a larger, still valid, bound from fewer corners."""
    phi = cover_angles()
    n = len(phi) - 1
    corner = lambda i, k: (r * math.cos(phi[i]), r * math.sin(phi[k]))  # noqa: E731
    best = np.asarray(value(*corner(n - 1, n)), dtype=np.float64)  # the piece at the orthogonal pair
    stack = [(0, n - 1)]
    while stack:
        i, k = stack.pop()
        v = np.asarray(value(*corner(i, k)), dtype=np.float64)
        if np.all(v <= best) or (reached is not None and np.all(v <= reached)):
            continue
        if k - i == 1 or (slack > 0 and np.all(v <= best * (1.0 + slack))):
            best = np.maximum(best, v)
            if reached is not None and np.any(best > reached):
                return best
            continue
        mid = (i + k) // 2
        stack.append((i, mid))
        stack.append((mid, k))  # popped first: nearer the orthogonal pair, the larger values
    return best


# --- replace-one ---------------------------------------------------------------------------------


def replace_delta(r: float, epsilon: float) -> float:
    """Certified upper bound on delta(epsilon) of Mix(u) against Mix(v) over ||u||, ||v|| <= r:
    the largest corner of the cover."""
    if r <= 0:
        return 0.0
    return float(_cover_sup(r, lambda a, b: pair_delta(a, b, epsilon)))


def replace_ok(r: float, epsilon: float, delta: float) -> bool:
    """replace_delta(r, epsilon) <= delta, refining the cover only where a corner exceeds delta."""
    if r <= 0:
        return True
    return bool(_cover_sup(r, lambda a, b: pair_delta(a, b, epsilon), reached=delta) <= delta)


def pair_epsilon(a: float, b: float, delta: float) -> float:
    """The smallest epsilon (to about 1e-12, rounded up) with pair_delta(a, b, epsilon) <= delta."""
    if pair_delta(a, b, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while pair_delta(a, b, hi) > delta:
        hi *= 2.0
        if hi > 1e4:
            return math.inf
    lo = hi / 2.0 if hi > 1.0 else 0.0
    f = lambda e: math.log(max(pair_delta(a, b, e), 1e-300)) - math.log(delta)  # noqa: E731
    root = _decreasing_root(f, lo, hi, 1e-13)
    step = 1e-12 * max(1.0, root)
    while pair_delta(a, b, root) > delta:  # the root's end of the bracket is checked already:
        root += step                       # kept, should it ever land a hair low
        step *= 2.0
    return root


def _decreasing_root(f, lo: float, hi: float, tol: float) -> float:
    """The upper end of a bracket [lo, hi] of the root of a decreasing ``f`` (f(lo) > 0 >= f(hi)),
    narrowed to ``tol`` relative: false position with the Illinois halving (superlinear, like the
    Brent's method it replaces, for a smooth f) and a bisection step whenever two steps did not
    halve the bracket. The end returned always has f <= 0 (epsilon is never understated)."""
    flo, fhi = f(lo), f(hi)
    if fhi > 0:
        raise ValueError("the bracket's upper end must have f <= 0")
    kept = 0  # which end the last step kept: -1 lo moved, +1 hi moved
    width = hi - lo
    for step in range(200):
        if hi - lo <= tol * max(1.0, hi):
            break
        x = hi - fhi * (hi - lo) / (fhi - flo) if flo > fhi else 0.5 * (lo + hi)
        if step % 2 == 1:  # every other step: did the last two at least halve the bracket?
            if hi - lo > 0.5 * width:
                x = 0.5 * (lo + hi)
            width = hi - lo
        if not lo < x < hi:
            x = 0.5 * (lo + hi)
        fx = f(x)
        if fx > 0:
            lo, flo = x, fx
            if kept == -1:
                fhi *= 0.5
            kept = -1
        else:
            hi, fhi = x, fx
            if kept == 1:
                flo *= 0.5
            kept = 1
    return hi


#: replace_epsilon's first guess: the corners of the pieces this far (radians) from pi/4, where the
#: largest corner lies (the corner's excess over the arc, linear in a piece's width, against the
#: profile's fall away from pi/4, quadratic). Only the speed depends on it.
GUESS_BAND = (0.006, 0.025)


def _cover_exceeding(r: float, value, threshold: float) -> list[int]:
    """The pieces j whose corner (r cos phi_j, r sin phi_j+1) has ``value`` above ``threshold``, by
    branch and bound: a group of pieces whose corner is at or below it has no such piece
    (``value`` grows with a and with b, Lemma 4)."""
    phi = cover_angles()
    out, stack = [], [(0, len(phi) - 1)]
    while stack:
        i, k = stack.pop()
        if value(r * math.cos(phi[i]), r * math.sin(phi[k])) <= threshold:
            continue
        if k - i == 1:
            out.append(i)
            continue
        mid = (i + k) // 2
        stack.append((i, mid))
        stack.append((mid, k))
    return out


@lru_cache(maxsize=1024)
def replace_epsilon(r: float, delta: float) -> float:
    """The smallest epsilon at which :func:`replace_delta` <= delta: the largest of the cover's
    corners' epsilons (each corner's profile falls with epsilon).

    Found with few root searches: the largest epsilon of the corners in GUESS_BAND is a guess g;
    every corner with delta(g) <= delta has its epsilon <= g, and the corners above (found by
    branch and bound, one profile evaluation per group) get their own. The result is the maximum
    over all corners (to the root search's 1e-12)."""
    if r <= 0:
        return 0.0
    if not math.isfinite(r):
        return math.inf
    phi = cover_angles()
    quarter = math.pi / 4.0
    corner = lambda j: (r * math.cos(phi[j]), r * math.sin(phi[j + 1]))  # noqa: E731
    band = [j for j in range(len(phi) - 1) if GUESS_BAND[0] <= quarter - phi[j] <= GUESS_BAND[1]]
    guess = max(pair_epsilon(*corner(j), delta) for j in band or [len(phi) - 2])
    if not math.isfinite(guess):
        return math.inf
    above = _cover_exceeding(r, lambda a, b: pair_delta(a, b, guess), delta)
    return float(max([guess] + [pair_epsilon(*corner(j), delta) for j in above]))


@lru_cache(maxsize=1024)
def replace_radius(epsilon: float, delta: float) -> float:
    """The largest r (to 1e-7, rounded down, less CALIBRATION_MARGIN) with replace_delta(r,
    epsilon) <= delta: a replace-one study needs sigma^2 max(1, lambda) + tau^2 >= B^2 / r^2."""
    if not (epsilon > 0 and math.isfinite(epsilon)) or not 0 < delta < 1:
        raise ValueError("need epsilon > 0 finite and 0 < delta < 1")

    def ok(r: float, full: bool) -> bool:
        if full:
            return replace_ok(r, epsilon, delta)
        return pair_delta(*orthogonal(r), epsilon) <= delta

    # the orthogonal pair alone first (cheap, and an upper end: the cover bound is larger), then
    # the whole cover just below it
    lo, hi = 1e-3, 1e-3
    while ok(hi, False):
        lo, hi = hi, hi * 2.0
        if hi >= MAX_RADIUS:  # no larger radius is evaluated (MAX_RADIUS)
            hi = MAX_RADIUS
            if ok(hi, False):
                lo = hi
            break
    while not ok(lo, False):
        lo /= 2.0
    while hi / lo > 1.0 + 1e-7:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid, False) else (lo, mid)
    hi = lo
    lo = hi * 0.99
    while not ok(lo, True):
        lo *= 0.99
    while hi / lo > 1.0 + 1e-7:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid, True) else (lo, mid)
    return lo / (1.0 + CALIBRATION_MARGIN)


def replace_radius_of(row_bound: float, sigma: float, server_sigma: float, honest_lambda: float) -> float:
    """r = B / sqrt(sigma^2 max(1, lambda) + tau^2) (inf without noise)."""
    var = float(sigma) ** 2 * max(1.0, float(honest_lambda)) + float(server_sigma) ** 2
    return math.inf if var <= 0 else float(row_bound) / math.sqrt(var)


def replace_pld(r: float, grid: float = 1e-3):
    """A dp-accounting PrivacyLossDistribution that dominates Mix(u) against Mix(v) for every pair
    with norms <= r, under composition.

    The least upper bound of the cover's corners in the Blackwell order is the binary symmetric
    experiment whose stop-loss is the largest of theirs. It is evaluated at Delta = tanh(k g / 2)
    for a set of integers k (rounded down), joined by chords (above it: it is convex), which is
    the stop-loss of a law on those points; an atom Delta has losses +-2 artanh(Delta) <= +-k g
    with probabilities (1 +- Delta)/2 under P (the same under Q, by symmetry)."""
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as pld

    ks = _loss_points(grid)
    z = np.nextafter(np.tanh(ks * grid / 2.0), 0.0)
    z[0] = 0.0
    values = _cover_sup(r, lambda a, b: pair_stop_loss(a, b, z, PLD_CELL), slack=PLD_SLACK)
    # trailing points with nothing left: the rest counts as infinite loss
    nonzero = np.nonzero(values > 0)[0]
    last = int(nonzero[-1]) + 1 if len(nonzero) else 1
    last = min(last, len(z) - 1)
    ks, z, values = ks[: last + 1], z[: last + 1], values[: last + 1]
    # convex and non-increasing (raise points where rounding broke it), ending in the slope to 1
    for j in range(len(z) - 2, -1, -1):
        nxt = values[j + 1] + (values[j + 1] - (values[j + 2] if j + 2 < len(z) else 0.0)) * (
            (z[j + 1] - z[j]) / ((z[j + 2] if j + 2 < len(z) else 1.0) - z[j + 1]))
        values[j] = max(values[j], nxt, values[j + 1])
    knots = np.append(z, 1.0)
    pis = np.append(values, 0.0)
    slopes = np.diff(pis) / np.diff(knots)  # in [-1, 0], non-decreasing
    mass = np.diff(np.concatenate([[-1.0], slopes]))  # mass at each knot but 1: jumps of the slope
    mass[0] = max(mass[0], 0.0)
    infinity = max(-float(slopes[-1]), 0.0)  # mass at Delta = 1
    size = int(ks[-1])
    probs = np.zeros(2 * size + 1)
    np.add.at(probs, size + ks, mass * (1.0 + z) / 2.0)
    np.add.at(probs, size - ks, mass * (1.0 - z) / 2.0)
    pmf = pld_pmf.DensePLDPmf(grid, -size, probs, infinity, pessimistic_estimate=True)
    return pld.PrivacyLossDistribution(pmf, pmf)


def _loss_points(grid: float) -> np.ndarray:
    """Integers k: steps of about 0.005 in loss up to 0.5, then steps growing by about 2 % (a
    chord over a short step costs little), up to loss 25 (tanh(12.5) = 1 - 3e-11: beyond it
    counts as infinite)."""
    step = max(1, int(round(0.005 / grid)))
    first = np.arange(0, int(math.ceil(0.5 / grid)) + 1, step)
    rest = np.unique(np.ceil(np.geomspace(first[-1], 25.0 / grid, 200)).astype(np.int64))
    return np.unique(np.concatenate([first, rest])).astype(np.int64)


# --- add/remove -------------------------------------------------------------------------------


def presence_pair(row_bound: float, sigma: float, server_sigma: float, honest_lambda: float):
    """(shift M, ratio R) of the add/remove pair (as accounting._presence_pair), or (None, None)."""
    var = float(sigma) ** 2 * max(0.0, float(honest_lambda) - 1.0) + float(server_sigma) ** 2
    if var <= 0:
        return None, None
    return float(row_bound) / math.sqrt(var), 1.0 + float(sigma) ** 2 / var


def _mixture_loss(shift: float, ratio: float, upper: bool) -> LossLaw:
    """(lo, hi, masses) of L(y) = ln[(N(M, R) + N(-M, R))/2 / N(0, 1)](y) under the mixture
    (``upper``: the remove direction) or of -L(y) under N(0, 1) (add). L = c + A y^2 +
    ln cosh(M y / R), c = -ln(R)/2 - M^2/2R, A = (1 - 1/R)/2, increases with |y|, so each loss
    bin is a pair of |y| intervals; their ends come from a bisection that keeps every |y| in a
    bin at or below the bin's top loss (pessimistic)."""

    m, r = float(shift), float(ratio)
    c, quad, slope = -0.5 * math.log(r) - m * m / (2.0 * r), 0.5 * (1.0 - 1.0 / r), m / r
    sd = math.sqrt(r)

    def loss(s):
        v = np.abs(slope * s)
        return c + quad * s * s + v + np.log1p(np.exp(-2.0 * v)) - math.log(2.0)

    zcut = 9.5
    s_max = (m + zcut * sd) if upper else zcut
    top = float(loss(np.array(s_max)))
    lo, hi = (c, top) if upper else (-top, -c)

    def invert(x: np.ndarray, low: bool) -> np.ndarray:
        """|y| with loss(|y|) ~ x: the end of a bisection bracket [s-, s+] with loss(s-) <= x
        <= loss(s+) (``low``: s-), clipped to [0, s_max]."""
        a = np.zeros_like(x)
        b = np.full_like(x, 2.0 * s_max + 1.0)
        for _ in range(80):
            mid = 0.5 * (a + b)
            below = loss(mid) <= x
            a = np.where(below, mid, a)
            b = np.where(below, b, mid)
        return a if low else b

    def survival(s: np.ndarray) -> np.ndarray:
        if upper:  # |y|, y ~ (N(M, R) + N(-M, R))/2: the same as |M + sqrt(R) Z|
            return ndtr((m - s) / sd) + ndtr((-m - s) / sd)
        return 2.0 * ndtr(-s)

    def masses(edges: np.ndarray) -> np.ndarray:
        if upper:  # loss <= x  <=>  |y| <= s(x); keep the ends low so mass moves up
            s = invert(edges, low=True)
            surv = survival(s)
            return np.maximum(surv[:-1] - surv[1:], 0.0)
        # -loss <= x  <=>  loss >= -x  <=>  |y| >= s(-x); keep the ends high so mass moves up
        s = invert(-edges, low=False)
        surv = survival(s)
        return np.maximum(surv[1:] - surv[:-1], 0.0)

    return lo, hi, masses


def _presence_pmfs(shift: float, ratio: float, width: int, grid: float):
    from . import accounting

    pmfs = []
    for upper in (True, False):
        one = _mixture_loss(shift, ratio, upper)
        rest = accounting._variance_loss(ratio, width, upper) if ratio > 1.0 and width >= 1 else None
        g = max(grid, accounting._parts_span(one, rest) / accounting.MAX_GRID_POINTS)
        pmfs.append((one, rest, g))
    g = max(p[2] for p in pmfs)
    out = []
    for one, rest, _ in pmfs:
        pmf = accounting._discretise(*one, g)
        out.append(pmf.compose(accounting._discretise(*rest, g)) if rest else pmf)
    return out, g


def presence_pld(shift: float, ratio: float, width: int, grid: float = 1e-3):
    """The pessimistic PLD of the add/remove pair with the secret sign: Mix(shift e_1) with
    variance ratio ``ratio`` on width + 1 columns against N(0, I) (the extra column covers every
    ||x|| < B: a shorter x is a marginal of a padded one)."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    (remove, add), _ = _presence_pmfs(shift, ratio, int(width), grid)
    return pld.PrivacyLossDistribution(remove, add)


@lru_cache(maxsize=1024)
def presence_epsilon(shift: float, ratio: float, width: int, delta: float, grid: float = 1e-3) -> float:
    return float(presence_pld(shift, ratio, width, grid).get_epsilon_for_delta(delta))


# --- one honest report ---------------------------------------------------------------------------


def report_epsilon(neighbouring: str, row_bound: float, sigma: float, server_sigma: float,
                   honest_lambda: float, width: int, delta: float, grid: float = 1e-3) -> float:
    """epsilon at delta of one honest report of a secret-sign sketch study (the secret-sign
    counterpart of accounting.report_epsilon)."""
    if neighbouring == "replace-one":
        r = replace_radius_of(row_bound, sigma, server_sigma, honest_lambda)
        if r > MAX_RADIUS:
            return math.inf  # not evaluated: accounting.report_epsilon takes the plain Gaussian's
        return replace_epsilon(r, delta)
    if neighbouring != "add-remove":
        raise ValueError(f"unknown neighbouring notion {neighbouring!r}")
    shift, ratio = presence_pair(row_bound, sigma, server_sigma, honest_lambda)
    if shift is None:
        return math.inf
    return presence_epsilon(shift, ratio, int(width), delta, grid)


def study_pld(neighbouring: str, row_bound: float, sigma: float, server_sigma: float,
              honest_lambda: float, width: int, notion: str | None = None, grid: float = 1e-3):
    """The secret-sign counterpart of accounting.study_pld (None: unbounded under ``notion``)."""
    notion = notion or neighbouring
    if notion == "replace-one":
        r = replace_radius_of(row_bound, sigma, server_sigma, honest_lambda)
        return None if not math.isfinite(r) else replace_pld(r, grid)
    if notion != "add-remove":
        raise ValueError(f"unknown neighbouring notion {notion!r}")
    if neighbouring != "add-remove":
        return None
    shift, ratio = presence_pair(row_bound, sigma, server_sigma, honest_lambda)
    return None if shift is None else presence_pld(shift, ratio, int(width), grid)


def pld_grid(neighbouring: str, row_bound: float, sigma: float, server_sigma: float,
             honest_lambda: float, width: int, notion: str | None = None, grid: float = 1e-3) -> float:
    """The loss grid :func:`study_pld` uses with ``grid`` (coarser for a very wide add/remove law)."""
    notion = notion or neighbouring
    if notion != "add-remove" or neighbouring != "add-remove":
        return grid
    shift, ratio = presence_pair(row_bound, sigma, server_sigma, honest_lambda)
    if shift is None:
        return grid
    return _presence_pmfs(shift, ratio, int(width), grid)[1]


def variance_needed(row_bound: float, epsilon: float, delta: float) -> float:
    """B^2 / r^2: the sigma^2 max(1, lambda) + tau^2 a replace-one secret-sign study needs (the
    counterpart of (Delta / mu_star)^2 without the sign)."""
    return (float(row_bound) / replace_radius(float(epsilon), float(delta))) ** 2
