"""The multi-level l1 sketch of paper 003 (Algorithm 2, after Munteanu et al. 2023), as a public
linear map of report ids, and the certificate that makes it private in the LTM.

Why a second map. Least absolute deviations needs an *l1* subspace embedding: OSNAP's random
signs preserve l2 norms, not sums of absolute values. The l1 sketch keeps 0/1 entries and samples:

* **level 0** (a CountMin of every report): in each of ``s`` blocks of ``level0_buckets`` rows a
  report lands in one row; weight 1/s;
* **levels h = 1 .. levels**: a report lands in at most one of them, level h with probability
  p_h = b^-h - b^-(h+1) (b = ``branching``, an integer >= 2), in one of ``buckets`` rows; weight
  1/p_h, so a level's weighted sum of |bucket residuals| estimates the sum over all reports.

A report's column S_i thus has s ones at level 0 and at most one more. The analyzer fits on the
weighted rows (``L1Spec.weights``); the servers only add shares into rows, as for OSNAP.

The hash (docs/protocol.md, "l1 sketch hash"):

    digest = BLAKE2b(key = seed, digest_size = 8 (s + 2), message = b"dpsketch/l1/1" || r)
    u_j    = little-endian uint64 of digest[8j : 8j+8]
    level 0, block l < s: row l * level0_buckets + floor(u_l * level0_buckets / 2^64)
    sampled level:  h = #{ j in 1 .. levels+1 : u_s < T_j },  T_j = ceil(2^64 / b^j)
                    (h = 0 or h = levels + 1: no sampled level, the slot is empty)
    its row:        s * level0_buckets + (h - 1) * buckets + floor(u_{s+1} * buckets / 2^64)

Integer thresholds keep the map bit-exact on every platform (no floating-point logarithm).

The certificate
---------------
OSNAP's certificate lambda_min(S_H S_H^T) - t >= lambda_star rests on every column having unit
norm: then each report's leverage S_i^T (S_H S_H^T)^{-1} S_i is at most 1/lambda_min. Here the
columns have s or s + 1 ones and the deep levels are sparse, so lambda_min says little, and a
bucket holding one report would release that report under its own noise alone. What the privacy
of report i really depends on: with each report's noise N(0, sigma^2) per value, the release's
noise covariance (per data column) is sigma^2 S_H S_H^T, and changing report i shifts the mean by
S_i (a_i - a_i'). The Gaussian mechanism's mu is then

    mu^2 = ||a_i - a_i'||^2 * S_i^T (S_H S_H^T)^+ S_i / sigma^2 = Delta^2 * leverage_i / sigma^2,

(S_i lies in the range of S_H S_H^T since i is in H) which is the study's calibration exactly when
leverage_i <= 1 / lambda_star. So a server accepts an inclusion set only if the *largest* leverage
over it is at most 1 / lambda_star (:func:`leverages`, :func:`certify`): exact, not a bound, and
cheap, since S S^T is only k x k and each column has at most s + 1 entries.

With t colluding clients (their noise not honest), S_H S_H^T = M - sum_{j in T} S_j S_j^T with
M = S S^T over the whole set. Every S_j lies in range(M) and has ||S_j||^2 <= kappa = s + 1, so
S_j S_j^T <= kappa P (P the projector on range(M)) and S_H S_H^T >= M - t kappa P. If every
positive eigenvalue of M exceeds t kappa, then leverage_i(H) <= S_i^T (M - t kappa P)^+ S_i: what
:func:`leverages` returns for t > 0 (infinity when the condition fails).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DOMAIN = b"dpsketch/l1/1"
SEED_BYTES = 32
MAX_BLOCKS = 6  # BLAKE2b digests are at most 64 bytes: s + 2 words of 8 bytes
_TWO64 = 1 << 64


@dataclass(frozen=True)
class L1Spec:
    """The shape of an l1 sketch: level-0 blocks and buckets, sampled levels and their buckets."""

    s: int = 2
    level0_buckets: int = 32
    levels: int = 4
    buckets: int = 32
    branching: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.s <= MAX_BLOCKS:
            raise ValueError(f"s (level-0 blocks) must be 1 .. {MAX_BLOCKS}, got {self.s}")
        if self.level0_buckets < 1 or self.buckets < 1:
            raise ValueError("level0_buckets and buckets must be at least 1")
        if not 0 <= self.levels <= 40:
            raise ValueError(f"levels must be 0 .. 40, got {self.levels}")
        if int(self.branching) != self.branching or self.branching < 2:
            raise ValueError(f"branching must be an integer >= 2, got {self.branching}")
        if self.branching ** (self.levels + 1) >= _TWO64:
            raise ValueError("branching ** (levels + 1) must stay below 2^64")

    @property
    def k(self) -> int:
        """Rows of the sketch."""
        return self.s * self.level0_buckets + self.levels * self.buckets

    @property
    def slots(self) -> int:
        """Entries per column (s at level 0, one sampled-level slot that may be empty)."""
        return self.s + 1

    def thresholds(self) -> list[int]:
        """T_j = ceil(2^64 / b^j) for j = 1 .. levels + 1 (integers, exact)."""
        b = int(self.branching)
        return [-(-_TWO64 // b ** j) for j in range(1, self.levels + 2)]

    def level_probabilities(self) -> np.ndarray:
        """p_h for h = 1 .. levels: the exact probability that a report lands in level h."""
        t = self.thresholds()
        return np.array([(t[h - 1] - t[h]) / _TWO64 for h in range(1, self.levels + 1)])

    def level_of_row(self) -> np.ndarray:
        """(k,) the level of every row: 0 for level-0 rows, h for level h."""
        return np.concatenate([np.zeros(self.s * self.level0_buckets, dtype=np.int64),
                               np.repeat(np.arange(1, self.levels + 1, dtype=np.int64), self.buckets)])

    def weights(self) -> np.ndarray:
        """(k,) the weight of every row: 1/s at level 0, 1/p_h at level h (Algorithm 2)."""
        p = self.level_probabilities()
        return np.concatenate([np.full(self.s * self.level0_buckets, 1.0 / self.s),
                               np.repeat(1.0 / p, self.buckets)])


def _multiply_shift(u: np.ndarray, m: int) -> np.ndarray:
    """floor(u * m / 2^64) for uint64 u without 128-bit integers (32-bit halves)."""
    hi = u >> np.uint64(32)
    lo = u & np.uint64(0xFFFFFFFF)
    mm = np.uint64(m)
    return ((hi * mm + ((lo * mm) >> np.uint64(32))) >> np.uint64(32)).astype(np.int64)


def _words(seed: bytes, report_ids: Sequence[bytes], n_words: int) -> np.ndarray:
    if len(seed) != SEED_BYTES:
        raise ValueError("sketch seed must be 32 bytes")
    width = 8 * n_words
    keyed = hashlib.blake2b(DOMAIN, digest_size=width, key=seed)
    buf = bytearray(len(report_ids) * width)
    for i, rid in enumerate(report_ids):
        h = keyed.copy()
        h.update(rid)
        buf[i * width:(i + 1) * width] = h.digest()
    return np.frombuffer(bytes(buf), dtype="<u8").reshape(len(report_ids), n_words)


def hash_report_ids(seed: bytes, report_ids: Sequence[bytes], spec: L1Spec) -> tuple[np.ndarray, np.ndarray]:
    """Rows (m, s + 1) int64 and signs (m, s + 1) int8 in {0, 1} of S for each report; the last
    slot is the sampled level's row, sign 0 (and row 0) when the report fell in no level."""
    m = len(report_ids)
    u = _words(seed, report_ids, spec.s + 2)
    rows = np.zeros((m, spec.slots), dtype=np.int64)
    signs = np.ones((m, spec.slots), dtype=np.int8)
    for block in range(spec.s):
        rows[:, block] = block * spec.level0_buckets + _multiply_shift(u[:, block], spec.level0_buckets)
    level = np.zeros(m, dtype=np.int64)
    for t in spec.thresholds():
        level += u[:, spec.s] < np.uint64(t)
    sampled = (level >= 1) & (level <= spec.levels)
    bucket = _multiply_shift(u[:, spec.s + 1], spec.buckets)
    rows[:, spec.s] = np.where(sampled, spec.s * spec.level0_buckets + (level - 1) * spec.buckets + bucket, 0)
    signs[:, spec.s] = sampled.astype(np.int8)
    return rows, signs


def rows_of(seed: bytes, report_id: bytes, spec: L1Spec) -> list[int]:
    """The rows of one report's column: the reference form, in plain Python integers."""
    digest = hashlib.blake2b(DOMAIN + report_id, digest_size=8 * (spec.s + 2), key=seed).digest()
    u = [int.from_bytes(digest[8 * j:8 * j + 8], "little") for j in range(spec.s + 2)]
    out = [block * spec.level0_buckets + (u[block] * spec.level0_buckets >> 64) for block in range(spec.s)]
    level = sum(u[spec.s] < t for t in spec.thresholds())
    if 1 <= level <= spec.levels:
        out.append(spec.s * spec.level0_buckets + (level - 1) * spec.buckets + (u[spec.s + 1] * spec.buckets >> 64))
    return out


def apply(rows: np.ndarray, signs: np.ndarray, X: np.ndarray, k: int) -> np.ndarray:
    """S X as a (k, d) float matrix (the analyzer's and the evaluation's view; the servers do the
    same sum on ring shares)."""
    X = np.asarray(X, dtype=np.float64)
    out = np.zeros((k, X.shape[1]))
    for slot in range(rows.shape[1]):
        keep = signs[:, slot] != 0
        np.add.at(out, rows[keep, slot], X[keep])
    return out


def gram(rows: np.ndarray, signs: np.ndarray, k: int) -> np.ndarray:
    """M = S S^T (k x k, integer counts: M_bc = reports in both rows b and c)."""
    M = np.zeros((k, k), dtype=np.int64)
    for a in range(rows.shape[1]):
        for c in range(rows.shape[1]):
            keep = (signs[:, a] != 0) & (signs[:, c] != 0)
            np.add.at(M.reshape(-1), rows[keep, a] * k + rows[keep, c], 1)
    return M


def leverages(rows: np.ndarray, signs: np.ndarray, k: int, t: int = 0, M: np.ndarray | None = None) -> np.ndarray:
    """(m,) leverage_i = S_i^T (S S^T)^+ S_i of every report of the set (t = 0), or for t > 0 the
    bound S_i^T (M - t kappa P)^+ S_i on the leverage over any honest subset missing t reports
    (infinity everywhere if an eigenvalue of M is not above t kappa). See the module docstring."""
    if M is None:
        M = gram(rows, signs, k)
    used = np.flatnonzero(np.diag(M) > 0)
    if len(used) == 0:
        return np.zeros(len(rows))
    evals, evecs = np.linalg.eigh(M[np.ix_(used, used)].astype(np.float64))
    tol = max(evals.max(), 1.0) * len(used) * np.finfo(np.float64).eps * 16
    positive = evals > tol
    kappa = int(signs.astype(np.int64).sum(axis=1).max()) if len(rows) else 0
    shifted = evals[positive] - t * kappa
    if t > 0 and (len(shifted) == 0 or shifted.min() <= 0):
        return np.full(len(rows), math.inf)
    V = evecs[:, positive]
    W_used = (V / shifted) @ V.T
    index = np.full(k, -1, dtype=np.int64)
    index[used] = np.arange(len(used))
    local = index[rows]
    out = np.zeros(len(rows))
    for a in range(rows.shape[1]):
        for c in range(rows.shape[1]):
            keep = (signs[:, a] != 0) & (signs[:, c] != 0)
            out[keep] += W_used[local[keep, a], local[keep, c]]
    return out


@dataclass(frozen=True)
class L1Certificate:
    """The outcome of :func:`certify`: the largest leverage over the set and what it must stay under."""

    max_leverage: float
    lambda_star: float
    n_reports: int
    t: int

    @property
    def ok(self) -> bool:
        return self.max_leverage * self.lambda_star <= 1.0


def certify(rows: np.ndarray, signs: np.ndarray, k: int, lambda_star: float, t: int = 0) -> L1Certificate:
    """Whether this inclusion set gives every report the study's calibration: max leverage <=
    1/lambda_star (the condition a server checks before it releases its share)."""
    lev = leverages(rows, signs, k, t)
    return L1Certificate(float(lev.max()) if len(lev) else math.inf, float(lambda_star), len(rows), t)


def typical_leverage(n: int, spec: L1Spec) -> float:
    """A design guide, not a guarantee: the leverage of a report whose buckets hold their expected
    counts, sum over its slots of 1/count, at the deepest level: s * level0_buckets / n +
    buckets / (n p_levels). The certificate always uses the exact value."""
    deepest = spec.level_probabilities()[-1] if spec.levels else None
    level0 = spec.s * spec.level0_buckets / n
    return level0 + (spec.buckets / (n * deepest) if deepest else 0.0)


#: The design keeps every sampled-level bucket at this many expected reports at least: the
#: largest leverage comes from the emptiest bucket, and a sparse deep level lowers lambda_star for
#: every client (measured in docs/lad.md: 3 levels of 32 buckets cost 5x the noise variance of 2
#: levels of 8 at n = 10^5).
MIN_DEEP_BUCKET = 256
#: lambda_star is this fraction of 1 / typical_leverage: room for the buckets' fluctuation (with
#: 256+ reports a bucket, the largest leverage of an honest set stays within 1.1x the typical one).
LEVERAGE_SAFETY = 0.8
#: The measured shape (docs/lad.md): two sampled levels whose buckets are a quarter as many as a
#: level-0 block's, so level 1's buckets are as full as level 0's and level 2's half as full.
DEFAULT_LEVELS = 2


def design(min_reports: int, d: int, s: int = 2, branching: int = 2,
           level0_buckets: int | None = None) -> tuple[L1Spec, float]:
    """A sketch shape and lambda_star for a study expecting at least ``min_reports`` reports of d
    columns: level-0 blocks of max(32, 4 d) buckets (rows enough for an l1 embedding of d
    dimensions), DEFAULT_LEVELS sampled levels of a quarter as many buckets (fewer levels if a
    bucket would expect fewer than MIN_DEEP_BUCKET reports), and lambda_star = LEVERAGE_SAFETY /
    typical_leverage. Privacy never rests on this guess: servers check the exact leverage of the
    set they are asked to release (:func:`certify`); the design only makes that check pass for
    honest sets, which tests/test_l1sketch.py measures."""
    if min_reports < 1 or d < 1:
        raise ValueError("need min_reports >= 1 and d >= 1")
    per = level0_buckets or max(32, 4 * d)
    if min_reports / per < MIN_DEEP_BUCKET:
        raise ValueError(f"min_reports = {min_reports} is too small for an l1 sketch of d = {d}: "
                         f"its {per} level-0 buckets would hold fewer than {MIN_DEEP_BUCKET} reports "
                         f"each (at least {per * MIN_DEEP_BUCKET} reports)")
    deep = max(1, per // 4)
    levels = 0
    while levels < DEFAULT_LEVELS:
        trial = L1Spec(s=s, level0_buckets=per, levels=levels + 1, buckets=deep, branching=branching)
        if min_reports * trial.level_probabilities()[-1] / deep < MIN_DEEP_BUCKET:
            break
        levels += 1
    spec = L1Spec(s=s, level0_buckets=per, levels=levels, buckets=deep, branching=branching)
    return spec, LEVERAGE_SAFETY / typical_leverage(min_reports, spec)
