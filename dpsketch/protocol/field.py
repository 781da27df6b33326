"""The prime field F_p, p = 2^64 - 2^32 + 1, and its quadratic extension F_(p^2).

Why this field (docs/validity.md; the lead's design notes): validity proofs (flp.py) need
polynomial interpolation, so shares live in a prime field instead of Z_(2^64). With this p a
value still fits one uint64 (8 bytes per share value, as today), the multiplicative group has
order 2^32 * 3 * 5 * 17 * 257 * 65537, so NTTs of every power-of-two size up to 2^32 exist
(ntt.py), and a 128-bit product reduces with shifts and additions: 2^64 = 2^32 - 1 and
2^96 = -1 (mod p).

Representation: an element is a uint64 in canonical form [0, p); arrays of them are numpy uint64
arrays of any shape. On the wire: little-endian uint64 per element. Every function here takes
canonical inputs and returns canonical outputs; :func:`elements` checks untrusted values.

F_(p^2) = F_p[X] / (X^2 - 7): 7 generates F_p^*, so it is not a square and X^2 - 7 is
irreducible (tests/test_field.py checks both). An element c0 + c1 X is a (..., 2) uint64 array
(c0, c1); on the wire c0 then c1. Addition, subtraction and negation are those of F_p on both
components, so :func:`add`, :func:`sub` and :func:`neg` serve both fields.

Speed: the arithmetic has two implementations that give identical results: numpy (the
reference, always available: products from 32-bit limbs, about twenty array passes per
product) and compiled loops (``_field_kernel.py``, numba: one pass). They are chosen by
kernels.py's rule through :data:`FIELD`: the loops are loaded when a call first has
``kernels.MIN_ROWS`` elements (or on :func:`warm_up`), and from then on serve every call.

Also here: uniform sampling from a byte stream by rejection (:func:`sample`, :func:`expand`)
and the signed fixed-point encoding with its centred decoding (:func:`encode_int`,
:func:`decode_int`, :func:`encode_fixed`, :func:`decode_fixed`). I/O-free.
"""

from __future__ import annotations

import operator

import numpy as np

from . import chacha, kernels, ring
from .keystream import Keystream

#: the Goldilocks prime
P = 2**64 - 2**32 + 1
#: a generator of F_p^* (and the non-square that defines F_(p^2))
GENERATOR = 7
NONRESIDUE = 7
#: p - 1 = 2^32 * odd: power-of-two subgroups up to order 2^32
TWO_ADICITY = 32
#: p - 1 = 2^32 * 3 * 5 * 17 * 257 * 65537
ORDER_FACTORS = (2, 3, 5, 17, 257, 65537)
#: wire format of one element
WIRE_DTYPE = np.dtype("<u8")
HALF = (P - 1) // 2

#: The compiled loops (``_field_kernel.py``), loaded by kernels.py's rule.
FIELD = kernels.Kernel("._field_kernel", "the field arithmetic (F_p, NTT)")

_P = np.uint64(P)
_EPS = np.uint64(0xFFFFFFFF)  # 2^64 mod p = 2^32 - 1, also the low-32-bit mask
_S32 = np.uint64(32)
_ZERO = np.uint64(0)
_SEVEN = np.uint64(7)
#: terms whose exact sum :func:`total` forms in 64-bit halves at once
_SUM_CHUNK = 1 << 31


class FieldError(ValueError):
    """A value that is not a canonical element of F_p (>= p, negative, not an integer)."""


def warm_up() -> bool:
    """Load the compiled loops now; whether they are available."""
    return FIELD.warm_up()


def _loops(size: int):
    return FIELD.for_rows(size)


def elements(values, what: str = "value") -> np.ndarray:
    """Untrusted values as canonical F_p elements (a uint64 array); FieldError for anything
    that is not an integer in [0, p)."""
    arr = values if isinstance(values, np.ndarray) else np.array(values, dtype=object)  # lists: exact ints
    if arr.dtype.kind == "u":
        arr = arr.astype(np.uint64, copy=False)
    elif arr.dtype.kind == "i":
        if arr.size and arr.min() < 0:
            raise FieldError(f"a {what} is negative")
        arr = arr.astype(np.uint64)
    elif arr.dtype == object or arr.size == 0:
        try:
            ints = [operator.index(v) for v in arr.reshape(-1).tolist()]  # no floats, no strings
        except (TypeError, ValueError):
            raise FieldError(f"a {what} is not an integer") from None
        if any(not 0 <= v < P for v in ints):
            raise FieldError(f"a {what} is outside [0, p)")
        return np.array(ints, dtype=np.uint64).reshape(arr.shape)
    else:
        raise FieldError(f"{what}s must be integers, got {arr.dtype}")
    if arr.size and arr.max() >= _P:
        raise FieldError(f"a {what} is not below p = 2^64 - 2^32 + 1")
    return arr


def from_wire(raw: bytes, count: int | None = None) -> np.ndarray:
    """Little-endian uint64 elements from bytes, checked canonical."""
    if len(raw) % 8 or (count is not None and len(raw) != 8 * count):
        raise FieldError("field elements are 8 bytes each")
    return elements(np.frombuffer(raw, dtype=WIRE_DTYPE).astype(np.uint64))


def to_wire(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype=np.uint64).astype(WIRE_DTYPE, copy=False).tobytes()


# --- the numpy reference --------------------------------------------------------------------

_WRAP = np.errstate(over="ignore")  # uint64 arithmetic wraps on purpose (numpy warns for 0-d)


@_WRAP
def _wide(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 128-bit products a b as (lo, hi) uint64 arrays, from four 32 x 32-bit products."""
    a0, a1 = a & _EPS, a >> _S32
    b0, b1 = b & _EPS, b >> _S32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = p01 + p10
    mid_carry = (mid < p01).astype(np.uint64) << _S32
    lo = p00 + (mid << _S32)
    hi = p11 + (mid >> _S32) + mid_carry + (lo < p00)
    return lo, hi


@_WRAP
def _reduce(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """hi 2^64 + lo mod p for any 128-bit values: 2^64 = 2^32 - 1, 2^96 = -1."""
    h1, h0 = hi >> _S32, hi & _EPS
    t = lo - h1
    t -= (lo < h1) * _EPS  # borrow: the wrapped difference plus p
    u = h0 * _EPS
    r = t + u
    r += (r < u) * _EPS  # carry: 2^64 = 2^32 - 1
    r -= (r >= _P) * _P
    return r


def _mul_ref(a, b):
    a, b = np.broadcast_arrays(a, b)
    return _reduce(*_wide(a, b))


@_WRAP
def _add_ref(a, b):
    s = a + b
    s += (s < a) * _EPS
    s -= (s >= _P) * _P
    return s


@_WRAP
def _sub_ref(a, b):
    d = a - b
    d -= (a < b) * _EPS
    return d


def total(a: np.ndarray, axis: int = -1) -> np.ndarray:
    """The sum mod p along ``axis``: exact, from the sums of the elements' 32-bit halves (each
    fits 64 bits for up to 2^32 terms), recombined as a 128-bit value and reduced."""
    a = np.asarray(a, dtype=np.uint64)
    if a.shape[axis] > _SUM_CHUNK:
        parts = np.array_split(a, -(-a.shape[axis] // _SUM_CHUNK), axis=axis)
        return total(np.stack([total(x, axis) for x in parts], axis=axis), axis)
    lo_sum = np.add.reduce(a & _EPS, axis=axis, dtype=np.uint64)
    hi_sum = np.add.reduce(a >> _S32, axis=axis, dtype=np.uint64)
    return _combine_halves(lo_sum, hi_sum)


@_WRAP
def segment_total(a: np.ndarray, starts: np.ndarray, axis: int = 0) -> np.ndarray:
    """The sums mod p of the segments of ``a`` along ``axis`` that begin at ``starts``
    (increasing, each segment non-empty, the last one running to the end)."""
    a = np.asarray(a, dtype=np.uint64)
    lo = np.add.reduceat(a & _EPS, starts, axis=axis, dtype=np.uint64)
    hi = np.add.reduceat(a >> _S32, starts, axis=axis, dtype=np.uint64)
    return _combine_halves(lo, hi)


def _combine_halves(lo_sum: np.ndarray, hi_sum: np.ndarray) -> np.ndarray:
    """hi_sum 2^32 + lo_sum mod p, both below 2^64."""
    lo = lo_sum + (hi_sum << _S32)
    hi = (hi_sum >> _S32) + (lo < lo_sum)
    return _reduce(lo, hi)


def _pow_ref(a: np.ndarray, e: int) -> np.ndarray:
    result = np.ones_like(a)
    base = a.copy()
    while e:
        if e & 1:
            result = _mul_ref(result, base)
        base = _mul_ref(base, base)
        e >>= 1
    return result


def _ntt_ref(x: np.ndarray, table: np.ndarray) -> None:
    """field's in-place NTT on the rows of x (rows, n), as the compiled loop (bit reversal, then
    one vectorised pass per stage over every row and butterfly)."""
    rows, n = x.shape
    x[:] = x[:, _bit_reversal(n)]
    h = 1
    while h < n:
        view = x.reshape(rows, n // (2 * h), 2, h)
        u = view[:, :, 0, :].copy()
        v = _mul_ref(view[:, :, 1, :], table[h - 1:2 * h - 1])
        view[:, :, 0, :] = _add_ref(u, v)
        view[:, :, 1, :] = _sub_ref(u, v)
        h *= 2


_BITREV: dict[int, np.ndarray] = {}


def _bit_reversal(n: int) -> np.ndarray:
    if n not in _BITREV:
        bits = n.bit_length() - 1
        idx = np.arange(n, dtype=np.int64)
        rev = np.zeros(n, dtype=np.int64)
        for b in range(bits):
            rev |= ((idx >> b) & 1) << (bits - 1 - b)
        _BITREV[n] = rev
    return _BITREV[n]


# --- F_p arithmetic -------------------------------------------------------------------------

_OPS = {"add": 0, "sub": 1, "mul": 2}


def _binary(name: str, ref, a, b) -> np.ndarray:
    a = np.asarray(a, dtype=np.uint64)
    b = np.asarray(b, dtype=np.uint64)
    shape = np.broadcast_shapes(a.shape, b.shape)
    size = int(np.prod(shape))
    loops = _loops(size)
    if loops is None or size == 0:
        return ref(*np.broadcast_arrays(a, b)).reshape(shape)
    if a.shape != shape:
        a = np.broadcast_to(a, shape)
    if b.shape != shape:
        b = np.broadcast_to(b, shape)
    out = np.empty(shape, dtype=np.uint64)
    if len(shape) == 2 and not (a.flags.c_contiguous and b.flags.c_contiguous) and a.strides[1] and b.strides[1]:
        loops.binary_2d(_OPS[name], a, b, out)  # views of wider arrays: no copies
        return out
    getattr(loops, name)(np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1), out.reshape(-1))
    return out


def add(a, b) -> np.ndarray:
    """a + b mod p, elementwise with broadcasting (also F_(p^2), componentwise)."""
    return _binary("add", _add_ref, a, b)


def sub(a, b) -> np.ndarray:
    """a - b mod p (also F_(p^2))."""
    return _binary("sub", _sub_ref, a, b)


def neg(a) -> np.ndarray:
    """-a mod p (also F_(p^2))."""
    a = np.asarray(a, dtype=np.uint64)
    return np.where(a == _ZERO, _ZERO, _P - a)


def mul(a, b) -> np.ndarray:
    """a b mod p, elementwise with broadcasting."""
    return _binary("mul", _mul_ref, a, b)


def power(a, e: int) -> np.ndarray:
    """a^e mod p elementwise, for an integer e >= 0 (0^0 = 1)."""
    if e < 0:
        raise ValueError("a negative exponent: use inv")
    a = np.asarray(a, dtype=np.uint64)
    loops = _loops(a.size)
    if loops is None or e >= 1 << 64 or a.size == 0:
        return _pow_ref(a, e)
    out = np.empty(a.shape, dtype=np.uint64)
    loops.power(np.ascontiguousarray(a).reshape(-1), np.uint64(e), out.reshape(-1))
    return out


def batch_inv(a) -> np.ndarray:
    """1 / a elementwise (Montgomery's trick in the compiled loop: one exponentiation for the
    whole array); ZeroDivisionError if any element is 0."""
    a = np.asarray(a, dtype=np.uint64)
    if a.size and not a.all():
        raise ZeroDivisionError("0 has no inverse in F_p")
    loops = _loops(a.size)
    if loops is None or a.size == 0:
        return _pow_ref(a, P - 2)
    out = np.empty(a.shape, dtype=np.uint64)
    loops.batch_inverse(np.ascontiguousarray(a).reshape(-1), out.reshape(-1))
    return out


def inv(a) -> np.ndarray:
    """1 / a elementwise (the same as :func:`batch_inv`)."""
    return batch_inv(a)


def matmul(a, b) -> np.ndarray:
    """a b over F_p: a (m, n), b (n, k) -> (m, k) (reports x coefficients). With few columns
    (k <= 4) and many rows the compiled loop runs on a transposed copy of a (:func:`matmul_t`)."""
    a = np.asarray(a, dtype=np.uint64)
    b = np.ascontiguousarray(b, dtype=np.uint64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul takes (m, n) and (n, k), got {a.shape} and {b.shape}")
    m, n = a.shape
    k = b.shape[1]
    loops = _loops(m * n * k)
    if loops is not None and k <= 4 and m >= 16:
        return matmul_t(a.T, b)
    if loops is not None:
        out = np.empty((m, k), dtype=np.uint64)
        loops.matmul(np.ascontiguousarray(a), b, out)
        return out
    out = np.zeros((m, k), dtype=np.uint64)
    step = max(1, (1 << 22) // max(1, m * k))  # inner terms per pass: bounded memory
    for j in range(0, n, step):
        out = _add_ref(out, total(_mul_ref(a[:, j:j + step, None], b[None, j:j + step, :]), axis=1))
    return out


def matmul_t(at, b) -> np.ndarray:
    """at^T b over F_p: at (n, m) (m lanes, e.g. reports, innermost), b (n, k) -> (m, k)."""
    at = np.ascontiguousarray(at, dtype=np.uint64)
    b = np.ascontiguousarray(b, dtype=np.uint64)
    if at.ndim != 2 or b.ndim != 2 or at.shape[0] != b.shape[0]:
        raise ValueError(f"matmul_t takes (n, m) and (n, k), got {at.shape} and {b.shape}")
    n, m = at.shape
    loops = _loops(m * n * b.shape[1])
    if loops is not None:
        out = np.empty((m, b.shape[1]), dtype=np.uint64)
        loops.matmul_t(at, b, out)
        return out
    return matmul(at.T, b)


def dot(a, b) -> np.ndarray:
    """sum_j a[..., j] b[j] over F_p: many rows against one coefficient vector."""
    a = np.asarray(a, dtype=np.uint64)
    b = np.asarray(b, dtype=np.uint64)
    return matmul(a.reshape(-1, a.shape[-1]), b.reshape(-1, 1)).reshape(a.shape[:-1])


def weighted_lanes(r, w) -> np.ndarray:
    """out[..., i] = sum_l w[l, i] r[..., l, i]: r (..., L, m), w (L, m): each lane i (a report)
    its own weights."""
    r = np.asarray(r, dtype=np.uint64)
    w = np.ascontiguousarray(w, dtype=np.uint64)
    if r.ndim < 2 or r.shape[-2:] != w.shape:
        raise ValueError(f"weighted_lanes takes (..., L, m) and (L, m), got {r.shape} and {w.shape}")
    lead = r.shape[:-2]
    r3 = np.ascontiguousarray(r).reshape((-1,) + w.shape)
    loops = _loops(r.size)
    if loops is not None:
        out = np.empty((r3.shape[0], w.shape[1]), dtype=np.uint64)
        loops.weighted_lanes(r3, w, out)
        return out.reshape(lead + (w.shape[1],))
    return total(_mul_ref(r3, w), axis=1).reshape(lead + (w.shape[1],))


def sparse_apply(xt, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray) -> np.ndarray:
    """A xt for a sparse A in CSR form (rows = len(indptr) - 1) and the inputs of m lanes as the
    columns of xt (n, m) -> (rows, m)."""
    xt = np.ascontiguousarray(xt, dtype=np.uint64)
    rows = len(indptr) - 1
    m = xt.shape[1]
    loops = _loops(m * max(len(data), 1))
    if loops is not None:
        out = np.empty((rows, m), dtype=np.uint64)
        loops.sparse_apply(xt, indptr, indices, data, out)
        return out
    out = np.zeros((rows, m), dtype=np.uint64)
    if len(data) == 0 or m == 0:
        return out
    filled = np.flatnonzero(indptr[1:] > indptr[:-1])
    out[filled] = segment_total(_mul_ref(xt[indices], data[:, None]), indptr[:-1][filled], axis=0)
    return out


def sparse_apply_rows(x, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, const: np.ndarray):
    """A x_i + const for each row x_i of x (m, n) (reports in rows, any strides) and a sparse A
    in CSR form -> (m, rows); None where the compiled loop is not loaded (the caller then works
    on lanes, :func:`sparse_apply`)."""
    x = np.asarray(x, dtype=np.uint64)
    loops = _loops(x.shape[0] * max(len(data), 1))
    if loops is None or x.ndim != 2 or x.shape[0] == 0:
        return None
    out = np.empty((x.shape[0], len(indptr) - 1), dtype=np.uint64)
    loops.sparse_apply_rows(x, indptr, indices, data, np.ascontiguousarray(const, dtype=np.uint64), out)
    return out


def lanes(x) -> np.ndarray:
    """x (m, n) (reports in rows, any strides) transposed to a C-contiguous (n, m): the layout
    with reports innermost that the prover and the query run on, by the compiled loop's tiled
    transpose where it is loaded."""
    x = np.asarray(x, dtype=np.uint64)
    if x.ndim == 2 and x.shape[0] == 1:  # one report (a batch proof's): a copy, 3-4x faster than the tiled loop
        return x.reshape(-1, 1).copy()
    loops = _loops(x.size)
    if loops is None or x.ndim != 2 or x.size == 0:
        return np.ascontiguousarray(x.T)
    out = np.empty((x.shape[1], x.shape[0]), dtype=np.uint64)
    loops.transpose(x, out)
    return out


def horner(coeffs, x) -> np.ndarray:
    """c(x) elementwise for one polynomial with F_p coefficients ``coeffs`` (lowest degree
    first) at every element of x (F_p)."""
    c = np.asarray(coeffs, dtype=np.uint64)[::-1].copy()
    x = np.asarray(x, dtype=np.uint64)
    loops = _loops(x.size * len(c))
    if loops is not None and x.size:
        out = np.empty(x.shape, dtype=np.uint64)
        loops.horner(c, np.ascontiguousarray(x).reshape(-1), out.reshape(-1))
        return out
    out = np.full(x.shape, c[0], dtype=np.uint64)
    for cj in c[1:]:
        out = _add_ref(_mul_ref(out, x), cj)
    return out


def square_poly_sums(x, centre: int, coeffs, w) -> np.ndarray:
    """sum_l w[l, :, i] c((x[..., l, i] - centre)^2) for each lane i (a weighted ParallelSum of
    a Range gadget, in the prover's layout): x (..., L, m), c the polynomial ``coeffs`` (lowest
    degree first), w (L, 2, m) F_(p^2) weights planar -> (..., 2, m). One compiled pass over x."""
    x = np.asarray(x, dtype=np.uint64)
    w = np.ascontiguousarray(w, dtype=np.uint64)
    lead, (L, m) = x.shape[:-2], x.shape[-2:]
    if w.shape != (L, 2, m):
        raise ValueError(f"square_poly_sums takes (..., L, m) and (L, 2, m), got {x.shape} and {w.shape}")
    loops = _loops(x.size)
    if loops is None or x.size == 0:
        u = sub(x, np.uint64(centre))
        v = horner(coeffs, mul(u, u))
        return np.stack([weighted_lanes(v, w[:, c, :]) for c in (0, 1)], axis=-2)
    out = np.empty((int(np.prod(lead, dtype=np.int64)), 2, m), dtype=np.uint64)
    high_first = np.ascontiguousarray(np.asarray(coeffs, dtype=np.uint64)[::-1])
    loops.square_poly_sums(np.ascontiguousarray(x).reshape(-1, L, m), np.uint64(centre), high_first, w, out)
    return out.reshape(lead + (2, m))


_NO_WEIGHTS = np.zeros((1, 2, 1), dtype=np.uint64)


def product_sums(x, arity: int, w=None) -> np.ndarray:
    """A ParallelSum of products in the prover's layout: for each lane i, sum_l w[l, :, i] g_l
    with g_l = a_l b_l (``arity`` 2) or a_l b_l - c_l (arity 3), the slots' wires consecutive:
    x (..., count arity, m); w (count, 2, m) -> (..., 2, m), or None (the plain sum) -> (..., m)."""
    if arity not in (2, 3):
        raise ValueError("products of two wires, less a third")
    x = np.asarray(x, dtype=np.uint64)
    lead, (nw, m) = x.shape[:-2], x.shape[-2:]
    count = nw // arity
    if nw != count * arity or (w is not None and np.shape(w) != (count, 2, m)):
        raise ValueError(f"product_sums takes (..., count {arity}, m) and (count, 2, m), got {x.shape}")
    loops = _loops(x.size)
    if loops is None or x.size == 0:
        slots = x.reshape(lead + (count, arity, m))
        g = mul(slots[..., 0, :], slots[..., 1, :])
        if arity == 3:
            g = sub(g, slots[..., 2, :])
        if w is None:
            return total(g, axis=-2)
        w = np.ascontiguousarray(w, dtype=np.uint64)
        return np.stack([weighted_lanes(g, w[:, c, :]) for c in (0, 1)], axis=-2)
    rows = int(np.prod(lead, dtype=np.int64))
    weighted = w is not None
    out = np.empty((rows, 2 if weighted else 1, m), dtype=np.uint64)
    lanes = np.ascontiguousarray(w, dtype=np.uint64) if weighted else _NO_WEIGHTS
    loops.product_sums(np.ascontiguousarray(x).reshape(rows, nw, m), arity, lanes, weighted, out)
    return out.reshape(lead + ((2, m) if weighted else (m,)))


def ext_square_poly_sums(v, centre: int, coeffs, w=None) -> np.ndarray:
    """sum_l w[i, l] c((v[i, l] - centre)^2) in F_(p^2) for each report i (the decision's
    ParallelSum of a Range gadget): v (m, L, 2), w (m, L, 2) or None (every weight 1), c the
    F_p polynomial ``coeffs`` (lowest degree first) -> (m, 2)."""
    v = np.ascontiguousarray(v, dtype=np.uint64)
    m, L = v.shape[:2]
    loops = _loops(v.size * len(coeffs))
    if loops is None or v.size == 0:
        d = sub(v, ext(centre))
        u = ext_mul(d, d)
        c = np.asarray(coeffs, dtype=np.uint64)
        acc = ext(np.full(u.shape[:-1], c[-1], dtype=np.uint64))
        for cj in c[-2::-1]:
            acc = add(ext_mul(acc, u), ext(cj))
        return total(acc if w is None else ext_mul(acc, w), axis=-2)
    out = np.empty((m, 2), dtype=np.uint64)
    high_first = np.ascontiguousarray(np.asarray(coeffs, dtype=np.uint64)[::-1])
    weights = np.ascontiguousarray(w, dtype=np.uint64) if w is not None else np.zeros((1, 1, 2), dtype=np.uint64)
    loops.ext_square_poly_sums(v, np.uint64(centre), high_first, weights, w is not None, out)
    return out


def ext_product_sums(v, arity: int, w=None) -> np.ndarray:
    """The decision's ParallelSum of products at one point of F_(p^2) per report: sum_l w[i, l]
    g_l with g_l = a_l b_l (``arity`` 2) or a_l b_l - c_l (arity 3): v (m, count arity, 2),
    w (m, count, 2) or None -> (m, 2)."""
    v = np.ascontiguousarray(v, dtype=np.uint64)
    m, nw = v.shape[:2]
    count = nw // arity
    loops = _loops(v.size)
    if loops is None or v.size == 0:
        slots = v.reshape(m, count, arity, 2)
        g = ext_mul(slots[:, :, 0], slots[:, :, 1])
        if arity == 3:
            g = sub(g, slots[:, :, 2])
        return total(g if w is None else ext_mul(g, w), axis=-2)
    out = np.empty((m, 2), dtype=np.uint64)
    weights = np.ascontiguousarray(w, dtype=np.uint64) if w is not None else np.zeros((1, 1, 2), dtype=np.uint64)
    loops.ext_product_sums(v, arity, weights, w is not None, out)
    return out


#: from this many transforms at once the compiled loop runs them side by side (ntt_columns)
_COLUMNS_FROM = 8


def ntt_rows(x: np.ndarray, table: np.ndarray, scale: int = 1) -> np.ndarray:
    """The radix-2 transform of every row of x (rows, n) as a new array (ntt.py builds
    ``table`` and calls this). Many rows run side by side in the compiled loop (on a transposed
    copy, vectorised over rows); a few long ones one after another."""
    loops = _loops(x.size)
    if loops is not None and len(x) >= _COLUMNS_FROM:
        cols = np.array(x.T, dtype=np.uint64, order="C")  # always a copy: x may be a transposed C array
        loops.ntt_columns(cols, table, np.uint64(scale))
        return cols.T
    out = np.array(x, dtype=np.uint64, order="C")
    if loops is not None:
        loops.ntt(out, table, np.uint64(scale))
        return out
    _ntt_ref(out, table)
    return _mul_ref(out, np.uint64(scale)) if scale != 1 else out


def ntt_columns(x: np.ndarray, table: np.ndarray, scale: int = 1) -> None:
    """The radix-2 transform of every column of a C-contiguous (n, cols) array, in place."""
    loops = _loops(x.size)
    if loops is not None and x.shape[1] >= _COLUMNS_FROM:
        loops.ntt_columns(x, table, np.uint64(scale))
    else:
        x[:] = ntt_rows(x.T, table, scale).T


# --- F_(p^2) = F_p[X] / (X^2 - 7), elements as (..., 2) arrays ---------------------------------

def ext(c0, c1=0) -> np.ndarray:
    """The F_(p^2) elements c0 + c1 X as a (..., 2) array."""
    c0, c1 = np.broadcast_arrays(np.asarray(c0, dtype=np.uint64), np.asarray(c1, dtype=np.uint64))
    return np.stack([c0, c1], axis=-1)


def ext_mul(a, b) -> np.ndarray:
    """(a0 + a1 X)(b0 + b1 X) = a0 b0 + 7 a1 b1 + (a0 b1 + a1 b0) X, elementwise."""
    a = np.asarray(a, dtype=np.uint64)
    b = np.asarray(b, dtype=np.uint64)
    shape = np.broadcast_shapes(a.shape, b.shape)
    size = int(np.prod(shape[:-1]))
    loops = _loops(2 * size)
    if loops is not None and size:
        out = np.empty(shape, dtype=np.uint64)
        a2 = np.ascontiguousarray(np.broadcast_to(a, shape)).reshape(-1, 2)
        b2 = np.ascontiguousarray(np.broadcast_to(b, shape)).reshape(-1, 2)
        loops.ext_mul(a2, b2, out.reshape(-1, 2))
        return out
    a0, a1, b0, b1 = a[..., 0], a[..., 1], b[..., 0], b[..., 1]
    c0 = add(mul(a0, b0), mul(_SEVEN, mul(a1, b1)))
    c1 = add(mul(a0, b1), mul(a1, b0))
    return np.stack([c0, c1], axis=-1)


def ext_scale(a, s) -> np.ndarray:
    """An F_(p^2) element times an F_p element: (a0 s, a1 s)."""
    a = np.asarray(a, dtype=np.uint64)
    return mul(a, np.asarray(s, dtype=np.uint64)[..., None])


def ext_conj(a) -> np.ndarray:
    """a0 - a1 X (the other root of X^2 - 7 substituted: the Frobenius a -> a^p)."""
    a = np.asarray(a, dtype=np.uint64)
    return np.stack([a[..., 0], neg(a[..., 1])], axis=-1)


def ext_norm(a) -> np.ndarray:
    """a conj(a) = a0^2 - 7 a1^2, in F_p; zero only for a = 0 (7 is not a square)."""
    a = np.asarray(a, dtype=np.uint64)
    return sub(mul(a[..., 0], a[..., 0]), mul(_SEVEN, mul(a[..., 1], a[..., 1])))


def ext_inv(a) -> np.ndarray:
    """1 / a = conj(a) / norm(a), with one batch inversion in F_p; ZeroDivisionError for 0."""
    return ext_scale(ext_conj(a), batch_inv(ext_norm(a)))


def ext_power(a, e: int) -> np.ndarray:
    """a^e elementwise in F_(p^2), e >= 0."""
    a = np.asarray(a, dtype=np.uint64)
    result = ext(np.ones(a.shape[:-1], dtype=np.uint64))
    base = a
    while e:
        if e & 1:
            result = ext_mul(result, base)
        base = ext_mul(base, base)
        e >>= 1
    return result


def ext_powers(a, n: int) -> np.ndarray:
    """(a^0, a^1, ..., a^(n-1)) for each element of a (..., 2): (..., n, 2), by doubling (the
    powers a^s .. a^(2s-1) are a^0 .. a^(s-1) times a^s: log2(n) products of whole arrays)."""
    a = np.asarray(a, dtype=np.uint64)
    out = np.empty(a.shape[:-1] + (n, 2), dtype=np.uint64)
    if n == 0:
        return out
    loops = _loops(out.size)
    if loops is not None:
        loops.ext_powers(np.ascontiguousarray(a).reshape(-1, 2), out.reshape(-1, n, 2))
        return out
    out[..., 0, :] = ext(np.ones(a.shape[:-1], dtype=np.uint64))
    step, power = 1, a  # power = a^step
    while step < n:
        take = min(step, n - step)
        out[..., step:step + take, :] = ext_mul(out[..., :take, :], power[..., None, :])
        step += take
        if step < n:
            power = ext_mul(power, power)
    return out


def ext_horner_lanes(coeffs, points) -> np.ndarray:
    """sum_j coeffs[j, :, i] points[:, i]^j in F_(p^2) for each lane i, each with its own point:
    coeffs (n, 2, m), points (2, m) -> (2, m) (F_(p^2) planar: c0 row, c1 row)."""
    c = np.ascontiguousarray(coeffs, dtype=np.uint64)
    t = np.ascontiguousarray(points, dtype=np.uint64)
    n, _, m = c.shape
    if n == 0:
        return np.zeros((2, m), dtype=np.uint64)
    loops = _loops(m * n)
    if loops is not None and m:
        out = np.empty((2, m), dtype=np.uint64)
        loops.ext_horner_lanes(c, t, out)
        return out
    acc = c[n - 1].T
    for j in range(n - 2, -1, -1):
        acc = add(ext_mul(acc, t.T), c[j].T)
    return np.ascontiguousarray(acc.T)


# --- sampling by rejection --------------------------------------------------------------------

def sample(stream: Keystream, count: int) -> np.ndarray:
    """``count`` uniform elements of F_p from a byte stream: consecutive 8-byte little-endian
    words, each word >= p skipped (probability (2^32 - 1) / 2^64 = 2^-32 per word), the first
    ``count`` accepted words in stream order."""
    words = stream.words(count)
    kept = words[words < _P]
    while len(kept) < count:
        more = stream.words(count - len(kept))
        kept = np.concatenate([kept, more[more < _P]])
    return kept


def sample_ext(stream: Keystream, count: int) -> np.ndarray:
    """``count`` uniform elements of F_(p^2), (count, 2): 2 count elements of F_p by
    :func:`sample`, c0 then c1 for each."""
    return sample(stream, 2 * count).reshape(count, 2)


def _words(stream: np.ndarray) -> np.ndarray:
    """Keystream bytes (m, 8 k) as (m, k) little-endian words in machine order."""
    words = stream.view(WIRE_DTYPE)
    return words.view(np.uint64) if WIRE_DTYPE == np.dtype(np.uint64) else words.astype(np.uint64)


def expand(seeds: np.ndarray | bytes, count: int, nonce: bytes) -> np.ndarray:
    """``count`` elements of F_p from each 32-byte seed, (m, count): the ChaCha20 keystream
    (RFC 8439; key = the seed, block counter 0, the 12-byte ``nonce``) read as consecutive
    little-endian uint64 words, a word >= p skipped, the first ``count`` accepted words in order.

    Vectorised over seeds: each row's keystream is drawn with a little room for rejections and
    only the rare rows that need more are drawn again, longer (a keystream's prefix does not
    change with its length)."""
    if isinstance(seeds, np.ndarray) and (seeds.dtype != np.uint8 or seeds.ndim != 2):
        seeds = np.ascontiguousarray(seeds).view(np.uint8).reshape(-1, chacha.KEY_BYTES)
    if not isinstance(seeds, np.ndarray):
        seeds = np.frombuffer(bytes(seeds), dtype=np.uint8).reshape(-1, chacha.KEY_BYTES)
    m = len(seeds)
    length = count + 2 + count // 1024
    words = _words(chacha.keystream(seeds, nonce, 8 * length))
    bad = words >= _P
    if not bad.any():  # the common case: no word of any row rejected (a view: callers copy)
        return words[:, :count]
    out = np.empty((m, count), dtype=np.uint64)
    pending = np.arange(m)
    while len(pending):
        if length > count + 2 + count // 1024:
            words = _words(chacha.keystream(seeds[pending], nonce, 8 * length))
            bad = words >= _P
        clean = ~bad[:, :count].any(axis=1)
        out[pending[clean]] = words[clean, :count]
        dirty = np.flatnonzero(~clean)
        if len(dirty):
            enough = (length - bad[dirty].sum(axis=1)) >= count
            fix = dirty[enough]
            order = np.argsort(bad[fix], axis=1, kind="stable")[:, :count]
            out[pending[fix]] = np.take_along_axis(words[fix], order, axis=1)
            pending = pending[dirty[~enough]]
        else:
            pending = pending[:0]
        length *= 2
    return out


# --- signed fixed point -----------------------------------------------------------------------

def encode_int(values) -> np.ndarray:
    """Signed integers with |x| <= (p - 1) / 2 as field elements (x mod p)."""
    x = np.asarray(values)
    if x.dtype.kind not in "iu":
        raise FieldError("encode_int takes integers")
    if x.dtype.kind == "u":
        if x.size and x.max() > HALF:
            raise FieldError("a value exceeds (p - 1) / 2")
        return x.astype(np.uint64)
    x = x.astype(np.int64)
    if x.size and (x.max() > HALF or x.min() < -HALF):
        raise FieldError("a value exceeds (p - 1) / 2 in magnitude")
    out = x.view(np.uint64).copy()
    negative = x < 0
    out[negative] = _P - (-x[negative]).astype(np.uint64)
    return out


def decode_int(values) -> np.ndarray:
    """The centred representative in [-(p - 1)/2, (p - 1)/2] of each element, as int64."""
    v = np.asarray(values, dtype=np.uint64)
    high = v > np.uint64(HALF)
    out = v.astype(np.int64)  # exact below 2^63; the high ones are replaced
    out[high] = -((_P - v[high]).astype(np.int64))
    return out


def encode_fixed(values, frac_bits: int, bound: float) -> np.ndarray:
    """Reals with |x| <= bound as round(x 2^f) mod p (round half to even): ring.py's rounding
    and range check, then :func:`encode_int`; values outside are refused, never wrapped."""
    return encode_int(ring.encode(values, frac_bits, bound).view(np.int64))


def decode_fixed(values, frac_bits: int) -> np.ndarray:
    """The centred representative divided by 2^f."""
    return np.ldexp(decode_int(values).astype(np.float64), -frac_bits)
