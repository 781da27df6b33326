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

The floor. Each study also promises a floor: (epsilon_floor, delta) for a report with no other
honest report at all (every other report a Sybil, every server but one colluding;
docs/trust.md). Under a Sybil attack on every study a victim gets only the floors, so the
ledger composes them too (:meth:`Charge.floor_pld`: the same Mechanism at honest_lambda = 1) and a
budget may bound both (:attr:`Budget.floor_epsilon`); seven default studies (epsilon 1, floor 4)
compose to floor epsilon 10.78 while their LTM guarantees compose to 1.95.

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

import functools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

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
    def _key(self) -> tuple[str, str, float, float, float, float, int, bool]:
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

    def floor_epsilon_in(self, notion: str) -> float:
        """This study's floor (no other honest report) at its own delta under ``notion``."""
        if notion == "add-remove" and self.neighbouring != "add-remove":
            return math.inf
        return accounting.report_epsilon(notion, self.kind, self.row_bound, self.sigma, self.server_sigma,
                                         1.0, self.width, self.delta, secret_sign=self.secret_sign)

    def pld(self, notion: str, grid: float = accounting.LOSS_GRID):
        """The PLD charged under ``notion`` (None: unbounded)."""
        return _noise_pld(*self._key, notion, grid)

    def floor_pld(self, notion: str, grid: float = accounting.LOSS_GRID):
        """The PLD of the study's floor under ``notion``: its Mechanism with no other honest report
        (honest_lambda = 1); None: unbounded."""
        return _floor_pld(*self._floor_key, notion, grid)

    def grid(self, notion: str, floor: bool = False) -> float:
        *key, signed = self._floor_key if floor else self._key
        if floor:
            key.insert(5, 1.0)
        return _loss_grid(tuple(key), notion, signed)

    @property
    def _floor_key(self) -> tuple[str, str, float, float, float, int, bool]:
        return (self.neighbouring, self.kind, self.row_bound, self.sigma, self.server_sigma, self.width,
                self.secret_sign)


@functools.lru_cache(maxsize=1024)
def _loss_grid(key: tuple, notion: str, signed: bool) -> float:
    """Cached: the loss grid of a charge's PLD (accounting.pld_grid). A signed add/remove study's
    is read off the distributions of its presence pair, about 5 ms each time, and every
    composition asks it of every charge (a budget check composes six times, the writer's six
    more): 10 such studies cost 51 ms a composition before, 0.44 ms now."""
    return accounting.pld_grid(*key, notion, secret_sign=signed)  # type: ignore[call-arg, misc]  # the key tuple spread


class _BuiltOnce:
    """A memo of built PLDs (the last ``kept``, as ``functools.lru_cache``) that builds each one once
    at a time: a thread asking for a PLD another thread is building waits for that build and gets
    the same PLD, rather than making it again (a signed study's takes seconds of CPU, and two
    threads building the same one at once took more than twice as long); a thread asking for
    another one builds it meanwhile, without waiting. So whoever asks (a share server's
    background build of a study's PLDs, a first upload token's check, the writer's check), a PLD
    is built once, and a check waits only for the PLDs it needs itself. A build that fails is
    not remembered: the next thread asking builds it again (and a waiting one is that thread)."""

    def __init__(self, build: Callable[..., Any], kept: int):
        self._build, self._kept = build, kept
        self._lock = threading.Lock()
        self._built: OrderedDict[tuple, Any] = OrderedDict()
        self._building: dict[tuple, threading.Event] = {}
        functools.update_wrapper(self, build)

    def __call__(self, *args):
        while True:
            with self._lock:
                if args in self._built:
                    self._built.move_to_end(args)
                    return self._built[args]
                other = self._building.get(args)
                if other is None:
                    mine = self._building[args] = threading.Event()
                    break
            other.wait()  # then it is built (or that build failed: then this thread builds it)
        try:
            value = self._build(*args)
            with self._lock:
                self._built[args] = value
                while len(self._built) > self._kept:
                    self._built.popitem(last=False)
            return value
        finally:
            with self._lock:
                del self._building[args]
            mine.set()

    def cache_clear(self) -> None:
        """Forget every PLD built (one being built is still handed to those waiting for it)."""
        with self._lock:
            self._built.clear()


def _built_once(kept: int) -> Callable[[Callable[..., Any]], _BuiltOnce]:
    return lambda build: _BuiltOnce(build, kept)


@_built_once(1024)
def _pld(neighbouring, kind, row_bound, sigma, server_sigma, lambda_star, width, secret_sign, notion, grid):
    """Cached: a server composes the same studies' PLDs on every provisioning of the population."""
    return accounting.study_pld(neighbouring, kind, row_bound, sigma, server_sigma, lambda_star, width,
                                notion, grid, secret_sign=secret_sign)


#: A signed replace-one study's PLD (the symmetric mixture's, docs/secret_sign.md) is built for its
#: radius r = B / sqrt(sigma^2 lambda + tau^2) rounded up to this step: studies designed for the
#: same target (every floor of 4, every LTM epsilon of 1) then share one, and building one takes
#: several seconds of CPU. A larger radius only loses more privacy, so rounding up is pessimistic
#: (measured: it raises a charge of epsilon 1 by at most 2 x 10^-4).
RADIUS_STEP = 1e-5


def _noise_pld(neighbouring, kind, row_bound, sigma, server_sigma, honest_lambda, width, secret_sign, notion, grid):
    """accounting.study_pld through the caches: a signed replace-one law by its rounded radius
    (in memory, and in the installed store: :func:`_signed_replace_pld`), anything else by its parameters."""
    if secret_sign and notion == "replace-one":
        from . import secret_sign as _sign

        r = _sign.replace_radius_of(row_bound, sigma, server_sigma, honest_lambda)
        ticks = math.ceil(r / RADIUS_STEP) if math.isfinite(r) else None
        if ticks is not None and ticks * RADIUS_STEP <= _sign.MAX_RADIUS:
            return _signed_replace_pld(ticks, grid)
    return _pld(neighbouring, kind, row_bound, sigma, server_sigma, honest_lambda, width, secret_sign, notion, grid)


def _floor_pld(neighbouring, kind, row_bound, sigma, server_sigma, width, secret_sign, notion, grid):
    return _noise_pld(neighbouring, kind, row_bound, sigma, server_sigma, 1.0, width, secret_sign, notion, grid)


class PldStore(Protocol):
    """Where built mixture PLDs are kept between processes, so that each one does not spend seconds
    rebuilding what another one built: a file per radius and grid on disk
    (:class:`dpsketch.pld_cache.DiskPldStore`, installed by the share server, the analyzer and the
    SDK's privacy limit). This module does no I/O itself; with no store it builds every PLD it
    needs (once per process: :func:`_signed_replace_pld` remembers them)."""

    def load(self, name: str) -> tuple[np.ndarray, int, float] | None:
        """The saved PLD's (probabilities, lower loss index, infinity mass) of ``name``; None when
        there is none (or it cannot be read: that only costs the rebuild)."""

    def save(self, name: str, probs: np.ndarray, lower: int, infinity: float) -> None:
        """Keep a built PLD under ``name``; best effort, never raises (a failure only costs
        another process the rebuild)."""


_PLD_STORE: PldStore | None = None


def keep_plds_in(store: PldStore | None) -> PldStore | None:
    """From now on ask ``store`` for a signed PLD before building it, and hand it the ones built
    (None: build every time, no I/O). Returns the store it replaces."""
    global _PLD_STORE
    previous, _PLD_STORE = _PLD_STORE, store
    return previous


def pld_store() -> PldStore | None:
    """The store :func:`keep_plds_in` installed, if any."""
    return _PLD_STORE


@_built_once(256)
def _signed_replace_pld(ticks: int, grid: float):
    """secret_sign.replace_pld at radius ticks * RADIUS_STEP; read from the installed
    :class:`PldStore` (by a name per radius and grid) if it has it, else built and handed to it."""
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as dp_pld

    from . import secret_sign as _sign

    name = f"replace-{ticks}x{RADIUS_STEP:g}-grid{grid!r}-v1.npz"
    store = _PLD_STORE
    saved = store.load(name) if store is not None else None
    if saved is not None:
        probs, lower, infinity = saved
        try:
            pmf = pld_pmf.DensePLDPmf(grid, lower, probs, infinity, pessimistic_estimate=True)
            return dp_pld.PrivacyLossDistribution(pmf, pmf)
        except ValueError:
            pass
    built = _sign.replace_pld(ticks * RADIUS_STEP, grid)
    pmf = built._pmf_remove
    if store is not None and isinstance(pmf, pld_pmf.DensePLDPmf) and built._pmf_add is pmf:
        store.save(name, pmf._probs, int(pmf._lower_loss), float(pmf._infinity_mass))
    return built


@dataclass(frozen=True)
class Composition:
    """A ledger's total: epsilon at ``delta`` of the composed PLDs, and the naive sum."""

    notion: str
    delta: float
    studies: int
    epsilon: float  # composed (inf if a study is unbounded in this notion); 0 with no studies
    naive_epsilon: float  # sum of each study's epsilon at its own delta ...
    naive_delta: float  # ... which holds at the sum of the deltas


def compose(charges: list[Charge], notion: str = "replace-one", delta: float = DEFAULT_DELTA,
            floor: bool = False) -> Composition:
    """Compose the charges' PLDs (dp-accounting) and read epsilon off at ``delta``; ``floor``:
    their floors' PLDs (no other honest report) instead of their certified guarantees'."""
    if notion not in ("replace-one", "add-remove"):
        raise ValueError(f"unknown neighbouring notion {notion!r}")
    charges = list(charges)
    alone = (lambda c: c.floor_epsilon_in(notion)) if floor else (lambda c: c.epsilon_in(notion))
    naive = math.fsum(alone(c) for c in charges) if charges else 0.0
    naive_delta = math.fsum(c.delta for c in charges)
    if not charges:
        return Composition(notion, delta, 0, 0.0, 0.0, 0.0)
    grid = max(c.grid(notion, floor) for c in charges)
    total = _composed(tuple(c._floor_key if floor else c._key for c in charges), floor, notion, grid)
    if total is None:
        return Composition(notion, delta, len(charges), math.inf, naive, naive_delta)
    epsilon = float(total.get_epsilon_for_delta(delta))
    return Composition(notion, delta, len(charges), epsilon, naive, naive_delta)


#: The composed PLDs of the last charge lists composed (:func:`_composed`), oldest first.
_COMPOSED: dict[tuple, object] = {}
#: How many are kept: a budget check asks for six (spent, with the study, the study alone; each
#: for the guarantees and the floors) and the writer's check asks for the same six again.
COMPOSED_KEPT = 32


def _composed(keys: tuple[tuple[Any, ...], ...], floor: bool, notion: str, grid: float):
    """The PLDs of the charges with these keys composed in order, left to right
    (``PrivacyLossDistribution.compose``), or None if one is unbounded under ``notion``.

    Remembered, and started from the longest composed prefix remembered: a budget check composes
    the population's charges, then the same charges and the study (their composition and one
    more step), and the check inside the writer's transaction asks for both again. The fold is
    the one without the memo, step for step, so every PLD and epsilon is the same to the bit
    (tests/test_ledger_cache.py). Threads may race on the dict: at worst a composition is made
    twice, never a different one."""
    start, total = 0, None
    for n in range(len(keys), 0, -1):
        known = _COMPOSED.get((floor, notion, grid, keys[:n]), _MISSING)
        if known is not _MISSING:
            start, total = n, known
            break
    spread: list[tuple[Any, ...]] = [(*key, notion, grid) for key in keys[start:]]
    plds = [_floor_pld(*args) if floor else _noise_pld(*args) for args in spread]
    if any(p is None for p in plds):
        return None
    for p in plds:
        total = p if total is None else total.compose(p)  # type: ignore[attr-defined]  # a PLD
    _remember((floor, notion, grid, keys), total)
    return total


_MISSING = object()


def _remember(key: tuple, composed) -> None:
    _COMPOSED[key] = composed
    while len(_COMPOSED) > COMPOSED_KEPT:
        try:
            del _COMPOSED[next(iter(_COMPOSED))]
        except (KeyError, RuntimeError, StopIteration):  # another thread evicted it first
            break


@dataclass(frozen=True)
class Budget:
    """A population's (or a data owner's) limit: every report stays (epsilon, delta)-DP over all
    studies charged, under ``notion``."""

    epsilon: float
    delta: float
    notion: str = "replace-one"
    #: the bound on the composed floors (every study's guarantee with no other honest report:
    #: what a victim keeps when every study is filled with Sybils); None: floors not bounded
    floor_epsilon: float | None = None

    def __post_init__(self) -> None:
        if not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"a budget's epsilon must be positive and finite, got {self.epsilon!r}")
        if self.floor_epsilon is not None and not (self.floor_epsilon > 0 and math.isfinite(self.floor_epsilon)):
            raise ValueError(f"a budget's floor epsilon must be positive and finite, got {self.floor_epsilon!r}")
        if not 0 < self.delta < 1:
            raise ValueError(f"a budget's delta must be in (0, 1), got {self.delta!r}")
        if self.notion not in ("replace-one", "add-remove"):
            raise ValueError(f"a budget's neighbouring notion is replace-one or add-remove, got {self.notion!r}")

    def describe(self) -> str:
        floor = f", floor epsilon = {self.floor_epsilon:g}" if self.floor_epsilon is not None else ""
        epsilon = f"epsilon = {self.epsilon:g}" if self.epsilon < 1e300 else "epsilon unbounded"
        return f"({epsilon}{floor}, delta = {self.delta:g}, {self.notion})"


@dataclass(frozen=True)
class Verdict:
    """Whether one more study fits a budget, with the numbers a refusal names."""

    fits: bool
    spent: Composition  # without the study
    needed: Composition  # with it
    study_epsilon: float  # the study alone, at the budget's delta, in the budget's notion
    #: the same for the floors (None: the budget does not bound them)
    floor_spent: Composition | None = None
    floor_needed: Composition | None = None
    floor_study_epsilon: float | None = None

    def explain(self, budget: Budget, who: str) -> str:
        s, n = self.spent, self.needed
        parts = []
        if n.epsilon > budget.epsilon * (1 + 1e-9):
            parts.append(f"epsilon = {n.epsilon:.4g}, past the budget's {budget.epsilon:g}")
        fn = self.floor_needed
        if budget.floor_epsilon is not None and fn is not None and fn.epsilon > budget.floor_epsilon * (1 + 1e-9):
            parts.append(f"floor epsilon = {fn.epsilon:.4g} (every study filled with Sybils), past the "
                         f"budget's floor {budget.floor_epsilon:g}")
        floor = ""
        if self.floor_spent is not None and self.floor_study_epsilon is not None:
            floor = (f"; their floors compose to {self.floor_spent.epsilon:.4g}, this study's floor is "
                     f"{self.floor_study_epsilon:.4g}")
        return (f"{who} has a budget of {budget.describe()}; its {s.studies} studies have spent "
                f"epsilon = {s.epsilon:.4g} at delta = {budget.delta:g} (naive sum {s.naive_epsilon:.4g}){floor}; "
                f"this study (epsilon = {self.study_epsilon:.4g} alone at that delta) would take it to "
                + (" and ".join(parts) if parts else f"epsilon = {n.epsilon:.4g}"))

    def problem_members(self, budget: Budget, population: str) -> dict:
        """The members of a 409 ``budget-exceeded`` problem (docs/protocol.md section 8), the same
        whoever refuses: a share server at provisioning, or the analyzer when a server's published
        ledger says that server would (non-finite epsilons, an unbounded study, are null)."""
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        floor = self.floor_needed is not None
        return {"population": population, "neighbouring": budget.notion,
                "budget_epsilon": budget.epsilon, "budget_delta": budget.delta,
                "spent_epsilon": finite(self.spent.epsilon), "studies_charged": self.spent.studies,
                "needed_epsilon": finite(self.needed.epsilon), "study_epsilon": finite(self.study_epsilon),
                "budget_floor_epsilon": budget.floor_epsilon,
                "spent_floor_epsilon": finite(self.floor_spent.epsilon) if floor and self.floor_spent else None,
                "needed_floor_epsilon": finite(self.floor_needed.epsilon) if floor else None,  # type: ignore[union-attr]  # set when floor
                "study_floor_epsilon": (finite(self.floor_study_epsilon)
                                        if floor and self.floor_study_epsilon is not None else None)}


def check(charges: list[Charge], study: Charge, budget: Budget) -> Verdict:
    """Would ``study`` keep the ledger of ``charges`` within ``budget``, both its certified
    guarantees and (if the budget bounds them) its floors? A study already charged (same id)
    costs nothing more."""
    charges = list(charges)
    bound_floor = budget.floor_epsilon is not None
    spent = compose(charges, budget.notion, budget.delta)
    floor_spent = compose(charges, budget.notion, budget.delta, floor=True) if bound_floor else None
    if any(c.study_id == study.study_id for c in charges):
        return Verdict(True, spent, spent, 0.0, floor_spent, floor_spent, 0.0 if bound_floor else None)
    needed = compose(charges + [study], budget.notion, budget.delta)
    alone = compose([study], budget.notion, budget.delta).epsilon
    fits = needed.epsilon <= budget.epsilon * (1 + 1e-9)
    floor_needed = floor_alone = None
    if bound_floor:
        floor_needed = compose(charges + [study], budget.notion, budget.delta, floor=True)
        floor_alone = compose([study], budget.notion, budget.delta, floor=True).epsilon
        fits = fits and floor_needed.epsilon <= budget.floor_epsilon * (1 + 1e-9)  # type: ignore[operator]  # bound_floor
    return Verdict(fits, spent, needed, alone, floor_spent, floor_needed, floor_alone)
