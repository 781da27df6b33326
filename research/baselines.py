"""The central-model regression baselines the evaluations compare the LTM against.

Plain SSP (:func:`ssp`), AdaSSP (:func:`adassp`, Wang 2018: private lambda_min, adaptive ridge,
budget split in three in GDP), and paper 004's data releases DGM-OLS (:func:`dgm_ols`: noise on
the data matrix, de-biased OLS) and RMGM-OLS (:func:`rmgm_ols`: public random +-1 mixing to k
rows, then noise, plain OLS), each returning a :class:`PrivateFit` at the same (epsilon, delta),
row bound and neighbouring notion as the study it is compared with.
:func:`research.evaluation.central_baselines` runs them all on anyone's data. The LTM, local and
central-Gram releases themselves are simulated by :mod:`analyzer.simulation` (the analyzer's
recommendation uses them too).

These are simulations: noise and mixing matrices come from the numpy ``Generator`` passed in.
They are *not* a privacy mechanism for real data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dpsketch.analyzer.simulation import Target, central_gram, clip_rows, gram_sensitivity, local_release
from dpsketch.protocol import privacy
from dpsketch.protocol.features import symmetric_from_upper, upper_triangle


# ---------------------------------------------------------------------------------------------
# central-model regression baselines: plain SSP, AdaSSP (Wang 2018), DGM-OLS and RMGM-OLS
# (Wu et al. 2022, papers/004)
#
# All of them take the rows' label split (X, y) and a privacy target (analyzer.simulation.Target:
# epsilon, delta, row bound, neighbouring notion; Target.of(study) is a study's), so they run on
# anyone's data without a Study. Rows [x, y] are clipped jointly to L2 norm
# ``target.row_bound`` = B first (idempotent on already clipped data), so ||x|| <= B, |y| <= B and
# ||x|| |y| <= (||x||^2 + y^2) / 2 <= B^2 / 2.
#
# Privacy: every mechanism is a (composition of) Gaussian mechanism(s) with L2 sensitivity
# Delta_i and noise std sigma_i, i.e. mu_i-GDP with mu_i = Delta_i / sigma_i (Dong, Roth, Su
# 2019). Compositions are mu-GDP with mu^2 = sum mu_i^2, exactly, and mu-GDP is (epsilon,
# delta)-DP exactly when delta = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2),
# which is the analytic Gaussian mechanism that privacy.unit_sigma = 1/mu_star computes with
# dp-accounting. So every release below is calibrated to mu = mu_star: exactly (epsilon, delta).


@dataclass(frozen=True, eq=False)
class PrivateFit:
    """A private regression fit: ``coef`` (p,) over the feature columns, the ``mechanism``'s
    name and ``info``: noise stds and sensitivities (public), penalties, the sketch size, and
    the released private statistics where they are small (AdaSSP's noisy X^T X, X^T y and
    lambda_min). Everything in it is post-processing of the release."""

    coef: np.ndarray
    mechanism: str
    info: dict = field(default_factory=dict)


def _clip_xy(X: np.ndarray, y: np.ndarray, row_bound: float) -> tuple[np.ndarray, np.ndarray]:
    X = np.atleast_2d(np.asarray(X, dtype=np.float64))
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but y has {y.shape[0]}")
    rows = clip_rows(np.column_stack([X, y]), row_bound)
    return rows[:, :-1], rows[:, -1]


def _solve(m: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Plain solve of a (possibly badly conditioned) symmetric system; least squares if singular.
    Deliberately *no* eigenvalue floor: the baselines are the published algorithms."""
    m = 0.5 * (m + m.T)
    try:
        return np.linalg.solve(m, rhs)
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(m, rhs, rcond=None)[0]


def xty_sensitivity(row_bound: float, neighbouring: privacy.Neighbouring) -> float:
    """L2 sensitivity of X^T y when every row [x, y] has ||[x, y]|| <= B.

    ||x y|| = ||x|| |y| <= (||x||^2 + y^2) / 2 <= B^2 / 2 (AM-GM), attained by
    x = (B/sqrt 2) e, y = B/sqrt 2. Add/remove moves X^T y by one x y: B^2 / 2. Replace-one moves it
    by x_a y_a - x_b y_b, at most B^2, attained with x_b y_b = -x_a y_a (flip the sign of y).
    """
    if neighbouring == "replace-one":
        return float(row_bound) ** 2
    if neighbouring == "add-remove":
        return float(row_bound) ** 2 / 2.0
    raise ValueError(f"unknown neighbouring notion {neighbouring!r}")


def lambda_min_sensitivity(row_bound: float, neighbouring: privacy.Neighbouring) -> float:
    """Sensitivity of lambda_min(X^T X) for ||x|| <= B: B^2 under *both* notions.

    Weyl: lambda_min(M + E) lies in [lambda_min(M) + lambda_min(E), lambda_min(M) + lambda_max(E)].
    Adding a row: E = x x^T with eigenvalues in [0, B^2]. Replacing a by b: E = b b^T - a a^T and
    -a a^T <= E <= b b^T, so the eigenvalues of E lie in [-B^2, B^2]. Replace-one does not double
    this sensitivity (unlike that of the rows or of the Gram).
    """
    if neighbouring not in ("replace-one", "add-remove"):
        raise ValueError(f"unknown neighbouring notion {neighbouring!r}")
    return float(row_bound) ** 2


def ssp(
    X: np.ndarray,
    y: np.ndarray,
    target: Target,
    *,
    rng: np.random.Generator,
    alpha: float = 0.0,
) -> PrivateFit:
    """Plain sufficient statistics perturbation (Vu and Slavkovic 2009; Wang 2018, Algorithm 1).

    Releases the Gram of the rows [x, y] with :func:`central_gram` (the same release as
    :func:`simulate_central`, noise std ``central_sigma`` = Delta_gram / mu_star per entry of
    u(A^T A)) and solves (G_xx + alpha I) theta = G_xy with a plain solve: no eigenvalue floor,
    no adaptive ridge. ``alpha`` is the penalty of the ridge objective being targeted (0: OLS).
    """
    X, y = _clip_xy(X, y, target.row_bound)
    p = X.shape[1]
    cols = [f"x{i}" for i in range(p)] + ["y"]
    rel = central_gram(np.column_stack([X, y]), cols, target, rng=rng)
    g = rel.gram(debias=False)
    coef = _solve(g[:p, :p] + float(alpha) * np.eye(p), g[:p, p])
    return PrivateFit(coef=coef, mechanism="ssp", info={**rel.info, "alpha": float(alpha)})


#: AdaSSP's failure probability rho (Wang 2018 uses 0.05 in its experiments).
ADASSP_RHO = 0.05


def adassp_sigmas(target: Target) -> dict[str, float]:
    """The three noise stds of :func:`adassp` and their sensitivities.

    The budget is split into three equal Gaussian mechanisms in GDP: mu_star^2 = 3 mu_part^2,
    mu_part = mu_star / sqrt(3), so each part gets noise std Delta_i * sqrt(3) / mu_star =
    Delta_i * sqrt(3) * privacy.unit_sigma(epsilon, delta). Composition of Gaussian mechanisms
    is exact in GDP (mu^2 adds), so the three releases together are exactly mu_star-GDP, i.e.
    exactly (epsilon, delta)-DP -- tighter than Wang's (epsilon/3, delta/3) split through basic
    composition.

    * lambda_min(X^T X): Delta = B^2 (:func:`lambda_min_sensitivity`, both notions);
    * X^T X through u(.) (Frobenius): Delta = :func:`gram_sensitivity` (sqrt 2 B^2 replace-one,
      B^2 add/remove);
    * X^T y: Delta = :func:`xty_sensitivity` (B^2 replace-one, B^2/2 add/remove).
    """
    unit = math.sqrt(3.0) * privacy.unit_sigma(target.epsilon, target.delta)
    bound, neighbouring = target.row_bound, target.neighbouring
    sens = {
        "lambda_min": lambda_min_sensitivity(bound, neighbouring),
        "gram": gram_sensitivity(bound, neighbouring),
        "xty": xty_sensitivity(bound, neighbouring),
    }
    out = {f"sigma_{k}": v * unit for k, v in sens.items()}
    out.update({f"sensitivity_{k}": v for k, v in sens.items()})
    return out


def adassp(
    X: np.ndarray,
    y: np.ndarray,
    target: Target,
    *,
    rng: np.random.Generator,
    alpha: float = 0.0,
    rho: float = ADASSP_RHO,
) -> PrivateFit:
    """AdaSSP (Wang 2018, "Revisiting differentially private linear regression", Algorithm 2).

    With p features, the three noise stds of :func:`adassp_sigmas` (sigma_l, sigma_G, sigma_g)
    and Z ~ N(0, 1):

    1. lambda_tilde = max(0, lambda_min(X^T X) + sigma_l Z - sqrt(log(6/delta)) sigma_l): a private
       lower bound on lambda_min (shifted down by sqrt(log(6/delta)) noise stds, as in the paper);
    2. lambda = max(0, sqrt(p log(2 p^2 / rho)) sigma_G - lambda_tilde): just enough ridge to
       dominate the spectral norm of the Gram noise w.p. 1 - rho;
    3. G = X^T X + W (W symmetric, u(W) ~ N(0, sigma_G^2 I), i.e. Var W_ii = sigma_G^2,
       Var W_ij = sigma_G^2 / 2);
    4. g = X^T y + N(0, sigma_g^2 I_p);
    5. theta = (G + (lambda + alpha) I)^{-1} g.

    ``alpha`` is the penalty of a ridge objective being targeted (0: least squares, Wang's
    setting); AdaSSP's own lambda is added on top. Wang's bounds ||x|| <= X-bar, |y| <= Y-bar
    come from the row bound: X-bar = Y-bar = B, and the product bound ||x|| |y| <= B^2/2.
    Returns the coefficients and, in ``info``, the noise stds, sensitivities, lambda_tilde
    (released) and lambda.
    """
    X, y = _clip_xy(X, y, target.row_bound)
    p = X.shape[1]
    s = adassp_sigmas(target)
    gram = X.T @ X
    lam_min = float(np.linalg.eigvalsh(gram)[0])
    lam_tilde = max(
        0.0,
        lam_min + s["sigma_lambda_min"] * rng.standard_normal()
        - math.sqrt(math.log(6.0 / target.delta)) * s["sigma_lambda_min"],
    )
    lam = max(0.0, math.sqrt(p * math.log(2.0 * p * p / rho)) * s["sigma_gram"] - lam_tilde)
    noisy_gram = symmetric_from_upper(
        upper_triangle(gram) + rng.normal(0.0, s["sigma_gram"], size=p * (p + 1) // 2), p
    )
    noisy_xty = X.T @ y + rng.normal(0.0, s["sigma_xty"], size=p)
    coef = _solve(noisy_gram + (lam + float(alpha)) * np.eye(p), noisy_xty)
    return PrivateFit(
        coef=coef,
        mechanism="adassp",
        info={
            **s,
            "lambda_tilde": lam_tilde,
            "lambda": lam,
            "alpha": float(alpha),
            "rho": rho,
            "gram": noisy_gram,
            "xty": noisy_xty,
        },
    )


#: DGM-OLS / RMGM-OLS add lambda I with lambda = 1e-5 to the 1/n-normalised Hessian (paper 004,
#: section 5.1); in units of sums over rows and of B^2 that is alpha = 1e-5 n B^2.
WU_RIDGE_PER_REPORT = 1e-5


def data_release_sigma(target: Target) -> float:
    """Noise std per entry of the DGM / RMGM released matrix: Delta / mu_star, Delta = 2B
    (replace-one) or B (add/remove), the local model's sigma (:func:`privacy.local_sigma`).

    Paper 004 adds N(0, 4 d_max sigma_{eps,delta}^2) with the classical sigma_{eps,delta} =
    sqrt(2 log(1.25/delta))/eps (valid for eps <= 1) because each entry is bounded by 1, so a
    row of d_max entries moves by at most 2 sqrt(d_max). Here rows are bounded in L2 norm by B,
    the released matrix is the whole row [x, y] (one data owner, or the parties' column blocks
    together), and the noise is the exact analytic Gaussian one.
    """
    return privacy.local_sigma(target.epsilon, target.delta, target.row_bound, target.neighbouring)


def dgm_release(
    X: np.ndarray,
    y: np.ndarray,
    target: Target,
    *,
    rng: np.random.Generator,
) -> np.ndarray:
    """DGM data release (paper 004, Algorithm 1): [X, y] + R, R i.i.d. N(0, sigma^2),
    sigma = :func:`data_release_sigma`. Replacing (adding) a row moves the n x (p+1) matrix by
    at most 2B (B) in Frobenius norm, so this is exactly mu_star-GDP. It is the same release as
    the local model (:func:`analyzer.simulation.simulate_local`); only the training algorithm differs."""
    X, y = _clip_xy(X, y, target.row_bound)
    d = np.column_stack([X, y])
    return local_release(d, [f"c{i}" for i in range(d.shape[1])], target, rng=rng).noisy_rows


def dgm_ols(
    X: np.ndarray,
    y: np.ndarray,
    target: Target,
    *,
    rng: np.random.Generator,
    alpha: float | None = None,
) -> PrivateFit:
    """DGM-OLS (paper 004, Algorithm 1): release [X, y] + R (:func:`dgm_release`), then solve the
    de-biased normal equations

        (Z_x^T Z_x - n sigma^2 I + alpha I) theta = Z_x^T z_y

    (the paper's (1/n) form times n). ``alpha`` defaults to the paper's 1e-5 n B^2 (its lambda =
    1e-5 on the normalised Hessian); pass the evaluation's ridge penalty to target that
    objective. No eigenvalue floor: the de-biased Hessian can have tiny or negative eigenvalues,
    the "small eigenvalue problem" that the paper documents and RMGM avoids.
    """
    z = dgm_release(X, y, target, rng=rng)
    n = z.shape[0]
    sigma = data_release_sigma(target)
    coef, alpha, h = _released_ols(z, n, target.row_bound, alpha, noise_energy=n * sigma**2)
    return PrivateFit(coef=coef, mechanism="dgm_ols", info={
        "sigma": sigma, "sensitivity": privacy.sensitivity(target.row_bound, target.neighbouring), "alpha": alpha,
        "hessian_lambda_min": float(np.linalg.eigvalsh(h)[0])})


def _released_ols(z: np.ndarray, n: int, row_bound: float, alpha: float | None, *,
                  noise_energy: float) -> tuple[np.ndarray, float, np.ndarray]:
    """Least squares on a released matrix z = [Z_x, z_y] (DGM's noisy rows, RMGM's mixed ones):
    solve (Z_x^T Z_x - noise_energy I + alpha I) theta = Z_x^T z_y, ``noise_energy`` the known
    noise on the Hessian's diagonal that is subtracted (0: none). ``alpha`` None is paper 004's
    1e-5 n B^2. Returns (theta, alpha, the Hessian)."""
    p = z.shape[1] - 1
    if alpha is None:
        alpha = WU_RIDGE_PER_REPORT * n * row_bound**2
    zx, zy = z[:, :p], z[:, p]
    h = zx.T @ zx - (noise_energy - float(alpha)) * np.eye(p)
    return _solve(h, zx.T @ zy), float(alpha), h


def rmgm_k(n: int, epsilon: float, delta: float, p: int = 1) -> int:
    """Mixing rows for RMGM-OLS: k = sqrt(n) / sigma_{eps,delta}, paper 004's choice in its
    synthetic experiments (Theorem 2 balances the JL and noise terms at
    k = O(sqrt(n d / d_max) / sigma_{eps,delta}); with one owner of the whole row d_max ~ d and
    the constant is 1). sigma_{eps,delta} is the noise per unit sensitivity, here the exact
    privacy.unit_sigma. Never fewer than 2 (p + 1) rows for p features: with k close to p the
    sketched least squares is ill-posed (its excess risk grows like p / (k - p)), which the
    asymptotic rule ignores at small n; never more than n."""
    k = int(round(math.sqrt(n) / privacy.unit_sigma(epsilon, delta)))
    return int(min(max(k, 2 * (p + 1)), max(n, 1)))


#: Rows of the data matrix mixed per chunk in :func:`rmgm_release` (bounds memory at k x chunk).
RMGM_CHUNK = 1 << 14


def mixing_matrix(k: int, n: int, rng: np.random.Generator, mixing: str = "rademacher") -> np.ndarray:
    """A k x n RMGM mixing matrix with unit-norm columns.

    ``"rademacher"`` (paper 004): entries +-1/sqrt(k), each sign with probability 1/2.
    ``"gaussian"``: i.i.d. N(0, 1) columns normalised to unit length (uniform on the sphere; the
    normalisation keeps the sensitivity exactly that of one row, which raw N(0, 1/k) entries
    would not).
    """
    if mixing == "rademacher":
        bits = np.unpackbits(np.frombuffer(rng.bytes((k * n + 7) // 8), dtype=np.uint8))[: k * n]
        return (bits.reshape(k, n).astype(np.float64) * 2.0 - 1.0) / math.sqrt(k)
    if mixing == "gaussian":
        m = rng.standard_normal((k, n))
        return m / np.linalg.norm(m, axis=0, keepdims=True)
    raise ValueError(f"unknown mixing {mixing!r}")


def rmgm_release(
    X: np.ndarray,
    y: np.ndarray,
    target: Target,
    *,
    rng: np.random.Generator,
    k: int | None = None,
    mixing: str = "rademacher",
) -> tuple[np.ndarray, int, float]:
    """RMGM data release (paper 004, Algorithm 2): M [X, y] + R with R i.i.d. N(0, sigma^2) on a
    k x (p+1) matrix and a public random mixing matrix M (k x n).

    ``mixing="rademacher"`` (the paper): M = B / sqrt(k), B_ij = +-1 with probability 1/2.
    ``mixing="gaussian"``: columns of M uniform on the unit sphere (normalised Gaussians).
    Either way every column of M has unit norm, so replacing (adding) row i moves the release by
    M_i (a_i - a'_i)^T, of Frobenius norm ||a_i - a'_i|| <= 2B (B): for any *fixed* M -- it is
    public, shared by the parties -- the release is a Gaussian mechanism with sensitivity
    privacy.sensitivity(B, notion) and sigma = :func:`data_release_sigma` makes it exactly
    mu_star-GDP. This is the paper's own analysis (Gaussian mechanism conditional on B), with the
    exact analytic calibration; the mixing itself buys no privacy here, so no Renyi-DP
    amplification argument (as in paper 002's Gaussian mixing mechanism) is used or needed.

    Returns (release (k x (p+1)), k, sigma). M is drawn from ``rng`` in chunks of rows.
    """
    X, y = _clip_xy(X, y, target.row_bound)
    d = np.column_stack([X, y])
    n, cols = d.shape
    k = rmgm_k(n, target.epsilon, target.delta, cols - 1) if k is None else int(k)
    if k < 1:
        raise ValueError("k must be at least 1")
    if mixing not in ("rademacher", "gaussian"):
        raise ValueError(f"unknown mixing {mixing!r}")
    out = np.zeros((k, cols))
    for start in range(0, n, RMGM_CHUNK):
        block = d[start : start + RMGM_CHUNK]
        out += mixing_matrix(k, block.shape[0], rng, mixing) @ block
    sigma = data_release_sigma(target)
    return out + rng.normal(0.0, sigma, size=out.shape), k, sigma


def rmgm_ols(
    X: np.ndarray,
    y: np.ndarray,
    target: Target,
    *,
    rng: np.random.Generator,
    alpha: float | None = None,
    k: int | None = None,
    mixing: str = "rademacher",
    debias: bool = False,
) -> PrivateFit:
    """RMGM-OLS (paper 004, Algorithm 2): release M [X, y] + R (:func:`rmgm_release`, k rows,
    default :func:`rmgm_k`) and solve ordinary least squares on it,

        (Y_x^T Y_x + alpha I) theta = Y_x^T y_y,

    *without* de-biasing (the paper's point: the noise energy k sigma^2 is o(n), so the Hessian
    stays positive definite and the bias vanishes as n grows). ``debias=True`` subtracts
    k sigma^2 I anyway (not in the paper). ``alpha`` defaults to the paper's 1e-5 n B^2.
    """
    z, k, sigma = rmgm_release(X, y, target, rng=rng, k=k, mixing=mixing)
    n = np.asarray(y).reshape(-1).shape[0]
    coef, alpha, _ = _released_ols(z, n, target.row_bound, alpha, noise_energy=k * sigma**2 if debias else 0.0)
    return PrivateFit(coef=coef, mechanism="rmgm_ols", info={
        "sigma": sigma, "sensitivity": privacy.sensitivity(target.row_bound, target.neighbouring), "k": k,
        "mixing": mixing, "alpha": alpha, "debias": debias})
