"""Utility figures of paper 000, section 5: error ratios to the non-private optimum.

* Ridge regression: F(theta_hat) / F(theta*) with F(theta) = ||X theta - y||^2 + alpha ||theta||^2
  on the true clipped data, theta* = argmin F, the same alpha for every mechanism (and in F).
* Low-rank approximation: ||A - A V V^T||_F^2 / ||A - A V* V*^T||_F^2 with V the mechanism's
  top-r right singular vectors and V* the exact ones.

1.0 is the non-private optimum. :func:`compare` puts the LTM release next to the local and central
models on the same data at the same (epsilon, delta). The analyzer's recommendation predicts with
it (:mod:`analyzer.recommend`), the demo measures with it; the research harness
(``research/evaluation.py``) adds the central-model regression baselines and the benchmark tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpsketch.protocol.study import Study

from . import simulation, synthetic
from .estimators import PCA, RidgeRegression
from .release import SecondMoments

#: Default ridge penalty of the evaluation objective, per report and per B^2: alpha = 1e-3 n B^2.
#: Proportional to n, so it is the same per-sample regulariser lambda = 1e-3 B^2 at every n
#: (the objective does not change meaning as n grows); small against the feature Gram, whose
#: eigenvalues are ~ n B^2 / (5 d) for the benchmark data, so F stays essentially least squares.
DEFAULT_ALPHA_PER_REPORT = 1e-3


# ---------------------------------------------------------------------------------------------
# ridge


def ridge_objective(X: np.ndarray, y: np.ndarray, theta: np.ndarray, alpha: float) -> float:
    r = X @ theta - y
    return float(r @ r + alpha * (theta @ theta))


def ridge_optimum(X: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    """argmin F exactly (least squares through lstsq on the stacked system)."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if alpha > 0:
        p = X.shape[1]
        X = np.vstack([X, np.sqrt(alpha) * np.eye(p)])
        y = np.concatenate([y, np.zeros(p)])
    return np.linalg.lstsq(X, y, rcond=None)[0]


def ridge_ratio(X: np.ndarray, y: np.ndarray, theta_hat: np.ndarray, alpha: float) -> float:
    """F(theta_hat) / F(theta*) on the given data."""
    best = ridge_objective(X, y, ridge_optimum(X, y, alpha), alpha)
    return ridge_objective(X, y, theta_hat, alpha) / best


# ---------------------------------------------------------------------------------------------
# low rank


def pca_error(A: np.ndarray, components: np.ndarray) -> float:
    """||A - A V V^T||_F^2 for V with orthonormal columns, given as ``components`` (r x d rows)."""
    v = np.atleast_2d(np.asarray(components, dtype=np.float64))
    resid = A - (A @ v.T) @ v
    return float(np.sum(resid * resid))


def pca_optimum(A: np.ndarray, rank: int) -> np.ndarray:
    """The exact top-``rank`` right singular vectors of A (rows)."""
    _, _, vt = np.linalg.svd(np.asarray(A, dtype=np.float64), full_matrices=False)
    return vt[:rank]


def pca_ratio(A: np.ndarray, components: np.ndarray) -> float:
    """||A - A V V^T||_F^2 / ||A - A V* V*^T||_F^2 with V* of the same rank."""
    r = np.atleast_2d(components).shape[0]
    return pca_error(A, components) / pca_error(A, pca_optimum(A, r))


# ---------------------------------------------------------------------------------------------
# comparison


def default_alpha(n_reports: int, row_bound: float) -> float:
    """The evaluation's ridge penalty: DEFAULT_ALPHA_PER_REPORT * n * B^2 (public)."""
    return DEFAULT_ALPHA_PER_REPORT * n_reports * row_bound**2


def fit_ratios(
    releases: dict[str, SecondMoments],
    rows: np.ndarray,
    columns: list[str],
    *,
    label: str | None,
    rank: int | None,
    alpha: float,
    debias: bool,
) -> dict[str, dict[str, float]]:
    """Ridge (with ``label``) and PCA (with ``rank``) error ratios of each release's fit on
    ``rows``, 1.0 being the non-private optimum of the same objective."""
    out: dict[str, dict[str, float]] = {}
    if label is not None:
        li = columns.index(label)
        X, y = np.delete(rows, li, axis=1), rows[:, li]
        best = ridge_objective(X, y, ridge_optimum(X, y, alpha), alpha)
        out["ridge"] = {}
        for name, rel in releases.items():
            model = RidgeRegression(label, alpha=alpha, debias=debias).fit(rel)
            out["ridge"][name] = ridge_objective(X, y, model.coef_, alpha) / best
    if rank is not None:
        best = pca_error(rows, pca_optimum(rows, rank))
        out["pca"] = {}
        for name, rel in releases.items():
            model = PCA(rank, debias=debias).fit(rel)
            out["pca"][name] = pca_error(rows, model.components_) / best
    return out


def compare_inputs(data, study: Study, ltm_release: SecondMoments, *, label: str | None = None,
                   rank: int | None = None, alpha: float | None = None, tasks: Sequence[str] = ("ridge", "pca")
                   ) -> tuple[np.ndarray, list[str], str | None, int | None, float]:
    """What :func:`compare` compares on: (rows clipped to the study's B, columns, label or None,
    rank or None, alpha), its defaults resolved and its inputs checked against each other."""
    rows = getattr(data, "rows", data)
    rows = simulation.clip_rows(np.atleast_2d(np.asarray(rows, dtype=np.float64)), study.row_bound)
    columns = list(study.columns)
    if rows.shape[1] != len(columns):
        raise ValueError(f"data has {rows.shape[1]} columns, the study {len(columns)}")
    data_columns = getattr(data, "columns", None)
    if data_columns is not None and list(data_columns) != columns:
        raise ValueError("the data's columns differ from the study's")
    if int(ltm_release.n_reports) != rows.shape[0]:
        raise ValueError(
            f"the release covers {ltm_release.n_reports} reports but the data has {rows.shape[0]} rows"
        )
    label = label or study.label or getattr(data, "label", None)
    if "ridge" not in tasks:
        label = None
    if "pca" in tasks:
        rank = rank or getattr(data, "rank", None) or min(synthetic.DEFAULT_RANK, len(columns) - 1)
    else:
        rank = None
    alpha = default_alpha(rows.shape[0], study.row_bound) if alpha is None else float(alpha)
    return rows, columns, label, rank, alpha


def compare(
    data,
    study: Study,
    ltm_release: SecondMoments,
    *,
    label: str | None = None,
    rank: int | None = None,
    alpha: float | None = None,
    rng: np.random.Generator | None = None,
    debias: bool = True,
    tasks: Sequence[str] = ("ridge", "pca"),
    references: bool = True,
) -> dict[str, dict[str, float]]:
    """Error ratios of ridge and PCA for the LTM release and the local and central models.

    ``data`` is the clients' data: a :class:`synthetic.Dataset` or an n x d array in the study's
    column order (rows are clipped to the study's B, as the clients did). ``ltm_release`` is the
    release over exactly these rows (from real servers or :func:`simulation.simulate_ltm`). The
    local and central releases are simulated here, at the study's (epsilon, delta), B and
    neighbouring notion, with ``rng`` (numpy; default seeded 0 -- a simulation).

    ``label`` defaults to the study's (or the data set's) label; ridge is skipped without one.
    ``rank`` defaults to the data set's rank, else 3 (at most d - 1). ``alpha`` is the ridge
    penalty used by every mechanism and in F; default :func:`default_alpha`.

    Returns ``{"ridge": {"ltm": r, "local": r, "central": r}, "pca": {...}}``, ratios >= 1 (up to
    rounding), 1.0 being the non-private optimum. ``references=False`` leaves out local and
    central (only ``"ltm"``): for a caller that compares several releases of the same rows and
    simulated them once already. ``research.evaluation.compare`` adds more baselines.
    """
    rows, columns, label, rank, alpha = compare_inputs(data, study, ltm_release, label=label, rank=rank,
                                                       alpha=alpha, tasks=tasks)
    rng = rng if rng is not None else np.random.default_rng(0)
    releases: dict[str, SecondMoments] = {"ltm": ltm_release}
    if references:
        releases["local"] = simulation.simulate_local(study, rows, rng)
        releases["central"] = simulation.simulate_central(study, rows, rng)
    return fit_ratios(releases, rows, columns, label=label, rank=rank, alpha=alpha, debias=debias)
