"""The histogram statistics, logistic regression and least absolute deviations of
conformance/analyses.json recomputed from docs/protocol.md section 6c alone (issue 44, G10): the
noise variance from the study's own sigma, AUC's negatives without "(other)", both Gini
statistics over n (n - 1), Kendall's tau-b and its delta-method standard error, the pooled
variance over n - 2, and LAD's objective without its penalty. Dense matrices and plain numpy:
another implementation of the same text."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from test_conformance import RELEASES, close, release_of, spec_second_moments


def release(name: str):
    vec = next(v for v in RELEASES if v["id"] == name)
    study, _, y = release_of(vec)
    return vec, study, y


def answers(vec) -> dict:
    return {a["id"]: a for a in vec["analyses"]}


# --- the rule for forms (section 6c, "Histograms") ---------------------------------------------

def estimate(c: np.ndarray, v: float, forms: list[tuple[np.ndarray | None, np.ndarray | None, float]]):
    """Each form (K, a, const) -> its debiased value; and a function giving the se of g . q."""
    L = c.size
    values, grads, syms = [], [], []
    for K, a, const in forms:
        K = np.zeros((L, L)) if K is None else K
        a = np.zeros(L) if a is None else a
        ks = (K + K.T) / 2
        values.append(c @ K @ c - v * np.trace(K) + a @ c + const)
        grads.append(2 * ks @ c + a)
        syms.append(ks)
    T = np.array([[np.trace(x @ y) for y in syms] for x in syms])
    H = np.array(grads) @ np.array(grads).T - 4 * v * T

    def se(g) -> float:
        g = np.asarray(g, dtype=float)
        return math.sqrt(v * max(0.0, g @ H @ g) + 2 * v * v * g @ T @ g)

    return np.array(values), se


def interval(value: float, se: float, confidence: float, low=-np.inf, high=np.inf) -> list[float]:
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    return np.clip([value - z * se, value + z * se], low, high).tolist()


def isotonic(x: np.ndarray) -> np.ndarray:
    """Least-squares non-decreasing fit (pool adjacent violators), unit weights."""
    blocks: list[list[float]] = []  # [mean, size]
    for value in x:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return np.concatenate([[m] * int(n) for m, n in blocks])


def test_histogram_statistics_follow_the_text():
    vec, study, y = release("histogram-statistics")
    got = answers(vec)
    n = vec["n_reports"]
    v = n * study.sigma ** 2 + study.n_servers * study.server_sigma ** 2  # the study's own sigma
    score, group = study.histogram.axes
    m1, m2 = len(score.edges) + 1, len(group.categories) + 1
    Y = y.reshape(m1, m2)
    flat = Y.reshape(-1)
    e = np.array(score.edges, dtype=float)
    r = np.concatenate([[e[0]], (e[:-1] + e[1:]) / 2, [e[-1]]])

    view = got["histogram-view"]
    conf = float(view["path"].split("confidence=")[1])  # a GET: the confidence is in the query
    resp, tol = view["response"], view["tolerance"]
    close(resp["noise_variance"], v, 1e-12, 0.0)
    assert resp["noise_variance"] != pytest.approx(n * (study.noise_grid.scale(study.sigma) * study.noise_grid.spacing)
                                                   ** 2 + study.n_servers * study.server_sigma ** 2, rel=1e-12)
    z = NormalDist().inv_cdf(0.5 + conf / 2)
    close(resp["counts"], Y.tolist(), tol["rtol"], tol["atol"])
    close(resp["counts_ci"], np.stack([Y - z * math.sqrt(v), Y + z * math.sqrt(v)], -1).tolist(), tol["rtol"], 1e-6)
    close(resp["proportions"], (Y / n).tolist(), tol["rtol"], tol["atol"])
    u = np.sort(flat)[::-1]
    css = np.cumsum(u) - n
    rho = np.nonzero(u - css / np.arange(1, u.size + 1) > 0)[0][-1]
    close(resp["nonnegative_counts"], np.maximum(flat - css[rho] / (rho + 1), 0).reshape(m1, m2).tolist(),
          tol["rtol"], 1e-6)

    c_score, v_score = Y.sum(axis=1), v * m2  # a column of a joint grid: summed over the other axis
    q = got["quantiles"]
    cdf = np.clip(isotonic(np.cumsum(c_score)[:-1] / n), 0, 1)
    want = []
    for p in q["request"].get("probabilities", [0.25, 0.5, 0.75]):
        j = next((i for i, f in enumerate(cdf) if (f >= p if p > 0 else f > 0)), len(cdf))
        want.append(e[0] if j == 0 else e[-1] if j == len(cdf) else
                    e[j - 1] + (p - cdf[j - 1]) / (cdf[j] - cdf[j - 1]) * (e[j] - e[j - 1]))
    close(q["response"]["cdf"], cdf.tolist(), q["tolerance"]["rtol"], q["tolerance"]["atol"])
    close(q["response"]["quantiles"], want, q["tolerance"]["rtol"], q["tolerance"]["atol"])

    mom = got["moments"]
    (mean, var), se = estimate(c_score, v_score, [(None, r / n, 0.0), (-np.outer(r, r) / n ** 2, r ** 2 / n, 0.0)])
    close(mom["response"]["value"], mean, mom["tolerance"]["rtol"], mom["tolerance"]["atol"])
    close(mom["response"]["se"], se([1, 0]), mom["tolerance"]["rtol"], mom["tolerance"]["atol"])
    close(mom["response"]["details"]["variance"], var, mom["tolerance"]["rtol"], mom["tolerance"]["atol"])
    close(mom["response"]["details"]["variance_se"], se([0, 1]), mom["tolerance"]["rtol"], mom["tolerance"]["atol"])

    kt = got["kendall-tau"]
    S1 = np.sign(np.subtract.outer(np.arange(m1), np.arange(m1))).astype(float)
    S2 = np.sign(np.subtract.outer(np.arange(m2), np.arange(m2))).astype(float)
    J1, J2 = np.ones((m1, m1)), np.ones((m2, m2))
    (C, D1, D2), se = estimate(flat, v, [(np.kron(S1, S2), None, 0.0), (-np.kron(np.eye(m1), J2), None, n * n),
                                         (-np.kron(J1, np.eye(m2)), None, n * n)])
    tau = C / math.sqrt(D1 * D2)
    tau_se = se([1 / math.sqrt(D1 * D2), -tau / (2 * D1), -tau / (2 * D2)])
    tk = kt["tolerance"]
    close(kt["response"]["value"], float(np.clip(tau, -1, 1)), tk["rtol"], tk["atol"])
    close(kt["response"]["se"], tau_se, tk["rtol"], tk["atol"])
    close(kt["response"]["ci"], interval(tau, tau_se, kt["response"]["confidence"], -1, 1), tk["rtol"], tk["atol"])
    close(kt["response"]["details"]["tau_a"], C / (n * (n - 1)), tk["rtol"], tk["atol"])

    auc = got["auc"]
    labels = [*group.categories, "(other)"]
    pos = np.array([lab == auc["request"]["positive"] for lab in labels], dtype=float)
    neg = np.array([lab not in (auc["request"]["positive"], "(other)") for lab in labels], dtype=float)
    M = (np.subtract.outer(np.arange(m1), np.arange(m1)) > 0) + 0.5 * np.eye(m1)
    (U, npos, nneg), se = estimate(flat, v, [(np.kron(M, np.outer(pos, neg)), None, 0.0),
                                             (None, np.kron(np.ones(m1), pos), 0.0),
                                             (None, np.kron(np.ones(m1), neg), 0.0)])
    value = U / (npos * nneg)
    ta = auc["tolerance"]
    close(auc["response"]["value"], value, ta["rtol"], ta["atol"])
    close(auc["response"]["se"], se([1 / (npos * nneg), -value / npos, -value / nneg]), ta["rtol"], ta["atol"])
    close(auc["response"]["details"]["n_negative"], nneg, ta["rtol"], ta["atol"])
    with_other = np.kron(np.ones(m1), 1 - pos) @ flat  # "(other)" counted as negative: another answer
    assert abs(with_other - auc["response"]["details"]["n_negative"]) > 100 * ta["atol"] + 1.0

    gmd = got["gini-mean-difference"]
    D = np.abs(np.subtract.outer(r, r))
    (g,), se = estimate(c_score, v_score, [(D / (n * (n - 1)), None, 0.0)])
    close(gmd["response"]["value"], max(g, 0.0), gmd["tolerance"]["rtol"], gmd["tolerance"]["atol"])
    close(gmd["response"]["se"], se([1]), gmd["tolerance"]["rtol"], gmd["tolerance"]["atol"])
    assert abs(g * (n - 1) / n - gmd["response"]["value"]) > gmd["tolerance"]["rtol"] * g  # not over n^2

    gs = got["gini-simpson"]
    c_group, v_group = Y.sum(axis=0), v * m1
    (Q,), se = estimate(c_group, v_group, [(np.eye(m2), None, 0.0)])
    diversity = 1 - (Q - n) / (n * (n - 1))
    close(gs["response"]["value"], diversity, gs["tolerance"]["rtol"], gs["tolerance"]["atol"])
    close(gs["response"]["se"], se([1]) / (n * (n - 1)), gs["tolerance"]["rtol"], gs["tolerance"]["atol"])
    var_q = v_group * max(0.0, 4 * c_group @ c_group - 4 * v_group * m2) + 2 * v_group ** 2 * m2
    close(se([1]), math.sqrt(var_q), 1e-12, 0.0)


def floored_solve(A: np.ndarray, b: np.ndarray, tau: float) -> np.ndarray:
    w, V = np.linalg.eigh((A + A.T) / 2)
    return V @ ((V.T @ b) / np.maximum(w, tau))


def test_logistic_follows_the_text():
    vec, study, y = release("gram-regression-logistic")
    n, d = vec["n_reports"], study.d
    G, tau, _ = spec_second_moments(study, y, n, True)
    row_sum = y.reshape(-1)[:d]
    cols = study.columns
    F = [cols.index(c) for c in cols if c != "y"]
    li = cols.index("y")
    for an in (a for a in vec["analyses"] if a["path"].endswith("/logistic")):
        req, resp, tol = an["request"], an["response"], an["tolerance"]
        c0, c1 = req.get("classes", [0.0, 1.0])
        sF = row_sum[F]
        Gaug = np.block([[np.array([[n]]), sF[None, :]], [sF[:, None], G[np.ix_(F, F)]]])
        P = np.diag([0.0] + [1.0] * len(F))
        x1 = np.concatenate([[n], sF])
        xy = np.concatenate([[row_sum[li]], G[F, li]])
        rhs = 2 * (2 * xy - (c0 + c1) * x1) / (c1 - c0)
        alpha = req.get("alpha")
        if alpha is None:
            alpha = max(0.0, tau - float(np.linalg.eigvalsh((Gaug + Gaug.T) / 2)[0]))
        beta = floored_solve(Gaug + alpha * P, rhs, tau)
        b, coef, calibration = beta[0], beta[1:], "taylor"
        if req.get("calibration", "gaussian") == "gaussian":
            R = (Gaug + alpha * P + (Gaug + alpha * P).T) / 2
            w, V = np.linalg.eigh(R)
            R = (V * np.maximum(w, tau)) @ V.T
            u = beta[1:]
            n1 = (row_sum[li] - c0 * n) / (c1 - c0)
            n0 = n - n1
            s1 = u @ (G[F, li] - c0 * sF) / (c1 - c0)
            m1, m0 = s1 / n1, (u @ sF - s1) / n0
            pooled = (u @ R[1:, 1:] @ u - n1 * m1 ** 2 - n0 * m0 ** 2) / (n - 2)
            assert 1 <= n1 <= n - 1 and pooled > 0 and m1 > m0
            slope = (m1 - m0) / pooled
            b, coef, calibration = math.log(n1 / n0) - slope * (m1 + m0) / 2, slope * u, "gaussian"
            wrong = (u @ R[1:, 1:] @ u - n1 * m1 ** 2 - n0 * m0 ** 2) / n  # over n, not n - 2: another slope
            assert abs((m1 - m0) / wrong * np.linalg.norm(u) - np.linalg.norm(resp["coef"])) > tol["rtol"] * 10
        assert resp["calibration"] == calibration
        close(resp["alpha"], alpha, tol["rtol"], tol["atol"])
        close(resp["coef"], coef.tolist(), tol["rtol"], tol["atol"])
        close(resp["intercept"], float(b), tol["rtol"], tol["atol"])


def test_lad_objective_is_the_weighted_sum_without_the_penalty():
    vec, study, y = release("l1-lad")
    s, shape = study.s, study.l1
    b = shape.branching
    weights = [1.0 / s] * (s * shape.level0_buckets)
    for h in range(1, shape.levels + 1):
        weights += [1.0 / (b ** -h - b ** -(h + 1))] * shape.buckets
    w = np.array(weights)
    cols = study.columns
    li = cols.index(study.label)
    F = [cols.index(c) for c in cols if c != study.label]
    penalised = 0
    for an in (a for a in vec["analyses"] if a["path"].endswith("/lad")):
        resp, tol = an["response"], an["tolerance"]
        coef = np.array(resp["coef"])
        objective = float(np.sum(w * np.abs(y[:, li] - y[:, F] @ coef)))
        close(resp["objective"], objective, tol["rtol"], tol["atol"])
        alpha = an["request"].get("alpha", 0.0)
        if alpha:
            penalised += 1
            assert objective + alpha * np.abs(coef).sum() > resp["objective"] * (1 + 100 * tol["rtol"])
    assert penalised == 1
