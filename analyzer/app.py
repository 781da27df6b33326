"""The analyzer's REST API: a thin FastAPI layer over :class:`Coordinator` and the estimators."""

from __future__ import annotations

import asyncio
import hmac
import sqlite3
from typing import Any, Literal

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from dpsketch import __version__, observability, problem_http
from dpsketch.protocol import ProblemError, Study, privacy
from dpsketch.protocol.histogram import HistogramSpec
from dpsketch.protocol.study import DEFAULT_EPSILON_FLOOR, POPULATION_PATTERN

from . import console_api, recommend
from .analyses import histogram, lad, logistic, pilot
from .coordinator import Coordinator, UpstreamError
from .estimators import PCA, LeastSquares, RidgeRegression
from .moments import release_columns
from .release import HistogramRelease, L1Release, Release, release_from_ring_sum
from .store import StudyRecord


class PrivacyTarget(BaseModel):
    """The analyst's choices a study design starts from (shared by create and recommend)."""

    model_config = ConfigDict(extra="forbid")
    expected_reports: int = Field(ge=2, le=1 << 36)
    epsilon: float = Field(default=1.0, gt=0, le=100)
    delta: float = Field(default=1e-6, gt=0, lt=1)
    row_bound: float = Field(default=1.0, gt=0, le=1e6)
    neighbouring: privacy.Neighbouring = "replace-one"
    t: int = Field(default=0, ge=0)
    epsilon_floor: float | None = Field(
        default=None, gt=0, le=100,
        description="the floor: each report stays (epsilon_floor, delta)-DP with no other honest "
        "report and all servers but one colluding (the servers add noise for it, docs/trust.md). "
        f"Omitted: max({DEFAULT_EPSILON_FLOOR:g}, epsilon); null: no floor (servers refuse such a "
        "study by default)")

    def design_args(self) -> dict[str, Any]:
        """Keyword arguments for ``design()``: an omitted epsilon_floor means the default."""
        args = self.model_dump()
        if "epsilon_floor" not in self.model_fields_set:
            args["epsilon_floor"] = "default"
        return args


class PartySpec(BaseModel):
    """A party of a study with parties: the columns it holds, and optionally its block's bound."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    columns: list[str] = Field(min_length=1, max_length=4096)
    row_bound: float | None = Field(default=None, gt=0, description="B_j; default B sqrt(d_j / d)")


class CreateStudy(PrivacyTarget):
    """What an analyst decides; the analyzer derives k, s, lambda_star, sigma and f from it."""

    name: str = Field(min_length=1, max_length=200)
    columns: list[str] = Field(default_factory=list, max_length=4096,
                               description="the columns (a histogram study's are its axes: omit them)")
    label: str | None = None
    bounds: dict[str, list[float]] | list[list[float]] | None = Field(
        default=None, description="the public range of every column: {\"age\": [16, 90], ...} or "
        "[lower, upper] pairs in column order. Each client clamps every value to its column's bounds "
        "(and counts what it clamped), maps its row into the row ball (docs/protocol.md section 2e), and "
        "analyses answer in the data's units with an intercept. Omitted: rows are taken as already "
        "scaled into the ball of radius row_bound (a raw row is clipped to that norm)")
    kind: Literal["sketch", "gram", "moments", "histogram", "l1", "auto"] = Field(
        default="auto",
        description="auto (the default): gram when its upload fits the analyzer's budget and no "
        "server's published max_study_bytes refuses it, else sketch; the study's explanation says "
        "which was chosen and why (see POST /v1/recommend). sketch: OSNAP sketch of the rows; gram: plain sum of [a, u(a a^T), 1] "
        "(central-model accuracy, about d^2/2 values per client); moments: plain sum of u(a a^T) "
        "alone (no row sum or count: 0.44 of the gram kind's noise variance, for ridge, least "
        "squares and PCA on the uncentered Gram); histogram: plain sum of the "
        "one-hot cell of each client's value(s) in `histogram`'s bins; l1: the multi-level l1 "
        "sketch of the rows, for least absolute deviations (analyses/lad)",
    )
    histogram: HistogramSpec | None = Field(
        default=None, description="the bins of a histogram study: {\"axes\": [{\"column\", \"edges\"} or "
        "{\"column\", \"categories\"}]}, one axis or two (a joint grid), or up to 64 counted side by side "
        "with \"marginal\": true (then row_bound is sqrt(axes)); underflow/overflow and \"other\" bins are "
        "added, so no value is dropped")
    k: int | None = Field(default=None, ge=1, le=1 << 20)
    s: int = Field(default=4, ge=1, le=8)
    min_reports: int | None = Field(default=None, ge=1)
    max_reports: int | None = Field(default=None, ge=1)
    parties: list[PartySpec] | None = Field(
        default=None, description="a sketch study whose columns different parties hold for the same "
        "individuals: the parties' blocks in column order (columns may then be omitted); "
        "docs/vertical.md")
    population: str | None = Field(
        default=None, pattern=POPULATION_PATTERN, description="the population the study is meant for "
        "(advisory): refused (409 budget-exceeded) if a server's published ledger of it has no room; "
        "the servers charge a study to the populations their operators issue upload tokens for, "
        "whatever this says (docs/ledger.md)")
    secret_sign: bool | None = Field(
        default=None, description="clients multiply their clipped rows by a secret sign before the "
        "noise, and the noise is calibrated for it: the same epsilon with much less noise "
        "(docs/secret_sign.md). Omitted or null: on for a sketch study with k > 1 and no parties, "
        "off for every other study; false: opt out; true on a study that cannot take it: 422 "
        "invalid-study")
    validity: bool = Field(
        default=False, description="every client proves in zero knowledge that its report is valid "
        "(its noisy vector within the row bound plus a noise allowance) and every share server "
        "refuses reports whose proofs do not verify, so one client moves a release no more than an "
        "honest one at the bound can (docs/validity.md). Sketch (parties too: each block proved with its "
        "party's bound), histogram, gram, "
        "moments and l1 studies; under auto the kind is chosen among those")
    batch_proofs: bool = Field(
        default=False, description="with validity: the servers also take batch records, one proof "
        "for a bulk owner's batch of rows (docs/protocol.md section 4d; the SDK's submit_many sends "
        "them), at about a tenth of per-report proofs' bytes and client time. Sketch and l1 studies "
        "without parties; under auto the kind is sketch")


class RecommendRequest(PrivacyTarget):
    """The inputs of ``dpsketch recommend``; ``predict`` runs the simulation (seconds at n = 10^6)."""

    d: int = Field(ge=1, le=4096, description="number of columns, label included")
    max_share_kib: float = Field(default=recommend.DEFAULT_MAX_SHARE_KIB, gt=0, le=1 << 20)
    predict: bool = False


class StudyView(BaseModel):
    study_id: str
    state: str = Field(description="collecting | finalizing | released")
    study: Study
    guarantees: dict[str, Any] = Field(description="what each honest report gets: epsilon with "
                                       "the certified honest reports, floor_epsilon with none "
                                       "(docs/trust.md); an infinite floor is null")
    explanation: list[str]
    n_reports: int | None = None
    inclusion_hash: str | None = None
    verification: dict[str, Any] | None = Field(
        None, description="a validity study's verification round, once every server decided: "
        "query_seed, decided, refused (by any server), refused_by_server (docs/protocol.md 6d)")


class ServerLedger(BaseModel):
    server_id: str
    url: str
    ledger: dict[str, Any] | None = Field(None, description="the server's PopulationLedger "
                                          "(GET /v1/populations/{population}/ledger)")
    error: str | None = None


class LedgerView(BaseModel):
    """A population's privacy ledger as every share server keeps it (docs/ledger.md)."""

    population: str | None = Field(description="null: the study names no population (servers charge the populations of its upload tokens)")
    study_id: str | None = None
    charged: bool | None = Field(None, description="for a study: whether every server lists it in the ledger")
    servers: list[ServerLedger]


INTERCEPT_FIELD = Field(
    default=None, description="fit an intercept (not penalised); default: whenever the study declares "
    "bounds (its release then carries the column sums and count); true on a study whose release has no "
    "column sums (a sketch study without bounds) is 422")


class RidgeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str | None = Field(default=None, description="label column; default: the study's label")
    alpha: float | None = Field(default=None, ge=0, description="ridge penalty, in units of the standardized "
                                "Gram (sums over reports of the columns scaled by their bounds to [-1, 1]); "
                                "default: chosen from the release's noise level (AdaSSP)")
    debias: bool = Field(default=True, description="subtract the known noise sigma^2 n I from the Gram")
    fit_intercept: bool | None = INTERCEPT_FIELD
    confidence: float = Field(default=0.95, gt=0, lt=1, description="level of the confidence intervals")


class LeastSquaresRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str | None = Field(default=None, description="label column; default: the study's label")
    debias: bool = Field(default=True, description="subtract the known noise sigma^2 n I from the Gram")
    fit_intercept: bool | None = INTERCEPT_FIELD
    confidence: float = Field(default=0.95, gt=0, lt=1, description="level of the confidence intervals")


class PCARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_components: int = Field(ge=1, le=4096, description="how many principal components")
    debias: bool = Field(default=True, description="subtract the known noise energy from the eigenvalues")
    center: bool | None = Field(default=None, description="centre the rows first (default: whenever the study "
                                "declares bounds, so its release carries the column sums)")


class RegressionResult(BaseModel):
    study_id: str
    label: str
    features: list[str]
    coef: list[float] = Field(description="per feature, in the data's units (label units per feature unit) "
                              "for a study with bounds")
    intercept: float = Field(default=0.0, description="in the label's units; 0 without an intercept")
    stderr: list[float | None] = Field(default_factory=list, description="per feature: the standard error "
                                       "for statements about the population the rows came from (the "
                                       "release's public noise law plus least squares' sampling error); "
                                       "null where the release cannot bound it")
    conf_int: list[list[float | None]] = Field(default_factory=list, description="per feature: [low, high] "
                                               "at `confidence`, from stderr")
    intercept_stderr: float | None = None
    intercept_conf_int: list[float | None] | None = None
    noise_stderr: list[float | None] = Field(default_factory=list, description="per feature (then the "
                                             "intercept, when fitted): the release's noise alone, how far "
                                             "this answer may lie from least squares on the same rows "
                                             "without privacy")
    confidence: float = 0.95
    fit_intercept: bool = False
    in_units: bool = Field(default=False, description="whether the study declared bounds, so coef and "
                           "intercept are in the data's units")
    alpha: float
    tau: float = Field(default=0.0, description="the eigenvalue floor: eigenvalues of G_xx + alpha I "
                       "below tau were raised to tau (docs/protocol.md section 6c)")
    n_floored: int = Field(default=0, description="how many eigenvalues were floored at tau")
    debias: bool
    n_reports: int


class PCAResult(BaseModel):
    study_id: str
    columns: list[str]
    components: list[list[float]]
    explained_variance: list[float] = Field(description="the rows' variance along each component (in the "
                                            "data's units squared for a study with bounds)")
    explained_variance_ratio: list[float | None] = Field(
        default_factory=list, description="each component's share of the trace; null when the noisy "
        "Gram's trace is not positive (so few or such small rows that the noise dominates)")
    mean: list[float] = Field(default_factory=list, description="the column means the rows were centred "
                              "on (zeros when not centred)")
    centered: bool = False
    debias: bool
    n_reports: int


class SketchView(BaseModel):
    study_id: str
    columns: list[str]
    kind: str = Field(description="the study kind: sketch, gram, moments, histogram or l1")
    k: int
    n_reports: int
    sigma: float
    sketch: list[list[float]] = Field(
        description="the release, k x width, already scaled by 1/sqrt(s): S(A+G) for a sketch "
        "study (width d); for a gram study (k = 1) the noisy sum of [a, u(a a^T), 1]; for a "
        "histogram study (k = 1) the noisy count of every cell"
    )


class GramView(BaseModel):
    study_id: str
    kind: str
    columns: list[str]
    n_reports: int
    gram: list[list[float]] = Field(
        description="estimate of A^T A: the released Gram (gram study) or Y^T Y - sigma^2 n I "
        "(sketch study)"
    )
    row_sum: list[float] | None = Field(None, description="noisy sum of the rows (gram study only)")
    noisy_count: float | None = Field(None, description="noisy count (gram study only)")


def _json_number(x: float) -> float | None:
    """A float for JSON, or None where it is not finite (an interval the release cannot bound)."""
    x = float(x)
    return x if np.isfinite(x) else None


def _view(rec: StudyRecord) -> StudyView:
    guarantees = {k: (None if isinstance(v, float) and not np.isfinite(v) else v)
                  for k, v in rec.study.guarantees().items()}
    return StudyView(study_id=rec.study.study_id, state=rec.state, study=rec.study,
                     guarantees=guarantees, explanation=rec.explanation, n_reports=rec.n_reports,
                     inclusion_hash=rec.inclusion_hash, verification=rec.verification)


def charged_population(named: str | None, charged: list[list[str] | None]) -> str | None:
    """The population to show a study's ledger for, from what each reachable server says it charges
    the study to (``charged``): the study's own name when every server charges it there, else one
    every server charges it to, else the study's own name (no server has charged it yet), else any
    population some server charges it to; None when there is none of these."""
    sets = [set(c or ()) for c in charged]
    everywhere = set.intersection(*sets) if sets else set()
    somewhere = set.union(*sets) if sets else set()
    if named is not None and (named in everywhere or not everywhere):
        return named
    return min(everywhere or somewhere) if (everywhere or somewhere) else None


def create_app(coordinator: Coordinator) -> FastAPI:
    app = FastAPI(
        title="dpsketch analyzer",
        version=__version__,
        description="Creates studies on the share servers, finalizes them and analyses the released "
        "noisy sketch. Errors are application/problem+json (docs/protocol.md section 8).",
        responses=problem_http.problem_responses(400, 401, 404, 409, 413, 422, 502),
    )
    problem_http.install(app)
    app.add_middleware(problem_http.BodyLimit, limit=1 << 20)
    # per-app registry: request latency by route template, problems by type, process figures
    registry = observability.CollectorRegistry()
    http_metrics = observability.HttpMetrics(registry)
    app.state.metrics = http_metrics
    app.add_middleware(observability.MetricsMiddleware, metrics=http_metrics)  # outermost
    api_token = coordinator.config.api_token

    def require_token(request: Request) -> None:
        if api_token is None:  # only with --insecure-no-api-token, logged loudly at startup
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_token.encode()):
            raise ProblemError("unauthorized", "send Authorization: Bearer <analyzer api token>",
                               headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(require_token)]

    def released(study_id: str) -> Release:
        rec = coordinator.record(study_id)
        if rec.state != "released":
            raise ProblemError("study-open", f"study {study_id} is {rec.state}; finalize it first")
        return release_from_ring_sum(rec.study, rec.ring_sum, rec.n_reports)

    def second_moments(study_id: str) -> Release:
        """A release that ridge, least squares, PCA and the Gram view can use (not a histogram)."""
        rel = released(study_id)
        if isinstance(rel, HistogramRelease):
            raise ProblemError("invalid-request", f"study {study_id} is a histogram study: use its "
                               f"/histogram view and analyses (quantiles, moments, kendall-tau, auc, gini-*)")
        if isinstance(rel, L1Release):
            raise ProblemError("invalid-request", f"study {study_id} is an l1 study (an l1 sketch, not an "
                               f"l2 embedding): use analyses/lad")
        return rel

    histogram.install(app, released, auth)
    logistic.install(app, released, auth)
    lad.install(app, released, auth)
    console_api.install(app)  # the analyst console's static files (no token: they carry no data)

    def upstream(exc: UpstreamError) -> ProblemError:
        if exc.problem is not None and exc.problem.slug in ("certificate-refused", "inclusion-conflict",
                                                            "inclusion-refused", "invalid-study"):
            return ProblemError(exc.problem.slug, str(exc), extra=exc.problem.extra)
        return ProblemError("upstream-failure", str(exc))

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz():
        """Ready when it can serve its own API: its database file opens and answers within 2 s and
        it is not shutting down. The share servers are not asked (each has its own /readyz; an
        analyzer with one server down still serves released studies)."""
        reasons = []
        if observability.shutting_down(app):
            reasons.append("shutting down")
        try:
            await asyncio.wait_for(run_in_threadpool(observability.sqlite_reachable, coordinator.store.path),
                                   timeout=2.0)
        except asyncio.TimeoutError:
            reasons.append("the analyzer's database did not answer within 2 s")
        except sqlite3.Error as exc:
            reasons.append(f"the analyzer's database cannot be opened: {exc}")
        return observability.ready_answer(reasons)

    @app.get("/metrics", include_in_schema=False, dependencies=auth)
    def prometheus_metrics():
        """Prometheus metrics, behind the API token like the rest of the analyzer's API
        (docs/operations.md)."""
        return observability.metrics_response(registry)

    @app.post("/v1/studies", status_code=201, dependencies=auth)
    async def create_study(body: CreateStudy) -> StudyView:
        try:
            study, _ = await run_in_threadpool(coordinator.create_study, **body.design_args())
        except ValueError as exc:
            raise ProblemError("invalid-study", str(exc)) from exc
        except UpstreamError as exc:
            raise upstream(exc) from exc
        return _view(coordinator.record(study.study_id))

    pilot.install(app, released, auth, create=lambda fields: create_study(CreateStudy(**fields)))

    @app.post("/v1/recommend", dependencies=auth)
    async def recommend_kind(body: RecommendRequest) -> dict[str, Any]:
        args = body.design_args()
        try:
            rec = await run_in_threadpool(
                recommend.recommend, args.pop("d"), args.pop("expected_reports"),
                n_servers=len(coordinator.config.server_ids), **args)
        except (ValueError, ArithmeticError) as exc:
            raise ProblemError("invalid-request", str(exc)) from exc
        return rec.as_dict()

    @app.get("/v1/studies", dependencies=auth)
    def list_studies() -> list[StudyView]:
        return [_view(r) for r in coordinator.store.list()]

    @app.get("/v1/studies/{study_id}", dependencies=auth)
    def get_study(study_id: str) -> StudyView:
        return _view(coordinator.record(study_id))

    @app.get("/v1/populations/{population}/ledger", dependencies=auth)
    async def population_ledger(population: str) -> LedgerView:
        """The population's ledger at every share server (each composes and enforces its own)."""
        import re

        if not re.fullmatch(POPULATION_PATTERN, population):
            raise ProblemError("invalid-request", f"a population id matches {POPULATION_PATTERN}; "
                                                  f"got {population[:80]!r}")
        servers = await run_in_threadpool(coordinator.ledgers, population)
        return LedgerView(population=population, servers=[ServerLedger(**s) for s in servers])

    @app.get("/v1/studies/{study_id}/ledger", dependencies=auth)
    async def study_ledger(study_id: str) -> LedgerView:
        """The ledger of the population the servers charge the study to (the operator's, whatever
        the study names: docs/ledger.md) at every share server; charged is whether every server
        lists it there. Before any server charges it: the study's own population, if named."""
        study = coordinator.record(study_id).study
        progress = await run_in_threadpool(coordinator.progress, study_id)
        population = charged_population(study.population, [p.populations for p in progress if p.reachable])
        if population is None:
            return LedgerView(population=None, study_id=study_id, charged=False, servers=[])
        servers = await run_in_threadpool(coordinator.ledgers, population)
        charged = all(any(e["charge"]["study_id"] == study_id for e in s["ledger"]["studies"])
                      for s in servers if s.get("ledger") is not None) and all(
                          s.get("ledger") is not None for s in servers)
        return LedgerView(population=population, study_id=study_id, charged=charged,
                          servers=[ServerLedger(**s) for s in servers])

    @app.get("/v1/studies/{study_id}/progress", dependencies=auth)
    async def progress(study_id: str) -> dict[str, Any]:
        rec = coordinator.record(study_id)
        servers = await run_in_threadpool(coordinator.progress, study_id)
        out = {"study_id": study_id, "state": rec.state, "min_reports": rec.study.min_reports,
               "servers": [s.__dict__ for s in servers]}
        if rec.study.validity is not None:
            out["verification"] = rec.verification
        if rec.study.parties is not None and rec.state != "released":
            try:
                out["parties"] = (await run_in_threadpool(coordinator.completeness, study_id)).as_dict()
            except UpstreamError as exc:
                out["parties"] = {"error": str(exc)}
        return out

    @app.post("/v1/studies/{study_id}/finalize", dependencies=auth)
    async def finalize(study_id: str) -> StudyView:
        try:
            rec = await run_in_threadpool(coordinator.finalize, study_id)
        except UpstreamError as exc:
            raise upstream(exc) from exc
        return _view(rec)

    @app.get("/v1/studies/{study_id}/sketch", dependencies=auth)
    def sketch(study_id: str) -> SketchView:
        rel = released(study_id)
        values = rel.values.reshape(1, -1) if rel.study.k == 1 and rel.study.kind != "sketch" else rel.sketch
        return SketchView(study_id=study_id, columns=rel.columns, kind=rel.study.kind, k=rel.study.k,
                          n_reports=rel.n_reports, sigma=rel.sigma, sketch=values.tolist())

    @app.get("/v1/studies/{study_id}/gram", dependencies=auth)
    def gram(study_id: str) -> GramView:
        rel = second_moments(study_id)
        extra = {}
        if rel.study.kind == "gram":
            extra = {"row_sum": rel.row_sum.tolist(), "noisy_count": rel.noisy_count}
        return GramView(study_id=study_id, kind=rel.study.kind, columns=rel.columns,
                        n_reports=rel.n_reports, gram=rel.gram(debias=True).tolist(), **extra)

    def finite(values: np.ndarray, what: str) -> list:
        """Refuse to answer NaN/inf (JSON has no such numbers): only absurd inputs produce them."""
        if not np.all(np.isfinite(values)):
            raise ProblemError("invalid-request", f"the {what} is not finite for these parameters "
                               f"(is alpha far larger than the data?)")
        return values.tolist()

    def _label(rel: Release, label: str | None) -> str:
        label = label or rel.study.label
        names = release_columns(rel)
        if label is None or label not in names:
            raise ProblemError("invalid-request",
                               f"label must be one of the columns {names}; got {label!r}")
        return label

    def regression(study_id: str, rel: Release, label: str, model: RidgeRegression,
                   body: RidgeRequest | LeastSquaresRequest) -> RegressionResult:
        try:
            model.fit(rel)
        except ValueError as exc:
            raise ProblemError("invalid-request", str(exc)) from None
        p = len(model.feature_names_)
        se = [_json_number(v) for v in model.stderr()]
        ci = [[_json_number(a), _json_number(b)] for a, b in model.conf_int(body.confidence)]
        return RegressionResult(study_id=study_id, label=label, features=list(model.feature_names_),
                                coef=finite(model.coef_, "solution"),
                                intercept=finite(np.array([model.intercept_]), "intercept")[0],
                                stderr=se[:p], conf_int=ci[:p],
                                intercept_stderr=se[p] if model.fit_intercept_ else None,
                                intercept_conf_int=ci[p] if model.fit_intercept_ else None,
                                noise_stderr=[_json_number(v) for v in model.stderr(population=False)],
                                confidence=body.confidence,
                                fit_intercept=model.fit_intercept_, in_units=model.in_units_,
                                alpha=float(model.alpha_), tau=float(model.tau_),
                                n_floored=int(model.n_floored_), debias=body.debias, n_reports=rel.n_reports)

    @app.post("/v1/studies/{study_id}/analyses/ridge", dependencies=auth)
    def ridge(study_id: str, body: RidgeRequest) -> RegressionResult:
        rel = second_moments(study_id)
        label = _label(rel, body.label)
        return regression(study_id, rel, label, RidgeRegression(
            label=label, alpha=body.alpha, debias=body.debias, fit_intercept=body.fit_intercept), body)

    @app.post("/v1/studies/{study_id}/analyses/least-squares", dependencies=auth)
    def least_squares(study_id: str, body: LeastSquaresRequest) -> RegressionResult:
        rel = second_moments(study_id)
        label = _label(rel, body.label)
        return regression(study_id, rel, label, LeastSquares(
            label=label, debias=body.debias, fit_intercept=body.fit_intercept), body)

    @app.post("/v1/studies/{study_id}/analyses/pca", dependencies=auth)
    def pca(study_id: str, body: PCARequest) -> PCAResult:
        rel = second_moments(study_id)
        names = release_columns(rel)
        if body.n_components > len(names):
            raise ProblemError("invalid-request",
                               f"n_components must be at most d = {len(names)}")
        try:
            model = PCA(n_components=body.n_components, debias=body.debias, columns=names,
                        center=body.center).fit(rel)
        except ValueError as exc:
            raise ProblemError("invalid-request", str(exc)) from None
        return PCAResult(study_id=study_id, columns=names,
                         components=finite(model.components_, "components"),
                         explained_variance=finite(model.explained_variance_, "explained variance"),
                         explained_variance_ratio=[float(v) if np.isfinite(v) else None
                                                   for v in model.explained_variance_ratio_],
                         mean=finite(model.mean_, "mean"), centered=model.centered_,
                         debias=body.debias, n_reports=rel.n_reports)

    return app
