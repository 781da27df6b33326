"""A study: the immutable public parameters every client, server and analyzer agrees on.

The study id is the content hash of the canonical encoding of :class:`Study`. All invariants
that keep the privacy promise and the ring arithmetic sound are checked here, in the model,
so a server provisioning a study and a client fetching one run the same checks.
"""

from __future__ import annotations

import functools
import math
import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from . import features, privacy, ring, sketch
from .canonical import canonical_json, content_hash

PROTOCOL = "dpsketch/1"

#: Noise is drawn from N(0, sigma^2) and refused beyond this many sigmas (probability 5.5e-89
#: per coordinate; the SDK then redraws). Part of the overflow bound; its effect on the privacy
#: guarantee is ``privacy.tail_delta``, checked below.
NOISE_TAIL_SIGMAS = 20.0

NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$"
SERVER_ID_PATTERN = r"^[a-z0-9][a-z0-9.\-]{0,62}$"


class Study(BaseModel):
    """Public parameters of one study. Every field is covered by the study id."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    protocol: Literal["dpsketch/1"] = PROTOCOL
    name: str = Field(min_length=1, max_length=200)
    # schema
    columns: list[str] = Field(min_length=1, max_length=4096)
    label: str | None = None
    row_bound: float = Field(gt=0, le=1e6)
    # transform: "sketch" shares the row and applies OSNAP; "gram" shares [a, u(a a^T), 1] and
    # sums (k = s = 1), see features.py
    kind: features.Kind = "sketch"
    k: int = Field(ge=1, le=1 << 20)
    s: int = Field(ge=1, le=sketch.MAX_BLOCKS)
    seed: str = Field(pattern=r"^[0-9a-f]{64}$")
    # privacy target
    epsilon: float = Field(gt=0, le=100)
    delta: float = Field(gt=0, lt=1)
    neighbouring: privacy.Neighbouring = "replace-one"
    lambda_star: float = Field(ge=1)
    sigma: float = Field(gt=0)
    # trust
    servers: list[str] = Field(min_length=2, max_length=16)
    t: int = Field(ge=0)
    min_reports: int = Field(ge=1)
    max_reports: int = Field(ge=1, le=1 << 40)
    # ring
    frac_bits: int = Field(ge=0, le=62)

    @field_validator("columns")
    @classmethod
    def _columns(cls, columns: list[str]) -> list[str]:
        import re

        for c in columns:
            if not re.match(NAME_PATTERN, c):
                raise ValueError(f"column name {c!r} must match {NAME_PATTERN}")
        if len(set(columns)) != len(columns):
            raise ValueError("column names must be unique")
        return columns

    @field_validator("servers")
    @classmethod
    def _servers(cls, servers: list[str]) -> list[str]:
        import re

        for sid in servers:
            if not re.match(SERVER_ID_PATTERN, sid):
                raise ValueError(f"server id {sid!r} must match {SERVER_ID_PATTERN}")
        if len(set(servers)) != len(servers):
            raise ValueError("server ids must be distinct: each share goes to a different server")
        return servers

    @model_validator(mode="after")
    def _consistent(self) -> "Study":
        if self.label is not None and self.label not in self.columns:
            raise ValueError(f"label {self.label!r} is not one of the columns")
        if self.k % self.s:
            raise ValueError("s must divide k (k rows in s blocks of k/s buckets)")
        if self.kind == "gram":
            if (self.k, self.s) != (1, 1):
                raise ValueError("a gram study is the plain sum: k = 1 and s = 1")
            if self.d > features.GRAM_MAX_COLUMNS:
                raise ValueError(
                    f"a gram study shares d(d+1)/2 values per client; use a sketch study beyond "
                    f"{features.GRAM_MAX_COLUMNS} columns"
                )
        if self.min_reports > self.max_reports:
            raise ValueError("min_reports exceeds max_reports")
        if self.min_reports <= self.t:
            raise ValueError("min_reports must exceed t")
        needed = privacy.client_sigma(
            self.epsilon, self.delta, self.row_bound, self.neighbouring, self.lambda_star, self.kind
        )
        if self.sigma < needed * (1 - privacy.SIGMA_RTOL):
            raise ValueError(
                f"sigma={self.sigma} is below the calibrated {needed} for this epsilon, delta, "
                f"row bound, kind and lambda_star"
            )
        tail = privacy.tail_delta(self.epsilon, self.max_reports * self.width, NOISE_TAIL_SIGMAS)
        if tail > 1e-6 * self.delta:
            raise ValueError(
                f"redrawing noise beyond {NOISE_TAIL_SIGMAS:g} sigma could cost up to {tail:.3g} "
                f"of delta = {self.delta:g}; lower epsilon or max_reports"
            )
        f_max = ring.max_frac_bits(self.max_reports, self.value_bound)
        if self.frac_bits > f_max:
            raise ValueError(
                f"frac_bits={self.frac_bits} can overflow: max_reports * (bound + 20 sigma) * 2^f "
                f"must stay below 2^63, so f <= {f_max}"
            )
        return self

    # derived values -----------------------------------------------------------------------
    @property
    def d(self) -> int:
        return len(self.columns)

    @property
    def n_servers(self) -> int:
        return len(self.servers)

    @property
    def seed_bytes(self) -> bytes:
        return bytes.fromhex(self.seed)

    @property
    def width(self) -> int:
        """Values per share: d for a sketch study, d + d(d+1)/2 + 1 for a gram study."""
        return features.width(self.kind, self.d)

    @property
    def value_bound(self) -> float:
        """Largest |coordinate| a client may encode: the feature bound plus the noise tail cut."""
        return value_bound(self.kind, self.row_bound, self.sigma)

    @property
    def share_bytes(self) -> int:
        return 8 * self.width

    @property
    def max_storage_bytes(self) -> int:
        """The share bytes a server agrees to store for this study: max_reports records of a
        16-byte report id and a share (it refuses uploads beyond max_reports). A server's
        max_study_bytes policy compares against this; SQLite adds its own overhead on top."""
        return self.max_reports * (sketch.REPORT_ID_BYTES + self.share_bytes)

    @property
    def aggregate_shape(self) -> tuple[int, int]:
        return (self.k, self.width)

    def canonical(self) -> bytes:
        return canonical_json(self.model_dump(mode="json"))

    @property
    def study_id(self) -> str:
        return content_hash(self.model_dump(mode="json"))


def value_bound(kind: features.Kind, row_bound: float, sigma: float) -> float:
    """The overflow bound of one encoded coordinate: feature bound + 20 sigma."""
    return features.coordinate_bound(kind, row_bound) + NOISE_TAIL_SIGMAS * sigma


def default_k(expected_reports: int, d: int, sigma_local: float, row_bound: float, s: int = 4) -> int:
    """Sketch rows that balance sketch distortion against noise (measured, docs/accuracy.md).

    The released Gram Y^T Y carries noise x data, whose size does not depend on k, and noise x
    noise, whose entries are about sigma^2 n / sqrt(k) ~ sigma_local^2 sqrt(k) / LAMBDA_SAFETY:
    it grows with k. The sketch's own distortion falls like d / k. Balancing the two gives k
    proportional to n B^2 / sigma_local^2; the constant 1/70 is the measured optimum of the
    synthetic benchmark (k ~ 200 at n = 10^6 and ~ 20 at n = 10^5 for epsilon = 1,
    delta = 1e-6, replace-one), clamped to [2 d, 40 d] (2 d keeps a usable subspace embedding,
    40 d puts the distortion sqrt(d/k) near 0.16) and to n/100 (every bucket well filled).
    """
    k = expected_reports * row_bound**2 / (70.0 * sigma_local**2)
    k = min(max(k, 2 * d), 40 * d, max(s, expected_reports // 100))
    return max(s, (int(k) // s) * s)


def _arithmetic_is_invalid_input(fn):
    """Extreme but schema-valid inputs (a row bound of 5e-324, say) underflow or overflow inside
    the design formulas; that is an invalid study (ValueError, a 422 over HTTP), not a crash, for
    every caller: the analyzer, ``dpsketch recommend`` and anyone calling :func:`design`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ArithmeticError as exc:
            raise ValueError(f"these parameters cannot be designed into a study: "
                             f"{type(exc).__name__}: {exc}") from None

    return wrapper


@_arithmetic_is_invalid_input
def design(
    *,
    name: str,
    columns: list[str],
    label: str | None,
    servers: list[str],
    expected_reports: int,
    epsilon: float = 1.0,
    delta: float = 1e-6,
    row_bound: float = 1.0,
    neighbouring: privacy.Neighbouring = "replace-one",
    t: int = 0,
    k: int | None = None,
    s: int = 4,
    min_reports: int | None = None,
    max_reports: int | None = None,
    seed: str | None = None,
    kind: features.Kind = "sketch",
) -> tuple[Study, list[str]]:
    """Choose k, s, lambda_star, sigma and f for a study; return it with a human explanation.

    ``kind="gram"`` makes the plain-sum study of the Gram matrix (k = s = 1, see features.py);
    ``dpsketch.recommend`` says which kind suits given d and n.
    """
    d = len(columns)
    if expected_reports < 2:
        raise ValueError("expected_reports must be at least 2")
    if kind not in features.KINDS:
        raise ValueError(f"kind must be one of {features.KINDS}, got {kind!r}")
    sigma_local = privacy.local_sigma(epsilon, delta, row_bound, neighbouring)
    if kind == "gram":
        if k not in (None, 1):
            raise ValueError("a gram study is the plain sum: k must be 1")
        if d > features.GRAM_MAX_COLUMNS:
            raise ValueError(f"a gram study of {d} columns would share {features.width('gram', d)} "
                             f"values per client; use a sketch study beyond "
                             f"{features.GRAM_MAX_COLUMNS} columns")
        k = 1
    elif k is None:
        k = default_k(expected_reports, d, sigma_local, row_bound, s)
    if k == 1:
        s = 1
    min_reports_note = "as requested"
    if min_reports is None:
        min_reports = max(t + 1, math.floor(0.9 * expected_reports))
        min_reports_note = "by default 90% of the expected count, so a few lost reports do not block it"

    if max_reports is None:
        max_reports = max(10 * expected_reports, 1000)
    lambda_star = privacy.choose_lambda_star(min_reports, k, t)
    sigma = privacy.client_sigma(epsilon, delta, row_bound, neighbouring, lambda_star, kind)
    bound = value_bound(kind, row_bound, sigma)
    frac_bits = ring.max_frac_bits(max_reports, bound)
    study = Study(
        name=name,
        columns=columns,
        label=label,
        row_bound=row_bound,
        kind=kind,
        k=k,
        s=s,
        seed=seed or secrets.token_hex(32),
        epsilon=epsilon,
        delta=delta,
        neighbouring=neighbouring,
        lambda_star=lambda_star,
        sigma=sigma,
        servers=servers,
        t=t,
        min_reports=min_reports,
        max_reports=max_reports,
        frac_bits=frac_bits,
    )
    if kind == "gram":
        transform = (
            f"Gram: each client shares [a, u(a a^T), 1], {study.width} values, and the servers "
            f"sum them (k = s = 1): the release is the noisy A^T A, row sum and count, "
            f"the central model's sufficient statistics."
        )
    else:
        transform = (
            f"Sketch: k = {k} rows in s = {s} blocks (k ~ n B^2 / (70 sigma_local^2) within "
            f"[2d, 40d] balances noise, which grows with k, against sketch distortion, which "
            f"falls like d/k; here sqrt(d/k) = {math.sqrt(d / k):.2f})."
        )
    own_local = privacy.local_sigma(epsilon, delta, row_bound, neighbouring, kind)
    explanation = [
        f"d = {d} columns, {len(servers)} servers, expecting {expected_reports} reports.",
        transform,
        f"Release needs at least min_reports = {min_reports} reports ({min_reports_note}).",
        (
            f"lambda_star = {lambda_star:.1f}: with k = 1, S S^T is the report count exactly, so "
            f"lambda_star = min_reports - t (t = {t})."
            if k == 1
            else f"lambda_star = {lambda_star:.1f}: {privacy.LAMBDA_SAFETY} x the expected "
            f"lambda_min(S S^T) ~ (n/k)(1 - sqrt(k/n))^2 at n = min_reports, minus t = {t}."
        ),
        f"Client noise sigma = {sigma:.4g} per coordinate (alone, a client would need "
        f"{own_local:.4g}: {own_local / sigma:.1f}x more) for ({epsilon}, {delta})-DP, "
        f"{neighbouring}, row bound B = {row_bound}, sensitivity "
        f"{privacy.sensitivity(row_bound, neighbouring, kind):.4g}.",
        f"Ring: f = {frac_bits} fractional bits; {max_reports} reports of |x| <= "
        f"{bound:.4g} cannot overflow 2^63.",
    ]
    if kind == "sketch" and k <= d:
        explanation.append(
            f"Warning: k = {k} <= d = {d}: with {expected_reports} reports the sketch has no more "
            f"rows than columns (k is capped at n/100 so every bucket is well filled), so it "
            f"cannot keep d-dimensional structure; expect errors near the local model's. A gram "
            f"study or more reports would do better (dpsketch recommend)."
        )
    return study, explanation
