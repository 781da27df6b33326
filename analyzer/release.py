"""What the analyzer holds after a study is finalized, and the interface estimators consume.

Every mechanism the analyzer knows -- the LTM sketch release, a central noisy Gram matrix (SSP /
Analyze Gauss, or a later study kind that releases A^T A directly), the local model's noisy rows,
the exact non-private Gram -- is exposed through one small interface, :class:`SecondMoments`:

* ``columns``: the d column names, in order;
* ``n_reports``: how many reports (rows) went into the release;
* ``gram(debias)``: a d x d estimate of A^T A, where A is the n x d matrix of clipped rows. With
  ``debias=True`` the known expected contribution of the privacy noise is subtracted, so the
  estimate is unbiased whenever the mechanism's noise law allows it.

Optionally, ``gram_noise_scale`` (a float, public) is the typical spectral norm of the noise left
in the debiased Gram; estimators use it to regularise and to floor eigenvalues. It must be a
function of public parameters only (sigma, n, d, k, ...), never of the private data.

The estimators in :mod:`analyzer.estimators` only use this interface, so one code path serves
every mechanism.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dpsketch.protocol import features, ring
from dpsketch.protocol.study import Study


@runtime_checkable
class SecondMoments(Protocol):
    """Anything estimators can fit on: column names, a report count and a (noisy) Gram matrix."""

    @property
    def columns(self) -> list[str]: ...

    @property
    def n_reports(self) -> int: ...

    def gram(self, debias: bool = True) -> np.ndarray: ...


def noise_scale_of(moments: SecondMoments) -> float:
    """The public ``gram_noise_scale`` of a release, 0 for releases that do not declare one."""
    return float(getattr(moments, "gram_noise_scale", 0.0) or 0.0)


def column_indices(moments: SecondMoments, names: Sequence[str]) -> list[int]:
    """Positions of ``names`` in ``moments.columns``; a clear error for unknown names."""
    cols = list(moments.columns)
    out = []
    for name in names:
        if name not in cols:
            raise KeyError(f"column {name!r} is not in the release (columns: {cols})")
        out.append(cols.index(name))
    return out


class SecondMomentsBase:
    """Shared helpers for concrete releases. Subclasses set ``columns``, ``n_reports`` and
    implement :meth:`gram`; ``gram_noise_scale`` defaults to 0 (no noise)."""

    columns: list[str]
    n_reports: int
    gram_noise_scale: float = 0.0

    def gram(self, debias: bool = True) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def d(self) -> int:
        return len(self.columns)

    def second_moment(self, debias: bool = True) -> np.ndarray:
        """The (uncentered) covariance estimate A^T A / n."""
        return self.gram(debias) / float(self.n_reports)


@dataclass(frozen=True, eq=False)
class GramRelease(SecondMomentsBase):
    """A released (possibly noisy) Gram matrix: the central mechanisms and the exact baseline.

    ``gram_matrix`` is A^T A plus noise; ``bias`` is the known expected noise on the diagonal
    (E[released] = A^T A + bias * I), removed by ``gram(debias=True)``; ``gram_noise_scale`` is the
    typical spectral norm of the zero-mean noise that remains. ``info`` records how the release
    was made (mechanism, noise standard deviation, sensitivity, ...), for reports only.
    """

    columns: list[str]
    n_reports: int
    gram_matrix: np.ndarray
    bias: float = 0.0
    gram_noise_scale: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        g = np.asarray(self.gram_matrix, dtype=np.float64)
        d = len(self.columns)
        if g.shape != (d, d):
            raise ValueError(f"gram matrix must be {d} x {d}, got {g.shape}")
        object.__setattr__(self, "gram_matrix", g)
        object.__setattr__(self, "columns", list(self.columns))

    def gram(self, debias: bool = True) -> np.ndarray:
        g = self.gram_matrix.copy()
        if debias and self.bias:
            g[np.diag_indices_from(g)] -= self.bias
        return g


class StudyRelease(SecondMomentsBase):
    """What the releases of a study have in common: the study, its columns and noise scale."""

    study: Study
    n_reports: int

    def _check(self, attribute: str, shape: tuple[int, ...], what: str) -> None:
        """Store ``attribute`` as a finite float array of ``shape`` and n_reports as an int >= 1."""
        values = np.asarray(getattr(self, attribute), dtype=np.float64)
        if values.shape != shape:
            raise ValueError(f"{what} must have shape {shape}, got {values.shape}")
        if not np.all(np.isfinite(values)):
            raise ValueError(f"{what} contains non-finite values")
        if int(self.n_reports) < 1:
            raise ValueError("n_reports must be at least 1")
        object.__setattr__(self, attribute, values)
        object.__setattr__(self, "n_reports", int(self.n_reports))

    @property
    def columns(self) -> list[str]:  # type: ignore[override]
        """The release's columns: the study's, then ``"1"`` when its rows carry the constant
        coordinate (a study with bounds of the sketch, moments or l1 kind)."""
        return list(self.study.row_columns)

    @property
    def sigma(self) -> float:
        """Client noise standard deviation per coordinate (public, from the study)."""
        return float(self.study.sigma)

    @property
    def server_noise_variance(self) -> float:
        """N server_sigma^2: the variance the N servers' own noise adds to every released cell."""
        return self.study.n_servers * float(self.study.server_sigma) ** 2


@dataclass(frozen=True, eq=False)
class SketchRelease(StudyRelease):
    """The LTM release: Y = S(A + G), a k x d float matrix, for a study and a report count.

    ``sketch`` is exactly S(A + G) + E (the decoded ring sum of the N aggregate shares times
    1/sqrt(s)); G has i.i.d. N(0, sigma^2) entries with sigma = ``study.sigma`` and E, the N
    servers' own noise, i.i.d. N(0, N server_sigma^2) entries. Every column of S has unit norm,
    so trace(S^T S) = n and

        E[Y^T Y] = A^T S^T S A + (sigma^2 n + k N server_sigma^2) I_d      (exactly),

    and ``gram(debias=True)`` subtracts that. ``n_reports`` is the size of the inclusion set the
    servers committed to.
    """

    study: Study
    sketch: np.ndarray
    n_reports: int

    def __post_init__(self) -> None:
        self._check("sketch", (self.study.k, self.study.row_width), "sketch")

    @classmethod
    def from_ring_sum(cls, study: Study, ring_sum: np.ndarray, n_reports: int) -> "SketchRelease":
        """Build the release from the reconstructed ring sum (k x d uint64) of the N shares."""
        if study.kind != "sketch":
            raise ValueError(f"a SketchRelease needs a sketch study, not {study.kind!r}")
        release = release_from_ring_sum(study, ring_sum, n_reports)
        assert isinstance(release, cls)
        return release

    # the SecondMoments interface ---------------------------------------------------------------
    @property
    def noise_variance(self) -> float:
        """sigma^2: the variance of each client's noise per coordinate."""
        return self.sigma**2

    @property
    def cell_noise_variance(self) -> float:
        """Noise variance of one released cell, about sigma^2 n / k + N server_sigma^2."""
        return self.noise_variance * self.n_reports / self.study.k + self.server_noise_variance

    @property
    def gram_bias(self) -> float:
        """sigma^2 n + k N server_sigma^2: the expected noise energy per column,
        E[(Y^T Y)_cc] - (A^T S^T S A)_cc."""
        return self.noise_variance * self.n_reports + self.study.k * self.server_noise_variance

    @property
    def gram_noise_scale(self) -> float:  # type: ignore[override]
        """Typical spectral norm of G^T S^T S G - sigma^2 n I (the noise-by-noise part).

        S S^T is close to (n/k) I_k, so S G + E is close to a k x d matrix of entries of variance
        v = sigma^2 n/k + N server_sigma^2, whose Gram deviates from k v I by about
        v (2 sqrt(k d) + d) in spectral norm (Bai-Yin). The noise-by-data cross terms are not
        included: they depend on A.
        """
        k, d = self.study.k, self.study.row_width
        return self.gram_bias * (2.0 * math.sqrt(d / k) + d / k)

    def gram(self, debias: bool = True) -> np.ndarray:
        g = self.sketch.T @ self.sketch
        if debias:
            g[np.diag_indices_from(g)] -= self.gram_bias
        return g

    @property
    def cross_noise_scale(self) -> float:
        """Typical size of the noise-by-data terms (S A)^T (S G) of Y^T Y.

        Each entry is about N(0, v ||A_c||^2) with v = sigma^2 n/k + N server_sigma^2 the noise
        variance of a cell (S S^T is close to (n/k) I), so the d x d cross term is of order
        sqrt(v) ||A||_F. ||A||_F^2 is estimated by the
        trace of the debiased release (post-processing: no privacy cost). Unlike the
        noise-by-noise part this does not shrink with k; it is what limits ridge accuracy of a
        sketch study (docs/accuracy.md), and the default ridge penalty adds it.
        """
        energy = max(float(np.trace(self.gram(debias=True))), 0.0)
        return math.sqrt(self.cell_noise_variance * energy)

    def noise_info(self) -> dict[str, float]:
        """The public noise law of the release, for reports and dashboards."""
        return {
            "sigma": self.sigma,
            "noise_variance": self.noise_variance,
            "server_noise_variance": self.server_noise_variance,
            "gram_bias": self.gram_bias,
            "gram_noise_scale": self.gram_noise_scale,
            "n_reports": float(self.n_reports),
            "k": float(self.study.k),
            "s": float(self.study.s),
            "lambda_star": float(self.study.lambda_star),
        }


@dataclass(frozen=True, eq=False)
class GramSumRelease(StudyRelease):
    """The release of a gram study: the noisy sum of phi(a) = [a, u(a a^T), 1] over the reports;
    or of a moments study: the noisy sum of u(a a^T) alone (no row sum, no count: ``row_sum`` and
    ``noisy_count`` raise AttributeError, so analyses that need them refuse it).

    Each client added N(0, sigma^2) to every coordinate of phi(a) and each server N(0,
    server_sigma^2), so the sum carries N(0, n sigma^2 + N server_sigma^2) per coordinate: the
    Gram estimate is unbiased (off-diagonal variance half that after undoing the sqrt(2) of u),
    there is nothing to debias, and ``gram(debias)`` returns the same matrix either way. This is
    sufficient statistics perturbation with the central model's noise, spread over the clients
    and the servers.
    """

    study: Study
    values: np.ndarray
    n_reports: int

    def __post_init__(self) -> None:
        if self.study.kind not in features.GRAM_KINDS:
            raise ValueError(f"a GramSumRelease needs a gram or moments study, not {self.study.kind!r}")
        object.__setattr__(self, "values", np.asarray(self.values, dtype=np.float64).reshape(-1))
        self._check("values", (self.study.width,), "a gram release")

    @property
    def coordinate_noise_std(self) -> float:
        """sqrt(n sigma^2 + N server_sigma^2): the noise standard deviation of each released
        coordinate."""
        return math.sqrt(self.sigma ** 2 * self.n_reports + self.server_noise_variance)

    @property
    def gram_noise_scale(self) -> float:  # type: ignore[override]
        """Typical spectral norm of the symmetric noise on A^T A: 2 sqrt(d n sigma^2 / 2)."""
        return self.coordinate_noise_std * math.sqrt(2.0 * self.d)

    def gram(self, debias: bool = True) -> np.ndarray:
        if self.study.kind == "moments":
            return features.symmetric_from_upper(self.values, self.d)
        return features.split_gram_sum(self.values, self.d)[1]

    def _first_moments(self) -> tuple[np.ndarray, np.ndarray, float]:
        if self.study.kind == "moments":
            raise AttributeError("a moments study releases no row sum and no count (use a gram study)")
        return features.split_gram_sum(self.values, self.d)

    @property
    def row_sum(self) -> np.ndarray:
        """The noisy sum of the clipped rows (for means and centering)."""
        return self._first_moments()[0]

    @property
    def noisy_count(self) -> float:
        """The noisy count; ``n_reports`` is the exact, public size of the inclusion set."""
        return self._first_moments()[2]

    def noise_info(self) -> dict[str, float]:
        return {
            "sigma": self.sigma,
            "coordinate_noise_std": self.coordinate_noise_std,
            "gram_noise_scale": self.gram_noise_scale,
            "n_reports": float(self.n_reports),
            "lambda_star": float(self.study.lambda_star),
        }


@dataclass(frozen=True, eq=False)
class HistogramRelease(StudyRelease):
    """The release of a histogram study: the noisy count of every cell of its bins.

    Each client added N(0, sigma^2) to every coordinate of its one-hot vector and each server
    N(0, server_sigma^2), so every released count carries independent N(0, n sigma^2 + N
    server_sigma^2) noise: the central model's histogram, known noise law, nothing to debias for
    the counts themselves. The statistics (quantiles, moments, Kendall's tau, AUC, Gini) live in
    :mod:`analyzer.analyses.histogram`; they take :meth:`histogram`. It has no Gram matrix.
    """

    study: Study
    values: np.ndarray
    n_reports: int

    def __post_init__(self) -> None:
        if self.study.histogram is None:
            raise ValueError(f"a HistogramRelease needs a histogram study, not {self.study.kind!r}")
        object.__setattr__(self, "values", np.asarray(self.values, dtype=np.float64).reshape(-1))
        self._check("values", (self.study.width,), "a histogram release")

    @property
    def cell_noise_variance(self) -> float:
        """n sigma^2 + N server_sigma^2: the noise variance of every released count."""
        return self.sigma ** 2 * self.n_reports + self.server_noise_variance

    def histogram(self):
        """The release as an :class:`analyzer.analyses.histogram.NoisyHistogram` (what the estimators fit)."""
        from .analyses.histogram import NoisyHistogram

        return NoisyHistogram(spec=self.study.histogram, counts=self.values,
                              noise_variance=self.cell_noise_variance, n_reports=self.n_reports)

    def gram(self, debias: bool = True) -> np.ndarray:
        raise TypeError("a histogram release has no Gram matrix: use the statistics of "
                        "analyzer.analyses.histogram (counts, quantiles, moments, Kendall's tau, AUC, Gini)")

    def noise_info(self) -> dict[str, float]:
        return {"sigma": self.sigma, "cell_noise_variance": self.cell_noise_variance,
                "n_reports": float(self.n_reports), "lambda_star": float(self.study.lambda_star)}


@dataclass(frozen=True, eq=False)
class L1Release(StudyRelease):
    """The release of an l1 study: Y = S(A + G) + E for the multi-level l1 sketch S
    (dpsketch/protocol/l1sketch.py), k x d, with its row weights.

    S has 0/1 entries (s at level 0, at most one more at a sampled level), so Y is not rescaled;
    every cell carries the noise of the reports in its bucket (sigma^2 per report) and the N
    servers' N(0, N server_sigma^2 (s + 1)). What it is for: least absolute deviations, the
    weighted l1 fit min sum_r w_r |Y_r,label - Y_r,features . beta| (analyzer/analyses/lad.py). It is not
    an l2 embedding, so it has no Gram matrix estimate.
    """

    study: Study
    sketch: np.ndarray
    n_reports: int

    def __post_init__(self) -> None:
        if self.study.kind != "l1":
            raise ValueError(f"an L1Release needs an l1 study, not {self.study.kind!r}")
        self._check("sketch", (self.study.k, self.study.row_width), "l1 sketch")

    @property
    def weights(self) -> np.ndarray:
        """(k,) the row weights of Algorithm 2: 1/s at level 0, 1/p_h at level h."""
        return self.study.l1_spec.weights()

    @property
    def server_noise_variance(self) -> float:
        """N server_sigma^2 (s + 1): the servers' noise in every released cell (no rescaling)."""
        return self.study.n_servers * float(self.study.server_noise_std) ** 2

    def gram(self, debias: bool = True) -> np.ndarray:
        raise TypeError("an l1 release is an l1 sketch for least absolute deviations (analyzer/analyses/lad.py), "
                        "not an l2 embedding: it has no Gram matrix estimate")

    def noise_info(self) -> dict[str, float]:
        return {"sigma": self.sigma, "server_noise_variance": self.server_noise_variance,
                "n_reports": float(self.n_reports), "lambda_star": float(self.study.lambda_star)}


Release = SketchRelease | GramSumRelease | HistogramRelease | L1Release


def release_from_values(study: Study, values: np.ndarray, n_reports: int) -> Release:
    """The release object of a study from its decoded, scaled k x width values."""
    if study.kind == "histogram":
        return HistogramRelease(study=study, values=np.asarray(values).reshape(-1), n_reports=n_reports)
    if study.kind in features.GRAM_KINDS:
        return GramSumRelease(study=study, values=np.asarray(values).reshape(-1), n_reports=n_reports)
    if study.kind == "l1":
        return L1Release(study=study, sketch=values, n_reports=n_reports)
    return SketchRelease(study=study, sketch=values, n_reports=n_reports)


def release_from_ring_sum(study: Study, ring_sum: np.ndarray, n_reports: int) -> Release:
    """Decode the reconstructed ring sum (k x width uint64) of the N aggregate shares."""
    z = np.asarray(ring_sum)
    if z.dtype != np.uint64:
        raise TypeError(f"ring sum must be uint64, got {z.dtype}")
    if z.shape != study.aggregate_shape:
        raise ValueError(f"ring sum must be {study.aggregate_shape[0]} x {study.aggregate_shape[1]}, got {z.shape}")
    return release_from_values(study, ring.decode(z, study.frac_bits) * study.release_scale, n_reports)
