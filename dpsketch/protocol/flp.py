"""Fully linear proofs (Boneh, Boyle, Corrigan-Gibbs, Gilboa, Ishai, CRYPTO 2019, Theorem 4.3)
over F_p (field.py), vectorised over reports: the I/O-free core of the validity proofs
(docs/validity.md; issue 40).

A client holds an input x in F_p^n (digits, circuits.py) that a public circuit declares valid.
It proves so to N servers that each hold only an additive share of x and of the proof; each
server computes a short verifier share, linear in its shares, the verifier shares are added (by
the analyzer, in the product's flow) and anyone holding the sum decides. Nothing but validity
is revealed, and an invalid x is accepted with probability at most :meth:`Circuit.soundness`.

The circuit (data, not code per report; circuits.py builds them). Gadgets g (:class:`Mul`,
:class:`Range`, :class:`ParallelSum`), each called M_g times. Call k of gadget g gets its
arity L_g wire values from an affine map of x (:class:`Affine`, a sparse F_p matrix and a
constant). The circuit's C check values are an affine map of x and of the gadget outputs
y_(g,k); x is valid iff every check is zero, whatever the joint randomness. The checks are
combined into one value v = sum_i rho^i c_i, and a weighted ParallelSum uses the weights
1, r_g, r_g^2, ...: rho and the r_g are the joint randomness, in F_(p^2), known to the prover
(the product derives them from the report id, :func:`joint_rand`).

The proof (prover, :func:`prove`). For each gadget g and wire j the wire polynomial f_j of
degree < P_g = next_pow2(M_g + 2) has on the domain of size P_g (ntt.py) the values
f_j(w^0) = a_j, f_j(w^k) = wire j of call k (k = 1..M_g), f_j(w^(M_g + 1)) = b_j, 0 after; a_j,
b_j are fresh uniform elements of F_p (the prove randomness). The gadget polynomial
q_g = G_g(f_1, ..., f_L) has degree D_g (P_g - 1); its coefficients have F_(p^2) values for a
weighted gadget. Proof = for each gadget, its 2 L_g seeds (a_1, b_1, ..., a_L, b_L) and the
D_g (P_g - 1) + 1 coefficients of q_g, lowest first (F_(p^2) coefficients as (c0, c1)).

Why two seeds per wire. The query point t is in F_(p^2) \\ F_p, so f_j(t) = sum_k L_k(t) f_j(w^k)
is an element of F_(p^2) (two F_p coordinates) that the verifiers reveal. With one F_p seed it
would be uniform only on the line L_0(t) F_p + c through c = the contribution of the wire
values, and the line gives away an F_p-linear function of the wire values (tests/test_flp.py
shows it). L_0(t) and L_(M+1)(t) are F_p-independent for every t outside F_p, so with two seeds
f_j(t) is uniform on all of F_(p^2), whatever the input.

The query (each server, :func:`query`, linear in its shares): its share of every wire value
(the affine maps, constants divided by N), hence of f_j(t) by the Lagrange weights of the
domain at t (ntt.py: one weighted sum per wire); its share of q_g(t) from the coefficients, and
of the outputs y_(g,k) = q_g(w^k) (the coefficients folded mod X^P - 1, one NTT of size P);
hence its share of the checks and of v. Verifier message = [v, then for each gadget
f_1(t), ..., f_L(t), q_g(t)], F_(p^2) elements.

The decision (:func:`decide`, on the sum of the N verifier shares): v == 0 and
G_g(f_1(t), ..., f_L(t)) == q_g(t) for every gadget. One query point t serves every report of a
verification round (the Lagrange weights and powers of t are computed once, :class:`Query`); it
must be fixed after the reports are, which the product arranges (commit and reveal of every
server's contribution), and any t outside F_p is outside every domain.

Shapes: everything runs on m reports at once (m rows); a Python loop runs over gadgets, chunks
of reports and NTT stages, never over reports. I/O-free.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace

import numpy as np

from . import field, ntt
from .keystream import Keystream

P = field.P
#: elements of working memory a chunk of reports may use in prove and query
CHUNK_ELEMENTS = 1 << 22


# --- gadgets ------------------------------------------------------------------------------------

class Gadget:
    """A low-degree polynomial G: F^arity -> F that the circuit calls; ``weighted`` gadgets take
    per-report weights from the joint randomness (their gadget polynomial has F_(p^2)
    coefficients).

    Two layouts: the prover evaluates G at many points of F_p for many reports, wires
    (..., arity, m) with the m reports innermost; the decision at one point of F_(p^2) per
    report, wires (m, arity, 2)."""

    arity: int
    degree: int
    weighted: bool = False
    #: a weighted gadget's number of weighted slots (ParallelSum sets it; annotation only)
    count: int

    def on_values(self, wires: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
        """wires (..., arity, m) -> (..., m), or (..., 2, m) if weighted (weights (count, 2, m))."""
        raise NotImplementedError

    def on_ext(self, wires: np.ndarray, weights: np.ndarray | None) -> np.ndarray:
        """wires (..., arity, 2) -> (..., 2) (weights (m, count, 2))."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class Mul(Gadget):
    """G(a, b) = a b (degree 2)."""

    arity = 2
    degree = 2

    def on_values(self, wires, weights=None):
        return field.mul(wires[..., 0, :], wires[..., 1, :])

    def on_ext(self, wires, weights=None):
        return field.ext_mul(wires[..., 0, :], wires[..., 1, :])

    def describe(self) -> str:
        return "Mul"


class MulSub(Gadget):
    """G(a, b, c) = a b - c (degree 2): zero iff c is the product a b. A gram study's proof
    states each of its products with it (a weighted ParallelSum, so that no two wrong products
    of one call cancel)."""

    arity = 3
    degree = 2

    def on_values(self, wires, weights=None):
        return field.sub(field.mul(wires[..., 0, :], wires[..., 1, :]), wires[..., 2, :])

    def on_ext(self, wires, weights=None):
        return field.sub(field.ext_mul(wires[..., 0, :], wires[..., 1, :]), wires[..., 2, :])

    def describe(self) -> str:
        return "MulSub"


class Range(Gadget):
    """G(x) = prod_{v < beta} (x - v) (degree beta, a power of two): zero iff x is a base-beta
    digit. Evaluated as a polynomial of degree beta/2 in u = (x - c)^2, c = (beta - 1)/2:
    (x - v)(x - (beta - 1 - v)) = u - (c - v)^2, so beta/2 + 1 products per point instead of beta."""

    arity = 1

    def __init__(self, beta: int):
        if not ntt.is_power_of_two(beta) or beta < 2:
            raise ValueError(f"a digit base is a power of two >= 2, got {beta}")
        self.beta = beta
        self.degree = beta
        half = pow(2, P - 2, P)
        self.centre = (beta - 1) * half % P
        poly = [1]  # prod_v (u - (c - v)^2), lowest degree first, Python integers
        for v in range(beta // 2):
            root = (self.centre - v) ** 2 % P
            poly = [((poly[i - 1] if i else 0) - root * (poly[i] if i < len(poly) else 0)) % P
                    for i in range(len(poly) + 1)]
        self.in_u = np.array(poly, dtype=np.uint64)

    def on_values(self, wires, weights=None):
        d = field.sub(wires[..., 0, :], np.uint64(self.centre))
        return field.horner(self.in_u, field.mul(d, d))

    def on_ext(self, wires, weights=None):
        d = field.sub(wires[..., 0, :], field.ext(self.centre))
        u = field.ext_mul(d, d)
        acc = field.ext(np.full(u.shape[:-1], self.in_u[-1], dtype=np.uint64))
        for c in self.in_u[-2::-1]:
            acc = field.add(field.ext_mul(acc, u), field.ext(c))
        return acc

    def describe(self) -> str:
        return f"Range({self.beta})"


class ParallelSum(Gadget):
    """G(x_1, ..., x_count) = sum_l w_l inner(x_l) over ``count`` groups of inner's wires;
    w_l = r^l from the joint randomness r in F_(p^2) if ``weighted`` (so that the inner values of
    one call cannot cancel each other), else w_l = 1 (the plain sum: of products, a sum of
    squares)."""

    def __init__(self, inner: Gadget, count: int, weighted: bool):
        if count < 1:
            raise ValueError("a ParallelSum has at least one group")
        self.inner, self.count, self.weighted = inner, count, weighted
        self.arity = inner.arity * count
        self.degree = inner.degree

    def on_values(self, wires, weights=None):
        w = weights if self.weighted else None
        if isinstance(self.inner, Range) and w is not None:  # fused: one pass, no temporaries
            return field.square_poly_sums(wires, self.inner.centre, self.inner.in_u, w)
        if isinstance(self.inner, (Mul, MulSub)):
            return field.product_sums(wires, self.inner.arity, w)
        lead, m = wires.shape[:-2], wires.shape[-1]
        inner = self.inner.on_values(wires.reshape(lead + (self.count, self.inner.arity, m)))  # (..., count, m)
        if not self.weighted:
            return field.total(inner, axis=-2)
        return np.stack([field.weighted_lanes(inner, weights[:, c, :]) for c in (0, 1)], axis=-2)

    def on_ext(self, wires, weights=None):
        w = weights if self.weighted else None
        if wires.ndim == 3 and isinstance(self.inner, Range):  # (m, L, 2): the decision's layout
            return field.ext_square_poly_sums(wires, self.inner.centre, self.inner.in_u, w)
        if wires.ndim == 3 and isinstance(self.inner, (Mul, MulSub)):
            return field.ext_product_sums(wires, self.inner.arity, w)
        lead = wires.shape[:-2]
        inner = self.inner.on_ext(wires.reshape(lead + (self.count, self.inner.arity, 2)))  # (..., count, 2)
        if self.weighted:
            inner = field.ext_mul(inner, weights)
        return field.total(inner, axis=-2)

    def describe(self) -> str:
        return f"ParallelSum({self.inner.describe()}, {self.count}, {'weighted' if self.weighted else 'plain'})"


# --- affine maps ----------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Affine:
    """y = A x + c over F_p with A sparse (CSR): the wiring of a circuit, as data."""

    rows: int
    cols: int
    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    const: np.ndarray

    @classmethod
    def build(cls, rows: int, cols: int, r: Iterable[int], c: Iterable[int], v: Iterable[int],
              const: dict[int, int] | None = None) -> "Affine":
        """From entries (r, c, v) (integers, negative allowed, repeats summed mod p) and a
        constant per row (absent: 0). Vectorised: a batch circuit has millions of entries."""
        r = np.asarray(r if isinstance(r, np.ndarray) else list(r), dtype=np.int64).reshape(-1)
        c = np.asarray(c if isinstance(c, np.ndarray) else list(c), dtype=np.int64).reshape(-1)
        v = _mod_p(v)
        if len(r) != len(c) or len(c) != len(v):
            raise ValueError("entries need a row, a column and a value each")
        if len(r) and (r.min() < 0 or r.max() >= rows or c.min() < 0 or c.max() >= cols):
            raise ValueError("an entry lies outside the matrix")
        key = r * cols + c
        order = np.argsort(key, kind="stable")
        key = key[order]
        starts = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]])) if len(key) else key
        data = field.segment_total(v[order], starts) if len(key) else v
        key = key[starts]
        keep = data != 0
        key, data = key[keep], data[keep]
        indptr = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(np.bincount(key // cols, minlength=rows), out=indptr[1:])
        constant = np.zeros(rows, dtype=np.uint64)
        for row, value in (const or {}).items():
            constant[row] = int(value) % P
        return cls(rows, cols, indptr, key % cols, data, constant)

    @property
    def nnz(self) -> int:
        return len(self.data)

    def apply(self, x: np.ndarray, const_scale: int = 1) -> np.ndarray:
        """A x + const_scale c for every row of x (m, cols) -> (m, rows); a share uses
        const_scale = 1/N so that the N shares' constants add up to c. Row by row where the
        compiled loop is loaded (no transposed copy of x), else on lanes."""
        x = np.asarray(x, dtype=np.uint64)
        if x.ndim == 2 and x.shape[0] >= 16:
            const = field.mul(self.const, np.uint64(const_scale % P)) if self.const.any() else self.const
            out = field.sparse_apply_rows(x, self.indptr, self.indices, self.data, const)
            if out is not None:
                return out
        return self.apply_lanes(x.T, const_scale).T

    def apply_lanes(self, xt: np.ndarray, const_scale: int = 1) -> np.ndarray:
        """The same on the columns of xt (cols, m) -> (rows, m) (m lanes innermost). By the
        :attr:`_plan`: a row that selects one input with coefficient 1 is a copy, not a sum of
        products, and rows with several entries are summed once per distinct row (a Mul's two
        wires are often the same row)."""
        plan = self._plan
        xt = np.ascontiguousarray(xt, dtype=np.uint64)
        out = np.zeros((self.rows, xt.shape[1]), dtype=np.uint64)
        if len(plan.picked):
            out[plan.picked] = xt[plan.picked_cols]
        if len(plan.summed):
            out[plan.summed] = field.sparse_apply(xt, plan.indptr, plan.indices, plan.data)[plan.summed_from]
        scale = const_scale % P
        if scale and len(plan.constant_rows):
            shift = field.mul(self.const[plan.constant_rows], np.uint64(scale))[:, None]
            out[plan.constant_rows] = field.add(out[plan.constant_rows], shift)
        return out

    @functools.cached_property
    def prefix_copy(self) -> int | None:
        """k if the map copies the first k inputs to its first k rows, in order, and every other
        row is 0 (no constant): a range check's wiring; else None."""
        plan = self._plan
        k = len(plan.picked)
        if len(plan.summed) or len(plan.constant_rows) or not k:
            return None
        if (plan.picked != np.arange(k)).any() or (plan.picked_cols != np.arange(k)).any():
            return None
        return k

    @functools.cached_property
    def _plan(self) -> SimpleNamespace:
        """``picked`` rows (one entry, coefficient 1) and the columns they copy; ``summed`` rows
        (several entries, or one other coefficient), each from the CSR of the distinct such rows
        (``summed_from``); rows with a constant. Vectorised but for the distinct summed rows."""
        counts = np.diff(self.indptr)
        first = self.indptr[:-1]
        single = counts == 1
        one = np.zeros(self.rows, dtype=bool)
        one[single] = self.data[first[single]] == 1
        picked = np.flatnonzero(one)
        summed = np.flatnonzero((counts > 0) & ~one)
        signatures: dict[tuple, int] = {}
        summed_from = np.empty(len(summed), dtype=np.int64)
        indptr, indices, data = [0], [], []  # type: list[int], list[int], list[int]
        for i, row in enumerate(summed.tolist()):
            a, b = self.indptr[row], self.indptr[row + 1]
            key = (tuple(self.indices[a:b].tolist()), tuple(self.data[a:b].tolist()))
            if key not in signatures:
                signatures[key] = len(signatures)
                indices += key[0]
                data += key[1]
                indptr.append(len(indices))
            summed_from[i] = signatures[key]
        return SimpleNamespace(
            picked=picked, picked_cols=self.indices[first[picked]], summed=summed, summed_from=summed_from,
            indptr=np.array(indptr, dtype=np.int64), indices=np.array(indices, dtype=np.int64),
            data=np.array(data, dtype=np.uint64), constant_rows=np.flatnonzero(self.const))

    def dense(self) -> np.ndarray:
        """A as a dense (rows, cols) uint64 array (tests, small circuits)."""
        out = np.zeros((self.rows, self.cols), dtype=np.uint64)
        for row in range(self.rows):
            for e in range(self.indptr[row], self.indptr[row + 1]):
                out[row, self.indices[e]] = self.data[e]
        return out


def _mod_p(values) -> np.ndarray:
    """Integers (negative allowed, any size) mod p as uint64."""
    if isinstance(values, np.ndarray) and values.dtype.kind == "u":
        return (values.astype(np.uint64) % np.uint64(P)).reshape(-1)
    if isinstance(values, np.ndarray) and values.dtype.kind == "i":
        x = values.astype(np.int64).reshape(-1)
        minus = (-(x + 1)).astype(np.uint64)  # -x - 1, exact for every int64
        return np.where(x < 0, np.uint64(P - 1) - minus, x.astype(np.uint64))
    return np.array([int(x) % P for x in values], dtype=np.uint64)


# --- circuits -----------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class GadgetCalls:
    """A gadget with its M calls: wire j of call k is row k * arity + j of ``wires``."""

    gadget: Gadget
    calls: int
    wires: Affine

    def __post_init__(self):
        if self.calls < 1 or self.wires.rows != self.calls * self.gadget.arity:
            raise ValueError("the wire map needs one row per wire of every call")

    @property
    def arity(self) -> int:
        return self.gadget.arity

    @property
    def wire_len(self) -> int:
        """P: the domain of the wire polynomials (two seeds and the M calls)."""
        return ntt.next_power_of_two(self.calls + 2)

    @property
    def poly_len(self) -> int:
        """Coefficients of the gadget polynomial: D (P - 1) + 1."""
        return self.gadget.degree * (self.wire_len - 1) + 1

    @property
    def eval_len(self) -> int:
        """The domain the prover computes the gadget polynomial on."""
        return ntt.next_power_of_two(self.poly_len)

    @property
    def coeff_width(self) -> int:
        """F_p elements per coefficient of the gadget polynomial."""
        return 2 if self.gadget.weighted else 1

    @property
    def proof_len(self) -> int:
        return 2 * self.arity + self.coeff_width * self.poly_len

    @property
    def verifier_len(self) -> int:
        """F_(p^2) elements: f_1(t), ..., f_L(t), q(t)."""
        return self.arity + 1


class Circuit:
    """A validity circuit as data: gadget calls with their wire maps, and the checks.

    ``checks_on_input`` (C x n) and ``checks_on_outputs`` (C x total calls, the outputs of the
    gadgets in order, call by call) give the C check values; the constant is on the input map.
    The joint randomness of one report is (r_g for each weighted gadget, in order, then rho), in
    F_(p^2)."""

    name = "circuit"

    def __init__(self, input_len: int, gadgets: Sequence[GadgetCalls], checks_on_input: Affine,
                 checks_on_outputs: Affine):
        self.input_len = input_len
        self.gadgets = tuple(gadgets)
        self.checks_on_input = checks_on_input
        self.checks_on_outputs = checks_on_outputs
        total_calls = sum(g.calls for g in self.gadgets)
        if any(g.wires.cols != input_len for g in self.gadgets) or checks_on_input.cols != input_len:
            raise ValueError("every map reads the whole input")
        if checks_on_outputs.cols != total_calls or checks_on_outputs.rows != checks_on_input.rows:
            raise ValueError("the checks read every gadget output, one row per check")
        if checks_on_outputs.const.any():
            raise ValueError("the checks' constant belongs to checks_on_input")

    @property
    def checks(self) -> int:
        return self.checks_on_input.rows

    @property
    def weighted(self) -> list[int]:
        """The gadgets (their positions) that take weights from the joint randomness."""
        return [i for i, g in enumerate(self.gadgets) if g.gadget.weighted]

    @property
    def joint_rand_len(self) -> int:
        """F_(p^2) elements of joint randomness per report."""
        return len(self.weighted) + 1

    @property
    def prove_rand_len(self) -> int:
        """F_p elements of prove randomness per report: the two seeds of every wire."""
        return sum(2 * g.arity for g in self.gadgets)

    @property
    def proof_len(self) -> int:
        """F_p elements per proof."""
        return sum(g.proof_len for g in self.gadgets)

    @property
    def verifier_len(self) -> int:
        """F_(p^2) elements per verifier message: v, then f(t) and q(t) for every gadget."""
        return 1 + sum(g.verifier_len for g in self.gadgets)

    def weights(self, position: int, joint_rand: np.ndarray) -> np.ndarray | None:
        """The weights (m, count, 2) of gadget ``position``: 1, r, r^2, ... for its r."""
        g = self.gadgets[position].gadget
        if not g.weighted:
            return None
        r = joint_rand[:, self.weighted.index(position)]
        return field.ext_powers(r, g.count)

    def describe(self) -> dict:
        return {"name": self.name, "input_len": self.input_len, "checks": self.checks,
                "joint_rand_len": self.joint_rand_len, "prove_rand_len": self.prove_rand_len,
                "proof_len": self.proof_len, "verifier_len": self.verifier_len,
                "gadgets": [{"gadget": g.gadget.describe(), "calls": g.calls, "arity": g.arity,
                             "degree": g.gadget.degree, "wire_len": g.wire_len, "poly_len": g.poly_len}
                            for g in self.gadgets]}

    def soundness(self, grinding: int = 1) -> dict[str, Fraction]:
        """The soundness error per report, exactly (docs/validity.md):

        * ``query``: the gadget identity q_g = G_g(f) false yet true at t, t uniform in
          F_(p^2) \\ F_p: at most max_g D_g (P_g - 1) / (p^2 - p) (Schwartz-Zippel);
        * ``joint``: every gadget identity true, x invalid, yet v = 0: v is a non-zero
          polynomial in (rho, r_g) of total degree at most (C - 1) + max_g (count_g - 1), so at
          most that over p^2 for one draw of the joint randomness; a client that tries
          ``grinding`` report ids (the joint randomness is derived from the id) multiplies it;
        * ``total``: their sum."""
        p2 = P * P
        query = max(Fraction(g.gadget.degree * (g.wire_len - 1), p2 - P) for g in self.gadgets)
        counts = [g.gadget.count - 1 for g in self.gadgets if g.gadget.weighted]
        joint = Fraction(grinding * (self.checks - 1 + max(counts, default=0)), p2)
        return {"query": query, "joint": joint, "total": query + joint}

    def chunk_rows(self, per_report: int) -> int:
        return max(1, CHUNK_ELEMENTS // max(1, per_report))


# --- randomness -------------------------------------------------------------------------------

JOINT_DOMAIN = b"dpsketch/joint/1"
JOINT_NONCE = hashlib.sha256(JOINT_DOMAIN).digest()[:12]
QUERY_DOMAIN = b"dpsketch/query/1"
QUERY_NONCE = hashlib.sha256(QUERY_DOMAIN).digest()[:12]
SHARE_DOMAIN = b"dpsketch/flp-share/1"
SHARE_NONCE = hashlib.sha256(SHARE_DOMAIN).digest()[:12]
SEED_BYTES = 32
REPORT_ID_BYTES = 16


def joint_rand(circuit: Circuit, report_ids: np.ndarray | Sequence[bytes]) -> np.ndarray:
    """The joint randomness of each report from its id, (m, J, 2): key_i = SHA-256(
    "dpsketch/joint/1" || report_id_i), then 2 J elements of F_p by :func:`field.expand` under
    that key (nonce SHA-256("dpsketch/joint/1")[:12]), as J pairs (c0, c1). The id commits to
    every input share (report binding), so the prover learns r only once its input is fixed."""
    from .binding import hash_rows  # the binding's vectorised SHA-256 of many rows

    ids = _id_matrix(report_ids)
    keys = hash_rows(len(ids), [JOINT_DOMAIN, ids])
    return field.expand(keys, 2 * circuit.joint_rand_len, JOINT_NONCE).reshape(len(ids), circuit.joint_rand_len, 2)


def _id_matrix(report_ids) -> np.ndarray:
    if isinstance(report_ids, np.ndarray):
        ids = np.ascontiguousarray(report_ids, dtype=np.uint8)
    else:
        try:
            joined = b"".join(report_ids)  # bytes-like ids: one C-level join, no per-id Python
        except TypeError:
            joined = b"".join(bytes(r) for r in report_ids)
        ids = np.frombuffer(joined, dtype=np.uint8)
    return ids.reshape(-1, REPORT_ID_BYTES)


def query_point(seed: bytes) -> np.ndarray:
    """A query point t in F_(p^2) \\ F_p from a 32-byte seed: pairs (c0, c1) of elements by
    :func:`field.expand` (nonce SHA-256("dpsketch/query/1")[:12]), the first with c1 != 0."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a query seed is {SEED_BYTES} bytes")
    count = 8
    while True:
        pairs = field.expand(bytes(seed), 2 * count, QUERY_NONCE).reshape(count, 2)
        good = np.flatnonzero(pairs[:, 1] != 0)
        if len(good):
            return pairs[good[0]].copy()
        count *= 2


def prove_rand(circuit: Circuit, m: int, stream: Keystream) -> np.ndarray:
    """Fresh prove randomness (m, prove_rand_len) from a CSPRNG stream (field.sample)."""
    return field.sample(stream, m * circuit.prove_rand_len).reshape(m, circuit.prove_rand_len)


# --- prove, query, decide --------------------------------------------------------------------------

def _check_rows(name: str, a: np.ndarray, m: int, shape: tuple[int, ...]) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != (m,) + shape:
        raise ValueError(f"{name} has shape {a.shape}, expected {(m,) + shape}")
    return field.elements(a, name)


def _wire_values(calls: GadgetCalls, xt: np.ndarray, seeds: np.ndarray, length: int,
                 const_scale: int = 1) -> np.ndarray:
    """(length, L, m): per wire [a_j, the M call values, b_j, 0 ...] on the wire domain, for
    the inputs xt (n, m) and the seeds (L, 2, m)."""
    L, M, m = calls.arity, calls.calls, xt.shape[1]
    vals = np.zeros((length, L, m), dtype=np.uint64)
    vals[0] = seeds[:, 0]
    vals[1:M + 1] = calls.wires.apply_lanes(xt, const_scale).reshape(M, L, m)
    vals[M + 1] = seeds[:, 1]
    return vals


def _wires_at_t(calls: GadgetCalls, xt: np.ndarray, seeds: np.ndarray, lagrange: np.ndarray,
                inv_n: int) -> np.ndarray:
    """f_j(t) for every wire j and lane, (L m, 2): sum_k L_k(t) times the values at w^0 ..
    w^(M+1) (seeds, calls, seeds). Where the wire map copies the first inputs in order (a range
    check's), the calls whose wires are all inputs are read in place from xt, and only the
    seeds and the last, partly filled calls are copied."""
    L, M, m = calls.arity, calls.calls, xt.shape[1]
    prefix = calls.wires.prefix_copy
    if prefix is None:
        vals = _wire_values(calls, xt, seeds, M + 2, inv_n)  # the values at w^0 .. w^(M+1)
        return field.matmul_t(vals.reshape(M + 2, L * m), lagrange[:M + 2])
    full = min(prefix // L, M)  # calls 1 .. full: rows (k - 1) L .. k L - 1 of xt
    rest = np.zeros((M - full + 2, L, m), dtype=np.uint64)  # seeds a, calls full + 1 .. M, seeds b
    rest[0] = seeds[:, 0]
    tail = xt[full * L:prefix]
    rest[1:M - full + 1].reshape(-1, m)[:len(tail)] = tail
    rest[-1] = seeds[:, 1]
    weights = np.concatenate([lagrange[:1], lagrange[full + 1:M + 2]])
    f_t = field.matmul_t(rest.reshape(len(rest), L * m), weights)
    if full:
        f_t = field.add(f_t, field.matmul_t(xt[:full * L].reshape(full, L * m), lagrange[1:full + 1]))
    return f_t


def prove(circuit: Circuit, inputs: np.ndarray, joint_rand: np.ndarray, prove_rand: np.ndarray) -> np.ndarray:
    """Proofs (m, proof_len) that each row of ``inputs`` (m, input_len) is valid, under each
    report's joint randomness (m, J, 2) and prove randomness (m, prove_rand_len)."""
    m = len(inputs)
    x = _check_rows("input", inputs, m, (circuit.input_len,))
    jr = _check_rows("joint randomness", joint_rand, m, (circuit.joint_rand_len, 2))
    pr = _check_rows("prove randomness", prove_rand, m, (circuit.prove_rand_len,))
    out = np.empty((m, circuit.proof_len), dtype=np.uint64)
    per_report = max(g.arity * g.eval_len * 3 for g in circuit.gadgets)
    step = circuit.chunk_rows(per_report)
    for start in range(0, m, step):
        rows = slice(start, min(m, start + step))
        out[rows] = _prove_chunk(circuit, x[rows], jr[rows], pr[rows])
    return out


def _prove_chunk(circuit: Circuit, x, jr, pr) -> np.ndarray:
    """Reports innermost (lanes): the wire values (P, L, m), their coefficients by one inverse
    NTT, their values on the gadget's evaluation domain (K, L, m), G there, and q's
    coefficients by one more inverse NTT."""
    m = len(x)
    xt = field.lanes(x)
    prt = field.lanes(pr)
    parts = []
    seed_at = 0
    for position, calls in enumerate(circuit.gadgets):
        L, P_, K = calls.arity, calls.wire_len, calls.eval_len
        seeds = prt[seed_at:seed_at + 2 * L].reshape(L, 2, m)
        seed_at += 2 * L
        evals = ntt.extend_columns(_wire_values(calls, xt, seeds, P_), K)  # the wires on the size-K domain
        weights = circuit.weights(position, jr)
        lanes = None if weights is None else np.ascontiguousarray(weights.transpose(1, 2, 0))
        q = ntt.ntt_columns(calls.gadget.on_values(evals, lanes), inverse=True, in_place=True)[:calls.poly_len]
        if calls.gadget.weighted:  # (poly_len, 2, m) -> (m, poly_len, 2): (c0, c1) pairs
            q = q.transpose(2, 0, 1).reshape(m, 2 * calls.poly_len)
        else:
            q = q.T
        parts += [pr[:, seed_at - 2 * L:seed_at], q]
    return np.concatenate(parts, axis=1)


class Query:
    """What a verification round computes once for its query point t: for each gadget the
    Lagrange weights of its wire domain at t, and the powers of t."""

    def __init__(self, circuit: Circuit, t):
        self.t = ntt.ext_point(t)
        if int(self.t[1]) == 0:
            raise ValueError("the query point must lie outside F_p (and so outside every domain)")
        self.lagrange = {g.wire_len: ntt.lagrange_weights(g.wire_len, self.t) for g in circuit.gadgets}
        self.powers = ntt.powers(self.t, max(g.poly_len for g in circuit.gadgets))


def query(circuit: Circuit, input_shares: np.ndarray, proof_shares: np.ndarray, joint_rand: np.ndarray,
          t, num_shares: int) -> np.ndarray:
    """One server's verifier shares (m, verifier_len, 2) for its input shares (m, input_len)
    and proof shares (m, proof_len), at query point t ((2,) or a :class:`Query`), the N =
    ``num_shares`` servers' constants each taking 1/N of the circuit's."""
    m = len(input_shares)
    x = _check_rows("input share", input_shares, m, (circuit.input_len,))
    pi = _check_rows("proof share", proof_shares, m, (circuit.proof_len,))
    jr = _check_rows("joint randomness", joint_rand, m, (circuit.joint_rand_len, 2))
    if num_shares < 1:
        raise ValueError("num_shares >= 1")
    prepared = t if isinstance(t, Query) else Query(circuit, t)
    out = np.empty((m, circuit.verifier_len, 2), dtype=np.uint64)
    per_report = 2 * (circuit.input_len + circuit.proof_len) + sum(
        g.arity * (g.calls + 4) + 4 * g.wire_len for g in circuit.gadgets)
    step = circuit.chunk_rows(per_report)
    inv_n = pow(num_shares, P - 2, P)
    for start in range(0, m, step):
        rows = slice(start, min(m, start + step))
        out[rows] = _query_chunk(circuit, x[rows], pi[rows], jr[rows], prepared, inv_n)
    return out


def _at_t(coeffs: np.ndarray, powers: np.ndarray) -> np.ndarray:
    """q(t) for each lane from coefficients (n, m) or (n, 2, m) and the powers of t: (m, 2)."""
    if coeffs.ndim == 2:
        return field.matmul_t(coeffs, powers[:len(coeffs)])
    u = field.matmul_t(coeffs[:, 0], powers[:len(coeffs)])  # c0(t)
    v = field.matmul_t(coeffs[:, 1], powers[:len(coeffs)])  # c1(t); X (a + b X) = 7 b + a X
    return field.add(u, np.stack([field.mul(np.uint64(7), v[:, 1]), v[:, 0]], axis=-1))


def _query_chunk(circuit: Circuit, x, pi, jr, prepared: Query, inv_n: int) -> np.ndarray:
    """Reports innermost, as in the prover."""
    m = len(x)
    xt = field.lanes(x)
    pit = field.lanes(pi)
    out = np.empty((m, circuit.verifier_len, 2), dtype=np.uint64)
    outputs = []
    at, col = 0, 1
    for calls in circuit.gadgets:
        L, M, P_ = calls.arity, calls.calls, calls.wire_len
        seeds = pit[at:at + 2 * L].reshape(L, 2, m)
        at += 2 * L
        width = calls.coeff_width * calls.poly_len
        shape = (calls.poly_len, 2, m) if calls.gadget.weighted else (calls.poly_len, m)
        coeffs = pit[at:at + width].reshape(shape)  # (c0, c1) pairs: rows 2j and 2j + 1
        at += width
        f_t = _wires_at_t(calls, xt, seeds, prepared.lagrange[P_], inv_n)  # (L m, 2)
        out[:, col:col + L] = f_t.reshape(L, m, 2).transpose(1, 0, 2)
        out[:, col + L] = _at_t(coeffs, prepared.powers)
        # the outputs q(w^k) = (q mod X^P - 1)(w^k), k = 1..M: fold, then one NTT of size P
        folded = np.zeros((P_,) + coeffs.shape[1:], dtype=np.uint64)
        for start in range(0, calls.poly_len, P_):
            part = coeffs[start:start + P_]
            folded[:len(part)] = field.add(folded[:len(part)], part)
        y = ntt.ntt_columns(folded, in_place=True)[1:M + 1]
        if not calls.gadget.weighted:
            y = np.stack([y, np.zeros_like(y)], axis=1)
        outputs.append(y)  # (M, 2, m)
        col += L + 1
    y = np.concatenate(outputs, axis=0)  # (total calls, 2, m)
    checks = np.empty((circuit.checks, 2, m), dtype=np.uint64)
    checks[:, 0] = field.add(circuit.checks_on_input.apply_lanes(xt, inv_n),
                             circuit.checks_on_outputs.apply_lanes(y[:, 0]))
    checks[:, 1] = circuit.checks_on_outputs.apply_lanes(y[:, 1])
    out[:, 0] = field.ext_horner_lanes(checks, np.ascontiguousarray(jr[:, -1].T)).T
    return out


def decide(circuit: Circuit, verifier: np.ndarray, joint_rand: np.ndarray) -> np.ndarray:
    """Whether each report's proof verifies, from the sum of the N verifier shares (m,
    verifier_len, 2): v == 0 and G_g(f(t)) == q_g(t) for every gadget. A bool array (m,)."""
    outcome = decision_parts(circuit, verifier, joint_rand)
    ok = outcome["v_is_zero"].copy()
    for gadget_ok in outcome["gadgets"]:
        ok &= gadget_ok
    return ok


def decision_parts(circuit: Circuit, verifier: np.ndarray, joint_rand: np.ndarray) -> dict:
    """The parts of the decision, each a bool array (m,): ``v_is_zero`` (the combined checks)
    and ``gadgets`` (G_g(f(t)) == q_g(t), one array per gadget): which one refused a report."""
    m = len(verifier)
    v = _check_rows("verifier", verifier, m, (circuit.verifier_len, 2))
    jr = _check_rows("joint randomness", joint_rand, m, (circuit.joint_rand_len, 2))
    gadgets = []
    col = 1
    for position, calls in enumerate(circuit.gadgets):
        L = calls.arity
        at_t = calls.gadget.on_ext(v[:, col:col + L], circuit.weights(position, jr))
        gadgets.append((at_t == v[:, col + L]).all(axis=-1))
        col += L + 1
    return {"v_is_zero": (v[:, 0] == 0).all(axis=-1), "gadgets": gadgets}


def reconstruct(shares: Sequence[np.ndarray]) -> np.ndarray:
    """The sum of N shares (inputs, proofs or verifier messages) mod p."""
    acc = np.asarray(shares[0], dtype=np.uint64)
    for s in shares[1:]:
        acc = field.add(acc, s)
    return acc


# --- sharing with seed-compressed helpers ---------------------------------------------------------

def expand_share(circuit: Circuit, seeds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A helper's input share (m, input_len) and proof share (m, proof_len) from its 32-byte
    seeds (m, 32): input_len + proof_len elements by :func:`field.expand` (nonce
    SHA-256("dpsketch/flp-share/1")[:12]), the input share first."""
    n = circuit.input_len
    both = field.expand(seeds, n + circuit.proof_len, SHARE_NONCE)
    return both[:, :n], both[:, n:]


@dataclass
class ClientShares:
    """A batch split for N servers: N - 1 helpers get a 32-byte seed per report (their input
    and proof shares expand from it), the leader the input share and the proof share that
    complete the sums. The leader's input share is fixed before the joint randomness (the report
    id commits to it), its proof share after the proof: :func:`share_inputs`, then
    :func:`share_proofs`."""

    helper_seeds: list[np.ndarray]
    leader_inputs: np.ndarray
    helper_proof_sum: np.ndarray
    leader_proofs: np.ndarray | None = None


def share_inputs(circuit: Circuit, inputs: np.ndarray, num_shares: int, stream: Keystream) -> ClientShares:
    """Seeds for N - 1 helpers and the leader's input share x - sum of the helpers' input shares."""
    if num_shares < 2:
        raise ValueError("need at least two shares")
    x = field.elements(inputs, "input")
    m = len(x)
    seeds = [stream.array(SEED_BYTES * m).reshape(m, SEED_BYTES) for _ in range(num_shares - 1)]
    n = circuit.input_len
    helpers = None  # the helpers' input and proof shares summed, (m, n + P), one pass per helper
    for s in seeds:
        both = field.expand(s, n + circuit.proof_len, SHARE_NONCE)  # a view: the adds read it in place
        helpers = both if helpers is None else field.add(helpers, both)
    assert helpers is not None
    return ClientShares(seeds, field.sub(x, helpers[:, :n]), helpers[:, n:])


def share_proofs(shares: ClientShares, proofs: np.ndarray) -> ClientShares:
    """The leader's proof shares: proof - sum of the helpers' proof shares."""
    shares.leader_proofs = field.sub(field.elements(proofs, "proof"), shares.helper_proof_sum)
    return shares
