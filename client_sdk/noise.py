"""Clipping and the client's noise for its rows (docs/protocol.md, section 5).

The noise itself comes from :mod:`dpsketch.protocol.noise` (the exact discrete Gaussian on the
study's grid, shared with the servers' noise); this module clips rows to the study's bound, maps
them to the vector the study kind shares, rounds that to the grid and adds the noise there. Rows
are clipped a hair under B (``Study.clip_bound``) so that the rounded vector keeps the study's
sensitivity.
"""

from __future__ import annotations

import numpy as np

from dpsketch.protocol import features, ring
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.noise import encoded_noise, scaled_noise
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


def ball_rows(rows: np.ndarray, study: Study) -> np.ndarray:
    """Rows in the study's row space, before clipping: mapped by the study's bounds (clamp each
    value, centre and scale into the cube, append the constant coordinate, scale into the ball:
    ``dpsketch.protocol.bounds``), or as given when the study declares none."""
    if study.bounds is None:
        return np.asarray(rows, dtype=np.float64)
    return study.column_map.to_ball(rows)


def client_vectors(rows: np.ndarray, study: Study) -> np.ndarray:
    """What a client of this study shares before noise: its row mapped by the study's bounds (if
    any) and clipped to the study's clip bound (sketch), the feature vector [a, u(a a^T), 1] of
    that row (gram), or the one-hot vector of the cell its raw values fall in (histogram;
    ``rows`` then holds the values, ``HistogramValueError`` if one has no cell)."""
    if study.histogram is not None:
        return study.histogram.one_hot(study.histogram.cell_index(rows))
    return features.client_vectors(study.kind, clipped_rows(rows, study))


def clipped_rows(rows: np.ndarray, study: Study) -> np.ndarray:
    """The rows mapped into the study's row space and clipped to its clip bound: what the
    features are made of (and a gram validity study's proof multiplies, validity.witness_rows)."""
    return clip_rows(ball_rows(rows, study), study.clip_bound)


def limited_counts(rows: np.ndarray, study: Study) -> tuple[np.ndarray, int]:
    """What the map into the ball changed, for the data owner to see: per column, how many values
    were clamped to the study's bounds, and how many rows were clipped to its row bound (with
    bounds none: the box maps inside the ball; without, every row of norm above the bound)."""
    a = np.asarray(rows, dtype=np.float64)
    if study.histogram is not None:
        return np.zeros(study.d, dtype=np.int64), 0
    if study.bounds is not None:  # the cube's corners sit on the sphere: only rounding can pass it
        over = row_norms(ball_rows(a, study)) > study.clip_bound * (1.0 + 1e-9)
        return study.column_map.clamped_counts(a), int(np.count_nonzero(over))
    return np.zeros(study.d, dtype=np.int64), int(np.count_nonzero(row_norms(a) > study.clip_bound))


def noisy_encoded(vectors: np.ndarray, study: Study, stream: Keystream | None = None) -> np.ndarray:
    """Vectors rounded to the study's noise grid plus discrete Gaussian noise of parameter sigma on
    every coordinate, encoded on the ring (uint64). Every value stays within
    ``study.value_bound`` (the noise is cut at 20 sigma less one grid step)."""
    grid = study.noise_grid
    if study.proved_features:  # raw products, their noise scaled alike (features.proved_scale)
        scale = study.feature_scale
        encoded = ring.encode_on_grid(np.asarray(vectors) * scale, study.frac_bits, grid.shift, study.value_bound)
        encoded += scaled_noise(len(encoded), study.sigma, scale, grid, stream)
        return encoded.view(np.uint64)
    encoded = ring.encode_on_grid(vectors, study.frac_bits, grid.shift, study.value_bound)
    if study.sigma > 0:  # 0: the servers' noise carries the whole guarantee (DAP model)
        encoded += encoded_noise(encoded.shape, study.sigma, grid, stream)
    return encoded.view(np.uint64)


def privatize_encoded(rows: np.ndarray, study: Study, stream: Keystream | None = None) -> np.ndarray:
    """What a client encodes before sharing: :func:`noisy_encoded` of its rows' vectors."""
    return noisy_encoded(client_vectors(rows, study), study, stream)


def privatize(rows: np.ndarray, study: Study) -> np.ndarray:
    """The noisy vectors as floats (decoded :func:`privatize_encoded`): for simulations and tests.
    The noise scale is the study's ``sigma``, never recomputed here."""
    return ring.decode(privatize_encoded(rows, study), study.frac_bits)
