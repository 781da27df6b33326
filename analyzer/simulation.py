"""The releases a study's prediction simulates, at the study's (epsilon, delta): LTM, local, central.

``dpsketch recommend --predict`` and ``POST /v1/recommend`` (``predict: true``) measure the
expected error of each study kind by simulating its release on synthetic data of the same shape
(:mod:`analyzer.recommend`); the demo and the research harness (``research/``) use the same
simulations. Every release here takes its privacy target, row bound B and neighbouring notion
from the study and its noise scale from :mod:`dpsketch.protocol.privacy`, so the comparison is
like for like:

* **non-private** (:func:`exact_gram`): A^T A of the clipped rows;
* **local model** (:func:`simulate_local`): each client adds N(0, sigma_local^2) per coordinate
  to its clipped row, sigma_local = Delta / mu_star (:func:`privacy.local_sigma`), no sketch;
  estimators run on the noisy rows' Gram. With ``secret_sign`` each client first multiplies its
  row by a secret +-1 and sigma_local is the secret sign's calibration at lambda = 1 and no
  server noise (:func:`signed_local_sigma`, docs/secret_sign.md section 7a);
* **central model** (:func:`central_gram`): a trusted curator releases A^T A plus symmetric
  Gaussian noise calibrated to the sensitivity of the Gram (:func:`gram_sensitivity`). For
  regression on [X, y] this is sufficient statistics perturbation (SSP, Vu and Slavkovic 2009);
  for PCA it is Analyze Gauss / MOD-SULQ (Dwork et al. 2014; Chaudhuri, Sarwate, Sinha 2012);
* **LTM** (:func:`simulate_ltm`): Y = S(A + G) with the real protocol sketch. The real pipeline
  (SDK -> share servers -> analyzer) produces the same :class:`~analyzer.release.SketchRelease`
  from the servers' aggregate shares.

The central-model regression baselines (SSP, AdaSSP, DGM-OLS, RMGM-OLS) that the evaluations
compare against are in ``research/baselines.py``, outside the installed packages.

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

from dpsketch.protocol import features, privacy, ring, sketch
from dpsketch.protocol.features import symmetric_from_upper, upper_triangle
from dpsketch.protocol.study import NOISE_TAIL_SIGMAS, Study

from .release import GramRelease, GramSumRelease, SecondMomentsBase, SketchRelease, release_from_ring_sum


# ---------------------------------------------------------------------------------------------
# helpers


@dataclass(frozen=True)
class Target:
    """A release's privacy target: (epsilon, delta)-DP for rows of L2 norm at most ``row_bound``
    under the ``neighbouring`` notion. Every release simulated here and every baseline of
    ``research/baselines.py`` is calibrated to one, which is what makes their errors comparable;
    :meth:`of` reads a study's."""

    epsilon: float
    delta: float
    row_bound: float
    neighbouring: privacy.Neighbouring = "replace-one"

    @classmethod
    def of(cls, study: Study) -> Target:
        return cls(study.epsilon, study.delta, study.row_bound, study.neighbouring)


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


def central_sigma(epsilon: float, delta: float, row_bound: float, neighbouring: privacy.Neighbouring) -> float:
    """Noise std per coordinate of u(A^T A) for the central Gram mechanism."""
    return privacy.gaussian_sigma(epsilon, delta, gram_sensitivity(row_bound, neighbouring))


def central_gram(rows: np.ndarray, columns: Sequence[str], target: Target, *,
                 rng: np.random.Generator) -> GramRelease:
    """SSP / Analyze Gauss: u(A^T A) + N(0, sigma_c^2 I), sigma_c = Delta_gram / mu_star.

    In matrix form the noise W is symmetric with W_ii ~ N(0, sigma_c^2) and W_ij ~
    N(0, sigma_c^2 / 2) (i != j); it has mean zero (nothing to debias) and spectral norm about
    2 sqrt(d) sigma_c / sqrt(2) = sqrt(2 d) sigma_c (Wigner semicircle), the release's
    ``gram_noise_scale``. Rows are clipped to the target's row bound first.
    """
    epsilon, delta, row_bound, neighbouring = target.epsilon, target.delta, target.row_bound, target.neighbouring
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
    return central_gram(rows, study.columns, Target.of(study), rng=rng)


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


def signed_local_sigma(epsilon: float, delta: float, row_bound: float,
                       neighbouring: privacy.Neighbouring) -> float:
    """The local model's noise when each client signs its row with a secret +-1 first.

    What the adversary sees of client i is z = t x + g, g ~ N(0, sigma^2 I), and it knows every
    other client's row: whitened, z / sigma = t x / sigma + N(0, I), which is the secret sign's
    replace-one experiment of docs/secret_sign.md section 1 with l = 1 / sigma^2 (lambda = 1: no
    other report shares its cells; tau = 0: no server noise). So its certified calibration
    applies unchanged: sigma^2 = B^2 / r(epsilon, delta)^2 (``secret_sign.variance_needed``).
    Replace-one only: the add/remove counterpart (the mixture against the row's absence) is not
    calibrated here."""
    if neighbouring != "replace-one":
        raise ValueError("the signed local model is calibrated for replace-one only")
    from dpsketch.protocol import secret_sign

    return math.sqrt(secret_sign.variance_needed(row_bound, epsilon, delta))


def local_release(clipped_rows: np.ndarray, columns: Sequence[str], target: Target, *,
                  rng: np.random.Generator, secret_sign: bool = False) -> LocalRelease:
    """Each client adds N(0, sigma_local^2), sigma_local = privacy.local_sigma(...), to its
    (already clipped) row and publishes it; with ``secret_sign`` it first multiplies the row by a
    secret +-1 and sigma_local is :func:`signed_local_sigma`. The Gram of the published rows has
    the same law either way ((t a)(t a)^T = a a^T), so the estimators are unchanged."""
    rows = np.asarray(clipped_rows, dtype=np.float64)
    calibration = signed_local_sigma if secret_sign else privacy.local_sigma
    sigma_l = calibration(target.epsilon, target.delta, target.row_bound, target.neighbouring)
    if secret_sign:
        rows = rows * secret_signs(rng, rows.shape[0])[:, None]
    noisy = rows + rng.normal(0.0, sigma_l, size=rows.shape)
    return LocalRelease(columns=list(columns), noisy_rows=noisy, sigma=sigma_l)


def simulate_local(study: Study, rows: np.ndarray, rng: np.random.Generator, *,
                   secret_sign: bool = False) -> LocalRelease:
    """:func:`local_release` of the rows clipped to the study's B, at its privacy target."""
    return local_release(_check_rows(study, rows), study.columns, Target.of(study), rng=rng,
                         secret_sign=secret_sign)


def secret_signs(rng: np.random.Generator, n: int) -> np.ndarray:
    """n secret signs +-1 for a simulation (numpy; the SDK draws them from its CSPRNG)."""
    return rng.choice(np.array([-1.0, 1.0]), size=n)


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


def ltm_ring_sum(study: Study, report_ids: Sequence[bytes], noisy_rows: np.ndarray,
                 rng: np.random.Generator | None = None) -> np.ndarray:
    """The k x d uint64 ring sum the N servers' aggregate shares add up to (unshared: the
    shares cancel), computed exactly as the servers do with :func:`sketch.accumulate`, plus the
    N servers' own noise (drawn from ``rng`` for a simulation, else the servers' CSPRNG draw)."""
    enc = ring.encode(noisy_rows, study.frac_bits, study.value_bound)
    acc = np.zeros(study.aggregate_shape, dtype=np.uint64)
    rows, signs = sketch.hash_report_ids(study.seed_bytes, report_ids, study.k, study.s)
    sketch.accumulate(acc, rows, signs, enc)
    for _ in range(study.n_servers):
        if rng is None:
            acc += study.server_noise()
        elif study.server_sigma > 0:
            std = study.server_noise_std
            acc += ring.encode(_truncated_normal(rng, std, study.aggregate_shape), study.frac_bits,
                               NOISE_TAIL_SIGMAS * std)
    return acc


def server_noise_variance(study: Study) -> float:
    """Variance per released cell of the N servers' noise together: N server_sigma^2."""
    return study.n_servers * study.server_sigma ** 2


def simulate_ltm(
    study: Study,
    rows: np.ndarray,
    rng: np.random.Generator,
    *,
    via_ring: bool = False,
    return_inputs: bool = False,
):
    """Simulate the LTM release of ``rows`` under ``study``: Y = S(A + G).

    Draws n random 16-byte report ids, G ~ N(0, study.sigma^2) (redrawn beyond 20 sigma, as
    the SDK does) and the N servers' noise N(0, server_sigma^2) per cell from ``rng`` -- numpy's
    generator, fine for a simulation, never for real noise -- clips the rows to B, builds S with
    the real protocol hash
    (:func:`sketch.hash_report_ids`) as a scipy.sparse matrix and returns the
    :class:`SketchRelease`. With ``via_ring=True`` the noisy rows go through the fixed-point ring
    encoding and the servers' accumulation and come back through
    :meth:`SketchRelease.from_ring_sum` (slower; same result up to 2^-f rounding).

    With ``return_inputs=True`` returns ``(release, report_ids, noise)``.

    A gram or moments study (k = 1) gives a :class:`GramSumRelease`: the clients' feature vectors
    ([a, u(a a^T), 1], or u(a a^T)) are summed and the sum of their n noise vectors is drawn at once as
    N(0, n sigma^2) per coordinate (the same law, without the 20 sigma cut; ``via_ring`` and
    ``return_inputs`` then draw per-client noise instead).
    """
    a = _check_rows(study, rows)
    n = a.shape[0]
    if study.kind in features.GRAM_KINDS:
        if not (via_ring or return_inputs):
            total = np.zeros(study.width)
            step = max(1, 4_000_000 // study.width)  # bounded memory for wide feature vectors
            for start in range(0, n, step):
                total += features.client_vectors(study.kind, a[start : start + step]).sum(axis=0)
            total += rng.normal(0.0, np.sqrt(study.sigma ** 2 * n + server_noise_variance(study)),
                                size=study.width)
            return GramSumRelease(study=study, values=total, n_reports=n)
        phi = features.client_vectors(study.kind, a)
        ids = random_report_ids(n, rng)
        g = _truncated_normal(rng, study.sigma, phi.shape) if study.sigma > 0 else np.zeros(phi.shape)
        release = release_from_ring_sum(study, ltm_ring_sum(study, ids, phi + g, rng), n)
        return (release, ids, g) if return_inputs else release
    ids = random_report_ids(n, rng)
    if study.secret_sign:  # each client signs its clipped row before its noise (prepare.py)
        a = a * secret_signs(rng, n)[:, None]
    g = _truncated_normal(rng, study.sigma, a.shape) if study.sigma > 0 else np.zeros(a.shape)
    if via_ring:
        release = SketchRelease.from_ring_sum(study, ltm_ring_sum(study, ids, a + g, rng), n)
    else:
        y = ltm_sketch(study, ids, a + g)
        if study.server_sigma > 0:
            y = y + rng.normal(0.0, np.sqrt(server_noise_variance(study)), size=y.shape)
        release = SketchRelease(study=study, sketch=y, n_reports=n)
    if return_inputs:
        return release, ids, g
    return release
