"""Comparison mechanisms and a fast LTM simulator, all at the study's (epsilon, delta).

Every mechanism here takes its privacy target, row bound B and neighbouring notion from the
study and its noise scale from :mod:`dpsketch.protocol.privacy`, so the comparison is like for
like:

* **non-private** (:func:`exact_gram`): A^T A of the clipped rows;
* **local model** (:func:`simulate_local`): each client adds N(0, sigma_local^2) per coordinate
  to its clipped row, sigma_local = Delta / mu_star (:func:`privacy.local_sigma`), no sketch;
  estimators run on the noisy rows' Gram;
* **central model** (:func:`central_gram`): a trusted curator releases A^T A plus symmetric
  Gaussian noise calibrated to the sensitivity of the Gram (:func:`gram_sensitivity`). For
  regression on [X, y] this is sufficient statistics perturbation (SSP, Vu and Slavkovic 2009);
  for PCA it is Analyze Gauss / MOD-SULQ (Dwork et al. 2014; Chaudhuri, Sarwate, Sinha 2012);
* **LTM** (:func:`simulate_ltm`): Y = S(A + G) with the real protocol sketch, for experiments.
  The real pipeline (SDK -> share servers -> analyzer) produces the same
  :class:`~analyzer.release.SketchRelease` from the servers' aggregate shares.

These are simulations: report ids and noise come from the numpy ``Generator`` passed in, which
makes experiments reproducible. They are *not* a privacy mechanism for real data, which must draw
noise and report ids from a CSPRNG (DESIGN.md); the SDK does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from dpsketch.protocol import privacy, ring, sketch
from dpsketch.protocol.study import NOISE_TAIL_SIGMAS, Study

from .release import GramRelease, SecondMomentsBase, SketchRelease


# ---------------------------------------------------------------------------------------------
# helpers


def clip_rows(rows: np.ndarray, row_bound: float) -> np.ndarray:
    """Scale each row to L2 norm at most ``row_bound`` (a <- a min(1, B/||a||)), as clients do."""
    a = np.asarray(rows, dtype=np.float64)
    norms = np.linalg.norm(a, axis=1)
    factor = np.minimum(1.0, row_bound / np.maximum(norms, np.finfo(float).tiny))
    return a * factor[:, None]


def _check_rows(study: Study, rows: np.ndarray) -> np.ndarray:
    a = np.atleast_2d(np.asarray(rows, dtype=np.float64))
    if a.shape[1] != study.d:
        raise ValueError(f"rows must have the study's {study.d} columns, got {a.shape[1]}")
    return clip_rows(a, study.row_bound)


def _truncated_normal(rng: np.random.Generator, sigma: float, shape: tuple[int, ...]) -> np.ndarray:
    """N(0, sigma^2) redrawn beyond NOISE_TAIL_SIGMAS sigma, as the SDK does (p ~ 1e-15)."""
    g = rng.normal(0.0, sigma, size=shape)
    bad = np.abs(g) > NOISE_TAIL_SIGMAS * sigma
    while np.any(bad):
        g[bad] = rng.normal(0.0, sigma, size=int(bad.sum()))
        bad = np.abs(g) > NOISE_TAIL_SIGMAS * sigma
    return g


# ---------------------------------------------------------------------------------------------
# non-private and central


def exact_gram(rows: np.ndarray, columns: Sequence[str]) -> GramRelease:
    """The non-private baseline: the exact Gram A^T A of the (already clipped) rows."""
    a = np.asarray(rows, dtype=np.float64)
    return GramRelease(
        columns=list(columns), n_reports=a.shape[0], gram_matrix=a.T @ a, info={"mechanism": "exact"}
    )


def gram_sensitivity(row_bound: float, neighbouring: privacy.Neighbouring) -> float:
    """L2 sensitivity of the Gram matrix A^T A, measured as the Frobenius norm.

    A symmetric d x d matrix M is released through its upper triangle
    u(M) = (M_ii for all i; sqrt(2) M_ij for i < j), so that ||u(M)||_2 = ||M||_F. The Gram
    changes by a a^T - b b^T when row a is replaced by row b (||a||, ||b|| <= B), and

        ||a a^T - b b^T||_F^2 = ||a||^4 + ||b||^4 - 2 (a . b)^2 <= 2 B^4,

    with equality for orthogonal a, b of norm B. So Delta = sqrt(2) B^2 for replace-one. Adding or
    removing a row changes the Gram by a a^T with ||a a^T||_F = ||a||^2 <= B^2: Delta = B^2.
    (Releasing the full matrix with i.i.d. noise on both triangles would instead see
    off-diagonals twice; the sqrt(2) scaling makes each degree of freedom count once.)
    """
    b2 = float(row_bound) ** 2
    if neighbouring == "replace-one":
        return math.sqrt(2.0) * b2
    if neighbouring == "add-remove":
        return b2
    raise ValueError(f"unknown neighbouring notion {neighbouring!r}")


def upper_triangle(m: np.ndarray) -> np.ndarray:
    """u(M): the diagonal, then sqrt(2) times the strict upper triangle (row-major)."""
    m = np.asarray(m, dtype=np.float64)
    iu = np.triu_indices(m.shape[0], k=1)
    return np.concatenate([np.diag(m), math.sqrt(2.0) * m[iu]])


def symmetric_from_upper(u: np.ndarray, d: int) -> np.ndarray:
    """The inverse of :func:`upper_triangle`."""
    u = np.asarray(u, dtype=np.float64)
    m = np.zeros((d, d))
    m[np.diag_indices(d)] = u[:d]
    iu = np.triu_indices(d, k=1)
    m[iu] = u[d:] / math.sqrt(2.0)
    m[(iu[1], iu[0])] = m[iu]
    return m


def central_sigma(epsilon: float, delta: float, row_bound: float, neighbouring: privacy.Neighbouring) -> float:
    """Noise std per coordinate of u(A^T A) for the central Gram mechanism."""
    return privacy.gaussian_sigma(epsilon, delta, gram_sensitivity(row_bound, neighbouring))


def central_gram(
    rows: np.ndarray,
    columns: Sequence[str],
    *,
    epsilon: float,
    delta: float,
    row_bound: float,
    neighbouring: privacy.Neighbouring,
    rng: np.random.Generator,
) -> GramRelease:
    """SSP / Analyze Gauss: u(A^T A) + N(0, sigma_c^2 I), sigma_c = Delta_gram / mu_star.

    In matrix form the noise W is symmetric with W_ii ~ N(0, sigma_c^2) and W_ij ~
    N(0, sigma_c^2 / 2) (i != j); it has mean zero (nothing to debias) and spectral norm about
    2 sqrt(d) sigma_c / sqrt(2) = sqrt(2 d) sigma_c (Wigner semicircle), the release's
    ``gram_noise_scale``. Rows are clipped to ``row_bound`` first.
    """
    a = clip_rows(np.atleast_2d(np.asarray(rows, dtype=np.float64)), row_bound)
    d = a.shape[1]
    if d != len(columns):
        raise ValueError("rows and columns disagree")
    sigma_c = central_sigma(epsilon, delta, row_bound, neighbouring)
    noisy = upper_triangle(a.T @ a) + rng.normal(0.0, sigma_c, size=d * (d + 1) // 2)
    return GramRelease(
        columns=list(columns),
        n_reports=a.shape[0],
        gram_matrix=symmetric_from_upper(noisy, d),
        bias=0.0,
        gram_noise_scale=math.sqrt(2.0 * d) * sigma_c,
        info={
            "mechanism": "central-gram",
            "sigma": sigma_c,
            "sensitivity": gram_sensitivity(row_bound, neighbouring),
        },
    )


def simulate_central(study: Study, rows: np.ndarray, rng: np.random.Generator) -> GramRelease:
    """:func:`central_gram` at the study's epsilon, delta, row bound and neighbouring notion."""
    return central_gram(
        rows,
        study.columns,
        epsilon=study.epsilon,
        delta=study.delta,
        row_bound=study.row_bound,
        neighbouring=study.neighbouring,
        rng=rng,
    )


# ---------------------------------------------------------------------------------------------
# local model


@dataclass(frozen=True, eq=False)
class LocalRelease(SecondMomentsBase):
    """The local model: every client's clipped row plus N(0, sigma_local^2) noise, in the clear.

    ``gram(debias=True)`` = Z^T Z - sigma^2 n I; the remaining noise G^T G - sigma^2 n I (plus
    the cross terms) has spectral norm about sigma^2 (2 sqrt(n d) + d).
    """

    columns: list[str]
    noisy_rows: np.ndarray
    sigma: float

    @property
    def n_reports(self) -> int:  # type: ignore[override]
        return int(self.noisy_rows.shape[0])

    @property
    def gram_bias(self) -> float:
        return self.sigma**2 * self.n_reports

    @property
    def gram_noise_scale(self) -> float:  # type: ignore[override]
        n, d = self.noisy_rows.shape
        return self.sigma**2 * (2.0 * math.sqrt(n * d) + d)

    def gram(self, debias: bool = True) -> np.ndarray:
        z = self.noisy_rows
        g = z.T @ z
        if debias:
            g[np.diag_indices_from(g)] -= self.gram_bias
        return g


def simulate_local(study: Study, rows: np.ndarray, rng: np.random.Generator) -> LocalRelease:
    """Each client adds N(0, sigma_local^2), sigma_local = privacy.local_sigma(...), to its row."""
    a = _check_rows(study, rows)
    sigma_l = privacy.local_sigma(study.epsilon, study.delta, study.row_bound, study.neighbouring)
    return LocalRelease(
        columns=list(study.columns), noisy_rows=a + rng.normal(0.0, sigma_l, size=a.shape), sigma=sigma_l
    )


# ---------------------------------------------------------------------------------------------
# LTM simulation


def random_report_ids(n: int, rng: np.random.Generator) -> list[bytes]:
    """n random 16-byte report ids (simulation only: real ids come from os.urandom)."""
    raw = rng.bytes(sketch.REPORT_ID_BYTES * n)
    w = sketch.REPORT_ID_BYTES
    return [raw[i * w : (i + 1) * w] for i in range(n)]


def sketch_matrix(study: Study, report_ids: Sequence[bytes]) -> sp.csr_matrix:
    """The study's sketch S (k x n, sparse) over these reports, from the protocol hash."""
    rows, signs = sketch.hash_report_ids(study.seed_bytes, report_ids, study.k, study.s)
    n = len(report_ids)
    cols = np.repeat(np.arange(n), study.s)
    data = signs.reshape(-1).astype(np.float64) * sketch.scale(study.s)
    return sp.csr_matrix((data, (rows.reshape(-1), cols)), shape=(study.k, n))


def ltm_sketch(study: Study, report_ids: Sequence[bytes], noisy_rows: np.ndarray) -> np.ndarray:
    """Y = S (A + G) for the given reports and noisy rows, in floating point."""
    return np.asarray(sketch_matrix(study, report_ids) @ np.asarray(noisy_rows, dtype=np.float64))


def ltm_ring_sum(study: Study, report_ids: Sequence[bytes], noisy_rows: np.ndarray) -> np.ndarray:
    """The k x d uint64 ring sum the N servers' aggregate shares add up to (unshared: the
    shares cancel), computed exactly as the servers do with :func:`sketch.accumulate`."""
    enc = ring.encode(noisy_rows, study.frac_bits, study.value_bound)
    acc = np.zeros(study.aggregate_shape, dtype=np.uint64)
    rows, signs = sketch.hash_report_ids(study.seed_bytes, report_ids, study.k, study.s)
    sketch.accumulate(acc, rows, signs, enc)
    return acc


def simulate_ltm(
    study: Study,
    rows: np.ndarray,
    rng: np.random.Generator,
    *,
    via_ring: bool = False,
    return_inputs: bool = False,
):
    """Simulate the LTM release of ``rows`` under ``study``: Y = S(A + G).

    Draws n random 16-byte report ids and G ~ N(0, study.sigma^2) (redrawn beyond 8 sigma, as
    the SDK does) from ``rng`` -- numpy's generator, fine for a simulation, never for real
    noise -- clips the rows to B, builds S with the real protocol hash
    (:func:`sketch.hash_report_ids`) as a scipy.sparse matrix and returns the
    :class:`SketchRelease`. With ``via_ring=True`` the noisy rows go through the fixed-point ring
    encoding and the servers' accumulation and come back through
    :meth:`SketchRelease.from_ring_sum` (slower; same result up to 2^-f rounding).

    With ``return_inputs=True`` returns ``(release, report_ids, noise)``.
    """
    a = _check_rows(study, rows)
    n = a.shape[0]
    ids = random_report_ids(n, rng)
    g = _truncated_normal(rng, study.sigma, a.shape)
    if via_ring:
        release = SketchRelease.from_ring_sum(study, ltm_ring_sum(study, ids, a + g), n)
    else:
        release = SketchRelease(study=study, sketch=ltm_sketch(study, ids, a + g), n_reports=n)
    if return_inputs:
        return release, ids, g
    return release
