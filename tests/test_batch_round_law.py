"""What the analyzer learns from a batch's verifier messages (docs/protocol.md section 6d): the
same law whatever the honest rows.

The analyzer sees every server's verifier share of a batch at the round's query point. For an
honest batch the shares are uniform given their sum, and the sum is (0, f(t), G(f(t))) with f(t)
the proof's masked wire polynomials at a uniform point (docs/validity.md sections 6 and 15): so
for two batches of different rows the analyzer's view has one law. Measured here on the core's
own prover and verifier (batch_validity) for two row sets, one of small rows and one at the bound,
over fresh proofs at one query point: each element of the sum is either the same constant for
both (the v = 0 outputs) or uniform for both, and each server's share element is uniform for both
(chi-square on the top 3 bits, 8 cells, and a two-sample chi-square between the sets; every test
at 1e-8: about 1,100 tests, 1.1e-5 a run).
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from dpsketch.protocol import batch_validity as bv
from dpsketch.protocol import field, validity
from dpsketch.protocol.keystream import Keystream

N = 3
R = 1000
QUERY = validity.query_seed("law-study", [bytes([j]) * 32 for j in range(N)])
ROWS = {"small": np.array([[10, 20, 30, 40], [0, 0, 0, 0], [-5, 0, 5, 0]]),
        "at the bound": np.array([[R, 0, 0, 0], [0, -600, 800, 0], [500, 500, 500, 500]])}
DRAWS = 150
ALPHA = 1e-8


def _views(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DRAWS fresh proofs of ``rows``: every server's verifier share (DRAWS, N, V, 2) and their
    sum (DRAWS, V, 2), at the one query point."""
    plan = bv.batch_plan(len(rows), rows.shape[1], R * R, 0, N)
    shares = []
    for _ in range(DRAWS):
        b = bv.prove(plan, rows, Keystream())
        views = [bv.receive(plan, j, b.payload(j), b.parts, b.digits_part, b.leader) for j in range(N)]
        shares.append([bv.verifier_share(plan, v, QUERY) for v in views])
    arr = np.asarray(shares, dtype=np.uint64)
    total = arr[:, 0]
    for j in range(1, N):
        total = field.add(total, arr[:, j])
    return arr, total


def _cells(values: np.ndarray) -> np.ndarray:
    """Counts of the top 3 bits of F_p elements (p just under 2^64: each cell has mass 1/8 to
    within 2^-32)."""
    return np.bincount((values >> np.uint64(61)).astype(np.int64), minlength=8)


def _uniform(values: np.ndarray) -> bool:
    return stats.chisquare(_cells(values)).pvalue > ALPHA


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return stats.chi2_contingency(np.vstack([_cells(a), _cells(b)]) + 0)[1] > ALPHA


def test_the_analyzers_view_of_a_batch_is_the_same_in_law_for_different_rows():
    (shares_a, total_a), (shares_b, total_b) = (_views(rows) for rows in ROWS.values())
    v_len = total_a.shape[1]
    constant = 0
    for i in range(v_len):
        for part in range(2):
            a, b = total_a[:, i, part], total_b[:, i, part]
            if len(set(a.tolist())) == 1 or len(set(b.tolist())) == 1:  # a fixed output: the same for both
                assert set(a.tolist()) == set(b.tolist()) == {0}, (i, part)
                constant += 1
            else:
                assert _uniform(a) and _uniform(b) and _same(a, b), (i, part)
            for j in range(N):  # one server's share: uniform whatever the rows
                sa, sb = shares_a[:, j, i, part], shares_b[:, j, i, part]
                assert _uniform(sa) and _uniform(sb) and _same(sa, sb), (i, part, j)
    assert 0 < constant < 2 * v_len  # the v = 0 outputs are there, and not everything is fixed
