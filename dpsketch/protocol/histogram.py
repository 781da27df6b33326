"""The histogram study kind: which cell a client's value falls in (docs/protocol.md section 2b).

A histogram study counts one column over explicit bins, or two columns over the joint grid of
their bins, or (``marginal``) up to 64 columns each over its own bins. Each client maps its
value(s) to one cell (one cell per axis in a marginal histogram), shares the one-hot (multi-hot)
vector of its cell(s) plus its noise, and the servers only add (k = s = 1): the release is the
noisy histogram, with the central model's noise spread over the clients and the servers. Every
value lands in some cell: a numeric axis has an underflow and an overflow bin around its edges, a
categorical axis an "other" bin after its categories, so nothing is ever dropped silently.

Cells, per axis (``Axis.index``):

* numeric, edges e_0 < ... < e_{m-1}: cell 0 is x < e_0, cell j (1 <= j <= m-1) is
  e_{j-1} <= x < e_j, cell m is x >= e_{m-1} (numpy's ``searchsorted(edges, x, "right")``); m + 1
  cells. NaN is refused, +-inf land in the outer bins.
* categorical, categories c_0 .. c_{m-1}: the value's string (``str(v).strip()``) equal to c_j is
  cell j, anything else cell m ("other"); m + 1 cells.

Two axes (a joint grid): cell = i_1 * cells_2 + i_2 (row-major). The width of a share is the
number of cells. A one-hot vector has L2 norm 1, so replacing a client's value moves it by
sqrt(2) and adding or removing a client by 1: those are the kind's sensitivities
(``privacy.sensitivity``, with the study's row bound B = 1).

Marginal (``marginal: true``, 1 to 64 axes): no grid. The cells are the axes' cells one axis after
the other (axis j's cell i is cell offset_j + i, offset_j the cells of the axes before it), and a
client's vector has a 1 in its cell of every axis: m ones for m axes, L2 norm sqrt(m), which is
the study's row bound B. Replacing a client moves it by at most sqrt(2 m) = sqrt(2) B, adding or
removing one by B: exactly the noise m one-axis histograms would need composed as Gaussian
mechanisms, in one study charged once. Why not a joint grid: the grid of m axes of ~150 bins is
150^m cells, while the marginals are 150 m, and per-column quantiles (what a pilot for bounds
needs, ``analyzer/analyses/pilot.py``) read only the marginals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

#: Most cells of one histogram study. A share is 8 bytes a cell (64 KiB at 8,192 cells, the
#: analyzer's default upload budget; only one server gets the full width with seed compression);
#: beyond this a sketched histogram (an OSNAP sketch of the one-hot vectors) is the tool.
MAX_CELLS = 1 << 16
MAX_BINS_PER_AXIS = 4096
#: Most axes of a marginal histogram (a joint grid has one or two).
MAX_MARGINAL_AXES = 64
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
    """The bins of a histogram study: one axis, two for a joint grid, or 1 to 64 axes counted
    side by side (``marginal``, module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    axes: list[Axis] = Field(min_length=1, max_length=MAX_MARGINAL_AXES)
    #: the axes' cells side by side, one 1 per axis in each client's vector (not a joint grid);
    #: omitted from the JSON when false, so the ids of one- and two-axis studies are unchanged
    marginal: bool = False

    @model_validator(mode="after")
    def _size(self) -> "HistogramSpec":
        names = [a.column for a in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"the axes must bin different columns, got {names}")
        if not self.marginal and len(self.axes) > 2:
            raise ValueError(f"a joint histogram has one or two axes (a grid), not {len(self.axes)}: "
                             f"set marginal: true to count up to {MAX_MARGINAL_AXES} columns side by side")
        if self.cells > MAX_CELLS:
            raise ValueError(f"{self.cells} cells is more than {MAX_CELLS}: use coarser bins (a share is "
                             f"8 bytes a cell)")
        return self

    @model_serializer(mode="wrap")
    def _omit_joint(self, handler):
        """``marginal`` appears only when true: a joint histogram's JSON is what it was before it."""
        data = handler(self)
        if isinstance(data, dict) and data.get("marginal") is False:
            data.pop("marginal")
        return data

    @property
    def columns(self) -> list[str]:
        return [a.column for a in self.axes]

    @property
    def shape(self) -> tuple[int, ...]:
        """Cells per axis (of the grid for a joint histogram; of each block for a marginal one)."""
        return tuple(a.bins for a in self.axes)

    @property
    def cells(self) -> int:
        """Width of a share: the grid's cells, or the axes' cells summed for a marginal histogram."""
        return sum(self.shape) if self.marginal else math.prod(self.shape)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each axis' block of cells starts in a marginal histogram (0 for the only axis)."""
        if not self.marginal and len(self.axes) > 1:
            raise ValueError("a joint histogram's cells are a grid, not blocks per axis")
        starts = [0]
        for bins in self.shape[:-1]:
            starts.append(starts[-1] + bins)
        return tuple(starts)

    @property
    def row_norm(self) -> float:
        """The L2 norm of every client's vector, the study's row bound: 1 (one-hot), or sqrt(m)
        for a marginal histogram of m axes (m ones)."""
        return math.sqrt(len(self.axes)) if self.marginal else 1.0

    def axis(self, column: str) -> tuple[int, Axis]:
        for i, a in enumerate(self.axes):
            if a.column == column:
                return i, a
        raise KeyError(f"the histogram has no axis {column!r} (axes: {', '.join(self.columns)})")

    def cell_index(self, values: np.ndarray, *, first_row: int = 0) -> np.ndarray:
        """The cell of each row of ``values`` ((m, len(axes)), in axis order): an int64 (m,) for a
        joint histogram; for a marginal one an int64 (m, len(axes)), row i's cell in every axis'
        block (offset included)."""
        v = np.asarray(values, dtype=object)
        if v.ndim != 2 or v.shape[1] != len(self.axes):
            raise HistogramValueError(f"expected rows of {len(self.axes)} value(s) "
                                      f"({', '.join(self.columns)}), got shape {v.shape}")
        if self.marginal:
            out = np.empty(v.shape, dtype=np.int64)
            for j, (axis, start) in enumerate(zip(self.axes, self.offsets)):
                out[:, j] = start + axis.index(v[:, j], first_row=first_row)
            return out
        index = np.zeros(v.shape[0], dtype=np.int64)
        for j, axis in enumerate(self.axes):
            index = index * axis.bins + axis.index(v[:, j], first_row=first_row)
        return index

    def one_hot(self, cells: np.ndarray) -> np.ndarray:
        """(m, cells) float64 rows, a 1 in each row's cell: ``cells`` as :meth:`cell_index` gives
        them, (m,) (one-hot) or (m, axes) for a marginal histogram (a 1 per axis, multi-hot)."""
        cells = np.asarray(cells, dtype=np.int64)
        out = np.zeros((len(cells), self.cells), dtype=np.float64)
        rows = np.arange(len(cells))
        out[rows[:, None] if cells.ndim == 2 else rows, cells] = 1.0
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
