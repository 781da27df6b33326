"""The analyzer's REST routes for histogram studies: a thin layer over ``analyzer.histogram``.

Each route fits one estimator on the released histogram and answers its value, its standard
error from the known noise law and a confidence interval. Wrong axes, a statistic the study's
bins cannot give (quantiles of a categorical axis, Kendall's tau of one axis or of a marginal
histogram) and non-histogram studies are 422 ``invalid-request``. A marginal histogram's view
answers per axis; its one-column statistics take the axis by ``column``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from dpsketch.protocol import ProblemError

from . import histogram as stats
from .release import HistogramRelease, Release


class Confidence(BaseModel):
    model_config = ConfigDict(extra="forbid")
    confidence: float = Field(default=0.95, gt=0, lt=1)


class ColumnStatistic(Confidence):
    column: str | None = Field(default=None, description="the axis; default: the study's only axis")


class QuantilesRequest(ColumnStatistic):
    probabilities: list[float] = Field(default=[0.25, 0.5, 0.75], min_length=1, max_length=1000)


class AUCRequest(Confidence):
    score: str = Field(description="the numeric (or ordered) axis that scores")
    label: str = Field(description="the categorical axis holding the classes")
    positive: str = Field(description="the positive class: one of the label axis' categories")


class Statistic(BaseModel):
    study_id: str
    statistic: str
    value: float
    se: float = Field(description="standard error from the privacy noise (the data held fixed)")
    ci: list[float] = Field(description="confidence interval [low, high] from that noise law")
    confidence: float
    n_reports: int
    details: dict[str, Any] = {}


def _finite(x: Any) -> Any:
    """JSON has no NaN or infinity: None instead (a statistic the noise left undefined)."""
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_finite(v) for v in np.asarray(x, dtype=object).tolist()]
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def install(app: FastAPI, released: Callable[[str], Release], auth: list) -> None:
    """Add the histogram routes to the analyzer's app."""

    def histogram_of(study_id: str) -> stats.NoisyHistogram:
        rel = released(study_id)
        if not isinstance(rel, HistogramRelease):
            raise ProblemError("invalid-request", f"study {study_id} is a {rel.study.kind} study, not a "
                               f"histogram study")
        return rel.histogram()

    def fit(estimator, h: stats.NoisyHistogram):
        try:
            return estimator.fit(h)
        except (ValueError, KeyError) as exc:
            raise ProblemError("invalid-request", str(exc).strip("'\"")) from None

    def column_of(h: stats.NoisyHistogram, column: str | None) -> str:
        if column is not None:
            return column
        if len(h.spec.axes) != 1:
            raise ProblemError("invalid-request", f"the histogram has {len(h.spec.axes)} axes "
                               f"({', '.join(h.spec.columns)}): name the column")
        return h.spec.columns[0]

    def fit_column(study_id: str, body: ColumnStatistic, estimator) -> tuple[stats.NoisyHistogram, str, Any]:
        """A one-column statistic: the release, the column (default: the only axis), the fit."""
        h = histogram_of(study_id)
        column = column_of(h, body.column)
        return h, column, fit(estimator(column, confidence=body.confidence), h)

    def answer(study_id: str, name: str, h: stats.NoisyHistogram, value: float, se: float, ci, confidence: float,
               **details: Any) -> Statistic:
        return Statistic(study_id=study_id, statistic=name, value=_finite(float(value)), se=_finite(float(se)),
                         ci=_finite([float(ci[0]), float(ci[1])]), confidence=confidence,
                         n_reports=h.n_reports, details={k: _finite(v) for k, v in details.items()})

    @app.get("/v1/studies/{study_id}/histogram", dependencies=auth)
    def counts(study_id: str, confidence: float = 0.95) -> dict[str, Any]:
        """The noisy counts and proportions of every cell, with confidence intervals."""
        if not 0 < confidence < 1:
            raise ProblemError("invalid-request", "confidence must lie strictly between 0 and 1")
        h = histogram_of(study_id)
        common = {"study_id": study_id, "shape": list(h.spec.shape), "n_reports": h.n_reports,
                  "noise_variance": h.noise_variance, "confidence": confidence}

        def cells(est: stats.Counts) -> dict[str, Any]:
            return {"counts": _finite(est.counts_), "counts_ci": _finite(est.counts_ci_),
                    "proportions": _finite(est.proportions_), "proportions_ci": _finite(est.proportions_ci_),
                    "nonnegative_counts": _finite(est.nonnegative_counts_)}

        if not h.is_joint:  # a marginal histogram: each axis' counts on their own (no grid)
            return {**common, "marginal": True,
                    "axes": [{"column": a.column, "labels": a.labels(),
                              **cells(fit(stats.Counts(confidence=confidence), h.marginal(a.column)))}
                             for a in h.spec.axes]}
        est = fit(stats.Counts(confidence=confidence), h)
        return {**common, "axes": [{"column": a.column, "labels": a.labels()} for a in h.spec.axes], **cells(est)}

    @app.post("/v1/studies/{study_id}/analyses/quantiles", dependencies=auth)
    def quantiles(study_id: str, body: QuantilesRequest) -> dict[str, Any]:
        h = histogram_of(study_id)
        column = column_of(h, body.column)
        if any(not 0 <= p <= 1 for p in body.probabilities):
            raise ProblemError("invalid-request", "probabilities must lie in [0, 1]")
        est = fit(stats.Quantiles(column, probabilities=tuple(body.probabilities)), h)
        _, axis = h.spec.axis(column)
        return {"study_id": study_id, "column": column, "probabilities": body.probabilities,
                "quantiles": _finite(est.quantiles_), "clipped": np.asarray(est.clipped_).tolist(),
                "edges": list(axis.edges or []), "cdf": _finite(est.cdf_), "n_reports": h.n_reports}

    @app.post("/v1/studies/{study_id}/analyses/moments", dependencies=auth)
    def moments(study_id: str, body: ColumnStatistic) -> Statistic:
        """Mean (value) and variance (details) of a binned numeric column."""
        h, column, est = fit_column(study_id, body, stats.BinnedMoments)
        return answer(study_id, "mean", h, est.mean_, est.mean_se_, est.mean_ci_, body.confidence,
                      column=column, variance=float(est.variance_), variance_se=float(est.variance_se_))

    @app.post("/v1/studies/{study_id}/analyses/kendall-tau", dependencies=auth)
    def kendall_tau(study_id: str, body: Confidence) -> Statistic:
        h = histogram_of(study_id)
        est = fit(stats.KendallTau(confidence=body.confidence), h)
        return answer(study_id, "kendall_tau_b", h, est.tau_, est.se_, est.ci_, body.confidence,
                      tau_a=float(est.tau_a_), columns=h.spec.columns)

    @app.post("/v1/studies/{study_id}/analyses/auc", dependencies=auth)
    def auc(study_id: str, body: AUCRequest) -> Statistic:
        h = histogram_of(study_id)
        est = fit(stats.AUC(body.score, body.label, body.positive, confidence=body.confidence), h)
        return answer(study_id, "auc", h, est.auc_, est.se_, est.ci_, body.confidence,
                      mann_whitney_u=float(est.u_), n_positive=float(est.n_positive_),
                      n_negative=float(est.n_negative_))

    @app.post("/v1/studies/{study_id}/analyses/gini-mean-difference", dependencies=auth)
    def gini_mean_difference(study_id: str, body: ColumnStatistic) -> Statistic:
        h, column, est = fit_column(study_id, body, stats.GiniMeanDifference)
        return answer(study_id, "gini_mean_difference", h, est.gmd_, est.se_, est.ci_, body.confidence,
                      column=column)

    @app.post("/v1/studies/{study_id}/analyses/gini-simpson", dependencies=auth)
    def gini_simpson(study_id: str, body: ColumnStatistic) -> Statistic:
        h, column, est = fit_column(study_id, body, stats.GiniSimpson)
        return answer(study_id, "gini_simpson", h, est.diversity_, est.se_, est.ci_, body.confidence,
                      column=column)
