"""The sketch kind's ridge error floor: what the release Y = S(A + G) + E costs a ridge fit.

Write N = S G + E for the noise of the release (k x d, cells of variance
v = sigma^2 n / k + N_servers server_sigma^2, since S S^T ~ (n/k) I) and split the debiased
Gram Y^T Y - k v I into

    A^T S^T S A   +   (S A)^T N + N^T (S A)   +   (N^T N - k v I)
    (sketch)          (noise x data)              (noise x noise)

For the rows [X, y], the penalty alpha, H = X^T X + alpha I, the optimum theta* with objective
R = F(theta*) and w = [-theta*; 1], the excess ratio F(theta)/F(theta*) - 1 of the debiased
ridge solution is, to second order in the noise, the sum of three terms (docs/accuracy.md):

* sketch: p / (k - p - 1), the excess of least squares on S [X, y] (exact in expectation for a
  Gaussian sketch; block OSNAP measures the same);
* noise x data: f v (||w||^2 p + R tr(H^-1)) / R. (S X)^T N w has covariance
  v ||w||^2 X^T S^T S X, and N_x^T S r (r the residual) covariance v R I; whatever k is,
  v ~ sigma_local^2 (n/k) / lambda_star does not shrink with k;
* noise x noise: f k v^2 (||w||^2 tr(H^-1) + theta*^T H^-1 theta*) / R, from the k independent
  rows of N: it grows with k;

with f = k / (k - p - 1), the finite-k inflation of (X^T S^T S X)^-1 that also gives the sketch
term. The last two are the first-order (delta-method) variance of the errors-in-variables moment
estimator with k observations of noise variance v (Fuller 1987, Theorem 2.2.1); they are exact
as v -> 0. Beyond first order the debiased Gram's own noise inflates them further: measured
(tests/test_sketch_floor.py, docs/accuracy.md) the prediction is within a few per cent when the
noise terms are small and about 15-25 % low when they are of the size of the sketch kind's at
n = 10^6, epsilon = 1.

p is the number of features. Everything is a function of the data (X, y) and the public noise
law; nothing here is private, it is a prediction to compare measured ratios with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FloorTerms:
    """The three terms of the predicted excess ratio (ratio - 1)."""

    sketch: float
    cross: float
    noise: float

    @property
    def excess(self) -> float:
        return self.sketch + self.cross + self.noise

    @property
    def ratio(self) -> float:
        return 1.0 + self.excess


def cell_variance(sigma: float, n: int, k: int, server_variance: float = 0.0) -> float:
    """v = sigma^2 n / k + N server_sigma^2: the noise variance of one released cell."""
    return float(sigma) ** 2 * n / k + float(server_variance)


def ridge_floor(X: np.ndarray, y: np.ndarray, alpha: float, k: int, v: float) -> FloorTerms:
    """The predicted excess of ridge on a sketch release with k rows and cell variance v."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    p = X.shape[1]
    h = X.T @ X + alpha * np.eye(p)
    theta = np.linalg.solve(h, X.T @ y)
    r = X @ theta - y
    big_r = float(r @ r + alpha * theta @ theta)
    hinv = np.linalg.inv(h)
    w2 = 1.0 + float(theta @ theta)
    tr = float(np.trace(hinv))
    if k <= p + 1:
        inf = float("inf")
        return FloorTerms(inf, inf, inf)
    finite_k = k / (k - p - 1)  # E[(X^T S^T S X)^-1] = H^-1 k / (k - p - 1) for a Gaussian S
    sketch_term = p / (k - p - 1)
    cross = finite_k * v * (w2 * p + big_r * tr) / big_r
    noise = finite_k * k * v * v * (w2 * tr + float(theta @ hinv @ theta)) / big_r
    return FloorTerms(sketch_term, cross, noise)
