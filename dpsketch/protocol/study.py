"""A study: the immutable public parameters every client, server and analyzer agrees on.

The study id is the content hash of the canonical encoding of :class:`Study`. All invariants
that keep the privacy promise and the ring arithmetic sound are checked here, in the model,
so a server provisioning a study and a client fetching one run the same checks.
"""

from __future__ import annotations

import functools
import math
import re
import secrets
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from . import accounting, bounds as _bounds, features, l1sketch, noise as _noise, parties as _parties, privacy, ring, sketch, smoothing
from . import validity as _validity
from .histogram import HistogramSpec
from .noise import NOISE_TAIL_SIGMAS
from .canonical import canonical_json, content_hash

if TYPE_CHECKING:
    import numpy as np

PROTOCOL = "dpsketch/2"


NAME_PATTERN = _parties.NAME_PATTERN
#: matched with ``fullmatch`` (see parties.NAME_PATTERN): "s1\n" is not a server id
SERVER_ID_PATTERN = r"^[a-z0-9][a-z0-9.\-]{0,62}$"
#: A population id (docs/ledger.md): short printable ASCII that needs no escaping in a URL path.
POPULATION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,63}$"
_NAME, _SERVER_ID = re.compile(NAME_PATTERN), re.compile(SERVER_ID_PATTERN)


#: id(study) -> (weak reference to that study, what _once computed of it); an entry leaves with
#: its study
_DERIVED: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    hit = _DERIVED.get(key)
    if hit is not None and hit[0] is ref:
        del _DERIVED[key]


def _once(compute: Callable[[Any], Any]) -> Any:
    """A property of a Study computed once per object: its id and the noise calibration every
    client, server and check derives from the fields again and again (a one-row device used each
    a dozen times). A Study is frozen, and every copy with other fields (``model_copy(update=...)``,
    validation of changed JSON) is another object, so the memo is keyed by the object itself and
    never copied with it: not a private attribute, which pydantic copies and compares."""
    name = compute.__name__

    @functools.wraps(compute)
    def get(study: Any) -> Any:
        key = id(study)
        hit = _DERIVED.get(key)
        if hit is None or hit[0]() is not study:
            hit = _DERIVED[key] = (weakref.ref(study, functools.partial(_forget, key)), {})
        values = hit[1]
        if name not in values:
            values[name] = compute(study)
        return values[name]

    return property(get)


class L1Params(BaseModel):
    """The shape of an l1 study's sketch beyond k and s (``l1sketch.L1Spec``; s is the study's)."""

    model_config = ConfigDict(extra="forbid")
    level0_buckets: int = Field(ge=1, le=1 << 16)
    levels: int = Field(ge=0, le=40)
    buckets: int = Field(ge=1, le=1 << 16)
    branching: int = Field(ge=2, le=1 << 16)


class Study(BaseModel):
    """Public parameters of one study. Every field is covered by the study id."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    protocol: Literal["dpsketch/2"] = PROTOCOL
    name: str = Field(min_length=1, max_length=200)
    #: the population the study draws from (a stable id chosen by whoever enrols the clients):
    #: every server charges the study to that population's privacy ledger (docs/ledger.md);
    #: absent: charged to nothing
    population: str | None = Field(default=None, pattern=POPULATION_PATTERN)
    # schema
    columns: list[str] = Field(min_length=1, max_length=4096)
    label: str | None = None
    row_bound: float = Field(gt=0, le=1e6)
    #: public [lower, upper] of every column, in column order: clients clamp each value to them
    #: and map the row into the ball (bounds.py, docs/protocol.md section 2e), and the analyzer
    #: answers in the data's units. Absent: rows are taken as already scaled into the ball.
    bounds: list[list[float]] | None = None
    # transform: "sketch" shares the row and applies OSNAP; "gram" shares [a, u(a a^T), 1] and
    # sums (k = s = 1), see features.py; "moments" shares u(a a^T) alone and sums (k = s = 1);
    # "histogram" shares the one-hot vector of the row's cell and sums (k = s = 1), see histogram.py
    kind: features.Kind = "sketch"
    #: the bins of a histogram study (its axes are the study's columns); null for other kinds
    histogram: HistogramSpec | None = None
    #: the sketch shape of an l1 study (l1sketch.py); absent for other kinds
    l1: L1Params | None = None
    #: parties holding different columns of the same individuals (parties.py); absent otherwise
    parties: list[_parties.Party] | None = None
    k: int = Field(ge=1, le=1 << 20)
    s: int = Field(ge=1, le=sketch.MAX_BLOCKS)
    seed: str = Field(pattern=r"^[0-9a-f]{64}$")
    # privacy target
    epsilon: float = Field(gt=0, le=100)
    delta: float = Field(gt=0, lt=1)
    neighbouring: privacy.Neighbouring = "replace-one"
    lambda_star: float = Field(ge=1)
    #: each client's noise per coordinate (0: the servers' noise carries the whole guarantee)
    sigma: float = Field(ge=0)
    #: each server's noise per released cell, added to its aggregate share before release (its
    #: part of the floor, docs/trust.md); in release units (after the 1/sqrt(s) scale)
    server_sigma: float = Field(default=0.0, ge=0)
    #: the floor: every report is (epsilon_floor, delta)-DP even if no other report is honest
    #: (Sybils) and every other server colludes; None: no floor promised
    epsilon_floor: float | None = Field(default=None, gt=0, le=100)
    # trust
    servers: list[str] = Field(min_length=2, max_length=16)
    t: int = Field(ge=0)
    min_reports: int = Field(ge=1)
    max_reports: int = Field(ge=1, le=1 << 40)
    # ring
    frac_bits: int = Field(ge=0, le=62)
    #: each client multiplies its clipped row by a secret sign t = +-1 from its CSPRNG before its
    #: noise (a sketch study with k > 1 and no parties only; docs/secret_sign.md); the study's
    #: epsilon is then accounted for the symmetric mixture (secret_sign.py). Omitted when false.
    secret_sign: bool = False
    #: every report carries a proof that it is valid, checked by every server (validity.py,
    #: docs/validity.md); absent: no proofs (a report's influence is unbounded)
    validity: Literal["norm-bound/1"] | None = None
    #: besides per-report proofs, the servers take *batch proofs* (docs/protocol.md section 4d,
    #: docs/validity.md section 15): a bulk owner proves m rows at once. A sketch or l1 study with
    #: validity and without parties only; its tail delta counts the batches' redraws too
    #: (:attr:`tail_delta`). Omitted when false, so every study from before keeps its id.
    batch_proofs: bool = False

    @field_validator("columns")
    @classmethod
    def _columns(cls, columns: list[str]) -> list[str]:
        for c in columns:
            if not _NAME.fullmatch(c):
                raise ValueError(f"column name {c!r} must match {NAME_PATTERN}")
        if len(set(columns)) != len(columns):
            raise ValueError("column names must be unique")
        return columns

    @field_validator("servers")
    @classmethod
    def _servers(cls, servers: list[str]) -> list[str]:
        for sid in servers:
            if not _SERVER_ID.fullmatch(sid):
                raise ValueError(f"server id {sid!r} must match {SERVER_ID_PATTERN}")
        if len(set(servers)) != len(servers):
            raise ValueError("server ids must be distinct: each share goes to a different server")
        return servers

    @model_validator(mode="after")
    def _consistent(self) -> "Study":
        if self.label is not None and self.label not in self.columns:
            raise ValueError(f"label {self.label!r} is not one of the columns")
        if self.kind == "l1":
            if self.l1 is None:
                raise ValueError("an l1 study needs its sketch shape (l1)")
            spec = self.l1_spec  # validates s and the levels
            if spec.k != self.k:
                raise ValueError(f"an l1 study's k is s * level0_buckets + levels * buckets = {spec.k}, "
                                 f"not {self.k}")
        elif self.l1 is not None:
            raise ValueError(f"only an l1 study has an l1 sketch shape, not a {self.kind} study")
        elif self.k % self.s:
            raise ValueError("s must divide k (k rows in s blocks of k/s buckets)")
        if self.kind in features.GRAM_KINDS:
            if (self.k, self.s) != (1, 1):
                raise ValueError(f"a {self.kind} study is the plain sum: k = 1 and s = 1")
            if self.d > features.GRAM_MAX_COLUMNS:
                raise ValueError(
                    f"a {self.kind} study shares d(d+1)/2 values per client; use a sketch study beyond "
                    f"{features.GRAM_MAX_COLUMNS} columns"
                )
        if self.kind == "histogram":
            if self.histogram is None:
                raise ValueError("a histogram study needs its bins (histogram)")
            if self.histogram.columns != list(self.columns):
                raise ValueError(f"a histogram study's columns are its axes: {self.histogram.columns}")
            if (self.k, self.s) != (1, 1):
                raise ValueError("a histogram study is the plain sum: k = 1 and s = 1")
            if self.row_bound != self.histogram.row_norm or self.label is not None:
                raise ValueError(f"a histogram study has no label and row_bound = the norm of its shared "
                                 f"vector: 1 (one-hot), sqrt(m) for a marginal histogram of m axes "
                                 f"(here {self.histogram.row_norm!r})")
        elif self.histogram is not None:
            raise ValueError(f"only a histogram study has bins, not a {self.kind} study")
        if self.parties is not None:
            if self.kind != "sketch":
                raise ValueError(
                    f"only a sketch study can have parties: a {self.kind} study's clients share "
                    f"products of their own columns, and products of columns held by different "
                    f"parties need interaction (docs/vertical.md)")
            _parties.check(self.parties, self.columns, self.row_bound)
        if self.bounds is not None:
            _bounds.check_bounds(self.bounds, self.columns)
            if self.kind == "histogram":
                raise ValueError("a histogram study's bins are its bounds: it has no bounds member")
            if self.parties is not None:
                raise ValueError("bounds are not yet available in a study with parties (each party "
                                 "would map its own block): scale each party's columns into its ball")
        if self.secret_sign:
            check_secret_sign(self.kind, self.k, self.parties is not None)
        if self.min_reports > self.max_reports:
            raise ValueError("min_reports exceeds max_reports")
        if self.min_reports <= self.t:
            raise ValueError("min_reports must exceed t")
        tail = self.tail_delta
        if tail > 1e-6 * self.delta:
            raise ValueError(
                f"redrawing noise beyond {NOISE_TAIL_SIGMAS:g} sigma could cost up to {tail:.3g} "
                f"of delta = {self.delta:g}; lower epsilon or max_reports"
            )
        argument = self.discrete_argument
        if argument.covered and argument.delta_slack(self.delta, self.epsilon) > 1e-6 * self.delta:
            raise ValueError(f"the discrete noise argument leaves too little of delta: {argument.describe()}")
        achieved = self.report_epsilon(self.lambda_star)
        if not achieved <= self.epsilon * (1 + privacy.SIGMA_RTOL):
            raise ValueError(
                f"sigma = {self.sigma} and server_sigma = {self.server_sigma} give epsilon = "
                f"{achieved:.6g} at lambda_star = {self.lambda_star:g} ({self.neighbouring}, "
                f"{self.kind}), more than the study's epsilon = {self.epsilon}")
        if self.epsilon_floor is not None:
            if self.epsilon_floor < self.epsilon:
                raise ValueError("epsilon_floor must be at least epsilon: the floor holds with no "
                                 "other honest report, so it cannot be the stronger guarantee")
            floor = self.report_epsilon(1.0)
            if not floor <= self.epsilon_floor * (1 + privacy.SIGMA_RTOL):
                raise ValueError(
                    f"server_sigma = {self.server_sigma} gives a floor of epsilon = {floor:.6g}, "
                    f"more than the study's epsilon_floor = {self.epsilon_floor}")
        if self.batch_proofs:
            check_batch_proofs(self)
        if self.validity is not None:
            _validity.check_study(self)
            f_max = _validity.max_frac_bits(self.max_reports, max(self.value_bound, _validity.bound_value(self)),
                                            self.server_noise_bound)
        else:
            f_max = ring.max_frac_bits(self.max_reports, self.value_bound, self.server_noise_bound)
        if self.frac_bits > f_max:
            raise ValueError(
                f"frac_bits={self.frac_bits} can overflow: max_reports * (bound + 20 sigma) + "
                f"servers * 20 server_sigma sqrt(s), times 2^f, must stay below 2^63, so f <= {f_max}"
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
    def has_constant(self) -> bool:
        """Whether each mapped row ends in the constant coordinate (a study with bounds of the
        sketch, moments or l1 kind: it gives the release the column sums and the count that the
        intercept and the centre need; bounds.py)."""
        return self.bounds is not None and self.kind in _bounds.CONSTANT_KINDS

    @property
    def row_width(self) -> int:
        """Length of a client's mapped row before its features: d, plus the constant coordinate."""
        return self.d + (1 if self.has_constant else 0)

    @property
    def row_columns(self) -> list[str]:
        """Names of the mapped row's coordinates: the columns, then ``"1"`` for the constant."""
        return [*self.columns, _bounds.CONSTANT] if self.has_constant else list(self.columns)

    @property
    def width(self) -> int:
        """Values per share: the mapped row's width (d, or d + 1 with the constant) for a sketch or
        l1 study, d + d(d+1)/2 + 1 for a gram study, w(w+1)/2 of the mapped row for a moments
        study, the number of cells for a histogram study."""
        if self.histogram is not None:
            return self.histogram.cells
        return features.width(self.kind, self.row_width)

    @property
    def column_map(self) -> "_bounds.ColumnMap":
        """The public map between raw values and mapped rows (identity without bounds)."""
        if self.bounds is None:
            return _bounds.ColumnMap.identity(self.d)
        return _bounds.ColumnMap.of(self.bounds, self.has_constant, self.clip_bound)

    @property
    def value_bound(self) -> float:
        """Largest |coordinate| a client may encode: the feature bound plus the noise tail cut."""
        return value_bound(self.kind, self.row_bound, self.sigma)

    @_once
    def mechanism(self) -> accounting.Mechanism:
        """The continuous Gaussian mechanism the release is a post-processing of (client and server
        noise, release units): with the discrete noise the clients and servers really draw
        (docs/protocol.md section 5a, ``smoothing.py``), the client noise is its grid parameter
        sigma_c >= sigma and the server noise keeps tau_c^2 - r^2 of its variance; without server
        noise in a replace-one study the clients' common noise gives up the r^2 instead. A study
        the argument does not cover is accounted as the continuous mechanism it approximates."""
        argument = self.discrete_argument
        if not argument.covered:
            return accounting.Mechanism(self.neighbouring, self.kind, self.row_bound, self.sigma,
                                        self.server_sigma, self.width, self.secret_sign)
        sigma = argument.client_std
        server_sigma = 0.0
        if argument.server_std > 0:
            server_sigma = math.sqrt(argument.server_variance_kept) * self.server_sigma / self.server_noise_std
        elif self.neighbouring == "replace-one" and sigma > 0:
            sigma = math.sqrt(sigma ** 2 - argument.rounding_radius ** 2)
        return accounting.Mechanism(self.neighbouring, self.kind, self.row_bound, sigma, server_sigma,
                                    self.width, self.secret_sign)

    @_once
    def noise_grid(self) -> _noise.Grid:
        """The lattice every noise term and every client value of this study lies on: the ring's
        2^-f grid, or a coarser 2^(shift - f) when the noise is wider than 2^24 steps; for a
        validity study the coarsest with its smallest noise at 64 steps or more (validity.py), or
        without client noise the one validity.floor_grid takes from the servers' noise."""
        largest = max(self.sigma, self.server_noise_std)
        if self.validity is not None and self.sigma == 0 and self.server_noise_std > 0:  # epsilon at the floor
            gram = self.kind in features.GRAM_KINDS
            return _validity.floor_grid(self.server_noise_std * (features.UPPER_SCALE if gram else 1.0),
                                        self.max_reports, self.frac_bits, gram)
        if self.validity is not None and self.sigma > 0 and self.kind in features.GRAM_KINDS:
            return _validity.gram_grid(min(s for s in (self.sigma, self.server_noise_std) if s > 0) * features.UPPER_SCALE,
                                       self.frac_bits)
        if self.validity is not None and self.sigma > 0:  # coarser: a proof costs digits per bit
            return _validity.noise_grid(min(s for s in (self.sigma, self.server_noise_std) if s > 0), self.frac_bits)
        return _noise.grid_for(largest, self.frac_bits) if largest > 0 else _noise.Grid(self.frac_bits, 0)

    @_once
    def discrete_argument(self) -> smoothing.Argument:
        """Whether and at what cost the discrete noise is as private as the continuous accounting."""
        return smoothing.argument(nonzeros=self.s + 1 if self.kind == "l1" else self.s, k=self.k,
                                  columns=self.width, max_reports=self.max_reports,
                                  client_sigma=self.sigma, server_noise_std=self.server_noise_std,
                                  grid=self.noise_grid, spacing_factor=self._spacing_factor)

    @property
    def _spacing_factor(self) -> float:
        """sqrt(2) for a gram or moments validity study: in the release's units its strict upper
        triangle lies on the grid sqrt(2) h (it shares raw products, features.proved_scale), so the
        argument is made for that coarser grid, which covers the diagonal's h too; 1 otherwise."""
        return math.sqrt(2.0) if self.proved_features else 1.0

    @property
    def proved_features(self) -> bool:
        """Whether clients share the raw products (a gram or moments study with proofs)."""
        return self.validity is not None and self.kind in features.GRAM_KINDS

    @property
    def feature_scale(self) -> "np.ndarray":
        """What a client multiplies its features (and their noise) by: features.proved_scale for
        a gram or moments study with proofs, ones otherwise."""
        import numpy as np

        if self.proved_features:
            return features.proved_scale(self.kind, self.row_width)
        return np.ones(self.width)

    @property
    def release_scale(self) -> "float | np.ndarray":
        """What the analyzer multiplies the decoded sum by: :attr:`entry_scale`, over
        :attr:`feature_scale` per column where clients shared raw products."""
        if self.proved_features:
            return self.entry_scale / self.feature_scale
        return self.entry_scale

    def report_epsilon(self, honest_lambda: float) -> float:
        """epsilon at the study's delta for one honest report when lambda_min(S_H S_H^T) >=
        honest_lambda (1: no other honest report), for the noise really drawn: the continuous
        accounting of :attr:`mechanism` at delta less the argument's and the tail's share, plus
        the argument's epsilon slack."""
        argument = self.discrete_argument
        if not argument.covered:
            return self.mechanism.epsilon(honest_lambda, self.delta)
        delta = self.delta - argument.delta_slack(self.delta, self.epsilon) - self.tail_delta
        lam = honest_lambda
        if self.neighbouring == "add-remove":
            lam = honest_lambda - argument.lambda_loss
        return self.mechanism.epsilon(lam, delta) + argument.epsilon_slack()

    @_once
    def tail_delta(self) -> float:
        """What conditioning every noise value on the 20-sigma cut can cost of delta: with m_c
        client and m_s server noise values and p their cut probabilities (``noise.tail_probability``),
        (e^epsilon + 1) mp / (1 - mp), mp = m_c p_c + m_s p_s (``privacy.tail_delta``'s argument)."""
        grid = self.noise_grid
        mp = 0.0
        for std, count in ((self.sigma, self.max_reports * self.width),
                           (self.server_noise_std, self.n_servers * self.k * self.width)):
            if std > 0:
                mp += count * _noise.tail_probability(grid.scale(std), grid.limit(std))
        if self.validity is not None:  # an honest vector redrawn outside the predicate's bound
            # one proved vector a report, or a block per party of each individual (parties)
            mp += self.max_reports * len(self.parties or (None,)) * 2.0 ** _validity.REFUSAL_LOG2
        if self.batch_proofs:  # and each batch redrawn for a wrap-around projection outside T: at
            # most max_reports batches, 2^-96 each (docs/validity.md section 15, "Privacy charge")
            mp += self.max_reports * 2.0 ** _validity.REFUSAL_LOG2
        return privacy.truncation_delta(self.epsilon, mp)

    @property
    def clip_bound(self) -> float:
        """The norm clients clip to: a little under B, so that rounding the clipped vector to the
        noise grid (at most h sqrt(w) / 2 in norm) keeps the sensitivity the study promises."""
        slack = self.noise_grid.spacing * math.sqrt(self.width) * self._spacing_factor
        return _clip_bound(self.kind, self.row_bound, slack)

    @property
    def server_noise_std(self) -> float:
        """What each server draws per cell of its (unscaled) aggregate share: server_sigma sqrt(s),
        so that after the analyzer's 1/sqrt(s) it is server_sigma. An l1 study's columns have up
        to s + 1 unit entries and are not rescaled: server_sigma sqrt(s + 1) per cell gives every
        report at least the protection server_sigma gives a unit column (l1sketch.py)."""
        if self.kind == "l1":
            return self.server_sigma * ((self.s + 1) ** 0.5)
        return self.server_sigma * (self.s ** 0.5)

    @property
    def entry_scale(self) -> float:
        """What the analyzer multiplies the decoded release by: OSNAP's 1/sqrt(s); 1 for l1."""
        return 1.0 if self.kind == "l1" else sketch.scale(self.s)

    @property
    def l1_spec(self) -> "l1sketch.L1Spec":
        if self.l1 is None:
            raise ValueError(f"a {self.kind} study has no l1 sketch")
        return l1sketch.L1Spec(s=self.s, **self.l1.model_dump())

    def hash_report_ids(self, report_ids, joined: bytes | None = None) -> tuple:
        """Rows and signs of this study's public map for these reports: the one place a server,
        the analyzer and the tools ask which rows a report goes to (OSNAP or the l1 sketch).
        ``joined``: the same ids concatenated, if the caller has them so."""
        if self.kind == "l1":
            return l1sketch.hash_report_ids(self.seed_bytes, report_ids, self.l1_spec)
        return sketch.hash_report_ids(self.seed_bytes, report_ids, self.k, self.s, joined)

    def party(self, name: str) -> tuple[int, "_parties.Party"]:
        """A party of this study by name: its index and declaration (ValueError if none)."""
        for index, party in enumerate(self.parties or []):
            if party.name == name:
                return index, party
        known = [p.name for p in self.parties] if self.parties else "none: this study has no parties"
        raise ValueError(f"study has no party {name[:64]!r} (parties: {known})")

    @property
    def server_noise_bound(self) -> float:
        """|total server noise| in one aggregate cell: N servers, each cut at 20 sigma."""
        return self.n_servers * NOISE_TAIL_SIGMAS * self.server_noise_std

    def server_noise(self) -> "np.ndarray":
        """One server's noise for its aggregate share: the discrete Gaussian of parameter
        server_noise_std on the study's noise grid per cell (noise.py), encoded on the ring (what ``services/store.py`` adds before it releases; the
        simulations add it N times). Zeros when the study asks for no server noise."""
        import numpy as np

        if self.server_sigma == 0:
            return np.zeros(self.aggregate_shape, dtype=np.uint64)
        if self.proved_features:  # the strict upper triangle at 1/sqrt(2), as the clients' (k = 1)
            return _noise.scaled_noise(1, self.server_noise_std, self.feature_scale, self.noise_grid).view(np.uint64)
        return _noise.encoded_noise(self.aggregate_shape, self.server_noise_std, self.noise_grid).view(np.uint64)

    def guarantees(self) -> dict[str, float | str | None]:
        """What the study promises each honest report, both ways (docs/trust.md):

        * ``epsilon``: with at least lambda_star worth of honest reports (the certificate), the
          LTM guarantee under the study's neighbouring notion;
        * ``floor_epsilon``: with no other honest report at all (every other report a Sybil) and
          every server but one colluding, from the report's own noise and one server's noise;
          computed from the noise, so it is finite for replace-one even without server noise
          (then it is weak) and infinite for add/remove without server noise;
        * for a signed study with parties, whose signs come from the party key: the same two if a
          party colludes with the servers and the analyst and so reveals every sign
          (``epsilon_if_a_party_colludes``, ``floor_epsilon_if_a_party_colludes``: the unsigned
          accounting of the same noise).
        """
        out: dict[str, float | str | None] = {
            "neighbouring": self.neighbouring, "delta": self.delta,
            "epsilon": self.report_epsilon(self.lambda_star),
            "epsilon_target": self.epsilon, "lambda_star": self.lambda_star,
            "floor_epsilon": self.report_epsilon(1.0),
            "floor_epsilon_target": self.epsilon_floor,
            "discrete_noise": self.discrete_argument.covered,
            "secret_sign": self.secret_sign}
        if self.secret_sign and self.parties is not None:
            known = self.model_copy(update={"secret_sign": False})
            out["epsilon_if_a_party_colludes"] = known.report_epsilon(self.lambda_star)
            out["floor_epsilon_if_a_party_colludes"] = known.report_epsilon(1.0)
        return out

    @property
    def share_bytes(self) -> int:
        """Bytes of the largest share a server stores per report: 8 width, or for a validity
        study the leader's input and proof shares, 8 (n + P) (validity.Plan.leader_width)."""
        if self.validity is not None:  # with parties: an individual's blocks, a leader's of each
            return 8 * sum(p.leader_width for p in _validity.plans(self))
        return 8 * self.width

    @property
    def max_storage_bytes(self) -> int:
        """The share bytes a server agrees to store for this study: max_reports records of a
        16-byte report id and a share (it refuses uploads beyond max_reports); with parties,
        max_reports blocks of every party, each with its block id and pseudonym. A server's
        max_study_bytes policy compares against this; SQLite adds its own overhead on top."""
        if self.parties is not None:
            return self.max_reports * (len(self.parties) * 2 * sketch.REPORT_ID_BYTES + self.share_bytes)
        return self.max_reports * (sketch.REPORT_ID_BYTES + self.share_bytes)

    @property
    def aggregate_shape(self) -> tuple[int, int]:
        return (self.k, self.width)

    @model_serializer(mode="wrap")
    def _omit_absent_bins(self, handler):
        """``bounds``, ``histogram``, ``l1``, ``parties`` and ``population`` appear only in studies that have them,
        ``validity`` only when set, ``secret_sign`` and ``batch_proofs`` only when true: the JSON (and so the canonical encoding and the id) of a
        sketch or gram study is what it was before them."""
        data = handler(self)
        if isinstance(data, dict):
            for member in ("bounds", "histogram", "l1", "parties", "population", "validity"):
                if data.get(member) is None:
                    data.pop(member, None)
            if data.get("secret_sign") is False:
                data.pop("secret_sign")
            if data.get("batch_proofs") is False:
                data.pop("batch_proofs")
        return data

    def canonical(self) -> bytes:
        return canonical_json(self.model_dump(mode="json"))

    @_once
    def study_id(self) -> str:
        """The content hash of the canonical encoding, computed once per object (about 0.1 ms
        each time otherwise)."""
        return content_hash(self.model_dump(mode="json"))


def check_batch_proofs(study: "Study") -> None:
    """Where batch proofs exist (ValueError otherwise): a sketch or l1 study (they prove the same
    noisy row) with ``validity`` (the rows' predicate is its norm bound, section 4b) and without
    parties (a party's blocks would need a batch per party and a join of the batches' row ids:
    not designed)."""
    if study.validity is None:
        raise ValueError("batch_proofs needs validity: a batch proves every row's norm bound "
                         "(docs/protocol.md section 4d)")
    if study.kind not in ("sketch", "l1"):
        raise ValueError(f"batch proofs exist for sketch and l1 studies, not {study.kind} studies "
                         f"(docs/protocol.md section 4d)")
    if study.parties is not None:
        raise ValueError("batch proofs exist for studies without parties (docs/protocol.md section 4d)")


def check_secret_sign(kind: str, k: int, has_parties: bool) -> None:
    """The secret sign is for a sketch study with k > 1 (ValueError otherwise).

    Only second moments survive a sign: (t a)(t a)^T = a a^T, so the OSNAP sketch's Y^T Y keeps
    its law (S diag(t) is again a block OSNAP). A gram study shares [a, u(a a^T), 1]: a sign
    flips the first-moment block a and the constant 1 (their sums would be destroyed), and a
    sign on the whole vector would flip the second-moment block too. A histogram sums one-hot
    vectors (first moments), a sketch study with k = 1 is the plain sum of the rows, and an l1
    study's estimator reads first moments of its buckets. With parties each party holds a block
    of the same individual, so they share the individual's sign, derived from the party key
    (parties.signs; docs/vertical.md): allowed, never by default (:func:`signs_by_default`), since
    a party that colludes with the servers then knows every sign."""
    if kind != "sketch":
        raise ValueError(f"secret_sign is only for a sketch study, not a {kind} study: a sign flip "
                         f"corrupts the first moments (sums of a, the intercept) the {kind} kind releases")
    if k == 1:
        raise ValueError("secret_sign needs k > 1: a sketch study with k = 1 is the plain sum of the "
                         "rows (first moments), which a sign flip corrupts")


def signs_by_default(kind: str, k: int, has_parties: bool) -> bool:
    """Whether :func:`design` signs a study's rows when not told (``secret_sign=None``): a sketch
    study with k > 1 and no parties (with parties the sign rests on the party key: asked for only)."""
    return kind == "sketch" and k > 1 and not has_parties


@functools.lru_cache(maxsize=256)
def _clip_bound(kind: features.Kind, row_bound: float, rounding: float) -> float:
    """The largest B' <= B with sensitivity(B') + rounding <= sensitivity(B) under both notions
    (rounding: the norm a vector may move when its coordinates are rounded, twice over for two
    vectors). A histogram's 0/1 vectors are on the grid already: B itself. Remembered per
    (kind, B, rounding): the bisection's 160 sensitivities cost about 1 ms, twice per report a
    one-row client prepares (session 53's profile)."""
    if kind == "histogram" or rounding == 0:
        return row_bound

    def fits(b: float) -> bool:
        return all(privacy.sensitivity(b, n, kind) + rounding <= privacy.sensitivity(row_bound, n, kind)
                   for n in ("replace-one", "add-remove"))

    lo, hi = 0.0, row_bound
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def value_bound(kind: features.Kind, row_bound: float, sigma: float) -> float:
    """The overflow bound of one encoded coordinate: feature bound + 20 sigma."""
    return features.coordinate_bound(kind, row_bound) + NOISE_TAIL_SIGMAS * sigma


#: The floor a study gets unless its designer says otherwise: every report (4, delta)-DP even when
#: all other reports are an adversary's and all servers but one collude (docs/trust.md).
DEFAULT_EPSILON_FLOOR = 4.0

def default_max_reports(expected_reports: int) -> int:
    """design()'s max_reports: room for ten times the expected reports (at least 1,000)."""
    return max(10 * expected_reports, 1000)


#: A server's default storage policy: it refuses a study whose max_storage_bytes exceed this
#: (services' --max-study-bytes); `dpsketch recommend` checks designs against it.
DEFAULT_MAX_STUDY_BYTES = 32 << 30


def _noise_line(study: Study, own_local: float) -> str:
    sens = privacy.sensitivity(study.row_bound, study.neighbouring, study.kind)
    client = (f"Client noise sigma = {study.sigma:.4g} per coordinate (alone, a client would need "
              f"{own_local:.4g}: {own_local / study.sigma:.1f}x more)" if study.sigma > 0 else
              "No client noise: the servers' noise carries the whole guarantee (the DAP model)")
    server = (f"each server adds N(0, {study.server_sigma:.4g}^2) to every released cell"
              if study.server_sigma > 0 else "no server noise")
    return (f"{client}; {server}. Calibrated exactly for {study.neighbouring} (sensitivity "
            f"{sens:.4g}, row bound B = {study.row_bound})"
            + (", the report's own noise leaving with it included" if study.neighbouring == "add-remove"
               else "") + "."
            + (" Each client signs its row with a secret +-1 before its noise, so the noise is "
               "calibrated for the symmetric Gaussian mixture (docs/secret_sign.md; the default for a "
               "sketch study, secret_sign=false opts out)." if study.secret_sign
               else ""))


def _guarantee_line(study: Study) -> str:
    g = study.guarantees()
    floor = g["floor_epsilon"]
    floor_text = (f"epsilon = {floor:.3g}" if math.isfinite(floor) else "no guarantee")
    return (f"Guarantees per report: ({g['epsilon']:.4g}, {study.delta:g})-DP while the honest "
            + ("reports certify every report's leverage <= 1 / lambda_star"
               if study.kind == "l1" else "reports certify lambda_min - t >= lambda_star")
            + "; without any other honest report "
            f"(Sybils) and with all servers but one colluding: {floor_text}"
            + ("" if study.epsilon_floor is not None else " (no floor requested)") + ".")


def _design_parties(parties, columns, row_bound: float) -> tuple[list[_parties.Party], list[str]]:
    """Parties with default bounds filled in, and the study's columns (their blocks in order)."""
    given = [p if isinstance(p, dict) else p.model_dump() for p in parties]
    if any(not isinstance(p.get("columns"), list) or not p["columns"] for p in given):
        raise ValueError("every party needs its columns: [{'name': ..., 'columns': [...]}]")
    joined = [c for p in given for c in p["columns"]]
    if columns and list(columns) != joined:
        raise ValueError(f"the columns {list(columns)} are not the parties' blocks in order ({joined})")
    open_ = [i for i, p in enumerate(given) if p.get("row_bound") is None]
    if open_:  # the parties without a bound share what the others leave of B^2, by width
        left = row_bound ** 2 - math.fsum(p["row_bound"] ** 2 for p in given if p.get("row_bound") is not None)
        if left <= 0:
            raise ValueError(f"the parties' bounds leave nothing of B^2 = {row_bound ** 2:g} for "
                             f"{[given[i]['name'] for i in open_]}")
        bounds = _parties.default_bounds(math.sqrt(left), [len(given[i]["columns"]) for i in open_])
        given = list(given)
        for i, b in zip(open_, bounds):
            given[i] = {**given[i], "row_bound": b}
    made = [_parties.Party.model_validate(p) for p in given]
    _parties.check(made, joined, row_bound)
    return made, joined


#: default_k for a study whose clients sign their rows: k = n B / (SIGNED_K_CONSTANT sigma_signed),
#: sigma_signed the signed local model's noise (docs/accuracy.md, "k for a signed study").
SIGNED_K_CONSTANT = 370.0


def default_k(expected_reports: int, d: int, sigma_local: float, row_bound: float, s: int = 4,
              signed_variance_ratio: float | None = None) -> int:
    """Sketch rows that balance sketch distortion against noise (measured, docs/accuracy.md).

    The released Gram Y^T Y carries noise x data, whose size does not depend on k, and noise x
    noise, whose entries are about sigma^2 n / sqrt(k) ~ sigma_local^2 sqrt(k) / LAMBDA_SAFETY:
    it grows with k. The sketch's own distortion falls like d / k. Balancing the two gives k
    proportional to n B^2 / sigma_local^2; the constant 1/70 is the measured optimum of the
    synthetic benchmark for an unsigned study (k ~ 200 at n = 10^6 and ~ 20 at n = 10^5 for
    epsilon = 1, delta = 1e-6, replace-one), clamped to [2 d, 40 d] (2 d keeps a usable subspace
    embedding, 40 d puts the distortion sqrt(d/k) near 0.16) and to n/100 (every bucket well filled).

    A signed study (``signed_variance_ratio``: its clients' noise variance over the unsigned
    one's, :func:`signed_variance_ratio`) has about a tenth of the noise per released cell, so the
    sketch's distortion, not the noise, dominates at the unsigned k (p / (k - p - 1) = 1.11 at
    k = 20, p = 10). Its k is n B / (SIGNED_K_CONSTANT sigma_signed), sigma_signed =
    sigma_local sqrt(ratio): with the noise x data term's factor k / (k - p - 1) the first-order
    optimum moves like 1 / sigma rather than 1 / sigma^2, and the constant is the measured
    optimum (issue 45: k ~ 100 at n = 10^5, epsilon = 1; 68 at epsilon = 0.5; 440 = 40 d at 10^6).
    """
    if signed_variance_ratio is None:
        k = expected_reports * row_bound**2 / (70.0 * sigma_local**2)
    else:
        # B / sigma through squares, so a row bound that underflows fails as the unsigned rule does
        k = expected_reports * math.sqrt(row_bound**2 / (sigma_local**2 * signed_variance_ratio)) / SIGNED_K_CONSTANT
    k = min(max(k, 2 * d), 40 * d, max(s, expected_reports // 100))
    return max(s, (int(k) // s) * s)


def signed_variance_ratio(epsilon: float, delta: float) -> float:
    """The noise variance a secret-sign study needs over the unsigned study's, replace-one (B = 1):
    min(B^2 / r^2, (2 B / mu_star)^2) / (2 B / mu_star)^2, the plain Gaussian's beyond the
    mixture's computed range, as ``accounting.calibrate`` chooses (docs/secret_sign.md section 2,
    Lemma 0). Used to size k only (:func:`default_k`): privacy is the calibration's business."""
    from . import secret_sign as _sign

    if epsilon > _sign.MAX_EPSILON:
        return 1.0
    radius = _sign.replace_radius(float(epsilon), float(delta))
    if radius >= _sign.MAX_RADIUS:
        return 1.0
    plain = (2.0 * privacy.unit_sigma(epsilon, delta)) ** 2
    return min(1.0 / radius ** 2, plain) / plain


def _validated(**fields) -> Study:
    """A Study, or ValueError with one sentence naming the offending field(s), never pydantic's
    multi-line dump (the analyzer passes it on as 422 invalid-study, the CLI prints it)."""
    from pydantic import ValidationError

    from .problems import summarize_errors

    try:
        return Study(**fields)
    except ValidationError as exc:
        raise ValueError(summarize_errors(exc.errors())) from None


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
    epsilon_floor: float | None | Literal["default"] = "default",
    histogram: HistogramSpec | dict | None = None,
    parties: Sequence[_parties.Party | dict] | None = None,
    population: str | None = None,
    secret_sign: bool | None = None,
    bounds: "dict[str, Sequence[float]] | Sequence[Sequence[float]] | None" = None,
    validity: bool = False,
    batch_proofs: bool = False,
) -> tuple[Study, list[str]]:
    """Choose k, s, lambda_star, the client and server noise and f for a study; return it with a
    human explanation.

    ``kind="gram"`` makes the plain-sum study of the Gram matrix (k = s = 1, see features.py),
    ``kind="moments"`` the same without the row sum and count (less noise for fits that only
    read A^T A);
    ``kind="histogram"`` the plain-sum study of one-hot cells of ``histogram``'s bins (its axes
    are the columns; ``columns`` and ``label`` may be left empty); ``dpsketch.recommend`` says
    which kind suits given d and n. ``parties`` (a sketch study only) splits the columns into
    blocks owned by parties (``[{"name", "columns", "row_bound"?}]``; ``columns`` may then be
    left empty; parties without a bound share what the others leave of B^2 by width: B sqrt(d_j / d)
    when none is given; docs/vertical.md). ``population`` names the population the study draws
    from: every server charges it to that population's privacy ledger (docs/ledger.md).
    ``secret_sign`` has every client sign its row with a secret +-1 and calibrates for it
    (docs/secret_sign.md): the same epsilon with much less noise. None (the default) turns it on
    wherever a study can take it (:func:`signs_by_default`: a sketch study with k > 1 and no
    parties) and off elsewhere; False opts out; True on a study that cannot take it is an error.
    ``epsilon_floor`` is the
    guarantee every report keeps when no other report is honest (servers add noise for it,
    docs/trust.md): by default max(DEFAULT_EPSILON_FLOOR, epsilon); None promises no floor (a
    share server's default policy refuses such a study).
    ``validity`` has every client prove its report valid and every server check it
    (validity.py, docs/validity.md): one report then moves the release no more than an honest
    report at the bound can. Sketch studies (with parties too: each block proved with its party's bound), histogram, gram, moments and l1 studies,
    at any epsilon (at the floor, sigma = 0, the servers' noise sets the grid: docs/validity.md section 14).
    ``batch_proofs`` (with ``validity``, a sketch or l1 study without parties) lets bulk owners
    prove batches of rows at once besides per-report proofs (docs/protocol.md section 4d).
    ``bounds`` ({column: [lower, upper]} or pairs in column order) are the public range of every
    column: clients clamp to them and map each row into the ball (bounds.py), and the analyzer
    answers in the data's units; without them rows must already be scaled into the ball.
    """
    if kind not in features.KINDS:
        raise ValueError(f"kind must be one of {features.KINDS}, got {kind!r}")
    if kind == "histogram":
        if histogram is None:
            raise ValueError("a histogram study needs its bins: histogram={'axes': [...]}")
        histogram = HistogramSpec.model_validate(histogram)
        if columns and list(columns) != histogram.columns:
            raise ValueError(f"a histogram study's columns are its axes ({histogram.columns}), not {columns}")
        columns, label, row_bound = histogram.columns, None, histogram.row_norm
        if k not in (None, 1):
            raise ValueError("a histogram study is the plain sum: k must be 1")
        k = 1
    elif histogram is not None:
        raise ValueError(f"only a histogram study has bins, not a {kind} study")
    if parties is not None:
        parties, columns = _design_parties(parties, columns, row_bound)
    if bounds is not None:
        if kind == "histogram":
            raise ValueError("a histogram study's bins are its bounds: leave bounds out")
        bounds = _bounds.bounds_from_mapping(bounds, list(columns))
    d = len(columns)
    if expected_reports < 2:
        raise ValueError("expected_reports must be at least 2")
    sigma_local = privacy.local_sigma(epsilon, delta, row_bound, neighbouring)
    if kind in features.GRAM_KINDS:
        if k not in (None, 1):
            raise ValueError(f"a {kind} study is the plain sum: k must be 1")
        if d > features.GRAM_MAX_COLUMNS:
            raise ValueError(f"a {kind} study of {d} columns would share {features.width(kind, d)} "
                             f"values per client; use a sketch study beyond "
                             f"{features.GRAM_MAX_COLUMNS} columns")
        k = 1
    elif kind == "l1":
        if k is not None:
            raise ValueError("an l1 study's k follows from its levels (l1sketch.design): leave k out")
        s = min(s, 2)
    elif k is None:  # the constant coordinate of a study with bounds is one more column to keep
        signed = (kind == "sketch" and parties is None) if secret_sign is None else bool(secret_sign)
        k = default_k(expected_reports, d + (1 if bounds is not None else 0), sigma_local, row_bound, s,
                      signed_variance_ratio(epsilon, delta) if signed else None)
    if k == 1:
        s = 1
    min_reports_note = "as requested"
    if min_reports is None:
        min_reports = max(t + 1, math.floor(0.9 * expected_reports))
        min_reports_note = "by default 90% of the expected count, so a few lost reports do not block it"

    if max_reports is None:
        max_reports = default_max_reports(expected_reports)
    l1 = None
    if kind == "l1":
        spec, lambda_star = l1sketch.design(min_reports, d, s=s)
        k = spec.k
        l1 = L1Params(level0_buckets=spec.level0_buckets, levels=spec.levels, buckets=spec.buckets,
                      branching=spec.branching)
    else:
        lambda_star = privacy.choose_lambda_star(min_reports, k, t, expected_reports)
    if epsilon_floor == "default":
        epsilon_floor = max(DEFAULT_EPSILON_FLOOR, float(epsilon))
    constant = bounds is not None and kind in _bounds.CONSTANT_KINDS
    width = histogram.cells if histogram is not None else features.width(kind, d + (1 if constant else 0))
    if secret_sign is None:
        secret_sign = signs_by_default(kind, k, parties is not None)
    elif secret_sign:
        check_secret_sign(kind, k, parties is not None)
    noise = accounting.calibrate(neighbouring, kind, row_bound, epsilon, delta, lambda_star, width,
                                 epsilon_floor, secret_sign)
    sigma, server_sigma = noise.sigma, noise.server_sigma
    bound = value_bound(kind, row_bound, sigma)
    server_bound = len(servers) * NOISE_TAIL_SIGMAS * server_sigma * math.sqrt(s + 1 if kind == "l1" else s)
    if validity:  # valid reports reach R h per coordinate (a little above B + the noise allowance)
        allowed = _validity.allowed_value(kind, row_bound, sigma, width)
        frac_bits = _validity.max_frac_bits(max_reports, max(bound, allowed), server_bound)
        if server_sigma == 0 and sigma > 0 and neighbouring == "replace-one":
            sigma = _validity.widened_sigma(sigma, k, frac_bits, kind)  # the coarse grid's rounding
            bound = value_bound(kind, row_bound, sigma)
            allowed = _validity.allowed_value(kind, row_bound, sigma, width)
            frac_bits = _validity.max_frac_bits(max_reports, max(bound, allowed), server_bound)
        if sigma == 0 and server_sigma > 0:  # epsilon at the floor: the grid's rounding radius
            per_cell = math.sqrt(s + 1 if kind == "l1" else s)
            server_sigma = _validity.widened_server_sigma(server_sigma, per_cell, k, max_reports, frac_bits, kind)
            server_bound = len(servers) * NOISE_TAIL_SIGMAS * server_sigma * per_cell
            frac_bits = _validity.max_frac_bits(max_reports, max(bound, allowed), server_bound)
    else:
        frac_bits = ring.max_frac_bits(max_reports, bound, server_bound)
    study = _validated(
        name=name,
        population=population,
        columns=columns,
        label=label,
        row_bound=row_bound,
        bounds=bounds,
        kind=kind,
        histogram=histogram,
        l1=l1,
        parties=parties,
        k=k,
        s=s,
        seed=seed or secrets.token_hex(32),
        epsilon=epsilon,
        delta=delta,
        neighbouring=neighbouring,
        lambda_star=lambda_star,
        sigma=sigma,
        server_sigma=server_sigma,
        epsilon_floor=epsilon_floor,
        servers=servers,
        t=t,
        min_reports=min_reports,
        max_reports=max_reports,
        frac_bits=frac_bits,
        secret_sign=secret_sign,
        validity=_validity.PREDICATE if validity else None,
        batch_proofs=batch_proofs,
    )
    if kind == "histogram" and histogram.marginal:
        transform = (
            f"Marginal histogram: {' + '.join(f'{a.column} ({a.bins} bins)' for a in histogram.axes)} = "
            f"{study.width} cells side by side (no joint grid); each client shares a vector with a 1 in "
            f"its cell of every axis (norm B = sqrt({len(histogram.axes)})) and the servers sum them "
            f"(k = s = 1): the release is one noisy histogram per column, the central model's noise "
            f"on the counts, for all {len(histogram.axes)} columns at the price of one study.")
    elif kind == "histogram":
        transform = (
            f"Histogram: {' x '.join(f'{a.column} ({a.bins} bins)' for a in histogram.axes)} = "
            f"{study.width} cells; each client shares the one-hot vector of its cell and the "
            f"servers sum them (k = s = 1): the release is the noisy histogram, the central "
            f"model's noise on the counts.")
    elif kind == "gram":
        transform = (
            f"Gram: each client shares [a, u(a a^T), 1], {study.width} values, and the servers "
            f"sum them (k = s = 1): the release is the noisy A^T A, row sum and count, "
            f"the central model's sufficient statistics."
        )
    elif kind == "moments":
        transform = (
            f"Moments: each client shares u(a a^T), {study.width} values, and the servers sum them "
            f"(k = s = 1): the release is the noisy A^T A alone (no row sum, no count), with the "
            f"sensitivity of A^T A, for ridge, least squares and PCA on the uncentered Gram."
        )
    elif kind == "l1":
        spec = study.l1_spec
        transform = (
            f"l1 sketch: k = {k} rows: level 0 in s = {s} blocks of {spec.level0_buckets}, then "
            f"{spec.levels} sampled levels of {spec.buckets} (branching {spec.branching}), as deep as "
            f"keeps the deepest buckets at {l1sketch.MIN_DEEP_BUCKET}+ expected reports.")
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
            else f"lambda_star = {lambda_star:.1f}: {l1sketch.LEVERAGE_SAFETY} / the typical leverage of "
            f"a report at n = min_reports; servers check every report's exact leverage <= "
            f"1 / lambda_star before they release."
            if kind == "l1"
            else f"lambda_star = {lambda_star:.1f}: {privacy.lambda_safety(min_reports, k, expected_reports)} x the expected "
            f"lambda_min(S S^T) ~ (n/k)(1 - sqrt(k/n))^2 at n = min_reports, minus t = {t}."
        ),
        _noise_line(study, own_local),
        _guarantee_line(study),
        f"Ring: f = {frac_bits} fractional bits; {max_reports} reports of |x| <= "
        f"{bound:.4g} cannot overflow 2^63.",
    ]
    if bounds is not None:
        shown = ", ".join(f"{c} in [{lo:g}, {hi:g}]" for c, (lo, hi) in zip(columns, bounds))
        explanation.append(
            f"Bounds: {shown}. Each client clamps every value to its column's bounds (counting what it "
            f"clamped) and maps its row into the ball of radius B = {row_bound:g}"
            + (" with a constant coordinate, so the release carries the column sums and count (the "
               "intercept and the centre)" if constant else "")
            + "; answers come back in the data's units.")
    elif kind != "histogram":
        explanation.append(
            f"Warning: no bounds declared. Every row is taken as already scaled into the ball of radius "
            f"B = {row_bound:g}: a row of raw values (a wage of 2,500) is clipped to norm {row_bound:g} "
            f"and the answers come back in that scale, without an intercept for a sketch study. "
            f"Declare the columns' bounds (or run a pilot study to propose them) to work in units.")
    if population is not None:
        explanation.append(
            f"Population {population!r}: every server charges this study's privacy loss (epsilon = "
            f"{study.guarantees()['epsilon']:.4g} at delta = {delta:g}, {neighbouring}) to the population's "
            f"ledger and refuses it if it would pass the population's budget (docs/ledger.md).")
    if parties is not None:
        explanation.append(
            f"Parties: {'; '.join(f'{p.name} holds {p.columns} (B_j = {p.row_bound:.4g})' for p in parties)}. "
            f"Each clips its block to B_j (sum of B_j^2 <= B^2) and adds the same sigma per value, "
            f"so the joined row is a single owner's report; an individual counts only when every "
            f"party's block is at every server (docs/vertical.md).")
    if kind == "sketch" and k <= study.row_width:
        explanation.append(
            f"Warning: k = {k} <= d = {study.row_width}: with {expected_reports} reports the sketch has no more "
            f"rows than columns (k is capped at n/100 so every bucket is well filled), so it "
            f"cannot keep d-dimensional structure; expect errors near the local model's. A gram "
            f"study or more reports would do better (dpsketch recommend)."
        )
    return study, explanation
