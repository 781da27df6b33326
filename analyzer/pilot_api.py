"""The analyzer's REST routes for the bounds pilot (``analyzer.pilot``, docs/bounds.md).

``POST /v1/pilots`` creates the pilot: a marginal histogram study over the columns with the
pilot's scale-free edges, through the same path as ``POST /v1/studies`` (designed, provisioned at
every server, charged to the population's ledger). ``POST /v1/studies/{id}/analyses/bounds``
reads a released histogram study and proposes bounds for its numeric columns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dpsketch.protocol import ProblemError, privacy
from dpsketch.protocol.histogram import MAX_MARGINAL_AXES
from dpsketch.protocol.study import POPULATION_PATTERN

from . import pilot
from .release import HistogramRelease, Release


class PilotRequest(BaseModel):
    """A pilot: the columns the real study will have, and what the pilot may spend."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    columns: list[str] = Field(min_length=1, max_length=MAX_MARGINAL_AXES,
                               description="the numeric columns to propose bounds for (1 to 64)")
    expected_reports: int = Field(ge=2, le=1 << 36)
    epsilon: float = Field(default=pilot.DEFAULT_EPSILON, gt=0, le=100,
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
    lower: float = Field(default=pilot.DEFAULT_LOWER, ge=0, lt=0.5,
                         description="the share of reports a lower bound may leave out below it")
    upper: float = Field(default=pilot.DEFAULT_UPPER, gt=0.5, le=1,
                         description="1 - the share of reports an upper bound may leave out above it")


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
        fields.setdefault("max_reports", pilot.default_max_reports(body.expected_reports))
        try:
            spec = pilot.pilot_spec(body.columns)
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
            raise ProblemError("invalid-request", f"study {study_id} is a {rel.study.kind} study: bounds are "
                               f"proposed from a histogram study's release (a pilot: POST /v1/pilots)")
        try:
            proposal = pilot.propose_bounds(rel, lower=body.lower, upper=body.upper)
        except ValueError as exc:
            raise ProblemError("invalid-request", str(exc)) from None
        return {"study_id": study_id, **_finite(proposal.as_dict())}


def _finite(x: Any) -> Any:
    """JSON has no NaN: None instead (a share estimated from no reports)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    return x
