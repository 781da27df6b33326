"""The privacy ledger of a population: what its studies have spent, composed tightly (docs/ledger.md).

A study may name the population it draws from (``Study.population``, a stable id chosen by
whoever enrols the clients). Every share server keeps, per population, one :class:`Charge` per
study it provisioned and refuses a study that would take the population past the budget of its
policy; a data owner's SDK keeps the same kind of ledger for itself (``client_sdk/budget.py``).
Both use this module, which does no I/O.

What is charged. A study promises (epsilon, delta) to one honest report while its certificate
holds (lambda_min >= lambda_star; servers refuse to release otherwise, docs/trust.md). Its
charge is the privacy loss distribution that promise is read from: the study's own
:class:`accounting.Mechanism` (client noise sigma, server noise server_sigma, row bound, kind,
width) at lambda_star, built by :func:`accounting.study_pld`. So the charge equals the study's
promise whatever its kind: a sketch, gram, histogram or l1 study's sensitivity and width are
those of its Mechanism (privacy.sensitivity per kind; the gram row [a, u(a a^T), 1] has norm
sqrt(B^4/2 + B^2 + 1), a histogram's 0/1 vector norm B: 1 one-hot, sqrt(m) marginal). A sketch study whose clients sign their
rows (``Study.secret_sign``, docs/secret_sign.md) is charged the symmetric Gaussian mixture's PLD
(``secret_sign.study_pld``), not the Gaussian shift of its smaller noise; the charge records the
flag (``Charge.secret_sign``, omitted from the JSON when false).

Composition. The PLDs of a population's studies are composed with dp-accounting
(``PrivacyLossDistribution.compose``; pessimistic, so the result is an upper bound) and epsilon
is read off at the ledger's delta. That is the tight composition of the Gaussian mechanisms,
not the sum of the epsilons, which is also reported (:attr:`Composition.naive_epsilon`, at the
sum of the deltas) for comparison.

Neighbouring notions. A ledger is kept in one notion (the budget's):

* replace-one (the default): every study is charged its replace-one loss. For a replace-one
  study that is its own promise; for an add/remove study it is the replace-one loss of the same
  noise (replacing a row keeps the report and its own noise in both worlds: the Gaussian shift
  of Delta_replace / sqrt(sigma^2 lambda + tau^2)), exact and tighter than group privacy over
  its add/remove promise.
* add-remove: an add/remove study is charged its own promise; a replace-one study is charged
  an unbounded loss (it publishes its exact report count, so presence shows), so an add/remove
  budget refuses every replace-one study of the population.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from . import accounting, privacy

#: The delta a ledger without a budget reads its composed epsilon at.
DEFAULT_DELTA = 1e-6


class Charge(BaseModel):
    """One study's entry in a ledger: the noise its PLD is built from, and its own (epsilon, delta).

    Kept (and published) instead of the whole study: it is all the accounting needs, and a
    data owner's local file need not hold the studies' columns.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    study_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    name: str = ""
    population: str | None = None
    neighbouring: privacy.Neighbouring
    kind: str
    row_bound: float = Field(gt=0)
    sigma: float = Field(ge=0)
    server_sigma: float = Field(ge=0)
    width: int = Field(ge=1)
    lambda_star: float = Field(ge=1)
    #: the study's delta, and the epsilon it promises there (under its own notion)
    delta: float = Field(gt=0, lt=1)
    epsilon: float = Field(ge=0)
    #: the study's clients sign their rows with a secret +-1 (docs/secret_sign.md): its PLD is the
    #: symmetric mixture's, not the Gaussian shift's. Omitted from the JSON when false, so a charge
    #: of a study without it serialises exactly as before the member existed.
    secret_sign: bool = False

    @model_serializer(mode="wrap")
    def _omit_unsigned(self, handler):
        data = handler(self)
        if isinstance(data, dict) and data.get("secret_sign") is False:
            data.pop("secret_sign")
        return data

    @classmethod
    def of(cls, study) -> "Charge":
        """The charge of a :class:`~dpsketch.protocol.study.Study`: its Mechanism at lambda_star,
        with the noise the release is accounted for (``Study.mechanism``: the discrete noise's
        effective sigma and server sigma, within 1e-6 of the nominal ones), so a charge is what
        the study's own guarantee is computed from."""
        g = study.guarantees()
        mechanism = study.mechanism
        return cls(study_id=study.study_id, name=study.name, population=study.population,
                   neighbouring=study.neighbouring, kind=study.kind, row_bound=study.row_bound,
                   sigma=mechanism.sigma, server_sigma=mechanism.server_sigma, width=study.width,
                   lambda_star=study.lambda_star, delta=study.delta, epsilon=float(g["epsilon"]),
                   secret_sign=mechanism.secret_sign)

    @property
    def _key(self) -> tuple:
        return (self.neighbouring, self.kind, self.row_bound, self.sigma, self.server_sigma,
                self.lambda_star, self.width, self.secret_sign)

    def epsilon_in(self, notion: str) -> float:
        """This study's epsilon at its own delta under ``notion`` (inf if unbounded there)."""
        if notion == self.neighbouring:
            return self.epsilon
        if notion == "add-remove":  # a replace-one study under add/remove
            return math.inf
        return accounting.report_epsilon("replace-one", self.kind, self.row_bound, self.sigma,
                                         self.server_sigma, self.lambda_star, self.width, self.delta,
                                         secret_sign=self.secret_sign)

    def pld(self, notion: str, grid: float = accounting.LOSS_GRID):
        """The PLD charged under ``notion`` (None: unbounded)."""
        return _pld(*self._key, notion, grid)

    def grid(self, notion: str) -> float:
        *key, signed = self._key
        return accounting.pld_grid(*key, notion, secret_sign=signed)


@lru_cache(maxsize=1024)
def _pld(neighbouring, kind, row_bound, sigma, server_sigma, lambda_star, width, secret_sign, notion, grid):
    """Cached: a server composes the same studies' PLDs on every provisioning of the population."""
    return accounting.study_pld(neighbouring, kind, row_bound, sigma, server_sigma, lambda_star, width,
                                notion, grid, secret_sign=secret_sign)


@dataclass(frozen=True)
class Composition:
    """A ledger's total: epsilon at ``delta`` of the composed PLDs, and the naive sum."""

    notion: str
    delta: float
    studies: int
    epsilon: float  # composed (inf if a study is unbounded in this notion); 0 with no studies
    naive_epsilon: float  # sum of each study's epsilon at its own delta ...
    naive_delta: float  # ... which holds at the sum of the deltas


def compose(charges: list[Charge], notion: str = "replace-one", delta: float = DEFAULT_DELTA) -> Composition:
    """Compose the charges' PLDs (dp-accounting) and read epsilon off at ``delta``."""
    if notion not in ("replace-one", "add-remove"):
        raise ValueError(f"unknown neighbouring notion {notion!r}")
    charges = list(charges)
    naive = math.fsum(c.epsilon_in(notion) for c in charges) if charges else 0.0
    naive_delta = math.fsum(c.delta for c in charges)
    if not charges:
        return Composition(notion, delta, 0, 0.0, 0.0, 0.0)
    grid = max(c.grid(notion) for c in charges)
    plds = [c.pld(notion, grid) for c in charges]
    if any(p is None for p in plds):
        return Composition(notion, delta, len(charges), math.inf, naive, naive_delta)
    total = plds[0]
    for p in plds[1:]:
        total = total.compose(p)
    epsilon = float(total.get_epsilon_for_delta(delta))
    return Composition(notion, delta, len(charges), epsilon, naive, naive_delta)


@dataclass(frozen=True)
class Budget:
    """A population's (or a data owner's) limit: every report stays (epsilon, delta)-DP over all
    studies charged, under ``notion``."""

    epsilon: float
    delta: float
    notion: str = "replace-one"

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"a budget's epsilon must be positive and finite, got {self.epsilon!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"a budget's delta must be in (0, 1), got {self.delta!r}")
        if self.notion not in ("replace-one", "add-remove"):
            raise ValueError(f"a budget's neighbouring notion is replace-one or add-remove, got {self.notion!r}")

    def describe(self) -> str:
        return f"(epsilon = {self.epsilon:g}, delta = {self.delta:g}, {self.notion})"


@dataclass(frozen=True)
class Verdict:
    """Whether one more study fits a budget, with the numbers a refusal names."""

    fits: bool
    spent: Composition  # without the study
    needed: Composition  # with it
    study_epsilon: float  # the study alone, at the budget's delta, in the budget's notion

    def explain(self, budget: Budget, who: str) -> str:
        s, n = self.spent, self.needed
        return (f"{who} has a budget of {budget.describe()}; its {s.studies} studies have spent "
                f"epsilon = {s.epsilon:.4g} at delta = {budget.delta:g} (naive sum {s.naive_epsilon:.4g}); "
                f"this study (epsilon = {self.study_epsilon:.4g} alone at that delta) would take it to "
                f"epsilon = {n.epsilon:.4g}, past the budget's {budget.epsilon:g}")

    def problem_members(self, budget: Budget, population: str) -> dict:
        """The members of a 409 ``budget-exceeded`` problem (docs/protocol.md section 8), the same
        whoever refuses: a share server at provisioning, or the analyzer when a server's published
        ledger says that server would (non-finite epsilons, an unbounded study, are null)."""
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {"population": population, "neighbouring": budget.notion,
                "budget_epsilon": budget.epsilon, "budget_delta": budget.delta,
                "spent_epsilon": finite(self.spent.epsilon), "studies_charged": self.spent.studies,
                "needed_epsilon": finite(self.needed.epsilon), "study_epsilon": finite(self.study_epsilon)}


def check(charges: list[Charge], study: Charge, budget: Budget) -> Verdict:
    """Would ``study`` keep the ledger of ``charges`` within ``budget``? A study already charged
    (same id) costs nothing more."""
    charges = list(charges)
    spent = compose(charges, budget.notion, budget.delta)
    if any(c.study_id == study.study_id for c in charges):
        return Verdict(True, spent, spent, 0.0)
    needed = compose(charges + [study], budget.notion, budget.delta)
    alone = compose([study], budget.notion, budget.delta).epsilon
    fits = needed.epsilon <= budget.epsilon * (1 + 1e-9)
    return Verdict(fits, spent, needed, alone)
