"""A typed Python client for the analyzer's REST API (used by ``dpsketch study``, the demo, tests)."""

from __future__ import annotations

from typing import Any

import httpx

from dpsketch.plain_errors import unreachable_reason
from dpsketch.protocol import ProblemError


class AnalyzerUnreachable(httpx.TransportError):
    """The analyzer could not be reached: one sentence naming its URL (an httpx transport error,
    so callers that catch those still do)."""


class AnalyzerClient:
    def __init__(self, url: str, token: str | None = None, timeout: float = 600.0, verify: Any = True):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout,
                                 verify=verify)

    def __enter__(self) -> "AnalyzerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kwargs) -> Any:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise AnalyzerUnreachable(
                f"cannot reach the analyzer at {self.url} (--analyzer, $DPSKETCH_ANALYZER): "
                f"{unreachable_reason(exc)}", request=exc.request) from exc
        if r.status_code >= 400:
            raise ProblemError.from_http(r.status_code, r.content)
        return r.json()

    def create_study(self, **fields: Any) -> dict[str, Any]:
        return self._call("POST", "/v1/studies", json=fields)

    def studies(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/studies")

    def study(self, study_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/studies/{study_id}")

    def ledger(self, population: str | None = None, study_id: str | None = None) -> dict[str, Any]:
        """A population's privacy ledger at every share server, by population or by study."""
        if (population is None) == (study_id is None):
            raise ValueError("give a population or a study id")
        if study_id is not None:
            return self._call("GET", f"/v1/studies/{study_id}/ledger")
        return self._call("GET", f"/v1/populations/{population}/ledger")

    def progress(self, study_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/studies/{study_id}/progress")

    def finalize(self, study_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/studies/{study_id}/finalize")

    def sketch(self, study_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/studies/{study_id}/sketch")

    def gram(self, study_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/studies/{study_id}/gram")

    def recommend(self, **fields: Any) -> dict[str, Any]:
        return self._call("POST", "/v1/recommend", json=fields)

    def ridge(self, study_id: str, **fields: Any) -> dict[str, Any]:
        return self._call("POST", f"/v1/studies/{study_id}/analyses/ridge", json=fields)

    def least_squares(self, study_id: str, **fields: Any) -> dict[str, Any]:
        return self._call("POST", f"/v1/studies/{study_id}/analyses/least-squares", json=fields)

    def pca(self, study_id: str, **fields: Any) -> dict[str, Any]:
        return self._call("POST", f"/v1/studies/{study_id}/analyses/pca", json=fields)

    def logistic(self, study_id: str, **fields: Any) -> dict[str, Any]:
        """Logistic regression (label?, classes?, alpha?, debias?, fit_intercept?, intercept_column?,
        calibration?); fields left None are omitted."""
        body = {k: v for k, v in fields.items() if v is not None}
        return self._call("POST", f"/v1/studies/{study_id}/analyses/logistic", json=body)

    def lad(self, study_id: str, **fields: Any) -> dict[str, Any]:
        """Robust regression on a gram or moments study (label?, weights?, tuning?: one round, docs/lad.md)
        or least absolute deviations on an l1 study (label?, alpha?, noise_correction?); fields left
        None are omitted."""
        body = {k: v for k, v in fields.items() if v is not None}
        return self._call("POST", f"/v1/studies/{study_id}/analyses/lad", json=body)

    # histogram studies
    def histogram(self, study_id: str, confidence: float = 0.95) -> dict[str, Any]:
        return self._call("GET", f"/v1/studies/{study_id}/histogram", params={"confidence": confidence})

    # the bounds pilot (docs/bounds.md)
    def create_pilot(self, name: str, columns: list[str], expected_reports: int, **fields: Any) -> dict[str, Any]:
        """Create a pilot (POST /v1/pilots): a marginal histogram study over ``columns`` whose
        release proposes bounds; ``fields``: epsilon (default 0.5), delta, neighbouring, t,
        epsilon_floor, min_reports, max_reports, population. Answers the StudyView."""
        return self._call("POST", "/v1/pilots", json={"name": name, "columns": list(columns),
                                                      "expected_reports": expected_reports, **fields})

    def propose_bounds(self, study_id: str, lower: float = 0.005, upper: float = 0.995) -> dict[str, Any]:
        """Bounds proposed from a released pilot (POST /v1/studies/{id}/analyses/bounds):
        {"bounds": {column: [lo, hi]}, "text": "age=15:100,...", "columns": [per-column details]}."""
        return self._call("POST", f"/v1/studies/{study_id}/analyses/bounds",
                          json={"lower": lower, "upper": upper})

    def statistic(self, study_id: str, name: str, **fields: Any) -> dict[str, Any]:
        """One histogram statistic: quantiles, moments, kendall-tau, auc, gini-mean-difference,
        gini-simpson (the analyzer's /analyses/NAME)."""
        return self._call("POST", f"/v1/studies/{study_id}/analyses/{name}", json=fields)
