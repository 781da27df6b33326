"""The release certificate at its boundary, with t > 0 colluding clients (issue 47).

A server releases its share only if lambda_min(S S^T) - t >= lambda_star over exactly the
inclusion set (DESIGN.md, "Noise calibration"; ``privacy.Certificate``). A test that checks only
a comfortable margin or a hopeless spectrum leaves two one-line mutants alive that break privacy:
the certificate ignoring t (so t Sybil clients eat the honest reports' lambda) and a margin of
-1 accepted (one report short of the calibration). So every test here puts a set on each side of
the boundary, with its margin in [-1, 0) on the refused side, and t = 3 so that forgetting t moves
a refused set well inside the accepted side.

The lambda_min every assertion is compared with is recomputed from the dense S of the protocol's
hash over exactly the set (``sketch.dense_matrix`` + numpy's eigvalsh), not from the server's
running totals. The l1 sketch's leverage certificate is checked against a brute force over every
coalition of t colluders.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dpsketch.protocol import l1sketch, privacy, sketch
from dpsketch.protocol.study import Study, design
from test_server_unit import Server, assert_problem, make_study

T = 3


def _lambda_min(study: Study, ids) -> float:
    dense = sketch.dense_matrix(study.seed_bytes, list(ids), study.k, study.s)
    return float(np.linalg.eigvalsh(dense @ dense.T)[0])


def with_lambda_star(study: Study, lambda_star: float) -> Study:
    """The same study asking for a larger lambda_star (its noise then over-delivers epsilon, which
    the study's own validation accepts): a boundary a test can place where it wants."""
    data = study.model_dump()
    data["lambda_star"] = float(lambda_star)
    return Study.model_validate(data)


# --- privacy.Certificate: the rule itself -----------------------------------------------------


@pytest.mark.parametrize("lambda_min,t,lambda_star,ok", [
    (100.0, T, 97.0, True),  # margin exactly 0: released
    (100.0, T, 96.5, True),  # just above
    (100.0, T, 97.5, False),  # just below: margin -0.5; ignoring t would give +2.5
    (100.0, T, 98.0, False),  # margin exactly -1
    (100.0, T, 97.0 + 1e-9, False),  # the smallest shortfall
    (100.0, 0, 100.0, True),
    (100.0, 0, 100.0 + 1e-9, False),
    (5.0, 5, 1.0, False),  # t alone eats the spectrum
])
def test_certificate_is_lambda_min_minus_t_at_least_lambda_star(lambda_min, t, lambda_star, ok):
    cert = privacy.Certificate(n_reports=1000, lambda_min=lambda_min, t=t, lambda_star=lambda_star)
    assert cert.margin == pytest.approx(lambda_min - t - lambda_star, abs=1e-12)
    assert cert.ok is ok


def test_certify_reads_lambda_min_of_the_scaled_gram_and_subtracts_t():
    """certify() takes s S S^T in integers (what servers keep) and divides by s; the margin it
    returns straddles 0 exactly where lambda_min - t crosses lambda_star."""
    study = make_study(t=T)
    rng = np.random.default_rng(47)
    ids = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(150)]
    rows, signs = study.hash_report_ids(ids)
    gram = np.zeros((study.k, study.k), dtype=np.int64)
    sketch.accumulate_gram(gram, rows, signs, +1)
    lam = _lambda_min(study, ids)
    assert privacy.lambda_min_of_gram(gram, study.s) == pytest.approx(lam, rel=1e-12)
    for star, ok in ((lam - T - 0.01, True), (lam - T + 0.01, False), (lam - T + 0.99, False)):
        cert = privacy.certify(gram, study.s, len(ids), T, star)
        assert (cert.lambda_min, cert.t, cert.lambda_star, cert.n_reports) == (pytest.approx(lam), T, star, 150)
        assert cert.ok is ok, (lam, star)
        via_study = privacy.certify_study(with_lambda_star(study, max(star, study.lambda_star)), gram, ids)
        if star >= study.lambda_star:
            assert via_study.ok is ok and via_study.t == T


# --- the share server: a set on each side of the boundary ------------------------------------


def _straddle(study: Study, ids: list[bytes]) -> tuple[int, float, float]:
    """The smallest prefix length n whose margin is >= 0 (removing a report only lowers
    lambda_min, by at most 1: its column has unit norm), with the margins at n - 1 and n."""
    margins = {}

    def margin(n):
        if n not in margins:
            margins[n] = _lambda_min(study, ids[:n]) - study.t - study.lambda_star
        return margins[n]

    lo, hi = study.min_reports, len(ids)  # margin(lo) < 0 <= margin(hi)
    assert margin(lo) < 0 <= margin(hi), (margin(lo), margin(hi))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if margin(mid) < 0 else (lo, mid)
    return hi, margin(hi - 1), margin(hi)


def test_server_releases_just_above_and_refuses_just_below_lambda_min_minus_t(tmp_path):
    """t = 3, lambda_star placed inside the range the uploads span: the largest refused prefix has
    margin in [-1, 0) (so both 'ignore t' and 'accept -1' would release it) and is refused with
    the lambda_min the dense S gives; one more report certifies and is released with its margin."""
    base = make_study(t=T)
    study = with_lambda_star(base, 9.0)
    srv = Server(tmp_path / "cert.db", max_excluded_fraction=1.0)
    try:
        assert srv.provision(study).status_code == 201
        rs = srv.reports(study, 220)
        assert srv.batch(study, rs).status_code == 200
        n, below, above = _straddle(study, rs.ids)
        assert -1.0 <= below < 0.0 <= above, (below, above)
        body = assert_problem(srv.commit(study, rs.ids[:n - 1]), 422, "certificate-refused")
        assert body["lambda_min"] == pytest.approx(below + T + study.lambda_star, rel=1e-9)
        assert body["lambda_star"] == study.lambda_star and body["n_reports"] == n - 1
        assert "lambda_min - t =" in body["detail"] and "leverage" not in body["detail"]
        assert srv.client.get(f"/v1/studies/{study.study_id}").json()["status"] == "open"
        r = srv.commit(study, rs.ids[:n])
        assert r.status_code == 200, r.text
        result = r.json()
        assert result["t"] == T and result["n_reports"] == n
        assert result["margin"] == pytest.approx(above, rel=1e-9, abs=1e-9)
        assert result["lambda_min"] == pytest.approx(above + T + study.lambda_star, rel=1e-9)
    finally:
        srv.close()


def test_server_refuses_a_margin_of_minus_one_exactly_at_the_boundary_of_t(tmp_path):
    """A set whose lambda_min - lambda_star lies in [0, t): released if t were ignored, refused
    by the certificate (margin in [-t, 0))."""
    study = with_lambda_star(make_study(t=T), 9.0)
    srv = Server(tmp_path / "cert-t.db", max_excluded_fraction=1.0)
    try:
        assert srv.provision(study).status_code == 201
        rs = srv.reports(study, 220)
        assert srv.batch(study, rs).status_code == 200
        # the largest prefix with lambda_min - lambda_star in [0, t) - well inside the t band
        lengths = range(len(rs), study.min_reports - 1, -1)
        margins = {n: _lambda_min(study, rs.ids[:n]) - study.lambda_star for n in lengths}
        inside = [n for n in lengths if 0.5 <= margins[n] < T - 0.5]
        assert inside, margins
        n = inside[0]
        body = assert_problem(srv.commit(study, rs.ids[:n]), 422, "certificate-refused")
        assert body["lambda_min"] - T < study.lambda_star <= body["lambda_min"]
    finally:
        srv.close()


# --- the l1 sketch's leverage certificate --------------------------------------------------


def test_l1_leverage_bound_covers_every_coalition_of_t():
    """For the l1 sketch a server certifies every report's leverage over any honest subset missing
    t reports: the bound it computes (``l1sketch.leverages`` with t) must never be below the true
    worst leverage S_i^T (S_H S_H^T)^+ S_i over the coalitions. Brute force over all coalitions of
    t = 1 and 2 among 80 reports of a small l1 sketch (k = 6)."""
    spec = l1sketch.L1Spec(s=2, level0_buckets=2, levels=1, buckets=2)
    rng = np.random.default_rng(3)
    ids = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(80)]
    rows, signs = l1sketch.hash_report_ids(bytes(32), ids, spec)
    m = len(ids)
    dense = np.zeros((spec.k, m))
    for a in range(rows.shape[1]):
        np.add.at(dense, (rows[:, a], np.arange(m)), signs[:, a].astype(float))
    for t in (1, 2):
        bound = l1sketch.leverages(rows, signs, spec.k, t)
        assert np.isfinite(bound).all(), bound
        worst = np.zeros(m)
        for coalition in itertools.combinations(range(m), t):
            honest = np.setdiff1d(np.arange(m), coalition)
            sh = dense[:, honest]
            pinv = np.linalg.pinv(sh @ sh.T)
            lev = np.einsum("ki,kl,li->i", sh, pinv, sh)
            worst[honest] = np.maximum(worst[honest], lev)
        assert (worst <= bound * (1 + 1e-9)).all(), (t, worst - bound)
        # a coalition does raise some leverage above the full set's: t must be in the bound
        assert worst.max() > l1sketch.leverages(rows, signs, spec.k, 0).max() * 1.05


def test_l1_certificate_margin_straddles_one_over_the_worst_leverage():
    """An l1 study's certificate carries lambda_min = 1 / (largest leverage bound, t included)
    and t = 0: released at lambda_star just under it, refused just over."""
    study = design(name="l1", columns=["a", "b"], label=None, servers=["s1", "s2"], kind="l1",
                   expected_reports=10_000, epsilon_floor=None, t=1)[0]
    rng = np.random.default_rng(4)
    ids = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(3000)]
    rows, signs = study.hash_report_ids(ids)
    gram = l1sketch.gram(rows, signs, study.k)
    worst = float(l1sketch.leverages(rows, signs, study.k, study.t, M=gram).max())
    without_t = float(l1sketch.leverages(rows, signs, study.k, 0, M=gram).max())
    assert math.isfinite(worst) and worst > without_t * 1.01  # t = 1 costs something here
    for star, ok in ((0.999 / worst, True), (1.001 / worst, False), (0.999 / without_t, False)):
        fake = study.model_copy(update={"lambda_star": star})
        cert = privacy.certify_study(fake, gram, ids)
        assert cert.t == 0 and cert.lambda_min == pytest.approx(1 / worst, rel=1e-9)
        assert cert.ok is ok, (star, worst, without_t)
