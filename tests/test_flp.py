"""The fully linear proofs (dpsketch/protocol/flp.py, circuits.py), attacked.

Completeness: random valid rows (and rows at the bound) through prove, seed-compressed sharing
for N = 2 and 3, query and decide: all accepted. Soundness, each attack with its exact decision
(which part refused it): a digit out of range; a norm above R, with the slack in range or not;
vectors that wrap around mod p ((p + 1)/2 and friends: |x|^2 mod p small) whose norm equation
holds mod p; a tampered proof share (every position); a tampered input share after proving
(every position); a proof replayed with another input; a random proof; joint randomness of
another report, against an input crafted to pass under the joint randomness it was made for.
The soundness formula on toy circuits: a cheating prover that passes at exactly D (P - 1)
query points (the bound's numerator) and an input that passes for exactly the 2 = (C - 1) +
(L - 1) joint randomness values the formula allows. Zero knowledge: one server's verifier share,
and the sum the analyzer sees, have the same law for two different valid rows (chi-square on the
top bits of every coordinate); a control with one seed per wire shows the leak two seeds close.
Also: the compiled loops against the numpy reference (identical proofs and verifier messages),
the joint randomness and seed expansion against hashlib and ``cryptography``, and the vectors
in conformance/flp.json against their generator."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from dpsketch.protocol import circuits, field, flp, ntt
from dpsketch.protocol.keystream import Keystream
from test_field import _expand_reference  # the expansion's definition, from cryptography's ChaCha20

P = field.P
ROOT = Path(__file__).resolve().parents[1]


def _stream(label: str) -> Keystream:
    return Keystream.from_key(hashlib.sha256(label.encode()).digest())


def small() -> circuits.NormBound:
    """w = 4, base 4, 3 digits per coordinate (H = 32), R^2 = 300 (5 slack digits)."""
    return circuits.NormBound(w=4, beta=4, q=3, r2=300)


def report_ids(m: int, label: str) -> np.ndarray:
    return np.frombuffer(_stream(label).bytes(16 * m), dtype=np.uint8).reshape(m, 16)


def run(circuit, inputs, num_shares=2, label="run", jr=None, proofs=None, t=None, tamper=None):
    """Prove (unless ``proofs``), share (helpers seed-compressed), query at every server, add the
    verifier shares and decide: (decisions, decision parts, verifier shares, verifier sum).
    ``tamper(server_inputs, server_proofs)`` may change what the servers receive."""
    inputs = np.asarray(inputs, dtype=np.uint64)
    m = len(inputs)
    stream = _stream(label)
    jr = flp.joint_rand(circuit, report_ids(m, label)) if jr is None else jr
    if proofs is None:
        proofs = flp.prove(circuit, inputs, jr, flp.prove_rand(circuit, m, stream))
    shares = flp.share_proofs(flp.share_inputs(circuit, inputs, num_shares, stream), proofs)
    held = [flp.expand_share(circuit, s) for s in shares.helper_seeds] + [(shares.leader_inputs, shares.leader_proofs)]
    xs = [h[0].copy() for h in held]
    ps = [h[1].copy() for h in held]
    if tamper is not None:
        tamper(xs, ps)
    t = flp.query_point(hashlib.sha256(label.encode() + b"/t").digest()) if t is None else t
    query = flp.Query(circuit, t)
    vs = [flp.query(circuit, x, p, jr, query, num_shares) for x, p in zip(xs, ps)]
    verifier = flp.reconstruct(vs)
    return flp.decide(circuit, verifier, jr), flp.decision_parts(circuit, verifier, jr), vs, verifier


def valid_rows(c: circuits.NormBound, m: int, seed: int) -> np.ndarray:
    """Random integer rows inside the ball (test data), with some at the bound."""
    rng = np.random.default_rng(seed)
    r = int(np.sqrt(c.r2))
    x = rng.integers(-min(r, c.half), min(r + 1, c.half), size=(8 * m + 64, c.w))
    x = x[(x.astype(np.int64) ** 2).sum(axis=1) <= c.r2][:m]
    assert len(x) == m
    return x


# --- completeness -------------------------------------------------------------------------------

@pytest.mark.parametrize("num_shares", [2, 3])
def test_valid_rows_are_always_accepted(num_shares):
    c = small()
    x = valid_rows(c, 400, num_shares)
    edges = np.array([[0, 0, 0, 0], [-17, 0, 0, 0], [10, 10, 10, 0], [-10, 10, -10, 0], [5, 5, 5, 15]])
    assert ((edges ** 2).sum(axis=1) <= c.r2).all() and (edges ** 2).sum(axis=1)[2] == 300  # one at R^2
    x = np.concatenate([x, edges])
    ok, parts, _, verifier = run(c, c.encode(x), num_shares, label=f"complete-{num_shares}")
    assert ok.all() and parts["v_is_zero"].all()
    # the servers aggregate x from their digit shares: the coordinates map with constants / N
    shares = flp.share_inputs(c, c.encode(x), num_shares, _stream("agg"))
    held = [flp.expand_share(c, s)[0] for s in shares.helper_seeds] + [shares.leader_inputs]
    inv = pow(num_shares, P - 2, P)
    total = flp.reconstruct([c.coordinates.apply(h, inv) for h in held])
    assert (field.decode_int(total) == x).all()


def test_range_digits_circuit_accepts_digits_and_refuses_a_non_digit():
    c = circuits.RangeDigits(width=5, digits=4, beta=16)
    values = np.random.default_rng(3).integers(0, 16 ** 4, size=(50, 5))
    inputs = c.encode(values)
    assert (field.decode_int(c.values.apply(inputs)) == values).all()
    ok, _, _, _ = run(c, inputs, 3, label="digits")
    assert ok.all()
    inputs[7, 13] = 16  # one digit out of range
    ok, parts, _, _ = run(c, inputs, 2, label="digits-bad")
    assert ok.tolist() == [i != 7 for i in range(50)] and not parts["v_is_zero"][7] and parts["gadgets"][0].all()


def test_digits_are_little_endian_and_exact_up_to_64_bits():
    values = np.array([[0, 5, 2**64 - 1, 12345678901234567]], dtype=np.uint64)
    for beta, digits in ((2, 64), (16, 18), (256, 9)):
        d = circuits.to_digits(values, beta, digits).reshape(4, digits)
        assert (d < beta).all()
        assert [sum(int(x) * beta ** i for i, x in enumerate(row)) for row in d] == [int(v) for v in values[0]]


def test_affine_maps_sum_repeated_entries_mod_p_and_apply_with_shared_constants():
    a = flp.Affine.build(3, 4, [0, 0, 2, 2, 2, 1], [1, 1, 0, 3, 0, 2], [5, P - 5, 2, -1, 7, 1], const={1: -3})
    assert a.dense().tolist() == [[0, 0, 0, 0], [0, 0, 1, 0], [9, 0, 0, P - 1]] and a.nnz == 3
    x = np.array([[1, 2, 3, 4], [P - 1, 0, 5, 1]], dtype=np.uint64)
    assert a.apply(x).tolist() == [[0, 0, (9 - 4) % P], [0, (5 - 3) % P, (-9 - 1) % P]]
    halves = [a.apply(x, pow(2, P - 2, P)), a.apply(np.zeros_like(x), pow(2, P - 2, P))]
    assert flp.reconstruct(halves).tolist() == a.apply(x).tolist()  # the constant split over 2 shares


def test_compiled_loops_and_numpy_reference_give_identical_proofs_and_verifier_shares():
    c = small()
    inputs = c.encode(valid_rows(c, 30, 5))
    jr = flp.joint_rand(c, report_ids(30, "same"))
    pr = flp.prove_rand(c, 30, _stream("same"))
    t = flp.query_point(bytes(32))
    field.FIELD.require()
    outputs = []
    for context in (field.FIELD.reference, contextlib.nullcontext):
        with context():
            proofs = flp.prove(c, inputs, jr, pr)
            outputs.append((proofs, flp.query(c, inputs, proofs, jr, t, 1)))
    assert (outputs[0][0] == outputs[1][0]).all() and (outputs[0][1] == outputs[1][1]).all()
    assert flp.decide(c, outputs[0][1], jr).all()


def test_fused_gadget_sums_coset_evaluation_and_in_place_reads_match_the_reference():
    """The fast paths of the prover, the query and the decision give the reference's bits on
    arbitrary elements (edge values included, not only valid digits): the fused ParallelSum
    loops for every inner gadget, weighted or plain, in both layouts; the wires' values on the
    evaluation domain by cosets against the zero-padded NTT; the affine maps read row by row
    from a view of a wider share against lanes; the query reading a range check's wires in
    place against the copied wire values; the powers of the joint randomness."""
    field.FIELD.require()
    rng = np.random.default_rng(11)

    def elems(*shape):
        v = rng.integers(0, 1 << 63, size=shape, dtype=np.uint64) * np.uint64(2) % np.uint64(P)
        flat = v.reshape(-1)
        flat[:4] = [0, 1, P - 1, P - 2]  # edge values in every array
        return v

    m = 300
    for gadget in (flp.ParallelSum(flp.Range(4), 7, True), flp.ParallelSum(flp.Range(2), 3, True),
                   flp.ParallelSum(flp.Mul(), 3, False), flp.ParallelSum(flp.Mul(), 2, True),
                   flp.ParallelSum(flp.MulSub(), 4, True), flp.ParallelSum(flp.MulSub(), 2, False)):
        x, v = elems(8, gadget.arity, m), elems(m, gadget.arity, 2)
        w = elems(gadget.count, 2, m) if gadget.weighted else None
        w_ext = elems(m, gadget.count, 2) if gadget.weighted else None
        fast = gadget.on_values(x, w), gadget.on_ext(v, w_ext)
        with field.FIELD.reference():
            slow = gadget.on_values(x, w), gadget.on_ext(v, w_ext)
        assert all(a.shape == b.shape and (a == b).all() for a, b in zip(fast, slow)), gadget.describe()
    for n, k in ((8, 32), (16, 64), (32, 64), (4, 4)):
        vals = elems(n, 3, 40)
        padded = np.zeros((k, 3, 40), dtype=np.uint64)
        padded[:n] = ntt.ntt_columns(vals, inverse=True)
        assert (ntt.extend_columns(vals, k) == ntt.ntt_columns(padded)).all()
    r = elems(m, 2)
    fast_powers = field.ext_powers(r, 9)
    with field.FIELD.reference():
        assert (field.ext_powers(r, 9) == fast_powers).all()
    for c in (small(), circuits.GramNorm(3, True, 4, 16, 4, 3, 50, 4, 900)):
        wide = elems(m, c.input_len + c.proof_len + 3)
        x, pi = wide[:, 1:1 + c.input_len], wide[:, 1 + c.input_len:1 + c.input_len + c.proof_len]
        for affine in [c.coordinates, c.checks_on_input] + [g.wires for g in c.gadgets]:
            assert (affine.apply(x, 12345) == affine.apply_lanes(np.ascontiguousarray(x.T), 12345).T).all()
        jr = elems(m, c.joint_rand_len, 2)
        t = flp.Query(c, np.array([5, 9], dtype=np.uint64))
        fast = flp.query(c, x, pi, jr, t, 3)
        saved = [g.wires.prefix_copy for g in c.gadgets]
        for g in c.gadgets:
            g.wires.__dict__["prefix_copy"] = None  # the copied wire values instead
        try:
            assert (flp.query(c, x, pi, jr, t, 3) == fast).all()
            with field.FIELD.reference():
                assert (flp.query(c, x, pi, jr, t, 3) == fast).all()
        finally:
            for g, k in zip(c.gadgets, saved):
                g.wires.__dict__["prefix_copy"] = k
    assert small().gadgets[0].wires.prefix_copy == small().input_len  # the range check reads in place


# --- soundness: attacks ---------------------------------------------------------------------------

def raw_digits(c: circuits.NormBound, x_field: list[int], slack: int) -> np.ndarray:
    """An attacker's input: digit 0 of each coordinate holds (x_i + H) mod p whatever its size
    (the other digits 0), so the circuit's affine map gives back exactly x_i mod p; the slack
    likewise. Digits of size beta or more are out of range."""
    row = np.zeros(c.input_len, dtype=np.uint64)
    for i, xi in enumerate(x_field):
        row[i * c.q] = (xi + c.half) % P
    row[c.w * c.q] = slack % P
    return row


def test_a_digit_out_of_range_is_refused():
    c = small()
    inputs = c.encode(valid_rows(c, 6, 7))
    inputs[0, 0] = 4  # beta = 4: not a digit
    inputs[1, 2] = P - 1  # -1
    inputs[2, c.w * c.q + 1] = 5  # a slack digit
    ok, parts, _, _ = run(c, inputs, label="digit")
    assert ok.tolist() == [False, False, False, True, True, True]
    assert parts["v_is_zero"].tolist() == ok.tolist()  # the weighted range sums are not zero
    assert all(g.all() for g in parts["gadgets"])  # the proof itself is honest


def test_a_norm_above_the_bound_is_refused_whatever_the_slack():
    c = small()
    x = [20, 20, 0, 0]  # |x|^2 = 800 > 300
    # (a) slack digits in range (s = 0): the norm equation fails
    a = raw_digits(c, [0] * 4, 0)
    a[:c.w * c.q] = circuits.to_digits(np.array([x]) + c.half, c.beta, c.q)[0]
    # (b) the slack that makes the equation hold, s = 300 - 800 = p - 500: out-of-range digits
    b = a.copy()
    b[c.w * c.q:] = 0
    b[c.w * c.q] = (300 - 800) % P
    ok, parts, _, _ = run(c, np.stack([a, b]), label="norm")
    assert ok.tolist() == [False, False]
    assert parts["v_is_zero"].tolist() == [False, False] and all(g.all() for g in parts["gadgets"])
    # what fails in (b) is only the range: the norm equation itself holds mod p there
    assert _norm_check(c, b) == 0 and _norm_check(c, a) != 0


def _norm_check(c: circuits.NormBound, row: np.ndarray) -> int:
    """sum x_i^2 + s - R^2 mod p as the circuit computes it from the digits (Python integers)."""
    digits = [int(v) for v in row]
    x = [sum(digits[i * c.q + k] * c.beta ** k for k in range(c.q)) - c.half for i in range(c.w)]
    s = sum(digits[c.w * c.q + k] * c.beta ** k for k in range(c.slack_digits))
    return (sum(v * v for v in x) + s - c.r2) % P


def _sqrt(a: int) -> int:
    """A square root mod p (Tonelli-Shanks), for the attacks' crafted values."""
    a %= P
    if a == 0:
        return 0
    assert pow(a, (P - 1) // 2, P) == 1, "not a square"
    q, s = P - 1, 0
    while q % 2 == 0:
        q, s = q // 2, s + 1
    z = 7  # a non-square
    m, c, t, r = s, pow(z, q, P), pow(a, q, P), pow(a, (q + 1) // 2, P)
    while t != 1:
        i, t2 = 0, t
        while t2 != 1:
            t2, i = t2 * t2 % P, i + 1
        b = pow(c, 1 << (m - i - 1), P)
        m, c, t, r = i, b * b % P, t * b * b % P, r * b % P
    return r


def test_vectors_that_wrap_around_p_are_refused_though_their_norm_holds_mod_p():
    """x_i = (p + 1)/2 (= 1/2 mod p) four times has sum x_i^2 = 1 mod p; sqrt(-1) and 1 give 0;
    (p - 1)/2 and (p + 1)/2 give 1/2. With a slack that satisfies the norm equation mod p, only
    the range of the digits stands between them and acceptance."""
    c = small()
    half = (P + 1) // 2
    i = _sqrt(P - 1)
    attacks = [[half] * 4, [i, 1, 0, 0], [(P - 1) // 2, half, 0, 0], [half, half, half, P - 7]]
    rows = []
    for x in attacks:
        norm = sum(v * v for v in x) % P
        slack = (c.r2 - norm) % P
        row = raw_digits(c, x, slack)
        assert _norm_check(c, row) == 0  # the norm equation holds mod p
        rows.append(row)
    assert [sum(v * v for v in x) % P for x in attacks[:3]] == [1, 0, pow(2, P - 2, P)]
    ok, parts, _, _ = run(c, np.stack(rows), label="wrap")
    assert ok.tolist() == [False] * 4 and parts["v_is_zero"].tolist() == [False] * 4


def test_a_tampered_proof_share_is_refused_at_every_position():
    c = small()
    x = c.encode(valid_rows(c, 1, 11))
    n = c.proof_len
    inputs = np.repeat(x, n, axis=0)  # row j: the same report, its leader's proof share changed at j
    delta = _stream("delta").words(n) % np.uint64(P - 1) + np.uint64(1)

    def tamper(xs, ps):
        ps[-1][np.arange(n), np.arange(n)] = field.add(ps[-1][np.arange(n), np.arange(n)], delta)

    ok, parts, _, _ = run(c, inputs, 2, label="tamper-proof", tamper=tamper)
    assert not ok.any()
    ok, _, _, _ = run(c, inputs, 2, label="tamper-proof")
    assert ok.all()  # the same reports untouched


def test_a_tampered_input_share_after_proving_is_refused_at_every_position():
    c = small()
    x = c.encode(valid_rows(c, 1, 12))
    n = c.input_len
    inputs = np.repeat(x, 2 * n, axis=0)
    # rows 0..n-1: +1 at position j (often still a digit: only the proof gives it away);
    # rows n..2n-1: a random change
    delta = np.concatenate([np.ones(n, dtype=np.uint64), _stream("d").words(n) % np.uint64(P - 1) + np.uint64(1)])
    rows, cols = np.arange(2 * n), np.tile(np.arange(n), 2)

    def tamper(xs, ps):
        xs[0][rows, cols] = field.add(xs[0][rows, cols], delta)

    ok, parts, _, _ = run(c, inputs, 3, label="tamper-input", tamper=tamper)
    assert not ok.any()


def test_a_proof_replayed_with_another_input_is_refused():
    c = small()
    x = c.encode(valid_rows(c, 40, 13))
    jr = flp.joint_rand(c, report_ids(40, "replay"))
    proofs = flp.prove(c, x, jr, flp.prove_rand(c, 40, _stream("replay")))
    ok, _, _, _ = run(c, x, jr=jr, proofs=proofs, label="replay")
    assert ok.all()
    ok, parts, _, _ = run(c, np.roll(x, 1, axis=0), jr=jr, proofs=proofs, label="replay")  # valid inputs, others' proofs
    assert not ok.any()
    ok, _, _, _ = run(c, np.roll(x, 1, axis=0), jr=np.roll(jr, 1, axis=0), proofs=proofs, label="replay")
    assert not ok.any()  # with the joint randomness that belongs to the rows' new ids, too


def test_a_random_proof_for_a_far_away_vector_is_refused():
    c = small()
    far = np.stack([raw_digits(c, [10**9, -(10**9), 3, 0], 0) for _ in range(50)])
    forged = field.sample(_stream("forged"), 50 * c.proof_len).reshape(50, c.proof_len)
    ok, parts, _, _ = run(c, far, label="forged", proofs=forged)
    assert not ok.any()


def _crafted_range_attack():
    """RangeDigits(1 x 3 bits) as one ParallelSum(Range(2), 3) call: the check is
    v = R(d0) + r R(d1) + r^2 R(d2), R(d) = d^2 - d. Knowing r (min. polynomial
    X^2 - tr X + N over F_p), digits with (R(d0), R(d1), R(d2)) = lam (N, -tr, 1) make v = 0 while
    none is a bit. Returns (circuit, crafted input, the joint randomness it was made for)."""
    c = circuits.RangeDigits(width=1, digits=3, beta=2, count=3)
    assert c.checks == 1 and c.gadgets[0].calls == 1
    for label in range(100):
        jr = flp.joint_rand(c, report_ids(1, f"victim-{label}"))
        r0, r1 = int(jr[0, 0, 0]), int(jr[0, 0, 1])
        tr, norm = 2 * r0 % P, (r0 * r0 - 7 * r1 * r1) % P
        for lam in range(1, 50):
            targets = [lam * norm % P, -lam * tr % P, lam]
            if all(pow((1 + 4 * v) % P, (P - 1) // 2, P) == 1 for v in targets):
                digits = [(1 + _sqrt(1 + 4 * v)) * pow(2, P - 2, P) % P for v in targets]
                assert all((d * d - d) % P == v for d, v in zip(digits, targets))
                assert all(d > 1 for d in digits)
                return c, np.array([digits], dtype=np.uint64), jr
    raise AssertionError("no crafted input found")


def test_joint_randomness_of_another_report_refuses_an_input_crafted_for_its_own():
    c, crafted, jr_own = _crafted_range_attack()
    # with the joint randomness it was crafted for (a client that could choose r), it passes
    ok, parts, _, _ = run(c, crafted, jr=jr_own, label="crafted")
    assert ok.tolist() == [True]
    # the product derives r from the report id, which commits to the shares: the same input
    # under another report's r is refused, with the proof made for r_own (the gadget identity
    # fails at t) or made honestly for the new r (v != 0)
    jr_other = flp.joint_rand(c, report_ids(1, "another report"))
    proof_own = flp.prove(c, crafted, jr_own, flp.prove_rand(c, 1, _stream("p")))
    ok, parts, _, _ = run(c, crafted, jr=jr_other, proofs=proof_own, label="crafted")
    assert ok.tolist() == [False] and parts["v_is_zero"].tolist() == [True] and parts["gadgets"][0].tolist() == [False]
    ok, parts, _, _ = run(c, crafted, jr=jr_other, label="crafted-2")
    assert ok.tolist() == [False] and parts["v_is_zero"].tolist() == [False] and parts["gadgets"][0].tolist() == [True]


def test_the_joint_randomness_bound_is_met_exactly_by_the_crafted_input():
    """The formula: (C - 1) + (L - 1) = 0 + 2 values of r (out of p^2) let an invalid input of
    this circuit through; the crafted input passes for exactly r and its conjugate, and for no
    other r (tried: 200 random ones, and r's F_p part alone)."""
    c, crafted, jr_own = _crafted_range_attack()
    bound = c.soundness()["joint"] * P * P
    assert bound == 2
    conj = jr_own.copy()
    conj[0, 0] = field.ext_conj(jr_own[0, 0])
    others = np.repeat(jr_own, 201, axis=0)
    others[:200, 0] = field.sample_ext(_stream("r"), 200)
    others[200, 0, 1] = 0
    ok = [run(c, crafted, jr=j, label="exact")[0][0] for j in (jr_own, conj)]
    assert ok == [True, True]
    ok, _, _, _ = run(c, np.repeat(crafted, 201, axis=0), jr=others, label="exact")
    assert not ok.any()


def _ext_poly_mul(a: list, b: list) -> list:
    out = [(0, 0)] * (len(a) + len(b) - 1)
    for i, (a0, a1) in enumerate(a):
        for j, (b0, b1) in enumerate(b):
            c0, c1 = out[i + j]
            out[i + j] = ((c0 + a0 * b0 + 7 * a1 * b1) % P, (c1 + a0 * b1 + a1 * b0) % P)
    return out


def _ext(a0: int, a1: int) -> np.ndarray:
    return np.array([a0, a1], dtype=np.uint64)


def test_the_query_bound_is_met_exactly_by_a_cheating_prover():
    """The formula max_g D (P - 1) / (p^2 - p): here D = 2, P = 4, so 6 query points. For an
    invalid digit d = 2 the honest gadget polynomial q = R(f) has q(w) = R(2) = 2, so v != 0. The
    cheater sends q' = q + E with E(w) = -2 (now v = 0) and E vanishing at 6 points t_1..t_6
    of its choice (E = -2 prod (X - t_i) / prod (w - t_i), degree 6 = D (P - 1)): it is accepted
    exactly when the query point is one of them."""
    c = circuits.RangeDigits(width=1, digits=1, beta=2, count=1)
    g = c.gadgets[0]
    assert (g.gadget.degree, g.wire_len, g.poly_len) == (2, 4, 7)
    crafted = np.array([[2]], dtype=np.uint64)
    jr = flp.joint_rand(c, report_ids(1, "cheat"))
    proof = flp.prove(c, crafted, jr, flp.prove_rand(c, 1, _stream("cheat")))
    points = [tuple(int(v) for v in field.sample_ext(_stream(f"t{i}"), 1)[0]) for i in range(6)]
    w = ntt.root(4)
    e = [(1, 0)]
    denominator = np.array([1, 0], dtype=np.uint64)
    for t in points:
        e = _ext_poly_mul(e, [((-t[0]) % P, (-t[1]) % P), (1, 0)])
        denominator = field.ext_mul(denominator, _ext((w - t[0]) % P, (-t[1]) % P))
    scale = field.ext_mul(_ext(P - 2, 0), field.ext_inv(denominator))
    e = field.ext_mul(np.array(e, dtype=np.uint64), scale)  # (7, 2)
    cheat = proof.copy()
    coeffs = cheat[0, 2 * g.arity:].reshape(g.poly_len, 2)
    cheat[0, 2 * g.arity:] = field.add(coeffs, e).reshape(-1)
    assert c.soundness()["query"] * (P * P - P) == 6
    for t in points:
        ok, parts, _, _ = run(c, crafted, jr=jr, proofs=cheat, t=_ext(*t), label="cheat")
        assert ok.tolist() == [True]
    for i in range(20):
        t = field.sample_ext(_stream(f"other-t{i}"), 1)[0]
        ok, parts, _, _ = run(c, crafted, jr=jr, proofs=cheat, t=t, label="cheat")
        assert ok.tolist() == [False] and parts["v_is_zero"].tolist() == [True]
    ok, parts, _, _ = run(c, crafted, jr=jr, proofs=proof, t=_ext(*points[0]), label="cheat")
    assert ok.tolist() == [False] and parts["v_is_zero"].tolist() == [False]  # the honest proof of it


def test_soundness_figures_of_the_benchmark_circuits():
    """The per-report error of the circuits benchmarks/flp.py measures: below 2^-100 from the
    query point, below 2^-100 per joint-randomness draw, below 2^-60 after 2^40 tries."""
    for w, beta, q in ((11, 2, 22), (11, 16, 6), (11, 256, 3), (101, 2, 22), (101, 16, 6), (101, 256, 3)):
        c = circuits.NormBound(w=w, beta=beta, q=q, r2=(1 << 20) ** 2)
        s = c.soundness()
        assert s["query"] < 2.0 ** -100 and s["joint"] < 2.0 ** -100
        assert c.soundness(grinding=1 << 40)["total"] < 2.0 ** -60


# --- zero knowledge ------------------------------------------------------------------------------

def _top_bits(values: np.ndarray, bits: int = 3) -> np.ndarray:
    return (np.asarray(values, dtype=np.uint64) >> np.uint64(64 - bits)).astype(np.int64)


def _same_law(a: np.ndarray, b: np.ndarray) -> float:
    """The chi-square test's p-value that two samples of small integers have the same law."""
    cats = np.union1d(a, b)
    table = np.array([[np.sum(a == v) for v in cats], [np.sum(b == v) for v in cats]])
    return stats.chi2_contingency(table)[1]


def _verifier_samples(c, row: np.ndarray, draws: int, label: str, second_seeds: bool = True):
    """``draws`` independent proofs and sharings of one valid row (same report id, hence the
    same joint randomness; one query point): each server's verifier shares and their sum."""
    inputs = np.repeat(row[None, :], draws, axis=0)
    jr = np.repeat(flp.joint_rand(c, report_ids(1, "zk")), draws, axis=0)
    pr = flp.prove_rand(c, draws, _stream(label))
    if not second_seeds:
        pr[:, 1::2] = 0  # b_j = 0: one F_p seed per wire (every gadget's block starts at an even offset)
    proofs = flp.prove(c, inputs, jr, pr)
    t = flp.query_point(hashlib.sha256(b"zk-t").digest())
    _, parts, shares, verifier = run(c, inputs, 2, label=label, jr=jr, proofs=proofs, t=t)
    return shares, verifier, flp.Query(c, t)


def test_one_servers_verifier_share_and_the_analyzers_sum_have_the_same_law_for_two_rows():
    c = small()
    row_a = c.encode(np.array([[0, 0, 0, 0]]))[0]
    row_b = c.encode(np.array([[-15, 7, 0, 3]]))[0]
    draws = 3000
    shares_a, sum_a, _ = _verifier_samples(c, row_a, draws, "zk-a")
    shares_b, sum_b, _ = _verifier_samples(c, row_b, draws, "zk-b")
    p_values = []
    for server in (0, 1):  # the helper (seed) and the leader
        for k in range(c.verifier_len):
            for comp in (0, 1):
                p_values.append(_same_law(_top_bits(shares_a[server][:, k, comp]),
                                          _top_bits(shares_b[server][:, k, comp])))
    assert min(p_values) > 1e-4, min(p_values)
    # the sum: v = 0 always, f(t) uniform on F_(p^2) (the same law for both rows), q(t) = G(f(t))
    assert (sum_a[:, 0] == 0).all() and (sum_b[:, 0] == 0).all()
    for k in range(1, c.verifier_len):
        for comp in (0, 1):
            a, b = _top_bits(sum_a[:, k, comp]), _top_bits(sum_b[:, k, comp])
            assert _same_law(a, b) > 1e-4
            assert stats.chisquare(np.bincount(a, minlength=8)).pvalue > 1e-4  # uniform


def test_one_seed_per_wire_would_leak_an_f_p_linear_function_of_the_wire_values():
    """The control that shows why each wire has two seeds. With one F_p seed a_j, f_j(t) =
    L_0(t) a_j + c_j lies on a line in F_(p^2), and phi(f_j(t)) = Im(f_j(t) conj(L_0(t))) does
    not depend on a_j: it is a fixed function of the input's wire values, different for two
    rows. With the second seed it is uniform for both."""
    c = small()
    row_a = c.encode(np.array([[0, 0, 0, 0]]))[0]
    row_b = c.encode(np.array([[-15, 7, 0, 3]]))[0]
    draws = 400

    def phi(verifier, query, gadget_col, position):
        l0 = query.lagrange[c.gadgets[0].wire_len][0]
        f = verifier[:, gadget_col + position]
        return field.ext_mul(f, field.ext_conj(l0))[:, 1]

    leaky = [phi(*_verifier_samples(c, row, draws, f"one-{i}", second_seeds=False)[1:], 1, 0)
             for i, row in enumerate((row_a, row_b))]
    assert len(set(leaky[0].tolist())) == 1 and len(set(leaky[1].tolist())) == 1  # constant per row
    assert leaky[0][0] != leaky[1][0]  # and they tell the rows apart
    sound = [phi(*_verifier_samples(c, row, draws, f"two-{i}")[1:], 1, 0) for i, row in enumerate((row_a, row_b))]
    assert all(len(set(s.tolist())) == draws for s in sound)
    assert _same_law(_top_bits(sound[0]), _top_bits(sound[1])) > 1e-4


# --- randomness, sharing, shapes --------------------------------------------------------------------

def test_joint_randomness_query_point_and_helper_shares_follow_their_definitions():
    c = small()
    ids = report_ids(5, "definitions")
    jr = flp.joint_rand(c, ids)
    nonce = hashlib.sha256(b"dpsketch/joint/1").digest()[:12]
    for i in range(5):
        key = hashlib.sha256(b"dpsketch/joint/1" + ids[i].tobytes()).digest()
        assert jr[i].reshape(-1).tolist() == _expand_reference(key, 2 * c.joint_rand_len, nonce)
    seed = bytes(range(32))
    pairs = _expand_reference(seed, 16, hashlib.sha256(b"dpsketch/query/1").digest()[:12])
    first = next(i for i in range(8) if pairs[2 * i + 1])
    assert flp.query_point(seed).tolist() == pairs[2 * first:2 * first + 2]
    seeds = np.frombuffer(bytes(range(64)), dtype=np.uint8).reshape(2, 32)
    xs, ps = flp.expand_share(c, seeds)
    for i in range(2):
        both = _expand_reference(seeds[i].tobytes(), c.input_len + c.proof_len,
                                 hashlib.sha256(b"dpsketch/flp-share/1").digest()[:12])
        assert xs[i].tolist() == both[:c.input_len] and ps[i].tolist() == both[c.input_len:]


def test_shares_add_up_and_a_helper_costs_32_bytes():
    c = small()
    inputs = c.encode(valid_rows(c, 20, 21))
    jr = flp.joint_rand(c, report_ids(20, "sh"))
    proofs = flp.prove(c, inputs, jr, flp.prove_rand(c, 20, _stream("sh")))
    shares = flp.share_proofs(flp.share_inputs(c, inputs, 3, _stream("sh2")), proofs)
    assert [s.shape for s in shares.helper_seeds] == [(20, 32), (20, 32)]
    helpers = [flp.expand_share(c, s) for s in shares.helper_seeds]
    assert (flp.reconstruct([h[0] for h in helpers] + [shares.leader_inputs]) == inputs).all()
    assert (flp.reconstruct([h[1] for h in helpers] + [shares.leader_proofs]) == proofs).all()


def test_shapes_and_non_canonical_elements_are_refused():
    c = small()
    inputs = c.encode(valid_rows(c, 3, 22))
    jr = flp.joint_rand(c, report_ids(3, "shape"))
    pr = flp.prove_rand(c, 3, _stream("shape"))
    with pytest.raises(ValueError):
        flp.prove(c, inputs[:, :-1], jr, pr)
    with pytest.raises(ValueError):
        flp.prove(c, inputs, jr[:2], pr)
    bad = inputs.copy()
    bad[0, 0] = np.uint64(P)
    with pytest.raises(field.FieldError):
        flp.prove(c, bad, jr, pr)
    proofs = flp.prove(c, inputs, jr, pr)
    with pytest.raises(ValueError):
        flp.query(c, inputs, proofs, jr, np.array([5, 0], dtype=np.uint64), 2)  # t in F_p
    with pytest.raises(ValueError):
        circuits.NormBound(w=4, beta=2, q=32, r2=10)  # w H^2 = 2^64 would wrap around p
    with pytest.raises(ValueError):
        c.encode(np.array([[17, 17, 0, 0]]))  # |x|^2 = 578 > 300
    with pytest.raises(ValueError):
        c.encode(np.array([[32, 0, 0, 0]]))  # x_i >= H


# --- test vectors ---------------------------------------------------------------------------------

def _ints(decimals: list[str]) -> np.ndarray:
    return np.array([int(s) for s in decimals], dtype=np.uint64)


def _pairs(decimals: list[list[str]]) -> np.ndarray:
    return np.array([[int(a), int(b)] for a, b in decimals], dtype=np.uint64)


def test_vectors_match_their_generator_and_verify():
    spec = importlib.util.spec_from_file_location("make_flp_vectors", ROOT / "scripts" / "make_flp_vectors.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    stored = (ROOT / "conformance" / "flp.json").read_text()
    assert generator.render() == stored
    doc = json.loads(stored)
    c = generator.circuit()
    assert [v["decision"] for v in doc["vectors"]] == [True, True, False]
    for v in doc["vectors"]:
        key = hashlib.sha256(b"dpsketch/joint/1" + bytes.fromhex(v["report_id"])).digest()
        assert [int(x) for pair in v["joint_rand"] for x in pair] == _expand_reference(
            key, 2 * c.joint_rand_len, hashlib.sha256(b"dpsketch/joint/1").digest()[:12])
        servers = [(_ints(xs), _ints(ps)) for xs, ps in zip(v["helper_input_shares"], v["helper_proof_shares"])]
        servers.append((_ints(v["leader_input_share"]), _ints(v["leader_proof_share"])))
        assert (flp.reconstruct([s[0] for s in servers]) == _ints(v["input"])).all()
        assert (flp.reconstruct([s[1] for s in servers]) == _ints(v["proof"])).all()
        summed = flp.reconstruct([_pairs(s) for s in v["verifier_shares"]])
        assert (summed == _pairs(v["verifier"])).all()
        assert bool(flp.decide(c, summed[None], _pairs(v["joint_rand"])[None])[0]) is v["decision"]
