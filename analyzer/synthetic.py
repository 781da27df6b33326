"""Synthetic benchmark data as in paper 000, section 5.1 (deterministic given a seed).

Both generators return a :class:`Dataset` whose rows already satisfy the row bound: after
generating the Gaussian data, *every* row is multiplied by the same constant

    c = B / max_i ||row_i||_2,

so the largest row has norm exactly B and no row needs clipping. A common factor keeps the
structure intact (the regression coefficients theta are unchanged; singular vectors are unchanged
and singular values scale by c), which per-row clipping would not. The constant is a property of
the synthetic data set, fixed before any mechanism runs and shared by all of them; it plays the
role of the public row bound a data owner picks for real data. The price, as with real data, is
that typical rows are well inside the bound (for the defaults, ||row||^2 averages 0.15-0.25 B^2 at
n = 10^6, and less as n grows, because the maximum of n Gaussian rows grows), which is what makes
the privacy noise hurt.

``clip_quantile=q`` (e.g. 0.99) instead scales so that the q-quantile of the row norms is B and
clips the remaining 1 - q of the rows to norm B, as the clients would. That is how a data owner
usually picks B for real data and gives 2-3x more signal per row; clipping a row [x, y]
multiplies x and y by the same factor, so the linear model y = x theta + e still holds (with
heteroscedastic noise). For low-rank data the clipped rows no longer have exactly the generated
singular values; the evaluation always uses the actual (clipped) rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Default label noise std (relative to Var(x . theta) = 1); gives R^2 = 1/(1 + 0.3^2) = 0.92.
DEFAULT_LABEL_NOISE = 0.3
#: Default rank and singular values of the low-rank data (before row scaling).
DEFAULT_RANK = 3
DEFAULT_BIG = 1.0
DEFAULT_SMALL = 0.1


@dataclass(frozen=True, eq=False)
class Dataset:
    """Rows (n x d, every row of norm <= row_bound), their column names and the ground truth."""

    rows: np.ndarray
    columns: list[str]
    label: str | None = None
    rank: int | None = None
    row_bound: float = 1.0
    scale: float = 1.0
    truth: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.rows.shape[0])

    @property
    def d(self) -> int:
        return int(self.rows.shape[1])

    def features(self) -> np.ndarray:
        """The non-label columns (all columns when there is no label)."""
        if self.label is None:
            return self.rows
        li = self.columns.index(self.label)
        return np.delete(self.rows, li, axis=1)

    def target(self) -> np.ndarray:
        if self.label is None:
            raise ValueError("this data set has no label")
        return self.rows[:, self.columns.index(self.label)]


def _scale_to_bound(
    rows: np.ndarray, row_bound: float, clip_quantile: float | None
) -> tuple[np.ndarray, float]:
    norms = np.linalg.norm(rows, axis=1)
    if clip_quantile is None:
        return rows * (float(row_bound) / float(norms.max())), float(row_bound) / float(norms.max())
    if not 0.5 <= clip_quantile <= 1.0:
        raise ValueError("clip_quantile must lie in [0.5, 1]")
    c = float(row_bound) / float(np.quantile(norms, clip_quantile))
    scaled = rows * c
    over = np.linalg.norm(scaled, axis=1) > row_bound
    scaled[over] *= (row_bound / np.linalg.norm(scaled[over], axis=1))[:, None]
    return scaled, c


def regression_data(
    n: int,
    d: int = 10,
    *,
    label_noise: float = DEFAULT_LABEL_NOISE,
    seed: int = 0,
    row_bound: float = 1.0,
    clip_quantile: float | None = None,
) -> Dataset:
    """Linear-regression data: columns x0..x{d-1}, y.

    X has i.i.d. N(0, 1) entries, the true theta has i.i.d. N(0, 1/d) entries (so the signal
    x . theta has variance ||theta||^2 ~ 1, like every feature), and y = X theta + e with
    e ~ N(0, label_noise^2). The default label_noise = 0.3 gives a population R^2 of about 0.92:
    a clearly but not perfectly linear relationship, between the almost noise-free settings in
    which any privacy noise dominates the tiny optimal residual and the very noisy ones in which
    every mechanism looks optimal. Rows [x, y] are then scaled by the common constant of the
    module docstring. ``truth`` holds theta, the scale and the parameters.
    """
    if n < 1 or d < 1:
        raise ValueError("need n >= 1 and d >= 1")
    rng = np.random.default_rng(np.random.SeedSequence([0x5EED, 1, int(seed)]))
    x = rng.standard_normal((n, d))
    theta = rng.standard_normal(d) / np.sqrt(d)
    y = x @ theta + label_noise * rng.standard_normal(n)
    rows, c = _scale_to_bound(np.column_stack([x, y]), row_bound, clip_quantile)
    columns = [f"x{i}" for i in range(d)] + ["y"]
    return Dataset(
        rows=rows,
        columns=columns,
        label="y",
        row_bound=row_bound,
        scale=c,
        truth={"theta": theta, "label_noise": label_noise, "seed": seed, "clip_quantile": clip_quantile},
    )


def lowrank_data(
    n: int,
    d: int = 10,
    *,
    rank: int = DEFAULT_RANK,
    big: float = DEFAULT_BIG,
    small: float = DEFAULT_SMALL,
    seed: int = 0,
    row_bound: float = 1.0,
    clip_quantile: float | None = None,
) -> Dataset:
    """Data with a spectral gap between the rank-th and the next singular value (paper 000).

    M has i.i.d. N(0, 1) entries with (thin) SVD M = U Sigma V^T; Sigma is replaced by
    diag(big, ..., big, small, ..., small) with ``rank`` big values, A = U Sigma' V^T, and rows are
    scaled by the common constant of the module docstring (singular vectors unchanged, singular
    values times c). The defaults (r = 3 of d = 10, big/small = 10, i.e. 99% of the energy in the
    top 3 directions) are a clear but not extreme gap: a uniformly random 3-dimensional
    subspace would lose 70% of the energy, so a mechanism that cannot find the subspace is
    visibly bad, while the tail is not so small that any perturbation gives an unbounded ratio.
    ``truth`` holds V (d x d, rows = right singular vectors) and the singular values.
    """
    if not 1 <= rank <= d:
        raise ValueError("need 1 <= rank <= d")
    if n < d:
        raise ValueError("need n >= d")
    if not big > small >= 0:
        raise ValueError("need big > small >= 0")
    rng = np.random.default_rng(np.random.SeedSequence([0x5EED, 2, int(seed)]))
    m = rng.standard_normal((n, d))
    u, _, vt = np.linalg.svd(m, full_matrices=False)
    sv = np.array([big] * rank + [small] * (d - rank), dtype=np.float64)
    rows, c = _scale_to_bound((u * sv) @ vt, row_bound, clip_quantile)
    return Dataset(
        rows=rows,
        columns=[f"x{i}" for i in range(d)],
        label=None,
        rank=rank,
        row_bound=row_bound,
        scale=c,
        truth={
            "V": vt,
            "singular_values": sv * c,
            "big": big,
            "small": small,
            "seed": seed,
            "clip_quantile": clip_quantile,
        },
    )
