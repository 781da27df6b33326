"""Least absolute deviations (median regression) on a weighted l1-sketch release.

The l1 sketch (:mod:`dpsketch.protocol.l1sketch`, paper 003 Algorithm 2 after Munteanu et al.
2023) releases Y = S(A + G) (+ servers' noise), a (k, d) matrix whose rows are bucket sums of the
reports' noisy rows [x, y], together with public row weights w (1/s at level 0, 1/p_h at level h).
:class:`LADRegression` minimises

    sum_r w_r | Y[r, label] - Y[r, features] . beta |  (+ alpha ||beta||_1)

which estimates the full-data l1 objective sum_i |y_i - x_i . beta|. Everything here is
post-processing of the release plus its public parameters (weights, the noise law sigma, the
bucket counts that the public map and the inclusion set determine), so the fit is as private as
the release.

The linear program
------------------
The weighted l1 problem is solved through its dual, with scipy's HiGHS (``linprog``):

    max_mu  y^T mu   s.t.  X^T mu = 0 (|X^T mu| <= alpha with an l1 penalty),  -w <= mu <= w,

n box-bounded variables and only p rows, much smaller than the primal's 2n + p variables and n
equalities (measured: the dual is about 10x faster than the primal at n = 10^5, p = 6). beta is
minus the equality (inequality) constraints' marginals; the primal objective is checked against
the dual's (strong duality) before the fit is accepted. :func:`lad_full` solves the same LP on the
full data for baselines; above ``GLOB_MIN_ROWS`` rows it uses the exact preprocessing of Portnoy
and Koenker (1997, "The Gaussian hare and the Laplacian tortoise"): fit on a subsample, glob the
rows whose residual sign is then certain into two pseudo-rows, solve the small LP, and re-solve
with any row whose sign came out wrong (so the result is the full LP's optimum, not an
approximation; 10^6 rows take a few seconds instead of minutes).

The privacy noise
-----------------
The noise enters both sides: bucket r carries N(0, tau_r^2) per column with
tau_r^2 = c_r sigma^2 + server_sigma^2 (c_r = reports in the bucket). In the features it is an
errors-in-variables problem, which shrinks the fitted beta towards 0 (paper 003 eq. (24) reads the
same effect as an implicit regulariser ||eta beta||_1). ``noise_correction="calibrate"`` undoes the
shrinkage by *regression calibration*: when the bucket sums are close to Gaussian (a bucket sums
many reports), the median regression of the label on the noisy features has slope
K beta with K = (Z^T V Z)^{-1} (Z^T V Z - N), Z the noisy feature rows, N = sum_r v_r tau_r^2 I the
known noise energy and v_r = w_r / sqrt(max(c_r, 1)) the rows' effective weights in the LAD's
first-order condition (a bucket's residual scale grows like sqrt(c_r)); so beta = K^{-1}
beta_naive, solved with the eigenvalue floor of :func:`analyzer.estimators.robust_solve` at the
noise energy's typical fluctuation (a direction the release does not resolve is not inverted).
LAD is equivariant under invertible linear maps of the features, so this is the same as fitting
LAD on the calibrated features Z K. Measured (``research/lad_evaluation.py``, docs/lad.md): the
correction is erratic on the l1 sketch (it lowers the coefficient error in some cells and raises
it in others by more, since the bucket sums are few and not Gaussian enough for K to be right), so
it is **off by default** (``noise_correction="none"``) and kept as an option. An l1 penalty
``alpha`` (in units of the weighted objective) is available; the noise already shrinks beta the
way eq. (24) says, and adding a penalty on top only adds bias, so the default is 0.

Models are uncentered, like :mod:`analyzer.estimators`: put a constant column in the schema for
an intercept.

The REST route
--------------
``install`` adds the analyzer's route for least absolute deviations, a thin layer over
:class:`LADRegression` and ``analyzer.analyses.lad_rounds``.

``POST /v1/studies/{id}/analyses/lad`` on a released **gram or moments** study (the default way,
docs/lad.md) fits one round of the robust regression of :class:`~analyzer.analyses.lad_rounds.RobustRegression`
(Huber iteratively reweighted least squares, each round a study): the body's ``weights`` are the
round weights the study's rows were weighted with (absent for round 1), and the answer carries the
fit in units, its standard errors over the release's noise, and ``next_weights`` for the next round.
On a released **l1** study it fits :class:`LADRegression` on the weighted l1 sketch
(docs/protocol.md section 2c) as before. Any other kind of study, an unknown label and bad
parameters are 422 ``invalid-request``; a study that is not released is 409 ``study-open``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dpsketch.protocol.bounds import CONSTANT

from ..estimators import robust_solve
from ..release import GramSumRelease, L1Release, Release
from .lad_rounds import DEFAULT_TUNING, RobustRegression
from .routes import fitting, label_of, refuse, require_finite

if TYPE_CHECKING:
    from fastapi import FastAPI

#: Above this many rows :func:`lad_full` uses Portnoy-Koenker globbing (exact).
GLOB_MIN_ROWS = 60_000
#: Relative tolerance of the strong-duality check (primal vs dual objective).
DUALITY_RTOL = 1e-6
NOISE_CORRECTIONS = ("calibrate", "none")


# ---------------------------------------------------------------------------------------------
# the linear program


class _Infeasible(RuntimeError):
    """The dual LP is infeasible (the primal unbounded): only with a linear term (globbing)."""


def _lp(X: np.ndarray, y: np.ndarray, w: np.ndarray, alpha: float = 0.0,
        linear: np.ndarray | None = None) -> np.ndarray:
    """argmin_beta sum_i w_i |y_i - x_i beta| (+ alpha ||beta||_1, or + linear . beta) through the
    dual LP (HiGHS): max y^T mu s.t. X^T mu = linear (|X^T mu| <= alpha), -w <= mu <= w."""
    from scipy.optimize import linprog  # here: the analyzer starts without scipy.optimize

    n, p = X.shape
    bounds = np.column_stack([-w, w])
    method = "highs-ipm" if n > 20_000 else "highs"
    g = np.zeros(p) if linear is None else np.asarray(linear, dtype=np.float64)
    if alpha > 0:
        if linear is not None:
            raise ValueError("a penalty and a linear term together are not supported")
        res = linprog(-y, A_ub=np.vstack([X.T, -X.T]), b_ub=np.full(2 * p, float(alpha)), bounds=bounds,
                      method=method)
    else:
        res = linprog(-y, A_eq=X.T, b_eq=g, bounds=bounds, method=method)
    if res.status == 2:
        raise _Infeasible(res.message)
    if res.status != 0:
        raise RuntimeError(f"the LAD linear program failed: {res.message}")
    if alpha > 0:
        m = res.ineqlin.marginals
        beta = -(m[:p] - m[p:])
    else:
        beta = -np.asarray(res.eqlin.marginals, dtype=np.float64)
    primal = float(np.sum(w * np.abs(y - X @ beta)) + alpha * np.sum(np.abs(beta)) + g @ beta)
    dual = -float(res.fun)
    if abs(primal - dual) > DUALITY_RTOL * max(1.0, abs(dual)) * 10:
        raise RuntimeError(f"LAD dual solution did not give the optimum (primal {primal}, dual {dual})")
    return beta


def _weighted_rank_band(r: np.ndarray, w: np.ndarray, keep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Masks (low, mid, high) with about ``keep`` rows around the weighted median of r in mid."""
    order = np.argsort(r, kind="stable")
    cw = np.cumsum(w[order])
    centre = int(np.searchsorted(cw, 0.5 * cw[-1]))
    lo = max(0, centre - keep // 2)
    hi = min(len(r), centre + keep // 2)
    low = np.zeros(len(r), bool)
    mid = np.zeros(len(r), bool)
    low[order[:lo]] = True
    mid[order[lo:hi]] = True
    return low, mid, ~(low | mid)


def _lad_globbed(X: np.ndarray, y: np.ndarray, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Exact weighted LAD by Portnoy-Koenker preprocessing (see the module docstring)."""
    n, p = X.shape
    m = int(min(n, max(5_000, n ** (2.0 / 3.0) * math.sqrt(p))))
    sub = rng.choice(n, size=m, replace=False)
    anchor = _lp(X[sub], y[sub], w[sub] * (n / m))
    r_anchor = y - X @ anchor
    # the subsample's error moves residuals by about n sqrt(p / m) ranks: keep a band of that
    keep = int(min(n, 3.0 * n * math.sqrt(p / m)))
    while keep < n:
        low, mid, high = _weighted_rank_band(r_anchor, w, keep)
        while True:
            # rows whose residual sign is fixed contribute a linear term: +w x beta below the
            # fit, -w x beta above it (plus constants)
            linear = (w[low, None] * X[low]).sum(axis=0) - (w[high, None] * X[high]).sum(axis=0)
            try:
                beta = _lp(X[mid], y[mid], w[mid], linear=linear)
            except _Infeasible:
                break  # too few rows in the band to balance the globs: widen it
            r = y - X @ beta
            wrong = (low & (r > 0)) | (high & (r < 0))
            n_wrong = int(wrong.sum())
            if n_wrong == 0:
                return beta
            if n_wrong > 0.1 * keep:
                break  # the band was too narrow: widen it
            mid |= wrong
            low &= ~wrong
            high &= ~wrong
        keep *= 2
    return _lp(X, y, w)


def lad_full(X, y, weights=None, alpha: float = 0.0, seed: int = 0) -> np.ndarray:
    """Non-private LAD on full data: argmin_beta sum_i w_i |y_i - x_i beta| (+ alpha ||beta||_1).

    The same dual LP as :class:`LADRegression`; exact Portnoy-Koenker globbing above
    ``GLOB_MIN_ROWS`` rows (without a penalty). ``seed`` only picks the globbing's subsample
    (the optimum does not depend on it, up to ties).
    """
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if X.ndim != 2 or X.shape[0] != y.shape[0]:
        raise ValueError(f"X must be (n, p) and y (n,), got {X.shape} and {y.shape}")
    w = np.ones(len(y)) if weights is None else np.asarray(weights, dtype=np.float64)
    _check_finite(X, y, w)
    if len(y) > GLOB_MIN_ROWS and alpha == 0:
        return _lad_globbed(X, y, w, np.random.default_rng(seed))
    return _lp(X, y, w, alpha)


def l1_objective(X, y, beta) -> float:
    """sum_i |y_i - x_i beta| (the full-data objective the sketch estimates)."""
    return float(np.sum(np.abs(np.asarray(y) - np.asarray(X) @ np.asarray(beta))))


def _check_finite(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> None:
    if not (np.all(np.isfinite(X)) and np.all(np.isfinite(y))):
        raise ValueError("the release (or data) contains NaN or infinite values")
    if w.shape != y.shape:
        raise ValueError(f"need one weight per row: {len(y)} rows, weights of shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and non-negative")
    if not np.any(w > 0):
        raise ValueError("at least one weight must be positive")


# ---------------------------------------------------------------------------------------------
# the estimator


def expected_counts(spec, n_reports: int) -> np.ndarray:
    """Expected reports per row of an l1 sketch of ``n_reports``: n / level0_buckets at level 0,
    n p_h / buckets at level h (for when the exact counts diag(S S^T) are not at hand)."""
    lvl = spec.level_of_row()
    p = np.concatenate([[1.0], spec.level_probabilities()])
    per = np.where(lvl == 0, 1.0 / spec.level0_buckets, p[lvl] / spec.buckets)
    return n_reports * per


class LADRegression:
    """Weighted least absolute deviations of ``label`` on the other columns (or ``features``).

    Parameters
    ----------
    label: the label column, by name (with ``columns=`` in :meth:`fit`) or by index.
    features: feature columns (names or indices); default every column except the label.
    alpha: l1 penalty on the coefficients, in units of the weighted objective (default 0).
    noise_correction: ``"none"`` (default) or ``"calibrate"`` (regression calibration for the
        noise in the features, module docstring; needs the noise law in :meth:`fit`, otherwise
        nothing is corrected).

    Attributes
    ----------
    coef_: (p,) coefficients over ``feature_names_``.
    coef_uncorrected_: the plain weighted LAD solution before the noise correction.
    intercept_: 0.0 (models are uncentered; put a constant column in the schema).
    feature_names_: the features (names, or indices when fitted without column names).
    objective_: the weighted l1 objective of ``coef_uncorrected_`` on the release.
    noise_energy_: sum_r v_r tau_r^2, the known noise energy removed by the correction (0 if none).
    n_floored_: eigenvalues floored in the correction's solve.
    """

    def __init__(self, label: str | int, features: Sequence[str | int] | None = None, alpha: float = 0.0,
                 noise_correction: str = "none"):
        self.label = label
        self.features = features
        self.alpha = alpha
        self.noise_correction = noise_correction

    def _columns(self, d: int, columns: Sequence[str] | None) -> tuple[list[int], int, list]:
        names = list(columns) if columns is not None else list(range(d))
        if len(names) != d:
            raise ValueError(f"columns names {len(names)} columns but the release has {d}")

        def index(c) -> int:
            if isinstance(c, (int, np.integer)) and not isinstance(c, bool):
                if not -d <= int(c) < d:
                    raise ValueError(f"column index {c} is out of range for {d} columns")
                return int(c) % d
            if c not in names:
                raise ValueError(f"column {c!r} is not in the release (columns: {names})"
                                 + ("; pass columns= to fit to use names" if columns is None else ""))
            return names.index(c)

        li = index(self.label)
        fi = [index(c) for c in self.features] if self.features is not None else [j for j in range(d) if j != li]
        if li in fi:
            raise ValueError("the label cannot also be a feature")
        if not fi:
            raise ValueError("need at least one feature column")
        if len(set(fi)) != len(fi):
            raise ValueError("features must not repeat")
        return fi, li, [names[j] for j in fi]

    def fit(self, Y, weights=None, *, columns: Sequence[str] | None = None, sigma: float = 0.0,
            counts=None, n_reports: int | None = None, spec=None, server_sigma: float = 0.0) -> "LADRegression":
        """Fit on the (k, d) release ``Y`` with row ``weights`` (default 1).

        The noise law (for ``noise_correction="calibrate"``): ``sigma``, each report's noise std
        per value; ``counts`` (k,), reports per row (diag of S S^T over the inclusion set), or
        ``n_reports`` with the sketch ``spec`` for their expectations (:func:`expected_counts`);
        ``server_sigma``, the std of the servers' noise per released cell, all servers together.
        """
        if self.noise_correction not in NOISE_CORRECTIONS:
            raise ValueError(f"noise_correction must be one of {NOISE_CORRECTIONS}, got {self.noise_correction!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError("alpha must be a finite non-negative number")
        Y = np.asarray(Y, dtype=np.float64)
        if Y.ndim != 2 or Y.shape[0] < 1 or Y.shape[1] < 2:
            raise ValueError(f"the release must be a (k, d) matrix with d >= 2 columns, got shape {Y.shape}")
        k, d = Y.shape
        w = np.ones(k) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
        if w.shape != (k,):
            raise ValueError(f"need one weight per release row: {k} rows, {w.size} weights")
        fi, li, names = self._columns(d, columns)
        X, y = Y[:, fi], Y[:, li]
        _check_finite(X, y, w)
        if not (math.isfinite(sigma) and sigma >= 0 and math.isfinite(server_sigma) and server_sigma >= 0):
            raise ValueError("sigma and server_sigma must be finite and non-negative")
        if k > GLOB_MIN_ROWS and self.alpha == 0:
            beta = _lad_globbed(X, y, w, np.random.default_rng(0))  # exact, faster (e.g. local model)
        else:
            beta = _lp(X, y, w, float(self.alpha))
        self.coef_uncorrected_ = beta
        self.objective_ = float(np.sum(w * np.abs(y - X @ beta)))
        coef, energy, floored = beta, 0.0, 0
        if self.noise_correction == "calibrate" and (sigma > 0 or server_sigma > 0):
            c = self._counts(k, counts, n_reports, spec) if sigma > 0 else np.zeros(k)
            tau2 = c * sigma ** 2 + server_sigma ** 2
            v = w / np.sqrt(np.maximum(c, 1.0))
            zvz = (X * v[:, None]).T @ X
            energy = float(np.sum(v * tau2))
            k_eff = float(np.sum(v) ** 2 / max(np.sum(v ** 2), 1e-300))
            # typical spectral size of the noise energy's fluctuation (a Wishart-like sum over
            # about k_eff effective rows): below it, a direction is not resolved
            floor = energy * 2.0 * math.sqrt(len(fi) / max(k_eff, 1.0))
            coef, floored = robust_solve(zvz - energy * np.eye(len(fi)), zvz @ beta, floor)
        self.coef_ = coef
        self.intercept_ = 0.0
        self.feature_names_ = names
        self.feature_indices_ = fi
        self.label_index_ = li
        self.noise_energy_ = energy
        self.n_floored_ = floored
        return self

    def fit_release(self, release) -> "LADRegression":
        """Fit on a released l1 study (``analyzer.release.L1Release``) with its public noise law.

        For a study with bounds the rows carry the constant coordinate, so the fit has an
        intercept (the constant's coefficient), and, since every mapped value is scale * z, the
        solution is the standardized one (``analyzer.moments``): it is carried back to the data's
        units. Without bounds: the plain fit on the release's columns, no intercept."""
        import math

        from dpsketch.protocol.bounds import CONSTANT

        from ..estimators import to_units

        study = release.study
        columns = list(release.columns)
        features = self.features
        if study.has_constant:  # the intercept is the constant coordinate's coefficient
            named = [c for c in columns if c not in (self.label, CONSTANT)] if features is None else list(features)
            features = [*named, CONSTANT]
        fitted = LADRegression(self.label, features, self.alpha, self.noise_correction).fit(
            release.sketch, release.weights, columns=columns, sigma=release.sigma,
            n_reports=release.n_reports, spec=study.l1_spec,
            server_sigma=math.sqrt(release.server_noise_variance))
        self.__dict__.update({k: v for k, v in vars(fitted).items() if k.endswith("_")})
        if study.bounds is None:
            return self
        cmap = study.column_map
        names = list(self.feature_names_)
        constant = CONSTANT in names
        keep = [i for i, c in enumerate(names) if c != CONSTANT]
        theta0 = float(self.coef_[names.index(CONSTANT)]) if constant else 0.0
        fi = [columns.index(names[i]) for i in keep]
        li = columns.index(self.label)
        self.standard_coef_ = self.coef_[keep].copy()
        self.standard_intercept_ = theta0
        self.coef_, self.intercept_ = to_units(self.coef_[keep], theta0, cmap.mid, cmap.half, fi, li, constant)
        self.feature_names_ = [names[i] for i in keep]
        self.in_units_ = True
        return self

    @staticmethod
    def _counts(k: int, counts, n_reports, spec) -> np.ndarray:
        if counts is not None:
            c = np.asarray(counts, dtype=np.float64).reshape(-1)
            if c.shape != (k,) or not np.all(np.isfinite(c)) or np.any(c < 0):
                raise ValueError(f"counts must be {k} finite non-negative numbers (reports per release row)")
            return c
        if n_reports is not None and spec is not None:
            if spec.k != k:
                raise ValueError(f"the spec has {spec.k} rows but the release {k}")
            return expected_counts(spec, int(n_reports))
        raise ValueError("with sigma > 0 the noise correction needs counts= (reports per row) or n_reports= and spec=")

    def predict(self, X) -> np.ndarray:
        """Predictions X @ coef_ for rows of the features (array of shape (m, p), or a DataFrame)."""
        if hasattr(X, "columns") and hasattr(X, "to_numpy"):
            X = X[list(self.feature_names_)].to_numpy()
        X = np.atleast_2d(np.asarray(X, dtype=np.float64))
        if X.shape[1] != len(self.coef_):
            raise ValueError(f"expected {len(self.coef_)} feature columns ({self.feature_names_}), got {X.shape[1]}")
        return X @ self.coef_ + self.intercept_


# ---------------------------------------------------------------------------------------------
# the REST route


class LADRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str | None = Field(default=None, description="label column; default: the study's label")
    alpha: float = Field(default=0.0, ge=0, le=1e12, description="l1 penalty on the coefficients, in units "
                         "of the weighted objective (default 0: the noise already shrinks them)")
    noise_correction: Literal["none", "calibrate"] = Field(
        default="none", description="none: the plain weighted fit (default); calibrate: undo the shrinkage "
        "the noise in the features causes by regression calibration with the known noise law (measured "
        "erratic, docs/lad.md)")
    weights: dict[str, Any] | None = Field(
        default=None, description="gram or moments study: the round weights its rows were weighted with "
        "(the previous round's next_weights); absent for round 1 (a study with bounds, or unweighted rows)")
    tuning: float = Field(default=DEFAULT_TUNING, gt=0, le=1e6, description="gram or moments study: the next "
                          "round's Huber threshold in units of this fit's weighted residual rms")


class LADResult(BaseModel):
    study_id: str
    label: str
    features: list[str]
    coef: list[float] = Field(description="per feature, in the data's units for a study with bounds")
    intercept: float = Field(default=0.0, description="in the label's units (a study with bounds: its rows "
                             "carry a constant coordinate); 0 for a study without bounds")
    in_units: bool = Field(default=False, description="whether the study declared bounds, so the answer is "
                           "in the data's units")
    objective: float | None = Field(default=None, description="l1 study: the weighted l1 objective of the fit")
    alpha: float
    noise_correction: str
    n_reports: int
    method: str | None = Field(default=None, description="gram or moments study: \"huber-rounds\"")
    round: int | None = Field(default=None, description="which round this study was (1: unweighted rows)")
    stderr: list[float] | None = Field(default=None, description="standard errors of coef and intercept (last) "
                                       "over this release's noise, the round's weights held fixed")
    scale: float | None = Field(default=None, description="the weighted residual rms, in the label's units")
    next_weights: dict[str, Any] | None = Field(
        default=None, description="what the next round's data owners weight their rows with "
        "(analyzer.analyses.lad_rounds.weighted_rows) and the next round's fit needs")


def install(app: FastAPI, released: Callable[[str], Release], auth: list) -> None:
    """Add the least absolute deviations route to the analyzer's app."""

    @app.post("/v1/studies/{study_id}/analyses/lad", dependencies=auth, response_model_exclude_none=True)
    def lad(study_id: str, body: LADRequest) -> LADResult:
        rel = released(study_id)
        if isinstance(rel, GramSumRelease):
            return _rounds(study_id, rel, body)
        if not isinstance(rel, L1Release):
            raise refuse(f"study {study_id} is a {rel.study.kind} study: least absolute deviations needs "
                         f"a gram or moments study (the default, docs/lad.md) or an l1 study")
        label = label_of(body.label, rel.study.label, rel.columns)
        if label == CONSTANT:
            raise refuse("the constant coordinate cannot be the label")
        with fitting():
            model = LADRegression(label=label, alpha=body.alpha, noise_correction=body.noise_correction).fit_release(rel)
        require_finite(model.coef_)
        return LADResult(study_id=study_id, label=label, features=[str(f) for f in model.feature_names_],
                         coef=model.coef_.tolist(), intercept=float(model.intercept_),
                         objective=float(model.objective_), alpha=float(body.alpha),
                         noise_correction=body.noise_correction, n_reports=rel.n_reports,
                         in_units=rel.study.bounds is not None)


def _rounds(study_id: str, rel: GramSumRelease, body: LADRequest) -> LADResult:
    """One round of the robust regression on a gram or moments release (module docstring)."""
    label = body.label or (body.weights or {}).get("label") or rel.study.label
    if label is None:
        raise refuse("name the label: this study has none")
    if body.alpha != 0.0 or body.noise_correction != "none":
        raise refuse("alpha and noise_correction apply to an l1 study only")
    with fitting():
        model = RobustRegression(label=str(label), weighted_by=body.weights, tuning=body.tuning).fit(rel)
    require_finite(model.coef_, model.intercept_)
    se = model.stderr()
    return LADResult(study_id=study_id, label=str(label), features=list(model.feature_names_),
                     coef=model.coef_.tolist(), intercept=float(model.intercept_), in_units=model.in_units_,
                     alpha=0.0, noise_correction="none", n_reports=rel.n_reports, method="huber-rounds",
                     round=model.round_, stderr=[float(v) for v in se] if np.all(np.isfinite(se)) else None,
                     scale=float(model.scale_), next_weights=model.next_weights_.to_dict())
