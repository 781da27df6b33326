"""Validity studies at epsilon = the floor (docs/validity.md section 14): no client noise
(sigma = 0), the grid from the servers' noise and max_reports (validity.floor_grid), t = 0 in
the predicate. For every kind that takes proofs: design() gives such a study, its grid is the
coarsest with max_reports h / 2 <= (a server's smallest noise) / 16, the discrete-noise argument
covers it and the accounting still meets the floor, the plan's bound is B / h with no noise
allowance, every honest row (rows at the bound included) is inside, deterministically, and a
vector one step beyond the bound is refused by the summed verifier. In process; the round over
real servers is tests/test_validity_floor_e2e.py."""

import math

import numpy as np
import pytest

from dpsketch.client_sdk import prepare
from dpsketch.protocol import features, flp, report as report_path, study as S, validity as V
from dpsketch.protocol.keystream import Keystream

SERVERS = ["s1", "s2", "s3"]
COLUMNS = ["a", "b", "c"]
HIST = {"axes": [{"column": "a", "edges": [0.5]}, {"column": "b", "edges": [0.5, 1.5]}]}
KINDS = {
    "sketch": dict(columns=COLUMNS, label="c"),
    "parties": dict(columns=[], label="c", parties=[{"name": "p", "columns": ["a"]}, {"name": "q", "columns": ["b", "c"]}]),
    "histogram": dict(kind="histogram", histogram=HIST, columns=[], label=None),
    "gram": dict(kind="gram", columns=COLUMNS, label="c"),
    "moments": dict(kind="moments", columns=COLUMNS, label="c"),
    "l1": dict(kind="l1", columns=COLUMNS, label="c"),
}


def floor_study(kind: str, expected: int = 10_000) -> S.Study:
    return S.design(name=f"floor-{kind}", servers=SERVERS, expected_reports=expected, epsilon=4.0,
                    validity=True, **KINDS[kind])[0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_design_at_the_floor_gives_a_validity_study_without_client_noise(kind):
    st = floor_study(kind)
    assert st.validity == V.PREDICATE and st.sigma == 0 and st.server_sigma > 0
    assert st.epsilon == st.epsilon_floor == 4.0
    # the servers' noise meets the floor for the noise really drawn on this grid (the argument's
    # rounding radius taken out of their variance: validity.widened_server_sigma)
    arg = st.discrete_argument
    assert arg.covered and arg.client_std == 0 and arg.server_std >= st.server_noise_std
    assert st.report_epsilon(1.0) <= st.epsilon_floor and st.guarantees()["epsilon"] <= st.epsilon
    # the grid: the coarsest of its kind with max_reports h / 2 <= (the smallest server noise) / 16
    gram = kind in ("gram", "moments")
    smallest = st.server_noise_std * (features.UPPER_SCALE if gram else 1.0)
    h = st.noise_grid.spacing
    assert st.max_reports * h / 2 <= smallest / V.FLOOR_BIAS < st.max_reports * h * (4 if gram else 2) / 2
    assert st.noise_grid == V.floor_grid(smallest, st.max_reports, st.frac_bits, gram)
    # so the clip bound gives up almost nothing (a grid of 64 steps per server noise would cost 2%)
    assert st.clip_bound > (1 - 1e-5) * st.row_bound
    # t = 0: no noise allowance, R = B / h (a histogram's one-hot cell is proved exactly: R = 0)
    for j, plan in enumerate(V.plans(st)):
        if gram:
            r2_row, r2 = V.gram_bounds(kind, st.row_width, st.row_bound, st.noise_grid, 0.0)
            assert (plan.circuit.r2_row, plan.circuit.r2) == (r2_row, r2)
        else:
            bound = (0.0 if kind == "histogram" else
                     st.parties[j].row_bound if st.parties else st.row_bound)
            assert plan.bound == math.ceil((bound / h) ** 2)


@pytest.mark.parametrize("kind", ["sketch", "gram", "histogram"])
def test_the_servers_noise_is_widened_for_the_grids_rounding_radius(kind, monkeypatch):
    """The argument keeps tau_c^2 - r^2 of a server's variance (Study.mechanism); widened, what
    it keeps is at least the calibrated server_sigma (what design() gives without the widening),
    for a relative cost below 10^-5 at max_reports = 1,000 (r / tau about 1/500 there)."""
    st = floor_study(kind, expected=100)
    assert st.max_reports == 1000
    with monkeypatch.context() as m:
        m.setattr(V, "widened_server_sigma", lambda sigma, *args, **kwargs: sigma)
        calibrated = floor_study(kind, expected=100).server_sigma
    assert calibrated < st.server_sigma < calibrated * (1 + 1e-5)
    assert st.mechanism.server_sigma >= calibrated
    assert st.report_epsilon(1.0) <= st.epsilon_floor


@pytest.mark.parametrize("kind", ["sketch", "l1", "gram", "moments", "histogram"])
def test_honest_rows_at_the_bound_prove_and_verify_and_one_step_beyond_is_refused(kind):
    st = floor_study(kind)
    plan = V.plan(st)
    rng = np.random.default_rng(4)
    stream = Keystream.from_key(b"\x11" * 32)
    if kind == "histogram":
        values = np.column_stack([rng.uniform(0, 1, 200), rng.uniform(0, 2, 200)])
        onehot = st.histogram.one_hot(st.histogram.cell_index(values))
        encoded = report_path.privatize_encoded(values, st, stream)
        units = V.grid_units(plan, encoded) - plan.circuit.unit * onehot.astype(np.int64)
        assert not units.any()  # no client noise: the vector is its cells exactly
        proved = V.prepare(st, encoded, stream, onehot=onehot)
    else:
        rows = rng.normal(size=(200, st.d))
        rows[:100] /= np.linalg.norm(rows[:100], axis=1, keepdims=True)  # at the bound B = 1
        rows[100:] *= 5.0  # beyond it: clipped to it
        if kind in ("gram", "moments"):
            clipped = report_path.clipped_rows(rows, st)
            encoded = report_path.noisy_encoded(features.client_vectors(kind, clipped), st, stream)
            proved = V.prepare(st, encoded, stream, rows=clipped)
        else:
            vectors = (prepare.signed_vectors(rows, st, stream) if st.secret_sign
                       else report_path.clipped_rows(rows, st))
            encoded = report_path.noisy_encoded(vectors, st, stream)
            units = V.grid_units(plan, encoded)
            # no noise: the shared vector is the clipped row rounded to the grid, norm within B / h
            np.testing.assert_allclose(units * st.noise_grid.spacing, vectors, atol=st.noise_grid.spacing / 2)
            assert (np.einsum("ij,ij->i", units.astype(float), units.astype(float)) <= plan.bound).all()
            proved = V.prepare(st, encoded, stream)
    views = [V.server_shares(plan, proved.leader if s is None else s, s is not None) for s in proved.seeds]
    seed = b"\x05" * 32
    total = flp.reconstruct([V.verifier_shares(plan, seed, proved.report_ids, x, p) for x, p in views])
    assert V.decide(plan, proved.report_ids, total).all()
    if kind in ("sketch", "l1"):
        # one grid step beyond R in one coordinate: outside the predicate, refused even with a
        # proof the honest prover makes for its digits
        r = math.isqrt(plan.bound)
        u = np.zeros((1, plan.w), dtype=np.int64)
        u[0, 0] = r + 1
        assert not V.within(plan, u).all()
        with pytest.raises(V.ValidityError):
            V.prepare(st, (u << plan.shift).view(np.uint64), stream)


def test_without_any_noise_a_validity_study_is_refused():
    st = floor_study("sketch")
    with pytest.raises(ValueError, match="needs noise"):
        V.check_study(st.model_copy(update={"server_sigma": 0.0}))


@pytest.mark.parametrize("kind", ["sketch", "gram"])
def test_the_floor_grid_stops_at_2_to_the_20_steps(kind):
    """From max_reports = 2^17 on the bias rule would ask for more than 2^20 steps per server
    noise, more digits than F_p holds the norm of at a wide study: the grid stops there (between
    2^20 and 2^21 steps, 2^22 for a grid 4^-m), and a study of 10^7 expected reports is designed."""
    st = floor_study(kind, expected=10 ** 7)
    smallest = st.server_noise_std * (features.UPPER_SCALE if kind == "gram" else 1.0)
    steps = smallest / st.noise_grid.spacing
    assert 2 ** 20 <= steps < 2 ** (22 if kind == "gram" else 21)
    assert st.max_reports * st.noise_grid.spacing / 2 > smallest / V.FLOOR_BIAS  # the rule gave way
    assert V.plan(st).input_len > 0 and st.report_epsilon(1.0) <= st.epsilon_floor


def test_party_blocks_at_their_bounds_prove_and_verify():
    """A study with parties at the floor: each party's blocks clipped to a hair under B_j (half a
    grid diagonal: the rounded block is within B_j) and rounded, no noise, verify under the
    party's plan R_j = B_j / h, for blocks at and beyond B_j; one step beyond R_j is refused."""
    from dpsketch.protocol import parties

    st = floor_study("parties")
    rng = np.random.default_rng(9)
    key = parties.new_key()
    ids = parties.pseudonyms(key, st.study_id, [f"p{i}" for i in range(120)])
    signs = parties.signs(key, st.study_id, ids) if st.secret_sign else None
    for index, declared in enumerate(st.parties):
        plan = V.party_plan(st, index)
        assert plan.bound == math.ceil((declared.row_bound / st.noise_grid.spacing) ** 2)
        rows = rng.normal(size=(120, declared.width))
        rows *= (declared.row_bound * np.resize([1.0, 4.0], 120) / np.linalg.norm(rows, axis=1))[:, None]
        blocks = report_path.block_vectors(st, declared.name, rows, signs)
        encoded = report_path.noisy_encoded(blocks, st, Keystream.from_key(bytes([index]) * 32))
        units = V.grid_units(plan, encoded)
        assert V.within(plan, units).all()
        proved = V.prepare(st, encoded, Keystream.from_key(b"\x22" * 32), party=index, pseudonyms=ids)
        views = [V.server_shares(plan, proved.leader if s is None else s, s is not None) for s in proved.seeds]
        total = flp.reconstruct([V.verifier_shares(plan, b"\x06" * 32, proved.report_ids, x, p) for x, p in views])
        assert V.decide(plan, proved.report_ids, total).all()
        beyond = np.zeros((1, plan.w), dtype=np.int64)
        beyond[0, 0] = math.isqrt(plan.bound) + 1
        assert not V.within(plan, beyond).all()
