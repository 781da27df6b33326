"""Study kinds: what vector a client shares for its clipped row, and how much it can move.

A study of kind ``sketch`` shares the clipped row a itself (width d) and the servers apply the
OSNAP sketch. A study of kind ``gram`` shares the feature vector

    phi(a) = [ a,  u(a a^T),  1 ]          (width d + d(d+1)/2 + 1)

and the servers only add (k = 1, s = 1: the plain sum), so the release is the noisy sum of a, the
noisy Gram A^T A and the noisy count: sufficient statistics perturbation inside the LTM
(DESIGN.md, "Noise calibration", last paragraph). A study of kind ``moments`` shares u(a a^T)
alone (width d(d+1)/2), for fits that read only the Gram (ridge, least squares, PCA on the
uncentered Gram): its sensitivity is that of A^T A, sqrt(2) B^2 replace-one and B^2 add/remove,
against sqrt(2 B^4 + 2 B^2 + 1/2) = 2.12 B^2 at B = 1 for the gram kind, so the same epsilon needs
0.44 of the gram kind's noise variance (:func:`moments_sensitivity`). ``u`` lists the diagonal and then sqrt(2) times
the strict upper triangle (row-major), so that ||u(M)||_2 = ||M||_F and every degree of freedom of
a symmetric matrix is counted once.

The L2 sensitivity of phi, used by :mod:`.privacy` to calibrate the noise, is derived in
:func:`gram_feature_sensitivity` and checked numerically in the tests.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

Kind = Literal["sketch", "gram", "histogram", "l1", "moments"]
KINDS: tuple[str, ...] = ("sketch", "gram", "histogram", "l1", "moments")
#: The plain-sum kinds of second moments (k = s = 1, at most GRAM_MAX_COLUMNS columns).
GRAM_KINDS: tuple[str, ...] = ("gram", "moments")

#: A gram study shares about d^2/2 values per client; beyond this many columns a sketch study is
#: the better tool (and the aggregate would be tens of thousands of cells per server).
GRAM_MAX_COLUMNS = 256


def width(kind: Kind, d: int) -> int:
    """Length of the vector each client shares (and of each aggregate row); a histogram's is its
    number of cells (``HistogramSpec.cells``, ``Study.width``)."""
    if kind in ("sketch", "l1"):
        return d
    if kind == "gram":
        return d + d * (d + 1) // 2 + 1
    if kind == "moments":
        return d * (d + 1) // 2
    if kind == "histogram":
        raise ValueError("a histogram study's width is its number of cells (Study.width)")
    raise ValueError(f"unknown study kind {kind!r}")


def coordinate_bound(kind: Kind, row_bound: float) -> float:
    """Largest |coordinate| of the shared vector before noise, for rows with ||a|| <= B.

    sketch, l1: |a_i| <= B. gram: |a_i| <= B, a_i^2 <= B^2, sqrt(2) |a_i a_j| <= B^2 / sqrt(2), and 1.
    """
    if kind in ("sketch", "l1"):
        return float(row_bound)
    if kind == "gram":
        return max(float(row_bound), float(row_bound) ** 2, 1.0)
    if kind == "moments":  # a_i^2 <= B^2, sqrt(2) |a_i a_j| <= B^2 / sqrt(2)
        return float(row_bound) ** 2
    if kind == "histogram":
        return 1.0  # a 0/1 vector (one-hot, or a marginal histogram's one 1 per axis)
    raise ValueError(f"unknown study kind {kind!r}")


def upper_triangle(m: np.ndarray) -> np.ndarray:
    """u(M) of one symmetric matrix (..., d, d) -> (..., d(d+1)/2): diagonal, then sqrt(2) M_ij, i < j."""
    m = np.asarray(m, dtype=np.float64)
    d = m.shape[-1]
    iu = np.triu_indices(d, k=1)
    diag = np.diagonal(m, axis1=-2, axis2=-1)
    return np.concatenate([diag, math.sqrt(2.0) * m[..., iu[0], iu[1]]], axis=-1)


def symmetric_from_upper(u: np.ndarray, d: int) -> np.ndarray:
    """The inverse of :func:`upper_triangle` for one vector of length d(d+1)/2."""
    u = np.asarray(u, dtype=np.float64)
    if u.shape != (d * (d + 1) // 2,):
        raise ValueError(f"expected {d * (d + 1) // 2} values for a {d} x {d} matrix, got {u.shape}")
    m = np.zeros((d, d))
    m[np.diag_indices(d)] = u[:d]
    iu = np.triu_indices(d, k=1)
    m[iu] = u[d:] / math.sqrt(2.0)
    m[(iu[1], iu[0])] = m[iu]
    return m


def gram_features(rows: np.ndarray) -> np.ndarray:
    """phi(a) for every (already clipped) row: (m, d) -> (m, d + d(d+1)/2 + 1)."""
    a = np.asarray(rows, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError("rows must be a 2-D array")
    m, d = a.shape
    iu = np.triu_indices(d, k=1)
    out = np.empty((m, width("gram", d)), dtype=np.float64)
    out[:, :d] = a
    out[:, d : 2 * d] = a * a
    out[:, 2 * d : -1] = math.sqrt(2.0) * a[:, iu[0]] * a[:, iu[1]]
    out[:, -1] = 1.0
    return out


def moment_features(rows: np.ndarray) -> np.ndarray:
    """u(a a^T) for every (already clipped) row: (m, d) -> (m, d(d+1)/2), the middle block of
    :func:`gram_features`."""
    a = np.asarray(rows, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError("rows must be a 2-D array")
    d = a.shape[1]
    iu = np.triu_indices(d, k=1)
    return np.concatenate([a * a, math.sqrt(2.0) * a[:, iu[0]] * a[:, iu[1]]], axis=1)


def client_vectors(kind: Kind, clipped_rows: np.ndarray) -> np.ndarray:
    """What a client of this study kind adds noise to and shares."""
    if kind in ("sketch", "l1"):
        return np.asarray(clipped_rows, dtype=np.float64)
    if kind == "gram":
        return gram_features(clipped_rows)
    if kind == "moments":
        return moment_features(clipped_rows)
    raise ValueError(f"unknown study kind {kind!r}")


#: 1 / sqrt(2) as a double (0.7071067811865475): a validity study's strict upper triangle scale,
#: and every noise sd there is sigma times this double (never sigma / sqrt(2), which differs in the
#: last bit for some sigma and then in the sampler's parameter)
UPPER_SCALE = 1.0 / math.sqrt(2.0)


def proved_scale(kind: Kind, d: int) -> np.ndarray:
    """What a validity study's client multiplies its features by (width values): 1/sqrt(2) on
    the strict upper triangle, 1 elsewhere, so that it shares the raw products a_i a_j, which
    its proof can state as products (circuits.GramNorm), instead of sqrt(2) a_i a_j. Its noise
    is scaled the same way (the strict upper triangle's is sigma / sqrt(2)), so the release
    divided by this vector is the feature release of a study without proofs, with the same
    noise law but for the grid (docs/validity.md section 12). All ones for the other kinds."""
    if kind not in GRAM_KINDS:
        return np.ones(width(kind, d))
    start = d if kind == "gram" else 0
    scale = np.ones(width(kind, d))
    scale[start + d:start + d * (d + 1) // 2] = UPPER_SCALE
    return scale


def split_gram_sum(vector: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(sum of rows, Gram matrix, count) from a released gram-kind sum of width d + d(d+1)/2 + 1."""
    v = np.asarray(vector, dtype=np.float64).reshape(-1)
    if v.shape[0] != width("gram", d):
        raise ValueError(f"a gram release for d = {d} has {width('gram', d)} values, got {v.shape[0]}")
    return v[:d].copy(), symmetric_from_upper(v[d:-1], d), float(v[-1])


def moments_sensitivity(row_bound: float, replace_one: bool) -> float:
    """L2 sensitivity of u(a a^T) over rows with ||a|| <= B: replace-one
    ||a a^T - b b^T||_F^2 = r^4 + q^4 - 2 c^2 <= 2 B^4 (c = a . b = 0, r = q = B), so sqrt(2) B^2;
    add/remove ||a a^T||_F = ||a||^2 <= B^2. The count is not released, so a replace-one study
    hides presence only up to the count, as every replace-one study."""
    b2 = float(row_bound) ** 2
    return math.sqrt(2.0) * b2 if replace_one else b2


def gram_feature_sensitivity(row_bound: float, replace_one: bool) -> float:
    """L2 sensitivity of phi over rows with ||a|| <= B.

    Replace-one (a -> b, r = ||a||, q = ||b||, c = a . b, |c| <= r q):

        ||phi(a) - phi(b)||^2 = ||a - b||^2 + ||a a^T - b b^T||_F^2
                              = r^2 + q^2 - 2c + r^4 + q^4 - 2c^2        (the count cancels).

    Over c the term -2c - 2c^2 peaks at c = -1/2 with value 1/2 when r q >= 1/2; otherwise at
    c = -r q. Both cases grow with r and q, so the supremum is at r = q = B:

        Delta^2 = 2 B^4 + 2 B^2 + 1/2   if B^2 >= 1/2,     Delta^2 = 4 B^2   otherwise,

    reached by rows of norm B with a . b = -1/2 (or b = -a). Add/remove (phi(a) appears or
    vanishes, the count with it): Delta^2 = ||a||^2 + ||a||^4 + 1 <= B^2 + B^4 + 1.
    """
    b2 = float(row_bound) ** 2
    if replace_one:
        return math.sqrt(2.0 * b2 * b2 + 2.0 * b2 + 0.5) if b2 >= 0.5 else 2.0 * math.sqrt(b2)
    return math.sqrt(b2 + b2 * b2 + 1.0)
