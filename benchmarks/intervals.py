"""Coverage of the release-noise intervals (analyzer/uncertainty.py) over repeated releases.

    .venv/bin/python -m benchmarks.intervals [--reps 200] [--quick]

Every run keeps ONE data set and draws the release again and again, in law (numpy noise at the
study's sigma and server_sigma: the product's own noise comes from a CSPRNG and cannot be seeded),
so the only randomness is the mechanism's: the clients' and servers' noise, and for the sketch
kind the report ids (fresh random ids per release, hashed by the protocol's block OSNAP, so the
sketch's distortion is the real one) and the secret signs. For each release the fit and its
interval are computed from the release alone, and the interval is checked against the
NON-PRIVATE coefficient: the same fit on the exact moments of the same clipped rows (least
squares with the intercept through the constant). Printed per case: coverage of the nominal 95 %
interval per coefficient, mean se / empirical sd of the estimates over the releases, and
(mean estimate - target) / sd.

Cases:
* ``gram``: a gram study (rows [x1, x2, x3, y]; the constant "1" from the row sum and the exact
  count), least squares and the ridge with the default penalty (AdaSSP's rule; the constant
  unpenalised);
* ``sketch`` with and without the secret sign (rows [x1, x2, x3, c, y], c = 0.5 the constant
  column a client appends), k from design(), least squares and the default ridge (AdaSSP's rule
  plus the sketch's cross-noise scale; the constant unpenalised);
* ``sampling``: fresh rows each replicate from a known linear model, a gram release; the interval
  with the total se (noise + sampling) against the TRUE generating coefficients, and the noise-only
  interval for comparison;
* ``logistic``: a gram study with a 0 / 0.5 label, LogisticRegression (Gaussian calibration) as a
  function of the moments, se by :func:`analyzer.uncertainty.delta_covariance`, against the same
  fit on the exact moments.

tests/test_uncertainty.py runs a fixed subset with fixed seeds; docs/accuracy.md ("Intervals")
shows this command's output.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dpsketch.analyzer import simulation
from dpsketch.analyzer import uncertainty as U
from dpsketch.analyzer.estimators import default_ridge_alpha, robust_solve
from dpsketch.analyzer.analyses.logistic import LogisticRegression
from dpsketch.analyzer.release import GramSumRelease
from dpsketch.protocol import features
from dpsketch.protocol.study import Study, design

FEATURES = ["x1", "x2", "x3"]
COEF = np.array([0.5, -0.3, 0.2])
INTERCEPT = 0.1
#: The constant column of a sketch study (the value a client would append, here 0.5).
CONSTANT_VALUE = 0.5
SERVERS = ["s1", "s2"]
LEVEL = 0.95


def make_study(kind: str, columns: list[str], label: str, n: int, epsilon: float,
               secret_sign: bool | None = None) -> Study:
    """design()'s study (its k, noise and floor), with a fixed public seed."""
    study, _ = design(name="intervals", columns=columns, label=label, servers=SERVERS, expected_reports=n,
                      epsilon=epsilon, kind=kind, secret_sign=secret_sign, seed="5e" * 32)
    return study


def regression_rows(n: int, rng: np.random.Generator, constant: bool, residual_sd: float = 0.1) -> np.ndarray:
    """Rows [x1, x2, x3, (c,) y], y = x . COEF + INTERCEPT + N(0, residual_sd^2), clipped to B = 1
    (a few rows are: the target is the fit on the clipped rows)."""
    x = rng.normal(0.0, 0.25, size=(n, len(FEATURES)))
    y = x @ COEF + INTERCEPT + rng.normal(0.0, residual_sd, n)
    parts = [x] + ([np.full((n, 1), CONSTANT_VALUE)] if constant else []) + [y[:, None]]
    return simulation.clip_rows(np.column_stack(parts), 1.0)


def model_rows(n: int, rng: np.random.Generator, residual_half_width: float = 0.4) -> np.ndarray:
    """Rows [x1, x2, x3, y] of the linear model y = x . COEF + INTERCEPT + e with x uniform on
    [-0.3, 0.3]^3 and e uniform on [-h, h]: every row has norm < 1, so nothing is clipped and the
    generating coefficients are the population's least-squares coefficients."""
    x = rng.uniform(-0.3, 0.3, size=(n, len(FEATURES)))
    y = x @ COEF + INTERCEPT + rng.uniform(-residual_half_width, residual_half_width, n)
    rows = np.column_stack([x, y])
    assert np.max(np.linalg.norm(rows, axis=1)) < 1.0
    return rows


def gram_release(study: Study, phi_sum: np.ndarray, n: int, rng: np.random.Generator) -> GramSumRelease:
    """A gram release in law: the exact sum of phi(a) plus N(0, n sigma^2 + N server_sigma^2) per
    coordinate (what simulation.simulate_ltm draws, without recomputing the sum)."""
    std = math.sqrt(study.sigma ** 2 * n + simulation.server_noise_variance(study))
    return GramSumRelease(study=study, values=phi_sum + rng.normal(0.0, std, size=phi_sum.shape), n_reports=n)


@dataclass
class CoverageRun:
    """One case: per release the estimate, its se and whether the interval covered the target."""

    name: str
    names: list[str]
    target: np.ndarray
    estimates: list[np.ndarray] = field(default_factory=list)
    ses: list[np.ndarray] = field(default_factory=list)
    covered: list[np.ndarray] = field(default_factory=list)
    note: str = ""

    def add(self, estimate: np.ndarray, se: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> None:
        self.estimates.append(np.asarray(estimate, dtype=float))
        self.ses.append(np.asarray(se, dtype=float))
        self.covered.append((lower <= self.target) & (self.target <= upper))

    @property
    def reps(self) -> int:
        return len(self.estimates)

    @property
    def coverage(self) -> np.ndarray:
        return np.mean(self.covered, axis=0)

    @property
    def empirical_sd(self) -> np.ndarray:
        return np.std(self.estimates, axis=0, ddof=1)

    @property
    def se_over_sd(self) -> np.ndarray:
        """mean se over the releases / the estimates' sd over the releases, per coefficient."""
        return np.mean(self.ses, axis=0) / self.empirical_sd

    @property
    def bias_over_sd(self) -> np.ndarray:
        return (np.mean(self.estimates, axis=0) - self.target) / self.empirical_sd

    def row(self) -> str:
        r = self.se_over_sd
        return (f"| {self.name} | {self.reps} | {self.coverage.min():.3f} - {self.coverage.max():.3f} | "
                f"{np.mean(r):.3f} ± {np.std(r, ddof=1):.3f} | "
                f"{np.max(np.abs(self.bias_over_sd)):.2f} | {self.note} |")


def _ridge_penalty(m_hat: np.ndarray, x_idx: list[int], tau: float, constant_pos: int, cross: float) -> np.ndarray:
    """The default ridge's diagonal penalty: AdaSSP's max(0, tau - lambda_min) plus the sketch's
    cross-noise scale, 0 on the constant."""
    alpha = default_ridge_alpha(m_hat[np.ix_(x_idx, x_idx)], tau) + cross
    pen = np.full(len(x_idx), alpha)
    pen[constant_pos] = 0.0
    return pen


@dataclass
class LinearCase:
    """Least squares and the default ridge over repeated releases of one data set; also keeps
    every release's dM = M_hat - M (upper triangle) to check the law itself."""

    least_squares: CoverageRun
    ridge: CoverageRun
    first_order: CoverageRun  # least squares without the small-sample factor, normal quantile
    moments: np.ndarray  # the exact M over the analysed columns
    law_at_truth: U.MomentLaw
    deviations: list[np.ndarray] = field(default_factory=list)  # one (p, p) dM per release
    seconds: float = 0.0


def linear_case(kind: str, n: int, epsilon: float, reps: int, seed: int, secret_sign: bool | None = None,
                name: str | None = None) -> LinearCase:
    rng = np.random.default_rng(seed)
    sketch_kind = kind == "sketch"
    rows = regression_rows(n, rng, constant=sketch_kind)
    study_cols = FEATURES + (["c"] if sketch_kind else []) + ["y"]
    study = make_study(kind, study_cols, "y", n, epsilon, secret_sign)
    cols = FEATURES + ["c" if sketch_kind else U.CONSTANT, "y"]
    x_idx, y_idx, const_pos = [0, 1, 2, 3], 4, 3
    # the exact moments over cols: the constant of a gram study is the column of ones
    exact_rows = rows if sketch_kind else np.column_stack([rows[:, :3], np.ones(n), rows[:, 3]])
    m_true = exact_rows.T @ exact_rows
    target = np.linalg.solve(m_true[np.ix_(x_idx, x_idx)], m_true[x_idx, y_idx])
    label = name or (f"{kind}{'' if not sketch_kind else (' signed' if study.secret_sign else ' unsigned')}"
                     f", n = {n}, epsilon = {epsilon:g}, k = {study.k}")
    names = FEATURES + ["c" if sketch_kind else "intercept"]
    ls = CoverageRun(f"{label}: least squares", names, target)
    ridge = CoverageRun(f"{label}: ridge (default alpha)", names, target)
    first = CoverageRun(f"{label}: least squares, first order (no k / (k - p - 1), normal quantile)",
                        names, target)
    phi_sum = features.gram_features(rows).sum(axis=0) if not sketch_kind else None
    deviations = []
    law_at_truth = None
    t0 = time.perf_counter()
    for _ in range(reps):
        release = (simulation.simulate_ltm(study, rows, rng) if sketch_kind
                   else gram_release(study, phi_sum, n, rng))
        m_hat, law = U.moment_law(release, cols)
        if law_at_truth is None:
            law_at_truth = (U.SketchLaw(moments=m_true, k=law.k, beta=law.beta, gamma=law.gamma, info=law.info)
                            if sketch_kind else law)
        deviations.append(m_hat - m_true)
        tau = float(release.gram_noise_scale)
        dof = U.interval_dof(law, len(x_idx))
        theta, _ = robust_solve(m_hat[np.ix_(x_idx, x_idx)], m_hat[x_idx, y_idx], tau)
        cov = U.linear_fit_covariance(m_hat, law, x_idx, y_idx, theta, floor=tau)
        ls.add(theta, *U.intervals(theta, cov, LEVEL, dof))
        first.add(theta, *U.intervals(theta, cov / U.small_sample_factor(law, len(x_idx)), LEVEL))
        pen = _ridge_penalty(m_hat, x_idx, tau, const_pos, float(getattr(release, "cross_noise_scale", 0.0)))
        theta_r, _ = robust_solve(m_hat[np.ix_(x_idx, x_idx)] + np.diag(pen), m_hat[x_idx, y_idx], tau)
        cov_r = U.linear_fit_covariance(m_hat, law, x_idx, y_idx, theta_r, penalty=pen, floor=tau)
        ridge.add(theta_r, *U.intervals(theta_r, cov_r, LEVEL, dof))
    return LinearCase(ls, ridge, first, m_true, law_at_truth, deviations, time.perf_counter() - t0)


@dataclass
class SamplingCase:
    total: CoverageRun
    noise_only: CoverageRun
    sampling_only: CoverageRun
    sampling_over_noise: float  # mean sampling variance / mean noise variance (over coefficients)


def sampling_case(n: int, epsilon: float, reps: int, seed: int, residual_half_width: float = 0.4) -> SamplingCase:
    """Fresh rows each replicate from the linear model of :func:`model_rows`, a gram release; the
    interval with the total se against the generating coefficients (and the noise-only one)."""
    rng = np.random.default_rng(seed)
    study = make_study("gram", FEATURES + ["y"], "y", n, epsilon)
    cols = FEATURES + [U.CONSTANT, "y"]
    x_idx, y_idx = [0, 1, 2, 3], 4
    target = np.r_[COEF, INTERCEPT]
    names = FEATURES + ["intercept"]
    label = f"gram, n = {n}, epsilon = {epsilon:g}, fresh data"
    total = CoverageRun(f"{label}: noise + sampling se vs true coefficients", names, target)
    noise_only = CoverageRun(f"{label}: noise-only se vs true coefficients", names, target)
    sampling_only = CoverageRun(f"{label}: sampling-only se vs true coefficients", names, target)
    ratios = []
    for _ in range(reps):
        rows = model_rows(n, rng, residual_half_width)
        release = gram_release(study, features.gram_features(rows).sum(axis=0), n, rng)
        m_hat, law = U.moment_law(release, cols)
        tau = float(release.gram_noise_scale)
        theta, _ = robust_solve(m_hat[np.ix_(x_idx, x_idx)], m_hat[x_idx, y_idx], tau)
        cov_noise = U.linear_fit_covariance(m_hat, law, x_idx, y_idx, theta, floor=tau)
        cov_sampling = U.sampling_covariance(m_hat, x_idx, y_idx, theta, n, floor=tau)
        total.add(theta, *U.intervals(theta, cov_noise + cov_sampling, LEVEL))
        noise_only.add(theta, *U.intervals(theta, cov_noise, LEVEL))
        sampling_only.add(theta, *U.intervals(theta, cov_sampling, LEVEL))
        ratios.append(np.diag(cov_sampling) / np.diag(cov_noise))
    return SamplingCase(total, noise_only, sampling_only, float(np.mean(ratios)))


LOGISTIC_COLUMNS = FEATURES + ["y"]


def logistic_rows(n: int, rng: np.random.Generator) -> np.ndarray:
    """Rows [x1, x2, x3, 0.5 y]: y ~ Bernoulli(0.4), x | y Gaussian with a class shift (the LDA
    model, under which the Gaussian calibration is consistent), rows clipped to B = 1."""
    y = (rng.uniform(size=n) < 0.4).astype(float)
    x = rng.normal(0.0, 0.2, size=(n, 3)) + np.outer(y - 0.4, [0.25, -0.15, 0.05])
    return simulation.clip_rows(np.column_stack([x, 0.5 * y]), 1.0)


def logistic_function(n: int, noise_scale: float) -> Callable[[np.ndarray], np.ndarray]:
    """[intercept, coef] of LogisticRegression(label "y", classes (0, 0.5), Gaussian calibration,
    default alpha) as a function of the moments over FEATURES + ["1", "y"] (the bare-Gram path of
    LogisticRegression.fit: the Gram of the columns, the row sum, the exact count)."""
    order = [0, 1, 2, 4]  # FEATURES + y within FEATURES + ["1", "y"]

    def fn(m: np.ndarray) -> np.ndarray:
        model = LogisticRegression("y", classes=(0, 0.5)).fit(
            m[np.ix_(order, order)], columns=LOGISTIC_COLUMNS, n_reports=n, row_sum=m[3, order],
            noise_scale=noise_scale)
        return np.r_[model.coef_[0], model.intercept_]

    return fn


def logistic_case(n: int, epsilon: float, reps: int, seed: int) -> CoverageRun:
    rng = np.random.default_rng(seed)
    rows = logistic_rows(n, rng)
    study = make_study("gram", LOGISTIC_COLUMNS, "y", n, epsilon)
    cols = FEATURES + [U.CONSTANT, "y"]
    exact = np.column_stack([rows[:, :3], np.ones(n), rows[:, 3]])
    phi_sum = features.gram_features(rows).sum(axis=0)
    first = gram_release(study, phi_sum, n, rng)
    fn = logistic_function(n, float(first.gram_noise_scale))
    target = fn(exact.T @ exact)
    run = CoverageRun(f"gram, n = {n}, epsilon = {epsilon:g}: logistic (Gaussian calibration)",
                      FEATURES + ["intercept"], target)
    for _ in range(reps):
        release = gram_release(study, phi_sum, n, rng)
        m_hat, law = U.moment_law(release, cols)
        theta = fn(m_hat)
        run.add(theta, *U.intervals(theta, U.delta_covariance(fn, m_hat, law), LEVEL))
    return run


HEADER = ("| case | releases | coverage (per coefficient, min - max) | mean se / sd (mean ± sd over "
          "coefficients) | max abs bias / sd | note |\n|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=200, help="releases per case (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and of the simulated noise")
    p.add_argument("--quick", action="store_true", help="only the cases tests/test_uncertainty.py runs")
    args = p.parse_args(argv)
    reps, seed = args.reps, args.seed
    print(HEADER)
    cases = [("gram", 20_000, 1.0, None), ("sketch", 30_000, 4.0, True), ("sketch", 30_000, 4.0, False)]
    if not args.quick:
        cases += [("gram", 2_000, 1.0, None), ("sketch", 50_000, 4.0, True), ("sketch", 50_000, 4.0, False),
                  ("sketch", 100_000, 1.0, True), ("sketch", 50_000, 1.0, True), ("sketch", 50_000, 1.0, False)]
    for kind, n, eps, sign in cases:
        case = linear_case(kind, n, eps, reps, seed, secret_sign=sign)
        print(case.least_squares.row(), flush=True)
        print(case.ridge.row(), flush=True)
        if kind == "sketch":
            print(case.first_order.row(), flush=True)
    sampling = sampling_case(20_000, 1.0, reps, seed)
    sampling.total.note = f"sampling var / noise var = {sampling.sampling_over_noise:.2f}"
    for run in (sampling.total, sampling.noise_only, sampling.sampling_only):
        print(run.row())
    print(logistic_case(20_000, 1.0, reps, seed).row())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
