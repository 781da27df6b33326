"""The analyzer's REST route for least absolute deviations: a thin layer over ``analyzer.lad``.

``POST /v1/studies/{id}/analyses/lad`` fits :class:`~analyzer.lad.LADRegression` on a released l1
study (its weighted l1 sketch, docs/protocol.md section 2c) with the study's public noise law, and
answers the coefficients like ridge does. Any other kind of study, an unknown label and bad
parameters are 422 ``invalid-request``; a study that is not released is 409 ``study-open``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from dpsketch.protocol import ProblemError
from dpsketch.protocol.bounds import CONSTANT

from .lad import LADRegression
from .release import L1Release, Release


class LADRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str | None = Field(default=None, description="label column; default: the study's label")
    alpha: float = Field(default=0.0, ge=0, le=1e12, description="l1 penalty on the coefficients, in units "
                         "of the weighted objective (default 0: the noise already shrinks them)")
    noise_correction: Literal["none", "calibrate"] = Field(
        default="none", description="none: the plain weighted fit (default); calibrate: undo the shrinkage "
        "the noise in the features causes by regression calibration with the known noise law (measured "
        "erratic, docs/lad.md)")


class LADResult(BaseModel):
    study_id: str
    label: str
    features: list[str]
    coef: list[float] = Field(description="per feature, in the data's units for a study with bounds")
    intercept: float = Field(default=0.0, description="in the label's units (a study with bounds: its rows "
                             "carry a constant coordinate); 0 for a study without bounds")
    in_units: bool = Field(default=False, description="whether the study declared bounds, so the answer is "
                           "in the data's units")
    objective: float
    alpha: float
    noise_correction: str
    n_reports: int


def install(app: FastAPI, released: Callable[[str], Release], auth: list) -> None:
    """Add the least absolute deviations route to the analyzer's app."""

    @app.post("/v1/studies/{study_id}/analyses/lad", dependencies=auth)
    def lad(study_id: str, body: LADRequest) -> LADResult:
        rel = released(study_id)
        if not isinstance(rel, L1Release):
            raise ProblemError("invalid-request", f"study {study_id} is a {rel.study.kind} study: least "
                               f"absolute deviations needs an l1 study (kind 'l1')")
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
