"""F_p (p = 2^64 - 2^32 + 1), F_(p^2) and the NTT (dpsketch/protocol/field.py, ntt.py) against
Python's integers: every operation on edge values (0, 1, p - 1, the 32-bit boundaries, the
largest canonical values just below 2^64) and random ones, in both implementations (the numpy
reference and the compiled loops); the field's constants (7 generates F_p^*, so it is not a
square, and X^2 - 7 is irreducible; the root of unity has order exactly 2^32); NTT round trips
and a schoolbook DFT; polynomial products against the naive convolution; Lagrange weights;
sampling and seed expansion by rejection, including the rare rejected words; the centred
fixed-point encoding."""

from __future__ import annotations

import contextlib
import hashlib
import random

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from dpsketch.protocol import chacha, field, ntt
from dpsketch.protocol.keystream import Keystream

P = field.P
EDGE = [0, 1, 2, 3, 7, P - 1, P - 2, P - 7, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, (1 << 63) - 1, 1 << 63,
        (1 << 63) + 1, P - (1 << 32), (1 << 64) - (1 << 33), P // 2, P // 2 + 1]


def _values(count: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return EDGE + [rnd.randrange(P) for _ in range(count)]


@pytest.fixture(params=["reference", "compiled"])
def impl(request):
    """Run the test with the numpy reference, then with the compiled loops."""
    if request.param == "compiled":
        field.FIELD.require()
        yield contextlib.nullcontext
    else:
        yield field.FIELD.reference


def arr(values) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


# --- the field's constants ------------------------------------------------------------------------

def test_constants_generator_non_square_and_roots_of_unity():
    assert P == 18446744069414584321
    factors = field.ORDER_FACTORS
    rest = P - 1
    for f in factors:  # p - 1 = 2^32 * 3 * 5 * 17 * 257 * 65537, each a prime
        assert all(f % d for d in range(2, int(f ** 0.5) + 1))
        while rest % f == 0:
            rest //= f
    assert rest == 1 and (P - 1) % (1 << 32) == 0 and ((P - 1) >> 32) % 2 == 1
    assert all(pow(7, (P - 1) // f, P) != 1 for f in factors)  # 7 generates F_p^*
    assert pow(7, (P - 1) // 2, P) == P - 1  # Euler: 7 is not a square, so X^2 - 7 is irreducible
    assert pow(ntt.ROOT, 1 << 31, P) == P - 1 and pow(ntt.ROOT, 1 << 32, P) == 1  # order exactly 2^32
    for k in (1, 5, 20, 32):
        w = ntt.root(1 << k)
        assert pow(w, 1 << k, P) == 1 and pow(w, 1 << (k - 1), P) == P - 1
    assert ntt.root(1 << 10) ** 2 % P == ntt.root(1 << 9)  # nested domains
    with pytest.raises(ValueError):
        ntt.root(3)


def test_extension_is_a_field_and_x_squared_is_7():
    x = field.ext(0, 1)
    assert field.ext_mul(x, x).tolist() == [7, 0]
    # Frobenius: a^p = conj(a) for every a, which holds because 7^((p-1)/2) = -1
    a = field.ext(arr(_values(6, 1)[:24]), arr(_values(6, 2)[-24:]))
    assert (field.ext_power(a, P) == field.ext_conj(a)).all()
    nonzero = a[(a != 0).any(axis=1)]
    assert (field.ext_mul(nonzero, field.ext_inv(nonzero)) == field.ext(1)).all()
    with pytest.raises(ZeroDivisionError):
        field.ext_inv(field.ext([0, 3], [0, 5]))


# --- F_p arithmetic against Python integers ----------------------------------------------------

def test_arithmetic_matches_python_integers(impl):
    vals = _values(40, 3)
    a = arr([x for x in vals for _ in vals])
    b = arr([y for _ in vals for y in vals])
    pairs = list(zip(a.tolist(), b.tolist()))
    with impl():
        assert field.add(a, b).tolist() == [(x + y) % P for x, y in pairs]
        assert field.sub(a, b).tolist() == [(x - y) % P for x, y in pairs]
        assert field.mul(a, b).tolist() == [x * y % P for x, y in pairs]
        assert field.neg(a).tolist() == [-x % P for x in a.tolist()]
        assert field.power(a[:200], 5).tolist() == [pow(x, 5, P) for x in a[:200].tolist()]
        assert field.power(a[:50], P - 1).tolist() == [pow(x, P - 1, P) for x in a[:50].tolist()]
        nz = arr([x for x in vals if x])
        assert field.batch_inv(nz).tolist() == [pow(x, P - 2, P) for x in nz.tolist()]
        with pytest.raises(ZeroDivisionError):
            field.batch_inv(arr([3, 0, 5]))
        # broadcasting and scalars
        assert field.mul(a[:5], np.uint64(P - 1)).tolist() == [x * (P - 1) % P for x in a[:5].tolist()]
        assert int(field.add(np.uint64(P - 1), np.uint64(P - 1))) == P - 2


def test_sums_and_products_of_many_terms(impl):
    """total, matmul, matmul_t, dot, weighted_lanes, sparse_apply and horner: sums of many
    products of the largest elements (the unreduced accumulators must not overflow)."""
    rnd = random.Random(4)
    m, n, k = 9, 300, 3
    A = [[rnd.choice([P - 1, P - 2, rnd.randrange(P)]) for _ in range(n)] for _ in range(m)]
    B = [[rnd.choice([P - 1, rnd.randrange(P)]) for _ in range(k)] for _ in range(n)]
    want = [[sum(A[i][j] * B[j][c] for j in range(n)) % P for c in range(k)] for i in range(m)]
    with impl():
        assert field.total(arr(A), axis=1).tolist() == [sum(r) % P for r in A]
        assert field.total(arr([[P - 1] * 5000]), axis=1).tolist() == [5000 * (P - 1) % P]
        assert field.matmul(arr(A), arr(B)).tolist() == want
        assert field.matmul_t(arr(A).T, arr(B)).tolist() == want
        big = arr([[P - 1] * 40] * 20)  # 20 rows, k = 2: the transposed path
        assert field.matmul(big, arr([[P - 1, 1]] * 40)).tolist() == [[40 % P, 40 * (P - 1) % P]] * 20
        assert field.dot(arr(A), arr([b[0] for b in B])).tolist() == [w[0] for w in want]
        r = arr([[[rnd.randrange(P) for _ in range(m)] for _ in range(n)] for _ in range(2)])  # (2, n, m)
        w = arr([[rnd.randrange(P) for _ in range(m)] for _ in range(n)])  # (n, m)
        got = field.weighted_lanes(r, w)
        assert got.tolist() == [[sum(int(w[l, i]) * int(r[g, l, i]) for l in range(n)) % P for i in range(m)]
                                for g in range(2)]
        # a sparse matrix (CSR): rows 0 and 2 with entries, row 1 empty
        indptr, indices, data = np.array([0, 2, 2, 5]), np.array([1, 4, 0, 1, 299]), arr([P - 1, 2, 3, P - 5, 9])
        xt = arr(A).T  # (n, m): m lanes
        got = field.sparse_apply(xt, indptr, indices, data)
        rows = [[(1, P - 1), (4, 2)], [], [(0, 3), (1, P - 5), (299, 9)]]
        assert got.tolist() == [[sum(v * A[i][c] for c, v in row) % P for i in range(m)] for row in rows]
        coeffs = [rnd.randrange(P) for _ in range(17)]
        x = arr(_values(30, 5))
        assert field.horner(arr(coeffs), x).tolist() == [
            sum(c * pow(v, e, P) for e, c in enumerate(coeffs)) % P for v in x.tolist()]


def test_extension_arithmetic(impl):
    rnd = random.Random(6)
    a = [(rnd.choice(EDGE + [rnd.randrange(P)]), rnd.choice(EDGE + [rnd.randrange(P)])) for _ in range(300)]
    b = [(rnd.choice(EDGE + [rnd.randrange(P)]), rnd.choice(EDGE + [rnd.randrange(P)])) for _ in range(300)]

    def mul(x, y):
        return ((x[0] * y[0] + 7 * x[1] * y[1]) % P, (x[0] * y[1] + x[1] * y[0]) % P)

    with impl():
        assert [tuple(v) for v in field.ext_mul(arr(a), arr(b)).tolist()] == [mul(x, y) for x, y in zip(a, b)]
        e = 11
        want = []
        for x in a[:20]:
            acc = (1, 0)
            for _ in range(e):
                acc = mul(acc, x)
            want.append(acc)
        assert [tuple(v) for v in field.ext_power(arr(a[:20]), e).tolist()] == want
        pw = field.ext_powers(arr(a[:3]), 5)
        assert [tuple(v) for v in pw[2].tolist()] == [(1, 0), a[2], mul(a[2], a[2]), mul(mul(a[2], a[2]), a[2]),
                                                     mul(mul(mul(a[2], a[2]), a[2]), a[2])]
        # each lane its own point: sum_j c_j t^j
        m, n = 7, 9
        coeffs = [[(rnd.randrange(P), rnd.randrange(P)) for _ in range(m)] for _ in range(n)]  # (n, m) pairs
        pts = [(rnd.randrange(P), rnd.randrange(P)) for _ in range(m)]
        got = field.ext_horner_lanes(arr(coeffs).transpose(0, 2, 1), arr(pts).T)
        for i in range(m):
            acc = (0, 0)
            for j in range(n - 1, -1, -1):
                acc = mul(acc, pts[i])
                acc = ((acc[0] + coeffs[j][i][0]) % P, (acc[1] + coeffs[j][i][1]) % P)
            assert (int(got[0, i]), int(got[1, i])) == acc


def test_elements_refuses_non_canonical_values():
    assert field.elements([0, P - 1]).tolist() == [0, P - 1]
    for bad in ([P], [(1 << 64) - 1], [-1], [1.5], ["x"]):
        with pytest.raises(field.FieldError):
            field.elements(np.array(bad, dtype=object) if isinstance(bad[0], str) else bad)
    with pytest.raises(field.FieldError):
        field.elements(np.array([P], dtype=np.uint64))
    assert field.from_wire(field.to_wire(arr([5, P - 1]))).tolist() == [5, P - 1]
    with pytest.raises(field.FieldError):
        field.from_wire((P).to_bytes(8, "little"))


# --- NTT and polynomials ----------------------------------------------------------------------------

def _dft(a: list[int], w: int) -> list[int]:
    n = len(a)
    return [sum(a[j] * pow(w, i * j, P) for j in range(n)) % P for i in range(n)]


def test_ntt_matches_schoolbook_dft_and_inverts(impl):
    rnd = random.Random(7)
    with impl():
        for n in (1, 2, 4, 8, 16, 64):
            rows = [[rnd.choice([0, 1, P - 1, rnd.randrange(P)]) for _ in range(n)] for _ in range(10)]
            got = ntt.ntt(arr(rows))
            assert got.tolist() == [_dft(r, ntt.root(n)) for r in rows]
            assert ntt.intt(got).tolist() == rows
            cols = ntt.ntt_columns(arr(rows).T)  # the same along axis 0
            assert cols.T.tolist() == got.tolist()
            assert ntt.ntt_columns(cols, inverse=True).T.tolist() == rows
        big = arr([rnd.randrange(P) for _ in range(1 << 12)])
        assert (ntt.intt(ntt.ntt(big)) == big).all()
        with pytest.raises(ValueError):
            ntt.ntt(arr([1, 2, 3]))


def test_ntt_of_the_largest_size_round_trips():
    """A transform of 2^20 points (the largest) and back, compiled (the reference takes the same
    path as smaller sizes); its values at indices 0, 1 and 5 checked as dot products with the
    powers of w_(2^20) (field.dot, no NTT involved)."""
    field.FIELD.require()
    n = ntt.MAX_SIZE
    a = np.random.default_rng(8).integers(0, P, n, dtype=np.uint64)  # test data
    values = ntt.ntt(a)
    w = ntt.root(n)
    for i in (0, 1, 5):
        assert int(values[i]) == int(field.dot(a, ntt._powers(pow(w, i, P), n)))
    assert (ntt.intt(values) == a).all()
    with pytest.raises(ValueError):
        ntt.ntt(np.zeros(2 * n, dtype=np.uint64))


def test_poly_mul_matches_naive_convolution(impl):
    rnd = random.Random(9)
    with impl():
        for la, lb in ((1, 1), (3, 5), (17, 16), (64, 65)):
            a = [[rnd.randrange(P) for _ in range(la)] for _ in range(3)]
            b = [[rnd.randrange(P) for _ in range(lb)] for _ in range(3)]
            want = [[sum(x[i] * y[k - i] for i in range(la) if 0 <= k - i < lb) % P for k in range(la + lb - 1)]
                    for x, y in zip(a, b)]
            assert ntt.poly_mul(arr(a), arr(b)).tolist() == want


def _ext_eval(coeffs: list, t: tuple[int, int]) -> tuple[int, int]:
    acc = (0, 0)
    for c in reversed(coeffs):
        c0, c1 = (c, 0) if isinstance(c, int) else c
        acc = ((acc[0] * t[0] + 7 * acc[1] * t[1] + c0) % P, (acc[0] * t[1] + acc[1] * t[0] + c1) % P)
    return acc


def test_evaluation_at_a_point_of_the_extension_and_lagrange_weights(impl):
    rnd = random.Random(10)
    t = (rnd.randrange(P), rnd.randrange(1, P))
    with impl():
        polys = [[rnd.randrange(P) for _ in range(13)] for _ in range(20)]
        got = ntt.evaluate(arr(polys), arr(t))
        assert [tuple(v) for v in got.tolist()] == [_ext_eval(f, t) for f in polys]
        ext_polys = [[(rnd.randrange(P), rnd.randrange(P)) for _ in range(6)] for _ in range(20)]
        got = ntt.evaluate_ext(arr(ext_polys), arr(t))
        assert [tuple(v) for v in got.tolist()] == [_ext_eval(f, t) for f in ext_polys]
        for n in (1, 2, 8, 64):
            weights = ntt.lagrange_weights(n, arr(t))
            f = [[rnd.randrange(P) for _ in range(n)] for _ in range(5)]  # degree < n
            on_domain = ntt.ntt(arr(f))  # f(w^i)
            at_t = field.matmul(on_domain, weights)  # sum_i L_i(t) f(w^i)
            assert [tuple(v) for v in at_t.tolist()] == [_ext_eval(c, t) for c in f]
        # at a point of the domain: the indicator of that point
        w8 = ntt.root(8)
        assert ntt.lagrange_weights(8, arr((pow(w8, 3, P), 0)))[:, 0].tolist() == [0, 0, 0, 1, 0, 0, 0, 0]


# --- sampling by rejection -------------------------------------------------------------------------

class _Words:
    """A stand-in stream that hands out given 64-bit words, in order."""

    def __init__(self, words: list[int]):
        self.words_left = list(words)

    def words(self, count: int) -> np.ndarray:
        out, self.words_left = self.words_left[:count], self.words_left[count:]
        return arr(out)


def test_sample_skips_words_at_or_above_p_in_stream_order():
    words = [5, P, 6, (1 << 64) - 1, P - 1, P + 1, 7, 8, 9]
    assert field.sample(_Words(words), 5).tolist() == [5, 6, P - 1, 7, 8]  # three skipped, topped up
    s = field.sample(Keystream.from_key(bytes(32)), 1000)
    assert s.dtype == np.uint64 and len(s) == 1000 and (s < np.uint64(P)).all()
    again = Keystream.from_key(bytes(32)).words(1000)
    assert (s == again).all()  # no word of this stream is >= p: the first 1000 words as they are


def _expand_reference(seed: bytes, count: int, nonce: bytes) -> list[int]:
    """The definition, with ``cryptography``'s ChaCha20: consecutive little-endian words, those
    >= p skipped."""
    cipher = Cipher(algorithms.ChaCha20(seed, b"\0\0\0\0" + nonce), mode=None).encryptor()
    out: list[int] = []
    while len(out) < count:
        word = int.from_bytes(cipher.update(bytes(8)), "little")
        if word < P:
            out.append(word)
    return out


def test_expand_matches_the_definition_and_handles_rejections(monkeypatch):
    nonce = hashlib.sha256(b"dpsketch/test/1").digest()[:12]
    seeds = np.frombuffer(bytes(range(256)) * 2, dtype=np.uint8).reshape(-1, 32)[:9].copy()
    got = field.expand(seeds, 37, nonce)
    assert got.tolist() == [_expand_reference(bytes(s), 37, nonce) for s in seeds]
    # rejected words are too rare to meet by chance (2^-32 each): plant them in the keystream,
    # a few in some rows and in one row more than the spare words drawn (so that row is drawn again)
    real = chacha.keystream

    def planted(keys, nonce_, nbytes, *args, **kwargs):
        out = real(keys, nonce_, nbytes, *args, **kwargs).copy()
        words = out.view("<u8")
        for i, key in enumerate(np.asarray(keys).reshape(-1, 32)):
            row = [bytes(s) for s in seeds].index(bytes(key))
            if row == 1:
                words[i, 0] = P  # one rejection
            elif row == 2:
                words[i, [3, 5]] = (1 << 64) - 1  # two
            elif row == 4:
                words[i, :min(words.shape[1], 30)] = P + 5  # thirty: more than the spare words drawn
        return out

    monkeypatch.setattr(chacha, "keystream", planted)
    got = field.expand(seeds[:6], 12, nonce)
    monkeypatch.setattr(chacha, "keystream", real)
    plain = [_expand_reference(bytes(s), 60, nonce) for s in seeds[:6]]
    assert got[0].tolist() == plain[0][:12] and got[3].tolist() == plain[3][:12] and got[5].tolist() == plain[5][:12]
    assert got[1].tolist() == plain[1][1:13]
    assert got[2].tolist() == [w for i, w in enumerate(plain[2][:14]) if i not in (3, 5)]
    assert got[4].tolist() == plain[4][30:42]


# --- encoding --------------------------------------------------------------------------------------

def test_centred_integer_and_fixed_point_encoding():
    half = (P - 1) // 2
    ints = np.array([0, 1, -1, 5, -5, half, -half, (1 << 62), -(1 << 62)], dtype=np.int64)
    enc = field.encode_int(ints)
    assert enc.tolist() == [int(v) % P for v in ints.tolist()]
    assert field.decode_int(enc).tolist() == ints.tolist()
    assert field.decode_int(arr([half + 1, P - 1])).tolist() == [-half, -1]
    with pytest.raises(field.FieldError):
        field.encode_int(np.array([half + 1], dtype=np.int64))
    with pytest.raises(field.FieldError):
        field.encode_int(np.array([-half - 1], dtype=np.int64))
    x = np.array([0.0, 1.5, -1.5, 3.0, -2.25, 0.5 ** 20])
    enc = field.encode_fixed(x, 20, 4.0)
    assert enc.tolist() == [round(v * 2 ** 20) % P for v in x.tolist()]
    assert field.decode_fixed(enc, 20).tolist() == x.tolist()
    # a sum of encoded values decodes to the sum (the centred representative)
    total = field.total(field.encode_fixed(np.array([-3.0, 1.25, -0.5]), 20, 4.0), axis=0)
    assert float(field.decode_fixed(total, 20)) == -2.25
    with pytest.raises(ValueError):
        field.encode_fixed(np.array([5.0]), 20, 4.0)
