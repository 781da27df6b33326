"""Robust regression (a smoothed least absolute deviations) from a few rounds of gram or moments
studies: iteratively reweighted least squares with Huber weights, every round an ordinary study.

Why not one release. A gram or moments release holds second moments, and every quadratic
surrogate of a loss has the least-squares minimiser: from second moments alone no estimator is
more robust than least squares (docs/logistic.md makes the same point for the logistic loss). The
l1 sketch (paper 003, Algorithm 2) keeps the l1 objective only in buckets that hold few rows; the
release certificate asks every report to share its buckets with about lambda_star others, and a
bucket's residual is then a sum of hundreds of residuals, close to Gaussian whatever the rows'
errors: its l1 objective measures an l2 quantity on k = 80 bucket sums (docs/lad.md, measured).

What works instead is the classical algorithm for M-estimators. Huber's loss with threshold c has
the weighted least-squares fixed point

    theta = argmin sum_i w_i (y_i - x_i theta)^2,   w_i = min(1, c / |y_i - x_i theta|),

and as c shrinks it approaches least absolute deviations (the conditional median). Each step is a
weighted least-squares fit, i.e. least squares on the second moments of the rows sqrt(w_i) a_i.
So round 1 is a gram or moments study of the rows (least squares: the starting point); after it
the analyst publishes the fit and a threshold c (:class:`RoundWeights`, post-processing of the
release), every data owner multiplies its mapped row by sqrt(w_i) (:func:`weighted_rows`; w_i <= 1,
so the row stays in the ball and the study's sensitivity is unchanged) and submits it to the next
round's study; the fit of that release is the next step. Two or three rounds converge (measured:
docs/lad.md).

Privacy. Every round is an ordinary study of its own, calibrated by ``design()``; the weights are
a public function of earlier releases, fixed before the round's rows are shared, so each round is
the study's Gaussian mechanism applied to a function of the row of norm at most B. The same people
take part in every round, so the rounds compose: :func:`round_budget` splits a target (epsilon,
delta) and the floor between R rounds in Gaussian DP (mu^2 = sum of the rounds' mu_r^2, exact for
Gaussian mechanisms), and a population ledger (docs/ledger.md) charges each round's study and
composes them by their privacy loss distributions.

Rows and units. A weighted round's rows are the data owner's mapped rows, weighted: a study of
such rows has no bounds (the SDK would map raw values, and a mapped row's constant coordinate
cannot be weighted from raw values), and names its columns ``[*columns, "_1"]``, ``_1`` holding
the constant coordinate map_scale * sqrt(w_i) (:data:`ROUND_CONSTANT`). The bounds and map scale
travel in :class:`RoundWeights`, so every answer comes back in the data's units with an
intercept, as :mod:`analyzer.moments` does for a study with bounds. Round 1 may be an ordinary
study with bounds (the SDK maps the rows) or, like the later rounds, a study of owner-mapped rows
(``RoundWeights.unweighted``). Rows that an owner scaled into the ball itself (no bounds) work the
same way with ``bounds=None``: a column ``_1`` holding the constant ``map_scale``, and units that
are the rows divided by it.

Everything here is post-processing of releases and public parameters, except
:func:`weighted_rows`, which each data owner runs on its own rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from dpsketch.protocol import privacy
from dpsketch.protocol.bounds import CONSTANT, ColumnMap
from dpsketch.protocol.study import DEFAULT_EPSILON_FLOOR

from .. import uncertainty
from ..estimators import robust_solve, to_units, units_jacobian
from ..moments import StandardMoments, standard_moments
from ..release import noise_scale_of

#: The column of a weighted round's study that holds the constant coordinate (weighted like the rest).
ROUND_CONSTANT = "_1"
#: Rounds by default: least squares, then two Huber steps (measured best on docs/lad.md's data).
DEFAULT_ROUNDS = 3
#: The share of the privacy budget (of mu^2 in Gaussian DP) each round gets, by number of rounds:
#: the least-squares start needs less than the steps that refine it.
DEFAULT_SHARES = {1: (1.0,), 2: (0.2, 0.8), 3: (0.15, 0.35, 0.5), 4: (0.1, 0.3, 0.3, 0.3)}
#: c = DEFAULT_TUNING x the weighted residual rms of the round (a Huber threshold of about one
#: residual sd: robust to gross errors, close to least absolute deviations under heavy tails).
DEFAULT_TUNING = 1.0


# ---------------------------------------------------------------------------------------------
# the budget


def _epsilon_at_mu(mu: float, delta: float) -> float:
    """The epsilon at which a mu-GDP mechanism is (epsilon, delta)-DP (``privacy.unit_sigma`` is
    1 / mu at (epsilon, delta); it falls as epsilon grows)."""
    from scipy.optimize import brentq

    target = 1.0 / mu
    lo, hi = 1e-6, 1.0
    while privacy.unit_sigma(hi, delta) > target:
        lo, hi = hi, hi * 2.0
        if hi > 1e4:
            raise ValueError(f"no epsilon reaches mu = {mu:g} at delta = {delta:g}")
    return float(brentq(lambda e: privacy.unit_sigma(e, delta) - target, lo, hi, xtol=1e-12, rtol=1e-12))


def round_budget(epsilon: float, delta: float, rounds: int = DEFAULT_ROUNDS,
                 epsilon_floor: float | None = DEFAULT_EPSILON_FLOOR,
                 shares: Sequence[float] | None = None) -> list[tuple[float, float | None]]:
    """(epsilon_r, epsilon_floor_r) for each of ``rounds`` studies of the same people, so that
    together they are (epsilon, delta)-DP with the floor epsilon_floor: in Gaussian DP a study
    calibrated to (epsilon_r, delta) is mu_r-GDP and R of them compose to sqrt(sum mu_r^2), so
    round r gets mu_r = mu sqrt(share_r) (shares summing to 1; ``DEFAULT_SHARES``), and the floor
    likewise. Give these to ``design(epsilon=..., epsilon_floor=...)`` for each round."""
    if rounds < 1:
        raise ValueError("need at least one round")
    shares = list(shares if shares is not None else DEFAULT_SHARES.get(rounds, [1.0 / rounds] * rounds))
    if len(shares) != rounds or min(shares) <= 0 or not math.isclose(sum(shares), 1.0, rel_tol=1e-9):
        raise ValueError(f"need {rounds} positive shares summing to 1, got {shares}")
    mu = 1.0 / privacy.unit_sigma(epsilon, delta)
    mu_f = None if epsilon_floor is None else 1.0 / privacy.unit_sigma(max(epsilon_floor, epsilon), delta)
    return [(_epsilon_at_mu(mu * math.sqrt(f), delta),
             None if mu_f is None else _epsilon_at_mu(mu_f * math.sqrt(f), delta)) for f in shares]


# ---------------------------------------------------------------------------------------------
# the weights a round publishes, and what a data owner does with them


@dataclass(frozen=True)
class RoundWeights:
    """What the next round's data owners need (public: a function of the released fits).

    ``coef`` (over ``features``) and ``intercept`` are the current fit in the data's units, ``scale``
    the Huber threshold c in the label's units (inf, null in JSON: no weighting), ``bounds`` the columns'
    [lower, upper] (the study's order: the features and the label as in ``columns``) or None for
    rows an owner scaled itself, ``map_scale`` the value of the mapped row's constant coordinate
    (``ColumnMap.scale``; for self-scaled rows, the constant the owner put in its ``_1`` column),
    ``round`` the round these weights are for (2 for the weights round 1 publishes)."""

    label: str
    columns: tuple[str, ...]
    coef: tuple[float, ...]
    intercept: float
    scale: float
    bounds: tuple[tuple[float, float], ...] | None
    map_scale: float
    round: int = 2

    def __post_init__(self) -> None:
        if self.label not in self.columns:
            raise ValueError(f"label {self.label!r} is not one of the columns {list(self.columns)}")
        if len(self.coef) != len(self.columns) - 1:
            raise ValueError(f"coef must have one entry per feature ({len(self.columns) - 1}), got {len(self.coef)}")
        if not (self.scale > 0) or not (self.map_scale > 0 and math.isfinite(self.map_scale)):
            raise ValueError("scale and map_scale must be positive")
        if not all(math.isfinite(v) for v in (*self.coef, self.intercept)):
            raise ValueError("coef and intercept must be finite")
        if self.bounds is not None and len(self.bounds) != len(self.columns):
            raise ValueError(f"bounds must have one [lower, upper] per column ({len(self.columns)})")

    @property
    def features(self) -> list[str]:
        return [c for c in self.columns if c != self.label]

    @classmethod
    def unweighted(cls, label: str, columns: Sequence[str], bounds: Sequence[Sequence[float]] | None,
                   map_scale: float) -> "RoundWeights":
        """The first round of owner-mapped rows: every weight 1."""
        return cls(label=label, columns=tuple(columns), coef=(0.0,) * (len(columns) - 1), intercept=0.0,
                   scale=math.inf, bounds=None if bounds is None else tuple(tuple(map(float, b)) for b in bounds),
                   map_scale=float(map_scale), round=1)

    @classmethod
    def from_dict(cls, data: Mapping) -> "RoundWeights":
        """From the JSON form (:meth:`to_dict`; what the REST route answers as ``next_weights``)."""
        try:
            bounds = data.get("bounds")
            return cls(label=str(data["label"]), columns=tuple(str(c) for c in data["columns"]),
                       coef=tuple(float(v) for v in data["coef"]), intercept=float(data["intercept"]),
                       scale=math.inf if data.get("scale") is None else float(data["scale"]),
                       bounds=None if bounds is None else tuple((float(lo), float(hi)) for lo, hi in bounds),
                       map_scale=float(data["map_scale"]), round=int(data.get("round", 2)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a round's weights: {exc}") from None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["columns"], out["coef"] = list(self.columns), list(self.coef)
        out["bounds"] = None if self.bounds is None else [list(b) for b in self.bounds]
        out["scale"] = None if math.isinf(self.scale) else self.scale  # JSON has no infinity: null, unweighted
        return out

    @property
    def round_columns(self) -> list[str]:
        """The columns of the round's study: the data's, then the constant ``_1``."""
        return [*self.columns, ROUND_CONSTANT]


def huber_weights(residuals: np.ndarray, scale: float) -> np.ndarray:
    """w = min(1, c / |r|): 1 inside the threshold, c / |r| beyond (Huber's psi(r) / r)."""
    r = np.abs(np.asarray(residuals, dtype=np.float64))
    if math.isinf(scale):
        return np.ones_like(r)
    return np.minimum(1.0, float(scale) / np.maximum(r, np.finfo(float).tiny))


def weighted_rows(rows: np.ndarray, weights: RoundWeights) -> np.ndarray:
    """A data owner's rows for the next round: (m, d + 1) over ``weights.round_columns``.

    ``rows``: (m, d) in the columns' order, in the data's units (with ``bounds``) or, for rows the
    owner scaled itself (``bounds`` None), the scaled values without their constant. Each row is
    clamped and mapped into the ball with its constant coordinate (``ColumnMap``, as the SDK maps
    a study with bounds), its residual under the published fit is computed from the clamped
    values, and the mapped row is multiplied by sqrt(min(1, c / |residual|)). Its norm only
    shrinks, so the round's sensitivity is the study's."""
    a = np.atleast_2d(np.asarray(rows, dtype=np.float64))
    d = len(weights.columns)
    if a.shape[1] != d:
        raise ValueError(f"expected rows of {d} values ({list(weights.columns)}), got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("rows must be finite numbers")
    if weights.bounds is not None:
        b = np.asarray(weights.bounds, dtype=np.float64)
        cmap = ColumnMap(lo=b[:, 0].copy(), hi=b[:, 1].copy(), constant=True, scale=weights.map_scale)
        units = np.minimum(np.maximum(a, cmap.lo), cmap.hi)
        mapped = cmap.to_ball(a)
    else:
        units = a / weights.map_scale
        mapped = np.concatenate([a, np.full((len(a), 1), weights.map_scale)], axis=1)
    li = list(weights.columns).index(weights.label)
    fi = [i for i in range(d) if i != li]
    resid = units[:, li] - weights.intercept - units[:, fi] @ np.asarray(weights.coef)
    return mapped * np.sqrt(huber_weights(resid, weights.scale))[:, None]


# ---------------------------------------------------------------------------------------------
# the fit of one round


@dataclass(frozen=True)
class RoundRows:
    """How a round's release relates to the standardized space: every mapped value is
    ``z_scale`` * z, the constant column (named ``constant``) holds ``kappa`` * sqrt(w); owners of the
    next round map with ``bounds`` and ``map_scale``."""

    bounds: tuple | None
    map_scale: float
    constant: str
    z_scale: float
    kappa: float


def round_moments(release, weighted_by: RoundWeights | None, debias: bool = True) -> tuple[StandardMoments, RoundRows]:
    """The weighted second moments of a round's release in the standardized space (``sums`` the
    weighted column sums, ``n`` the sum of the weights W) and how its rows were made. Two forms: a
    gram or moments study with bounds (round 1 through the SDK; ``weighted_by`` must be None or
    unweighted) or a study without bounds whose columns end in ``_1`` (owner-mapped rows, weighted
    by ``weighted_by``)."""
    study = getattr(release, "study", None)
    if study is not None and study.bounds is not None:
        if weighted_by is not None and not math.isinf(weighted_by.scale):
            raise ValueError("a study with bounds has its rows mapped by the SDK, which cannot weight them: "
                             "a weighted round is a study without bounds over the mapped columns and _1 "
                             "(docs/lad.md)")
        m = standard_moments(release, debias)
        if not m.has_first_moments:
            raise ValueError("this release carries no column sums (no constant): use a gram or moments study "
                             "with bounds")
        z_scale = study.column_map.scale
        owners = study.clip_bound / math.sqrt(study.d + 1)  # the owners' map: the constant is one more column
        bounds = tuple(tuple(map(float, b)) for b in study.bounds)
        return m, RoundRows(bounds, owners, CONSTANT, z_scale, z_scale if study.has_constant else 1.0)
    cols = list(release.columns)
    if ROUND_CONSTANT not in cols:
        raise ValueError(f"robust regression needs the constant: a gram or moments study with bounds, or rows "
                         f"mapped by weighted_rows with the column {ROUND_CONSTANT!r} (docs/lad.md)")
    if weighted_by is None:
        raise ValueError("a study of owner-mapped rows needs the weights they were mapped with (weighted_by; "
                         "RoundWeights.unweighted for the first round)")
    names = [c for c in cols if c != ROUND_CONSTANT]
    if names != list(weighted_by.columns):
        raise ValueError(f"the release's columns {names} are not the weights' {list(weighted_by.columns)}")
    g = np.asarray(release.gram(debias), dtype=np.float64)
    ci = cols.index(ROUND_CONSTANT)
    idx = [cols.index(c) for c in names]
    s2 = weighted_by.map_scale ** 2
    total = float(g[ci, ci]) / s2
    if not total > 0:
        raise ValueError("the release's weights sum to nothing (its constant's energy is not positive)")
    if weighted_by.bounds is None:
        mid, half = np.zeros(len(names)), np.ones(len(names))
    else:
        b = np.asarray(weighted_by.bounds, dtype=np.float64)
        mid, half = b[:, 0] / 2.0 + b[:, 1] / 2.0, b[:, 1] / 2.0 - b[:, 0] / 2.0
    m = StandardMoments(columns=names, gram=g[np.ix_(idx, idx)] / s2, sums=g[idx, ci] / s2, n=total,
                        mid=mid, half=half, noise_scale=noise_scale_of(release) / s2,
                        cross_noise_scale=float(getattr(release, "cross_noise_scale", 0.0) or 0.0) / s2,
                        in_units=weighted_by.bounds is not None)
    ms = weighted_by.map_scale
    return m, RoundRows(weighted_by.bounds, ms, ROUND_CONSTANT, ms, ms)


class RobustRegression:
    """One round of Huber iteratively reweighted least squares on a gram or moments release
    (module docstring): weighted least squares of ``label`` on the other columns with an
    intercept, in the data's units, and the weights of the next round.

    Parameters
    ----------
    label: the label column.
    weighted_by: the :class:`RoundWeights` (or their dict) the release's rows were weighted with;
        None for a study with bounds (round 1 through the SDK).
    tuning: the next round's threshold c = tuning x the weighted residual rms of this fit
        (DEFAULT_TUNING; smaller is closer to least absolute deviations, larger to least squares).
    debias: subtract the release's known noise energy first (recommended).

    Attributes
    ----------
    coef_, intercept_: the fit in the data's units (the rows' own scale without bounds).
    feature_names_: the features, in order.
    scale_: the weighted residual rms in the label's units.
    next_weights_: :class:`RoundWeights` for the next round (threshold ``tuning * scale_``).
    round_: which round this release was (1 + the weights' round, or 1).
    noise_cov_: covariance of (coef_, intercept_) over this release's noise, the weights held fixed
        (the delta method on the weighted moments: ``uncertainty.linear_fit_covariance``).
    in_units_: whether the answer is in the data's units (bounds known).
    """

    def __init__(self, label: str, weighted_by: RoundWeights | Mapping | None = None,
                 tuning: float = DEFAULT_TUNING, debias: bool = True):
        self.label = label
        self.weighted_by = weighted_by
        self.tuning = tuning
        self.debias = debias

    def fit(self, release) -> "RobustRegression":
        if not self.tuning > 0:
            raise ValueError("tuning must be positive")
        wb = self.weighted_by
        if wb is not None and not isinstance(wb, RoundWeights):
            wb = RoundWeights.from_dict(wb)
        m, rows = round_moments(release, wb, self.debias)
        if self.label not in m.columns:
            raise KeyError(f"label {self.label!r} is not in the release (columns: {m.columns})")
        if wb is not None and wb.label != self.label:
            raise ValueError(f"the weights were computed for the label {wb.label!r}, not {self.label!r}")
        features = [c for c in m.columns if c != self.label]
        if not features:
            raise ValueError("need at least one feature column")
        fi, li = m.index(features), m.index([self.label])[0]
        centred = m.gram - np.outer(m.sums, m.sums) / float(m.n)
        theta, floored = robust_solve(centred[np.ix_(fi, fi)], centred[fi, li], m.noise_scale)
        theta0 = float((m.sums[li] - theta @ m.sums[fi]) / m.n)
        q = np.zeros(len(m.columns))
        q[fi], q[li] = -theta, 1.0
        energy = float(q @ centred @ q)
        floor = max(m.noise_scale, 0.0) * float(q @ q)  # a debiased energy below the noise is not resolved
        rms_z = math.sqrt(max(energy, floor, np.finfo(float).tiny) / float(m.n))
        self.coef_, self.intercept_ = to_units(theta, theta0, m.mid, m.half, fi, li, True)
        self.scale_ = float(m.half[li] * rms_z)
        self.feature_names_ = features
        self.n_floored_ = floored
        self.in_units_ = m.in_units
        self.round_ = 1 if wb is None else wb.round
        self.n_reports_ = int(release.n_reports)
        self.next_weights_ = RoundWeights(
            label=self.label, columns=tuple(m.columns), coef=tuple(float(v) for v in self.coef_),
            intercept=float(self.intercept_), scale=self.tuning * self.scale_,
            bounds=rows.bounds, map_scale=float(rows.map_scale), round=self.round_ + 1)
        self.noise_cov_ = self._noise_cov(release, m, rows, features, theta, theta0, fi, li)
        return self

    def _noise_cov(self, release, m: StandardMoments, rows: RoundRows, features, theta, theta0, fi, li) -> np.ndarray:
        """Over the release's noise, with the weights fixed: in the release's own columns every
        mapped value is z_scale z and the constant kappa sqrt(w), so the fit is the linear fit
        a_y = phi a_const + sum_c theta_c a_c with phi = z_scale theta_0 / kappa
        (``uncertainty.linear_fit_covariance``); then phi -> theta_0 and the map to units."""
        p = len(features) + 1
        names = [*features, self.label, rows.constant]
        try:
            m_law, law = uncertainty.moment_law(release, names)
        except (TypeError, KeyError, ValueError):
            return np.full((p, p), np.nan)
        x_idx = [i for i in range(len(names)) if i != len(features)]
        phi = rows.z_scale * theta0 / rows.kappa
        cov = uncertainty.linear_fit_covariance(m_law, law, x_idx, len(features), np.append(theta, phi))
        back = np.ones(p)
        back[-1] = rows.kappa / rows.z_scale
        jac = units_jacobian(m, fi, li, True) * back
        return jac @ cov @ jac.T

    def stderr(self) -> np.ndarray:
        """Standard errors of (coef_, intercept_) over this release's noise, the weights fixed."""
        return uncertainty.standard_errors(self.noise_cov_)

    def conf_int(self, level: float = 0.95) -> np.ndarray:
        """(p + 1, 2) intervals for coef_ and intercept_ (last), over this release's noise with the
        weights fixed: how far the private step may lie from the same step computed without noise."""
        _, low, high = uncertainty.intervals(np.append(self.coef_, self.intercept_), self.noise_cov_, level)
        return np.column_stack([low, high])

    def predict(self, X) -> np.ndarray:
        return np.asarray(X, dtype=np.float64) @ self.coef_ + self.intercept_
