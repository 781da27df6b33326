"""Number-theoretic transforms and polynomials over F_p (field.py), for the validity proofs.

Roots of unity. 7 generates F_p^* (order p - 1 = 2^32 * 3 * 5 * 17 * 257 * 65537), so
ROOT = 7^((p - 1) / 2^32) mod p is a primitive 2^32-th root of unity, and the domain of size
n = 2^k (k <= 32) is {w_n^i : i < n} with w_n = ROOT^(2^(32 - k)): every domain is a subgroup
of the next one, w_(2n)^2 = w_n. tests/test_field.py checks the orders.

Conventions. A polynomial is its coefficient vector, lowest degree first, along the last axis
of an array (many polynomials at once: one per row). ``ntt(a)`` evaluates on the domain of size
n = a.shape[-1]: A_i = sum_j a_j w_n^(ij); ``intt`` inverts it (1/n included). Transforms run
for sizes up to :data:`MAX_SIZE` = 2^20 (radix 2, decimation in time, the butterflies of a stage
innermost).

Evaluation at a point t of F_(p^2) (outside F_p in the proofs) in two ways: from coefficients
(:func:`evaluate`: the powers of t once, then one product over all rows; Horner's rule per row
would cost 4 products per coefficient in F_(p^2) against these 2) and from the values on a
domain (:func:`lagrange_weights`: the barycentric weights L_i(t) of the domain, so that
f(t) = sum_i L_i(t) f(w^i) is one weighted sum per polynomial). I/O-free.
"""

from __future__ import annotations

import functools

import numpy as np

from . import field

#: a primitive 2^32-th root of unity: 7^((p - 1) / 2^32)
ROOT = pow(field.GENERATOR, (field.P - 1) >> field.TWO_ADICITY, field.P)
MAX_SIZE = 1 << 20


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def root(n: int) -> int:
    """w_n: a primitive n-th root of unity, n a power of two up to 2^32."""
    if not is_power_of_two(n) or n > 1 << field.TWO_ADICITY:
        raise ValueError(f"no NTT domain of size {n}: a power of two up to 2^32")
    return pow(ROOT, (1 << field.TWO_ADICITY) // n, field.P)


def domain(n: int) -> np.ndarray:
    """(w_n^0, ..., w_n^(n-1))."""
    return _powers(root(n), n)


def _powers(x: int, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint64)
    if n:
        out[0] = 1
        step = 1
        while step < n:  # doubling: out[step:2 step] = out[:step] x^step, one vector product each
            take = min(step, n - step)
            out[step:step + take] = field.mul(out[:take], np.uint64(pow(x, step, field.P)))
            step += take
    return out


@functools.cache
def _table(n: int, inverse: bool) -> np.ndarray:
    """The twiddles of every stage, stage of half-size h at [h - 1, 2h - 1): w_(2h)^(+-j)."""
    w = root(n)
    if inverse:
        w = pow(w, field.P - 2, field.P)
    full = _powers(w, max(n // 2, 1))
    parts = [full[:: n // (2 * h)][:h] for h in (1 << s for s in range(n.bit_length() - 1))]
    table = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)
    table.setflags(write=False)
    return table


@functools.cache
def coset_twists(n: int, k: int) -> np.ndarray:
    """(k / n - 1, n): row s - 1 holds w_k^(s i), i < n, for the cosets s = 1 .. k/n - 1 of the
    domain of size n in the domain of size k (:func:`extend_columns`)."""
    w = root(k)
    out = np.stack([_powers(pow(w, s, field.P), n) for s in range(1, k // n)]) if k > n else np.zeros((0, n), np.uint64)
    out.setflags(write=False)
    return out


def extend_columns(values, k: int) -> np.ndarray:
    """The values on the domain of size k (k / n times the size n of axis 0) of the polynomials
    of degree < n whose values on the domain of size n are the columns of ``values`` (n, ...):
    (k, ...), the same as the transform of their coefficients padded with zeros to k, at less
    cost. The point w_k^(s + (k/n) j) lies in the coset w_k^s of the small domain: s = 0 is the
    small domain itself (the values, copied), and each other coset is one size-n transform of
    the coefficients twisted by w_k^(s i) (the k-point transform's first log2(k/n) stages, done
    on zeros, are skipped)."""
    vals = np.ascontiguousarray(values, dtype=np.uint64)
    n = vals.shape[0]
    if not is_power_of_two(k) or k % n:
        raise ValueError(f"extend a domain of size {n} to a multiple that is a power of two, got {k}")
    ratio = k // n
    out = np.empty((n, ratio) + vals.shape[1:], dtype=np.uint64)
    out[:, 0] = vals
    if ratio > 1:
        coeffs = ntt_columns(vals, inverse=True)
        flat = coeffs.reshape(n, -1)
        for s, twist in enumerate(coset_twists(n, k), start=1):
            out[:, s] = ntt_columns(field.mul(flat, twist[:, None]), in_place=True).reshape(vals.shape)
    return out.reshape((k,) + vals.shape[1:])


def _transform(a, inverse: bool) -> np.ndarray:
    a = np.asarray(a, dtype=np.uint64)
    n = a.shape[-1]
    if not is_power_of_two(n) or n > MAX_SIZE:
        raise ValueError(f"NTT sizes are powers of two up to 2^20, got {n}")
    rows = a.reshape(-1, n)
    if n == 1 or not len(rows):
        return a.copy()
    scale = pow(n, field.P - 2, field.P) if inverse else 1
    return field.ntt_rows(rows, _table(n, inverse), scale).reshape(a.shape)


def ntt(a) -> np.ndarray:
    """The values of the polynomials a (..., n) on the domain of size n: A_i = sum_j a_j w_n^(ij)."""
    return _transform(a, False)


def intt(values) -> np.ndarray:
    """The coefficients (..., n) of the polynomials of degree < n with these values on the domain."""
    return _transform(values, True)


def poly_mul(a, b) -> np.ndarray:
    """The products of the polynomials a (..., la) and b (..., lb) (broadcast over the leading
    axes), of length la + lb - 1, via NTTs of the next power of two."""
    a = np.asarray(a, dtype=np.uint64)
    b = np.asarray(b, dtype=np.uint64)
    la, lb = a.shape[-1], b.shape[-1]
    out_len = la + lb - 1
    n = next_power_of_two(out_len)
    lead = np.broadcast_shapes(a.shape[:-1], b.shape[:-1])
    pa = np.zeros(lead + (n,), dtype=np.uint64)
    pb = np.zeros(lead + (n,), dtype=np.uint64)
    pa[..., :la] = a
    pb[..., :lb] = b
    return intt(field.mul(ntt(pa), ntt(pb)))[..., :out_len]


def ext_point(t) -> np.ndarray:
    t = np.asarray(t, dtype=np.uint64)
    if t.shape != (2,):
        raise ValueError("a point of F_(p^2) is a pair (c0, c1)")
    return t


def powers(t, n: int) -> np.ndarray:
    """(t^0, ..., t^(n-1)) for one point of F_(p^2): (n, 2)."""
    return field.ext_powers(ext_point(t), n)


def evaluate(coeffs, t, t_powers: np.ndarray | None = None) -> np.ndarray:
    """The values at one point t of F_(p^2) of many polynomials: coeffs (..., n) with F_p
    coefficients, or (..., n, 2) with F_(p^2) ones -> (..., 2). ``t_powers``: the powers of t
    (:func:`powers`, at least n of them), when the caller evaluates many batches at one t."""
    return _evaluate(np.asarray(coeffs, dtype=np.uint64), t, t_powers, coeffs_ext=False)


def evaluate_ext(coeffs, t, t_powers: np.ndarray | None = None) -> np.ndarray:
    """As :func:`evaluate` for polynomials with F_(p^2) coefficients, coeffs (..., n, 2)."""
    return _evaluate(np.asarray(coeffs, dtype=np.uint64), t, t_powers, coeffs_ext=True)


def _evaluate(c: np.ndarray, t, t_powers, coeffs_ext: bool) -> np.ndarray:
    n = c.shape[-2] if coeffs_ext else c.shape[-1]
    tp = powers(t, n) if t_powers is None else np.asarray(t_powers, dtype=np.uint64)[:n]
    if not coeffs_ext:
        flat: np.ndarray = c.reshape(-1, n)
        return field.matmul(flat, tp).reshape(c.shape[:-1] + (2,))
    flat = c.reshape(-1, n, 2)
    c0 = np.ascontiguousarray(flat[:, :, 0])
    c1 = np.ascontiguousarray(flat[:, :, 1])
    u = field.matmul(c0, tp)  # c0(t): (c0 . T0, c0 . T1)
    v = field.matmul(c1, tp)  # c1(t)
    # c(t) = c0(t) + X c1(t), X (a + b X) = 7 b + a X
    out = field.add(u, np.stack([field.mul(np.uint64(7), v[:, 1]), v[:, 0]], axis=-1))
    return out.reshape(c.shape[:-2] + (2,))


def lagrange_weights(n: int, t) -> np.ndarray:
    """The weights L_i(t), i < n, of the domain of size n at t in F_(p^2), (n, 2): for every
    polynomial f of degree < n, f(t) = sum_i L_i(t) f(w_n^i). Barycentric form:
    L_i(t) = w^i (t^n - 1) / (n (t - w^i)); at a point of the domain, the indicator of it."""
    t = ext_point(t)
    dom = domain(n)
    if int(t[1]) == 0 and int(t[0]) in set(dom.tolist()):
        out = np.zeros((n, 2), dtype=np.uint64)
        out[dom.tolist().index(int(t[0])), 0] = 1
        return out
    diff = np.stack([field.sub(t[0], dom), np.full(n, t[1], dtype=np.uint64)], axis=-1)  # t - w^i
    inv = field.ext_inv(diff)
    tn = field.ext_power(t, n)
    scale = field.ext_scale(field.sub(tn, field.ext(1)), np.uint64(pow(n, field.P - 2, field.P)))  # (t^n - 1)/n
    return field.ext_mul(field.ext_scale(inv, dom), scale)


def ntt_columns(x, inverse: bool = False, in_place: bool = False) -> np.ndarray:
    """The transform (or its inverse) along axis 0 of x (n, ...): every x[:, j, ...] is one
    polynomial. The layout of the prover and the verifier (flp.py): the domain first, the
    reports last and contiguous, so that the compiled loop vectorises over reports.
    ``in_place``: transform x itself (a C-contiguous uint64 array the caller no longer needs)."""
    x_is_ready = isinstance(x, np.ndarray) and x.dtype == np.uint64 and x.flags.c_contiguous
    out = x if in_place and x_is_ready else np.array(x, dtype=np.uint64, order="C")
    n = out.shape[0]
    if not is_power_of_two(n) or n > MAX_SIZE:
        raise ValueError(f"NTT sizes are powers of two up to 2^20, got {n}")
    if n > 1 and out.size:
        scale = pow(n, field.P - 2, field.P) if inverse else 1
        field.ntt_columns(out.reshape(n, -1), _table(n, inverse), scale)
    return out
