"""Repeated runs of the sketch and gram kinds with summary statistics, and the design variants of
issue 15, measured side by side on the same draws (``python -m research.accuracy_runs``).

Every run draws one data set, one set of report ids (hence one sketch S, from the protocol hash)
and one set of standard normals; each *variant* turns them into a release with its own noise
scale and estimator, so differences between variants are paired (common random numbers) and
much more precise than the spread of either. S is drawn by :func:`random_osnap` (the protocol
hash's law, faster). Variants:

sketch kind (``design()``'s study: k, lambda_star, sigma, server_sigma)
  * ``today``: the study as designed *without* the secret sign (``secret_sign=False``, the
    baseline of issue 15); ridge with the evaluation's penalty alpha = 1e-3 n B^2 and the debiased
    Gram (what ``dpsketch experiments`` reports), PCA on the debiased Gram;
  * ``lambda97``: lambda_star = 0.97 x the Bai-Yin estimate at n = min_reports, minus t (the
    client and server noise recalibrated by ``accounting.calibrate``; the certificate is checked
    on the same S, refusals are counted). Since ``privacy.LAMBDA_SAFETY`` became 0.97 (for
    n/k >= 90 at min_reports, every default design) this is today's design: the variant is kept to
    reproduce the measurement that led to it (docs/experiments/design_results.md, made at 0.9);
  * ``fuller1`` / ``fuller4`` (ridge): Fuller's (1987, section 2.5) modification of the
    errors-in-variables estimator, :func:`fuller_ridge`, with alpha_F = 1 or 4;
  * ``sign``: the secret sign as ``design()`` makes it by default (docs/secret_sign.md): each row
    multiplied by its own t_i = +-1 before its noise, client and server noise from the proven
    calibration (same k, lambda_star and S). ``--sign-factor F`` instead keeps today's server
    noise and scales the client noise variance by F (the provisional form of issue 15);
  * ``two_round`` (ridge): a pilot study on the first half of the clients gives theta0; the
    second half shares [x, b (y - x . theta0)] in a second study (b from the pilot's release),
    theta = theta0 + delta / b. Disjoint clients: each is in one study at (epsilon, delta).
    ``two_round_sign`` adds the secret sign to both rounds;

gram kind
  * ``gram``: the study as designed ([a, u(a a^T), 1], sensitivity sqrt(2 B^4 + 2 B^2 + 1/2));
  * ``gram_moments``: u(a a^T) only, sensitivity sqrt(2) B^2 (replace-one) or B^2 (add/remove),
    the central Gram's (:func:`simulation.gram_sensitivity`): client and server noise scaled by
    the ratio of the sensitivities (exact for replace-one, where the calibration is linear in
    Delta^2);
  * ``central``: :func:`simulation.simulate_central` (SSP / Analyze Gauss).

Ratios are those of :mod:`research.evaluation` (1 = the non-private optimum). Tables give mean,
sample sd, median and the number of runs, and for variants the paired mean difference to
``today`` (or ``gram``) with its standard error. Simulation: numpy noise (never for real data).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import scipy.sparse as sp

from dpsketch.protocol import accounting, features, privacy
from dpsketch.protocol.study import Study

from dpsketch.analyzer import error_ratios, simulation, synthetic
from dpsketch.analyzer.estimators import PCA, RidgeRegression
from dpsketch.analyzer.release import GramRelease, SketchRelease

from .experiments import CLIP_QUANTILE, D, PCA_RANK, ROW_BOUND, design_study
from .report import stats
from .sketch_floor import cell_variance, ridge_floor

#: The fraction of the Bai-Yin estimate the ``lambda97`` variant asks for.
PROPOSED_SAFETY = 0.97

SKETCH_RIDGE = ("today", "lambda97", "fuller1", "fuller4", "sign", "two_round", "two_round_sign")
SKETCH_PCA = ("today", "lambda97", "sign")
GRAM = ("gram", "gram_moments", "central")


# ---------------------------------------------------------------------------------------------
# releases from shared draws


def _copy(study: Study, **update: Any) -> Study:
    return study.model_copy(update=update)


def recalibrated(study: Study, lambda_star: float) -> Study:
    """The study with lambda_star replaced and the noise recalibrated for it (simulation only)."""
    noise = accounting.calibrate(study.neighbouring, study.kind, study.row_bound, study.epsilon,
                                 study.delta, lambda_star, study.width, study.epsilon_floor)
    return _copy(study, lambda_star=lambda_star, sigma=noise.sigma, server_sigma=noise.server_sigma)


def proposed_lambda_star(study: Study, safety: float = PROPOSED_SAFETY) -> float:
    return safety * privacy.expected_lambda_min(study.min_reports, study.k) - study.t


def random_osnap(k: int, s: int, n: int, rng: np.random.Generator) -> sp.csr_matrix:
    """A block OSNAP S (k x n, s blocks of k/s rows, one +-1/sqrt(s) per block and column) with
    numpy's buckets and signs: the law of the protocol hash (a PRF) over fresh report ids, about
    10x faster than hashing 10^6 ids in Python."""
    b = k // s
    rows = (rng.integers(0, b, size=(n, s)) + np.arange(s) * b).ravel()
    signs = rng.choice(np.array([-1.0, 1.0]), size=n * s) / math.sqrt(s)
    return sp.csr_matrix((signs, (rows, np.repeat(np.arange(n), s))), shape=(k, n))


class SketchDraw:
    """One run's randomness for a sketch study over n rows: S (:func:`random_osnap`), standard
    normals for the clients (n x d) and the servers (k x d), and secret signs."""

    def __init__(self, study: Study, n: int, rng: np.random.Generator):
        self.S = random_osnap(study.k, study.s, n, rng)
        self.lambda_min = float(np.linalg.eigvalsh((self.S @ self.S.T).toarray())[0])
        self.z = rng.standard_normal((n, study.d))
        self.e = rng.standard_normal((study.k, study.d))
        self.t = rng.choice(np.array([-1.0, 1.0]), size=n)

    def release(self, study: Study, rows: np.ndarray, *, secret_sign: bool = False) -> SketchRelease:
        a = rows * self.t[:, None] if secret_sign else rows
        y = np.asarray(self.S @ (a + study.sigma * self.z))
        y = y + math.sqrt(simulation.server_noise_variance(study)) * self.e
        return SketchRelease(study=study, sketch=y, n_reports=rows.shape[0])


def sign_study(study: Study, factor: float) -> Study:
    """The ``--sign-factor`` form: client noise variance times ``factor`` (servers' noise unchanged)."""
    return _copy(study, sigma=study.sigma * math.sqrt(factor))


def signed_design(columns, label, n: int, epsilon: float, tag, factor: float | None,
                  unsigned: Study | None = None) -> Study:
    """The signed study: design()'s secret-sign calibration, or with ``factor`` the unsigned
    study's client noise variance times it."""
    if factor is not None:
        base = unsigned or design_study(columns, label, n, epsilon, "sketch", tag, secret_sign=False)
        return sign_study(base, factor)
    return design_study(columns, label, n, epsilon, "sketch", tag, secret_sign=True)


# ---------------------------------------------------------------------------------------------
# estimators under test


def fuller_ridge(release: SketchRelease, label: str, alpha: float, fuller_alpha: float) -> np.ndarray:
    """Ridge with Fuller's modification (:class:`RidgeRegression` ``fuller``) and the evaluation's
    penalty."""
    return RidgeRegression(label, alpha=alpha, debias=True, fuller=fuller_alpha).fit(release).coef_


def ridge_coef(release, label: str, alpha: float) -> np.ndarray:
    return RidgeRegression(label, alpha=alpha, debias=True).fit(release).coef_


def two_round(study_full: Study, data: synthetic.Dataset, rng: np.random.Generator, *, alpha: float,
              signed: bool, sign_factor: float | None, tag: Sequence[Any]) -> tuple[np.ndarray, dict]:
    """theta from the two-round protocol (see the module docstring); returns it with details."""
    n = data.n
    half = n // 2
    li = data.columns.index(data.label)
    pilot_rows, rest = data.rows[:half], data.rows[half:]

    def round_release(rows: np.ndarray, name: str) -> tuple[Study, SketchRelease]:
        """One round: its own sketch study over its rows (signed or not), and its release."""
        count = rows.shape[0]
        study = (signed_design(list(data.columns), data.label, count, study_full.epsilon, (*tag, name), sign_factor)
                 if signed else design_study(list(data.columns), data.label, count, study_full.epsilon, "sketch",
                                             (*tag, name), secret_sign=False))
        return study, SketchDraw(study, count, rng).release(study, rows, secret_sign=signed)

    st1, rel1 = round_release(pilot_rows, "pilot")
    a1 = error_ratios.default_alpha(half, ROW_BOUND)
    theta0 = ridge_coef(rel1, data.label, a1)
    g = rel1.gram(debias=True)
    fi = [i for i in range(data.d) if i != li]
    gyy, gxy, gxx = g[li, li], g[fi, li], g[np.ix_(fi, fi)]
    resid = gyy - 2 * theta0 @ gxy + theta0 @ gxx @ theta0
    # b rescales the residual towards the label's size; the noisy energies can be <= 0 at small n
    b = float(np.clip(math.sqrt(gyy / max(resid, gyy / 100.0)), 1.0, 10.0)) if gyy > 0 else 1.0
    x = np.delete(rest, li, axis=1)
    second = rest.copy()
    second[:, li] = b * (rest[:, li] - x @ theta0)
    second = simulation.clip_rows(second, ROW_BOUND)
    st2, rel2 = round_release(second, "second")
    delta = ridge_coef(rel2, data.label, error_ratios.default_alpha(n - half, ROW_BOUND))
    return theta0 + delta / b, {"b": b, "k1": st1.k, "k2": st2.k}


# ---------------------------------------------------------------------------------------------
# one run


def benchmark_data(task: str, n: int, seed: int) -> synthetic.Dataset:
    """The benchmark's data set for ``task``: regression rows for ridge, low-rank rows for PCA
    (D columns, clipped at the CLIP_QUANTILE quantile of the norms, row bound ROW_BOUND)."""
    if task == "ridge":
        return synthetic.regression_data(n, D, seed=seed, clip_quantile=CLIP_QUANTILE, row_bound=ROW_BOUND)
    return synthetic.lowrank_data(n, D, rank=PCA_RANK, seed=seed, clip_quantile=CLIP_QUANTILE, row_bound=ROW_BOUND)


def run_rng(stream: int, task: str, n: int, epsilon: float, seed: int) -> np.random.Generator:
    """The noise generator of one run: its own ``stream`` (one per kind of run) and the run's
    cell, so that runs are reproducible one by one and independent of each other."""
    return np.random.default_rng(np.random.SeedSequence([stream, n, seed, int(round(epsilon * 1000)),
                                                         task == "ridge"]))


def sketch_run(task: str, n: int, epsilon: float, seed: int, variants: Sequence[str],
               sign_factor: float | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    rng = run_rng(0xACC, task, n, epsilon, seed)
    data = benchmark_data(task, n, seed)
    tag = ("accuracy-runs", task, n, epsilon, seed)
    study = design_study(list(data.columns), data.label, n, epsilon, "sketch", tag, secret_sign=False)
    draw = SketchDraw(study, n, rng)
    factor = sign_factor
    alpha = error_ratios.default_alpha(n, ROW_BOUND)
    out: dict[str, Any] = {"task": task, "n": n, "epsilon": epsilon, "seed": seed, "k": study.k,
                           "lambda_star": study.lambda_star, "lambda_min": draw.lambda_min,
                           "ratios": {}, "notes": {}}
    if task == "ridge":
        li = data.columns.index(data.label)
        X, y = np.delete(data.rows, li, axis=1), data.rows[:, li]
        best = error_ratios.ridge_objective(X, y, error_ratios.ridge_optimum(X, y, alpha), alpha)

        def ratio(theta: np.ndarray) -> float:
            return error_ratios.ridge_objective(X, y, theta, alpha) / best

        floor = ridge_floor(X, y, alpha, study.k,
                            cell_variance(study.sigma, n, study.k, simulation.server_noise_variance(study)))
        out["predicted"] = {"sketch": floor.sketch, "cross": floor.cross, "noise": floor.noise}
    else:
        best = error_ratios.pca_error(data.rows, error_ratios.pca_optimum(data.rows, PCA_RANK))

        def fit_pca(rel) -> float:
            return error_ratios.pca_error(data.rows, PCA(PCA_RANK).fit(rel).components_) / best

    for v in variants:
        if v == "today":
            rel = draw.release(study, data.rows)
        elif v == "lambda97":
            lam = proposed_lambda_star(study)
            out["lambda97"] = lam
            if draw.lambda_min - study.t < lam:
                out["notes"][v] = "certificate refused"
                continue
            rel = draw.release(recalibrated(study, lam), data.rows)
        elif v == "sign":
            signed = signed_design(list(data.columns), data.label, n, epsilon, tag, factor, study)
            assert (signed.k, signed.s, signed.seed) == (study.k, study.s, study.seed)  # the same S
            out["sign_noise"] = {"sigma": signed.sigma, "server_sigma": signed.server_sigma}
            rel = draw.release(signed, data.rows, secret_sign=True)
        elif v in ("fuller1", "fuller4"):
            rel = draw.release(study, data.rows)
            out["ratios"][v] = ratio(fuller_ridge(rel, data.label, alpha, float(v[-1])))
            continue
        elif v in ("two_round", "two_round_sign"):
            theta, info = two_round(study, data, rng, alpha=alpha, signed=v == "two_round_sign",
                                    sign_factor=factor, tag=(*tag, v))
            out["ratios"][v] = ratio(theta)
            out[v] = info
            continue
        else:
            raise ValueError(f"unknown sketch variant {v!r}")
        out["ratios"][v] = ratio(ridge_coef(rel, data.label, alpha)) if task == "ridge" else fit_pca(rel)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def gram_run(task: str, n: int, epsilon: float, seed: int) -> dict[str, Any]:
    """``gram``, ``gram_moments`` and ``central`` on the same data and the same standard normals."""
    rng = run_rng(0x6A, task, n, epsilon, seed)
    data = benchmark_data(task, n, seed)
    study = design_study(list(data.columns), data.label, n, epsilon, "gram", ("accuracy-runs", task, n, epsilon, seed))
    d = study.d
    exact = data.rows.T @ data.rows
    z = rng.standard_normal(d * (d + 1) // 2)
    std = math.sqrt(study.sigma ** 2 * n + simulation.server_noise_variance(study))
    ratio_m = (simulation.gram_sensitivity(study.row_bound, study.neighbouring)
               / privacy.sensitivity(study.row_bound, study.neighbouring, "gram"))
    releases = {}
    for name, s in (("gram", std), ("gram_moments", std * ratio_m)):
        g = features.symmetric_from_upper(features.upper_triangle(exact) + s * z, d)
        releases[name] = GramRelease(columns=list(data.columns), n_reports=n, gram_matrix=g,
                                     gram_noise_scale=s * math.sqrt(2.0 * d))
    releases["central"] = simulation.simulate_central(study, data.rows, rng)
    alpha = error_ratios.default_alpha(n, ROW_BOUND)
    ratios = error_ratios.fit_ratios(releases, data.rows, list(data.columns),
                                    label=data.label if task == "ridge" else None,
                                    rank=PCA_RANK if task == "pca" else None, alpha=alpha, debias=True)[task]
    return {"task": task, "n": n, "epsilon": epsilon, "seed": seed, "kind": "gram",
            "sensitivity_ratio": ratio_m, "ratios": ratios, "notes": {}}


def lambda_min_spread(n: int, k: int, draws: int, s: int = 4, seed: int = 7) -> dict[str, float]:
    """lambda_min(S S^T) / the Bai-Yin estimate over ``draws`` block OSNAP sketches (k x n), and
    the fraction below the ``lambda97`` variant's 0.97: how often it would refuse at n reports."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, n, k, s]))
    est = privacy.expected_lambda_min(n, k)
    r = np.array([np.linalg.eigvalsh((m @ m.T).toarray())[0] / est
                  for m in (random_osnap(k, s, n, rng) for _ in range(draws))])
    return {**stats(r), "min": float(r.min()), "below_0.97": float(np.mean(r < PROPOSED_SAFETY))}


def k_sweep_run(task: str, n: int, epsilon: float, seed: int, ks: Sequence[int],
                secret_sign: bool = True, fits: Sequence[str] = ("bench",)) -> dict[str, Any]:
    """One data set under design()'s sketch study at each k in ``ks`` (signed unless told), with
    common random numbers: the same rows, the same client normals Z (n x d) and server normals E
    (the first k rows of one draw), the same secret signs; only S (``random_osnap``, drawn per k
    from a seed of (seed, k)) and the study's calibration differ. A k whose draw fails the
    certificate is reported as refused. ``fits`` (ridge): ``bench`` is the benchmark's fixed
    penalty alpha = 1e-3 n B^2 (what every table reports); ``product`` is the estimator's default
    (AdaSSP's rule plus the sketch release's cross_noise_scale), scored with the same F."""
    from dpsketch.protocol import design

    t0 = time.perf_counter()
    rng = run_rng(0x5C, task, n, epsilon, seed)
    data = benchmark_data(task, n, seed)
    cols = list(data.columns)
    d = len(cols)
    z = rng.standard_normal((n, d))
    e = rng.standard_normal((max(ks), d))
    t = rng.choice(np.array([-1.0, 1.0]), size=n)
    rows = data.rows * t[:, None] if secret_sign else data.rows
    alpha = error_ratios.default_alpha(n, ROW_BOUND)
    out: dict[str, Any] = {"task": task, "n": n, "epsilon": epsilon, "seed": seed, "secret_sign": secret_sign,
                           "ratios": {}, "studies": {}, "notes": {}}
    if task == "ridge":
        li = cols.index(data.label)
        X, y = np.delete(data.rows, li, axis=1), data.rows[:, li]
        best = error_ratios.ridge_objective(X, y, error_ratios.ridge_optimum(X, y, alpha), alpha)
    else:
        best = error_ratios.pca_error(data.rows, error_ratios.pca_optimum(data.rows, PCA_RANK))
    for k in ks:
        study, _ = design(name="k", columns=cols, label=data.label, servers=["s1", "s2"], expected_reports=n,
                          epsilon=epsilon, delta=1e-6, row_bound=ROW_BOUND, k=int(k), seed="ab" * 32,
                          secret_sign=secret_sign)
        S = random_osnap(study.k, study.s, n, np.random.default_rng(np.random.SeedSequence([0x5D, n, seed, int(k)])))
        lam = float(np.linalg.eigvalsh((S @ S.T).toarray())[0])
        out["studies"][str(k)] = {"sigma": study.sigma, "server_sigma": study.server_sigma,
                                  "lambda_star": study.lambda_star, "lambda_min": lam,
                                  "cell_variance": cell_variance(study.sigma, n, study.k,
                                                                 simulation.server_noise_variance(study))}
        if lam - study.t < study.lambda_star:
            out["notes"][str(k)] = "certificate refused"
            continue
        y_rel = np.asarray(S @ (rows + study.sigma * z)) + math.sqrt(simulation.server_noise_variance(study)) * e[:study.k]
        rel = SketchRelease(study=study, sketch=y_rel, n_reports=n)
        if task == "ridge":
            for fit in fits:
                a = alpha if fit == "bench" else None
                coef = RidgeRegression(data.label, alpha=a).fit(rel).coef_
                name = str(k) if fit == "bench" else f"{k}/{fit}"
                out["ratios"][name] = error_ratios.ridge_objective(X, y, coef, alpha) / best
        else:
            out["ratios"][str(k)] = error_ratios.pca_error(data.rows, PCA(PCA_RANK).fit(rel).components_) / best
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def k_sweep(n: int, ks: Sequence[int], runs: int, epsilon: float = 1.0, jobs: int = 1,
            secret_sign: bool = True, fits: Sequence[str] = ("bench",),
            records: list | None = None) -> list[dict[str, Any]]:
    """:func:`k_sweep_run` over seeds 0..runs-1 for ridge and PCA: per k, the ratios' stats (with
    the 90th percentile), the design's lambda_star, and the first-order prediction of
    :func:`ridge_floor` on the first data set. ``records`` (a list) receives every run."""
    tasks = [(task, n, epsilon, seed, tuple(ks), secret_sign, tuple(fits)) for seed in range(runs)
             for task in ("ridge", "pca")]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            done = list(pool.map(k_sweep_run, *zip(*tasks)))
    else:
        done = [k_sweep_run(*a) for a in tasks]
    if records is not None:
        records.extend(done)
    data = benchmark_data("ridge", n, 0)
    li = data.columns.index(data.label)
    X, y = np.delete(data.rows, li, axis=1), data.rows[:, li]
    alpha = error_ratios.default_alpha(n, ROW_BOUND)
    out = []
    for k in ks:
        first = next(r for r in done if r["task"] == "ridge")["studies"][str(k)]
        row: dict[str, Any] = {"k": int(k), "secret_sign": secret_sign, "lambda_star": first["lambda_star"],
                               "cell_variance": first["cell_variance"],
                               "predicted_ridge": ridge_floor(X, y, alpha, int(k), first["cell_variance"]).ratio}
        for task in ("ridge", "pca"):
            recs = [r for r in done if r["task"] == task]
            row[task] = stats([r["ratios"][str(k)] for r in recs if str(k) in r["ratios"]])
            row[task]["refused"] = sum(1 for r in recs if str(k) in r["notes"])
        for fit in fits:
            if fit != "bench":
                row[f"ridge/{fit}"] = stats([r["ratios"][f"{k}/{fit}"] for r in done
                                            if f"{k}/{fit}" in r["ratios"]])
        out.append(row)
    return out


def k_sweep_line(n: int, epsilon: float, row: dict[str, Any]) -> str:
    def cell(e: dict[str, float]) -> str:
        return (f"{e['mean']:.3g} ± {e['sd']:.2g} ({e['median']:.3g}), p90 {e['p90']:.3g}, max {e['max']:.3g}"
                + (f" [{e['refused']} refused]" if e.get("refused") else ""))

    extra = "".join(f"; {key} {cell(v)}" for key, v in row.items() if key.startswith("ridge/"))
    return (f"n = {n:,}, epsilon = {epsilon:g}, k = {row['k']} (lambda_star {row['lambda_star']:.0f}, v "
            f"{row['cell_variance']:.3g}): predicted ridge {row['predicted_ridge']:.3g}; ridge {cell(row['ridge'])}"
            f"{extra}; PCA {cell(row['pca'])}; {row['ridge']['runs']} runs")


def trivial_run(n: int, seed: int) -> dict[str, float]:
    """One data set's ratios of estimates that learn nothing, on the benchmark's data: ridge with
    theta = 0 and PCA with a random 3-dimensional subspace (the yardstick for "no better than
    predicting zero")."""
    data = benchmark_data("ridge", n, seed)
    low = benchmark_data("pca", n, seed)
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((D, PCA_RANK)))
    return {"ridge_theta_zero": error_ratios.ridge_ratio(data.features(), data.target(), np.zeros(D),
                                                         error_ratios.default_alpha(n, ROW_BOUND)),
            "pca_random_subspace": error_ratios.pca_ratio(low.rows, q.T)}


# ---------------------------------------------------------------------------------------------
# the secret sign's end-to-end pipeline in memory (tests/test_secret_sign_e2e.py runs it over HTTP)

#: Columns and coefficients of :func:`strong_signal_data`.
SIGN_COLUMNS = ["x0", "x1", "y"]
SIGN_THETA = np.array([1.0, -0.6])


def strong_signal_data(n: int, seed: int) -> np.ndarray:
    """Rows [x, y] with x of i.i.d. +-1/sqrt(2) entries and y = x . SIGN_THETA + N(0, 0.1^2),
    scaled by one constant to max norm 1: every row near the bound, so the signal in A^T A is as
    large as the row bound allows (the secret sign's end-to-end data)."""
    rng = np.random.default_rng(np.random.SeedSequence([0x516E, seed]))
    x = rng.choice([-1.0, 1.0], size=(n, 2)) / np.sqrt(2.0)
    a = np.column_stack([x, x @ SIGN_THETA + 0.1 * rng.standard_normal(n)])
    return a / np.linalg.norm(a, axis=1).max()


def sign_fit_errors(data: np.ndarray, coef: np.ndarray, components: np.ndarray) -> tuple[float, float]:
    """(relative error of ridge coefficients against least squares on ``data`` (label last),
    PCA's error ratio against the exact subspace of the same rank): what the secret sign's
    end-to-end test and :func:`sign_pipeline_errors` score."""
    x, y = data[:, :-1], data[:, -1]
    truth = np.linalg.lstsq(x, y, rcond=None)[0]
    return (float(np.linalg.norm(np.asarray(coef) - truth) / np.linalg.norm(truth)),
            float(error_ratios.pca_ratio(data, np.asarray(components))))


def sign_studies(n: int, k: int, epsilon: float = 1.0) -> dict[bool, Study]:
    """The end-to-end test's signed and unsigned studies of :func:`strong_signal_data`: the
    analyzer's design at ``epsilon``, the default floor, three servers, min_reports = n."""
    from dpsketch.protocol import design

    return {signed: design(name="law", columns=SIGN_COLUMNS, label="y", servers=["s1", "s2", "s3"],
                           expected_reports=n, epsilon=epsilon, k=k, min_reports=n, secret_sign=signed)[0]
            for signed in (True, False)}


def sign_pipeline_errors(study: Study, data: np.ndarray, draw: SketchDraw, *, secret_sign: bool) -> tuple[float, float]:
    """The end-to-end test's pipeline in memory for one release: ``draw``'s block OSNAP, the
    clients' signs (if ``secret_sign``) and noise, the servers' noise, the analyzer's ridge (label
    y) and rank-2 PCA; :func:`sign_fit_errors` of the result."""
    release = draw.release(study, data, secret_sign=secret_sign)
    return sign_fit_errors(data, RidgeRegression(label="y").fit(release).coef_,
                           PCA(n_components=2).fit(release).components_)


def sign_pair_run(n: int, k: int, epsilon: float, seed: int) -> dict[str, float]:
    """One data set (:func:`strong_signal_data` at seed + 1, the test's data sets 1, 2, ...) under
    the signed and the unsigned study on common random numbers (one S, client and server
    normals, signs): each one's ridge coefficient error and PCA ratio, and signed / unsigned."""
    studies = sign_studies(n, k, epsilon)
    assert (studies[True].k, studies[True].s) == (studies[False].k, studies[False].s)  # one S fits both
    data = strong_signal_data(n, seed + 1)
    draw = SketchDraw(studies[True], n, np.random.default_rng(np.random.SeedSequence([0x5167, n, k, seed])))
    out: dict[str, float] = {}
    errors = {signed: sign_pipeline_errors(studies[signed], data, draw, secret_sign=signed) for signed in (True, False)}
    for i, metric in enumerate(("ridge_coef", "pca")):
        out[f"{metric}/signed"], out[f"{metric}/unsigned"] = errors[True][i], errors[False][i]
        out[f"{metric}/signed_over_unsigned"] = errors[True][i] / errors[False][i]
        out[f"{metric}/signed_better"] = float(errors[True][i] < errors[False][i])
    return out


def trivial_ratios(n: int, runs: int) -> dict[str, dict[str, float]]:
    """:func:`trivial_run` over seeds 0..runs-1, summarised."""
    done = [trivial_run(n, seed) for seed in range(runs)]
    return {key: stats([r[key] for r in done]) for key in ("ridge_theta_zero", "pca_random_subspace")}


# ---------------------------------------------------------------------------------------------
# tables


def summarize(records: list[dict[str, Any]], kind: str) -> dict[tuple, dict[str, Any]]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("kind", "sketch") == kind:
            groups.setdefault((r["task"], r["n"], r["epsilon"]), []).append(r)
    out = {}
    base = "today" if kind == "sketch" else "gram"
    for key, recs in sorted(groups.items()):
        names = list(dict.fromkeys(m for r in recs for m in r["ratios"]))
        cell: dict[str, Any] = {"k": recs[0].get("k"), "runs": len(recs), "variants": {}}
        for m in names:
            vals = [r["ratios"][m] for r in recs if m in r["ratios"]]
            entry = stats(vals)
            paired = [r["ratios"][m] - r["ratios"][base] for r in recs if m in r["ratios"] and base in r["ratios"]]
            if m != base and len(paired) > 1:
                entry["diff"] = float(np.mean(paired))
                entry["diff_se"] = float(np.std(paired, ddof=1) / math.sqrt(len(paired)))
            entry["refused"] = sum(1 for r in recs if m in r.get("notes", {}))
            cell["variants"][m] = entry
        preds = [r["predicted"] for r in recs if "predicted" in r]
        if preds:
            cell["predicted"] = {t: float(np.mean([p[t] for p in preds])) for t in preds[0]}
            cell["today_only"] = None
        out[key] = cell
    return out


def _f(v: float) -> str:
    if abs(v - 1.0) < 0.01:
        return f"1 + {v - 1.0:.2g}"
    return f"{v:.4g}" if v < 1.1 else f"{v:.3g}"


def markdown(records: list[dict[str, Any]], argv: Sequence[str], seconds: float) -> str:
    lines = ["# Design variants, repeated runs (issue 15)", "",
             f"Generated by `python -m research.accuracy_runs {' '.join(argv)}` in {seconds / 60:.1f} min "
             "(simulation: numpy block OSNAP and noise; see the module docstring for every variant). "
             "Cells: mean ± sd (median) over the runs; Δ: paired mean difference to the first "
             "column ± its standard error. d = 10, delta = 1e-6, replace-one, B = 1, 0.99-quantile "
             "scaling. *today* is design()'s study without the secret sign; **sign** and "
             "**two_round_sign** are design()'s secret-sign studies (the proven calibration, "
             "docs/secret_sign.md) unless the command gives --sign-factor.", ""]
    for kind in ("sketch", "gram"):
        summ = summarize(records, kind)
        if not summ:
            continue
        for task in ("ridge", "pca"):
            keys = [k for k in summ if k[0] == task]
            if not keys:
                continue
            names = list(dict.fromkeys(m for k in keys for m in summ[k]["variants"]))
            lines += [f"## {kind} kind, {task}", ""]
            head = ["n", "epsilon", "runs"] + (["k"] if kind == "sketch" else []) + names
            if kind == "sketch" and task == "ridge":
                head.append("predicted (sketch + cross + noise)")
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for key in keys:
                cell = summ[key]
                row = [f"{key[1]:,}", f"{key[2]:g}", str(cell["runs"])]
                if kind == "sketch":
                    row.append(str(cell["k"]))
                for m in names:
                    e = cell["variants"].get(m)
                    if e is None:
                        row.append("-")
                        continue
                    txt = f"{_f(e['mean'])} ± {e['sd']:.2g} ({_f(e['median'])})"
                    if "diff" in e:
                        txt += f"; Δ {e['diff']:+.3g} ± {e['diff_se']:.2g}"
                    if e["runs"] != cell["runs"]:
                        txt += f" [{e['runs']} runs]"
                    if e.get("refused"):
                        txt += f" [{e['refused']} refused]"
                    row.append(txt)
                if kind == "sketch" and task == "ridge":
                    p = cell.get("predicted")
                    row.append("-" if p is None else
                               f"{1 + sum(p.values()):.3g} = 1 + {p['sketch']:.3f} + {p['cross']:.3f} + {p['noise']:.3f}")
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# command line


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m research.accuracy_runs",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
    ap.add_argument("--n", type=float, nargs="+", default=[1e4, 1e5, 1e6])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0])
    ap.add_argument("--runs", type=int, default=20, help="runs per cell (default %(default)s)")
    ap.add_argument("--tasks", nargs="+", default=["ridge", "pca"], choices=["ridge", "pca"])
    ap.add_argument("--kinds", nargs="+", default=["sketch", "gram"], choices=["sketch", "gram"])
    ap.add_argument("--variants", nargs="+", default=None,
                    help=f"sketch variants (default: ridge {' '.join(SKETCH_RIDGE)}; pca {' '.join(SKETCH_PCA)})")
    ap.add_argument("--sign-factor", type=float, default=None,
                    help="instead of design()'s secret-sign calibration: today's study with the client "
                    "noise variance times this factor (servers' noise unchanged)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json (default: print only)")
    ap.add_argument("--from-json", nargs="+", metavar="FILE",
                    help="re-draw the tables from earlier runs' OUT.json files (merged), run nothing")
    ap.add_argument("--trivial", action="store_true",
                    help="instead: ratios of theta = 0 (ridge) and a random subspace (PCA) per n")
    ap.add_argument("--lambda-spread", nargs=2, type=int, metavar=("N", "K"), action="append",
                    help="instead: lambda_min(S S^T) / Bai-Yin over --runs sketches of N reports and K rows "
                    "(repeatable)")
    ap.add_argument("--k-sweep", nargs="+", type=int, metavar="K",
                    help="instead: design()'s sketch study at each of these k on common random numbers "
                    "(k_sweep_run), --runs data sets, every --n and --epsilons; --out writes OUT.json")
    ap.add_argument("--unsigned", action="store_true", help="with --k-sweep: secret_sign=False")
    ap.add_argument("--fits", nargs="+", default=["bench"], choices=["bench", "product"],
                    help="with --k-sweep: ridge penalties to score (bench: alpha = 1e-3 n B^2; product: "
                    "the estimator's default)")
    args = ap.parse_args(argv)
    if args.k_sweep:
        t0 = time.perf_counter()
        records: list[dict[str, Any]] = []
        table = []
        for n in (int(x) for x in args.n):
            for eps in args.epsilons:
                ks = [k for k in args.k_sweep if k <= n // 100 or k == min(args.k_sweep)]
                for row in k_sweep(n, ks, args.runs, eps, args.jobs, not args.unsigned, args.fits, records):
                    table.append({"n": n, "epsilon": eps, **row})
                    print(k_sweep_line(n, eps, row), flush=True)
        if args.out:
            with open(args.out + ".json", "w") as fh:
                json.dump({"argv": argv, "seconds": round(time.perf_counter() - t0, 1), "table": table,
                           "records": records}, fh, indent=1, default=float)
        return 0
    if args.lambda_spread:
        for n, k in args.lambda_spread:
            res = lambda_min_spread(n, k, args.runs)
            print(f"n = {n:,}, k = {k} (n/k = {n // k}): lambda_min / Bai-Yin {res['mean']:.4f} ± {res['sd']:.4f} "
                  f"(median {res['median']:.4f}, min {res['min']:.4f}), below 0.97 in {res['below_0.97']:.2%} "
                  f"of {res['runs']}")
        return 0
    if args.trivial:
        for n in (int(x) for x in args.n):
            res = trivial_ratios(n, args.runs)
            print(f"n = {n:,}: " + "; ".join(
                f"{k} {v['mean']:.3g} ± {v['sd']:.2g} ({v['median']:.3g}), {v['runs']} runs" for k, v in res.items()))
        return 0
    if args.from_json:
        records, seconds, echo, notes = [], 0.0, [], []
        for path in args.from_json:
            with open(path) as fh:
                saved = json.load(fh)
            records += saved["records"]
            for part in saved.get("runs", [saved]):  # a merged file lists the runs it holds
                seconds += part["seconds"]
                echo.append(" ".join(part["argv"]))
                if part.get("note"):
                    notes.append(f"Note ({' '.join(part['argv'])}): {part['note']}.")
        md = markdown(records, ["; ".join(echo)], seconds) + "".join("\n" + n + "\n" for n in notes)
        print(md)
        if args.out:
            with open(args.out + ".md", "w") as fh:
                fh.write(md + "\n")
        return 0
    jobs = []
    for n in sorted((int(x) for x in args.n), reverse=True):
        for eps in args.epsilons:
            for task in args.tasks:
                for seed in range(args.runs):
                    if "sketch" in args.kinds:
                        vs = args.variants or (SKETCH_RIDGE if task == "ridge" else SKETCH_PCA)
                        if task == "pca":
                            vs = [v for v in vs if v in SKETCH_PCA]
                        jobs.append((sketch_run, (task, n, eps, seed, tuple(vs), args.sign_factor)))
                    if "gram" in args.kinds:
                        jobs.append((gram_run, (task, n, eps, seed)))
    t0 = time.perf_counter()
    records = []
    print(f"accuracy_runs: {len(jobs)} runs", file=sys.stderr)

    partial = open(args.out + ".partial.jsonl", "a") if args.out else None

    def done(r):
        records.append(r)
        if partial is not None:  # every record as it comes: a crash keeps the runs done so far
            partial.write(json.dumps(r, default=float) + "\n")
            partial.flush()
        print(f"[{time.perf_counter() - t0:6.0f}s] {r.get('kind', 'sketch')} {r['task']} n={r['n']} "
              f"eps={r['epsilon']:g} seed={r['seed']}: "
              + ", ".join(f"{m} {v:.4g}" for m, v in r["ratios"].items()), file=sys.stderr, flush=True)

    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            for f in [pool.submit(fn, *a) for fn, a in jobs]:
                done(f.result())
    else:
        for fn, a in jobs:
            done(fn(*a))
    seconds = time.perf_counter() - t0
    md = markdown(records, argv, seconds)
    print(md)
    if args.out:
        with open(args.out + ".md", "w") as fh:
            fh.write(md + "\n")
        with open(args.out + ".json", "w") as fh:
            json.dump({"argv": argv, "seconds": round(seconds, 1), "records": records}, fh, indent=1,
                      default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
