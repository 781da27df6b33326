"""Validity proofs of a study's reports: the predicate a report must satisfy, the client's
proof of it, and each server's share of the check (issue 40; docs/validity.md).

Why. Without it one enrolled client moves any release anywhere: its shares may add up to any
vector. With it every server refuses a report whose fully linear proof (flp.py) does not
verify, and a valid report moves the release no more than an honest report at the study's bound.

The predicate of a sketch study (``validity == "norm-bound/1"``). What the client shares is u,
its noisy (signed) vector in units of the study's noise grid (an integer vector: the client
rounds its clipped row to the grid and adds discrete Gaussian noise on it, noise.py). An honest
u is the sum of a vector of norm at most B (clip_bound keeps the rounded row within B) and of w
independent discrete Gaussians of parameter t (grid units), each t-subgaussian (Canonne, Kamath
and Steinke 2020) and cut at 20 t (a cut only lowers the moment generating function of a
symmetric variable). By Hsu, Kakade and Zhang (2012, Theorem 1) the noise's squared norm exceeds
t^2 (w + 2 sqrt(w a) + 2 a) with probability at most e^(-a); with a = 96 ln 2 that is 2^-96.
So the predicate is ||u|| <= R = B / h + t sqrt(w + 2 sqrt(w a) + 2 a) (R^2 rounded up), with
every |u_i| < H = beta^q / 2 >= R (which a u of norm <= R satisfies), circuits.NormBound.
An honest client whose noise falls outside (probability <= 2^-96 per report) draws it again;
the accounting charges the conditioning as it charges the 20-sigma cut (Study.tail_delta: at most
max_reports 2^-96 of total variation, so delta grows by (e^epsilon + 1) times that: 2^-96 rather
than the 2^-40 the issue asks or the 2^-64 of the first version, because a study refuses a tail
charge above 10^-6 delta, and at 2^-64 that refused every study from max_reports = 10^7 at
epsilon = 1 (every default study at n = 10^6); 2^-96 admits max_reports (e^epsilon + 1) up to
7.9 10^16 at delta = 10^-6, for 12-18% more allowance).

Encoding. A report's input is the NormBound digits of u (base 4); the servers aggregate
x = 2^shift u in F_p (an affine function of their digit shares, times the grid's 2^shift), so a
sum decodes as today's ring sum does: its centred representative is the int64 the ring would
hold (the study's overflow rule keeps every sum below (p - 1) / 2, Study._consistent).

Sharing. One server per batch, the leader, gets explicit shares: its input share (which the
report id commits to) and its proof share (made after the id fixed the joint randomness, so
the id cannot commit to it: a changed proof share only makes the proof fail). Every other
server, a helper, gets one 32-byte seed per report, which expands to its input and proof shares
(flp.expand_share).

The round (docs/protocol.md). After uploads close every server commits to a 32-byte contribution,
reveals it once it has seen every commitment (both through the analyzer), and the query seed is
SHA-256 of all of them: no client and no single server can choose the query point. Each server
computes its verifier share of each report; the analyzer returns to each the sum of the others';
each decides for itself. I/O-free.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import binding, features, field, flp
from .circuits import GramNorm, NormBound, OneHotNorm, coordinate_digits
from .keystream import Keystream

PREDICATE = "norm-bound/1"
#: the digits' base: the cheapest per report measured (docs/validity.md section 8)
BETA = 4
#: an honest report is outside the predicate with probability at most 2^REFUSAL_LOG2
REFUSAL_LOG2 = -96
COMMIT_DOMAIN = b"dpsketch/verify-commit/1"
SEED_DOMAIN = b"dpsketch/verify-seed/1"
CONTRIBUTION_BYTES = 32
_HALF_WORD = np.uint64(0xFFFFFFFF)
#: a validity study's grid puts its smallest noise at this many steps or a little more: fine
#: enough for the discrete noise argument (smoothing.py: a step of 1/64 of the client's noise
#: leaves an error near 2^-18000, where 2^-100 is required) and for accuracy (rounding moves a
#: row by h sqrt(w) / 2 at most), and coarse enough that a coordinate needs about 12 bits
#: instead of the 26 of the default grid (2^24 steps per sigma of the widest noise)
GRID_STEPS = 64
#: a gram or moments study's grid puts its smallest noise (the strict upper triangle's, sigma /
#: sqrt(2)) at this many steps or more: its features are rounded to the grid, so a step of 1/4096
#: of the noise keeps what rounding can bias a sum (every row the same) below 1/8192 of one
#: report's noise, while its witness grid g = sqrt(h) stays fine enough that the witness row's
#: rounding adds little to the allowance (docs/validity.md section 12)
GRAM_GRID_STEPS = 4096
#: a validity study without client noise (epsilon at its floor: the servers' noise carries the
#: whole guarantee) has its grid fine enough that rounding max_reports rows (h / 2 a coordinate
#: each, in the worst case all the same way) moves a cell by at most 1/FLOOR_BIAS of one
#: server's noise: no client noise grows with n to cover it (docs/validity.md section 14)
FLOOR_BIAS = 16
#: ... but with at most this many steps per server noise: a finer grid would need more digits a
#: coordinate than F_p holds the norm of (w H^2 < p; at 2^20, R = B / h stays near 2^20 B / tau)
FLOOR_MAX_STEPS = 1 << 20


class ValidityError(ValueError):
    """A validity study's parameters or a message of its round are not what the protocol allows."""


def norm_allowance(t: float, w: int, refusal_log2: float = REFUSAL_LOG2) -> float:
    """The noise norm an honest report stays within but for probability 2^refusal_log2: w
    t-subgaussian coordinates, t sqrt(w + 2 sqrt(w a) + 2 a), a = -refusal_log2 ln 2."""
    a = -refusal_log2 * math.log(2.0)
    return t * math.sqrt(w + 2.0 * math.sqrt(w * a) + 2.0 * a)


@dataclass(frozen=True)
class Plan:
    """What a validity study's reports are, derived from the study alone (every party computes
    the same): the circuit, the grid shift, and the sizes of each message."""

    circuit: NormBound | OneHotNorm | GramNorm
    w: int
    shift: int
    n_servers: int

    @property
    def input_len(self) -> int:
        return self.circuit.input_len

    @property
    def proof_len(self) -> int:
        return self.circuit.proof_len

    @property
    def verifier_len(self) -> int:
        return self.circuit.verifier_len

    @property
    def leader_width(self) -> int:
        """uint64 elements a leader receives and stores per report: input share, proof share."""
        return self.input_len + self.proof_len

    @property
    def state_width(self) -> int:
        """Columns of a server's running aggregate: the low and the high 32-bit halves of its
        F_p coordinate shares, each summed as an exact integer by the ring kernel."""
        return 2 * self.w

    @property
    def bound(self) -> int:
        """R^2 of the predicate, in grid units squared."""
        return self.circuit.r2


def noise_grid(smallest_std: float, frac_bits: int):
    """The coarsest power-of-two grid 2^(shift - f) on which the study's smallest noise has at
    least GRID_STEPS steps (the digits of a report are what a proof costs)."""
    from .noise import Grid

    shift = 0
    while shift < frac_bits and smallest_std * math.ldexp(1.0, frac_bits - shift - 1) >= GRID_STEPS:
        shift += 1
    return Grid(frac_bits, shift)


def gram_grid(smallest_std: float, frac_bits: int):
    """A gram or moments validity study's grid h = 4^-m, with witness grid g = 2^-m = sqrt(h)
    (so that a product of two witness values is an integer number of steps): the least m >= 0
    that puts ``smallest_std`` at GRAM_GRID_STEPS steps or more."""
    from .noise import Grid

    m = 0
    while smallest_std * 4.0 ** m < GRAM_GRID_STEPS:
        m += 1
    if 2 * m > frac_bits:
        raise ValueError(f"the noise ({smallest_std:.3g}) is too small for the study's {frac_bits} fractional "
                         "bits: a validity gram study needs its grid 4^-m on the ring")
    return Grid(frac_bits, frac_bits - 2 * m)


def floor_grid(server_std: float, max_reports: int, frac_bits: int, gram: bool):
    """The grid of a validity study without client noise: the coarsest of its kind (2^(shift - f),
    or 4^-m for a gram or moments study, ``server_std`` then the strict upper triangle's) whose
    step h keeps max_reports h / 2 <= server_std / FLOOR_BIAS, with at least the GRID_STEPS (or
    GRAM_GRID_STEPS) steps per server noise a study with client noise has and at most
    FLOOR_MAX_STEPS (from max_reports = 2^17 on, the bias bound is max_reports 2^-21 server_std)."""
    steps = min(max(GRID_STEPS, FLOOR_BIAS * max_reports / 2), FLOOR_MAX_STEPS)
    cap = server_std / steps  # the largest step allowed
    return gram_grid(cap * GRAM_GRID_STEPS, frac_bits) if gram else noise_grid(cap * GRID_STEPS, frac_bits)


def widened_server_sigma(server_sigma: float, per_cell: float, k: int, max_reports: int, frac_bits: int,
                         kind: str = "sketch") -> float:
    """The server noise a validity study without client noise needs: the discrete-noise argument
    keeps tau_c^2 - r^2 of a server's per-cell variance (Study.mechanism, r the rounding radius of
    the grid), which the calibration did not give up; so server_sigma is widened to
    sqrt(server_sigma^2 + r^2 / per_cell^2) (per_cell: server_noise_std / server_sigma, sqrt(s) or
    sqrt(s + 1)), r of the grid the widened noise itself gets (a fixed point: the grid moves only
    by powers of two). On :func:`floor_grid` at max_reports >= 1,000 (design()'s least) r is at
    most 1/480 of the noise, so this is a relative 2 10^-6 or less."""
    from .smoothing import rounding_radius

    gram = kind in features.GRAM_KINDS
    wide = server_sigma
    for _ in range(8):
        std = wide * per_cell
        grid = floor_grid(std * features.UPPER_SCALE if gram else std, max_reports, frac_bits, gram)
        r = rounding_radius((math.sqrt(2.0) if gram else 1.0) * grid.spacing, k)
        nxt = math.sqrt(server_sigma ** 2 + (r / per_cell) ** 2) * (1.0 + 1e-12)
        if nxt <= wide:
            return wide
        wide = nxt
    return wide


def widened_sigma(sigma: float, k: int, frac_bits: int, kind: str = "sketch") -> float:
    """The client noise a replace-one validity study without server noise needs: on its coarse
    grid (step h, GRID_STEPS steps per sigma) the rounding argument costs r^2 of the noise's
    variance (smoothing.rounding_radius, Study.mechanism), which a fine grid makes negligible and
    this one does not (about 3% of epsilon). So the calibrated sigma is widened to
    sqrt(sigma^2 + r^2), r of the grid the widened sigma itself gets (a fixed point, reached in a
    step or two: the grid moves only by powers of two)."""
    from .smoothing import rounding_radius

    gram = kind in features.GRAM_KINDS  # its grid (gram_grid) and the sqrt(2) h its argument is made for
    wide = sigma
    for _ in range(8):
        r = (rounding_radius(math.sqrt(2.0) * gram_grid(wide * features.UPPER_SCALE, frac_bits).spacing, k) if gram
             else rounding_radius(noise_grid(wide, frac_bits).spacing, k))
        nxt = math.sqrt(sigma * sigma + r * r) * (1.0 + 1e-12)
        if nxt <= wide:
            return wide
        wide = nxt
    return wide


def norm_bound_units(row_bound: float, spacing: float, t: int, w: int) -> int:
    """R^2 (grid units): (B / h + the noise allowance)^2, rounded up. A histogram's one-hot part
    is proved exactly, so its bound is the allowance alone (``row_bound`` = 0)."""
    r = row_bound / spacing + norm_allowance(t, w)
    return math.ceil(r * r)


def client_scale(study, std: float) -> int:
    """The client noise's parameter t in grid steps: grid.scale(std), or 0 in a study without
    client noise (Grid.scale's floor of 1 is for noise that is drawn; none is here)."""
    return study.noise_grid.scale(std) if study.sigma > 0 else 0


def _r2(study) -> int:
    grid = study.noise_grid
    row = 0.0 if study.kind == "histogram" else study.row_bound
    return norm_bound_units(row, grid.spacing, client_scale(study, study.sigma), study.width)


def bound_value(study) -> float:
    """The largest |coordinate| a valid report can have, in the study's units: R h for a sketch
    study, 1 + R h for a histogram (its cell plus the noise), the features of a row of norm R_r g
    plus R h for a gram or moments study: what the overflow rule must allow per report instead
    of the ring's value bound."""
    spacing = study.noise_grid.spacing
    if study.kind in features.GRAM_KINDS:
        c = plan(study).circuit
        assert isinstance(c, GramNorm)
        return (features.coordinate_bound(study.kind, math.sqrt(c.r2_row) * math.sqrt(spacing))
                + math.sqrt(c.r2) * spacing)
    reach = math.sqrt(_r2(study)) * spacing
    return 1.0 + reach if study.kind == "histogram" else reach


def allowed_value(kind: features.Kind, row_bound: float, sigma: float, width: int) -> float:
    """What design() allows per coordinate before the grid is known (a little above
    :func:`bound_value`): the feature bound plus the noise allowance."""
    return 1.01 * (features.coordinate_bound(kind, row_bound) + norm_allowance(sigma, width))


def max_frac_bits(max_reports: int, bound: float, extra: float) -> int:
    """The largest f with (max_reports bound + extra) 2^f <= (p - 1) / 2: no sum of valid
    reports and server noise wraps around p (ring.max_frac_bits' rule, for F_p)."""
    from . import ring

    f = ring.max_frac_bits(max_reports, bound, extra)
    while f > 0 and (max_reports * bound + extra) * 2.0 ** f > field.HALF:
        f -= 1
    return f


def check_study(study) -> None:
    """What a validity study must be (ValueError otherwise): a sketch study (with or without
    parties: each party's blocks then proved with its own bound, :func:`party_plan`), or a
    histogram, gram, moments or l1 study, with noise (its grid is set by the smallest client or
    server noise for the proof's digits; without client noise, as when epsilon is at the floor,
    by the servers' noise and max_reports, :func:`floor_grid`, and the predicate has t = 0),
    whose sums fit F_p."""
    if study.kind not in ("sketch", "histogram", "gram", "moments", "l1"):
        raise ValueError(f"validity proofs exist for sketch, histogram, gram, moments and l1 studies, not "
                         f"{study.kind} studies")
    if study.parties is not None and study.kind != "sketch":
        raise ValueError("only a sketch study has parties")
    if not (study.sigma > 0 or study.server_sigma > 0):
        raise ValueError("a validity study needs noise: its grid is set by the clients' noise, or without it "
                         "(epsilon at the floor) by the servers' (docs/validity.md section 14)")
    plans(study)


def _digits_for(r2: int) -> int:
    return coordinate_digits(BETA, r2)  # H^2 > R^2: every |u_i| <= R < H


@functools.lru_cache(maxsize=64)
def _plan(w: int, shift: int, r2: int, n_servers: int, blocks: tuple | None = None, unit: int = 0) -> Plan:
    q = _digits_for(r2)
    try:
        circuit = (NormBound(w, BETA, q, r2) if blocks is None else
                   OneHotNorm(w, [tuple(b) for b in blocks], unit, BETA, q, r2))
    except ValueError as exc:
        raise ValueError(f"no validity circuit for this study: {exc}") from None
    return Plan(circuit, w, shift, n_servers)


@functools.lru_cache(maxsize=64)
def _gram_plan(d: int, linear: bool, m: int, r2_row: int, r2: int, shift: int, n_servers: int) -> Plan:
    try:
        circuit = GramNorm(d, linear, 1 << m, 1 << (2 * m), BETA, _digits_for(r2_row), r2_row, _digits_for(r2), r2)
    except ValueError as exc:
        raise ValueError(f"no validity circuit for this study: {exc}") from None
    return Plan(circuit, circuit.w, shift, n_servers)


def gram_bounds(kind: features.Kind, d: int, row_bound: float, grid, t_eff: float) -> tuple[int, int]:
    """(R_r^2, R^2) of a gram or moments study, in witness and grid units squared.

    The witness r = round(a / g) of a row of norm <= B has ||r|| <= B / g + sqrt(d) / 2 = R_r.
    What the client shares, x = round_h(psi(a)) + e, differs from psi(r) by e, by the rounding
    to the grid (at most h / 2 a coordinate, sqrt(sum c_i) h / 2 in the weighted norm) and by
    psi(a) - psi(r g), whose weighted norm is that of the features in the release's units:
    ||a - r g|| <= delta = g sqrt(d) / 2 for the linear part and ||a a^T - (r g)(r g)^T||_F <=
    delta (2 B + delta). So R = the noise allowance of t_eff + those, over h."""
    h = grid.spacing
    g = math.sqrt(h)
    w = features.width(kind, d)
    weights = np.where(features.proved_scale(kind, d) < 1.0, 2, 1)  # c_i: 2 on the strict upper triangle
    delta = g * math.sqrt(d) / 2.0
    residual = math.hypot(delta if kind == "gram" else 0.0, delta * (2.0 * row_bound + delta))
    r = norm_allowance(t_eff, w) + residual / h + math.sqrt(int(weights.sum())) / 2.0
    r_row = row_bound / g + math.sqrt(d) / 2.0
    return math.ceil(r_row * r_row), math.ceil(r * r)


def plan(study) -> Plan:
    """The study's validity plan (cached per parameters): NormBound for a sketch study,
    OneHotNorm (one block of cells per axis of a marginal histogram, one for a grid) for a
    histogram study, whose unit is one count in grid units, 2^(f - shift), GramNorm for a gram
    or moments study (its noise parameter t on the diagonal, t_o = ceil(sigma UPPER_SCALE / h) on
    the strict upper triangle: t_eff = the larger of t and sqrt(2) t_o)."""
    grid = study.noise_grid
    if study.kind in features.GRAM_KINDS:
        t_eff = max(client_scale(study, study.sigma),
                    math.sqrt(2.0) * client_scale(study, study.sigma * features.UPPER_SCALE))
        r2_row, r2 = gram_bounds(study.kind, study.row_width, study.row_bound, grid, t_eff)
        m = (grid.frac_bits - grid.shift) // 2
        return _gram_plan(study.row_width, study.kind == "gram", m, r2_row, r2, grid.shift, study.n_servers)
    if study.kind == "histogram":
        spec = study.histogram
        if spec.marginal:
            blocks = tuple((int(o), int(n)) for o, n in zip(spec.offsets, spec.shape, strict=True))
        else:
            blocks = ((0, study.width),)
        return _plan(study.width, grid.shift, _r2(study), study.n_servers, blocks, 1 << (grid.frac_bits - grid.shift))
    return _plan(study.width, grid.shift, _r2(study), study.n_servers)


def party_plan(study, party: int) -> Plan:
    """The plan of party ``party``'s blocks in a validity study with parties: what it shares is
    its block of an individual's row (clipped to its own bound B_j, times the individual's sign
    in a signed study, rounded to the study's grid) plus the study's noise on each of its d_j
    columns, so its predicate is the sketch predicate of width d_j and bound B_j:
    NormBound(d_j, 4, q_j, R_j^2), R_j = B_j / h + t sqrt(d_j + 2 sqrt(d_j a) + 2 a). A valid
    block then moves the joined row no more than an honest block at B_j with its noise at the
    2^-96 tail, whatever the other parties do (docs/validity.md section 13)."""
    if study.parties is None:
        raise ValueError("only a study with parties has party plans")
    declared = study.parties[party]
    grid = study.noise_grid
    r2 = norm_bound_units(declared.row_bound, grid.spacing, client_scale(study, study.sigma), declared.width)
    return _plan(declared.width, grid.shift, r2, study.n_servers)


def plans(study) -> list[Plan]:
    """Every circuit a validity study's reports are proved with: one per party (in the study's
    order) for a study with parties, else the study's one (:func:`plan`)."""
    if study.parties is None:
        return [plan(study)]
    return [party_plan(study, j) for j in range(len(study.parties))]


def verifier_len(study) -> int:
    """F_(p^2) elements of one report's (or block's) verifier share in the round's messages: its
    plan's, or for a study with parties the largest party's (a block of a narrower party fills
    its party's first elements and 0 after them: docs/protocol.md section 6d)."""
    return max(p.verifier_len for p in plans(study))


# --- client ----------------------------------------------------------------------------------------

def grid_units(plan: Plan, encoded: np.ndarray) -> np.ndarray:
    """The client's noisy vectors (ring-encoded, on the grid) as integers in grid units."""
    x = np.asarray(encoded, dtype=np.uint64).view(np.int64)
    if plan.shift:
        if (x & ((1 << plan.shift) - 1)).any():
            raise ValidityError("a value is not on the study's noise grid")
        return x >> plan.shift
    return x.copy()


def within(plan: Plan, units: np.ndarray) -> np.ndarray:
    """Which rows (grid units; a histogram's noise alone) satisfy the norm bound: an honest
    client redraws the noise of the others (probability <= 2^-96 each)."""
    u = np.asarray(units, dtype=np.int64)
    half = plan.circuit.half
    inside = (u >= -half).all(axis=1) & (u < half).all(axis=1)
    mag = np.minimum(np.abs(u), half).astype(np.uint64)
    norm2 = (mag * mag).sum(axis=1, dtype=np.uint64)  # < w H^2 < p < 2^64: exact
    return inside & (norm2 <= np.uint64(plan.bound))


@dataclass
class Proved:
    """A batch of proved reports: ids, each server's binding proofs, the leader's explicit
    payload (input share then proof share) and each helper's seeds."""

    report_ids: list[bytes]
    binding: list[np.ndarray]
    full: int
    leader: np.ndarray
    seeds: list[np.ndarray | None]


def witness_rows(plan: Plan, rows: np.ndarray) -> np.ndarray:
    """A gram or moments client's witness: its clipped row in units of the witness grid g =
    sqrt(h), rounded to the nearest integer (ties to even), int64 (m, d)."""
    if not isinstance(plan.circuit, GramNorm):
        raise ValueError("only a gram or moments study's proof takes a witness row")
    m = plan.circuit.lin.bit_length() - 1  # g = 2^-m
    return np.rint(np.ldexp(np.asarray(rows, dtype=np.float64), m)).astype(np.int64)


def prepare(study, encoded: np.ndarray, stream: Keystream, full: int | None = None,
            onehot: np.ndarray | None = None, rows: np.ndarray | None = None,
            party: int | None = None, pseudonyms: Sequence[bytes] | None = None) -> Proved:
    """Digits, sharing, binding, joint randomness, proof: how a validity study's batch of noisy
    vectors (ring-encoded, as noise.noisy_encoded makes them) becomes what its servers receive.
    ``full``: the leader's position (default the last server). A histogram study needs the
    clients' one-hot rows (``onehot``, (m, w) of 0/1): its proof separates the cell from the
    noise; a gram or moments study the clipped rows (``rows``, (m, d)) its features came from:
    their witness is what its proof multiplies. One party's blocks of a study with parties
    (``party``, its index, and each block's individual's ``pseudonyms``): proved with the
    party's plan (:func:`party_plan`) and bound as blocks (binding.block_prefixes), so that the
    block id, hence the proof's joint randomness, commits to the party and the pseudonym too."""
    if (party is None) != (pseudonyms is None) or (party is None) != (study.parties is None):
        raise ValueError("a study with parties proves one party's blocks (party and pseudonyms), "
                         "a study without parties whole reports")
    p = plan(study) if party is None else party_plan(study, party)
    n = p.n_servers
    full = n - 1 if full is None else full
    if not 0 <= full < n:
        raise ValueError(f"full={full}: a server position, 0 to {n - 1}")
    units = grid_units(p, encoded)
    if isinstance(p.circuit, GramNorm):
        if rows is None or np.shape(rows) != (len(units), p.circuit.d):
            raise ValueError(f"a {study.kind} study's proof needs the clipped rows")
        witness = witness_rows(p, rows)
        noise = units - p.circuit.features(witness)
        if not p.circuit.within(witness, noise).all():
            raise ValidityError("a vector is outside the study's validity bound: redraw its noise")
        inputs = p.circuit.encode(witness, noise)
    else:
        if isinstance(p.circuit, OneHotNorm):
            if onehot is None or np.shape(onehot) != units.shape:
                raise ValueError("a histogram study's proof needs the one-hot rows")
            units = units - p.circuit.unit * np.asarray(onehot, dtype=np.int64)  # the noise alone
        if not within(p, units).all():
            raise ValidityError("a vector is outside the study's validity bound: redraw its noise")
        inputs = p.circuit.encode(onehot, units) if isinstance(p.circuit, OneHotNorm) else p.circuit.encode(units)
    shares = flp.share_inputs(p.circuit, inputs, n, stream)
    helpers = iter(shares.helper_seeds)
    seeds: list[np.ndarray | None] = [None if j == full else next(helpers) for j in range(n)]
    contents = [binding.CONTENT_SHARE if s is None else binding.CONTENT_SEED for s in seeds]
    payloads = [shares.leader_inputs if s is None else s for s in seeds]
    prefixes = None if party is None else binding.block_prefixes(study.study_id, party, list(pseudonyms or ()))
    ids, proofs = binding.bind(study.study_id, contents, payloads, prefixes, stream=stream)
    jr = flp.joint_rand(p.circuit, ids)
    proof = flp.prove(p.circuit, inputs, jr, flp.prove_rand(p.circuit, len(ids), stream))
    flp.share_proofs(shares, proof)
    leader = np.concatenate([shares.leader_inputs, shares.leader_proofs], axis=1)
    return Proved(ids, proofs, full, leader, seeds)


# --- server: storage and aggregation ---------------------------------------------------------------

def _seed_bytes(payload) -> np.ndarray:
    """Seeds as (m, 32) bytes, reinterpreting (never casting) whatever words hold them."""
    return np.ascontiguousarray(payload).view(np.uint8).reshape(-1, flp.SEED_BYTES)


def server_shares(plan: Plan, payload: np.ndarray, seeded: bool) -> tuple[np.ndarray, np.ndarray]:
    """A server's input shares (m, n) and proof shares (m, P) of the reports of one batch: a
    helper's from its (m, 32) seeds, a leader's from its (m, n + P) payload."""
    if seeded:
        return flp.expand_share(plan.circuit, _seed_bytes(payload))
    a = field.elements(payload, "leader share")
    if a.ndim != 2 or a.shape[1] != plan.leader_width:
        raise ValidityError(f"a leader's share has {plan.leader_width} elements per report")
    return a[:, :plan.input_len], a[:, plan.input_len:]


def input_shares(plan: Plan, payload: np.ndarray, seeded: bool) -> np.ndarray:
    """The input shares alone (what aggregation needs; a helper expands only n elements: the
    accepted words of a seed's expansion are the same whatever their count)."""
    if seeded:
        return field.expand(_seed_bytes(payload), plan.input_len, flp.SHARE_NONCE)
    return server_shares(plan, payload, False)[0]


def coordinate_shares(plan: Plan, inputs: np.ndarray) -> np.ndarray:
    """A server's F_p shares (m, w) of x = 2^shift u: the digits' affine map, its constant
    taking 1/N, times the grid's 2^shift."""
    inv_n = pow(plan.n_servers, field.P - 2, field.P)
    u = plan.circuit.coordinates.apply(inputs, const_scale=inv_n)
    return field.mul(u, np.uint64(pow(2, plan.shift, field.P))) if plan.shift else u


def split_words(values: np.ndarray) -> np.ndarray:
    """(m, w) F_p -> (m, 2 w) uint64: low 32 bits then high 32 bits, so that sums of up to 2^31
    of them (with signs +-1) are exact int64 totals in the ring kernel's uint64 arithmetic."""
    v = np.asarray(values, dtype=np.uint64)
    return np.concatenate([v & _HALF_WORD, v >> np.uint64(32)], axis=1)


def aggregand(plan: Plan, inputs: np.ndarray) -> np.ndarray:
    """What a server adds into its running aggregate for these reports (instead of a ring share)."""
    return split_words(coordinate_shares(plan, inputs))


def join_words(running: np.ndarray) -> np.ndarray:
    """The F_p values of a running aggregate of split words: (lo + 2^32 hi) mod p, lo and hi
    read as the signed integer totals they are."""
    r = np.asarray(running, dtype=np.uint64)
    w = r.shape[-1] // 2
    lo = field.encode_int(r[..., :w].view(np.int64))
    hi = field.encode_int(r[..., w:].view(np.int64))
    return field.add(lo, field.mul(hi, np.uint64(1 << 32)))


def release_share(plan: Plan, running: np.ndarray) -> np.ndarray:
    """A server's (k, w) F_p aggregate share from its running aggregate."""
    return join_words(running)


def field_noise(study) -> np.ndarray:
    """One server's floor noise (study.server_noise, on the grid; a gram study's strict upper
    triangle at 1/sqrt(2) of it, as its clients') as F_p elements."""
    return field.encode_int(study.server_noise().view(np.int64))


def to_ring(summed: np.ndarray) -> np.ndarray:
    """The sum of the servers' F_p aggregates as the ring sum it stands for: its centred
    representative, as int64 viewed uint64 (what ring.decode reads)."""
    return field.decode_int(summed).view(np.uint64)


# --- the verification round ------------------------------------------------------------------------

def new_contribution() -> bytes:
    return os.urandom(CONTRIBUTION_BYTES)


def commitment(study_id: str, position: int, contribution: bytes) -> bytes:
    """SHA-256(domain || study id || position (1 byte) || contribution)."""
    if len(contribution) != CONTRIBUTION_BYTES:
        raise ValidityError(f"a contribution is {CONTRIBUTION_BYTES} bytes")
    return hashlib.sha256(COMMIT_DOMAIN + study_id.encode() + bytes((position,)) + contribution).digest()


def check_reveal(study_id: str, commitments: Sequence[bytes], contributions: Sequence[bytes]) -> None:
    """Every revealed contribution matches its commitment (ValidityError naming the first that does not)."""
    if len(commitments) != len(contributions):
        raise ValidityError(f"{len(contributions)} contributions for {len(commitments)} commitments")
    for j, (c, opened) in enumerate(zip(commitments, contributions, strict=True)):
        if len(opened) != CONTRIBUTION_BYTES or commitment(study_id, j, opened) != c:
            raise ValidityError(f"server {j}'s contribution does not open its commitment")


def query_seed(study_id: str, contributions: Sequence[bytes]) -> bytes:
    """SHA-256(domain || study id || every server's contribution in position order)."""
    if any(len(c) != CONTRIBUTION_BYTES for c in contributions):
        raise ValidityError(f"a contribution is {CONTRIBUTION_BYTES} bytes")
    return hashlib.sha256(SEED_DOMAIN + study_id.encode() + b"".join(contributions)).digest()


@functools.lru_cache(maxsize=16)
def _query(plan: Plan, seed: bytes) -> flp.Query:
    return flp.Query(plan.circuit, flp.query_point(seed))


def verifier_shares(plan: Plan, seed: bytes, report_ids, inputs: np.ndarray, proofs: np.ndarray) -> np.ndarray:
    """One server's verifier shares (m, V, 2) of these reports at the round's query point."""
    jr = flp.joint_rand(plan.circuit, report_ids)
    return flp.query(plan.circuit, inputs, proofs, jr, _query(plan, seed), plan.n_servers)


def add_verifiers(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return field.add(a, b)


def decide(plan: Plan, report_ids, total: np.ndarray) -> np.ndarray:
    """Which reports' proofs verify (bool (m,)), from the sum of every server's verifier shares."""
    return flp.decide(plan.circuit, total, flp.joint_rand(plan.circuit, report_ids))


VERIFIERS_MEDIA_TYPE = "application/vnd.dpsketch.verifiers"


def encode_verifiers(report_ids, shares: np.ndarray) -> bytes:
    """A verifier message: u32 count m (little-endian), the m 16-byte report ids (ascending),
    then the (m, V, 2) elements (8 bytes little-endian each)."""
    return verifiers_head(report_ids) + field.to_wire(np.ascontiguousarray(shares))


def verifiers_head(report_ids) -> bytes:
    """A verifier message up to its elements (the count and the ids): a sender that makes the
    elements a chunk of reports at a time sends this, then each chunk's ``field.to_wire``."""
    ids = flp._id_matrix(report_ids)
    return struct.pack("<I", len(ids)) + ids.tobytes()


def decode_verifiers(body: bytes, plan: Plan | int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (m, 16) uint8, shares (m, V, 2)); ValidityError for a malformed body (length,
    an element >= p, ids not strictly ascending). ``plan``: the study's plan, or V itself
    (:func:`verifier_len`: a study with parties)."""
    if len(body) < 4:
        raise ValidityError("a verifier message starts with its 4-byte count")
    (m,) = struct.unpack_from("<I", body)
    v_len = plan if isinstance(plan, int) else plan.verifier_len
    per = 16 + 16 * v_len
    if len(body) != 4 + m * per:
        raise ValidityError(f"a verifier message of {m} reports is {4 + m * per} bytes, got {len(body)}")
    ids = np.frombuffer(body, dtype=np.uint8, count=16 * m, offset=4).reshape(m, 16)
    raw = np.frombuffer(body, dtype="<u8", offset=4 + 16 * m)
    try:
        shares = field.elements(raw, "verifier share").reshape(m, v_len, 2)
    except field.FieldError as exc:
        raise ValidityError(str(exc)) from None
    if m > 1:
        keys = ids.view(">u8").reshape(m, 2)
        hi, lo = keys[:, 0], keys[:, 1]
        ascending = (hi[1:] > hi[:-1]) | ((hi[1:] == hi[:-1]) & (lo[1:] > lo[:-1]))
        if not ascending.all():
            raise ValidityError("a verifier message's report ids must be strictly ascending")
    return ids, shares
