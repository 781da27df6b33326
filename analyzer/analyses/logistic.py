"""Logistic regression from released second moments (paper 002, section 5.2).

The log-loss of a row (x, y) with y in {-1, +1} is phi(s) = log(1 + exp(-s)) at the margin
s = y (b + x.w). Its Taylor expansion at s = 0, i.e. at the expansion point w = 0, b = 0 (paper 002,
after Huggins et al. 2017), is

    phi(s) ~ log 2 - s / 2 + s^2 / 8,

and since y^2 = 1, s^2 = (b + x.w)^2 does not depend on the label. Summed over the rows, with
x~ = [1, x] and beta = [b, w], the surrogate is

    L(beta) = n log 2 - beta . (X~^T y) / 2 + beta^T (X~^T X~) beta / 8 + (alpha / 8) ||w||^2,

which needs only X~^T X~ (the count n, the row sum and A^T A of the features) and X~^T y (the
label's sum and its column of A^T A): exactly the second moments a gram release holds and a
sketch release estimates. Its minimiser is the ridge solution of the +-1 labels scaled by 2,

    beta_taylor = 2 (X~^T X~ + alpha P)^{-1} X~^T y,    P = diag(0, 1, ..., 1),

solved with the same robust eigenvalue floor as :class:`analyzer.estimators.RidgeRegression`.

What second moments can and cannot give
---------------------------------------
* **Direction only.** Any quadratic surrogate of phi with one common expansion point for all rows
  (Taylor at another margin, a Chebyshev fit on [-R, R] as in PASS-GLM) has the form c0 + c1 s +
  c2 s^2, so its minimiser is the same vector up to a positive factor -c1 / (2 c2): the
  *direction* of beta is the least-squares / Fisher discriminant direction whatever the expansion
  point. Ranking metrics (AUC) and the sign of the decision function do not depend on the factor;
  probabilities (log-loss) do: the Taylor point w = 0 overstates the loss of confidently correct
  rows, so beta_taylor is shrunk toward 0 whenever the classes separate well.
* **No Newton step.** A Newton (IRLS) step from any w != 0 needs sum p_i (1 - p_i) x_i x_i^T and
  sum (p_i - y_i) x_i with p_i = sigmoid(x_i.w): per-row weights that no linear map of the rows
  fixed before the data can release. Expanding every row at its own margin is likewise impossible.
  Exact logistic regression is not a function of second moments.
* **What is possible: a calibration of the scale and intercept.** The released moments give the
  class counts n_1, n_0, the class means of the scores z = x.u along any direction u, and the
  pooled within-class variance of those scores (from u^T A^T A u). If the scores are Gaussian within
  each class with one common variance v (exactly true under the LDA model, approximately when z sums
  many features), the conditional probability is exactly logistic in z, with slope
  a = (m_1 - m_0) / v and intercept log(n_1 / n_0) - a (m_1 + m_0) / 2. ``calibration="gaussian"``
  (the default) keeps the surrogate's direction u = w_taylor and sets the scale and intercept this
  way (closed form, no further privacy cost; the variance is read from the same regularised,
  eigenvalue-floored Gram the direction was solved with, so noise shrinks the slope rather than
  inflating it); ``calibration="taylor"`` returns beta_taylor as in
  paper 002. Both give the same AUC and almost the same accuracy; the Gaussian calibration gives a
  far better log-loss (docs/logistic.md). It is a modelling assumption, not a consequence of the
  release: on data whose scores are far from Gaussian within a class it can be worse than Taylor's.

Regularisation
--------------
``alpha`` is a ridge penalty on the surrogate (never on the intercept), in the units of the Gram
(sums over reports), as for :class:`~analyzer.estimators.RidgeRegression`; it corresponds to
scikit-learn's ``C = 4 / alpha`` on the surrogate. ``alpha=None`` uses the ridge estimator's rule:
AdaSSP's max(0, tau - lambda_min) on the (intercept-augmented) Gram, with tau the release's public
``gram_noise_scale``, plus the sketch release's ``cross_noise_scale``. So the penalty grows with the
noise (sigma^2 n for the client noise) and vanishes relative to the data as n grows; it is 0 on
noise-free input. Eigenvalues below tau are floored there, as in ridge.

Labels and intercept
--------------------
``classes=(negative, positive)``: the two numbers the label column holds (default (0, 1); (-1, 1)
works the same, and so does any pair such as (0, 0.7) chosen to leave room for the features in the
row bound). The mapping to +-1 is affine, so X~^T y+-1 follows from the label's column of the Gram,
its sum and the count. The estimator cannot check that the private labels really take only these
two values.

The intercept needs the count and the row sum. A gram release (:class:`GramSumRelease`) has both
(the count is the exact, public size of the inclusion set). A sketch release has neither: name a
column that holds the same positive constant in every row with ``intercept_column`` (its value is
read from its Gram diagonal, sqrt(G_cc / n)), or fit without intercept (``fit_intercept=False``).

Everything here is post-processing of the release and its public parameters.

The REST route
--------------
``install`` adds the analyzer's route for logistic regression, a thin layer over
:class:`LogisticRegression`.

``POST /v1/studies/{id}/analyses/logistic`` fits :class:`LogisticRegression` on
a released gram or sketch study and answers the coefficients and intercept like ridge does. A
histogram study, an unknown label or intercept column, classes that are not two distinct numbers,
a sketch study without an intercept column (unless ``fit_intercept`` is false) are 422
``invalid-request``; a study that is not released is 409 ``study-open`` (from ``released``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..estimators import _as_matrix, default_ridge_alpha, robust_solve
from ..moments import release_columns, standard_moments
from ..release import HistogramRelease, L1Release, Release, column_indices, noise_scale_of
from .routes import NOT_FINITE, fitting, json_number, label_of, refuse, require_finite

if TYPE_CHECKING:
    from fastapi import FastAPI

CALIBRATIONS = ("gaussian", "taylor")


@dataclass
class _GramInput:
    """A bare Gram matrix passed to :meth:`LogisticRegression.fit` (the baselines' path)."""

    columns: list[str]
    n_reports: int
    gram_matrix: np.ndarray
    row_sum: np.ndarray | None = None
    gram_noise_scale: float = 0.0
    cross_noise_scale: float = 0.0

    def gram(self, debias: bool = True) -> np.ndarray:
        return self.gram_matrix


def check_classes(classes: Any) -> tuple[float, float]:
    """The (negative, positive) label values as two distinct finite floats, or ValueError."""
    try:
        values = [float(c) for c in classes]
    except (TypeError, ValueError):
        raise ValueError(f"classes must be two distinct numbers (negative, positive), got {classes!r}") from None
    if len(values) != 2 or not all(math.isfinite(v) for v in values) or values[0] == values[1]:
        raise ValueError(f"classes must be two distinct finite numbers (negative, positive), got {classes!r}")
    return values[0], values[1]


def _logit_to_units(w: np.ndarray, b: float, mid: np.ndarray, half: np.ndarray) -> tuple[np.ndarray, float]:
    """A decision function b + sum w_c z_c of standardized z = (x - mid) / half, in units:
    (w / half, b - sum w_c mid_c / half_c)."""
    return w / half, float(b - w @ (mid / half))


class LogisticRegression:
    """Binary logistic regression of ``label`` on the other columns, from a release.

    Parameters
    ----------
    label: the label column's name.
    classes: (negative, positive) values of the label column; default (0, 1).
    alpha: ridge penalty on the surrogate (units of the Gram); ``None``: chosen from the noise.
    debias: subtract the release's known noise energy from the Gram first (recommended).
    features: feature columns; default every column but the label (and ``intercept_column``).
    fit_intercept: fit an intercept (needs the count and row sum, or ``intercept_column``).
    intercept_column: a column holding one positive constant in every row (sketch studies).
    calibration: "gaussian" (default: surrogate direction, scale and intercept from the
        within-class score distribution) or "taylor" (the Taylor-at-0 minimiser of paper 002).

    Attributes
    ----------
    coef_: (1, p) coefficients over ``feature_names_`` (scikit-learn's shape).
    intercept_: (1,) intercept.
    classes_: array([negative, positive]).
    feature_names_, alpha_, noise_scale_, n_floored_, n_reports_, direction_ (the surrogate
    solution before calibration, intercept first), calibration_ (what was applied: "gaussian",
    or "taylor" also when the Gaussian calibration was undefined, e.g. a non-positive noisy
    variance).
    """

    def __init__(
        self,
        label: str,
        classes: Sequence[float] = (0, 1),
        alpha: float | None = None,
        debias: bool = True,
        features: Sequence[str] | None = None,
        fit_intercept: bool = True,
        intercept_column: str | None = None,
        calibration: str = "gaussian",
    ):
        self.label = label
        self.classes = classes
        self.alpha = alpha
        self.debias = debias
        self.features = features
        self.fit_intercept = fit_intercept
        self.intercept_column = intercept_column
        self.calibration = calibration

    # -- the sufficient statistics ---------------------------------------------------------------
    def _moments(self, release) -> dict[str, Any]:
        """n, sum x, sum y, X^T X, X^T y for the features and the label (intercept or not)."""
        cols = list(release.columns)
        if self.label not in cols:
            raise ValueError(f"label {self.label!r} is not in the release (columns: {cols})")
        ic = self.intercept_column
        if ic is not None:
            if ic not in cols:
                raise ValueError(f"intercept_column {ic!r} is not in the release (columns: {cols})")
            if ic == self.label:
                raise ValueError("the label cannot also be the intercept column")
        features = (list(self.features) if self.features is not None
                    else [c for c in cols if c not in (self.label, ic)])
        if self.label in features:
            raise ValueError("the label cannot also be a feature")
        if ic is not None and ic in features:
            raise ValueError(f"the intercept column {ic!r} cannot also be a feature")
        if not features:
            raise ValueError("need at least one feature column")
        fi = column_indices(release, features)
        (li,) = column_indices(release, [self.label])
        g = np.asarray(release.gram(self.debias), dtype=np.float64)
        if g.shape != (len(cols), len(cols)) or not np.all(np.isfinite(g)):
            raise ValueError(f"the Gram must be a finite {len(cols)} x {len(cols)} matrix")
        n = int(release.n_reports)
        out: dict[str, Any] = {"features": features, "n": n, "gxx": g[np.ix_(fi, fi)], "gxy": g[fi, li]}
        if not self.fit_intercept:
            return out
        if ic is not None:
            (ci,) = column_indices(release, [ic])
            if not g[ci, ci] > 0:
                raise ValueError(f"the intercept column {ic!r} has no positive energy in the release")
            value = math.sqrt(g[ci, ci] / n)
            out.update(sx=g[fi, ci] / value, sy=g[li, ci] / value)
            return out
        row_sum = getattr(release, "row_sum", None)
        if row_sum is None:
            raise ValueError(
                "this release has no count and row sum (a sketch study): put a constant column in the "
                "schema and name it intercept_column, or set fit_intercept=False")
        row_sum = np.asarray(row_sum, dtype=np.float64).reshape(-1)
        if row_sum.shape != (len(cols),):
            raise ValueError(f"row_sum must have {len(cols)} entries, got {row_sum.shape}")
        out.update(sx=row_sum[fi], sy=float(row_sum[li]))
        return out

    def fit(self, release, *, columns: Sequence[str] | None = None, n_reports: int | None = None,
            row_sum: np.ndarray | None = None, noise_scale: float = 0.0) -> "LogisticRegression":
        """Fit on a release (any :class:`~analyzer.release.SecondMoments`, with ``row_sum`` for an
        intercept), or on a bare Gram matrix A^T A: then give ``columns`` and ``n_reports`` (and
        ``row_sum`` for the intercept, ``noise_scale`` for the eigenvalue floor and the default
        penalty; the Gram is taken as already debiased)."""
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {self.calibration!r}")
        c0, c1 = check_classes(self.classes)
        if self.alpha is not None and not (float(self.alpha) >= 0 and math.isfinite(float(self.alpha))):
            raise ValueError(f"alpha must be a non-negative number, got {self.alpha!r}")
        if isinstance(release, np.ndarray) or (columns is not None and not hasattr(release, "gram")):
            if columns is None or n_reports is None:
                raise ValueError("fitting on a Gram matrix needs columns and n_reports")
            release = _GramInput(list(columns), int(n_reports), np.asarray(release, dtype=np.float64),
                                 None if row_sum is None else np.asarray(row_sum, dtype=np.float64),
                                 float(noise_scale))
        if int(release.n_reports) < 2:
            raise ValueError("need at least 2 reports")
        study = getattr(release, "study", None)
        if study is not None and study.bounds is not None:
            return self._fit_in_units(release, c0, c1)
        m = self._moments(release)
        n, p = m["n"], len(m["features"])
        span, shift = c1 - c0, c0 + c1
        # X~^T y+-1 with y+-1 = (2 y - (c0 + c1)) / (c1 - c0); class-1 indicator y01 = (y - c0) / span
        if self.fit_intercept:
            gaug = np.empty((p + 1, p + 1))
            gaug[0, 0], gaug[0, 1:], gaug[1:, 0], gaug[1:, 1:] = n, m["sx"], m["sx"], m["gxx"]
            xy = np.concatenate([[m["sy"]], m["gxy"]])
            x1 = np.concatenate([[n], m["sx"]])
            penalty = np.diag(np.r_[0.0, np.ones(p)])
        else:
            gaug, xy, x1 = m["gxx"], m["gxy"], None
            penalty = np.eye(p)
            if shift != 0:
                # sum_i x_i is needed to recode the labels; without it only symmetric classes work
                sx = getattr(release, "row_sum", None)
                if sx is None:
                    raise ValueError("without an intercept and without a row sum the classes must be "
                                     "symmetric (-c, +c)")
                x1 = np.asarray(sx, dtype=np.float64)[column_indices(release, m["features"])]
        xy_pm = (2.0 * xy - (shift * x1 if x1 is not None else 0.0)) / span
        tau = noise_scale_of(release)
        if self.alpha is None:
            alpha = default_ridge_alpha(gaug, tau) + float(getattr(release, "cross_noise_scale", 0.0) or 0.0)
        else:
            alpha = float(self.alpha)
        beta, floored = robust_solve(gaug + alpha * penalty, 2.0 * xy_pm, tau)
        self.direction_ = beta.copy()
        calibration = "taylor"
        if self.calibration == "gaussian" and self.fit_intercept:
            regularised = gaug + alpha * penalty
            if tau > 0:  # the matrix robust_solve inverted: eigenvalues floored at tau
                w_, v_ = np.linalg.eigh(0.5 * (regularised + regularised.T))
                regularised = (v_ * np.maximum(w_, tau)) @ v_.T
            cal = self._gaussian_calibration(beta, {**m, "gxx": regularised[1:, 1:]}, (xy - c0 * x1) / span)
            if cal is not None:
                beta, calibration = cal, "gaussian"
        if self.fit_intercept:
            intercept, coef = float(beta[0]), beta[1:]
        else:
            intercept, coef = 0.0, beta
        self.coef_ = coef.reshape(1, -1)
        self.intercept_ = np.array([intercept])
        self.classes_ = np.array([c0, c1])
        self.feature_names_ = m["features"]
        self.alpha_ = alpha
        self.noise_scale_ = tau
        self.n_floored_ = floored
        self.n_reports_ = n
        self.calibration_ = calibration
        return self

    def _fit_in_units(self, release, c0: float, c1: float) -> "LogisticRegression":
        """A study with bounds: fit in its standardized space (``analyzer.moments``; the labels
        c0, c1 mapped there too), then carry the decision function back to the data's units:
        b + sum w_c z_c = (b - sum w_c mid_c / half_c) + sum (w_c / half_c) x_c."""
        m = standard_moments(release, self.debias)
        if self.label not in m.columns:
            raise ValueError(f"label {self.label!r} is not in the release (columns: {m.columns})")
        inner = self._standard_fit(m.columns, m.n, m.gram, m.sums, m.noise_scale, m.cross_noise_scale, m, c0, c1)
        fi = m.index(inner.feature_names_)
        w = inner.coef_[0]
        for name, value in vars(inner).items():
            if name.endswith("_"):
                setattr(self, name, value)
        self.standard_coef_, self.standard_intercept_ = w.copy(), float(inner.intercept_[0])
        coef, intercept = _logit_to_units(w, float(inner.intercept_[0]), m.mid[fi], m.half[fi])
        self.coef_ = coef.reshape(1, -1)
        self.intercept_ = np.array([intercept])
        self.classes_ = np.array([c0, c1])
        self.in_units_ = True
        self.noise_cov_ = self._noise_covariance(release, m, c0, c1)
        return self

    def _standard_fit(self, columns, n, gram, sums, noise_scale, cross, m, c0, c1) -> "LogisticRegression":
        """The fit in the standardized space of the bounds (labels mapped there too)."""
        (li,) = m.index([self.label])
        z_classes = [(c - m.mid[li]) / m.half[li] for c in (c0, c1)]
        standard = _GramInput(list(columns), n, gram, sums, noise_scale, cross)
        return LogisticRegression(self.label, classes=z_classes, alpha=self.alpha, debias=self.debias,
                                  features=self.features, fit_intercept=self.fit_intercept,
                                  calibration=self.calibration).fit(standard)

    def _noise_covariance(self, release, m, c0: float, c1: float) -> np.ndarray:
        """Covariance of [coef_, intercept_] (units) over the release's noise: the delta method
        through a numerical Jacobian of the whole fit as a function of the released moments
        (``analyzer.uncertainty.delta_covariance``; the fit is a smooth function of them, its
        eigenvalue floor aside). The moments are taken in the release's own columns, where a
        study with bounds has a = scale z and a constant of value kappa (its constant coordinate,
        kappa = scale, or a gram study's count, kappa = 1): Z^T Z = M / scale^2 and the column
        sums M[:, const] / (scale kappa). NaN where the release declares no noise law."""
        from dpsketch.protocol.bounds import CONSTANT

        from .. import uncertainty

        study = release.study
        features = [c for c in m.columns if c != self.label] if self.features is None else list(self.features)
        names = [*features, self.label, CONSTANT]
        size = len(features) + 1
        try:
            m_law, law = uncertainty.moment_law(release, names)
        except (TypeError, KeyError, ValueError):
            return np.full((size, size), np.nan)
        scale = study.column_map.scale
        kappa = scale if study.has_constant else 1.0
        p = len(features) + 1
        order = m.index([*features, self.label])

        def fit(moments: np.ndarray) -> np.ndarray:
            gram = np.zeros((len(m.columns), len(m.columns)))
            sums = np.zeros(len(m.columns))
            gram[np.ix_(order, order)] = moments[:p, :p] / scale ** 2
            sums[order] = moments[:p, p] / (scale * kappa)
            inner = self._standard_fit(m.columns, m.n, gram, sums, m.noise_scale, m.cross_noise_scale, m, c0, c1)
            fi = m.index(inner.feature_names_)
            coef, intercept = _logit_to_units(inner.coef_[0], float(inner.intercept_[0]), m.mid[fi], m.half[fi])
            return np.append(coef, intercept)

        return uncertainty.delta_covariance(fit, m_law, law)

    def stderr(self) -> np.ndarray:
        """Standard errors of coef_ and (last) intercept_ over the release's noise, in units (a
        study with bounds; NaN otherwise)."""
        from ..uncertainty import standard_errors

        return standard_errors(getattr(self, "noise_cov_", np.full((self.coef_.shape[1] + 1,) * 2, np.nan)))

    def conf_int(self, level: float = 0.95) -> np.ndarray:
        """(p + 1, 2) intervals [low, high] of coef_ and (last) intercept_ over the release's noise."""
        from ..uncertainty import intervals

        cov = getattr(self, "noise_cov_", np.full((self.coef_.shape[1] + 1,) * 2, np.nan))
        _, low, high = intervals(np.append(self.coef_[0], self.intercept_), cov, level)
        return np.column_stack([low, high])

    @staticmethod
    def _gaussian_calibration(beta: np.ndarray, m: dict[str, Any], xy01: np.ndarray) -> np.ndarray | None:
        """Slope and intercept along u = beta[1:] if the scores are N(m_k, v) in class k.

        With z = x.u: n_1 = sum y01, sum_{class 1} z = u . X^T y01, sum z = u . sum x,
        sum z^2 = u^T X^T X u; m_k are the class means and v the pooled within-class variance
        (all from the released second moments). X^T X here is the regularised, eigenvalue-floored
        Gram the direction was solved with, so v is never below what the noise allows and the
        slope shrinks as the penalty grows. None when a class is empty or v <= 0.
        """
        u = beta[1:]
        n = float(m["n"])
        n1 = float(xy01[0])
        n0 = n - n1
        if not (1.0 <= n1 <= n - 1.0):
            return None
        s1 = float(u @ xy01[1:])
        s = float(u @ m["sx"])
        m1, m0 = s1 / n1, (s - s1) / n0
        v = (float(u @ m["gxx"] @ u) - n1 * m1 ** 2 - n0 * m0 ** 2) / (n - 2.0)
        if not (v > 0 and m1 > m0):
            return None
        a = (m1 - m0) / v
        b = math.log(n1 / n0) - a * (m1 + m0) / 2.0
        return np.concatenate([[b], a * u])

    # -- predictions -----------------------------------------------------------------------------
    def decision_function(self, X) -> np.ndarray:
        """b + X @ w for rows of the features (an array or a DataFrame)."""
        return _as_matrix(X, self.feature_names_) @ self.coef_[0] + self.intercept_[0]

    def predict_proba(self, X) -> np.ndarray:
        """(n, 2): probabilities of classes_[0] and classes_[1]."""
        from scipy.special import expit  # here: the analyzer starts without scipy.special

        p1 = expit(self.decision_function(X))
        return np.column_stack([1.0 - p1, p1])

    def predict_log_proba(self, X) -> np.ndarray:
        z = self.decision_function(X)
        return np.column_stack([-np.logaddexp(0.0, z), -np.logaddexp(0.0, -z)])

    def predict(self, X) -> np.ndarray:
        """classes_[1] where the decision function is positive, else classes_[0]."""
        return np.where(self.decision_function(X) > 0, self.classes_[1], self.classes_[0])


# ---------------------------------------------------------------------------------------------
# the REST route


class LogisticRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str | None = Field(default=None, description="label column; default: the study's label")
    classes: list[float] = Field(default=[0.0, 1.0], description="the label's (negative, positive) values")
    alpha: float | None = Field(default=None, ge=0, description="ridge penalty on the surrogate (units of "
                                "the Gram); default: chosen from the noise level")
    debias: bool = Field(default=True, description="subtract the known noise energy from the Gram (sketch)")
    fit_intercept: bool = True
    intercept_column: str | None = Field(default=None, description="a column holding one positive constant "
                                         "(needed for an intercept on a sketch study without bounds; a study "
                                         "with bounds carries its own constant)")
    confidence: float = Field(default=0.95, gt=0, lt=1, description="level of the confidence intervals")
    calibration: Literal["gaussian", "taylor"] = Field(
        default="gaussian", description="taylor: the Taylor-at-0 surrogate's minimiser (paper 002); gaussian: "
        "its direction, with scale and intercept from the within-class score distribution (docs/logistic.md)")


class LogisticResult(BaseModel):
    study_id: str
    label: str
    classes: list[float]
    features: list[str]
    coef: list[float] = Field(description="per feature, on the log-odds scale per unit of the feature (in the "
                              "data's units for a study with bounds)")
    intercept: float
    stderr: list[float | None] = Field(default_factory=list, description="per feature, then the intercept: "
                                       "the standard error over the release's public noise law (a study "
                                       "with bounds; null where not available)")
    conf_int: list[list[float | None]] = Field(default_factory=list, description="per feature, then the "
                                               "intercept: [low, high] at `confidence`")
    confidence: float = 0.95
    in_units: bool = Field(default=False, description="whether the study declared bounds, so coef is per unit "
                           "of each feature in the data's units")
    alpha: float
    calibration: str
    debias: bool
    n_reports: int


def install(app: FastAPI, released: Callable[[str], Release], auth: list) -> None:
    """Add the logistic regression route to the analyzer's app."""

    @app.post("/v1/studies/{study_id}/analyses/logistic", dependencies=auth)
    def logistic(study_id: str, body: LogisticRequest) -> LogisticResult:
        rel = released(study_id)
        if isinstance(rel, (HistogramRelease, L1Release)):
            raise refuse(f"study {study_id} is a {rel.study.kind} study: logistic regression needs a gram "
                         f"or sketch study")
        label = label_of(body.label, rel.study.label, release_columns(rel))
        with fitting():
            classes = check_classes(body.classes)
            model = LogisticRegression(label=label, classes=classes, alpha=body.alpha, debias=body.debias,
                                       fit_intercept=body.fit_intercept, intercept_column=body.intercept_column,
                                       calibration=body.calibration).fit(rel)
        require_finite(model.coef_[0], model.intercept_,
                       message=NOT_FINITE + " (is alpha far larger than the data?)")
        return LogisticResult(study_id=study_id, label=label, classes=list(classes),
                              features=list(model.feature_names_), coef=model.coef_[0].tolist(),
                              intercept=float(model.intercept_[0]), alpha=float(model.alpha_),
                              calibration=model.calibration_, debias=body.debias, n_reports=rel.n_reports,
                              in_units=bool(getattr(model, "in_units_", False)),
                              stderr=[json_number(v) for v in model.stderr()],
                              conf_int=[[json_number(a), json_number(b)] for a, b in model.conf_int(body.confidence)],
                              confidence=body.confidence)
