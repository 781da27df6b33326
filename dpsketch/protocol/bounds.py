"""Data in its own units: a study's public per-column bounds and the map of a raw row into the
study's row ball (docs/protocol.md section 2e).

A row of raw values (a wage of 2,500, an age of 41) cannot be shared as it is: the noise is
calibrated for rows of L2 norm at most B, and clipping a raw row to norm 1 silently destroys it.
A study that declares ``bounds`` fixes, for every column c, a public interval [lo_c, hi_c];
every client maps its row the same way before anything else:

    x'_c = min(max(x_c, lo_c), hi_c)                     clamp (counted per column)
    z_c  = (x'_c - mid_c) / half_c,  mid_c = lo_c / 2 + hi_c / 2,  half_c = hi_c / 2 - lo_c / 2
    z_c  = min(max(z_c, -1), 1)                          (absorbs rounding at the edges)
    u    = [z_1 .. z_d]        or [z_1 .. z_d, 1] when the study carries the constant coordinate
    a    = u * (B' / sqrt(len(u)))                        B' the study's clip bound (section 5)

So every in-bounds row lands in the ball of radius B' (u lies in the cube [-1, 1]^w, whose
corners have norm sqrt(w)) and no in-bounds row is ever clipped: the only loss is the clamping
of values outside the declared bounds, which the client counts and reports. The operations are
IEEE double operations in exactly this order, so two conforming clients map a row to the same
bits. The map is affine and public, so the analyzer inverts it exactly: answers come back in the
data's units (``ColumnMap``).

Why the constant coordinate: the sketch kind releases only second moments (S(A + G) has no
column sums), and so do the moments and l1 kinds; a constant 1 in every row makes the Gram of the
mapped rows carry the column sums and the count, so regression gets its intercept and PCA its
centre. A gram study shares [a, u(a a^T), 1] and already releases both, so it adds nothing.
The constant survives the secret sign: (t a)(t a)^T = a a^T.

Why the midpoint and half-width: they map the declared box onto the cube [-1, 1]^d with the
smallest ball around it, so the clipping bound costs the least signal; tighter bounds give a
larger share of the ball to the data (less noise relative to it) at the price of clamping more
values (docs/accuracy.md, "Choosing bounds").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: Largest |bound| a study may declare: keeps mid and half exact enough in doubles (a half-width
#: of 1e-300 next to a midpoint of 1e300 would map every value to -1 or 1).
MAX_ABS_BOUND = 1e15

#: The name of the constant coordinate in a release's columns (never a valid column name: names
#: start with a letter or an underscore).
CONSTANT = "1"

#: Study kinds whose mapped row carries the constant coordinate when the study has bounds.
CONSTANT_KINDS = ("sketch", "moments", "l1")

#: The SDK warns when more than this share of a column's values were clamped.
CLAMP_WARNING_SHARE = 0.01


def check_bounds(bounds: Sequence[Sequence[float]], columns: Sequence[str]) -> list[tuple[float, float]]:
    """The bounds as a list of (lo, hi) floats aligned with ``columns``; ValueError naming the
    column when a pair is malformed, not finite, out of range or not increasing."""
    if len(bounds) != len(columns):
        raise ValueError(f"bounds: {len(bounds)} pairs for {len(columns)} columns; give one [lower, upper] "
                         f"per column, in column order")
    out = []
    for name, pair in zip(columns, bounds):
        if len(pair) != 2:
            raise ValueError(f"bounds of {name}: expected [lower, upper], got {list(pair)!r}")
        lo, hi = float(pair[0]), float(pair[1])
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"bounds of {name}: [{lo}, {hi}] must be finite numbers")
        if max(abs(lo), abs(hi)) > MAX_ABS_BOUND:
            raise ValueError(f"bounds of {name}: [{lo:g}, {hi:g}] exceed {MAX_ABS_BOUND:g} in absolute value")
        if not lo < hi:
            raise ValueError(f"bounds of {name}: the lower bound {lo:g} must be below the upper bound {hi:g}")
        if not (hi / 2.0 - lo / 2.0) > 0:
            raise ValueError(f"bounds of {name}: [{lo:g}, {hi:g}] is too narrow to map")
        out.append((lo, hi))
    return out


def bounds_from_mapping(bounds: Mapping[str, Sequence[float]] | Sequence[Sequence[float]],
                        columns: Sequence[str]) -> list[list[float]]:
    """Bounds given by column name ({"age": [16, 90], ...}) or already in column order, as the
    list aligned with ``columns`` that the study holds; ValueError naming missing or unknown
    columns."""
    if isinstance(bounds, Mapping):
        unknown = [c for c in bounds if c not in columns]
        if unknown:
            raise ValueError(f"bounds name columns the study does not have: {', '.join(map(str, unknown))} "
                             f"(columns: {', '.join(columns)})")
        missing = [c for c in columns if c not in bounds]
        if missing:
            raise ValueError(f"bounds are missing for column(s) {', '.join(missing)}: give [lower, upper] "
                             f"for every column")
        bounds = [bounds[c] for c in columns]
    return [list(p) for p in check_bounds(bounds, columns)]


def parse_bounds(text: str) -> dict[str, list[float]]:
    """``age=16:90,hours=0:100`` (the command line's form) as {"age": [16, 90], ...}."""
    out: dict[str, list[float]] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, eq, rng = item.partition("=")
        lo, colon, hi = rng.partition(":")
        if not eq or not colon or not name.strip():
            raise ValueError(f"--bounds item {item!r}: expected COLUMN=LOWER:UPPER, e.g. age=16:90")
        if name.strip() in out:
            raise ValueError(f"--bounds names {name.strip()} twice")
        try:
            out[name.strip()] = [float(lo), float(hi)]
        except ValueError:
            raise ValueError(f"--bounds item {item!r}: LOWER and UPPER must be numbers") from None
    if not out:
        raise ValueError("--bounds is empty: give COLUMN=LOWER:UPPER for every column")
    return out


@dataclass(frozen=True)
class ColumnMap:
    """The public affine map between a study's raw columns and its mapped rows (module docstring).

    ``lo``, ``hi``: the bounds; ``mid``, ``half``: their midpoints and half-widths; ``constant``:
    whether the mapped row ends in the constant coordinate; ``scale``: B' / sqrt(w), what the
    cube coordinates u are multiplied by. A study without bounds has the identity map (mid 0,
    half 1, scale 1, no constant): its rows are taken as already scaled into the ball, so the
    analyzer converts nothing (only :meth:`of` maps for clients)."""

    lo: np.ndarray
    hi: np.ndarray
    constant: bool
    scale: float

    @classmethod
    def identity(cls, d: int) -> "ColumnMap":
        return cls(lo=np.full(d, -1.0), hi=np.full(d, 1.0), constant=False, scale=1.0)

    @classmethod
    def of(cls, bounds: Sequence[Sequence[float]], constant: bool, clip_bound: float) -> "ColumnMap":
        b = np.asarray(bounds, dtype=np.float64).reshape(-1, 2)
        width = b.shape[0] + (1 if constant else 0)
        return cls(lo=b[:, 0].copy(), hi=b[:, 1].copy(), constant=constant,
                   scale=float(clip_bound) / math.sqrt(width))

    @property
    def d(self) -> int:
        return len(self.lo)

    @property
    def mid(self) -> np.ndarray:
        return self.lo / 2.0 + self.hi / 2.0

    @property
    def half(self) -> np.ndarray:
        return self.hi / 2.0 - self.lo / 2.0

    @property
    def width(self) -> int:
        """Length of a mapped row."""
        return self.d + (1 if self.constant else 0)

    def clamped_counts(self, rows: np.ndarray) -> np.ndarray:
        """Per column, how many of ``rows``' values lie outside the bounds (int64, (d,))."""
        a = np.asarray(rows, dtype=np.float64)
        return np.count_nonzero((a < self.lo) | (a > self.hi), axis=0).astype(np.int64)

    def to_ball(self, rows: np.ndarray) -> np.ndarray:
        """The mapped rows a (m, width): clamp, centre, scale to the cube, add the constant, scale
        into the ball (module docstring, operation for operation). Rows must be finite."""
        a = np.asarray(rows, dtype=np.float64)
        if a.ndim != 2 or a.shape[1] != self.d:
            raise ValueError(f"expected rows of {self.d} values, got shape {a.shape}")
        if not np.isfinite(a).all():  # NaN would pass the clamp; the SDK names the row first
            raise ValueError("rows must be finite numbers before they are mapped")
        clamped = np.minimum(np.maximum(a, self.lo), self.hi)
        z = np.clip((clamped - self.mid) / self.half, -1.0, 1.0)
        if self.constant:
            z = np.concatenate([z, np.ones((len(z), 1))], axis=1)
        return z * self.scale

    def from_ball(self, mapped: np.ndarray) -> np.ndarray:
        """Raw values of mapped rows (the inverse of :meth:`to_ball` on in-bounds rows)."""
        a = np.asarray(mapped, dtype=np.float64)[:, : self.d]
        return self.mid + self.half * (a / self.scale)
