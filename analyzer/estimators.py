"""Ridge regression, least squares and PCA on any released second moments.

scikit-learn conventions: hyperparameters go to ``__init__``, ``fit(release)`` returns ``self``,
learned attributes end in ``_``. ``fit`` accepts anything with the
:class:`analyzer.release.SecondMoments` interface (the LTM :class:`~analyzer.release.SketchRelease`,
a central noisy Gram, the local model's noisy rows, the exact Gram), so the same code serves every
mechanism. Everything here is post-processing of the release plus its public parameters, so the
results are as private as the release.

Models are *uncentered* (no intercept): they work on A^T A, the sum of x x^T over the clipped
rows. For an intercept, put a constant column in the schema.

Debiasing and robustness
------------------------
``debias=True`` (the default) subtracts the known expected noise energy (sigma^2 n I for the
LTM) from the Gram, which removes the shrinkage the noise would otherwise cause. The debiased
matrix is unbiased but can be indefinite when the noise is large compared with the data. The
solvers work in the eigenbasis of the (feature) Gram and floor its eigenvalues at the release's
public ``gram_noise_scale`` tau (the typical spectral norm of the noise left after debiasing):
an eigenvalue below tau is not resolved by the release, so it is treated as tau instead of being
inverted (a tiny or negative eigenvalue would blow the solution up or flip its sign). For
noise-free releases (tau = 0) the solve is a pseudo-inverse: directions with eigenvalue below
1e-12 of the largest are dropped, i.e. the minimum-norm least-squares solution.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpsketch.protocol.bounds import CONSTANT

from . import uncertainty
from .moments import StandardMoments, standard_moments
from .release import SecondMoments

#: Relative eigenvalue cut-off for the pseudo-inverse of a noise-free Gram.
PINV_RCOND = 1e-12


def _as_matrix(x, names: Sequence[str]) -> np.ndarray:
    """A 2-D float array from an array or a DataFrame (columns picked by name)."""
    if hasattr(x, "columns") and hasattr(x, "to_numpy"):
        return np.asarray(x[list(names)].to_numpy(), dtype=np.float64)
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.shape[1] != len(names):
        raise ValueError(f"expected {len(names)} columns ({list(names)}), got {arr.shape[1]}")
    return arr


def robust_solve(gram: np.ndarray, rhs: np.ndarray, floor: float) -> tuple[np.ndarray, int]:
    """Solve ``gram @ x = rhs`` for a symmetric, possibly indefinite ``gram``.

    With ``floor > 0`` the eigenvalues of ``gram`` are replaced by max(eigenvalue, floor); with
    ``floor == 0`` the pseudo-inverse is used. Returns the solution and how many eigenvalues were
    floored (or dropped).
    """
    g = 0.5 * (gram + gram.T)
    w, v = np.linalg.eigh(g)
    if floor > 0:
        changed = int(np.sum(w < floor))
        inv = 1.0 / np.maximum(w, floor)
    else:
        cutoff = PINV_RCOND * max(float(np.max(np.abs(w))), np.finfo(float).tiny)
        keep = w > cutoff
        changed = int(np.sum(~keep))
        inv = np.where(keep, 1.0 / np.where(keep, w, 1.0), 0.0)
    return v @ (inv * (v.T @ rhs)), changed


def default_ridge_alpha(feature_gram: np.ndarray, noise_scale: float) -> float:
    """The default ridge penalty: max(0, tau - lambda_min(debiased feature Gram)).

    This is the AdaSSP rule of Wang (2018, "Revisiting differentially private linear
    regression"): add just enough ridge that the noisy Gram is at least as well-conditioned as
    the noise is large, and nothing when the data already dominate the noise (so the estimate
    converges to least squares as n grows). It uses only the release and its public noise scale
    tau (lambda_min is post-processing of the release), so it costs no privacy and is
    deterministic given the release. For noise-free releases tau = 0 and alpha = 0.
    """
    if noise_scale <= 0:
        return 0.0
    lam_min = float(np.linalg.eigvalsh(0.5 * (feature_gram + feature_gram.T))[0])
    return max(0.0, noise_scale - lam_min)


def fuller_adjustment(release, feature_index: Sequence[int], fuller_alpha: float) -> float:
    """What Fuller's modification adds to the debiased feature Gram of a release with k noise rows
    of cell variance v (see :class:`RidgeRegression`, ``fuller``): (1 - h) k v + alpha_F k v / (k - 1)
    with h = 1 if lambda_hat >= 1 + 1/(k - 1), else lambda_hat - 1/(k - 1)."""
    if not fuller_alpha >= 0:
        raise ValueError("fuller must be non-negative")
    k = int(release.study.k)
    kv = k * float(release.cell_noise_variance)
    if kv <= 0:
        return 0.0
    raw = np.asarray(release.gram(False), dtype=np.float64)[np.ix_(feature_index, feature_index)]
    lam_hat = float(np.linalg.eigvalsh(0.5 * (raw + raw.T))[0]) / kv
    h = 1.0 if lam_hat >= 1.0 + 1.0 / (k - 1) else lam_hat - 1.0 / (k - 1)
    return (1.0 - h) * kv + fuller_alpha * kv / (k - 1)


class RidgeRegression:
    """Ridge regression of ``label`` on the other columns (or on ``features``), in the data's units.

    Minimises ||X theta - y||^2 + alpha ||theta||^2 with the Gram blocks of the release in place
    of X^T X and X^T y, i.e. theta = (G_xx + alpha I)^+ G_xy with the eigenvalue floor of the
    module docstring. With an intercept the Gram blocks are centred first (the intercept is not
    penalised, as in scikit-learn). For a study with bounds the fit runs in the standardized
    space of the declared bounds (z = (x - mid) / half, ``analyzer.moments``) and the answer is
    carried back to units; without bounds it is in the scale the rows were sent in.

    Parameters
    ----------
    label: the label column's name.
    alpha: the ridge penalty, in units of the standardized Gram (sums over reports of z z^T; for
        a study without bounds, the Gram as released). ``None`` uses
        :func:`default_ridge_alpha` (AdaSSP: just enough to dominate the release's noise) plus,
        for a sketch release, its ``cross_noise_scale`` (measured: ridge ratio 2.2 -> 1.7 at
        n = 10^6, d = 10, epsilon = 1; docs/accuracy.md).
    debias: subtract the known noise energy before solving (recommended).
    features: feature column names; default every column except the label.
    fit_intercept: fit an intercept (default None: whenever the study declares bounds, so its
        release carries the column sums and count; a study without bounds is fit uncentered, as
        its rows were pre-scaled). True on a release without first moments is an error.
    fuller: None (default), or Fuller's constant alpha_F (1 or 4 are usual) to use Fuller's
        (1987, section 2.5) modification of the moment estimator on a release whose noise is k
        rows of i.i.d. cells (a sketch release: ``cell_noise_variance`` v, k = ``study.k``): with
        lambda_hat the smallest eigenvalue of the undebiased feature Gram over k v, it subtracts
        k v I if lambda_hat >= 1 + 1/(k - 1), else (lambda_hat - 1/(k - 1)) k v I, and adds back
        alpha_F k v / (k - 1) I. Ignored for other releases and with an intercept. Measured on
        the sketch kind (docs/accuracy.md, "Design variants"): a small paired gain, so it is an
        option.

    Attributes
    ----------
    coef_: (p,) coefficients over ``feature_names_``, in the data's units.
    intercept_: the intercept in the label's units (0.0 without one).
    feature_names_: list of the p feature names.
    alpha_: the penalty actually used.
    n_floored_: how many eigenvalues of G_xx + alpha I were floored at tau (or, for tau = 0,
        dropped by the pseudo-inverse).
    tau_: the eigenvalue floor used, the release's public gram_noise_scale tau (0 for noise-free
        releases; docs/protocol.md section 6c gives it for every release kind), in the units of
        the standardized Gram. It does not depend on ``debias``.
    noise_scale_: the same as ``tau_`` (the older name).
    standard_coef_, standard_intercept_: the solution in the standardized space (what the
        release's noise law applies to; equal to coef_ and intercept_ without bounds).
    in_units_: whether the study declared bounds (answers in the data's units).
    """

    def __init__(
        self,
        label: str,
        alpha: float | None = None,
        debias: bool = True,
        features: Sequence[str] | None = None,
        fuller: float | None = None,
        fit_intercept: bool | None = None,
    ):
        self.label = label
        self.alpha = alpha
        self.debias = debias
        self.features = features
        self.fuller = fuller
        self.fit_intercept = fit_intercept

    def fit(self, release: SecondMoments) -> "RidgeRegression":
        if self.alpha is not None and not self.alpha >= 0:
            raise ValueError("alpha must be non-negative")
        m = standard_moments(release, self.debias)
        cols = m.columns
        if self.label not in cols:
            raise KeyError(f"label {self.label!r} is not in the release (columns: {cols})")
        features = list(self.features) if self.features is not None else [c for c in cols if c != self.label]
        if self.label in features:
            raise ValueError("the label cannot also be a feature")
        if not features:
            raise ValueError("need at least one feature column")
        intercept = resolve_intercept(self.fit_intercept, m)
        fi = m.index(features)
        (li,) = m.index([self.label])
        g = m.centered() if intercept else m.gram
        gxx = g[np.ix_(fi, fi)]
        gxy = g[fi, li]
        if self.fuller is not None and self.debias and not intercept and hasattr(release, "cell_noise_variance") \
                and getattr(getattr(release, "study", None), "k", 1) > 1:
            gxx = gxx + fuller_adjustment(release, fi, float(self.fuller)) * np.eye(len(fi))
        tau = m.noise_scale
        if self.alpha is None:
            # AdaSSP's rule against the noise-by-noise part, plus the size of the noise-by-data
            # terms that a sketch release also carries (0 for Gram-type releases)
            alpha = default_ridge_alpha(gxx, tau) + m.cross_noise_scale
        else:
            alpha = float(self.alpha)
        theta, floored = robust_solve(gxx + alpha * np.eye(len(fi)), gxy, tau)
        theta0 = float((m.sums[li] - theta @ m.sums[fi]) / m.n) if intercept else 0.0
        self.standard_coef_ = theta
        self.standard_intercept_ = theta0
        self.coef_, self.intercept_ = to_units(theta, theta0, m.mid, m.half, fi, li, intercept)
        self.noise_cov_, self.sampling_cov_, self._dof = coefficient_covariances(
            release, m, features, self.label, theta, theta0, intercept, alpha)
        self.feature_names_ = features
        self.alpha_ = alpha
        self.n_floored_ = floored
        self.tau_ = tau
        self.noise_scale_ = tau
        self.n_reports_ = int(release.n_reports)
        self.fit_intercept_ = intercept
        self.in_units_ = m.in_units
        return self

    def predict(self, X) -> np.ndarray:
        """Predictions X @ coef_ + intercept_ for rows of the features in the data's units (an
        array or a DataFrame)."""
        return _as_matrix(X, self.feature_names_) @ self.coef_ + self.intercept_

    def stderr(self, population: bool = True) -> np.ndarray:
        """Standard errors of coef_ (and, last, of intercept_ when fitted), in units. With
        ``population`` (the default) they add the sampling error of least squares to the release's
        noise: for statements about the population the rows came from; without it, the release's
        noise alone: how far the private fit may lie from the non-private fit on the same rows."""
        return uncertainty.standard_errors(self._cov(population))

    def conf_int(self, level: float = 0.95, population: bool = True) -> np.ndarray:
        """(p [+ 1], 2) intervals [low, high] for coef_ (and intercept_ last), as :meth:`stderr`
        says: the release's noise law is public, so these are honest up to the delta method
        (docs/accuracy.md, "Intervals": 95% intervals covered the non-private coefficient 90-99%
        of the time over 200 releases for least squares)."""
        _, low, high = uncertainty.intervals(self._coefficients(), self._cov(population), level, self.dof_)
        return np.column_stack([low, high])

    def _coefficients(self) -> np.ndarray:
        return np.append(self.coef_, self.intercept_) if self.fit_intercept_ else np.asarray(self.coef_)

    def _cov(self, population: bool) -> np.ndarray:
        return self.noise_cov_ + self.sampling_cov_ if population else self.noise_cov_

    @property
    def dof_(self) -> float | None:
        """Degrees of freedom of the t quantile of the intervals (a sketch release: k - p), None
        for the normal quantile."""
        return self._dof


def coefficient_covariances(release: SecondMoments, m: StandardMoments, features: Sequence[str], label: str,
                            theta: np.ndarray, theta0: float, intercept: bool,
                            alpha: float) -> tuple[np.ndarray, np.ndarray, float | None]:
    """The covariance of (coef_, intercept_) in units over the release's noise, and the classical
    sampling covariance of the same fit, each (p [+ 1]) square, and the degrees of freedom of the
    intervals' t quantile (``analyzer.uncertainty``).

    The delta method runs in the release's own columns (``uncertainty.moment_law``), where a study
    with bounds has a = scale z and its constant coordinate (the column "1"; a gram study's "1" is
    the count, of value 1): the fit there is a_y = sum_c theta_c a_c + phi kappa with kappa the
    constant's value, so phi = scale theta_0 / kappa, and the penalty is alpha scale^2. Then the
    map to units (:func:`units_jacobian`). A release without a public noise law (the evaluation's
    noisy central baselines) gets NaN covariances: no interval rather than a wrong one."""
    p = len(features) + (1 if intercept else 0)
    study = getattr(release, "study", None)
    scale = study.column_map.scale if study is not None and study.bounds is not None else 1.0
    names = [*features, label] + ([CONSTANT] if intercept else [])
    try:
        m_law, law = uncertainty.moment_law(release, names)
    except (TypeError, KeyError, ValueError):
        nan = np.full((p, p), np.nan)
        return nan, nan, None
    kappa = 1.0
    if intercept and study is not None and study.has_constant:
        kappa = scale  # the study's own constant coordinate, as every mapped value: scale * 1
    coef = np.append(theta, scale * theta0 / kappa) if intercept else np.asarray(theta)
    x_idx = [i for i in range(len(names)) if i != len(features)]
    penalty = np.append(np.full(len(features), alpha * scale ** 2), [0.0] * (1 if intercept else 0))
    noise = uncertainty.linear_fit_covariance(m_law, law, x_idx, len(features), coef, penalty)
    sampling = uncertainty.sampling_covariance(m_law, x_idx, len(features), coef, int(release.n_reports), penalty)
    back = np.ones(p)
    if intercept:
        back[-1] = kappa / scale  # phi -> theta_0
    jac = units_jacobian(m, m.index(features), m.index([label])[0], intercept) * back
    dof = uncertainty.interval_dof(law, p)
    if not np.all(np.isfinite(noise)):  # k <= p + 1: the release cannot bound the fit's spread
        return np.full((p, p), np.inf), jac @ sampling @ jac.T, dof
    return jac @ noise @ jac.T, jac @ sampling @ jac.T, dof


def resolve_intercept(fit_intercept: bool | None, m: StandardMoments) -> bool:
    """Whether to fit an intercept: as asked, or by default whenever the data are in units (the
    study declared bounds) and the release carries first moments."""
    if fit_intercept is None:
        return m.in_units and m.has_first_moments
    if fit_intercept and not m.has_first_moments:
        raise ValueError("this release carries no column sums, so it cannot give an intercept: declare "
                         "bounds on the study (its rows then carry a constant coordinate) or use a gram "
                         "study; fit_intercept=False fits through the origin")
    return bool(fit_intercept)


def to_units(theta: np.ndarray, theta0: float, mid: np.ndarray, half: np.ndarray, fi: Sequence[int],
             li: int, intercept: bool) -> tuple[np.ndarray, float]:
    """Coefficients and intercept of a fit in the standardized space, in the data's units:
    coef_c = half_y theta_c / half_c, intercept = mid_y + half_y theta_0 - coef . mid_x
    (``analyzer.moments``). Without an intercept the label's midpoint cannot be absorbed, so the
    map is the plain rescaling (a study without bounds: the identity)."""
    half_x, mid_x = half[list(fi)], mid[list(fi)]
    coef = half[li] * np.asarray(theta, dtype=np.float64) / half_x
    if not intercept:
        return coef, 0.0
    return coef, float(mid[li] + half[li] * theta0 - coef @ mid_x)


def units_jacobian(m: StandardMoments, fi: Sequence[int], li: int, intercept: bool) -> np.ndarray:
    """d(coef, intercept) / d(theta, theta_0): the linear map :func:`to_units` applies, for
    carrying a covariance of the standardized solution to units."""
    p = len(fi)
    half_x, mid_x = m.half[list(fi)], m.mid[list(fi)]
    scale = m.half[li] / half_x
    size = p + (1 if intercept else 0)
    jac = np.zeros((size, size))
    jac[np.arange(p), np.arange(p)] = scale
    if intercept:
        jac[p, :p] = -scale * mid_x
        jac[p, p] = m.half[li]
    return jac


class LeastSquares(RidgeRegression):
    """Ordinary least squares (ridge with alpha = 0), solved robustly: eigenvalues of the
    debiased feature Gram below the release's noise scale are floored there (noisy releases),
    or dropped (pseudo-inverse, exact releases)."""

    def __init__(self, label: str, debias: bool = True, features: Sequence[str] | None = None,
                 fit_intercept: bool | None = None):
        super().__init__(label=label, alpha=0.0, debias=debias, features=features,
                         fit_intercept=fit_intercept)


class PCA:
    """PCA / rank-r approximation of the release: centred and in the data's units for a study with
    bounds, uncentered (the top right singular vectors of the release) for a study without.

    For a study with bounds the release carries the column sums, so the covariance of the rows
    in units, C = D (Z^T Z / n - mean mean^T) D with D = diag(half) (``analyzer.moments``), is
    estimated and its top eigenvectors are the components, as scikit-learn's PCA centres. For the
    LTM without bounds these are the top right singular vectors of Y = S(A + G), i.e. the top
    eigenvectors of Y^T Y. Debiasing subtracts a multiple of the identity from the Gram, so
    without bounds it does not change the components, only ``explained_variance_`` and
    ``singular_values_`` (which then estimate those of A rather than of Y).

    Parameters
    ----------
    n_components: r, the number of components.
    debias: subtract the known noise energy from the eigenvalues.
    columns: the columns to analyse (default all).
    center: centre the rows (default None: whenever the study declares bounds).

    Attributes
    ----------
    components_: (r, p) orthonormal rows, sorted by decreasing eigenvalue; each row's sign is
        fixed so that its largest-magnitude entry is positive (deterministic).
    explained_variance_: (r,) the variance of the rows along each component, in the data's
        units squared (centred); uncentered: eigenvalues / n, the mean squared projection.
    explained_variance_ratio_: (r,) eigenvalues / trace.
    singular_values_: (r,) sqrt(max(eigenvalue, 0)) of the (centred) Gram.
    mean_: (p,) the column means in units (zeros when not centred).
    feature_names_: the p analysed columns.
    """

    def __init__(self, n_components: int, debias: bool = True, columns: Sequence[str] | None = None,
                 center: bool | None = None):
        self.n_components = n_components
        self.debias = debias
        self.columns = columns
        self.center = center

    def fit(self, release: SecondMoments) -> "PCA":
        m = standard_moments(release, self.debias)
        names = list(self.columns) if self.columns is not None else list(m.columns)
        idx = m.index(names)
        r = int(self.n_components)
        if not 1 <= r <= len(names):
            raise ValueError(f"n_components must be between 1 and {len(names)}")
        center = resolve_intercept(self.center, m)
        n = float(release.n_reports)
        half = m.half[idx]
        if center:
            g = m.centered()[np.ix_(idx, idx)] * np.outer(half, half)
            mean = m.mid[idx] + half * m.mean()[idx]
        else:
            g = m.gram[np.ix_(idx, idx)] * np.outer(half, half)
            mean = np.zeros(len(idx))
        w, v = np.linalg.eigh(0.5 * (g + g.T))
        order = np.argsort(w)[::-1][:r]
        w, comps = w[order], v[:, order].T
        pivot = np.argmax(np.abs(comps), axis=1)
        signs = np.sign(comps[np.arange(r), pivot])
        signs[signs == 0] = 1.0
        comps = comps * signs[:, None]
        trace = float(np.trace(g))
        self.components_ = comps
        self.eigenvalues_ = w
        self.explained_variance_ = w / n
        self.explained_variance_ratio_ = w / trace if trace > 0 else np.full(r, np.nan)
        self.singular_values_ = np.sqrt(np.maximum(w, 0.0))
        self.mean_ = mean
        self.centered_ = center
        self.feature_names_ = names
        self.n_reports_ = int(release.n_reports)
        return self

    def transform(self, X) -> np.ndarray:
        """Coordinates of rows in the component basis: (X - mean_) @ components_.T."""
        return (_as_matrix(X, self.feature_names_) - self.mean_) @ self.components_.T

    def inverse_transform(self, Z) -> np.ndarray:
        """Back from component coordinates to the analysed columns: Z @ components_ + mean_."""
        return np.atleast_2d(np.asarray(Z, dtype=np.float64)) @ self.components_ + self.mean_

    def projector(self) -> np.ndarray:
        """V^T V, the (p, p) orthogonal projector onto the component span."""
        return self.components_.T @ self.components_
