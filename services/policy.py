"""The server's own policy: the weakest study it agrees to serve, the largest, and the rules it
holds every study to.

Every share server is run by an organisation that does not trust the others, so each one decides
for itself which privacy targets it helps to release (the study's epsilon and, with no other
honest report, its floor), how much it agrees to store (a gram study's shares are d^2/2 values
per report) and keep in memory; a study outside the policy is refused at provisioning (422
``invalid-study``, the detail names the rule). The batch rule (how much of what it holds an
inclusion set may leave out) and upload authentication apply to every study. GET /v1/info
publishes the policy, so a client can check it before it submits (docs/trust.md).

The privacy budget per population (docs/ledger.md) is part of the policy too, but it depends on
what the server has already charged, so the store checks it (:func:`check_population`) inside
the transaction that charges the study (issuing its first upload token for a population): two
studies of one population charged at once cannot both slip under the budget.
"""

from __future__ import annotations

from dpsketch.protocol import ledger, proved_shares
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.study import Study

from .settings import Settings


def describe(settings: Settings) -> dict[str, float | int | str | list[str] | None]:
    """The policy as published in ServerInfo.policy."""
    return {
        "max_epsilon": settings.max_epsilon,
        "max_delta": settings.max_delta,
        "min_reports_floor": settings.min_reports_floor,
        "min_lambda_star": settings.min_lambda_star,
        "max_floor_epsilon": settings.max_floor_epsilon,
        "max_excluded_fraction": settings.max_excluded_fraction,
        "upload_auth": settings.upload_auth,
        "relayed_uploads": settings.relayed_uploads,
        "max_study_bytes": settings.max_study_bytes,
        "max_study_memory": settings.max_study_memory,
        "memory_budget": settings.memory_budget,
        "max_k": settings.max_k,
        "max_aggregate_cells": settings.max_aggregate_cells,
        "retention_after_commit_seconds": settings.retention_after_commit_s,
        # populations belong to this server's operator (docs/ledger.md): each has this budget
        "population_epsilon": settings.population_epsilon,
        "population_floor_epsilon": settings.population_floor_epsilon,
        "population_delta": settings.population_delta,
        "population_neighbouring": settings.population_neighbouring,
        "default_population": settings.default_population,
        "study_expiry_seconds": settings.study_expiry_s,
        "max_open_studies": settings.max_open_studies,
        "cors_origins": list(settings.cors_origins),
    }


def study_memory(study: Study) -> int:
    """Bytes of one study's running totals: the k x width aggregate (k x 2 width for a study with
    validity proofs) and k x k S S^T (state.py)."""
    return 8 * study.k * (proved_shares.state_width(study) + study.k)


def floor_epsilon(study: Study) -> float:
    return float(study.guarantees()["floor_epsilon"])


def check(study: Study, settings: Settings) -> None:
    """422 invalid-study naming the first rule the study breaks."""
    storage_ok = settings.max_study_bytes is None or study.max_storage_bytes <= settings.max_study_bytes
    floor = floor_epsilon(study) if settings.max_floor_epsilon is not None else 0.0
    required = f"{settings.max_floor_epsilon:g}" if settings.max_floor_epsilon is not None else "none"
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
        (settings.max_floor_epsilon is None or floor <= settings.max_floor_epsilon * (1 + 1e-9),
         "privacy", "max_floor_epsilon",
         f"with no other honest report a report of this study is only epsilon = {floor:.4g}-DP "
         f"(its own noise and one server's, server_sigma = {study.server_sigma:g}); this server "
         f"requires a floor of at most {required}: design the study with epsilon_floor <= {required}"),
        (storage_ok, "storage", "max_study_bytes",
         f"max_reports = {study.max_reports} shares of {study.share_bytes} bytes (+16 for the "
         f"report id) could take {study.max_storage_bytes} bytes, more than this server's "
         f"max_study_bytes = {settings.max_study_bytes}; lower max_reports, or use a sketch study "
         f"(d values per share instead of d^2/2)"),
        (study_memory(study) <= settings.max_study_memory, "memory", "max_study_memory",
         f"k = {study.k} rows of {proved_shares.state_width(study)} running values need "
         f"{study_memory(study)} bytes of running totals (8 k (width + k); a study with validity "
         f"proofs keeps 2 width), more than this server's max_study_memory = "
         f"{settings.max_study_memory}; use a smaller k"),
    )
    for ok, policy, rule, detail in rules:
        if not ok:
            raise ProblemError("invalid-study", f"{policy} policy {rule}: {detail}", extra={"policy_rule": rule})


#: With the LTM bound switched off ("none"), a floor bound still needs a Budget: this epsilon
#: never refuses anything.
_UNBOUNDED = 1e300


def population_budget(settings: Settings) -> ledger.Budget | None:
    """The budget every population is held to at this server (None: both bounds off: ledger
    kept, nothing refused)."""
    if settings.population_epsilon is None and settings.population_floor_epsilon is None:
        return None
    return ledger.Budget(settings.population_epsilon if settings.population_epsilon is not None else _UNBOUNDED,
                         settings.population_delta, settings.population_neighbouring,
                         floor_epsilon=settings.population_floor_epsilon)


def check_population(charges: list[ledger.Charge], study: Study, settings: Settings, population: str) -> None:
    """409 budget-exceeded if charging ``study`` to ``population`` would take it past the
    budget; the detail and the problem's members name the budget, what is spent and what the
    study needs, for both the certified guarantees and the floors."""
    budget = population_budget(settings)
    if budget is None:
        return
    verdict = ledger.check(charges, ledger.Charge.of(study), budget)
    if verdict.fits:
        return
    members = verdict.problem_members(budget, population)
    members["budget_epsilon"] = settings.population_epsilon  # null when only the floors are bounded
    raise ProblemError("budget-exceeded", verdict.explain(budget, f"population {population!r}"),
                       extra=members)
