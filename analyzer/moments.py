"""The second moments an estimator fits, in the study's standardized space, and the way back to
the data's units.

A study with bounds maps every raw column x_c to z_c = (x_c - mid_c) / half_c in [-1, 1] and the
mapped row a = [z, 1] * scale into the ball (``dpsketch.protocol.bounds``). Estimators fit in the
z space: it is standardized by the declared bounds (a ridge penalty treats the columns alike, as
scikit-learn users standardize), every noise scale of the release divides by scale^2 the same
way, and the constant coordinate (or a gram study's row sum and count) gives the intercept and
the centre. An answer is then carried back to units by the inverse of the public affine map:

    y = mid_y + half_y z_y,   z_y = theta_0 + sum_c theta_c z_c
    =>  coef_c (units) = half_y theta_c / half_c,
        intercept (units) = mid_y + half_y theta_0 - sum_c coef_c mid_c.

A study without bounds (rows already scaled into the ball by their owner) has the identity map
and, for the sketch, moments and l1 kinds, no first moments: its answers are in the scale the
rows were sent in, uncentered, as before bounds existed.

Everything here is post-processing of the release and public parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpsketch.protocol.bounds import CONSTANT

from .release import GramSumRelease, SecondMoments, noise_scale_of


@dataclass(frozen=True)
class StandardMoments:
    """The release's second moments over its named columns in the z space.

    ``gram``: (d, d), the (debiased) sum of z z^T over the reports; ``sums``: (d,) the sum of z,
    or None when the release carries no first moments; ``n``: the public report count;
    ``mid``, ``half``: the columns' map to units (0 and 1 without bounds); ``noise_scale`` and
    ``cross_noise_scale``: the release's public noise scales (``release.py``) in z units."""

    columns: list[str]
    gram: np.ndarray
    sums: np.ndarray | None
    n: int
    mid: np.ndarray
    half: np.ndarray
    noise_scale: float
    cross_noise_scale: float
    in_units: bool

    @property
    def has_first_moments(self) -> bool:
        return self.sums is not None

    def index(self, names: Sequence[str]) -> list[int]:
        out = []
        for name in names:
            if name not in self.columns:
                raise KeyError(f"column {name!r} is not in the release (columns: {self.columns})")
            out.append(self.columns.index(name))
        return out

    def centered(self) -> np.ndarray:
        """The (d, d) sum of (z - mean)(z - mean)^T: the Gram less n mean mean^T."""
        if self.sums is None:
            raise ValueError("this release carries no column sums: it has no centre")
        return self.gram - np.outer(self.sums, self.sums) / float(self.n)

    def mean(self) -> np.ndarray:
        """The column means in z units (sums / n)."""
        if self.sums is None:
            raise ValueError("this release carries no column sums: it has no means")
        return self.sums / float(self.n)


def standard_moments(release: SecondMoments, debias: bool = True) -> StandardMoments:
    """The release's moments in the z space of its study (any :class:`SecondMoments`; releases
    without a study, such as the evaluation's central baselines, are taken as they are)."""
    study = getattr(release, "study", None)
    g = np.asarray(release.gram(debias), dtype=np.float64)
    columns = list(release.columns)
    tau = noise_scale_of(release)
    cross = float(getattr(release, "cross_noise_scale", 0.0) or 0.0)
    n = int(release.n_reports)
    sums = None
    if study is None or study.bounds is None:
        d = len(columns)
        if isinstance(release, GramSumRelease) and study is not None and study.kind == "gram":
            sums = np.asarray(release.row_sum, dtype=np.float64)
        return StandardMoments(columns, g, sums, n, np.zeros(d), np.ones(d), tau, cross, False)
    cmap = study.column_map
    s2 = cmap.scale ** 2
    d = study.d
    if study.has_constant:  # the Gram of [a, scale]: its last row holds scale * the sums
        sums = g[:d, d] / s2
        g = g[:d, :d]
    elif isinstance(release, GramSumRelease) and study.kind == "gram":
        sums = np.asarray(release.row_sum, dtype=np.float64) / cmap.scale
    return StandardMoments(columns[:d], g / s2, sums, n, cmap.mid, cmap.half, tau / s2, cross / s2, True)


def release_columns(release: SecondMoments) -> list[str]:
    """The named columns an analyst may use (the constant coordinate is not one of them)."""
    return [c for c in release.columns if c != CONSTANT]
