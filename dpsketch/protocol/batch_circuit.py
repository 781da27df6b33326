"""The circuit of a batch proof: m rows of w coordinates, each of squared norm at most R^2, proved
at once without a digit per coordinate (docs/validity.md section 15).

Why. A per-report proof (circuits.NormBound) writes every coordinate as ~7 base-4 digits so that
its norm cannot wrap around p: about 10 field elements a coordinate on the wire and in the
prover. Here the coordinates are field elements themselves (centred integers mod p), and what
keeps the norm from wrapping is the batch's wrap-around checks (wraparound.py), whose digits are
shared by every row of the batch. Per row the input holds O(1) more elements: the roots of its
slack, whose squares add up to it exactly.

Input (all F_p), for a batch of m rows filled up to ``rows`` = a multiple of L:

* per row, its w coordinates x_i (integers encoded centred, as field.encode_int), then the g + 4
  roots a_i of its slack s_i = R^2 - ||x_i||^2: g greedy squares (a = isqrt(s), s -= a^2;
  :func:`greedy_steps`: g = 1 for R^2 below 2^24, every sketch study of docs/validity.md section
  10) and an exact four-square decomposition of what they leave (a table up to 8,191:
  :func:`four_square_table`), so sum_j x_ij^2 + sum_k a_ik^2 = R^2 exactly; the rows past m
  (padding, to fill the last call) are x = 0 with the roots of R^2;
* the q_w base-4 digits of <z_k, v> + T for each of the r repetitions (v = the rows above).

Gadgets: ParallelSum(Range(4), weighted) over the wrap digits; ParallelSum(RowNorm(w + g + 4,
R^2), L, weighted) over the rows, RowNorm(a) = sum_j a_j^2 - R^2: a call adds up
sum_l r^l G(row l) over its L rows with r the gadget's joint randomness, a polynomial in r that
is 0 only if every row of the call is (the weights, not the check combination, separate the
rows; m / L call checks instead of m row checks keep the combination's degree near 2 sqrt(m / K)).
The wire map copies the rows in input order (the query reads them in place).

Checks: each range call; each row call (its output is 0); each repetition
sum_t 4^t d_kt - T - <z_k, v> = 0, linear in the input with coefficients z_kj in {-1, 0, 1} that
depend on the batch's wrap seed: the circuit keeps only the digits' part as an Affine and
:meth:`BatchNorm.checked` adds the projections (:class:`ProjectedChecks`), computed by
wraparound.project_seeded instead of an r x (rows K) matrix.

Why this is sound (section 15): if every |v_j| < 4^q_w (the wrap checks, else 2^-r per wrap
seed) then each row's sum of squares minus R^2 is an integer in (-p, p) (checked at
construction: (w + g + 4) (4^q_w - 1)^2 < p) that is 0 mod p, so 0: ||x_i||^2 = R^2 -
||a_i||^2 <= R^2. I/O-free.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import cast

import numpy as np

from . import field, ntt, wraparound
from .circuits import _range_over, to_digits
from .flp import Affine, Circuit, Gadget, GadgetCalls, ParallelSum

P = field.P
#: the exact four-square decompositions are tabulated up to this value; a slack above it first
#: loses greedy squares (a = isqrt(s), s -= a^2) until what is left is at most this
TABLE_LIMIT = 8191
EXACT = 4
BASE = 4


def greedy_steps(r2: int) -> int:
    """How many greedy squares every slack in [0, R^2] needs before the table takes the rest:
    s - isqrt(s)^2 <= 2 isqrt(s) and isqrt is monotone, so after a step from s <= X the rest is
    <= 2 isqrt(X). 0 up to R^2 = 8191, 1 below 2^24 (the sketch studies of section 10), 2 below 2^48."""
    bound, steps = int(r2), 0
    while bound > TABLE_LIMIT:
        bound, steps = 2 * math.isqrt(bound), steps + 1
    return steps


@functools.lru_cache(maxsize=1)
def four_square_table() -> np.ndarray:
    """(TABLE_LIMIT + 1, 4) int64: for each n some a, b, c, d >= 0 with a^2 + b^2 + c^2 + d^2 = n
    (Lagrange: one exists for every n), from sums of two sums of two squares."""
    top = math.isqrt(TABLE_LIMIT)
    a, b = (g.ravel() for g in np.meshgrid(np.arange(top + 1), np.arange(top + 1), indexing="ij"))
    n2 = a * a + b * b
    keep = n2 <= TABLE_LIMIT
    n2, pairs = n2[keep], np.stack([a[keep], b[keep]], axis=1)
    sums, first = np.unique(n2, return_index=True)
    two = np.full((TABLE_LIMIT + 1, 2), -1, dtype=np.int64)
    two[sums] = pairs[first]
    table = np.full((TABLE_LIMIT + 1, 4), -1, dtype=np.int64)
    for u in sums:  # ~2,000 sums of two squares: n = u + (another), vectorised over the others
        n = u + sums[sums <= TABLE_LIMIT - u]
        todo = n[table[n, 0] < 0]
        table[todo, :2] = two[u]
        table[todo, 2:] = two[todo - u]
    assert (table >= 0).all() and ((table * table).sum(axis=1) == np.arange(TABLE_LIMIT + 1)).all()
    return table


def _isqrt(s: np.ndarray) -> np.ndarray:
    """floor(sqrt(s)) of int64 values in [0, 2^62], exactly: the float root is within 1 (53-bit
    mantissa), then corrected both ways with integer squares."""
    a = np.sqrt(s.astype(np.float64)).astype(np.int64)
    for _ in range(2):
        a -= (a * a > s).astype(np.int64)
        a += ((a + 1) * (a + 1) <= s).astype(np.int64)
    return a


def slack_roots(slack, greedy: int) -> np.ndarray:
    """Roots (m, greedy + 4) with sum_k a_k^2 = s exactly for each s in [0, 2^62]: ``greedy``
    greedy squares (greedy_steps(R^2) of them for s <= R^2), then the tabulated four squares of
    the rest."""
    s = np.asarray(slack, dtype=np.int64).copy()
    if s.size and (s.min() < 0 or s.max() > 1 << 62):
        raise ValueError("a slack is negative or above 2^62")
    roots = np.empty((len(s), greedy + EXACT), dtype=np.int64)
    for k in range(greedy):
        roots[:, k] = _isqrt(s)
        s -= roots[:, k] * roots[:, k]
    if s.size and s.max() > TABLE_LIMIT:
        raise ValueError("too few greedy squares for this slack")
    roots[:, greedy:] = four_square_table()[s]
    return roots


class RowNorm(Gadget):
    """G(a_1, ..., a_K) = sum_j a_j^2 - R^2 (degree 2): zero iff the row (its coordinates, then its
    slack's roots) has squared norm exactly R^2."""

    degree = 2

    def __init__(self, arity: int, r2: int):
        self.arity, self.r2 = arity, int(r2) % P

    def on_values(self, wires, weights=None):
        return field.sub(field.total(field.mul(wires, wires), axis=-2), np.uint64(self.r2))

    def on_ext(self, wires, weights=None):
        return field.sub(field.total(field.ext_mul(wires, wires), axis=-2), field.ext(self.r2))

    def describe(self) -> str:
        return f"RowNorm({self.arity}, {self.r2})"


class RowNorms(ParallelSum):
    """ParallelSum(RowNorm(K, R^2), L, weighted): sum_l r^l G(row l) over a group of L rows, r from
    the joint randomness. In the prover, on one lane (one batch), the squares' sums and two F_p
    matrix products with the weights' coordinates (the generic path builds per-slot temporaries)."""

    def __init__(self, count: int, arity: int, r2: int):
        super().__init__(RowNorm(arity, r2), count, weighted=True)

    def on_values(self, wires, weights=None):
        if wires.shape[-1] != 1 or weights is None:
            return super().on_values(wires, weights)
        lead = wires.shape[:-2]
        k = self.inner.arity
        flat = wires.reshape(-1, self.count, k)
        g = field.sub(field.total(field.mul(flat, flat), axis=-1), np.uint64(self.inner.r2))  # (rows, count)
        out = field.matmul(g, np.ascontiguousarray(weights[:, :, 0]))  # (rows, 2): c0, c1
        return out.reshape(lead + (2, 1))


def best_rows_per_call(m: int, k: int) -> int:
    """L (rows per call) with the smallest proof plus verifier length: 2 L K seeds, 2 (2 (P - 1)
    + 1) coefficients (F_(p^2)), 2 (L K + 1) verifier elements, P = next_pow2(ceil(m / L) + 2);
    the smallest L among equals."""
    def cost(rows: int) -> int:
        return 4 * rows * k + 2 * (2 * (ntt.next_power_of_two(-(-m // rows) + 2) - 1) + 1) + 2
    return min(range(1, m + 1), key=lambda rows: (cost(rows), rows))


class ProjectedChecks:
    """A batch circuit's check map for one batch: the circuit's Affine (digits, constants) less
    <z_k, v> on the repetitions' rows (v the input's first v_len elements; the z from the batch's
    wrap seed, wraparound.project_seeded). Duck-types the part of :class:`flp.Affine` that
    flp.query uses."""

    def __init__(self, base: Affine, wrap_seed: bytes, v_len: int, first_row: int, reps: int, threads: int = 1):
        self.base, self.wrap_seed, self.v_len, self.first_row, self.reps = base, wrap_seed, v_len, first_row, reps
        self.threads = threads
        self.rows, self.cols, self.const = base.rows, base.cols, base.const

    def apply_lanes(self, xt: np.ndarray, const_scale: int = 1) -> np.ndarray:
        out = self.base.apply_lanes(xt, const_scale)
        rows = slice(self.first_row, self.first_row + self.reps)
        for lane in range(xt.shape[1]):  # one lane per batch: a verification handles one batch
            proj = wraparound.project_seeded(xt[:self.v_len, lane], self.wrap_seed, self.reps, threads=self.threads)
            out[rows, lane] = field.sub(out[rows, lane], proj)
        return out

    def apply(self, x: np.ndarray, const_scale: int = 1) -> np.ndarray:
        return self.apply_lanes(np.asarray(x).T, const_scale).T


class BatchNorm(Circuit):
    """m rows of w coordinates, each row of squared norm at most R^2 (``r2``), with r (``reps``)
    wrap-around checks of threshold T (module doc)."""

    name = "BatchNorm"

    def __init__(self, m: int, w: int, r2: int, reps: int = wraparound.REPETITIONS, threshold: int | None = None,
                 rows_per_call: int | None = None, range_count: int | None = None):
        if m < 1 or w < 1 or r2 < 0 or reps < 1:
            raise ValueError("need m >= 1, w >= 1, R^2 >= 0 and reps >= 1")
        self.m, self.w, self.r2, self.reps = m, w, int(r2), reps
        if self.r2 > 1 << 62:
            raise ValueError("R^2 above 2^62")
        self.squares = greedy_steps(self.r2) + EXACT  # the roots of a row's slack
        self.k = k = w + self.squares  # wires per row: its coordinates, then its slack's roots
        # the rows: call c holds rows c L .. c L + L - 1, slot l wire j = element j of row c L + l;
        # the rows past m (to fill the last call) are padding rows of norm R^2 in the input, so
        # that the wire map copies the input's first (rows) K elements in order and the query
        # reads them in place (flp.Affine.prefix_copy)
        self.rows_per_call = L = rows_per_call or best_rows_per_call(m, k)
        calls = -(-m // L)
        self.rows = calls * L
        # ||v||^2 = sum over every row (padding included) of R^2 exactly: Hoeffding's variance
        self.threshold = wraparound.threshold(self.rows, self.r2, reps) if threshold is None else int(threshold)
        self.wrap_digits = wraparound.digits_for(self.threshold)
        self.wrap_bound = BASE ** self.wrap_digits  # every |v_j| below this, else 2^-r per try
        if k * (self.wrap_bound - 1) ** 2 >= P:
            raise ValueError("(w + roots) (4^q_w - 1)^2 exceeds p: a row's norm could wrap around "
                             "(fewer rows per batch, or a smaller R^2)")
        self.v_len = self.rows * k
        self.at_wrap = self.v_len
        n = self.at_wrap + reps * self.wrap_digits
        ranges = _range_over(np.arange(self.at_wrap, n), n, BASE, range_count)
        wires = np.arange(self.v_len)
        rows = GadgetCalls(RowNorms(L, k, self.r2), calls,
                           Affine.build(self.v_len, n, wires, wires, np.ones(self.v_len, dtype=np.int64)))
        # checks: range calls, row calls, repetitions
        c_r = ranges.calls
        self.first_wrap_check = c_r + calls
        n_checks = c_r + calls + reps
        out = np.arange(c_r + calls)
        checks_out = Affine.build(n_checks, c_r + calls, out, out, np.ones(len(out), dtype=np.int64))
        rep_rows = self.first_wrap_check + np.repeat(np.arange(reps), self.wrap_digits)
        rep_cols = self.at_wrap + np.arange(reps * self.wrap_digits)
        rep_vals = np.tile(np.array([BASE ** q for q in range(self.wrap_digits)], dtype=np.int64), reps)
        checks_in = Affine.build(n_checks, n, rep_rows, rep_cols, rep_vals,
                                 const={self.first_wrap_check + r: -self.threshold for r in range(reps)})
        super().__init__(n, [ranges, rows], checks_in, checks_out)

    def checked(self, wrap_seed: bytes, threads: int = 1) -> "BatchNorm":
        """This circuit with the projections of one batch's wrap bits (from its wrap seed) in its
        checks: what a server queries with (the prover needs no checks); the projections on
        ``threads`` threads (wraparound.project_seeded)."""
        if len(wrap_seed) != 32:
            raise ValueError("a wrap seed is 32 bytes")
        out = copy.copy(self)
        # flp.query reads only rows, cols, const and apply_lanes of the check map, which
        # ProjectedChecks provides (it is not an Affine: its z change with every batch)
        out.checks_on_input = cast(Affine, ProjectedChecks(self.checks_on_input, bytes(wrap_seed), self.v_len,
                                                           self.first_wrap_check, self.reps, threads))
        return out

    # --- the honest witness ---------------------------------------------------------------------

    def prefix(self, x) -> np.ndarray:
        """x (m, w) integers with every row's squared norm <= R^2 -> the input's first v_len
        elements: each row's coordinates then the roots of its slack, then the padding rows
        (ValueError for a row outside)."""
        x = np.asarray(x)
        if x.shape != (self.m, self.w) or x.dtype.kind not in "iu":
            raise ValueError(f"x is an ({self.m}, {self.w}) integer array")
        x = x.astype(np.int64)
        if x.size and np.abs(x).max() > math.isqrt(self.r2):
            raise ValueError("a row's squared norm exceeds R^2")  # (and keeps the squares below in int64)
        norm2 = (x * x).sum(axis=1)
        if (norm2 > self.r2).any():
            raise ValueError("a row's squared norm exceeds R^2")
        return self.prefix_of(x, slack_roots(self.r2 - norm2, self.squares - EXACT))

    def prefix_of(self, x, roots) -> np.ndarray:
        """The input's first v_len elements from any x (m, w) and roots (m, squares): integers
        (encoded centred) or F_p elements (uint64): a forger's too, nothing is checked. The
        padding rows are x = 0 with the roots of R^2."""
        out = np.empty((self.rows, self.k), dtype=np.uint64)
        out[:self.m, :self.w] = _as_field(x)
        out[:self.m, self.w:] = _as_field(roots)
        out[self.m:, :self.w] = 0
        out[self.m:, self.w:] = _as_field(slack_roots([self.r2], self.squares - EXACT))
        return out.ravel()

    def coordinates(self, inputs: np.ndarray) -> np.ndarray:
        """x (m, w) from the input (or a share of it: the coordinates are input elements, no map)."""
        return inputs[:self.m * self.k].reshape(self.m, self.k)[:, :self.w]

    def wrap_input(self, projections) -> np.ndarray:
        """The repetitions' digits of <z_k, v> + T (centred projections, Python or numpy
        integers); ValueError if one is outside [-T, 4^q_w - T): an honest batch then redraws."""
        shifted = np.asarray(projections, dtype=np.int64) + self.threshold
        if (shifted < 0).any() or (shifted >= self.wrap_bound).any():
            raise ValueError("a wrap-around projection is outside its range")
        return to_digits(shifted[:, None].astype(np.uint64), BASE, self.wrap_digits).ravel()

    def describe(self) -> dict:
        return {**super().describe(), "m": self.m, "w": self.w, "r2": self.r2, "reps": self.reps,
                "threshold": self.threshold, "wrap_digits": self.wrap_digits, "rows_per_call": self.rows_per_call,
                "rows": self.rows,
                "squares": self.squares}


def _as_field(values) -> np.ndarray:
    """Integers (int64, or uint64 already F_p elements) as F_p elements."""
    v = np.asarray(values)
    if v.dtype == np.uint64:
        return field.elements(v)
    return field.encode_int(v.astype(np.int64))
