"""The histogram study kind: which cell a client's value falls in (docs/protocol.md section 2b).

A histogram study counts one column over explicit bins, or two columns over the joint grid of
their bins. Each client maps its value(s) to one cell, shares the one-hot vector of that cell
(plus its noise), and the servers only add (k = s = 1): the release is the noisy histogram, with
the central model's noise spread over the clients and the servers. Every value lands in some
cell: a numeric axis has an underflow and an overflow bin around its edges, a categorical axis an
"other" bin after its categories, so nothing is ever dropped silently.

Cells, per axis (``Axis.index``):

* numeric, edges e_0 < ... < e_{m-1}: cell 0 is x < e_0, cell j (1 <= j <= m-1) is
  e_{j-1} <= x < e_j, cell m is x >= e_{m-1} (numpy's ``searchsorted(edges, x, "right")``); m + 1
  cells. NaN is refused, +-inf land in the outer bins.
* categorical, categories c_0 .. c_{m-1}: the value's string (``str(v).strip()``) equal to c_j is
  cell j, anything else cell m ("other"); m + 1 cells.

Two axes: cell = i_1 * cells_2 + i_2 (row-major). The width of a share is the number of cells.
A one-hot vector has L2 norm 1, so replacing a client's value moves it by sqrt(2) and adding or
removing a client by 1: those are the kind's sensitivities (``privacy.sensitivity``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Most cells of one histogram study. A share is 8 bytes a cell (64 KiB at 8,192 cells, the
#: analyzer's default upload budget; only one server gets the full width with seed compression);
#: beyond this a sketched histogram (an OSNAP sketch of the one-hot vectors) is the tool.
MAX_CELLS = 1 << 16
MAX_BINS_PER_AXIS = 4096
OTHER = "(other)"


class HistogramValueError(ValueError):
    """A value that cannot be placed in a cell (NaN, or not a number on a numeric axis)."""


class Axis(BaseModel):
    """One binned column: numeric ``edges`` or ``categories``, never both."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    column: str
    edges: list[float] | None = Field(default=None, min_length=1, max_length=MAX_BINS_PER_AXIS - 1)
    categories: list[str] | None = Field(default=None, min_length=1, max_length=MAX_BINS_PER_AXIS - 1)

    @model_validator(mode="after")
    def _one_kind(self) -> "Axis":
        if (self.edges is None) == (self.categories is None):
            raise ValueError(f"axis {self.column!r}: give either edges (numeric) or categories, not both")
        if self.edges is not None and any(b <= a for a, b in zip(self.edges, self.edges[1:])):
            raise ValueError(f"axis {self.column!r}: edges must be strictly increasing")
        if self.categories is not None:
            stripped = [c.strip() for c in self.categories]
            if stripped != list(self.categories) or any(not c for c in stripped):
                raise ValueError(f"axis {self.column!r}: categories must be non-empty and without "
                                 f"leading or trailing spaces")
            if len(set(stripped)) != len(stripped):
                raise ValueError(f"axis {self.column!r}: categories must be distinct")
        return self

    @property
    def numeric(self) -> bool:
        return self.edges is not None

    @property
    def bins(self) -> int:
        """Cells of this axis, the outer or "other" bin included."""
        return len(self.edges if self.edges is not None else self.categories) + 1  # type: ignore[arg-type]

    def labels(self) -> list[str]:
        """A readable name per cell: "< e0", "[e0, e1)", ..., ">= e_last"; or the categories and
        "(other)"."""
        if self.categories is not None:
            return [*self.categories, OTHER]
        e = self.edges or []
        return [f"< {e[0]:g}", *(f"[{a:g}, {b:g})" for a, b in zip(e, e[1:])), f">= {e[-1]:g}"]

    def representatives(self) -> np.ndarray:
        """A value standing for each cell of a numeric axis: interior bins their midpoints, the
        outer bins their edge (they are unbounded: docs/protocol.md 2b says what that costs)."""
        if self.edges is None:
            raise ValueError(f"axis {self.column!r} is categorical: its cells have no values")
        e = np.asarray(self.edges, dtype=np.float64)
        return np.concatenate([[e[0]], (e[:-1] + e[1:]) / 2.0, [e[-1]]])

    def index(self, values: Sequence[Any] | np.ndarray, *, first_row: int = 0) -> np.ndarray:
        """Each value's cell on this axis (int64); HistogramValueError naming the first bad row."""
        if self.categories is not None:
            lookup = {c: j for j, c in enumerate(self.categories)}
            other = len(self.categories)
            return np.fromiter((lookup.get(str(v).strip(), other) for v in values), dtype=np.int64,
                               count=len(values))
        try:
            x = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError):
            x = None
        if x is None:
            for i, v in enumerate(values):
                try:
                    float(v)
                except (TypeError, ValueError):
                    raise HistogramValueError(f"row {first_row + i}, column {self.column}: {v!r} is "
                                              f"not a number (the axis has numeric edges)") from None
            raise HistogramValueError(f"column {self.column}: values are not numbers")  # pragma: no cover
        bad = np.flatnonzero(np.isnan(x))
        if bad.size:
            raise HistogramValueError(f"row {first_row + int(bad[0])}, column {self.column}: NaN has no "
                                      f"bin (an out-of-range number lands in the outer bins)")
        return np.searchsorted(np.asarray(self.edges), x, side="right").astype(np.int64)


class HistogramSpec(BaseModel):
    """The bins of a histogram study: one axis, or two for a joint grid."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    axes: list[Axis] = Field(min_length=1, max_length=2)

    @model_validator(mode="after")
    def _size(self) -> "HistogramSpec":
        names = [a.column for a in self.axes]
        if len(set(names)) != len(names):
            raise ValueError("the two axes must bin different columns")
        if self.cells > MAX_CELLS:
            raise ValueError(f"{self.cells} cells is more than {MAX_CELLS}: use coarser bins (a share is "
                             f"8 bytes a cell)")
        return self

    @property
    def columns(self) -> list[str]:
        return [a.column for a in self.axes]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(a.bins for a in self.axes)

    @property
    def cells(self) -> int:
        return math.prod(self.shape)

    def axis(self, column: str) -> tuple[int, Axis]:
        for i, a in enumerate(self.axes):
            if a.column == column:
                return i, a
        raise KeyError(f"the histogram has no axis {column!r} (axes: {', '.join(self.columns)})")

    def cell_index(self, values: np.ndarray, *, first_row: int = 0) -> np.ndarray:
        """The cell of each row of ``values`` ((m, len(axes)), in axis order): an int64 (m,)."""
        v = np.asarray(values, dtype=object)
        if v.ndim != 2 or v.shape[1] != len(self.axes):
            raise HistogramValueError(f"expected rows of {len(self.axes)} value(s) "
                                      f"({', '.join(self.columns)}), got shape {v.shape}")
        index = np.zeros(v.shape[0], dtype=np.int64)
        for j, axis in enumerate(self.axes):
            index = index * axis.bins + axis.index(v[:, j], first_row=first_row)
        return index

    def one_hot(self, cells: np.ndarray) -> np.ndarray:
        """(m, cells) float64 rows, a 1 in each row's cell."""
        out = np.zeros((len(cells), self.cells), dtype=np.float64)
        out[np.arange(len(cells)), cells] = 1.0
        return out


def parse_axis(text: str) -> Axis:
    """An axis from the command line: ``COLUMN:e0,e1,...`` (numeric edges) or
    ``COLUMN=cat1,cat2,...`` (categories)."""
    if ":" in text and ("=" not in text or text.index(":") < text.index("=")):
        column, _, rest = text.partition(":")
        try:
            edges = [float(x) for x in rest.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{text!r}: numeric edges must be numbers, e.g. age:18,30,50,70") from None
        return Axis(column=column.strip(), edges=edges)
    if "=" in text:
        column, _, rest = text.partition("=")
        return Axis(column=column.strip(), categories=[c.strip() for c in rest.split(",") if c.strip()])
    raise ValueError(f"{text!r}: give COLUMN:e0,e1,... (numeric edges) or COLUMN=a,b,... (categories)")
