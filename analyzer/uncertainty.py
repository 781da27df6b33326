"""Standard errors and confidence intervals that account for the release's noise.

Every fit of the analyzer (least squares, ridge, logistic regression's calibration) is a function
theta = f(M_hat) of a released p x p second-moment matrix M_hat over some named columns, and the
law of M_hat - M (M = A^T A over the clipped rows, the non-private moments) is public: it follows
from the study's parameters (sigma, server_sigma, N, k, s, secret_sign) and the exact size n of
the inclusion set, plus, for the sketch kind, M itself, which is estimated by M_hat (a
post-processing: no privacy cost). So the spread of theta over the randomness of the mechanism can
be computed honestly. This module gives that law (:func:`moment_law`), the covariance of a linear
fit by the delta method (:func:`linear_fit_covariance`), of any smooth fit by a numerical Jacobian
(:func:`delta_covariance`), the classical sampling covariance for inference about a population
rather than this data set (:func:`sampling_covariance`), and intervals (:func:`intervals`).

Notation: Cov(dM_ab, dM_ce) is the covariance of two entries of dM = M_hat - M;
``K(L, R)_{ab,ce} = L_ac R_be + L_ae R_bc`` (the symmetrised Kronecker form: the covariance of a
Wishart matrix is K(Sigma, Sigma)).

The additive kinds (gram, moments)
----------------------------------
A client of a gram study shares phi(a) = [a, u(a a^T), 1] (u: the diagonal, then sqrt(2) times
the strict upper triangle; dpsketch/protocol/features.py) plus N(0, sigma^2) per coordinate, and
each server adds N(0, server_sigma^2) per cell of its aggregate (k = s = 1, no rescaling), so every
released coordinate carries independent noise of variance V = n sigma^2 + N server_sigma^2
(``GramSumRelease.coordinate_noise_std`` squared). Undoing u's sqrt(2):

* Var(dM_aa) = V (diagonal of the Gram), Var(dM_ab) = V / 2 (a != b);
* the constant "1" (gram kind only): M_1j = the released row sum, Var = V; M_11 = n, the exact
  public size of the inclusion set (docs/protocol.md section 6c: never the noisy count), Var = 0;
* all entries of the upper triangle independent.

A moments study shares u(a a^T) alone: the same law without the row sum and count (its constant,
if the study has one, is an ordinary column, so M_cc, M_cj follow the Gram rule).

*Why Gaussian.* The noise is an exact discrete Gaussian on the study's grid h Z (docs/protocol.md
section 5a), parameter t_c h = ceil(sigma / h) h, cut at 20 sigma; h < max(sigma, server_sigma
sqrt(s)) 2^-23 (2^-22 = 2.4e-7 for design()'s studies at n = 30,000). Its variance exceeds sigma^2
by a relative 2 h / sigma at most (5e-6 for those studies; where h / sigma is not small the
client noise is itself negligible against the servers'), the discrete Gaussian's variance is
t^2 (1 - O(e^{-2 pi^2 t^2})) and the cut removes mass below 1e-88; section 5a shows the sum of the n
clients' and one server's noise is within statistical distance 1e-25 of a continuous Gaussian
plus a rounding of scale about 16 h. The rows' own rounding to the grid moves an entry by at most
n h / 2, again negligible against the noise. So the Gaussian law with the continuous sigma and
server_sigma is exact for every purpose here.

The sketch kind
---------------
With T = diag(t_i) the secret signs (I without ``secret_sign``), S the k x n block OSNAP matrix of
the inclusion set (unit columns, s entries +-1/sqrt(s) per column, signs from the public hash), G
the clients' noise (iid N(0, sigma^2)) and E the servers' (iid N(0, N server_sigma^2)):

    Y = X + W,   X = S T A,   W = S G + E,   M_hat = Y^T Y - b I,   b = sigma^2 n + k N server_sigma^2

    M_hat - M =  A^T (T S^T S T - I) A   +   X^T W + W^T X   +   (W^T W - b I)
                 D: sketch distortion        C: noise x data     Q: noise x noise

Given S and T, the columns of W are independent N(0, Sigma_W), Sigma_W = sigma^2 S S^T +
N server_sigma^2 I_k, so E[C | S] = 0, E[Q | S] = (trace Sigma_W - b) I = 0 exactly (trace S S^T =
n), and C (linear in W) and Q (quadratic) are uncorrelated (odd Gaussian moments vanish). D is
fixed given S and T. Hence the three terms are uncorrelated and

    Cov(dM) = Cov(D) + E[Cov(C | S)] + E[Cov(Q | S)].

Over the hash of fresh random report ids (and the secret signs) P = S^T S has P_ii = 1 and, for
i != j, P_ij = (1/s) sum_l g_l(i) g_l(j) [h_l(i) = h_l(j)] with mean 0, E[P_ij^2] = 1/(s b) = 1/k,
and E[P_ij P_i'j'] = 0 unless {i, j} = {i', j'} (the hash's independent signs; the secret sign
gives the same). Then:

* D: Cov(D_ab, D_ce) = (1/k)(M_ac M_be + M_ae M_bc) - (2/k) sum_i A_ia A_ib A_ic A_ie. The fourth
  moment sum is n times smaller than the first term for rows of comparable norm and is not
  available from second moments: it is dropped. So Cov(D) = (1/k) K(M, M).
* C: Cov(C_ab, C_ce | S) = K(X^T Sigma_W X, I) + K(I, X^T Sigma_W X), and E[(S^T S)^2] =
  (1 + (n - 1)/k) I (the off-diagonal terms have a lone sign), so E[X^T Sigma_W X] = beta M with
  beta = sigma^2 (1 + (n - 1)/k) + N server_sigma^2 (about v = sigma^2 n / k + N server_sigma^2,
  the cell variance). So E[Cov(C | S)] = beta (K(M, I) + K(I, M)).
* Q: Isserlis: Cov(Q_ab, Q_ce | S) = trace(Sigma_W^2) K(I, I), and E trace((S S^T)^2) =
  E ||P||_F^2 = n + n (n - 1)/k, so gamma = sigma^4 n (1 + (n - 1)/k) + 2 sigma^2 N server_sigma^2 n
  + k N^2 server_sigma^4 (about k v^2).

Altogether Cov(dM) = K(M, M)/k + beta (K(M, I) + K(I, M)) + gamma K(I, I), with M plugged in as
M_hat floored to positive semidefinite. Since beta^2 ~ gamma / k this is close to
K(L, L) with L = (M + k v I) / sqrt(k): the covariance of a Wishart matrix with k degrees of
freedom, as if the release were k Gaussian rows. That is also how the fit behaves at small k:
least squares on k rows has variance k / (k - p - 1) times its first-order (delta-method) value
(the mean of an inverse Wishart), so for the sketch kind :func:`linear_fit_covariance` multiplies
by that factor and :func:`intervals` uses Student's t with k - p degrees of freedom (the law's
``dof`` = k). The direction-wise forms of the three terms (Var(dM w) for a vector w) are those of
:meth:`MomentLaw.product_covariance`; tests/test_uncertainty.py checks the whole covariance
against simulated releases with the real hash.

The hash is deterministic: for one fixed inclusion set D is a fixed (unknown) matrix, and the law
above is the law over the report ids the clients draw (random 128-bit ids from their CSPRNG) and
the secret signs. Intervals therefore have their coverage over repeated releases of the same data,
which is what the tests measure.

Assumptions and where they are weak
-----------------------------------
* Delta method: theta is linearised around M. Good when the noise is small against the data
  (relative standard errors well below 1); the fit's nonlinearity (M_xx^{-1}) biases theta by about
  the squared relative error, which the intervals do not include.
* Penalties are held fixed: a data-dependent penalty (the default ridge alpha) is treated as a
  constant, and its shrinkage bias is not in the interval (measured in docs/accuracy.md,
  "Intervals": it can break coverage of the non-private least-squares coefficient).
* Eigenvalue floors (robust_solve's tau) are held fixed too: a fit with floored directions is
  noise-dominated and its interval is not meaningful.
* Sketch kind: M_hat plugged in for M; the fourth-moment term of D dropped; at small k the
  k / (k - p - 1) correction and t quantiles are rough but conservative (measured at k = 8, p = 4:
  coverage 0.98-1.00, se up to 1.5x the spread; without them 0.77-0.83 on a signed study).
* :func:`sampling_covariance` assumes the classical linear model (homoskedastic errors): second
  moments carry no fourth moments, so no sandwich (heteroskedasticity-robust) form is possible.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

#: The name that stands for the constant 1 in :func:`moment_law` (gram releases: the row sum and
#: the count; any other release: an ordinary column of that name).
CONSTANT = "1"


def _sym_kron_bilinear(left: np.ndarray, right: np.ndarray, a1: np.ndarray, a2: np.ndarray) -> float:
    """sum A1_ab A2_ce K(L, R)_{ab,ce} for symmetric A1, A2: 2 trace(A1 L A2 R^T)."""
    return 2.0 * float(np.sum((left @ a2 @ right.T) * a1))


def upper_pairs(p: int) -> tuple[np.ndarray, np.ndarray]:
    """The (row, column) indices of the upper triangle (diagonal included) of a p x p matrix,
    row-major: the order of :meth:`MomentLaw.upper_covariance`."""
    return np.triu_indices(p)


class MomentLaw:
    """The Gaussian law of dM = M_hat - M, a symmetric p x p matrix of zero mean.

    Subclasses give Cov(dM_ab, dM_ce); everything an estimator needs is a view of it:

    * :meth:`entry_variance`: Var(dM_ab) as a p x p matrix;
    * :meth:`product_covariance`: Cov(dM w) for a fixed p-vector w (p x p): what a linear fit
      needs (d theta = H^{-1} (dM w)_x, w = [-theta; 1]);
    * :meth:`bilinear`: Cov(<A1, dM>, <A2, dM>) for symmetric A1, A2 (any linear functional);
    * :meth:`upper_covariance`: the covariance of the upper-triangle vector of dM (row-major,
      diagonal included; size p(p+1)/2), for Jacobians and for sampling.

    ``dof`` is the degrees of freedom of the Wishart-like law of a sketch release (k), or None for
    the additive kinds (Gaussian, no small-sample correction). ``info`` describes the law in public
    terms (kind and parameters), for reports.
    """

    p: int
    dof: int | None = None
    info: dict

    def covariance(self, a, b, c, e) -> np.ndarray:  # pragma: no cover - abstract
        """Cov(dM_ab, dM_ce), broadcasting over index arrays."""
        raise NotImplementedError

    def entry_variance(self) -> np.ndarray:
        i, j = np.indices((self.p, self.p))
        return np.asarray(self.covariance(i, j, i, j), dtype=np.float64)

    def product_covariance(self, w: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def bilinear(self, a1: np.ndarray, a2: np.ndarray) -> float:  # pragma: no cover - abstract
        """Cov(<A1, dM>, <A2, dM>) for symmetric A1, A2 (Frobenius products)."""
        raise NotImplementedError

    def upper_covariance(self) -> np.ndarray:
        iu, ju = upper_pairs(self.p)
        return np.asarray(self.covariance(iu[:, None], ju[:, None], iu[None, :], ju[None, :]),
                          dtype=np.float64)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` draws of dM (size, p, p) from this Gaussian law: for tests and simulations."""
        cov = self.upper_covariance()
        w, v = np.linalg.eigh(0.5 * (cov + cov.T))
        root = v * np.sqrt(np.maximum(w, 0.0))
        z = rng.standard_normal((size, len(w))) @ root.T
        out = np.zeros((size, self.p, self.p))
        iu, ju = upper_pairs(self.p)
        out[:, iu, ju] = z
        out[:, ju, iu] = z
        return out


@dataclass(frozen=True)
class AdditiveLaw(MomentLaw):
    """Independent entries (the gram and moments kinds): Var(dM_ab) = ``variance[a, b]``, every
    entry of the upper triangle independent of the others.

    In K-form Cov(dM_ab, dM_ce) = V'_ab (delta_ac delta_be + delta_ae delta_bc) with V' the
    variance halved on the diagonal (a diagonal entry meets itself twice).
    """

    variance: np.ndarray
    info: dict = field(default_factory=dict)
    dof: int | None = None

    def __post_init__(self) -> None:
        v = np.asarray(self.variance, dtype=np.float64)
        if v.ndim != 2 or v.shape[0] != v.shape[1] or not np.allclose(v, v.T) or np.any(v < 0):
            raise ValueError("variance must be a symmetric non-negative p x p matrix")
        object.__setattr__(self, "variance", v)

    @property
    def p(self) -> int:  # type: ignore[override]
        return self.variance.shape[0]

    def _half(self) -> np.ndarray:
        return self.variance / (1.0 + np.eye(self.p))

    def covariance(self, a, b, c, e) -> np.ndarray:
        h = self._half()
        same = ((a == c) & (b == e)).astype(float) + ((a == e) & (b == c)).astype(float)
        return h[a, b] * same

    def product_covariance(self, w: np.ndarray) -> np.ndarray:
        """Cov(dM w)_ac = delta_ac sum_b V'_ab w_b^2 + V'_ac w_a w_c."""
        w = np.asarray(w, dtype=np.float64)
        h = self._half()
        return np.diag(h @ (w * w)) + h * np.outer(w, w)

    def bilinear(self, a1: np.ndarray, a2: np.ndarray) -> float:
        """Cov(<A1, dM>, <A2, dM>) for symmetric A1, A2: 2 sum_ab V'_ab A1_ab A2_ab."""
        return 2.0 * float(np.sum(self._half() * a1 * a2))


@dataclass(frozen=True)
class SketchLaw(MomentLaw):
    """The sketch kind's law (module docstring): Cov(dM) = K(M, M)/k + beta (K(M, I) + K(I, M))
    + gamma K(I, I), with M the plugged-in (PSD-floored) second moments."""

    moments: np.ndarray
    k: int
    beta: float
    gamma: float
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        m = np.asarray(self.moments, dtype=np.float64)
        if m.ndim != 2 or m.shape[0] != m.shape[1]:
            raise ValueError("moments must be a p x p matrix")
        object.__setattr__(self, "moments", psd_floor(m))

    @property
    def p(self) -> int:  # type: ignore[override]
        return self.moments.shape[0]

    @property
    def dof(self) -> int:  # type: ignore[override]
        return int(self.k)

    def _terms(self) -> list[tuple[float, np.ndarray, np.ndarray]]:
        m, eye = self.moments, np.eye(self.p)
        return [(1.0 / self.k, m, m), (self.beta, m, eye), (self.beta, eye, m), (self.gamma, eye, eye)]

    def covariance(self, a, b, c, e) -> np.ndarray:
        return sum(coef * (left[a, c] * right[b, e] + left[a, e] * right[b, c])
                   for coef, left, right in self._terms())

    def product_covariance(self, w: np.ndarray) -> np.ndarray:
        """Cov(dM w) = sum over the terms of coef (L (w^T R w) + (L w)(R w)^T); e.g. the noise x
        data part beta (||w||^2 M + (w^T M w) I + M w w^T + w w^T M)."""
        w = np.asarray(w, dtype=np.float64)
        out = np.zeros((self.p, self.p))
        for coef, left, right in self._terms():
            out += coef * (left * float(w @ right @ w) + np.outer(left @ w, right @ w))
        return out

    def bilinear(self, a1: np.ndarray, a2: np.ndarray) -> float:
        """Cov(<A1, dM>, <A2, dM>) for symmetric A1, A2 (Frobenius products)."""
        return sum(coef * _sym_kron_bilinear(left, right, a1, a2) for coef, left, right in self._terms())


def psd_floor(m: np.ndarray) -> np.ndarray:
    """The symmetric part of ``m`` with its negative eigenvalues set to 0."""
    s = 0.5 * (np.asarray(m, dtype=np.float64) + np.asarray(m, dtype=np.float64).T)
    w, v = np.linalg.eigh(s)
    return (v * np.maximum(w, 0.0)) @ v.T


# ---------------------------------------------------------------------------------------------
# the released moments and their law


def moment_law(release, columns: Sequence[str]) -> tuple[np.ndarray, MomentLaw]:
    """The released p x p second-moment matrix over ``columns`` and the public law of its noise.

    ``columns`` are names of the release's columns; the name ``"1"`` (:data:`CONSTANT`) stands for
    the constant 1 of a gram release (its row of M is the released row sum, and M_11 the exact
    report count n). On any other release a constant is an ordinary column of the study (e.g. the
    one a client appends), named as the study names it.

    * :class:`~analyzer.release.GramSumRelease` (gram, moments): M_hat from the release
      (``gram()``, ``row_sum``, ``n_reports``) and an :class:`AdditiveLaw`;
    * :class:`~analyzer.release.SketchRelease` (k > 1): M_hat = the debiased Gram Y^T Y - b I and a
      :class:`SketchLaw` whose M is M_hat floored to PSD;
    * an exact :class:`~analyzer.release.GramRelease` (no noise declared: the non-private
      baseline): its Gram and a zero law (standard errors 0). A noisy GramRelease (the central
      baselines) declares no law: TypeError.

    Raises KeyError for an unknown column (or "1" on a release without a row sum), TypeError for a
    release without a Gram (histogram, l1) and ValueError for a sketch study with k = 1 (its
    Y^T Y is not an estimate of A^T A).
    """
    from .release import GramRelease, GramSumRelease, SketchRelease

    names = list(columns)
    if not names:
        raise ValueError("need at least one column")
    if len(set(names)) != len(names):
        raise ValueError(f"columns must be distinct, got {names}")
    cols = list(release.columns)
    n = int(release.n_reports)
    if isinstance(release, GramSumRelease):
        var = release.coordinate_noise_std ** 2
        gram = release.gram()
        p = len(names)
        m_hat = np.zeros((p, p))
        variance = np.zeros((p, p))
        constant = [name == CONSTANT and name not in cols for name in names]
        for i, a in enumerate(names):
            for j, b in enumerate(names):
                if constant[i] and constant[j]:
                    m_hat[i, j], variance[i, j] = float(n), 0.0
                elif constant[i] or constant[j]:
                    m_hat[i, j], variance[i, j] = _row_sum(release, cols, b if constant[i] else a), var
                else:
                    ia, ib = _index(cols, a), _index(cols, b)
                    m_hat[i, j] = gram[ia, ib]
                    variance[i, j] = var if ia == ib else var / 2.0
        info = {"kind": release.study.kind, "coordinate_variance": var, "n_reports": float(n),
                "sigma": release.sigma, "server_noise_variance": release.server_noise_variance}
        return m_hat, AdditiveLaw(variance=variance, info=info)
    if isinstance(release, SketchRelease):
        study = release.study
        k = int(study.k)
        if k < 2:
            raise ValueError("a sketch study with k = 1 releases the plain sum, not second moments")
        idx = [_index(cols, c) for c in names]
        m_hat = np.asarray(release.gram(debias=True), dtype=np.float64)[np.ix_(idx, idx)]
        s2 = float(release.sigma) ** 2
        nv = float(release.server_noise_variance)  # N server_sigma^2
        spread = 1.0 + (n - 1.0) / k  # E[(S^T S)^2]_ii
        beta = s2 * spread + nv
        gamma = s2 * s2 * n * spread + 2.0 * s2 * nv * n + k * nv * nv
        info = {"kind": "sketch", "k": float(k), "s": float(study.s), "n_reports": float(n),
                "sigma": float(release.sigma), "server_noise_variance": nv, "beta": beta,
                "gamma": gamma, "secret_sign": bool(study.secret_sign)}
        return m_hat, SketchLaw(moments=m_hat, k=k, beta=beta, gamma=gamma, info=info)
    if isinstance(release, GramRelease) and not release.bias and not release.gram_noise_scale:
        idx = [_index(cols, c) for c in names]  # an exact (noise-free) Gram: nothing to add
        m_hat = np.asarray(release.gram(), dtype=np.float64)[np.ix_(idx, idx)]
        return m_hat, AdditiveLaw(variance=np.zeros((len(idx), len(idx))), info={"kind": "exact"})
    kind = getattr(getattr(release, "study", None), "kind", type(release).__name__)
    raise TypeError(f"no second-moment law for a {kind} release (gram, moments and sketch releases have one)")


def _index(cols: list[str], name: str) -> int:
    if name not in cols:
        raise KeyError(f"column {name!r} is not in the release (columns: {cols})")
    return cols.index(name)


def _row_sum(release, cols: list[str], name: str) -> float:
    try:
        row_sum = release.row_sum
    except AttributeError:
        raise KeyError(f"the constant {CONSTANT!r} needs a row sum and count: a {release.study.kind} "
                       f"release has none (name the study's constant column instead)") from None
    return float(row_sum[_index(cols, name)])


# ---------------------------------------------------------------------------------------------
# fits


def _inverse(h: np.ndarray, floor: float) -> np.ndarray:
    """The inverse the estimators apply (analyzer.estimators.robust_solve): eigenvalues floored at
    ``floor`` when it is positive, else the pseudo-inverse."""
    from .estimators import PINV_RCOND

    w, v = np.linalg.eigh(0.5 * (h + h.T))
    if floor > 0:
        inv = 1.0 / np.maximum(w, floor)
    else:
        cutoff = PINV_RCOND * max(float(np.max(np.abs(w))), np.finfo(float).tiny)
        inv = np.where(w > cutoff, 1.0 / np.where(w > cutoff, w, 1.0), 0.0)
    return (v * inv) @ v.T


def _penalty_matrix(penalty, p: int) -> np.ndarray:
    if penalty is None:
        return np.zeros((p, p))
    pen = np.asarray(penalty, dtype=np.float64)
    if pen.ndim == 0:
        return float(pen) * np.eye(p)
    if pen.ndim == 1:
        return np.diag(pen)
    return pen


def small_sample_factor(law: MomentLaw, n_coef: int) -> float:
    """k / (k - p - 1) for a sketch law of k degrees of freedom and p coefficients (the mean of an
    inverse Wishart over its first-order value; inf when k <= p + 1), 1 for the additive kinds."""
    if law.dof is None:
        return 1.0
    spare = law.dof - n_coef - 1
    return law.dof / spare if spare > 0 else math.inf


def linear_fit_covariance(m_hat: np.ndarray, law: MomentLaw, x_idx: Sequence[int], y_idx: int,
                          coef: np.ndarray, penalty=None, floor: float = 0.0,
                          small_sample: bool = True) -> np.ndarray:
    """Covariance, over the release's noise, of theta = (M_xx + P)^{-1} M_xy (the delta method).

    d theta = H^{-1} (dM_xy - dM_xx theta) = H^{-1} (dM w)_x with H = M_xx + P and w = -theta on
    x_idx, 1 on y_idx, 0 elsewhere; so Cov(theta) = H^{-1} Cov(dM w)_xx H^{-1}. ``penalty`` is P:
    None (least squares), a scalar, a vector (its diagonal: give 0 for the intercept) or a matrix;
    it is held fixed. ``floor`` is the estimator's eigenvalue floor tau (H's eigenvalues below it
    are taken as tau, as analyzer.estimators.robust_solve does; 0: the pseudo-inverse). ``coef``
    is the fitted theta (it enters through w). With ``small_sample`` a sketch law's covariance is
    multiplied by :func:`small_sample_factor` (all inf when k <= p + 1: no finite interval).
    """
    m_hat = np.asarray(m_hat, dtype=np.float64)
    x_idx = [int(i) for i in x_idx]
    coef = np.asarray(coef, dtype=np.float64).reshape(-1)
    if coef.shape != (len(x_idx),):
        raise ValueError(f"coef must have {len(x_idx)} entries, got {coef.shape}")
    if int(y_idx) in x_idx:
        raise ValueError("the label cannot also be a feature")
    h_inv = _inverse(m_hat[np.ix_(x_idx, x_idx)] + _penalty_matrix(penalty, len(x_idx)), floor)
    w = np.zeros(m_hat.shape[0])
    w[x_idx] = -coef
    w[int(y_idx)] = 1.0
    c = law.product_covariance(w)[np.ix_(x_idx, x_idx)]
    cov = h_inv @ c @ h_inv
    if small_sample:
        factor = small_sample_factor(law, len(x_idx))
        if not math.isfinite(factor):  # k <= p + 1: the release cannot bound the fit's spread
            return np.full_like(cov, math.inf)
        cov = cov * factor
    return 0.5 * (cov + cov.T)


def sampling_covariance(m_hat: np.ndarray, x_idx: Sequence[int], y_idx: int, coef: np.ndarray,
                        n_reports: int, penalty=None, floor: float = 0.0) -> np.ndarray:
    """The classical sampling covariance of a (penalised) least-squares fit, from the moments.

    For inference about the population the rows were drawn from (y = x theta + e, e iid of
    variance s^2), not about this data set: s^2 = (y^T y - 2 theta^T X^T y + theta^T X^T X theta)
    / (n - p), read from M_hat, and Cov = s^2 H^{-1} X^T X H^{-1} with H = X^T X + P (s^2 (X^T
    X)^{-1} for least squares). X^T X is M_hat's block floored to PSD. Add it to the noise
    covariance of :func:`linear_fit_covariance` for the total (the noise is independent of the
    sample). Homoskedastic errors assumed (second moments carry no fourth moments)."""
    m_hat = np.asarray(m_hat, dtype=np.float64)
    x_idx = [int(i) for i in x_idx]
    y = int(y_idx)
    coef = np.asarray(coef, dtype=np.float64).reshape(-1)
    p = len(x_idx)
    if n_reports <= p:
        raise ValueError(f"need more reports than coefficients ({n_reports} <= {p})")
    mxx = m_hat[np.ix_(x_idx, x_idx)]
    rss = float(m_hat[y, y] - 2.0 * coef @ m_hat[x_idx, y] + coef @ mxx @ coef)
    s2 = max(rss, 0.0) / (n_reports - p)
    h_inv = _inverse(mxx + _penalty_matrix(penalty, p), floor)
    cov = s2 * h_inv @ psd_floor(mxx) @ h_inv
    return 0.5 * (cov + cov.T)


def delta_covariance(fn: Callable[[np.ndarray], np.ndarray], m_hat: np.ndarray, law: MomentLaw,
                     rel_step: float = 0.1) -> np.ndarray:
    """Covariance of fn(M_hat) over the release's noise, for any smooth fn of the moments.

    J, the Jacobian of fn with respect to the upper triangle of M (an entry and its mirror move
    together), by central differences with a step of ``rel_step`` times that entry's noise
    standard deviation (entries without noise, e.g. the exact count, are not moved); then
    Cov = J Cov(upper(dM)) J^T. The step is relative to the noise because that is the scale on
    which fn must be close to linear for the delta method to hold at all; a step there also steps
    over kinks far smaller than the noise (eigenvalue floors). 2 p(p+1)/2 evaluations of fn.
    """
    m_hat = np.asarray(m_hat, dtype=np.float64)
    p = m_hat.shape[0]
    if law.p != p:
        raise ValueError(f"the law is over {law.p} columns, the moments over {p}")
    iu, ju = upper_pairs(p)
    sd = np.sqrt(law.entry_variance()[iu, ju])
    active = np.flatnonzero(sd > 0)
    base = np.asarray(fn(m_hat), dtype=np.float64).reshape(-1)
    jac = np.zeros((base.size, active.size))
    for col, e in enumerate(active):
        step = rel_step * sd[e]
        bump = np.zeros((p, p))
        bump[iu[e], ju[e]] = bump[ju[e], iu[e]] = step
        up = np.asarray(fn(m_hat + bump), dtype=np.float64).reshape(-1)
        down = np.asarray(fn(m_hat - bump), dtype=np.float64).reshape(-1)
        jac[:, col] = (up - down) / (2.0 * step)
    cov_u = law.upper_covariance()[np.ix_(active, active)]
    cov = jac @ cov_u @ jac.T
    return 0.5 * (cov + cov.T)


# ---------------------------------------------------------------------------------------------
# intervals


def standard_errors(cov: np.ndarray) -> np.ndarray:
    """sqrt of the diagonal of a covariance (negative rounding clipped to 0)."""
    return np.sqrt(np.maximum(np.diag(np.asarray(cov, dtype=np.float64)), 0.0))


def quantile(level: float, dof: float | None = None) -> float:
    """The two-sided critical value of a ``level`` interval: normal, or Student's t with ``dof``
    degrees of freedom."""
    if not 0.0 < level < 1.0:
        raise ValueError("level must be in (0, 1)")
    q = 0.5 + level / 2.0
    if dof is None or math.isinf(dof):
        return NormalDist().inv_cdf(q)
    if dof <= 0:
        return math.inf
    from scipy.stats import t  # here: the analyzer starts without scipy.stats

    return float(t.ppf(q, dof))


def interval_dof(law: MomentLaw, n_coef: int) -> float | None:
    """Degrees of freedom for the t quantile of a fit with ``n_coef`` coefficients: k - n_coef for
    a sketch law (the fit behaves as least squares on k rows), None (normal) otherwise."""
    return None if law.dof is None else float(law.dof - n_coef)


def intervals(coef: np.ndarray, cov: np.ndarray, level: float = 0.95,
              dof: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(standard errors, lower, upper) of the ``level`` intervals coef +- q se."""
    coef = np.asarray(coef, dtype=np.float64).reshape(-1)
    se = standard_errors(cov)
    q = quantile(level, dof)
    return se, coef - q * se, coef + q * se
