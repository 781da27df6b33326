"""A private pilot that proposes bounds: how an analyst without domain bounds gets good ones
without looking at the data (docs/bounds.md).

Step 1, the pilot: a marginal histogram study (docs/protocol.md section 2b) over the columns, with
the same scale-free edges on every axis (:func:`pilot_spec`), so nothing about the data needs to
be known. It is a study like any other: provisioned at every server, charged to the population's
ledger, released once. Step 2: :func:`propose_bounds` reads the release and proposes, per column,
[lower, upper] that leave out about ``lower`` and ``1 - upper`` of the reports, as the public
bounds of the real study (``age=15:100,hours=10:100``, what ``dpsketch.protocol.bounds.parse_bounds``
reads). Everything here is post-processing of the release and of its public noise law.

The edges: +-{1, 1.5, 2, 3, 5, 7} x 10^j for j = -2 .. 9, and 0 (145 edges, 146 cells an axis).
Why these: a bound is an edge, so the grid is the proposal's resolution; consecutive edges are
at most 5/3 apart, so a bound overshoots the data by less than that ratio (a 1-2-5 grid: 2.5;
on the simulated pilots below its proposals were up to 1.27 times wider, 1.94 against 1.53
times the data's range for a normal column around 5, and a fit's error grows about as the
square of the width: docs/bounds.md), and they are round numbers an analyst can read and keep.
Twelve decades each way cover cents to billions, 1e-2 to 7e9, with no scale to guess. More
cells do not cost noise per cell (a marginal histogram's noise depends on its number of axes,
not of cells: sensitivity sqrt(2 m)), only bytes per report (8 a cell: 1.2 KB a column) and the
noise of the sums over the cells the data span (six a decade), which the estimator below takes
instead of sums from the far end.

The estimator, and why not the plain quantile of the noisy CDF. The cumulative count at an edge
carries the noise of every cell below it: at the defaults (n = 20,000, epsilon 0.5, four
columns) each cell has N(0, 24^2) noise and the CDF near a positive column's lower tail sums
about 90 mostly empty cells (sd about 1 % of n), twice the 0.5 % tail it is looking for. On
simulated pilots (``benchmarks/bounds_choice.py``, 50 each of eleven column shapes) the plain
quantiles of the noisy CDF (``analyzer.analyses.histogram.Quantiles``) gave a median range more than 100
times the data's for 8 of the 11 shapes, from noise in empty cells alone. So:

1. Support: cells whose noisy count exceeds ``DETECTION_SIGMAS`` (5) noise standard deviations
   hold data (a false alarm has probability 3e-7 a cell, 0.3 % over 64 axes of 146 cells). The
   window is every cell from the first such cell to the last, plus one cell either side (where
   a tail too thin to stand out of the noise usually sits). No cell detected: the window is all
   cells, and the proposal says so (``no_signal``).
2. Tails: the mass below edge e is the sum of the window's noisy counts below e, from the
   window's lower end; the mass above, from its upper end (cells outside the window count as
   empty). Both sums are made monotone (isotonic regression, scipy's PAVA), which takes care of
   noise that would make the CDF go down.
3. Bounds: ``lower`` is the largest edge with at most ``lower`` x n below it, ``upper`` the
   smallest edge with at most (1 - ``upper``) x n above it: edges at or outside the quantiles.

Degenerate columns: all reports in one bin (a constant column) get that bin's edges; a 0/1
column gets [0, 1] (positive edges are nudged up by one ulp, so a value equal to a round edge
falls in the bin below it and the upper bound can be that edge; bounds are reported to 15
significant digits, which undoes the nudge); a column with more than ``lower`` of its reports
below the lowest edge (or above the highest) gets that edge, flagged ``below_range``
(``above_range``): those values will be clamped. Measured on the same simulated pilots (shapes:
integer ages, clipped hours, lognormal wages, 0/1, a normal with negatives, Pareto, 1e-3 and 1e6
scales, a constant, zero-inflated, bimodal): the mean share clamped per tail at most 0.61 % (the
largest single one 0.87 %), the proposed range at most 1.94 times the data's 0.5-99.5 % range;
with twice the noise 0.77 %, 0.91 % and 2.17. ``tests/test_pilot.py`` checks proposals on
releases simulated in law and on real ones.

The REST routes
---------------
``install`` adds the analyzer's routes for the bounds pilot (docs/bounds.md).

``POST /v1/pilots`` creates the pilot: a marginal histogram study over the columns with the
pilot's scale-free edges, through the same path as ``POST /v1/studies`` (designed, provisioned at
every server, charged to the population's ledger). ``POST /v1/studies/{id}/analyses/bounds``
reads a released histogram study and proposes bounds for its numeric columns.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dpsketch.protocol import ProblemError, privacy
from dpsketch.protocol.histogram import MAX_MARGINAL_AXES, Axis, HistogramSpec
from dpsketch.protocol.study import POPULATION_PATTERN

from ..release import HistogramRelease, Release
from .histogram import NoisyHistogram
from .routes import json_finite, refuse

if TYPE_CHECKING:
    from fastapi import FastAPI

#: The mantissas of the pilot's edges in every decade (see the module docstring for why).
MANTISSAS = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
#: The decades 10^j the edges span, each way from 0.
DECADES = range(-2, 10)
#: A cell holds data when its noisy count exceeds this many noise standard deviations.
DETECTION_SIGMAS = 5.0
#: What a pilot spends by default (replace-one, delta 1e-6): enough at 20,000 reports to place
#: 0.5 % tails (measured, module docstring); its cost is charged like any study's.
DEFAULT_EPSILON = 0.5
DEFAULT_LOWER, DEFAULT_UPPER = 0.005, 0.995
#: A pilot's default max_reports, as a multiple of the expected count (a study's is 10): a pilot
#: report is 1.2 KB a column, and a server's default storage policy (32 GiB a study) counts
#: max_reports of them, so 10x would refuse a three-column pilot of 10^6 expected reports.
MAX_REPORTS_FACTOR = 2


def default_max_reports(expected_reports: int) -> int:
    return max(MAX_REPORTS_FACTOR * expected_reports, 1000)


def pilot_edges() -> list[float]:
    """The pilot's edges, ascending: negative round numbers, 0, positive ones nudged up one ulp."""
    magnitudes = sorted(m * 10.0 ** j for j in DECADES for m in MANTISSAS)
    return [-x for x in reversed(magnitudes)] + [0.0] + [math.nextafter(x, math.inf) for x in magnitudes]


def pilot_spec(columns: Sequence[str]) -> HistogramSpec:
    """The pilot study's bins: a marginal histogram, the same scale-free edges on every column."""
    edges = pilot_edges()
    return HistogramSpec(axes=[Axis(column=c, edges=edges) for c in columns], marginal=True)


def shown(x: float) -> float:
    """An edge as a bound: to 15 significant digits (undoes the pilot's one-ulp nudge)."""
    return float(f"{x:.15g}")


@dataclass
class ColumnProposal:
    """What the pilot proposes for one column, and what it is based on.

    ``lower``, ``upper``: the bounds. ``below``, ``above``: the estimated share of reports below
    ``lower`` and above ``upper`` (what the real study will clamp), each with its standard error
    ``below_se``, ``above_se`` from the noise law. ``data_from``, ``data_to``: the edges around
    the cells that clearly hold data (the detected support); ``flags``: ``one_bin``,
    ``below_range``, ``above_range``, ``no_signal``; ``note``: what the flags mean."""

    column: str
    lower: float
    upper: float
    below: float
    above: float
    below_se: float
    above_se: float
    data_from: float | None
    data_to: float | None
    flags: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class BoundsProposal:
    """Proposed bounds for every numeric column of a released histogram."""

    bounds: dict[str, list[float]]
    columns: list[ColumnProposal]
    lower: float
    upper: float
    n_reports: int
    noise_sd: float
    #: categorical axes (they have no bounds)
    skipped: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The bounds as the command line takes them: ``age=15:100,hours=10:100``."""
        return ",".join(f"{c}={lo:.15g}:{hi:.15g}" for c, (lo, hi) in self.bounds.items())

    def as_dict(self) -> dict[str, Any]:
        return {"bounds": self.bounds, "text": self.text, "lower": self.lower, "upper": self.upper,
                "n_reports": self.n_reports, "noise_sd": self.noise_sd,
                "columns": [asdict(c) for c in self.columns], "skipped": self.skipped}


def _monotone(x: np.ndarray) -> np.ndarray:
    from scipy.optimize import isotonic_regression  # scipy.optimize is slow to import: on use

    return np.maximum(isotonic_regression(x).x, 0.0)


def propose_column(hist: NoisyHistogram, column: str, lower: float = DEFAULT_LOWER,
                   upper: float = DEFAULT_UPPER) -> ColumnProposal:
    """The proposal for one numeric column of ``hist`` (module docstring, steps 1 to 3)."""
    one = hist.marginal(column)
    axis = one.spec.axes[0]
    if not axis.numeric:
        raise ValueError(f"column {column!r} is categorical: it has no bounds")
    edges = np.asarray(axis.edges, dtype=np.float64)
    m = len(edges)
    if m < 2:
        raise ValueError(f"column {column!r} has one edge: bounds need at least two")
    n = float(one.n_reports)
    y = one.counts
    sd = math.sqrt(one.noise_variance)
    flags: list[str] = []
    held = np.flatnonzero(y > DETECTION_SIGMAS * sd)
    if held.size == 0:
        flags.append("no_signal")
        first, last = 0, m
    else:
        first, last = max(int(held[0]) - 1, 0), min(int(held[-1]) + 1, m)
    window = np.zeros_like(y)
    window[first:last + 1] = y[first:last + 1]
    below = _monotone(np.cumsum(window))                 # below[j]: cells 0..j, the values < e_j
    above = _monotone(np.cumsum(window[::-1]))[::-1]     # above[j]: cells j..m
    ok_low = np.flatnonzero(below[:m] <= lower * n)
    ok_high = np.flatnonzero(above[1:] <= (1.0 - upper) * n)  # above[j + 1]: the values >= e_j
    if ok_low.size:
        lo = int(ok_low[-1])
    else:
        lo = 0
        flags.append("below_range")
    if ok_high.size:
        hi = int(ok_high[0])
    else:
        hi = m - 1
        flags.append("above_range")
    if hi <= lo:  # only when the window's sums are mostly noise (no_signal)
        hi = min(lo + 1, m - 1)
        lo = hi - 1
    if held.size == 1 and 0 < held[0] < m and hi - lo == 1:  # one interior (bounded) bin
        flags.append("one_bin")
    lo_value, hi_value = shown(edges[lo]), shown(edges[hi])
    if not lo_value < hi_value:  # edges closer than 15 digits apart (not a pilot's)
        lo_value, hi_value = float(edges[lo]), float(edges[hi])
    cells_below = max(lo + 1 - first, 0)
    cells_above = max(last - hi, 0)
    notes = {
        "no_signal": "no cell stands out of the noise: too few reports for this epsilon, so the bounds "
                     "come from sums of mostly noise (run the pilot with more reports or epsilon)",
        "below_range": f"more than {lower:g} of the reports lie below the pilot's lowest edge "
                       f"{shown(edges[0]):g}: they will be clamped",
        "above_range": f"more than {1 - upper:g} of the reports lie at or above the pilot's highest edge "
                       f"{shown(edges[-1]):g}: they will be clamped",
        "one_bin": "every report that stands out of the noise is in one bin (a constant column?): the "
                   "bounds are that bin's edges",
    }
    return ColumnProposal(
        column=column, lower=lo_value, upper=hi_value,
        below=float(below[lo] / n) if n else math.nan, above=float(above[hi + 1] / n) if n else math.nan,
        below_se=math.sqrt(cells_below) * sd / n if n else math.nan,
        above_se=math.sqrt(cells_above) * sd / n if n else math.nan,
        data_from=shown(edges[held[0] - 1]) if held.size and held[0] > 0 else None,
        data_to=shown(edges[held[-1]]) if held.size and held[-1] < m else None,
        flags=flags, note="; ".join(notes[f] for f in flags))


def propose_bounds(release, lower: float = DEFAULT_LOWER, upper: float = DEFAULT_UPPER) -> BoundsProposal:
    """Bounds for every numeric column of a released histogram (a pilot's, or any histogram
    study's: a joint grid's columns are read from its marginals). ``release`` is a
    :class:`analyzer.release.HistogramRelease` or a :class:`NoisyHistogram`; ``lower`` and
    ``upper`` the shares of reports a bound may leave out below and above (0 <= lower < 0.5 <
    upper <= 1). Categorical axes are listed in ``skipped``."""
    hist = release.histogram() if hasattr(release, "histogram") else release
    if not isinstance(hist, NoisyHistogram):
        raise TypeError(f"propose_bounds takes a histogram release, got {type(release).__name__}")
    if not (0.0 <= lower < 0.5 < upper <= 1.0):
        raise ValueError(f"lower and upper must satisfy 0 <= lower < 0.5 < upper <= 1, got {lower}, {upper}")
    numeric = [a.column for a in hist.spec.axes if a.numeric]
    if not numeric:
        raise ValueError("the histogram has no numeric column to propose bounds for")
    columns = [propose_column(hist, c, lower, upper) for c in numeric]
    sd = math.sqrt(hist.marginal(numeric[0]).noise_variance)
    return BoundsProposal(bounds={p.column: [p.lower, p.upper] for p in columns}, columns=columns,
                          lower=lower, upper=upper, n_reports=hist.n_reports, noise_sd=sd,
                          skipped=[a.column for a in hist.spec.axes if not a.numeric])


# ---------------------------------------------------------------------------------------------
# the REST route


class PilotRequest(BaseModel):
    """A pilot: the columns the real study will have, and what the pilot may spend."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    columns: list[str] = Field(min_length=1, max_length=MAX_MARGINAL_AXES,
                               description="the numeric columns to propose bounds for (1 to 64)")
    expected_reports: int = Field(ge=2, le=1 << 36)
    epsilon: float = Field(default=DEFAULT_EPSILON, gt=0, le=100,
                           description="what the pilot spends; charged to the population's ledger like "
                           "any study (default 0.5: enough at 20,000 reports, docs/bounds.md)")
    delta: float = Field(default=1e-6, gt=0, lt=1)
    neighbouring: privacy.Neighbouring = "replace-one"
    t: int = Field(default=0, ge=0)
    epsilon_floor: float | None = Field(
        default=None, gt=0, le=100, description="as for POST /v1/studies: omitted, max(4, epsilon); "
        "null, no floor")
    min_reports: int | None = Field(default=None, ge=1)
    max_reports: int | None = Field(default=None, ge=1, description="default: twice expected_reports (a "
                                    "pilot report is 1.2 KB a column; servers' storage policies count it)")
    population: str | None = Field(default=None, pattern=POPULATION_PATTERN,
                                   description="the population whose ledger the pilot is charged to")


class BoundsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lower: float = Field(default=DEFAULT_LOWER, ge=0, lt=0.5,
                         description="the share of reports a lower bound may leave out below it")
    upper: float = Field(default=DEFAULT_UPPER, gt=0.5, le=1,
                         description="1 - the share of reports an upper bound may leave out above it")


#: the route below is named ``propose_bounds`` too (its name is its OpenAPI operation id)
_propose_bounds = propose_bounds


def install(app: FastAPI, released: Callable[[str], Release], auth: list,
            create: Callable[[dict[str, Any]], Awaitable[Any]]) -> None:
    """Add the pilot routes; ``create`` takes the fields of a ``POST /v1/studies`` body and
    creates that study (the analyzer's own create route)."""

    @app.post("/v1/pilots", status_code=201, dependencies=auth)
    async def create_pilot(body: PilotRequest):
        """Create a pilot study (a marginal histogram with scale-free edges) over ``columns``;
        data owners submit their raw rows to it like to any histogram study."""
        fields = body.model_dump(exclude={"columns"}, exclude_none=True)
        if "epsilon_floor" in body.model_fields_set:
            fields["epsilon_floor"] = body.epsilon_floor  # null: no floor
        fields.setdefault("max_reports", default_max_reports(body.expected_reports))
        try:
            spec = pilot_spec(body.columns)
        except ValidationError as exc:
            raise ProblemError("invalid-study", f"pilot columns: {exc.errors()[0]['msg']}") from None
        try:
            return await create({**fields, "kind": "histogram", "histogram": spec})
        except ValidationError as exc:
            raise ProblemError("invalid-study", exc.errors()[0]["msg"]) from None

    @app.post("/v1/studies/{study_id}/analyses/bounds", dependencies=auth)
    def propose_bounds(study_id: str, body: BoundsRequest) -> dict[str, Any]:
        """Bounds for the numeric columns of a released histogram study (a pilot's), with what
        each would clamp; ``text`` is the form ``--bounds`` takes."""
        rel = released(study_id)
        if not isinstance(rel, HistogramRelease):
            raise refuse(f"study {study_id} is a {rel.study.kind} study: bounds are proposed from a "
                         f"histogram study's release (a pilot: POST /v1/pilots)")
        try:
            proposal = _propose_bounds(rel, lower=body.lower, upper=body.upper)
        except ValueError as exc:
            raise refuse(str(exc)) from None
        return {"study_id": study_id, **json_finite(proposal.as_dict())}
