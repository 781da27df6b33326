"""The compiled loops behind field.py and ntt.py: arithmetic in F_p, p = 2^64 - 2^32 + 1.

Loaded on first use by kernels.py's rule (``field.FIELD``), through :func:`load`, which checks
every loop on a probe against Python's integers (and the NTT against a schoolbook transform)
before anything uses it; until then, and wherever numba is missing, field.py's numpy reference
gives the same canonical results. Compiled with numba's on-disk cache where one is writable.

The product of two elements is 128 bits wide; numba has no 128-bit integer, so it is formed from
four 32 x 32-bit products (as the numpy reference does) and reduced with the shape of p:
2^64 = 2^32 - 1 and 2^96 = -1 (mod p), so x = hi 2^64 + lo with hi = h1 2^32 + h0 reduces to
lo - h1 + h0 (2^32 - 1), a subtraction, a 32 x 32-bit product and an addition, each with one
conditional correction. The corrections are written as selects, not branches: on random data a
branch mispredicts half the time, and selects let LLVM vectorise the loops that run over
independent elements (every loop here keeps independent elements innermost where it can; a
Horner chain over one element is latency-bound, about 5x slower per product than a loop over
many). Sums of many products (matrix products) are accumulated unreduced in three 64-bit words
and reduced once per output: 2^128 = -2^32 (mod p).
"""

from __future__ import annotations

import numba
import numpy as np

from .kernels import njit_cached

_P = np.uint64(0xFFFFFFFF00000001)
#: 2^64 mod p = 2^32 - 1; also the low-32-bit mask
_EPS = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_ZERO = np.uint64(0)
_ONE = np.uint64(1)
#: 2^128 mod p = p - 2^32
_R128 = np.uint64(0xFFFFFFFF00000001 - (1 << 32))
_SEVEN = np.uint64(7)

_OPTIONS = dict(nogil=True, boundscheck=False, error_model="numpy")


@numba.njit(inline="always")
def wide(a, b):
    """The 128-bit product a b as (lo, hi), from four 32 x 32-bit products."""
    a0 = a & _EPS
    a1 = a >> _S32
    b0 = b & _EPS
    b1 = b >> _S32
    p00 = a0 * b0
    p01 = a0 * b1
    p10 = a1 * b0
    p11 = a1 * b1
    mid = p01 + p10
    mid_carry = (_ONE << _S32) if mid < p01 else _ZERO
    lo = p00 + (mid << _S32)
    lo_carry = _ONE if lo < p00 else _ZERO
    hi = p11 + (mid >> _S32) + mid_carry + lo_carry
    return lo, hi


@numba.njit(inline="always")
def reduce(lo, hi):
    """hi 2^64 + lo mod p, canonical (any 128-bit value)."""
    h1 = hi >> _S32
    h0 = hi & _EPS
    t = lo - h1
    t = t - _EPS if lo < h1 else t  # borrow: the wrapped value plus p is the value minus 2^32 - 1
    u = h0 * _EPS
    r = t + u
    r = r + _EPS if r < u else r  # carry: 2^64 = 2^32 - 1
    return r - _P if r >= _P else r


@numba.njit(inline="always")
def mulmod(a, b):
    lo, hi = wide(a, b)
    return reduce(lo, hi)


@numba.njit(inline="always")
def addmod(a, b):
    s = a + b
    s = s + _EPS if s < a else s
    return s - _P if s >= _P else s


@numba.njit(inline="always")
def submod(a, b):
    d = a - b
    return d - _EPS if a < b else d


@numba.njit(inline="always")
def powmod(a, e):
    result = _ONE
    base = a
    while e:
        if e & _ONE:
            result = mulmod(result, base)
        base = mulmod(base, base)
        e >>= _ONE
    return result


@numba.njit(inline="always")
def accumulate(lo, mid, top, a, b):
    """(lo, mid, top) += a b: a three-word unreduced sum of products."""
    plo, phi = wide(a, b)
    lo = lo + plo
    phi = phi + (_ONE if lo < plo else _ZERO)  # phi < 2^64 - 2^33: no overflow
    mid = mid + phi
    top = top + (_ONE if mid < phi else _ZERO)
    return lo, mid, top


@numba.njit(inline="always")
def settle(lo, mid, top):
    """lo + mid 2^64 + top 2^128 mod p (top < p)."""
    return addmod(reduce(lo, mid), mulmod(top, _R128))


@njit_cached(**_OPTIONS)
def mul(a, b, out):
    for i in range(out.size):
        out[i] = mulmod(a[i], b[i])


@njit_cached(**_OPTIONS)
def add(a, b, out):
    for i in range(out.size):
        out[i] = addmod(a[i], b[i])


@njit_cached(**_OPTIONS)
def sub(a, b, out):
    for i in range(out.size):
        out[i] = submod(a[i], b[i])


@njit_cached(**_OPTIONS)
def binary_2d(op, a, b, out):
    """out = a + b (op 0), a - b (1) or a b (2) on (m, n) arrays of any strides (views of wider
    shares: no contiguous copies first)."""
    m, n = out.shape
    for i in range(m):
        ai = a[i]
        bi = b[i]
        oi = out[i]
        if op == 0:
            for j in range(n):
                oi[j] = addmod(ai[j], bi[j])
        elif op == 1:
            for j in range(n):
                oi[j] = submod(ai[j], bi[j])
        else:
            for j in range(n):
                oi[j] = mulmod(ai[j], bi[j])


@njit_cached(**_OPTIONS)
def power(a, e, out):
    for i in range(out.size):
        out[i] = powmod(a[i], e)


@njit_cached(**_OPTIONS)
def batch_inverse(a, out):
    """out[i] = 1 / a[i] by Montgomery's trick (one exponentiation for the whole array); returns
    the index of a zero, or -1."""
    n = a.size
    acc = _ONE
    for i in range(n):
        if a[i] == _ZERO:
            return i
        out[i] = acc  # the product of a[0..i-1]
        acc = mulmod(acc, a[i])
    inv = powmod(acc, _P - np.uint64(2))  # 1 / (a[0] ... a[n-1])
    for i in range(n - 1, -1, -1):
        out[i] = mulmod(out[i], inv)  # 1 / a[i]
        inv = mulmod(inv, a[i])  # 1 / (a[0] ... a[i-1])
    return -1


@numba.njit(inline="always")
def _bit_reversal(n):
    rev = np.zeros(n, np.int64)
    bits = 0
    while (1 << bits) < n:
        bits += 1
    for i in range(n):
        r = 0
        v = i
        for _ in range(bits):
            r = (r << 1) | (v & 1)
            v >>= 1
        rev[i] = r
    return rev


@njit_cached(**_OPTIONS)
def ntt(x, table, scale):
    """In place on each row of x (rows, n), n a power of two: the radix-2 decimation-in-time
    transform, x_i <- sum_j x_j w^(ij), after the bit-reversal permutation; ``table`` holds the
    twiddles stage by stage (stage of half-size h at table[h - 1 : 2h - 1], w_(2h)^j); every
    output is then multiplied by ``scale`` unless it is 1 (the inverse's 1/n). For few long
    rows; many short ones go through :func:`ntt_columns`."""
    rows, n = x.shape
    rev = _bit_reversal(n)
    for row in range(rows):
        y = x[row]
        for i in range(n):
            j = rev[i]
            if i < j:
                t = y[i]
                y[i] = y[j]
                y[j] = t
        h = 1
        while h < n:
            for start in range(0, n, 2 * h):
                for j in range(h):
                    u = y[start + j]
                    v = mulmod(y[start + j + h], table[h - 1 + j])
                    y[start + j] = addmod(u, v)
                    y[start + j + h] = submod(u, v)
            h *= 2
        if scale != _ONE:
            for i in range(n):
                y[i] = mulmod(y[i], scale)


@njit_cached(**_OPTIONS)
def ntt_columns(x, table, scale):
    """The same transform on every column of x (n, cols): each butterfly runs over a whole
    row of x, contiguous and independent, so the compiler vectorises it (about 4x faster per
    butterfly than :func:`ntt` for many short transforms)."""
    n, cols = x.shape
    rev = _bit_reversal(n)
    for i in range(n):
        j = rev[i]
        if i < j:
            a = x[i]
            b = x[j]
            for c in range(cols):
                t = a[c]
                a[c] = b[c]
                b[c] = t
    h = 1
    while h < n:
        for start in range(0, n, 2 * h):
            for j in range(h):
                w = table[h - 1 + j]
                a = x[start + j]
                b = x[start + j + h]
                for c in range(cols):
                    u = a[c]
                    v = mulmod(b[c], w)
                    a[c] = addmod(u, v)
                    b[c] = submod(u, v)
        h *= 2
    if scale != _ONE:
        for i in range(n):
            a = x[i]
            for c in range(cols):
                a[c] = mulmod(a[c], scale)


@njit_cached(**_OPTIONS)
def matmul(a, b, out):
    """out = a b over F_p: a (m, n), b (n, k), out (m, k); each output one reduction."""
    m, n = a.shape
    k = b.shape[1]
    lo = np.zeros(k, np.uint64)
    mid = np.zeros(k, np.uint64)
    top = np.zeros(k, np.uint64)
    for i in range(m):
        lo[:] = 0
        mid[:] = 0
        top[:] = 0
        for j in range(n):
            aij = a[i, j]
            for c in range(k):
                lo[c], mid[c], top[c] = accumulate(lo[c], mid[c], top[c], aij, b[j, c])
        for c in range(k):
            out[i, c] = settle(lo[c], mid[c], top[c])


@njit_cached(**_OPTIONS)
def matmul_t(at, b, out):
    """out = at^T b over F_p: at (n, m), b (n, k), out (m, k); the loop over the m outputs is
    innermost (contiguous rows of at, vectorised), so a product with few columns k (the
    Lagrange weights, the powers of t: k = 2) does not run one short dot product per row. The
    outputs go a block of lanes at a time, so that their three-word sums stay in the L1 cache
    while every row of at passes over them."""
    n, m = at.shape
    k = b.shape[1]
    block = 512
    lo = np.empty((k, block), np.uint64)
    mid = np.empty((k, block), np.uint64)
    top = np.empty((k, block), np.uint64)
    for start in range(0, m, block):
        width = min(block, m - start)
        lo[:] = 0
        mid[:] = 0
        top[:] = 0
        for j in range(n):
            row = at[j, start:start + width]
            for c in range(k):
                bjc = b[j, c]
                lc = lo[c]
                mc = mid[c]
                tc = top[c]
                for i in range(width):
                    lc[i], mc[i], tc[i] = accumulate(lc[i], mc[i], tc[i], bjc, row[i])
        for c in range(k):
            for i in range(width):
                out[start + i, c] = settle(lo[c, i], mid[c, i], top[c, i])


@njit_cached(**_OPTIONS)
def weighted_lanes(r, w, out):
    """out[g, i] = sum_l w[l, i] r[g, l, i]: r (G, L, m), w (L, m), out (G, m): each lane i
    (a report) its own weights; lanes innermost."""
    groups, nl, m = r.shape
    lo = np.zeros(m, np.uint64)
    mid = np.zeros(m, np.uint64)
    top = np.zeros(m, np.uint64)
    for g in range(groups):
        lo[:] = 0
        mid[:] = 0
        top[:] = 0
        for j in range(nl):
            rj = r[g, j]
            wj = w[j]
            for i in range(m):
                lo[i], mid[i], top[i] = accumulate(lo[i], mid[i], top[i], wj[i], rj[i])
        og = out[g]
        for i in range(m):
            og[i] = settle(lo[i], mid[i], top[i])


@njit_cached(**_OPTIONS)
def sparse_apply(xt, indptr, indices, data, out):
    """out[r, i] = sum_e data[e] xt[indices[e], i] over the entries e of row r (CSR): xt (n, m)
    the inputs of m lanes, out (rows, m); lanes innermost."""
    m = xt.shape[1]
    rows = out.shape[0]
    lo = np.zeros(m, np.uint64)
    mid = np.zeros(m, np.uint64)
    top = np.zeros(m, np.uint64)
    for r in range(rows):
        lo[:] = 0
        mid[:] = 0
        top[:] = 0
        for e in range(indptr[r], indptr[r + 1]):
            coef = data[e]
            col = xt[indices[e]]
            for i in range(m):
                lo[i], mid[i], top[i] = accumulate(lo[i], mid[i], top[i], coef, col[i])
        orow = out[r]
        for i in range(m):
            orow[i] = settle(lo[i], mid[i], top[i])


@njit_cached(**_OPTIONS)
def sparse_apply_rows(x, indptr, indices, data, const, out):
    """out[i, r] = const[r] + sum_e data[e] x[i, indices[e]] over the entries e of row r (CSR):
    x (m, n) the inputs of m reports in rows (any strides: a view of a wider share), out
    (m, rows). A block of reports at a time is transposed into a scratch array in the cache,
    then summed with the reports innermost (independent, vectorised): no transposed copy of
    the whole of x."""
    m, n = x.shape
    rows = out.shape[1]
    block = 32
    buf = np.empty((n, block), np.uint64)
    lo = np.empty(block, np.uint64)
    mid = np.empty(block, np.uint64)
    top = np.empty(block, np.uint64)
    for start in range(0, m, block):
        width = min(block, m - start)
        for i in range(width):
            xi = x[start + i]
            for j in range(n):
                buf[j, i] = xi[j]
        for r in range(rows):
            lo[:] = 0
            mid[:] = 0
            top[:] = 0
            for e in range(indptr[r], indptr[r + 1]):
                coef = data[e]
                col = buf[indices[e]]
                for i in range(width):
                    lo[i], mid[i], top[i] = accumulate(lo[i], mid[i], top[i], coef, col[i])
            c = const[r]
            for i in range(width):
                out[start + i, r] = addmod(settle(lo[i], mid[i], top[i]), c)


@njit_cached(**_OPTIONS)
def horner(coeffs, x, out):
    """out[i] = c(x[i]) for one polynomial c (highest degree first), a block of elements at a
    time in a scratch array, so that the loop over elements is innermost (independent,
    vectorised: about 7x faster per product than a Horner chain per element)."""
    n = x.size
    block = 1024
    acc = np.empty(block, np.uint64)
    for start in range(0, n, block):
        stop = min(n, start + block)
        width = stop - start
        xs = x[start:stop]
        for i in range(width):
            acc[i] = coeffs[0]
        for j in range(1, coeffs.size):
            cj = coeffs[j]
            for i in range(width):
                acc[i] = addmod(mulmod(acc[i], xs[i]), cj)
        out[start:stop] = acc[:width]


@njit_cached(**_OPTIONS)
def ext_mul(a, b, out):
    """(a0 + a1 X)(b0 + b1 X) mod X^2 - 7 on (s, 2) arrays."""
    for i in range(out.shape[0]):
        a0 = a[i, 0]
        a1 = a[i, 1]
        b0 = b[i, 0]
        b1 = b[i, 1]
        out[i, 0] = addmod(mulmod(a0, b0), mulmod(_SEVEN, mulmod(a1, b1)))
        out[i, 1] = addmod(mulmod(a0, b1), mulmod(a1, b0))


@njit_cached(**_OPTIONS)
def ext_horner_lanes(coeffs, points, out):
    """out[:, i] = sum_j coeffs[j, :, i] points[:, i]^j in F_(p^2), each lane its own point:
    coeffs (n, 2, m), points (2, m), out (2, m); lanes innermost."""
    n = coeffs.shape[0]
    m = coeffs.shape[2]
    for i in range(m):
        out[0, i] = coeffs[n - 1, 0, i]
        out[1, i] = coeffs[n - 1, 1, i]
    for j in range(n - 2, -1, -1):
        c0 = coeffs[j, 0]
        c1 = coeffs[j, 1]
        for i in range(m):
            a0 = out[0, i]
            a1 = out[1, i]
            t0 = points[0, i]
            t1 = points[1, i]
            r0 = addmod(mulmod(a0, t0), mulmod(_SEVEN, mulmod(a1, t1)))
            r1 = addmod(mulmod(a0, t1), mulmod(a1, t0))
            out[0, i] = addmod(r0, c0[i])
            out[1, i] = addmod(r1, c1[i])


@numba.njit(inline="always")
def accumulate_plain(lo, mid, v):
    """(lo, mid) += v: a two-word unreduced sum of elements."""
    lo = lo + v
    mid = mid + (_ONE if lo < v else _ZERO)
    return lo, mid


@njit_cached(**_OPTIONS)
def square_poly_sums(x, centre, coeffs, w, out):
    """The prover's weighted ParallelSum of a polynomial in (x - centre)^2 (a Range gadget),
    fused: out[k, c, i] = sum_l w[l, c, i] coeffs((x[k, l, i] - centre)^2), coeffs highest degree
    first; x (K, L, m), w (L, 2, m), out (K, 2, m); lanes innermost. One pass over x instead
    of the four whole-array passes (difference, square, polynomial, weighted sum) and their
    temporaries."""
    nk, nl, m = x.shape
    nc = coeffs.size
    lo0 = np.empty(m, np.uint64)
    mid0 = np.empty(m, np.uint64)
    top0 = np.empty(m, np.uint64)
    lo1 = np.empty(m, np.uint64)
    mid1 = np.empty(m, np.uint64)
    top1 = np.empty(m, np.uint64)
    u = np.empty(m, np.uint64)
    v = np.empty(m, np.uint64)
    c0 = coeffs[0]
    for k in range(nk):
        lo0[:] = 0
        mid0[:] = 0
        top0[:] = 0
        lo1[:] = 0
        mid1[:] = 0
        top1[:] = 0
        for j in range(nl):
            xj = x[k, j]
            first = 1
            if c0 == _ONE and nc > 1:  # monic (a Range gadget's is): the first step is an addition
                c1 = coeffs[1]
                for i in range(m):
                    d = submod(xj[i], centre)
                    dd = mulmod(d, d)
                    u[i] = dd
                    v[i] = addmod(dd, c1)
                first = 2
            else:
                for i in range(m):
                    d = submod(xj[i], centre)
                    u[i] = mulmod(d, d)
                    v[i] = c0
            for e in range(first, nc):
                ce = coeffs[e]
                for i in range(m):
                    v[i] = addmod(mulmod(v[i], u[i]), ce)
            w0 = w[j, 0]
            w1 = w[j, 1]
            for i in range(m):
                lo0[i], mid0[i], top0[i] = accumulate(lo0[i], mid0[i], top0[i], w0[i], v[i])
                lo1[i], mid1[i], top1[i] = accumulate(lo1[i], mid1[i], top1[i], w1[i], v[i])
        o0 = out[k, 0]
        o1 = out[k, 1]
        for i in range(m):
            o0[i] = settle(lo0[i], mid0[i], top0[i])
            o1[i] = settle(lo1[i], mid1[i], top1[i])


@njit_cached(**_OPTIONS)
def product_sums(x, arity, w, weighted, out):
    """The prover's ParallelSum of products (a Mul gadget, arity 2: a b; a MulSub, arity 3:
    a b - c), fused: x (K, count arity, m) the wires of every slot, out (K, 2, m) if
    ``weighted`` (w (count, 2, m)), else (K, 1, m) (w ignored); lanes innermost."""
    nk, nw, m = x.shape
    count = nw // arity
    lo0 = np.empty(m, np.uint64)
    mid0 = np.empty(m, np.uint64)
    top0 = np.empty(m, np.uint64)
    lo1 = np.empty(m, np.uint64)
    mid1 = np.empty(m, np.uint64)
    top1 = np.empty(m, np.uint64)
    for k in range(nk):
        lo0[:] = 0
        mid0[:] = 0
        top0[:] = 0
        lo1[:] = 0
        mid1[:] = 0
        top1[:] = 0
        for j in range(count):
            a = x[k, j * arity]
            b = x[k, j * arity + 1]
            if not weighted:
                if arity == 2:
                    for i in range(m):
                        lo0[i], mid0[i], top0[i] = accumulate(lo0[i], mid0[i], top0[i], a[i], b[i])
                else:
                    c = x[k, j * arity + 2]
                    for i in range(m):
                        lo0[i], mid0[i], top0[i] = accumulate(lo0[i], mid0[i], top0[i], a[i], b[i])
                        lo1[i], mid1[i] = accumulate_plain(lo1[i], mid1[i], c[i])
            else:
                w0 = w[j, 0]
                w1 = w[j, 1]
                if arity == 2:
                    for i in range(m):
                        v = mulmod(a[i], b[i])
                        lo0[i], mid0[i], top0[i] = accumulate(lo0[i], mid0[i], top0[i], w0[i], v)
                        lo1[i], mid1[i], top1[i] = accumulate(lo1[i], mid1[i], top1[i], w1[i], v)
                else:
                    c = x[k, j * arity + 2]
                    for i in range(m):
                        v = submod(mulmod(a[i], b[i]), c[i])
                        lo0[i], mid0[i], top0[i] = accumulate(lo0[i], mid0[i], top0[i], w0[i], v)
                        lo1[i], mid1[i], top1[i] = accumulate(lo1[i], mid1[i], top1[i], w1[i], v)
        o0 = out[k, 0]
        if weighted:
            o1 = out[k, 1]
            for i in range(m):
                o0[i] = settle(lo0[i], mid0[i], top0[i])
                o1[i] = settle(lo1[i], mid1[i], top1[i])
        elif arity == 2:
            for i in range(m):
                o0[i] = settle(lo0[i], mid0[i], top0[i])
        else:
            for i in range(m):
                o0[i] = submod(settle(lo0[i], mid0[i], top0[i]), reduce(lo1[i], mid1[i]))


@numba.njit(inline="always")
def ext_mulmod(a0, a1, b0, b1):
    return (addmod(mulmod(a0, b0), mulmod(_SEVEN, mulmod(a1, b1))),
            addmod(mulmod(a0, b1), mulmod(a1, b0)))


#: reports per block in the decision's loops: their verifier rows (a few KiB each) stay in
#: the L2 cache while the loop runs over slots with the reports innermost
_DECIDE_BLOCK = 64


@njit_cached(**_OPTIONS)
def ext_square_poly_sums(v, centre, coeffs, w, weighted, out):
    """The decision's ParallelSum of a polynomial in (f - centre)^2 at one point of F_(p^2) per
    report: out[i] = sum_l w[i, l] coeffs((v[i, l] - centre)^2) (w = 1 unless ``weighted``),
    coeffs highest degree first; v (m, L, 2), w (m, L, 2), out (m, 2). A block of reports at a
    time is copied to lanes (slot, report) in the cache, then every step runs over the block's
    reports innermost: independent elements, which the compiler vectorises."""
    m, nl, _ = v.shape
    nc = coeffs.size
    block = _DECIDE_BLOCK
    f0 = np.empty((nl, block), np.uint64)
    f1 = np.empty((nl, block), np.uint64)
    w0 = np.empty((nl, block), np.uint64)
    w1 = np.empty((nl, block), np.uint64)
    u0 = np.empty(block, np.uint64)
    u1 = np.empty(block, np.uint64)
    a0 = np.empty(block, np.uint64)
    a1 = np.empty(block, np.uint64)
    s0 = np.empty(block, np.uint64)
    s1 = np.empty(block, np.uint64)
    for start in range(0, m, block):
        width = min(block, m - start)
        for i in range(width):
            for j in range(nl):
                f0[j, i] = v[start + i, j, 0]
                f1[j, i] = v[start + i, j, 1]
                if weighted:
                    w0[j, i] = w[start + i, j, 0]
                    w1[j, i] = w[start + i, j, 1]
        s0[:] = 0
        s1[:] = 0
        for j in range(nl):
            fj0 = f0[j]
            fj1 = f1[j]
            monic = coeffs[0] == _ONE and nc > 1  # a Range gadget's: the first step is an addition
            for i in range(width):
                d0 = submod(fj0[i], centre)
                d1 = fj1[i]
                u0[i] = addmod(mulmod(d0, d0), mulmod(_SEVEN, mulmod(d1, d1)))
                u1[i] = addmod(mulmod(d0, d1), mulmod(d1, d0))
                if monic:
                    a0[i] = addmod(u0[i], coeffs[1])
                    a1[i] = u1[i]
                else:
                    a0[i] = coeffs[0]
                    a1[i] = _ZERO
            for e in range(2 if monic else 1, nc):
                ce = coeffs[e]
                for i in range(width):
                    x0 = a0[i]
                    x1 = a1[i]
                    a0[i] = addmod(addmod(mulmod(x0, u0[i]), mulmod(_SEVEN, mulmod(x1, u1[i]))), ce)
                    a1[i] = addmod(mulmod(x0, u1[i]), mulmod(x1, u0[i]))
            if weighted:
                wj0 = w0[j]
                wj1 = w1[j]
                for i in range(width):
                    x0 = a0[i]
                    x1 = a1[i]
                    s0[i] = addmod(s0[i], addmod(mulmod(x0, wj0[i]), mulmod(_SEVEN, mulmod(x1, wj1[i]))))
                    s1[i] = addmod(s1[i], addmod(mulmod(x0, wj1[i]), mulmod(x1, wj0[i])))
            else:
                for i in range(width):
                    s0[i] = addmod(s0[i], a0[i])
                    s1[i] = addmod(s1[i], a1[i])
        for i in range(width):
            out[start + i, 0] = s0[i]
            out[start + i, 1] = s1[i]


@njit_cached(**_OPTIONS)
def ext_product_sums(v, arity, w, weighted, out):
    """The decision's ParallelSum of products (Mul: a b, MulSub: a b - c) at one point of
    F_(p^2) per report: v (m, count arity, 2), w (m, count, 2), out (m, 2); blocks of reports,
    reports innermost."""
    m, nw, _ = v.shape
    count = nw // arity
    for i in range(m):
        out[i, 0] = _ZERO
        out[i, 1] = _ZERO
    for start in range(0, m, _DECIDE_BLOCK):
        stop = min(m, start + _DECIDE_BLOCK)
        for j in range(count):
            at = j * arity
            for i in range(start, stop):
                a0, a1 = ext_mulmod(v[i, at, 0], v[i, at, 1], v[i, at + 1, 0], v[i, at + 1, 1])
                if arity == 3:
                    a0 = submod(a0, v[i, at + 2, 0])
                    a1 = submod(a1, v[i, at + 2, 1])
                if weighted:
                    a0, a1 = ext_mulmod(a0, a1, w[i, j, 0], w[i, j, 1])
                out[i, 0] = addmod(out[i, 0], a0)
                out[i, 1] = addmod(out[i, 1], a1)


@njit_cached(**_OPTIONS)
def ext_powers(a, out):
    """out[i, l] = a[i]^l in F_(p^2): a (s, 2), out (s, n, 2), one product per power."""
    s, n, _ = out.shape
    for i in range(s):
        p0 = _ONE
        p1 = _ZERO
        a0 = a[i, 0]
        a1 = a[i, 1]
        for j in range(n):
            out[i, j, 0] = p0
            out[i, j, 1] = p1
            p0, p1 = ext_mulmod(p0, p1, a0, a1)


@njit_cached(**_OPTIONS)
def transpose(x, out):
    """out = x^T for x (m, n) of any strides, out (n, m) C-contiguous: in 32 x 32 tiles, so that
    both the reads and the writes stay within a few cache lines per tile (numpy's copy of a
    transposed view walks one of them with a stride of a whole row)."""
    m, n = x.shape
    tile = 32
    for i0 in range(0, m, tile):
        i1 = min(m, i0 + tile)
        for j0 in range(0, n, tile):
            j1 = min(n, j0 + tile)
            for j in range(j0, j1):
                oj = out[j]
                for i in range(i0, i1):
                    oj[i] = x[i, j]


def _probe_fused(vals, p):
    """The fused and strided loops against Python's integers on a small probe (edge and
    random values): the gadget sums in both layouts, the 2-D operations on views, the
    row-wise sparse map, the transpose and the powers in F_(p^2)."""
    def ext_mul_py(a, b):
        return ((a[0] * b[0] + 7 * a[1] * b[1]) % p, (a[0] * b[1] + a[1] * b[0]) % p)

    v = np.array(vals[:24], dtype=np.uint64)
    x = v.reshape(2, 3, 4)  # (K, L, m)
    w = v[::-1].copy().reshape(3, 2, 4)  # (L, 2, m)
    coeffs = np.array([1, vals[5], vals[9]], dtype=np.uint64)  # monic, highest first
    centre = np.uint64(vals[3])
    got = np.empty((2, 2, 4), np.uint64)
    square_poly_sums(x, centre, coeffs, w, got)
    for k in range(2):
        for i in range(4):
            polys = []
            for j in range(3):
                u = (int(x[k, j, i]) - int(centre)) ** 2 % p
                polys.append((u * u + int(coeffs[1]) * u + int(coeffs[2])) % p)
            for c in range(2):
                if int(got[k, c, i]) != sum(int(w[j, c, i]) * polys[j] for j in range(3)) % p:
                    return False
    y = v.reshape(2, 6, 2)  # two slots of MulSub (K = 2, m = 2)
    pw = v[:8].copy().reshape(2, 2, 2)
    got = np.empty((2, 2, 2), np.uint64)
    product_sums(y, 3, pw, True, got)
    plain = np.empty((2, 1, 2), np.uint64)
    product_sums(y, 2, pw, False, plain)
    for k in range(2):
        for i in range(2):
            g = [(int(y[k, 3 * j, i]) * int(y[k, 3 * j + 1, i]) - int(y[k, 3 * j + 2, i])) % p for j in range(2)]
            h = sum(int(y[k, 2 * j, i]) * int(y[k, 2 * j + 1, i]) for j in range(3)) % p
            if int(plain[k, 0, i]) != h or any(int(got[k, c, i]) != sum(int(pw[j, c, i]) * g[j] for j in range(2)) % p
                                               for c in range(2)):
                return False
    f = v.reshape(4, 3, 2)  # (m, L, 2) at the query point
    fw = v[::-1].copy().reshape(4, 3, 2)
    got = np.empty((4, 2), np.uint64)
    ext_square_poly_sums(f, centre, coeffs, fw, True, got)
    got_products = np.empty((4, 2), np.uint64)
    ext_product_sums(v[:16].copy().reshape(4, 2, 2), 2, fw, False, got_products)
    for i in range(4):
        total = (0, 0)
        for j in range(3):
            d = ((int(f[i, j, 0]) - int(centre)) % p, int(f[i, j, 1]))
            u = ext_mul_py(d, d)
            a = ext_mul_py(ext_mul_py(u, u), (1, 0))
            a = ((a[0] + int(coeffs[1]) * u[0] + int(coeffs[2])) % p, (a[1] + int(coeffs[1]) * u[1]) % p)
            a = ext_mul_py(a, (int(fw[i, j, 0]), int(fw[i, j, 1])))
            total = ((total[0] + a[0]) % p, (total[1] + a[1]) % p)
        if (int(got[i, 0]), int(got[i, 1])) != total:
            return False
        q = v[:16].reshape(4, 2, 2)
        if (int(got_products[i, 0]), int(got_products[i, 1])) != ext_mul_py(
                (int(q[i, 0, 0]), int(q[i, 0, 1])), (int(q[i, 1, 0]), int(q[i, 1, 1]))):
            return False
    wide = np.array(vals[:30], dtype=np.uint64).reshape(3, 10)
    a2, b2 = wide[:, 1:5], wide[:, 5:9]  # views of a wider array
    out2 = np.empty((3, 4), np.uint64)
    for op, fn in ((0, lambda s, t: (s + t) % p), (1, lambda s, t: (s - t) % p), (2, lambda s, t: s * t % p)):
        binary_2d(op, a2, b2, out2)
        if out2.tolist() != [[fn(int(s), int(t)) for s, t in zip(ra, rb)] for ra, rb in zip(a2, b2)]:
            return False
    t2 = np.empty((4, 3), np.uint64)
    transpose(a2, t2)
    if (t2 != a2.T).any():
        return False
    indptr = np.array([0, 2, 2, 3], np.int64)
    indices = np.array([0, 3, 1], np.int64)
    data = np.array([vals[4], vals[7], 1], np.uint64)
    const = np.array([vals[2], 0, vals[8]], np.uint64)
    rows_out = np.empty((3, 3), np.uint64)
    sparse_apply_rows(a2, indptr, indices, data, const, rows_out)
    for i in range(3):
        r = a2[i].tolist()
        expect = [(int(data[0]) * r[0] + int(data[1]) * r[3] + int(const[0])) % p, 0, (r[1] + int(const[2])) % p]
        if rows_out[i].tolist() != expect:
            return False
    base = v[:4].copy().reshape(2, 2)
    powers = np.empty((2, 5, 2), np.uint64)
    ext_powers(base, powers)
    for i in range(2):
        acc = (1, 0)
        for j in range(5):
            if (int(powers[i, j, 0]), int(powers[i, j, 1])) != acc:
                return False
            acc = ext_mul_py(acc, (int(base[i, 0]), int(base[i, 1])))
    return True


def load():
    """The loops as a namespace, once each agrees with Python's integers on a probe of edge and
    random values (and the NTT with a schoolbook transform), else None."""
    from types import SimpleNamespace

    p = int(_P)
    edge = [0, 1, 2, 7, p - 1, p - 2, (1 << 32) - 1, 1 << 32, (1 << 63) % p, p - (1 << 32), 0xFFFFFFFF00000000]
    rng = np.random.default_rng(2024)  # a probe, not randomness anyone relies on
    rand = [int(v) % p for v in rng.integers(0, 1 << 63, 24, dtype=np.int64)]
    vals = edge + rand
    a = np.array([x for x in vals for _ in vals], dtype=np.uint64)
    b = np.array([y for _ in vals for y in vals], dtype=np.uint64)
    out = np.empty_like(a)
    pairs = list(zip(a.tolist(), b.tolist()))
    mul(a, b, out)
    if out.tolist() != [x * y % p for x, y in pairs]:
        return None
    add(a, b, out)
    if out.tolist() != [(x + y) % p for x, y in pairs]:
        return None
    sub(a, b, out)
    if out.tolist() != [(x - y) % p for x, y in pairs]:
        return None
    power(a[:64], np.uint64(p - 2), out[:64])
    if out[:64].tolist() != [pow(x, p - 2, p) for x in a[:64].tolist()]:
        return None
    n = 8
    w = pow(7, (p - 1) // n, p)
    table = np.array([pow(w, (n // (2 * h)) * j, p) for h in (1, 2, 4) for j in range(h)], dtype=np.uint64)
    x = np.array([vals[:n]], dtype=np.uint64)
    expect = [sum(int(v) * pow(w, i * j, p) for j, v in enumerate(vals[:n])) % p for i in range(n)]
    cols = np.ascontiguousarray(np.repeat(x, 3, axis=0).T)
    ntt(x, table, _ONE)
    ntt_columns(cols, table, _ONE)
    if x[0].tolist() != expect or any(cols[:, c].tolist() != expect for c in range(3)):
        return None
    m2 = np.array([vals[:6], vals[6:12]], dtype=np.uint64)
    k2 = np.array([vals[12:15], vals[15:18], vals[18:21], vals[21:24], vals[24:27], vals[27:30]], dtype=np.uint64)
    prod = np.empty((2, 3), np.uint64)
    matmul(m2, k2, prod)
    if prod.tolist() != [[sum(int(m2[i, j]) * int(k2[j, c]) for j in range(6)) % p for c in range(3)] for i in range(2)]:
        return None
    prod_t = np.empty((2, 3), np.uint64)
    matmul_t(np.ascontiguousarray(m2.T), k2, prod_t)
    if (prod_t != prod).any():
        return None
    if not _probe_fused(vals, p):
        return None
    return SimpleNamespace(mul=mul, add=add, sub=sub, binary_2d=binary_2d, transpose=transpose,
                           ext_powers=ext_powers, power=power, batch_inverse=batch_inverse, ntt=ntt,
                           ntt_columns=ntt_columns, matmul=matmul, matmul_t=matmul_t,
                           weighted_lanes=weighted_lanes, sparse_apply=sparse_apply,
                           sparse_apply_rows=sparse_apply_rows, horner=horner,
                           ext_mul=ext_mul, ext_horner_lanes=ext_horner_lanes,
                           square_poly_sums=square_poly_sums, product_sums=product_sums,
                           ext_square_poly_sums=ext_square_poly_sums, ext_product_sums=ext_product_sums)
