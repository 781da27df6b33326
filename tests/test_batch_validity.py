"""Batch proofs with wrap-around checks (docs/validity.md section 15): honest batches at and near
the bound are accepted, and every forgery below is refused at decide, each attacked the way a
client would try it (the norm equation made to hold in F_p, so that only the wrap-around checks
stand in the way); the measured soundness of the wrap-around checks against their bound; the
servers' F_p aggregate against the exact integer sums."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from scipy import stats

from dpsketch.protocol import batch_circuit, batch_validity as bv, field, flp, validity, wraparound
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.study import design

P = field.P
N = 3
QUERY = validity.query_seed("test-study", [bytes([j]) * 32 for j in range(N)])
R2 = 1000 ** 2
#: sqrt(-1) in F_p: 7 generates F_p^*, so 7^((p - 1) / 4) squares to 7^((p - 1) / 2) = -1
I = pow(7, (P - 1) // 4, P)


def _stream(label: str) -> Keystream:
    return Keystream.from_key(hashlib.sha256(label.encode()).digest())


def _plan(m: int, w: int, r2: int = R2, reps: int = wraparound.REPETITIONS) -> bv.BatchPlan:
    return bv.batch_plan(m, w, r2, 0, N, reps)


def _views(plan: bv.BatchPlan, batch: bv.ProvedBatch, parts=None):
    parts = batch.parts if parts is None else parts
    return [bv.receive(plan, j, batch.payload(j), parts[j] if isinstance(parts[0], list) else parts,
                       batch.digits_part, batch.leader) for j in range(N)]


def _accepted(plan: bv.BatchPlan, batch: bv.ProvedBatch, views=None) -> bool:
    views = _views(plan, batch) if views is None else views
    return bv.decide(plan, [(v.batch_id, bv.verifier_share(plan, v, QUERY)) for v in views])


def _parts_of_decision(plan: bv.BatchPlan, batch: bv.ProvedBatch) -> dict:
    """Which part of the FLP decision refuses: the gadget identities, or the combined checks."""
    views = _views(plan, batch)
    total = flp.reconstruct([bv.verifier_share(plan, v, QUERY)[None] for v in views])
    return flp.decision_parts(plan.circuit, total, flp.joint_rand(plan.circuit, [views[0].batch_id]))


def _rows_near_bound(m: int, w: int, seed: int) -> np.ndarray:
    """Rows at the bound exactly (+-1000 on one coordinate), one short of it, and random ones inside."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-1000 // max(1, math.isqrt(w)), 1000 // max(1, math.isqrt(w)) + 1, size=(m, w))
    x[0] = 0
    x[0, 0] = 1000  # ||x||^2 = R^2: slack 0
    if m > 1:
        x[1] = 0
        x[1, -1] = -1000
    if m > 2 and w > 1:
        x[2] = 0
        x[2, :2] = [999, 44]  # 998,001 + 1,936 = R^2 - 63
    return x


# --- honest batches ---------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 7, 100])
@pytest.mark.parametrize("w", [1, 10])
def test_honest_batches_at_and_near_the_bound_are_accepted(m, w):
    plan = _plan(m, w)
    x = _rows_near_bound(m, w, m * 100 + w)
    assert ((x * x).sum(axis=1) <= R2).all() and (x * x).sum(axis=1).max() == R2
    for leader in (0, N - 1):
        batch = bv.prove(plan, x, _stream(f"honest {m} {w} {leader}"), leader=leader)
        assert _accepted(plan, batch)


def test_a_study_batch_of_noisy_rows_is_accepted_and_one_row_beyond_is_not_provable():
    study = design(name="batch", columns=[f"c{i}" for i in range(10)], label="c0", servers=["a", "b", "c"],
                   expected_reports=100_000, validity=True)[0]
    plan = bv.study_plan(study, 100)
    assert (plan.w, plan.circuit.r2, plan.shift) == (10, validity.plan(study).bound, validity.plan(study).shift)
    rng = np.random.default_rng(3)
    r = math.isqrt(plan.circuit.r2)
    x = rng.integers(-r // 4, r // 4 + 1, size=(100, 10))
    x[5] = 0
    x[5, 3] = r  # at the bound
    assert _accepted(plan, bv.prove(plan, x, _stream("study")))
    x[6] = 0
    x[6, 0] = r + 1
    with pytest.raises(validity.ValidityError, match="redraw"):
        bv.prove(plan, x, _stream("study beyond"))


def test_the_slack_is_a_sum_of_squares_exactly():
    table = batch_circuit.four_square_table()
    assert ((table * table).sum(axis=1) == np.arange(batch_circuit.TABLE_LIMIT + 1)).all()
    rng = np.random.default_rng(1)
    for r2 in (0, 10, 8191, 8192, R2, 5_133_776, 2 ** 24, 2 ** 40, 2 ** 62):
        g = batch_circuit.greedy_steps(r2)
        s = np.concatenate([rng.integers(0, r2 + 1, size=2000), [0, r2]])
        roots = batch_circuit.slack_roots(s, g)
        assert ((roots * roots).sum(axis=1) == s).all(), r2
        assert roots.min() >= 0 and roots.max() <= math.isqrt(r2)
    assert [batch_circuit.greedy_steps(v) for v in (8191, 8192, 5_133_776, 2 ** 30, 2 ** 62)] == [0, 1, 1, 2, 3]


def test_projections_are_the_signed_sums_of_the_bits():
    assert wraparound.WRAP.warm_up()  # the compiled loop, whatever the batch's size
    rng = np.random.default_rng(2)
    for n in (1, 8, 13, 1000):
        v = rng.integers(0, P, size=n, dtype=np.uint64)
        table = wraparound.bits(bytes(range(32)), 5, n)
        z = wraparound.signs(table, n)
        assert set(np.unique(z)) <= {-1, 0, 1}
        expected = [sum(int(a) * int(b) for a, b in zip(z[k], v, strict=True)) % P for k in range(5)]
        assert wraparound.project(v, table).tolist() == expected
        with wraparound.WRAP.reference():
            assert wraparound.project(v, table).tolist() == expected
    z = wraparound.signs(wraparound.bits(bytes(32), 64, 4000), 4000)
    freq = [(z == s).mean() for s in (-1, 0, 1)]
    assert abs(freq[0] - 0.25) < 0.01 and abs(freq[1] - 0.5) < 0.01 and abs(freq[2] - 0.25) < 0.01


def test_the_subset_sums_loop_is_exact_on_edge_values():
    """The compiled subset sums (256-entry tables mod p, a row's sum as a word plus its overflow
    count) equal Python integers' sums mod p: values at 0, 1, p - 2, p - 1 (every table entry and
    every row sum wraps), lengths not a multiple of 8 and a last chunk of fewer blocks, bit rows
    all set and all clear."""
    loop = wraparound.WRAP.require()
    from dpsketch.protocol import _wrap_kernel

    rng = np.random.default_rng(21)
    chunk = 8 * _wrap_kernel.CHUNK
    for n in (1, 7, 8, 9, chunk - 1, chunk, chunk + 1, 5 * chunk + 3):
        for kind in ("random", "top", "mixed"):
            if kind == "random":
                v = rng.integers(0, P, size=n, dtype=np.uint64)
            elif kind == "top":
                v = np.full(n, P - 1, dtype=np.uint64)
            else:
                v = np.array([0, 1, P - 2, P - 1], dtype=np.uint64)[rng.integers(0, 4, size=n)]
            table = rng.integers(0, 256, size=(-(-n // 8), 6), dtype=np.uint8)
            table[:, 0] = 255
            table[:, 1] = 0
            ints = [int(a) for a in v]
            want = []
            for row in range(6):
                chosen = [ints[j] for j in range(n) if (int(table[j // 8, row]) >> (j % 8)) & 1]
                want.append(sum(chosen) % P)
            assert wraparound.subset_sums(v, table, loop).tolist() == want, (n, kind)
            assert wraparound.subset_sums(v, table).tolist() == want, (n, kind)
    with pytest.raises(field.FieldError):
        wraparound.project(np.array([P], dtype=np.uint64), np.zeros((1, 2), dtype=np.uint8))


def test_projections_drawn_a_piece_at_a_time_are_the_same():
    """project_seeded (bits drawn and projected in pieces, the loop's sums carried over) equals
    project on the whole table of bits, compiled and reference, across piece boundaries."""
    assert wraparound.WRAP.warm_up()
    rng = np.random.default_rng(22)
    seed = hashlib.sha256(b"pieces").digest()
    for n in (1, 9, 64, 1000, 4099, 3000):
        v = rng.integers(0, P, size=n, dtype=np.uint64)
        want = wraparound.project(v, wraparound.bits(seed, 7, n)).tolist()
        for piece in (1, 3, 8, 1000, wraparound.PIECE_BLOCKS):
            assert wraparound.project_seeded(v, seed, 7, piece).tolist() == want, (n, piece)
        for threads in (2, 3):  # ranges from a multiple of 64 blocks, each its own keystream
            assert wraparound.project_seeded(v, seed, 7, 5, threads=threads).tolist() == want, (n, threads)
            assert wraparound.project_seeded(v, seed, 128, threads=threads).tolist() == \
                wraparound.project(v, wraparound.bits(seed, 128, n)).tolist()
        with wraparound.WRAP.reference():
            assert wraparound.project_seeded(v, seed, 7).tolist() == want


def test_the_servers_aggregate_is_the_exact_integer_sum_of_the_rows():
    study = design(name="batch-agg", columns=[f"c{i}" for i in range(10)], label="c0", servers=["a", "b", "c"],
                   expected_reports=100_000, validity=True)[0]
    plan = bv.study_plan(study, 100)
    rng = np.random.default_rng(4)
    r = math.isqrt(plan.circuit.r2)
    x = rng.integers(-r // 4, r // 4 + 1, size=(100, 10))
    batch = bv.prove(plan, x, _stream("aggregate"))
    views = _views(plan, batch)
    shares = [bv.coordinate_shares(plan, v) for v in views]
    assert plan.shift > 0
    per_row = field.decode_int(flp.reconstruct(shares))
    assert (per_row == x * (1 << plan.shift)).all()
    summed = flp.reconstruct([field.total(s, axis=0) for s in shares])  # each server's sum over rows
    assert field.decode_int(summed).tolist() == [int(v) << plan.shift for v in x.sum(axis=0)]
    ids = bv.row_ids(views[0].batch_id, 100)
    assert ids.shape == (100, 16) and len({bytes(i) for i in ids}) == 100
    bid = views[0].batch_id
    assert [bytes(i) for i in ids] == [hashlib.sha256(b"dpsketch/batch-row/1" + bid + i.to_bytes(4, "little")).digest()[:16]
                                       for i in range(100)]
    hi = ids[:, :8].copy().view(">u8").ravel()
    assert len(set(hi.tolist())) == 100  # uniform first halves, as report ids' (a sorted list's search key)


def test_one_long_keystream_is_the_protocols_chacha20():
    """The wrap bits and a helper's expansion through OpenSSL's one long stream are chacha.py's
    ChaCha20 (RFC 8439) and field.expand's elements exactly; a seed whose words include one at
    or above p takes field.expand itself (forced here: no seed below 2^32 tries has one)."""
    from dpsketch.protocol import chacha

    for n in (1, 8, 13, 1000, 70_001):
        seed = hashlib.sha256(b"bits %d" % n).digest()
        b = wraparound.bits(seed, 128, n)
        assert b.shape == (-(-n // 8), 129)
        assert (b.ravel() == chacha.keystream(seed, wraparound.BITS_NONCE, b.size, compiled=False)[0]).all()
        for count in (1, n, 3 * n + 5):
            want = field.expand(np.frombuffer(seed, np.uint8).reshape(1, 32), count, bv.SHARE_NONCE)[0]
            assert bv.expand_one(seed, count).tolist() == want.tolist()


def test_expand_one_takes_field_expand_when_a_word_is_rejected(monkeypatch):
    seed = hashlib.sha256(b"rejected").digest()
    words = wraparound.keystream_into(seed, bv.SHARE_NONCE, np.empty(50, dtype=np.uint64))
    forced = words.copy()
    forced[17] = np.uint64(P + 5)  # a word >= p: field.expand skips it
    monkeypatch.setattr(wraparound, "keystream_into", lambda key, nonce, out: np.copyto(out, forced) or out)
    calls = []
    real = field.expand
    monkeypatch.setattr(field, "expand", lambda *a: calls.append(a) or real(*a))
    got = bv.expand_one(seed, 50)
    assert len(calls) == 1 and got.tolist() == real(np.frombuffer(seed, np.uint8).reshape(1, 32), 50,
                                                     bv.SHARE_NONCE)[0].tolist()


@pytest.mark.parametrize("compiled", [True, False])
def test_the_field_sums_into_sketch_cells_are_exact(compiled):
    """aggregate's one-word lazy sums mod p (compiled) and its numpy reference against Python
    integers: random elements, elements at 0, 1, p - 1 and p - 2, both signs and empty slots,
    many rows into one cell (every sum overflows 2^64), a shift and a running aggregate."""
    if compiled:
        assert wraparound.WRAP.warm_up()  # else a batch below kernels.MIN_ROWS takes the reference
    m, w, k = 300, 3, 4
    rng = np.random.default_rng(8)
    plan = _plan(m, w)
    c = plan.circuit
    values = rng.integers(0, P, size=(m, c.k), dtype=np.uint64)
    values[:40, :w] = np.array([0, 1, P - 1, P - 2], dtype=np.uint64)[rng.integers(0, 4, size=(40, w))]
    values[40:80, :w] = P - 1
    rows = rng.integers(0, k, size=(m, 2))
    rows[40:80] = 0  # 40 rows of p - 1 into cell 0: its word overflows 2^64 again and again
    signs = rng.integers(-1, 2, size=(m, 2)).astype(np.int8)
    signs[40:80] = 1
    inputs = np.zeros(c.input_len, dtype=np.uint64)
    inputs[:m * c.k] = values.ravel()
    view = bv.ServerBatch(0, inputs, np.zeros(c.proof_len, dtype=np.uint64), bytes(32), bytes(16))
    start = rng.integers(0, P, size=(k, w), dtype=np.uint64)
    expected = [[int(start[r, j]) for j in range(w)] for r in range(k)]
    for i in range(m):
        for slot in range(2):
            for j in range(w):
                expected[rows[i, slot]][j] += int(signs[i, slot]) * int(values[i, j])
    for shift in (0, 5):
        plan_s = bv.BatchPlan(c, shift, N)
        want = [[(e - int(start[r, j])) * (1 << shift) + int(start[r, j]) for j, e in enumerate(row)]
                for r, row in enumerate(expected)]
        if compiled:
            got = bv.aggregate(plan_s, view, rows, signs, start)
        else:
            with wraparound.WRAP.reference():
                got = bv.aggregate(plan_s, view, rows, signs, start)
        assert got.tolist() == [[v % P for v in row] for row in want]
    with pytest.raises(ValueError, match="outside"):
        bv.aggregate(plan, view, rows + k, signs, start)


# --- forgeries ----------------------------------------------------------------------------------------

def _forge(plan: bv.BatchPlan, x_field: np.ndarray, roots_field: np.ndarray, label: str) -> bv.ProvedBatch:
    """A forger's batch: its x and roots as F_p elements whose norm equation holds mod p, the
    wrap digits the best it has (prove_prefix, strict=False)."""
    c = plan.circuit
    x_int = [[int(v) for v in row] for row in x_field]
    a_int = [[int(v) for v in row] for row in roots_field]
    for xi, ai in zip(x_int, a_int, strict=True):  # the equation holds in F_p: the FLP alone would pass it
        assert (sum(v * v for v in xi) + sum(v * v for v in ai) - c.r2) % P == 0
    prefix = c.prefix_of(np.asarray(x_field, dtype=np.uint64), np.asarray(roots_field, dtype=np.uint64))
    return bv.prove_prefix(plan, prefix, _stream(label), strict=False)


def _honest_roots(plan: bv.BatchPlan, x: np.ndarray) -> np.ndarray:
    c = plan.circuit
    return batch_circuit.slack_roots(c.r2 - (x * x).sum(axis=1), c.squares - batch_circuit.EXACT)


def _mod(a) -> np.ndarray:
    return np.array([[int(v) % P for v in row] for row in np.asarray(a, dtype=object)], dtype=np.uint64)


def _refused_by_the_wrap_checks_alone(plan, batch):
    """Refused; the gadget identities hold (the FLP proves what it was given), the checks do not."""
    assert not _accepted(plan, batch)
    parts = _parts_of_decision(plan, batch)
    assert all(bool(g[0]) for g in parts["gadgets"]) and not bool(parts["v_is_zero"][0])


def test_a_row_of_norm_1_01_R_with_the_norm_equation_holding_in_F_p_is_refused():
    plan = _plan(7, 10)
    x = _rows_near_bound(7, 10, 5)
    roots = _honest_roots(plan, x).astype(object)
    x = x.astype(object)
    x[3] = 0
    x[3, 0] = 1010  # norm 1.01 R: slack R^2 - 1010^2 = -20,100
    b = batch_circuit.slack_roots([1010 ** 2 - R2], plan.circuit.squares - batch_circuit.EXACT)[0]
    roots[3] = [I * int(v) % P for v in b]  # (i b)^2 = -b^2: the squares of wrapped values add up to the slack
    _refused_by_the_wrap_checks_alone(plan, _forge(plan, _mod(x), _mod(roots), "1.01R"))


def test_a_negative_slack_as_the_square_of_a_wrapped_value_is_refused():
    plan = _plan(7, 1)
    x = _rows_near_bound(7, 1, 6).astype(object)
    roots = _honest_roots(plan, x.astype(np.int64)).astype(object)
    x[4, 0] = 1001  # one step beyond: slack -2,001
    b = batch_circuit.slack_roots([2001], plan.circuit.squares - batch_circuit.EXACT)[0]
    roots[4] = [I * int(v) % P for v in b]
    _refused_by_the_wrap_checks_alone(plan, _forge(plan, _mod(x), _mod(roots), "negative slack"))


@pytest.mark.parametrize("value, count", [((P + 1) // 2, 4), ((P - 1) // 3, 9)])
def test_a_coordinate_at_p_over_2_or_3_is_refused(value, count):
    """(p + 1) / 2 = 1/2 and (p - 1) / 3 = -1/3 mod p: four squares of 1/2, nine of -1/3, add up
    to 1, so the row's norm equation holds in F_p with the honest roots of R^2 - 1."""
    plan = _plan(7, 10)
    x = _mod(_rows_near_bound(7, 10, 7))
    x[2] = 0
    x[2, :count] = value
    honest = _rows_near_bound(7, 10, 7)
    roots = _honest_roots(plan, honest)
    roots[2] = batch_circuit.slack_roots([R2 - 1], plan.circuit.squares - batch_circuit.EXACT)[0]
    _refused_by_the_wrap_checks_alone(plan, _forge(plan, x, _mod(roots), f"wrapped {count}"))


def test_wrong_wrap_digits_are_refused(monkeypatch):
    plan = _plan(7, 10)
    x = _rows_near_bound(7, 10, 8)
    honest = plan.circuit.wrap_input

    def shifted(projections):  # a digit one higher: still a digit, the wrong value
        d = honest(projections).copy()
        d[3] = (d[3] + 1) % 4
        return d

    monkeypatch.setattr(plan.circuit, "wrap_input", shifted)
    batch = bv.prove(plan, x, _stream("wrong digit"))
    _refused_by_the_wrap_checks_alone(plan, batch)

    def out_of_range(projections):  # digit 0 raised by 4, digit 1 lowered by 1: the same value
        d = honest(projections).copy()
        k = int(np.flatnonzero(d[1:plan.circuit.wrap_digits] > 0)[0]) + 1
        d[k - 1] += 4
        d[k] -= 1
        return d

    monkeypatch.setattr(plan.circuit, "wrap_input", out_of_range)
    batch = bv.prove(plan, x, _stream("digit out of range"))
    digits = [honest(np.zeros(plan.circuit.reps, dtype=np.int64)), out_of_range(np.zeros(plan.circuit.reps, dtype=np.int64))]
    weights = 4 ** np.arange(plan.circuit.wrap_digits)
    assert [int((d[:len(weights)] * weights).sum()) for d in digits] == [plan.circuit.threshold] * 2
    _refused_by_the_wrap_checks_alone(plan, batch)  # the range checks: the wrap equation holds


def test_shares_tampered_after_proving_are_refused():
    plan = _plan(7, 10)
    x = _rows_near_bound(7, 10, 9)
    c = plan.circuit
    for at in (0, c.k + c.w + 2, c.v_len - 1, c.at_wrap + 1):  # a coordinate, a root, a padding root, a digit
        batch = bv.prove(plan, x, _stream(f"tamper {at}"))
        batch.leader_inputs = batch.leader_inputs.copy()
        batch.leader_inputs[at] = field.add(batch.leader_inputs[at], np.uint64(1))
        with pytest.raises(bv.BatchRefused):  # in transit: the leader's part is not what it holds
            _views(plan, batch)
        # by the client, with the parts made again for what it sends: refused at decide
        if at < c.v_len:
            batch.parts[batch.leader] = bv.share_part(plan, batch.leader, batch.leader_inputs, batch.blind)
        batch.digits_part = bv.digits_part(plan, batch.leader, batch.leader_inputs, batch.blind)
        assert not _accepted(plan, batch)
    batch = bv.prove(plan, x, _stream("tamper proof"))
    batch.leader_proof = field.add(batch.leader_proof, np.uint64(1))
    assert not _accepted(plan, batch)


def test_a_proof_replayed_with_another_batchs_shares_is_refused():
    plan = _plan(7, 10)
    a = bv.prove(plan, _rows_near_bound(7, 10, 10), _stream("replay a"))
    b = bv.prove(plan, _rows_near_bound(7, 10, 11), _stream("replay b"))
    assert _accepted(plan, a) and _accepted(plan, b)
    b.leader_proof = a.leader_proof  # a's proof with b's input shares and parts
    assert not _accepted(plan, b)
    a.leader_inputs = b.leader_inputs  # b's leader shares under a's parts: refused at the leader
    with pytest.raises(bv.BatchRefused):
        _views(plan, a)


def test_a_proof_valid_only_at_n_minus_1_servers_is_refused():
    plan = _plan(7, 10)
    x = _rows_near_bound(7, 10, 12)
    # a helper gets another seed (its part made for it): the shares no longer add up to x
    batch = bv.prove(plan, x, _stream("n-1 seed"))
    helper = next(j for j in range(N) if j != batch.leader)
    batch.seeds[helper] = hashlib.sha256(b"another").digest()
    batch.parts[helper] = bv.seed_part(helper, batch.seeds[helper])
    assert not _accepted(plan, batch)
    # one server gets other parts than the rest (its own is right): the batch ids differ
    batch = bv.prove(plan, x, _stream("n-1 parts"))
    helper2 = next(j for j in range(N) if j not in (batch.leader, helper))
    other = list(batch.parts)
    other[batch.leader] = hashlib.sha256(b"a part for no one").digest()
    views = _views(plan, batch)
    views[helper2] = bv.receive(plan, helper2, batch.payload(helper2), other, batch.digits_part, batch.leader)
    assert views[helper2].batch_id != views[0].batch_id
    assert not _accepted(plan, batch, views)
    # the N - 1 servers' messages alone decide nothing
    honest = _views(plan, batch)
    msgs = [(v.batch_id, bv.verifier_share(plan, v, QUERY)) for v in honest]
    assert bv.decide(plan, msgs) and not bv.decide(plan, msgs[:-1])


# --- soundness, measured --------------------------------------------------------------------------

def test_the_wrap_checks_pass_a_wrapped_batch_at_the_rate_their_bound_allows():
    """r = 8: a batch with a coordinate at p/2 (its norm equation holding in F_p) passes all 8
    checks with probability at most 2^-8 per wrap seed (exactly 2^-8 here: each check passes iff
    the four wrapped coordinates' signs add up to an even number). 2,000 wrap seeds (fresh helper
    seeds each); then a passing and a failing one through prove, query and decide: the FLP
    accepts exactly when the wrap checks do."""
    reps, tries = 8, 2000
    plan = _plan(7, 10, reps=reps)
    c = plan.circuit
    x = _mod(_rows_near_bound(7, 10, 13))
    x[2] = 0
    x[2, :4] = (P + 1) // 2
    roots = _honest_roots(plan, _rows_near_bound(7, 10, 13))
    roots[2] = batch_circuit.slack_roots([R2 - 1], c.squares - batch_circuit.EXACT)[0]
    prefix = c.prefix_of(x, _mod(roots))
    passed = []
    for i in range(tries):
        proj = bv.projections(plan, bv.commit(plan, prefix, _stream(f"try {i}")))
        passed.append(bool(((proj >= -c.threshold) & (proj < c.wrap_bound - c.threshold)).all()))
    count = sum(passed)
    bound = 2.0 ** -reps
    assert count <= stats.binom.ppf(1 - 1e-6, tries, bound), count  # at most the bound, with a margin
    assert count >= stats.binom.ppf(1e-6, tries, bound)  # and the bound is met here, not just respected
    yes, no = passed.index(True), passed.index(False)
    assert _accepted(plan, bv.prove_prefix(plan, prefix, _stream(f"try {yes}"), strict=False))
    assert not _accepted(plan, bv.prove_prefix(plan, prefix, _stream(f"try {no}"), strict=False))


def test_construction_numbers():
    """The threshold covers an honest batch (Hoeffding at 2^-96 over all repetitions); the
    circuit refuses a batch whose rows' norms could wrap around p; the soundness figures."""
    c = _plan(100, 10).circuit
    assert c.rows >= 100 and c.threshold ** 2 >= 2 * c.rows * R2 * (math.log(2 * 128) + 96 * math.log(2))
    assert 4 ** c.wrap_digits > 2 * c.threshold and (c.w + c.squares) * (c.wrap_bound - 1) ** 2 < P
    with pytest.raises(ValueError, match="wrap around"):
        batch_circuit.BatchNorm(10 ** 6, 100, 2 ** 40)
    sound = c.soundness()
    assert float(sound["total"]) < 2.0 ** -115
    # an honest batch's projections sit well inside [-T, T] (T is 17 sd of sqrt(||v||^2 / 2))
    x = _rows_near_bound(100, 10, 14)
    plan = _plan(100, 10)
    proj = bv.projections(plan, bv.commit(plan, c.prefix(x), _stream("honest projections")))
    assert np.abs(proj).max() < c.threshold / 3
