"""The server's own privacy policy: the weakest study it agrees to serve, and the largest.

Every share server is run by an organisation that does not trust the others, so each one decides
for itself which privacy targets it helps to release, and how much it agrees to store (a gram
study's shares are d^2/2 values per report); a study outside the policy is refused at
provisioning (422 ``invalid-study``, the detail names the rule). GET /v1/info publishes the policy.
"""

from __future__ import annotations

from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.study import Study

from .settings import Settings


def describe(settings: Settings) -> dict[str, float | int | None]:
    """The policy as published in ServerInfo.policy."""
    return {
        "max_epsilon": settings.max_epsilon,
        "max_delta": settings.max_delta,
        "min_reports_floor": settings.min_reports_floor,
        "min_lambda_star": settings.min_lambda_star,
        "max_study_bytes": settings.max_study_bytes,
        "max_k": settings.max_k,
        "max_aggregate_cells": settings.max_aggregate_cells,
        "retention_after_commit_seconds": settings.retention_after_commit_s,
    }


def check(study: Study, settings: Settings) -> None:
    """422 invalid-study naming the first rule the study breaks."""
    storage_ok = settings.max_study_bytes is None or study.max_storage_bytes <= settings.max_study_bytes
    rules = (  # (holds, which policy, rule, detail)
        (study.epsilon <= settings.max_epsilon, "privacy", "max_epsilon",
         f"epsilon = {study.epsilon:g} exceeds this server's max_epsilon = {settings.max_epsilon:g}"),
        (study.delta <= settings.max_delta, "privacy", "max_delta",
         f"delta = {study.delta:g} exceeds this server's max_delta = {settings.max_delta:g}"),
        (study.min_reports >= settings.min_reports_floor, "privacy", "min_reports_floor",
         f"min_reports = {study.min_reports} is below this server's min_reports_floor = "
         f"{settings.min_reports_floor}"),
        (study.lambda_star >= settings.min_lambda_star, "privacy", "min_lambda_star",
         f"lambda_star = {study.lambda_star:g} is below this server's min_lambda_star = "
         f"{settings.min_lambda_star:g}"),
        (storage_ok, "storage", "max_study_bytes",
         f"max_reports = {study.max_reports} shares of {study.share_bytes} bytes (+16 for the "
         f"report id) could take {study.max_storage_bytes} bytes, more than this server's "
         f"max_study_bytes = {settings.max_study_bytes}; lower max_reports, or use a sketch study "
         f"(d values per share instead of d^2/2)"),
    )
    for ok, policy, rule, detail in rules:
        if not ok:
            raise ProblemError("invalid-study", f"{policy} policy {rule}: {detail}", extra={"policy_rule": rule})
