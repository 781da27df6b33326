"""Statistics of a released noisy histogram (the "histogram" study kind).

A histogram release is the true cell counts h plus independent N(0, v) noise g on every cell,
with v public (n sigma^2 + N server_sigma^2 for the LTM; other values for the baselines) and
the number of reports n known exactly. Everything here is post-processing of the release and of
those public numbers, so it is as private as the release.

scikit-learn conventions: hyperparameters go to ``__init__``, ``fit(hist)`` takes a
:class:`NoisyHistogram` and returns ``self``, learned values end in ``_``. Validation of the
hyperparameters against the histogram happens in ``fit`` (only then is the spec known) and
raises ``ValueError`` naming the column and what was wrong.

Pairwise statistics as quadratic forms
--------------------------------------
Ghazi et al. (NeurIPS 2023, ../shared/papers/001) write pairwise statistics (Kendall's tau, AUC,
Gini mean difference, Gini-Simpson diversity) as quadratic forms h^T K h of the histogram. With
y = h + g, g ~ N(0, v I) and K_s = (K + K^T) / 2:

* E[y^T K y] = h^T K h + v tr(K): the plug-in is biased by v tr(K), so we subtract it. (Several
  of the kernels below have a zero diagonal, tr(K) = 0, and need no correction; the Gini-Simpson
  sum of squares, the tie counts of tau-b and the squared mean of a variance do.)
* For q_i(y) = y^T K_i y + a_i^T y + c_i, the noisy value is q_i(h) + grad_i^T g + g^T K_is g
  (minus its mean) with grad_i = 2 K_is h + a_i, the two parts uncorrelated, so
  Cov(q_i, q_j) = v grad_i . grad_j + 2 v^2 tr(K_is K_js). This holds the special cases:
  Var = 4 v h^T K^2 h + 2 v^2 tr(K^2) for a pure quadratic form and v ||a||^2 for a linear one.
* grad_i . grad_j is unknown (it involves h); its plug-in from y is biased by 4 v tr(K_is K_js),
  which we subtract. The variance of the one combination a statistic needs (a single form, or
  the delta method's gradient-weighted sum) then has its data part floored at 0
  (:class:`FormEstimates`).

Ratios (tau-b, AUC with its noisy class sizes) and other smooth functions of several forms get
their standard error by the delta method, gradient^T Cov gradient. All of that algebra is in
:class:`QuadraticForm`, :func:`estimate_forms` and :class:`FormEstimates`; each statistic only
states its kernels and, for a ratio, the gradient of the ratio.

Memory
------
Histograms have up to 65,536 cells, so a dense cells x cells K (32 GiB) is never built. Every
kernel here is a sum of Kronecker products of per-axis m x m matrices (m <= 4096 bins), given by
their entries as a vectorised function of (row, column) (:class:`AxisMatrix`); a product
(A kron B) vec(Y) is A Y B^T on the grid, and a per-axis matrix is materialised in row blocks of
at most 2^20 entries (8 MiB), so the largest temporaries are a block and the grid itself. Traces
factor over the axes: tr((A kron B)(C kron D)) = tr(AC) tr(BD), computed blockwise in O(m^2).
One-column statistics run on the column's marginal (:meth:`NoisyHistogram.marginal`), which is
again a histogram with independent Gaussian noise per cell.

Marginal histograms
-------------------
A study whose bins say ``marginal: true`` (docs/protocol.md section 2b) releases each axis' cells
side by side, not a joint grid: every client has one 1 in every axis' block. Its release splits
into one 1-D histogram per axis (:meth:`NoisyHistogram.marginal`, :meth:`NoisyHistogram.split`),
each cell with the same N(0, v) noise as the release (the blocks are disjoint cells, nothing is
summed), and every one-column statistic runs on it as on a one-axis study. Statistics of the
joint law (Kendall's tau, AUC, Gini-Simpson over all cells) need a joint grid and refuse it.

The REST routes
---------------
``install`` adds the analyzer's routes for histogram studies (the view and the statistics above).
Each route fits one estimator on the released histogram and answers its value, its standard
error from the known noise law and a confidence interval. Wrong axes, a statistic the study's
bins cannot give (quantiles of a categorical axis, Kendall's tau of one axis or of a marginal
histogram) and non-histogram studies are 422 ``invalid-request``. A marginal histogram's view
answers per axis; its one-column statistics take the axis by ``column``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np

from pydantic import BaseModel, ConfigDict, Field

from dpsketch.protocol.histogram import OTHER, Axis, HistogramSpec

from ..release import HistogramRelease, Release
from .routes import fitting, json_finite, refuse

if TYPE_CHECKING:
    from fastapi import FastAPI

#: Entries of one materialised block of a per-axis matrix (8 MiB of float64).
BLOCK_ENTRIES = 1 << 20


# --------------------------------------------------------------------------------------------
# The release


@dataclass(frozen=True, eq=False)
class NoisyHistogram:
    """A released histogram: true counts plus independent N(0, ``noise_variance``) per cell.

    ``counts`` is flat (``spec.cells``), row-major over the axes (cell = i1 * bins2 + i2), or for
    a marginal spec the axes' blocks one after the other, as the servers release it;
    ``noise_variance`` 0 means exact counts. ``n_reports`` is exact and public
    (the servers count the accepted reports), which is why statistics normalise by it rather than
    by the noisy total. (``eq=False``: comparing arrays field by field has no single truth value.)
    """

    spec: HistogramSpec
    counts: np.ndarray
    noise_variance: float
    n_reports: int

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.float64).reshape(-1)
        if counts.size != self.spec.cells:
            raise ValueError(f"counts has {counts.size} values but the spec has {self.spec.cells} "
                             f"cells (shape {self.spec.shape})")
        if not np.all(np.isfinite(counts)):
            raise ValueError("counts must be finite")
        v = float(self.noise_variance)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"noise_variance must be a finite number >= 0, got {self.noise_variance!r}")
        n = int(self.n_reports)
        if n != self.n_reports or n < 0:
            raise ValueError(f"n_reports must be a non-negative integer, got {self.n_reports!r}")
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "noise_variance", v)
        object.__setattr__(self, "n_reports", n)

    @property
    def is_joint(self) -> bool:
        """Whether the cells form one grid over all axes (not a marginal histogram of 2+ axes)."""
        return not (self.spec.marginal and len(self.spec.axes) > 1)

    def grid(self) -> np.ndarray:
        """The counts as an array of ``spec.shape`` (a view); a marginal histogram of several axes
        has no grid (ValueError: take :meth:`marginal` of a column)."""
        if not self.is_joint:
            raise ValueError(f"a marginal histogram ({', '.join(self.spec.columns)}) has no joint grid: "
                             f"take one column's histogram (marginal(column))")
        return self.counts.reshape(self.spec.shape)

    def split(self) -> list["NoisyHistogram"]:
        """One 1-D histogram per axis, in axis order (:meth:`marginal` of every column)."""
        return [self.marginal(c) for c in self.spec.columns]

    def marginal(self, column: str) -> "NoisyHistogram":
        """The one-axis histogram of ``column``.

        Of a joint grid: the sum over the other axis. A marginal cell sums ``bins`` independent
        noisy cells of the other axis, so its noise is N(0, v * bins), still independent across
        cells: the marginal is itself a release of the same kind and every one-column statistic
        can run on it. Of a marginal histogram: the column's block of cells as released, with
        the release's own noise N(0, v) per cell.
        """
        index, axis = axis_of(self, column)
        if len(self.spec.axes) == 1:
            return self
        if self.spec.marginal:
            start = self.spec.offsets[index]
            return NoisyHistogram(HistogramSpec(axes=[axis]), self.counts[start:start + axis.bins],
                                  self.noise_variance, self.n_reports)
        other = 1 - index
        counts = self.grid().sum(axis=other)
        return NoisyHistogram(HistogramSpec(axes=[axis]), counts,
                              self.noise_variance * self.spec.axes[other].bins, self.n_reports)


def axis_of(hist: NoisyHistogram, column: str) -> tuple[int, Axis]:
    """(position, axis) of ``column``, or a ValueError listing the histogram's columns."""
    for i, a in enumerate(hist.spec.axes):
        if a.column == column:
            return i, a
    raise ValueError(f"the histogram has no column {column!r} (its columns: "
                     f"{', '.join(map(repr, hist.spec.columns))})")


def _numeric_axis(hist: NoisyHistogram, column: str, what: str) -> Axis:
    _, axis = axis_of(hist, column)
    if not axis.numeric:
        raise ValueError(f"{what} needs a numeric column, but {column!r} is categorical "
                         f"(categories {axis.categories}): its bins have no values to order or "
                         f"average")
    return axis


def _check_hist(hist: object) -> NoisyHistogram:
    if not isinstance(hist, NoisyHistogram):
        raise TypeError(f"fit() takes a NoisyHistogram, got {type(hist).__name__}")
    return hist


def _joint(hist: NoisyHistogram, what: str) -> None:
    """A statistic of the joint law needs a joint grid, which a marginal histogram does not have."""
    if not hist.is_joint:
        raise ValueError(f"{what} needs a joint histogram (one grid over the axes); this one is marginal "
                         f"(each of {', '.join(map(repr, hist.spec.columns))} counted on its own), so "
                         f"only one-column statistics apply")


# --------------------------------------------------------------------------------------------
# The one generic piece: debiased quadratic / bilinear forms of a noisy histogram


class AxisMatrix:
    """An m x m matrix on one axis, given by its entries ``entry(i, k)`` (vectorised, broadcasting
    over integer index arrays) so that it can be materialised a block of rows at a time.

    Small matrices (<= ``BLOCK_ENTRIES`` entries) are materialised once and cached; larger ones
    are rebuilt block by block on each use (time O(m^2) per product, memory one block).
    """

    def __init__(self, m: int, entry: Callable[[np.ndarray, np.ndarray], np.ndarray],
                 transposed: bool = False):
        self.m = int(m)
        self._entry = entry
        self._transposed = transposed
        self._dense: np.ndarray | None = None
        self._t: AxisMatrix | None = None

    @property
    def T(self) -> "AxisMatrix":
        """The transpose (cached both ways, so a materialised block is built once each)."""
        if self._t is None:
            self._t = AxisMatrix(self.m, self._entry, not self._transposed)
            self._t._t = self
        return self._t

    def _slices(self) -> list[slice]:
        step = max(1, BLOCK_ENTRIES // max(self.m, 1))
        return [slice(s, min(s + step, self.m)) for s in range(0, self.m, step)]

    def rows(self, sl: slice) -> np.ndarray:
        """Rows ``sl`` of the matrix, dense (len x m)."""
        if self.m * self.m <= BLOCK_ENTRIES:
            if self._dense is None:
                self._dense = self._build(slice(0, self.m))
            return self._dense[sl]
        return self._build(sl)

    def _build(self, sl: slice) -> np.ndarray:
        i = np.arange(sl.start, sl.stop)[:, None]
        k = np.arange(self.m)[None, :]
        block = self._entry(k, i) if self._transposed else self._entry(i, k)
        return np.array(np.broadcast_to(block, (sl.stop - sl.start, self.m)), dtype=np.float64)

    def apply(self, x: np.ndarray, axis: int) -> np.ndarray:
        """This matrix applied along ``axis`` of the grid ``x``."""
        xt = np.moveaxis(x, axis, 0)
        flat = xt.reshape(self.m, -1)
        out = np.empty_like(flat)
        for sl in self._slices():
            out[sl] = self.rows(sl) @ flat
        return np.moveaxis(out.reshape(xt.shape), 0, axis)

    def trace(self) -> float:
        i = np.arange(self.m)
        return float(np.sum(np.broadcast_to(self._entry(i, i), (self.m,))))

    def trace_product(self, other: "AxisMatrix") -> tuple[float, float]:
        """(tr(self @ other), sum(self * other)), i.e. tr(AC) and tr(AC^T), blockwise."""
        tr = inner = 0.0
        other_t = other.T
        for sl in self._slices():
            a = self.rows(sl)
            tr += float(np.sum(a * other_t.rows(sl)))  # sum_k A_ik C_ki
            inner += float(np.sum(a * other.rows(sl)))
        return tr, inner


# Per-axis building blocks (entries as functions of the row and column index arrays).

def identity(m: int) -> AxisMatrix:
    return AxisMatrix(m, lambda i, k: (i == k).astype(np.float64))


def ones(m: int) -> AxisMatrix:
    return AxisMatrix(m, lambda i, k: np.ones(np.broadcast_shapes(np.shape(i), np.shape(k))))


def sign_matrix(m: int) -> AxisMatrix:
    """sign(i - k): +1 when bin i is above bin k (antisymmetric)."""
    return AxisMatrix(m, lambda i, k: np.sign(i - k).astype(np.float64))


def above_half_ties(m: int) -> AxisMatrix:
    """1 if i > k, 1/2 if i == k, 0 below: the Mann-Whitney kernel."""
    return AxisMatrix(m, lambda i, k: (i > k) + 0.5 * (i == k))


def outer(u: np.ndarray, w: np.ndarray | None = None) -> AxisMatrix:
    """u w^T (u u^T by default)."""
    u = np.asarray(u, dtype=np.float64)
    w = u if w is None else np.asarray(w, dtype=np.float64)
    return AxisMatrix(len(u), lambda i, k: u[i] * w[k])


def abs_difference(x: np.ndarray) -> AxisMatrix:
    """|x_i - x_k|: the Gini mean difference kernel."""
    x = np.asarray(x, dtype=np.float64)
    return AxisMatrix(len(x), lambda i, k: np.abs(x[i] - x[k]))


@dataclass
class QuadraticForm:
    """q(h) = h^T K h + a^T h + c with K = sum_t coef_t * kron(factors_t) over the axes.

    ``terms`` is a list of (coef, (one AxisMatrix per axis of the histogram)); K need not be
    symmetric (a bilinear form u^T M w between two sets of cells is the quadratic form with the
    block M placed off the diagonal), only its symmetric part matters. ``linear`` is flat over
    the cells (or None), ``const`` a known number (e.g. n^2 with n public).
    """

    terms: list[tuple[float, tuple[AxisMatrix, ...]]] = field(default_factory=list)
    linear: np.ndarray | None = None
    const: float = 0.0

    def apply(self, grid: np.ndarray, transpose: bool = False) -> np.ndarray:
        out = np.zeros_like(grid)
        for coef, factors in self.terms:
            z = grid
            for ax, f in enumerate(factors):
                z = (f.T if transpose else f).apply(z, ax)
            out += coef * z
        return out

    def apply_sym(self, grid: np.ndarray) -> np.ndarray:
        """K_s y = (K y + K^T y) / 2 on the grid."""
        return 0.5 * (self.apply(grid) + self.apply(grid, transpose=True))

    def trace(self) -> float:
        return float(sum(c * math.prod(f.trace() for f in fs) for c, fs in self.terms))

    def trace_sym_product(self, other: "QuadraticForm") -> float:
        """tr(K_s L_s) = (tr(K L) + tr(K L^T)) / 2, factored over the axes of each term pair."""
        total = 0.0
        for c1, f1 in self.terms:
            for c2, f2 in other.terms:
                pairs = [a.trace_product(b) for a, b in zip(f1, f2)]
                total += c1 * c2 * 0.5 * (math.prod(p[0] for p in pairs)
                                          + math.prod(p[1] for p in pairs))
        return total


@dataclass(frozen=True)
class FormEstimates:
    """Debiased values of several forms of one release, and what their (co)variance needs.

    ``gradient_gram[i, j]`` is the unbiased estimate of grad_i . grad_j (grad_i = 2 K_is h + a_i),
    ``traces[i, j]`` = tr(K_is K_js) (exact, data-free). The variance of any linear combination
    w . q (the delta method's linearisation of a ratio, or a single form) is
    v w^T G w + 2 v^2 w^T T w; the data part w^T G w is floored at 0 for that very combination,
    which is the least correction that keeps the variance a variance (projecting the whole G onto
    the PSD cone instead would inflate every se whenever some other combination came out
    negative).
    """

    values: np.ndarray
    gradient_gram: np.ndarray
    traces: np.ndarray
    noise_variance: float

    def variance(self, weights: Sequence[float]) -> float:
        w = np.asarray(weights, dtype=np.float64)
        v = self.noise_variance
        return v * max(float(w @ self.gradient_gram @ w), 0.0) + 2.0 * v * v * float(w @ self.traces @ w)

    def se(self, weights: Sequence[float]) -> float:
        return math.sqrt(self.variance(weights))

    def ses(self) -> np.ndarray:
        """The standard error of each form on its own."""
        return np.array([self.se(e) for e in np.eye(len(self.values))])

    def cov(self) -> np.ndarray:
        """A covariance matrix of all the forms: G projected onto the PSD cone (for joint use;
        somewhat conservative under heavy noise, see the class docstring)."""
        g = self.gradient_gram
        w, vec = np.linalg.eigh(0.5 * (g + g.T))
        v = self.noise_variance
        return v * (vec * np.maximum(w, 0.0)) @ vec.T + 2.0 * v * v * self.traces


def estimate_forms(hist: NoisyHistogram, forms: Sequence[QuadraticForm]) -> FormEstimates:
    """Unbiased estimates of q_i(h) from the release, with what their (co)variance needs.

    value_i = y^T K_i y - v tr(K_i) + a_i^T y + c_i (unbiased);
    Cov_ij = v grad_i . grad_j + 2 v^2 tr(K_is K_js), with grad_i . grad_j estimated by the
    debiased (2 K_is y + a_i) . (2 K_js y + a_j) - 4 v tr(K_is K_js) (module docstring).
    """
    v = hist.noise_variance
    flat = hist.counts
    y = hist.grid()
    k = len(forms)
    values = np.empty(k)
    grads = np.empty((k, flat.size))
    for i, f in enumerate(forms):
        ksy = f.apply_sym(y).reshape(-1) if f.terms else np.zeros(flat.size)
        lin = np.zeros(flat.size) if f.linear is None else np.asarray(f.linear, dtype=np.float64)
        values[i] = float(flat @ ksy) - v * f.trace() + float(lin @ flat) + f.const
        grads[i] = 2.0 * ksy + lin
    if v == 0.0:
        zero = np.zeros((k, k))
        return FormEstimates(values, zero, zero, 0.0)
    traces = np.array([[forms[i].trace_sym_product(forms[j]) if forms[i].terms and forms[j].terms
                        else 0.0 for j in range(k)] for i in range(k)])
    return FormEstimates(values, grads @ grads.T - 4.0 * v * traces, traces, v)


# --------------------------------------------------------------------------------------------
# Estimators


class _Estimator:
    """Shared plumbing: the confidence level, the normal quantile, a readable repr."""

    def _z(self) -> float:
        c = self.confidence  # type: ignore[attr-defined]
        if not 0.0 < c < 1.0:
            raise ValueError(f"confidence must be in (0, 1), got {c!r}")
        return NormalDist().inv_cdf(0.5 + c / 2.0)

    def _interval(self, estimate: float, se: float, low: float = -np.inf,
                  high: float = np.inf) -> np.ndarray:
        """estimate +- z se, intersected with the statistic's range (the truth lies in it, so this
        never loses coverage)."""
        z = self._z()
        return np.clip(np.array([estimate - z * se, estimate + z * se]), low, high)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.endswith("_"))
        return f"{type(self).__name__}({params})"


def _pairs(n: int, what: str) -> float:
    if n < 2:
        raise ValueError(f"{what} needs at least 2 reports, the histogram has {n}")
    return float(n) * (n - 1)


class Counts(_Estimator):
    """Cell counts and proportions with confidence intervals from the known noise law.

    Each released count is the true count plus N(0, v), so counts +- z sqrt(v) covers it with
    probability exactly ``confidence`` (and /n for proportions, n being exact).

    Attributes: ``counts_``, ``proportions_`` (grid shape), ``se_`` (sqrt v), ``proportions_se_``
    (sqrt v / n), ``counts_ci_``, ``proportions_ci_`` (grid shape + (2,)), and
    ``nonnegative_counts_``: the Euclidean projection of the noisy counts onto
    {c >= 0, sum c = n} (the scaled simplex), i.e. the nearest histogram consistent with what is
    known for sure. It is post-processing (as private), keeps the exact total, and is never
    farther from the true counts than the release is (a projection onto a convex set containing
    the truth), but it is biased upwards for small cells, so the intervals stay on the raw counts.
    """

    def __init__(self, confidence: float = 0.95):
        self.confidence = confidence

    def fit(self, hist: NoisyHistogram) -> "Counts":
        hist = _check_hist(hist)
        z = self._z()
        n = hist.n_reports
        self.counts_ = hist.grid().copy()
        self.se_ = math.sqrt(hist.noise_variance)
        self.counts_ci_ = np.stack([self.counts_ - z * self.se_, self.counts_ + z * self.se_], -1)
        scale = 1.0 / n if n > 0 else np.nan
        self.proportions_ = self.counts_ * scale
        self.proportions_se_ = self.se_ * scale
        self.proportions_ci_ = self.counts_ci_ * scale
        self.nonnegative_counts_ = project_simplex(hist.counts, float(n)).reshape(hist.spec.shape)
        return self


def project_simplex(x: np.ndarray, total: float) -> np.ndarray:
    """Euclidean projection of ``x`` onto {c >= 0, sum c = total} (sort-based, O(k log k))."""
    x = np.asarray(x, dtype=np.float64)
    if total <= 0:
        return np.zeros_like(x)
    u = np.sort(x)[::-1]
    css = np.cumsum(u) - total
    idx = np.arange(1, x.size + 1)
    rho = np.nonzero(u - css / idx > 0)[0][-1]
    return np.maximum(x - css[rho] / (rho + 1), 0.0)


class Quantiles(_Estimator):
    """Quantiles of a numeric column from its noisy binned CDF.

    ``cdf_[j]`` estimates P(X < edges[j]): the noisy cumulative counts / n, made non-decreasing by
    isotonic regression (least squares, scipy's PAVA) and clipped to [0, 1]; P(X < -inf) = 0 and
    P(X < +inf) = 1 are exact (n is public), so the estimated CDF is a proper one. A quantile is
    interpolated linearly inside its bin (values assumed spread evenly within a bin); one falling
    in an unbounded outer bin cannot be located, so it is returned as that bin's edge and flagged
    in ``clipped_``. Attributes: ``edges_``, ``cdf_``, ``quantiles_``, ``clipped_`` (aligned with
    ``probabilities``).
    """

    def __init__(self, column: str, probabilities: Sequence[float] = (0.25, 0.5, 0.75)):
        self.column = column
        self.probabilities = probabilities

    def fit(self, hist: NoisyHistogram) -> "Quantiles":
        hist = _check_hist(hist)
        axis = _numeric_axis(hist, self.column, "Quantiles")
        p = np.atleast_1d(np.asarray(self.probabilities, dtype=np.float64))
        if p.ndim != 1 or np.any(~np.isfinite(p)) or np.any((p < 0) | (p > 1)):
            raise ValueError(f"probabilities must be numbers in [0, 1], got {self.probabilities!r}")
        n = hist.n_reports
        if n < 1:
            raise ValueError("Quantiles needs at least 1 report")
        counts = hist.marginal(self.column).counts
        edges = np.asarray(axis.edges, dtype=np.float64)
        raw = np.cumsum(counts)[:-1] / n                # P(X < e_j), j = 0 .. m-2
        from scipy.optimize import isotonic_regression  # here: scipy.optimize is a third of the
        # analyzer's start-up imports, and only histogram quantiles need it
        cdf = np.clip(isotonic_regression(raw).x, 0.0, 1.0)
        q = np.empty(p.size)
        clipped = np.zeros(p.size, dtype=bool)
        for t, pt in enumerate(p):
            # first edge whose CDF reaches pt (for pt = 0: first edge with mass below it)
            j = int(np.searchsorted(cdf, pt, side="left" if pt > 0 else "right"))
            if j == 0:
                q[t], clipped[t] = edges[0], True
            elif j == cdf.size:
                q[t], clipped[t] = edges[-1], True
            else:
                f0, f1 = cdf[j - 1], cdf[j]
                q[t] = edges[j - 1] + (pt - f0) / (f1 - f0) * (edges[j] - edges[j - 1])
        self.edges_ = edges
        self.cdf_ = cdf
        self.quantiles_ = q
        self.clipped_ = clipped
        return self


class BinnedMoments(_Estimator):
    """Mean and variance of a numeric column with each value replaced by its bin's
    representative (``Axis.representatives()``: midpoints, outer bins their edge).

    mean = r^T c / n (linear, n exact: unbiased); variance (``ddof`` as numpy's) =
    (r^2)^T c / n - (r^T c)^2 / n^2, whose square term is the quadratic form c^T r r^T c, debiased
    by v ||r||^2, so variance_ is unbiased too (and can come out negative for a nearly constant
    column under heavy noise). Attributes: ``mean_``, ``variance_``, ``mean_se_``,
    ``variance_se_``, ``mean_ci_``, ``variance_ci_`` (floored at 0).
    """

    def __init__(self, column: str, ddof: int = 0, confidence: float = 0.95):
        self.column = column
        self.ddof = ddof
        self.confidence = confidence

    def fit(self, hist: NoisyHistogram) -> "BinnedMoments":
        hist = _check_hist(hist)
        axis = _numeric_axis(hist, self.column, "BinnedMoments")
        n = hist.n_reports
        if n - self.ddof <= 0:
            raise ValueError(f"BinnedMoments needs more than ddof={self.ddof} reports, has {n}")
        marg = hist.marginal(self.column)
        r = axis.representatives()
        scale = n / (n - self.ddof)
        mean = QuadraticForm(linear=r / n)
        var = QuadraticForm(terms=[(-scale / n**2, (outer(r),))], linear=scale * r**2 / n)
        est = estimate_forms(marg, [mean, var])
        self.mean_, self.variance_ = est.values
        self.mean_se_, self.variance_se_ = est.ses()
        self.mean_ci_ = self._interval(self.mean_, self.mean_se_)
        self.variance_ci_ = self._interval(self.variance_, self.variance_se_, 0.0)
        return self


def _ordered(axis: Axis) -> str:
    return "numeric" if axis.numeric else "categorical (category order, other last)"


class KendallTau(_Estimator):
    """Kendall's tau between the two axes of a two-axis histogram, on the bin order.

    Both axes are ordered by bin index: numeric bins by value, categorical ones in category
    order with "other" last. With S the sign matrix (sign(i - k)) of an axis, J all-ones and I
    identity, for the grid counts h:

    * 2 (P - Q) = h^T (S kron S) h (concordant minus discordant pairs; zero diagonal: no bias),
    * n^2 - sum_i row_i^2 = n^2 - h^T (I kron J) h = 2 x (pairs not tied on the first axis),
      likewise J kron I for the second axis (these squares are debiased);
    * tau_a = 2 (P - Q) / (n (n - 1)), tau_b = 2 (P - Q) / sqrt(D1 D2) (scipy's default).

    ``tau_``, ``tau_a_`` are the estimates clipped to [-1, 1] (the raw debiased forms are in
    ``forms_`` / ``forms_se_``: "concordance" 2 (P - Q), "untied_1", "untied_2"); ``se_``,
    ``ci_`` for tau-b by the delta method (``tau_a_se_``, ``tau_a_ci_`` for tau-a).
    """

    def __init__(self, confidence: float = 0.95):
        self.confidence = confidence

    def fit(self, hist: NoisyHistogram) -> "KendallTau":
        hist = _check_hist(hist)
        _joint(hist, "KendallTau")
        if len(hist.spec.axes) != 2:
            raise ValueError(f"KendallTau needs a two-axis histogram, this one has only "
                             f"{hist.spec.columns[0]!r}")
        n = hist.n_reports
        pairs = _pairs(n, "KendallTau")
        a, b = hist.spec.shape
        forms = [QuadraticForm([(1.0, (sign_matrix(a), sign_matrix(b)))]),
                 QuadraticForm([(-1.0, (identity(a), ones(b)))], const=float(n) ** 2),
                 QuadraticForm([(-1.0, (ones(a), identity(b)))], const=float(n) ** 2)]
        est = estimate_forms(hist, forms)
        num, d1, d2 = est.values
        self.forms_ = {"concordance": num, "untied_1": d1, "untied_2": d2}
        self.forms_se_ = dict(zip(self.forms_, est.ses()))
        self.tau_a_ = float(np.clip(num / pairs, -1, 1))
        self.tau_a_se_ = est.se([1.0 / pairs, 0.0, 0.0])
        self.tau_a_ci_ = self._interval(num / pairs, self.tau_a_se_, -1, 1)
        if d1 > 0 and d2 > 0:
            root = math.sqrt(d1 * d2)
            tau = num / root
            self.se_ = est.se([1.0 / root, -tau / (2 * d1), -tau / (2 * d2)])
            self.tau_ = float(np.clip(tau, -1, 1))
            self.ci_ = self._interval(tau, self.se_, -1, 1)
        else:  # (estimated) no untied pairs on an axis: tau-b is undefined, as in scipy
            self.tau_, self.se_, self.ci_ = np.nan, np.nan, np.array([np.nan, np.nan])
        return self


class AUC(_Estimator):
    """Area under the ROC curve of a score column for a label column, on the score's bins.

    ``positive`` is a category of the label axis; the negatives are ``negative`` (categories of
    the label axis, "(other)" allowed) or by default every other category except "(other)".
    With u, w the score histograms of the positives and negatives (slices of the grid),
    U = u^T M w, M_ik = 1 if i > k, 1/2 if i == k (a bilinear form over disjoint cells: no noise
    bias), n_pos = 1^T u, n_neg = 1^T w (noisy, unbiased, independent), AUC = U / (n_pos n_neg):
    exactly ``sklearn.metrics.roc_auc_score`` on the bin indices. The score axis is ordered by
    bin (numeric, or categories in order with "other" last); ties count one half.

    Attributes: ``auc_`` (clipped to [0, 1]), ``u_`` (Mann-Whitney U of the positives),
    ``n_positive_``, ``n_negative_``, ``se_`` and ``ci_`` (delta method over U, n_pos, n_neg),
    ``forms_``, ``forms_se_``.
    """

    def __init__(self, score: str, label: str, positive: str, negative: Sequence[str] | None = None,
                 confidence: float = 0.95):
        self.score = score
        self.label = label
        self.positive = positive
        self.negative = negative
        self.confidence = confidence

    def fit(self, hist: NoisyHistogram) -> "AUC":
        hist = _check_hist(hist)
        _joint(hist, "AUC")
        if len(hist.spec.axes) != 2:
            raise ValueError("AUC needs a two-axis histogram (a score column and a label column)")
        if self.score == self.label:
            raise ValueError(f"score and label must be different columns, both are {self.score!r}")
        s_index, s_axis = axis_of(hist, self.score)
        l_index, l_axis = axis_of(hist, self.label)
        if l_axis.categories is None:
            raise ValueError(f"the label column {self.label!r} must be categorical, it has numeric "
                             f"edges")
        labels = [*l_axis.categories, OTHER]
        if self.positive not in l_axis.categories:
            raise ValueError(f"positive={self.positive!r} is not a category of {self.label!r} "
                             f"(categories: {l_axis.categories})")
        if self.negative is None:
            negative = [c for c in l_axis.categories if c != self.positive]
        else:
            negative = [self.negative] if isinstance(self.negative, str) else list(self.negative)
            unknown = [c for c in negative if c not in labels]
            if unknown:
                raise ValueError(f"negative={unknown!r}: not categories of {self.label!r} "
                                 f"(categories: {labels})")
            if self.positive in negative:
                raise ValueError(f"{self.positive!r} cannot be both positive and negative")
        if not negative:
            raise ValueError(f"no negative category: {self.label!r} has only {self.positive!r}")
        m_s = s_axis.bins
        pos = np.array([c == self.positive for c in labels], dtype=np.float64)
        neg = np.array([c in negative for c in labels], dtype=np.float64)
        # factors in the histogram's axis order
        def kron(score_factor: AxisMatrix, label_factor: AxisMatrix) -> tuple[AxisMatrix, ...]:
            return (score_factor, label_factor) if s_index == 0 else (label_factor, score_factor)
        def cells(label_mask: np.ndarray) -> np.ndarray:
            grid = np.ones(m_s)[:, None] * label_mask[None, :]
            return (grid if s_index == 0 else grid.T).reshape(-1)
        forms = [QuadraticForm([(1.0, kron(above_half_ties(m_s), outer(pos, neg)))]),
                 QuadraticForm(linear=cells(pos)),
                 QuadraticForm(linear=cells(neg))]
        est = estimate_forms(hist, forms)
        u, n_pos, n_neg = est.values
        self.forms_ = {"u": u, "n_positive": n_pos, "n_negative": n_neg}
        self.forms_se_ = dict(zip(self.forms_, est.ses()))
        self.u_, self.n_positive_, self.n_negative_ = u, n_pos, n_neg
        if n_pos > 0 and n_neg > 0:
            auc = u / (n_pos * n_neg)
            self.se_ = est.se([1.0 / (n_pos * n_neg), -auc / n_pos, -auc / n_neg])
            self.auc_ = float(np.clip(auc, 0, 1))
            self.ci_ = self._interval(auc, self.se_, 0, 1)
        else:  # (estimated) empty class: the AUC is undefined, as in sklearn
            self.auc_, self.se_, self.ci_ = np.nan, np.nan, np.array([np.nan, np.nan])
        return self


class GiniMeanDifference(_Estimator):
    """Gini's mean difference of a numeric column at its bin representatives:
    sum over ordered pairs of distinct reports |x_i - x_j| / (n (n - 1)) = c^T D c / (n (n - 1)),
    D_ik = |r_i - r_k| (zero diagonal: pairs in one bin add 0, and the noise adds no bias).
    Attributes: ``gmd_`` (floored at 0), ``se_``, ``ci_``, ``forms_``, ``forms_se_``."""

    def __init__(self, column: str, confidence: float = 0.95):
        self.column = column
        self.confidence = confidence

    def fit(self, hist: NoisyHistogram) -> "GiniMeanDifference":
        hist = _check_hist(hist)
        axis = _numeric_axis(hist, self.column, "GiniMeanDifference")
        pairs = _pairs(hist.n_reports, "GiniMeanDifference")
        form = QuadraticForm([(1.0 / pairs, (abs_difference(axis.representatives()),))])
        est = estimate_forms(hist.marginal(self.column), [form])
        (gmd,), (self.se_,) = est.values, est.ses()
        self.forms_, self.forms_se_ = {"gmd": gmd}, {"gmd": self.se_}
        self.gmd_ = max(float(gmd), 0.0)
        self.ci_ = self._interval(gmd, self.se_, 0.0)
        return self


class GiniSimpson(_Estimator):
    """Gini-Simpson diversity: the probability that two distinct reports fall in different cells,
    1 - sum_j c_j (c_j - 1) / (n (n - 1)) = 1 - (c^T I c - n) / (n (n - 1)); the sum of squares
    is debiased by v * cells. ``column`` names an axis (numeric or categorical; its marginal), or
    None for the cells of the whole histogram. Attributes: ``diversity_`` (clipped to [0, 1]),
    ``se_``, ``ci_``, ``forms_`` ("sum_of_squares"), ``forms_se_``."""

    def __init__(self, column: str | None = None, confidence: float = 0.95):
        self.column = column
        self.confidence = confidence

    def fit(self, hist: NoisyHistogram) -> "GiniSimpson":
        hist = _check_hist(hist)
        if self.column is None:
            _joint(hist, "GiniSimpson over all cells (column=None)")
        h = hist if self.column is None else hist.marginal(self.column)
        n = h.n_reports
        pairs = _pairs(n, "GiniSimpson")
        form = QuadraticForm([(1.0, tuple(identity(m) for m in h.spec.shape))])
        est = estimate_forms(h, [form])
        (squares,), (squares_se,) = est.values, est.ses()
        diversity = 1.0 - (squares - n) / pairs
        self.forms_, self.forms_se_ = {"sum_of_squares": squares}, {"sum_of_squares": squares_se}
        self.diversity_ = float(np.clip(diversity, 0.0, 1.0))
        self.se_ = squares_se / pairs
        self.ci_ = self._interval(diversity, self.se_, 0.0, 1.0)
        return self


# ---------------------------------------------------------------------------------------------
# the REST route


class Confidence(BaseModel):
    model_config = ConfigDict(extra="forbid")
    confidence: float = Field(default=0.95, gt=0, lt=1)


class ColumnStatistic(Confidence):
    column: str | None = Field(default=None, description="the axis; default: the study's only axis")


class QuantilesRequest(ColumnStatistic):
    probabilities: list[float] = Field(default=[0.25, 0.5, 0.75], min_length=1, max_length=1000)


class AUCRequest(Confidence):
    score: str = Field(description="the numeric (or ordered) axis that scores")
    label: str = Field(description="the categorical axis holding the classes")
    positive: str = Field(description="the positive class: one of the label axis' categories")


class Statistic(BaseModel):
    study_id: str
    statistic: str
    value: float
    se: float = Field(description="standard error from the privacy noise (the data held fixed)")
    ci: list[float] = Field(description="confidence interval [low, high] from that noise law")
    confidence: float
    n_reports: int
    details: dict[str, Any] = {}


def install(app: FastAPI, released: Callable[[str], Release], auth: list) -> None:
    """Add the histogram routes to the analyzer's app."""

    def histogram_of(study_id: str) -> NoisyHistogram:
        rel = released(study_id)
        if not isinstance(rel, HistogramRelease):
            raise refuse(f"study {study_id} is a {rel.study.kind} study, not a "
                               f"histogram study")
        return rel.histogram()

    def fit(estimator, h: NoisyHistogram):
        with fitting():
            return estimator.fit(h)

    def column_of(h: NoisyHistogram, column: str | None) -> str:
        if column is not None:
            return column
        if len(h.spec.axes) != 1:
            raise refuse(f"the histogram has {len(h.spec.axes)} axes "
                               f"({', '.join(h.spec.columns)}): name the column")
        return h.spec.columns[0]

    def fit_column(study_id: str, body: ColumnStatistic, estimator) -> tuple[NoisyHistogram, str, Any]:
        """A one-column statistic: the release, the column (default: the only axis), the fit."""
        h = histogram_of(study_id)
        column = column_of(h, body.column)
        return h, column, fit(estimator(column, confidence=body.confidence), h)

    def answer(study_id: str, name: str, h: NoisyHistogram, value: float, se: float, ci, confidence: float,
               **details: Any) -> Statistic:
        return Statistic(study_id=study_id, statistic=name, value=json_finite(float(value)), se=json_finite(float(se)),
                         ci=json_finite([float(ci[0]), float(ci[1])]), confidence=confidence,
                         n_reports=h.n_reports, details={k: json_finite(v) for k, v in details.items()})

    @app.get("/v1/studies/{study_id}/histogram", dependencies=auth)
    def counts(study_id: str, confidence: float = 0.95) -> dict[str, Any]:
        """The noisy counts and proportions of every cell, with confidence intervals."""
        if not 0 < confidence < 1:
            raise refuse("confidence must lie strictly between 0 and 1")
        h = histogram_of(study_id)
        common = {"study_id": study_id, "shape": list(h.spec.shape), "n_reports": h.n_reports,
                  "noise_variance": h.noise_variance, "confidence": confidence}

        def cells(est: Counts) -> dict[str, Any]:
            return {"counts": json_finite(est.counts_), "counts_ci": json_finite(est.counts_ci_),
                    "proportions": json_finite(est.proportions_), "proportions_ci": json_finite(est.proportions_ci_),
                    "nonnegative_counts": json_finite(est.nonnegative_counts_)}

        if not h.is_joint:  # a marginal histogram: each axis' counts on their own (no grid)
            return {**common, "marginal": True,
                    "axes": [{"column": a.column, "labels": a.labels(),
                              **cells(fit(Counts(confidence=confidence), h.marginal(a.column)))}
                             for a in h.spec.axes]}
        est = fit(Counts(confidence=confidence), h)
        return {**common, "axes": [{"column": a.column, "labels": a.labels()} for a in h.spec.axes], **cells(est)}

    @app.post("/v1/studies/{study_id}/analyses/quantiles", dependencies=auth)
    def quantiles(study_id: str, body: QuantilesRequest) -> dict[str, Any]:
        h = histogram_of(study_id)
        column = column_of(h, body.column)
        if any(not 0 <= p <= 1 for p in body.probabilities):
            raise refuse("probabilities must lie in [0, 1]")
        est = fit(Quantiles(column, probabilities=tuple(body.probabilities)), h)
        _, axis = h.spec.axis(column)
        return {"study_id": study_id, "column": column, "probabilities": body.probabilities,
                "quantiles": json_finite(est.quantiles_), "clipped": np.asarray(est.clipped_).tolist(),
                "edges": list(axis.edges or []), "cdf": json_finite(est.cdf_), "n_reports": h.n_reports}

    @app.post("/v1/studies/{study_id}/analyses/moments", dependencies=auth)
    def moments(study_id: str, body: ColumnStatistic) -> Statistic:
        """Mean (value) and variance (details) of a binned numeric column."""
        h, column, est = fit_column(study_id, body, BinnedMoments)
        return answer(study_id, "mean", h, est.mean_, est.mean_se_, est.mean_ci_, body.confidence,
                      column=column, variance=float(est.variance_), variance_se=float(est.variance_se_))

    @app.post("/v1/studies/{study_id}/analyses/kendall-tau", dependencies=auth)
    def kendall_tau(study_id: str, body: Confidence) -> Statistic:
        h = histogram_of(study_id)
        est = fit(KendallTau(confidence=body.confidence), h)
        return answer(study_id, "kendall_tau_b", h, est.tau_, est.se_, est.ci_, body.confidence,
                      tau_a=float(est.tau_a_), columns=h.spec.columns)

    @app.post("/v1/studies/{study_id}/analyses/auc", dependencies=auth)
    def auc(study_id: str, body: AUCRequest) -> Statistic:
        h = histogram_of(study_id)
        est = fit(AUC(body.score, body.label, body.positive, confidence=body.confidence), h)
        return answer(study_id, "auc", h, est.auc_, est.se_, est.ci_, body.confidence,
                      mann_whitney_u=float(est.u_), n_positive=float(est.n_positive_),
                      n_negative=float(est.n_negative_))

    @app.post("/v1/studies/{study_id}/analyses/gini-mean-difference", dependencies=auth)
    def gini_mean_difference(study_id: str, body: ColumnStatistic) -> Statistic:
        h, column, est = fit_column(study_id, body, GiniMeanDifference)
        return answer(study_id, "gini_mean_difference", h, est.gmd_, est.se_, est.ci_, body.confidence,
                      column=column)

    @app.post("/v1/studies/{study_id}/analyses/gini-simpson", dependencies=auth)
    def gini_simpson(study_id: str, body: ColumnStatistic) -> Statistic:
        h, column, est = fit_column(study_id, body, GiniSimpson)
        return answer(study_id, "gini_simpson", h, est.diversity_, est.se_, est.ci_, body.confidence,
                      column=column)
