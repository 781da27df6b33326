"""The analyzer's REST route for least absolute deviations: a thin layer over ``analyzer.lad_rounds``
and ``analyzer.lad``.

``POST /v1/studies/{id}/analyses/lad`` on a released **gram or moments** study (the default way,
docs/lad.md) fits one round of the robust regression of :class:`~analyzer.lad_rounds.RobustRegression`
(Huber iteratively reweighted least squares, each round a study): the body's ``weights`` are the
round weights the study's rows were weighted with (absent for round 1), and the answer carries the
fit in units, its standard errors over the release's noise, and ``next_weights`` for the next round.
On a released **l1** study it fits :class:`~analyzer.lad.LADRegression` on the weighted l1 sketch
(docs/protocol.md section 2c) as before. Any other kind of study, an unknown label and bad
parameters are 422 ``invalid-request``; a study that is not released is 409 ``study-open``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from dpsketch.protocol import ProblemError
from dpsketch.protocol.bounds import CONSTANT

from .lad import LADRegression
from .lad_rounds import DEFAULT_TUNING, RobustRegression
from .release import GramSumRelease, L1Release, Release


class LADRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str | None = Field(default=None, description="label column; default: the study's label")
    alpha: float = Field(default=0.0, ge=0, le=1e12, description="l1 penalty on the coefficients, in units "
                         "of the weighted objective (default 0: the noise already shrinks them)")
    noise_correction: Literal["none", "calibrate"] = Field(
        default="none", description="none: the plain weighted fit (default); calibrate: undo the shrinkage "
        "the noise in the features causes by regression calibration with the known noise law (measured "
        "erratic, docs/lad.md)")
    weights: dict[str, Any] | None = Field(
        default=None, description="gram or moments study: the round weights its rows were weighted with "
        "(the previous round's next_weights); absent for round 1 (a study with bounds, or unweighted rows)")
    tuning: float = Field(default=DEFAULT_TUNING, gt=0, le=1e6, description="gram or moments study: the next "
                          "round's Huber threshold in units of this fit's weighted residual rms")


class LADResult(BaseModel):
    study_id: str
    label: str
    features: list[str]
    coef: list[float] = Field(description="per feature, in the data's units for a study with bounds")
    intercept: float = Field(default=0.0, description="in the label's units (a study with bounds: its rows "
                             "carry a constant coordinate); 0 for a study without bounds")
    in_units: bool = Field(default=False, description="whether the study declared bounds, so the answer is "
                           "in the data's units")
    objective: float | None = Field(default=None, description="l1 study: the weighted l1 objective of the fit")
    alpha: float
    noise_correction: str
    n_reports: int
    method: str | None = Field(default=None, description="gram or moments study: \"huber-rounds\"")
    round: int | None = Field(default=None, description="which round this study was (1: unweighted rows)")
    stderr: list[float] | None = Field(default=None, description="standard errors of coef and intercept (last) "
                                       "over this release's noise, the round's weights held fixed")
    scale: float | None = Field(default=None, description="the weighted residual rms, in the label's units")
    next_weights: dict[str, Any] | None = Field(
        default=None, description="what the next round's data owners weight their rows with "
        "(analyzer.lad_rounds.weighted_rows) and the next round's fit needs")


def install(app: FastAPI, released: Callable[[str], Release], auth: list) -> None:
    """Add the least absolute deviations route to the analyzer's app."""

    @app.post("/v1/studies/{study_id}/analyses/lad", dependencies=auth, response_model_exclude_none=True)
    def lad(study_id: str, body: LADRequest) -> LADResult:
        rel = released(study_id)
        if isinstance(rel, GramSumRelease):
            return _rounds(study_id, rel, body)
        if not isinstance(rel, L1Release):
            raise ProblemError("invalid-request", f"study {study_id} is a {rel.study.kind} study: least "
                               f"absolute deviations needs a gram or moments study (the default, docs/lad.md) "
                               f"or an l1 study")
        label = body.label or rel.study.label
        if label is None or label not in rel.columns:
            raise ProblemError("invalid-request", f"label must be one of the columns {rel.columns}; got {label!r}")
        if label == CONSTANT:
            raise ProblemError("invalid-request", "the constant coordinate cannot be the label")
        try:
            model = LADRegression(label=label, alpha=body.alpha, noise_correction=body.noise_correction).fit_release(rel)
        except (ValueError, KeyError) as exc:
            raise ProblemError("invalid-request", str(exc).strip("'\"")) from None
        if not np.all(np.isfinite(model.coef_)):
            raise ProblemError("invalid-request", "the solution is not finite for these parameters")
        return LADResult(study_id=study_id, label=label, features=[str(f) for f in model.feature_names_],
                         coef=model.coef_.tolist(), intercept=float(model.intercept_),
                         objective=float(model.objective_), alpha=float(body.alpha),
                         noise_correction=body.noise_correction, n_reports=rel.n_reports,
                         in_units=rel.study.bounds is not None)


def _rounds(study_id: str, rel: GramSumRelease, body: LADRequest) -> LADResult:
    """One round of the robust regression on a gram or moments release (module docstring)."""
    label = body.label or (body.weights or {}).get("label") or rel.study.label
    if label is None:
        raise ProblemError("invalid-request", "name the label: this study has none")
    if body.alpha != 0.0 or body.noise_correction != "none":
        raise ProblemError("invalid-request", "alpha and noise_correction apply to an l1 study only")
    try:
        model = RobustRegression(label=str(label), weighted_by=body.weights, tuning=body.tuning).fit(rel)
    except (ValueError, KeyError) as exc:
        raise ProblemError("invalid-request", str(exc).strip("'\"")) from None
    if not (np.all(np.isfinite(model.coef_)) and np.isfinite(model.intercept_)):
        raise ProblemError("invalid-request", "the solution is not finite for these parameters")
    se = model.stderr()
    return LADResult(study_id=study_id, label=str(label), features=list(model.feature_names_),
                     coef=model.coef_.tolist(), intercept=float(model.intercept_), in_units=model.in_units_,
                     alpha=0.0, noise_correction="none", n_reports=rel.n_reports, method="huber-rounds",
                     round=model.round_, stderr=[float(v) for v in se] if np.all(np.isfinite(se)) else None,
                     scale=float(model.scale_), next_weights=model.next_weights_.to_dict())
