"""Validity circuits for the fully linear proofs of flp.py, as data (docs/validity.md).

* :class:`RangeDigits` (width, digits, beta): every input element is a base-beta digit; the
  values it encodes are sum_m beta^m d_(i,m), each in [0, beta^digits).
* :class:`NormBound` (w, beta, q, r2): the row predicate of the design notes. The input holds,
  for each of the w coordinates x_i (integers, the fixed-point values of the shared vector),
  the q base-beta digits of x_i + H (H = beta^q / 2), then the digits of the slack
  s = R^2 - sum_i x_i^2. The circuit checks that every digit is in range (so |x_i| <= H and
  0 <= s < beta^(q_s), with no reduction mod p possible: w H^2 + beta^(q_s) <= p is required at
  construction) and that sum_i x_i^2 + s - R^2 == 0 (so sum_i x_i^2 <= R^2 over the integers).
  x_i = sum_m beta^m d_(i,m) - H is affine in the digits: the servers aggregate x from their
  digit shares (:attr:`NormBound.coordinates`).
* :class:`OneHotNorm`: a histogram's one-hot cells plus noise of bounded norm.
* :class:`GramNorm`: a gram or moments study's quadratic features: the products of a row of
  bounded norm (each product stated by a MulSub gadget), plus noise of bounded (weighted) norm.

Digits are little-endian: digit m of a value has weight beta^m. Each circuit groups its gadget
calls into ParallelSums; the group sizes default to those minimising proof plus verifier length
(:func:`best_count`).
"""

from __future__ import annotations

import numpy as np

from . import field, ntt
from .flp import Affine, Circuit, GadgetCalls, Mul, MulSub, ParallelSum, Range

P = field.P


def parallel_cost(items: int, count: int, inner_arity: int, degree: int, weighted: bool) -> int:
    """F_p elements of proof plus verifier message (2 per F_(p^2) element) that a ParallelSum of
    ``count`` groups over ``items`` inner calls costs."""
    calls = -(-items // count)
    arity = inner_arity * count
    wire_len = ntt.next_power_of_two(calls + 2)
    poly_len = degree * (wire_len - 1) + 1
    return 2 * arity + (2 if weighted else 1) * poly_len + 2 * (arity + 1)


def best_count(items: int, inner_arity: int, degree: int, weighted: bool) -> int:
    """The group size with the smallest :func:`parallel_cost` (the first of equals)."""
    return min(range(1, items + 1), key=lambda c: (parallel_cost(items, c, inner_arity, degree, weighted), c))


def _range_calls(n: int, beta: int, count: int | None) -> GadgetCalls:
    """ParallelSum(Range(beta), count, weighted) over the n input elements: call k, slot j reads
    element k count + j (slots past n read 0, a valid digit)."""
    count = count or best_count(n, 1, beta, True)
    calls = -(-n // count)
    idx = np.arange(n)
    wires = Affine.build(calls * count, n, idx, idx, np.ones(n, dtype=np.int64))
    return GadgetCalls(ParallelSum(Range(beta), count, weighted=True), calls, wires)


def to_digits(values: np.ndarray, beta: int, digits: int) -> np.ndarray:
    """(m, k) non-negative integers below beta^digits -> (m, k digits) little-endian digits
    (beta a power of two: shifts and a mask, one vectorised pass)."""
    v = np.asarray(values).astype(np.uint64)
    bits = beta.bit_length() - 1
    shifts = np.arange(digits, dtype=np.uint64) * np.uint64(bits)
    out = (v[..., None] >> np.minimum(shifts, np.uint64(63))) & np.uint64(beta - 1)
    out[..., shifts >= 64] = 0  # digits above 64 bits (numpy's shift is not defined there)
    return out.reshape(v.shape[0], -1)


class RangeDigits(Circuit):
    """Every one of width * digits input elements is a base-beta digit."""

    name = "RangeDigits"

    def __init__(self, width: int, digits: int, beta: int, count: int | None = None):
        if width < 1 or digits < 1:
            raise ValueError("width and digits are at least 1")
        self.width, self.digits, self.beta = width, digits, beta
        n = width * digits
        ranges = _range_calls(n, beta, count)
        k = np.arange(ranges.calls)
        checks_out = Affine.build(ranges.calls, ranges.calls, k, k, np.ones(ranges.calls, dtype=np.int64))
        checks_in = Affine.build(ranges.calls, n, [], [], [])
        super().__init__(n, [ranges], checks_in, checks_out)
        i = np.repeat(np.arange(width), digits)
        self.values = Affine.build(width, n, i, np.arange(n), [beta ** m for m in range(digits)] * width)

    def encode(self, values) -> np.ndarray:
        """(m, width) integers in [0, beta^digits) -> (m, width * digits) digits."""
        v = np.asarray(values)
        if v.ndim != 2 or v.shape[1] != self.width:
            raise ValueError(f"values are (m, {self.width})")
        if v.size and (v.min() < 0 or int(v.max()) >= self.beta ** self.digits):
            raise ValueError(f"a value is outside [0, {self.beta}^{self.digits})")
        return to_digits(v, self.beta, self.digits)

    def describe(self) -> dict:
        return {**super().describe(), "width": self.width, "digits": self.digits, "beta": self.beta}


class NormBound(Circuit):
    """w coordinates x_i in [-H, H), H = beta^q / 2, with sum x_i^2 <= R^2 (``r2``)."""

    name = "NormBound"

    def __init__(self, w: int, beta: int, q: int, r2: int, range_count: int | None = None,
                 square_count: int | None = None):
        if w < 1 or q < 1 or r2 < 0:
            raise ValueError("need w >= 1, q >= 1 and R^2 >= 0")
        self.w, self.beta, self.q, self.r2 = w, beta, q, int(r2)
        self.half = beta ** q // 2  # H
        self.slack_digits = slack_digits(beta, self.r2)
        if w * self.half ** 2 + beta ** self.slack_digits > P:
            raise ValueError(f"w H^2 + beta^q_s = {w * self.half ** 2 + beta ** self.slack_digits} exceeds p: "
                             "the norm could wrap around mod p")
        n = w * q + self.slack_digits
        ranges = _range_calls(n, beta, range_count)
        # squares: ParallelSum(Mul, count) with both wires of slot j of call k = x_(k count + j)
        count = square_count or best_count(w, 2, 2, False)
        calls = -(-w // count)
        i = np.repeat(np.arange(w), q)  # coordinate of each digit
        digit = np.arange(w * q)
        weight = [beta ** m for m in range(q)] * w
        rows = np.concatenate([2 * i, 2 * i + 1])  # wire rows: 2 (k count + j) and + 1 for coordinate k count + j
        squares = GadgetCalls(ParallelSum(Mul(), count, weighted=False), calls,
                              Affine.build(2 * calls * count, n, rows, np.concatenate([digit, digit]), weight * 2,
                                           const={r: -self.half for r in range(2 * w)}))
        # checks: one per range call (its weighted sum is 0), then the norm equation
        c = ranges.calls
        k = np.arange(c)
        out_r = np.concatenate([k, np.full(calls, c)])
        out_c = np.concatenate([k, c + np.arange(calls)])
        checks_out = Affine.build(c + 1, c + calls, out_r, out_c, np.ones(c + calls, dtype=np.int64))
        checks_in = Affine.build(c + 1, n, [c] * self.slack_digits, w * q + np.arange(self.slack_digits),
                                 [beta ** m for m in range(self.slack_digits)], const={c: -self.r2})
        super().__init__(n, [ranges, squares], checks_in, checks_out)
        #: x (m, w) from the input (or a share of it, with const_scale 1/N)
        self.coordinates = Affine.build(w, n, i, digit, weight, const={r: -self.half for r in range(w)})

    def encode(self, x) -> np.ndarray:
        """(m, w) integers with -H <= x_i < H and sum x_i^2 <= R^2 -> (m, n) digits (ValueError
        for a row outside the predicate: an honest client cannot prove it)."""
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.w or x.dtype.kind not in "iu":
            raise ValueError(f"x is an (m, {self.w}) integer array")
        x = x.astype(np.int64)
        if x.size and (x.min() < -self.half or x.max() >= self.half):
            raise ValueError(f"a coordinate is outside [-{self.half}, {self.half})")
        mag = np.abs(x).astype(np.uint64)
        norm2 = (mag * mag).sum(axis=1, dtype=np.uint64)  # < w H^2 < p: exact
        if (norm2 > np.uint64(self.r2)).any():
            raise ValueError("a row's squared norm exceeds R^2")
        slack = np.uint64(self.r2) - norm2
        digits = to_digits((x + self.half).astype(np.uint64), self.beta, self.q)
        return np.concatenate([digits, to_digits(slack[:, None], self.beta, self.slack_digits)], axis=1)

    def describe(self) -> dict:
        return {**super().describe(), "w": self.w, "beta": self.beta, "q": self.q, "r2": self.r2,
                "H": self.half, "slack_digits": self.slack_digits}


def _range_over(columns: np.ndarray, n: int, beta: int, count: int | None) -> GadgetCalls:
    """ParallelSum(Range(beta), count, weighted) over the given input columns (in order): call
    k, slot j reads columns[k count + j] (slots past the end read 0, in range for every beta)."""
    items = len(columns)
    count = count or best_count(items, 1, beta, True)
    calls = -(-items // count)
    return GadgetCalls(ParallelSum(Range(beta), count, weighted=True), calls,
                       Affine.build(calls * count, n, np.arange(items), columns, np.ones(items, dtype=np.int64)))


class OneHotNorm(Circuit):
    """A histogram report: x_i = unit b_i + e_i with b one-hot in each block of cells (``blocks``:
    (start, length) pairs covering the w cells; one block for a histogram over one grid, one per
    axis for a marginal histogram), and integer noise e with every |e_i| < H = beta^q / 2 and
    sum e_i^2 <= R^2.

    Input: the w bits b_i, then the q base-beta digits of e_i + H for each cell, then the q_s
    digits of the slack R^2 - sum e_i^2. Checks: every bit in {0, 1} (Range(2)), every digit in
    range, each block's bits sum to 1, and the norm equation (as :class:`NormBound`; w H^2 +
    beta^(q_s) <= p is required, so nothing wraps). x is affine in the input
    (:attr:`coordinates`): what the servers aggregate."""

    name = "OneHotNorm"

    def __init__(self, w: int, blocks: list[tuple[int, int]], unit: int, beta: int, q: int, r2: int):
        if w < 1 or q < 1 or r2 < 0 or unit < 1:
            raise ValueError("need w >= 1, q >= 1, R^2 >= 0 and unit >= 1")
        if sorted(blocks) != blocks or sum(length for _, length in blocks) != w or any(
                start != sum(length for _, length in blocks[:i]) for i, (start, _) in enumerate(blocks)):
            raise ValueError("the blocks must cover the w cells in order, without overlap")
        self.w, self.blocks, self.unit, self.beta, self.q, self.r2 = w, list(blocks), int(unit), beta, q, int(r2)
        self.half = beta ** q // 2
        self.slack_digits = slack_digits(beta, self.r2)
        if w * self.half ** 2 + beta ** self.slack_digits > P:
            raise ValueError("w H^2 + beta^q_s exceeds p: the noise's norm could wrap around mod p")
        n = w + w * q + self.slack_digits
        bits = _range_over(np.arange(w), n, 2, None)
        digits = _range_over(np.arange(w, n), n, beta, None)
        count = best_count(w, 2, 2, False)
        calls = -(-w // count)
        i = np.repeat(np.arange(w), q)  # cell of each noise digit
        digit = w + np.arange(w * q)
        weight = [beta ** m for m in range(q)] * w
        squares = GadgetCalls(ParallelSum(Mul(), count, weighted=False), calls,
                              Affine.build(2 * calls * count, n, np.concatenate([2 * i, 2 * i + 1]),
                                           np.concatenate([digit, digit]), weight * 2,
                                           const={r: -self.half for r in range(2 * w)}))
        c_bits, c_digits = bits.calls, digits.calls
        ranged = c_bits + c_digits
        nb = len(blocks)
        rows = ranged + nb + 1  # range checks, one per block, the norm equation
        out_r = np.concatenate([np.arange(ranged), np.full(calls, ranged + nb)])
        out_c = np.concatenate([np.arange(ranged), ranged + np.arange(calls)])
        checks_out = Affine.build(rows, ranged + calls, out_r, out_c, np.ones(ranged + calls, dtype=np.int64))
        in_r = [ranged + b for b, (start, length) in enumerate(blocks) for _ in range(length)]
        in_c = [start + j for start, length in blocks for j in range(length)]
        in_r += [ranged + nb] * self.slack_digits
        in_c += list(w + w * q + np.arange(self.slack_digits))
        in_v = [1] * w + [beta ** m for m in range(self.slack_digits)]
        const = {ranged + b: -1 for b in range(nb)}
        const[ranged + nb] = -self.r2
        checks_in = Affine.build(rows, n, in_r, in_c, in_v, const=const)
        super().__init__(n, [bits, digits, squares], checks_in, checks_out)
        #: x (m, w) = unit b + e, from the input (or a share of it, with const_scale 1/N)
        self.coordinates = Affine.build(w, n, np.concatenate([np.arange(w), i]),
                                        np.concatenate([np.arange(w), digit]),
                                        [self.unit] * w + weight, const={r: -self.half for r in range(w)})

    def encode(self, onehot, noise) -> np.ndarray:
        """One-hot rows (m, w) of 0/1 and noise (m, w) integers -> (m, n) input (ValueError for
        a row outside the predicate)."""
        b = np.asarray(onehot)
        e = np.asarray(noise)
        if b.shape != e.shape or b.ndim != 2 or b.shape[1] != self.w or e.dtype.kind not in "iu":
            raise ValueError(f"one-hot rows and noise are (m, {self.w}), the noise integers")
        b = b.astype(np.int64)
        if ((b != 0) & (b != 1)).any() or any((b[:, s:s + n].sum(axis=1) != 1).any() for s, n in self.blocks):
            raise ValueError("every block of a row must hold exactly one 1")
        e = e.astype(np.int64)
        if e.size and (e.min() < -self.half or e.max() >= self.half):
            raise ValueError(f"a noise value is outside [-{self.half}, {self.half})")
        mag = np.abs(e).astype(np.uint64)
        norm2 = (mag * mag).sum(axis=1, dtype=np.uint64)
        if (norm2 > np.uint64(self.r2)).any():
            raise ValueError("a row's noise exceeds the norm bound")
        slack = np.uint64(self.r2) - norm2
        return np.concatenate([b.astype(np.uint64), to_digits((e + self.half).astype(np.uint64), self.beta, self.q),
                               to_digits(slack[:, None], self.beta, self.slack_digits)], axis=1)

    def describe(self) -> dict:
        return {**super().describe(), "w": self.w, "blocks": self.blocks, "unit": self.unit, "beta": self.beta,
                "q": self.q, "r2": self.r2, "H": self.half, "slack_digits": self.slack_digits}


def _least_digits(beta: int, r2: int, halved_square: bool) -> int:
    q = 1
    while (beta ** q // 2) ** 2 <= r2 if halved_square else beta ** q <= r2:
        q += 1
    return q


def slack_digits(beta: int, r2: int) -> int:
    """The least q >= 1 with beta^q > r2: digits enough for a slack R^2 - (a norm) in [0, R^2]."""
    return _least_digits(beta, r2, halved_square=False)


def coordinate_digits(beta: int, r2: int) -> int:
    """The least q >= 1 with H^2 > R^2, H = beta^q / 2: digits enough for every coordinate u_i of a
    vector of norm at most R to be written as u_i + H in [0, beta^q)."""
    return _least_digits(beta, r2, halved_square=True)


class GramNorm(Circuit):
    """A gram (``linear``) or moments report over a row of d columns: x = psi(r) + e, with

    * r in Z^d the row's witness (|r_i| < H_r = beta^q_r / 2, sum r_i^2 <= R_r^2), in units of
      the witness grid g;
    * psi(r) the quadratic features in units of the noise grid h = g^2: [lin r_i (gram only),
      the products P_k = r_i r_j for i <= j (the diagonal, then the strict upper triangle row
      by row, as features.upper_triangle), count (gram only)], where lin = g / h and count = 1 / h;
    * e integer noise with every |e_i| < H = beta^q / 2 and sum_i c_i e_i^2 <= R^2, c_i = 2 on
      the strict upper triangle and 1 elsewhere: the norm of the noise in the release's own units
      (the upper triangle carries sqrt(2) times a product, features.py), so that the bound is
      the same whichever way a report spends it.

    Input: the q_r digits of r_i + H_r for each column, the D = d(d+1)/2 products, the q digits
    of e_i + H for each of the w coordinates, the digits of the row slack R_r^2 - sum_i P_ii,
    then of the noise slack R^2 - sum_i c_i e_i^2. Checks: every digit in range; every product
    r_i r_j - P_k = 0 (a weighted ParallelSum of MulSub: a wrong product in a call cannot cancel
    another); sum_i P_ii + row slack = R_r^2 (the row's norm, affine once the diagonal is
    proved); sum_i c_i e_i^2 + noise slack = R^2. d H_r^2 + beta^(q_rs) <= p and
    sum_i c_i H^2 + beta^(q_s) <= p are required, so neither norm can wrap around p. x is
    affine in the input (:attr:`coordinates`): what the servers aggregate."""

    name = "GramNorm"

    def __init__(self, d: int, linear: bool, lin: int, count_unit: int, beta: int, q_row: int, r2_row: int,
                 q: int, r2: int):
        if d < 1 or q_row < 1 or q < 1 or r2_row < 0 or r2 < 0 or lin < 1 or count_unit < 1:
            raise ValueError("need d >= 1, digits >= 1, bounds >= 0 and units >= 1")
        self.d, self.linear, self.lin, self.count_unit = d, bool(linear), int(lin), int(count_unit)
        self.beta, self.q_row, self.r2_row, self.q, self.r2 = beta, q_row, int(r2_row), q, int(r2)
        self.half_row = beta ** q_row // 2
        self.half = beta ** q // 2
        iu, ju = np.triu_indices(d, k=1)
        self.pairs = (np.concatenate([np.arange(d), iu]), np.concatenate([np.arange(d), ju]))
        n_prod = len(self.pairs[0])
        self.w = n_prod + (d + 1 if self.linear else 0)
        off = d + (d if self.linear else 0)  # first strict-upper coordinate of x
        self.norm_weights = np.ones(self.w, dtype=np.int64)
        self.norm_weights[off:off + n_prod - d] = 2
        self.row_slack_digits = slack_digits(beta, self.r2_row)
        self.slack_digits = slack_digits(beta, self.r2)
        if d * self.half_row ** 2 + beta ** self.row_slack_digits > P:
            raise ValueError("d H_r^2 + beta^q_rs exceeds p: the row's norm could wrap around mod p")
        if int(self.norm_weights.sum()) * self.half ** 2 + beta ** self.slack_digits > P:
            raise ValueError("sum c_i H^2 + beta^q_s exceeds p: the noise's norm could wrap around mod p")
        # the input's layout
        self.at_products = d * q_row
        self.at_noise = self.at_products + n_prod
        self.at_row_slack = self.at_noise + self.w * q
        self.at_slack = self.at_row_slack + self.row_slack_digits
        n = self.at_slack + self.slack_digits
        digit_cols = np.concatenate([np.arange(self.at_products), np.arange(self.at_noise, n)])
        ranges = _range_over(digit_cols, n, beta, None)
        # r_i = sum_m beta^m digit - H_r: the (column, digit, weight) entries of each r_i
        r_col = np.repeat(np.arange(d), q_row)
        r_digit = np.arange(d * q_row)
        r_weight = np.array([beta ** m for m in range(q_row)] * d, dtype=object)
        # products: slot k of the ParallelSum(MulSub) reads (r_i, r_j, P_k)
        count = best_count(n_prod, 3, 2, True)
        calls = -(-n_prod // count)
        # per product k, in order: r_i's q_row digits (row 3k), r_j's (row 3k + 1), P_k (row 3k + 2);
        # built as arrays (d(d+1)/2 products: 32,896 at d = 256), not a loop over them
        ks = np.arange(n_prod)
        digit_of = np.arange(q_row)
        i_cols = self.pairs[0][:, None] * q_row + digit_of
        j_cols = self.pairs[1][:, None] * q_row + digit_of
        prod_rows = np.concatenate([np.repeat(3 * ks, q_row).reshape(n_prod, q_row),
                                    np.repeat(3 * ks + 1, q_row).reshape(n_prod, q_row),
                                    (3 * ks + 2)[:, None]], axis=1).ravel()
        prod_cols = np.concatenate([i_cols, j_cols, (self.at_products + ks)[:, None]], axis=1).ravel()
        powers = [beta ** m for m in range(q_row)]
        prod_vals = (powers + powers + [1]) * n_prod
        prod_const = {row: -self.half_row for k in range(n_prod) for row in (3 * k, 3 * k + 1)}
        products = GadgetCalls(ParallelSum(MulSub(), count, weighted=True), calls,
                               Affine.build(3 * calls * count, n, prod_rows, prod_cols, prod_vals,
                                            const=prod_const))
        # noise squares: slot i of the ParallelSum(Mul) reads (c_i e_i, e_i)
        sq_count = best_count(self.w, 2, 2, False)
        sq_calls = -(-self.w // sq_count)
        e_coord = np.repeat(np.arange(self.w), q)
        e_digit = self.at_noise + np.arange(self.w * q)
        e_weight = np.array([beta ** m for m in range(q)] * self.w, dtype=object)
        left = e_weight * self.norm_weights[e_coord].astype(object)
        sq_const = {2 * i: -self.half * int(self.norm_weights[i]) for i in range(self.w)}
        sq_const.update({2 * i + 1: -self.half for i in range(self.w)})
        squares = GadgetCalls(ParallelSum(Mul(), sq_count, weighted=False), sq_calls,
                              Affine.build(2 * sq_calls * sq_count, n, np.concatenate([2 * e_coord, 2 * e_coord + 1]),
                                           np.concatenate([e_digit, e_digit]), list(left) + list(e_weight),
                                           const=sq_const))
        # checks: each range call, each product call, the row's norm, the noise's norm
        c_r, c_p = ranges.calls, products.calls
        rows = c_r + c_p + 2
        out_r = np.concatenate([np.arange(c_r + c_p), np.full(sq_calls, c_r + c_p + 1)])
        out_c = np.concatenate([np.arange(c_r + c_p), c_r + c_p + np.arange(sq_calls)])
        checks_out = Affine.build(rows, c_r + c_p + sq_calls, out_r, out_c, np.ones(len(out_r), dtype=np.int64))
        row_norm, noise_norm = c_r + c_p, c_r + c_p + 1
        in_r = ([row_norm] * d + [row_norm] * self.row_slack_digits + [noise_norm] * self.slack_digits)
        in_c = np.concatenate([self.at_products + np.arange(d), self.at_row_slack + np.arange(self.row_slack_digits),
                               self.at_slack + np.arange(self.slack_digits)])
        in_v: list[int] = ([1] * d + [beta ** m for m in range(self.row_slack_digits)]
                           + [beta ** m for m in range(self.slack_digits)])
        checks_in = Affine.build(rows, n, in_r, in_c, in_v, const={row_norm: -self.r2_row, noise_norm: -self.r2})
        super().__init__(n, [ranges, products, squares], checks_in, checks_out)
        # x = psi(r) + e
        x_rows, x_cols, x_vals = [e_coord], [e_digit], [e_weight]
        const = {i: -self.half for i in range(self.w)}
        at = 0
        if self.linear:
            x_rows.append(r_col)
            x_cols.append(r_digit)
            x_vals.append(r_weight * self.lin)
            for i in range(d):
                const[i] -= self.lin * self.half_row
            at = d
        x_rows.append(at + np.arange(n_prod))
        x_cols.append(self.at_products + np.arange(n_prod))
        x_vals.append(np.ones(n_prod, dtype=object))
        if self.linear:
            const[self.w - 1] += self.count_unit
        #: x (m, w) from the input (or a share of it, with const_scale 1/N)
        self.coordinates = Affine.build(self.w, n, np.concatenate(x_rows), np.concatenate(x_cols),
                                        list(np.concatenate(x_vals)), const=const)

    def features(self, rows) -> np.ndarray:
        """psi(r) (m, w) as int64 for witness rows r (m, d): what an honest x is before noise."""
        r = np.asarray(rows, dtype=np.int64)
        prods = r[:, self.pairs[0]] * r[:, self.pairs[1]]
        if not self.linear:
            return prods
        count = np.full((len(r), 1), self.count_unit, dtype=np.int64)
        return np.concatenate([self.lin * r, prods, count], axis=1)

    def within(self, rows, noise) -> np.ndarray:
        """Which reports (witness rows, noise) satisfy both norm bounds and the ranges."""
        r = np.asarray(rows, dtype=np.int64)
        e = np.asarray(noise, dtype=np.int64)
        ok = ((r >= -self.half_row) & (r < self.half_row)).all(axis=1)
        ok &= ((e >= -self.half) & (e < self.half)).all(axis=1)
        rm = np.minimum(np.abs(r), self.half_row).astype(np.uint64)
        em = np.minimum(np.abs(e), self.half).astype(np.uint64)
        ok &= (rm * rm).sum(axis=1, dtype=np.uint64) <= np.uint64(self.r2_row)
        ok &= (em * em * self.norm_weights.astype(np.uint64)).sum(axis=1, dtype=np.uint64) <= np.uint64(self.r2)
        return ok

    def encode(self, rows, noise) -> np.ndarray:
        """Witness rows (m, d) and noise (m, w), integers, -> (m, n) input (ValueError for a
        report outside the predicate: an honest client cannot prove it)."""
        r = np.asarray(rows)
        e = np.asarray(noise)
        if r.ndim != 2 or r.shape[1] != self.d or e.shape != (len(r), self.w) or r.dtype.kind not in "iu" \
                or e.dtype.kind not in "iu":
            raise ValueError(f"rows are (m, {self.d}) and noise (m, {self.w}) integers")
        r = r.astype(np.int64)
        e = e.astype(np.int64)
        if not self.within(r, e).all():
            raise ValueError("a report is outside the predicate (a range or a norm bound)")
        prods = r[:, self.pairs[0]] * r[:, self.pairs[1]]
        row_slack = np.uint64(self.r2_row) - (r * r).sum(axis=1).astype(np.uint64)
        em = np.abs(e).astype(np.uint64)
        slack = np.uint64(self.r2) - (em * em * self.norm_weights.astype(np.uint64)).sum(axis=1, dtype=np.uint64)
        return np.concatenate([to_digits((r + self.half_row).astype(np.uint64), self.beta, self.q_row),
                               field.encode_int(prods),
                               to_digits((e + self.half).astype(np.uint64), self.beta, self.q),
                               to_digits(row_slack[:, None], self.beta, self.row_slack_digits),
                               to_digits(slack[:, None], self.beta, self.slack_digits)], axis=1)

    def describe(self) -> dict:
        return {**super().describe(), "d": self.d, "linear": self.linear, "lin": self.lin,
                "count_unit": self.count_unit, "beta": self.beta, "q_row": self.q_row, "r2_row": self.r2_row,
                "H_row": self.half_row, "q": self.q, "r2": self.r2, "H": self.half,
                "row_slack_digits": self.row_slack_digits, "slack_digits": self.slack_digits}
