"""Clipping and the client's noise for its rows (docs/protocol.md, section 5).

The noise itself comes from :mod:`dpsketch.protocol.noise` (CSPRNG Gaussian, shared with the
servers' floor noise); this module clips rows to the study's bound and maps them to the vector
the study kind shares. Clipping is done so that the clipped norm never exceeds B even after
rounding.
"""

from __future__ import annotations

import os  # noqa: F401  (tests patch os.urandom through this module)

import numpy as np

from dpsketch.protocol import features
from scipy.special import ndtri  # noqa: F401  (the sampler's inverse CDF, for tests)

from dpsketch.protocol.noise import _unit_uniform, gaussian, standard_normal  # noqa: F401
from dpsketch.protocol.study import Study


def row_norms(rows: np.ndarray) -> np.ndarray:
    """L2 norm of each row, without overflow for huge coordinates."""
    a = np.asarray(rows, dtype=np.float64)
    peak = np.max(np.abs(a), axis=1) if a.shape[1] else np.zeros(len(a))
    safe = np.where(peak > 0, peak, 1.0)
    return np.linalg.norm(a / safe[:, None], axis=1) * safe


def clip_rows(rows: np.ndarray, bound: float) -> np.ndarray:
    """Scale each row to L2 norm at most ``bound``: a * min(1, bound / ||a||).

    Rows already inside the ball are returned unchanged. A scaled row is nudged down by a few
    ulps if rounding left its computed norm above ``bound``, and every coordinate is kept in
    [-bound, bound], so the sensitivity bound holds in floating point too.
    """
    a = np.array(rows, dtype=np.float64, ndmin=2)
    if not np.all(np.isfinite(a)):
        raise ValueError("rows must be finite before clipping")
    norms = row_norms(a)
    over = norms > bound
    if over.any():
        # scale by the largest coordinate first: huge rows (1e200) must not overflow to inf
        peak = np.max(np.abs(a[over]), axis=1, keepdims=True)
        unit = a[over] / peak
        clipped = unit * (bound / np.linalg.norm(unit, axis=1))[:, None]
        for _ in range(8):
            too_big = row_norms(clipped) > bound
            if not too_big.any():
                break
            clipped[too_big] *= 1.0 - 4.0 * np.finfo(np.float64).eps
        a[over] = clipped
    np.clip(a, -bound, bound, out=a)
    return a


def client_vectors(rows: np.ndarray, study: Study) -> np.ndarray:
    """What a client of this study shares before noise: its row clipped to B (sketch), the
    feature vector [a, u(a a^T), 1] of that row (gram), or the one-hot vector of the cell its raw
    values fall in (histogram; ``rows`` then holds the values, ``HistogramValueError`` if one has
    no cell)."""
    if study.histogram is not None:
        return study.histogram.one_hot(study.histogram.cell_index(rows))
    return features.client_vectors(study.kind, clip_rows(rows, study.row_bound))


def privatize(rows: np.ndarray, study: Study) -> np.ndarray:
    """The study kind's vector of each row (:func:`client_vectors`) plus N(0, sigma^2) noise on
    every coordinate.

    The result always lies within ``study.value_bound`` (feature bound + 20 sigma), so
    ``ring.encode`` accepts it. The noise scale is the study's ``sigma``, never recomputed here.
    """
    vectors = client_vectors(rows, study)
    if study.sigma == 0:  # the servers' noise carries the whole guarantee (DAP model)
        return vectors
    return vectors + gaussian(vectors.shape, study.sigma)
