"""The analyzer's REST route for logistic regression: a thin layer over ``analyzer.logistic``.

``POST /v1/studies/{id}/analyses/logistic`` fits :class:`~analyzer.logistic.LogisticRegression` on
a released gram or sketch study and answers the coefficients and intercept like ridge does. A
histogram study, an unknown label or intercept column, classes that are not two distinct numbers,
a sketch study without an intercept column (unless ``fit_intercept`` is false) are 422
``invalid-request``; a study that is not released is 409 ``study-open`` (from ``released``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from dpsketch.protocol import ProblemError

from .logistic import LogisticRegression, check_classes
from .moments import release_columns
from .release import HistogramRelease, L1Release, Release


class LogisticRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str | None = Field(default=None, description="label column; default: the study's label")
    classes: list[float] = Field(default=[0.0, 1.0], description="the label's (negative, positive) values")
    alpha: float | None = Field(default=None, ge=0, description="ridge penalty on the surrogate (units of "
                                "the Gram); default: chosen from the noise level")
    debias: bool = Field(default=True, description="subtract the known noise energy from the Gram (sketch)")
    fit_intercept: bool = True
    intercept_column: str | None = Field(default=None, description="a column holding one positive constant "
                                         "(needed for an intercept on a sketch study without bounds; a study "
                                         "with bounds carries its own constant)")
    confidence: float = Field(default=0.95, gt=0, lt=1, description="level of the confidence intervals")
    calibration: Literal["gaussian", "taylor"] = Field(
        default="gaussian", description="taylor: the Taylor-at-0 surrogate's minimiser (paper 002); gaussian: "
        "its direction, with scale and intercept from the within-class score distribution (docs/logistic.md)")


class LogisticResult(BaseModel):
    study_id: str
    label: str
    classes: list[float]
    features: list[str]
    coef: list[float] = Field(description="per feature, on the log-odds scale per unit of the feature (in the "
                              "data's units for a study with bounds)")
    intercept: float
    stderr: list[float | None] = Field(default_factory=list, description="per feature, then the intercept: "
                                       "the standard error over the release's public noise law (a study "
                                       "with bounds; null where not available)")
    conf_int: list[list[float | None]] = Field(default_factory=list, description="per feature, then the "
                                               "intercept: [low, high] at `confidence`")
    confidence: float = 0.95
    in_units: bool = Field(default=False, description="whether the study declared bounds, so coef is per unit "
                           "of each feature in the data's units")
    alpha: float
    calibration: str
    debias: bool
    n_reports: int


def _number(x: float) -> float | None:
    """JSON has no NaN or infinity: None where an interval is not available."""
    return float(x) if np.isfinite(x) else None


def install(app: FastAPI, released: Callable[[str], Release], auth: list) -> None:
    """Add the logistic regression route to the analyzer's app."""

    @app.post("/v1/studies/{study_id}/analyses/logistic", dependencies=auth)
    def logistic(study_id: str, body: LogisticRequest) -> LogisticResult:
        rel = released(study_id)
        if isinstance(rel, (HistogramRelease, L1Release)):
            raise ProblemError("invalid-request", f"study {study_id} is a {rel.study.kind} study: logistic "
                               f"regression needs a gram or sketch study")
        label = body.label or rel.study.label
        names = release_columns(rel)
        if label is None or label not in names:
            raise ProblemError("invalid-request", f"label must be one of the columns {names}; got {label!r}")
        try:
            classes = check_classes(body.classes)
            model = LogisticRegression(label=label, classes=classes, alpha=body.alpha, debias=body.debias,
                                       fit_intercept=body.fit_intercept, intercept_column=body.intercept_column,
                                       calibration=body.calibration).fit(rel)
        except (ValueError, KeyError) as exc:
            raise ProblemError("invalid-request", str(exc).strip("'\"")) from None
        values = np.concatenate([model.coef_[0], model.intercept_])
        if not np.all(np.isfinite(values)):
            raise ProblemError("invalid-request", "the solution is not finite for these parameters "
                               "(is alpha far larger than the data?)")
        return LogisticResult(study_id=study_id, label=label, classes=list(classes),
                              features=list(model.feature_names_), coef=model.coef_[0].tolist(),
                              intercept=float(model.intercept_[0]), alpha=float(model.alpha_),
                              calibration=model.calibration_, debias=body.debias, n_reports=rel.n_reports,
                              in_units=bool(getattr(model, "in_units_", False)),
                              stderr=[_number(v) for v in model.stderr()],
                              conf_int=[[_number(a), _number(b)] for a, b in model.conf_int(body.confidence)],
                              confidence=body.confidence)
