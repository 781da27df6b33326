"""A validity study at epsilon = the floor over real processes (docs/validity.md section 14):
three share servers with their default policy (a floor of 4 required) and a real analyzer,
uvicorn on loopback ports, SQLite files. The study has no client noise (sigma = 0): the SDK's
clients share their clipped rows rounded to the grid (from the servers' noise), proved with
t = 0; the servers' floor noise carries the whole guarantee.

* 300 honest reports through the SDK, a third of them rows at the bound and a third beyond it
  (clipped to it): none refused at any server.
* The issue's attack (one coordinate at 40,000 times R, the norm equation made to hold in F_p,
  proved by the honest prover code on its digits, correctly bound so every server stores it):
  refused at every server.
* The release is the exact sketch of the honest reports' shares plus the three servers' floor
  noise: that residual has the standard deviation sqrt(3) server_sigma the study promises (and
  nothing of the attack, 40,000 bounds away), and the analyzer counts 300 reports.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.client_sdk.client import DataLimitedWarning
from dpsketch.protocol import Study, field, ring, sketch
from dpsketch.protocol import validity as V
from dpsketch.protocol.circuits import to_digits
from dpsketch.protocol.keystream import Keystream
from studies import record_batches
from test_validity_e2e import encoded_vectors, ring_sketch
from test_validity_round_attacks import prove_inputs, upload

COLUMNS = ["x0", "x1", "x2", "y"]


def rows_with_bound(n: int, seed: int) -> np.ndarray:
    """n rows: a third inside the unit ball, a third on its sphere (the bound B = 1), a third at
    3 B (each clipped to the bound by its client)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(COLUMNS)))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    scale = np.resize([0.5, 1.0, 3.0], n)
    return x * scale[:, None]


def far_attack(study: Study, stream: Keystream) -> V.Proved:
    """The issue's attack on a study at the floor: coordinate 0 at 40,000 R (R = B / h: the
    bound with t = 0), the norm equation made to hold in F_p by an out-of-range digit and the
    slack, proved by the honest prover on those digits, bound as a client binds."""
    c = V.plan(study).circuit
    w, q = c.w, c.q
    r = int(c.r2 ** 0.5)
    zero = to_digits(np.full((1, w), c.half, dtype=np.uint64), c.beta, q)[0]
    far = np.zeros((1, c.input_len), dtype=np.uint64)
    far[0, :w * q] = zero
    far[0, 0] = (int(zero[0]) + 40_000 * r) % field.P
    far[0, w * q] = (c.r2 - (40_000 * r) ** 2) % field.P
    return prove_inputs(study, far, 0, stream)


def test_floor_study_refuses_no_honest_report_and_every_server_refuses_the_attack(shared_cluster, monkeypatch):
    c = shared_cluster
    n = 300
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        # min_reports 0.9 n (design()'s default ratio), not n: the sketch seed and the report ids
        # are fresh each run, and at exactly min_reports = 300 (18.75 reports a row) the
        # certificate refused 3 of 1000 simulated draws (lambda_min / lambda_star 0.95-1.55); with
        # 300 reports against min_reports 270, 0 of 2000 (1.10 at worst, 1.39 +- 0.07)
        view = an.create_study(name="floor-validity", columns=COLUMNS, label="y", expected_reports=n,
                               k=16, s=4, min_reports=n * 9 // 10, epsilon=4.0, validity=True)
    study = Study.model_validate(view["study"])
    assert study.validity == V.PREDICATE and study.sigma == 0 and study.server_sigma > 0
    assert study.epsilon == study.epsilon_floor == 4.0
    plan = V.plan(study)
    h = study.noise_grid.spacing
    assert plan.bound == int(np.ceil((study.row_bound / h) ** 2))  # t = 0: R = B / h

    rows = rows_with_bound(n, seed=21)
    sent = record_batches(monkeypatch)
    with Client(c.server_urls) as client, pytest.warns(DataLimitedWarning, match="200 rows"):
        assert client.submit_many(study.study_id, rows, batch_size=100).n_reports == n
    # what the clients shared: their clipped rows (times a secret sign) rounded to the grid, no noise
    vectors = ring.decode(np.concatenate([encoded_vectors(study, b) for b in sent]), study.frac_bits)
    norms = np.linalg.norm(vectors, axis=1)
    assert np.all(norms <= study.row_bound) and np.sum(norms > 0.999 * study.row_bound) >= 2 * n // 3 - 1
    clipped = rows * np.minimum(1.0, study.clip_bound / np.linalg.norm(rows, axis=1))[:, None]
    np.testing.assert_allclose(np.abs(vectors), np.abs(clipped), rtol=0, atol=h / 2 * (1 + 1e-9))

    attack = far_attack(study, Keystream.from_key(b"\xa7" * 32))
    upload(c, study, attack)
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        fin = an.finalize(study.study_id)
        served = np.array(an.sketch(study.study_id)["sketch"])
    assert fin["state"] == "released" and fin["n_reports"] == n
    v = fin["verification"]
    assert v["decided"] == n + 1 and v["refused"] == 1
    assert v["refused_by_server"] == {"s1": 1, "s2": 1, "s3": 1}
    assert not set(attack.report_ids) & {rid for b in sent for rid in b.report_ids}

    # the release less the exact sketch of the honest shares: the three servers' floor noise alone
    exact = ring.decode(ring_sketch(study, sent), study.frac_bits) * sketch.scale(study.s)
    residual = (served - exact).reshape(-1)
    expected_sd = np.sqrt(study.n_servers) * study.server_sigma
    # sum(residual^2) / sd^2 is chi-square with 64 degrees of freedom (the noise has mean 0):
    # bounds at 1e-6 each side, a false alarm in 2e-6 of runs (2 of 10^6 simulated; the sd read
    # within 0.61-1.44 of its value). The former std within 30 % was 3.3 of its own sd: 626 of
    # 10^6 simulated draws of 64 cells failed it; the mean within 4 se: 59 of 10^6, now 5 se.
    energy = float(np.sum(residual ** 2)) / expected_sd ** 2
    assert stats.chi2.ppf(1e-6, residual.size) < energy < stats.chi2.isf(1e-6, residual.size), (
        energy, residual.size)
    assert abs(residual.mean()) < 5 * expected_sd / np.sqrt(residual.size)
    assert np.abs(residual).max() < 6 * expected_sd  # the attack (40,000 bounds) is not in it
