"""Configuration of one share server, gathered in one immutable object.

The command line (``services.__main__``) builds it from flags and environment; tests build it
directly. Keeping it a plain dataclass means ``create_app(settings)`` needs no globals, so one
test process can run several independent servers side by side.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dpsketch.protocol.study import DEFAULT_MAX_STUDY_BYTES, SERVER_ID_PATTERN

MIB = 1 << 20


def _env_float(name: str, default: float | None) -> float | None:
    """A number from the environment ('none' or empty: ``default``); ValueError naming it."""
    value = os.environ.get(name, "").strip()
    if not value or value.lower() == "none":
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"${name} = {value!r} is not a number") from None


def _env_origins(name: str) -> tuple[str, ...]:
    """Comma-separated web origins from the environment (empty: none)."""
    from dpsketch.origins import split_origins

    return split_origins(os.environ.get(name, ""))


def _env_budget(name: str, default: float) -> float | None:
    """A budget from the environment: unset or empty gives ``default`` (budgets are on by
    default); "none" switches it off explicitly (logged as a warning at startup)."""
    value = os.environ.get(name, "").strip()
    if value.lower() == "none":
        return None
    return _env_float(name, default)


#: The budget every population has unless the operator says otherwise (docs/ledger.md): the
#: certified guarantees of its studies compose to at most DEFAULT_POPULATION_EPSILON and their
#: floors (no other honest report: every study filled with Sybils) to at most
#: DEFAULT_POPULATION_FLOOR_EPSILON, both at DEFAULT_POPULATION_DELTA. With design()'s defaults
#: (epsilon 1, floor 4, signed) that admits eight studies per population (floors 11.58; a ninth
#: would take them to 12.34), unsigned ones six (11.35).
DEFAULT_POPULATION_EPSILON = 4.0
DEFAULT_POPULATION_FLOOR_EPSILON = 12.0
DEFAULT_POPULATION_DELTA = 1e-6
#: The population of reports whose upload token names none, and of token-less uploads.
DEFAULT_POPULATION = "default"
#: An open study not committed this long after it was provisioned expires (a week).
DEFAULT_STUDY_EXPIRY_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class Settings:
    server_id: str
    #: The store: a SQLite file (``db_path``, the default) or a PostgreSQL database (``db_url``,
    #: ``postgresql://user@host:port/dbname``; services/pg.py). Exactly one is given; the
    #: command line's ``--db`` / $DPSKETCH_DB fills in whichever its value is.
    db_path: Path | None = None
    db_url: str | None = None
    #: The environment's tokens (DPSKETCH_OPERATOR_TOKEN / DPSKETCH_ANALYST_TOKEN). Only their
    #: SHA-256 digests are kept: ``__post_init__`` moves them to ``*_digests`` and blanks these.
    operator_token: str = ""
    analyst_token: str = ""
    #: JSON ``{"operator": [...], "analyst": [...]}`` of more tokens (``sha256:<hex>`` digests or
    #: plain tokens, hashed on load), re-read when it changes or on SIGHUP (services/auth.py).
    tokens_file: Path | None = None
    #: Privacy policy: provisioning refuses (422 invalid-study) a study outside it (policy.py).
    max_epsilon: float = 10.0
    max_delta: float = 1e-5
    min_reports_floor: int = 50
    min_lambda_star: float = 1.0
    #: The floor (docs/trust.md): refuse a study unless every report stays (this, delta)-DP with
    #: no other honest report and every other server colluding; None accepts any study.
    max_floor_epsilon: float | None = 4.0
    #: Privacy budget per population (docs/ledger.md). Populations belong to the operator: an
    #: upload token is issued for one (``default_population`` unless the operator names one) and
    #: a study is charged to a population when its first token for that population is issued
    #: (open uploads: to ``default_population`` at provisioning); that is refused (409
    #: budget-exceeded) if the population's composed guarantees would pass population_epsilon or
    #: its composed floors population_floor_epsilon, both at population_delta under
    #: population_neighbouring. None (the environment's "none"): that bound is off, the ledger is
    #: still kept. Defaults from $DPSKETCH_POPULATION_EPSILON, $DPSKETCH_POPULATION_FLOOR_EPSILON,
    #: $DPSKETCH_POPULATION_DELTA, $DPSKETCH_POPULATION_NEIGHBOURING, $DPSKETCH_DEFAULT_POPULATION.
    population_epsilon: float | None = field(
        default_factory=lambda: _env_budget("DPSKETCH_POPULATION_EPSILON", DEFAULT_POPULATION_EPSILON))
    population_floor_epsilon: float | None = field(
        default_factory=lambda: _env_budget("DPSKETCH_POPULATION_FLOOR_EPSILON", DEFAULT_POPULATION_FLOOR_EPSILON))
    population_delta: float = field(
        default_factory=lambda: _env_float("DPSKETCH_POPULATION_DELTA", DEFAULT_POPULATION_DELTA))
    default_population: str = field(
        default_factory=lambda: os.environ.get("DPSKETCH_DEFAULT_POPULATION", "").strip() or DEFAULT_POPULATION)
    #: An open study not committed this many seconds after it was provisioned expires: its
    #: shares are deleted, it takes no more reports, never releases, and its population charges
    #: are refunded (nothing was released). None: studies never expire. $DPSKETCH_STUDY_EXPIRY.
    study_expiry_s: float | None = field(
        default_factory=lambda: _env_budget("DPSKETCH_STUDY_EXPIRY", DEFAULT_STUDY_EXPIRY_S))
    #: How many studies may be open (neither committed, expired nor dropped) at once: each costs
    #: memory for its parameters even before a report arrives. $DPSKETCH_MAX_OPEN_STUDIES.
    max_open_studies: int = field(
        default_factory=lambda: int(_env_float("DPSKETCH_MAX_OPEN_STUDIES", 1000)))
    population_neighbouring: str = field(
        default_factory=lambda: os.environ.get("DPSKETCH_POPULATION_NEIGHBOURING", "").strip() or "replace-one")
    #: Web pages allowed to call this server from a browser (CORS): exact origins such as
    #: "https://survey.example.org", or "*" for any page. Empty (the default): none, and a
    #: browser refuses a page on another origin. Upload tokens still gate every upload; no
    #: cookies are used, so no credentials are allowed. $DPSKETCH_CORS_ORIGINS (comma-separated).
    cors_origins: tuple[str, ...] = field(default_factory=lambda: _env_origins("DPSKETCH_CORS_ORIGINS"))
    #: Batch rule: refuse a commit whose inclusion set leaves out more than this fraction of the
    #: reports this server acknowledged (an analyst cannot pick a victim and its own reports).
    max_excluded_fraction: float = 0.1
    #: "tokens": every study takes uploads only with upload tokens this server's operator issued
    #: (each good for its quota of reports); "open": a study takes uploads without a token until
    #: its first upload token is issued.
    upload_auth: str = "tokens"
    #: Whether this server takes relayed uploads (POST /v1/studies/{id}/relayed, docs/relay.md):
    #: many devices' sealed batches in one request, each with its upload token's MAC. A reader of
    #: this server's store (its token digests) could make such uploads here (docs/trust.md), so an
    #: operator that never uses a relay may turn the route off.
    relayed_uploads: bool = True
    #: Storage policy: refuse a study whose max_reports shares could take more than this many
    #: bytes (Study.max_storage_bytes); None accepts any size the schema allows.
    max_study_bytes: int | None = DEFAULT_MAX_STUDY_BYTES
    #: Memory policy: one study's running totals (k x width aggregate and k x k S S^T, 8 bytes a
    #: cell) may take at most this; all open studies' totals plus their report index (about
    #: state.INDEX_BYTES_PER_REPORT a report) at most ``memory_budget``.
    max_study_memory: int = 256 << 20
    memory_budget: int = 4 << 30
    #: Retention: delete a committed study's individual shares this many seconds after its
    #: commit (0 = right away); None keeps them. The aggregate and the commit stay.
    retention_after_commit_s: float | None = None
    #: How often the retention sweeper looks for studies due (seconds).
    retention_sweep_s: float = 60.0
    #: Largest request body accepted (413 beyond). A 10k-row batch at d = 100 is about 8 MiB.
    max_body_bytes: int = 64 * MIB
    #: How long a write waits for a lock held by someone else before answering 503 (SQLite's busy
    #: timeout; PostgreSQL's lock_timeout, and how long a read waits for a pooled connection).
    busy_timeout_s: float = 5.0
    #: A PostgreSQL store that cannot be reached at start (not up yet, as when a whole stack
    #: starts at once) is retried for this many seconds before the server gives up; 0 gives up at
    #: once. ``dpsketch server --db-wait`` defaults to 60. A database that answers with a refusal
    #: (wrong password, no such database) is not retried: waiting would not change it.
    db_wait_s: float = 0.0
    #: Upper bounds on one group commit: more rows or requests wait for the next transaction.
    max_group_rows: int = 200_000
    max_group_jobs: int = 1024
    #: Requests waiting for the writer beyond this are refused with 503 (back-pressure).
    max_queued_jobs: int = 4096
    #: ... and so are uploads beyond this many share bytes waiting (bounds memory under load).
    max_queued_bytes: int = 1024 * MIB
    #: Resource policy: this server keeps a k x k int64 matrix and a k x d aggregate per study
    #: in memory, so it refuses (422 invalid-study) studies that would not fit.
    max_k: int = 4096
    max_aggregate_cells: int = 1 << 24
    #: Rows read per chunk when rebuilding a study's running totals from the database.
    load_chunk_rows: int = 50_000
    #: Load every open study's running totals in a background thread at startup.
    warm_start: bool = True
    #: Replicas sharing a PostgreSQL store: how often a replica re-reads the HPKE keys, so a
    #: rotation or retirement done through another replica reaches it.
    key_refresh_s: float = 2.0
    #: Where a validity study's query answer is kept for its decision (services/verify_cache.py):
    #: "auto" (the default) is ``<SQLite file>.verify-cache`` beside a SQLite store, and the
    #: system's temporary directory's ``dpsketch-verify-cache-<hash of the URL>`` for a PostgreSQL
    #: one; "off" keeps none (every decision recomputes its shares); any other text is that
    #: directory. Resolved to a Path or None by ``__post_init__``. $DPSKETCH_VERIFY_CACHE_DIR,
    #: --verify-cache-dir.
    verify_cache_dir: Path | str | None = field(
        default_factory=lambda: os.environ.get("DPSKETCH_VERIFY_CACHE_DIR", "").strip() or "auto")
    #: SHA-256 digests (32 bytes) of the environment's tokens; filled in by ``__post_init__``.
    operator_digests: tuple[bytes, ...] = field(default=(), repr=False)
    analyst_digests: tuple[bytes, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        from .auth import digest_of, warn_if_short
        from .backend import is_url

        if self.db_url is None and is_url(self.db_path):  # a URL given where a path was expected
            object.__setattr__(self, "db_url", self.db_path)
            object.__setattr__(self, "db_path", None)
        if (self.db_path is None) == (self.db_url is None):
            raise ValueError("give the store as exactly one of db_path (a SQLite file) or db_url "
                             "(postgresql://...)")
        if self.db_url is not None and not is_url(self.db_url):
            raise ValueError(f"db_url must start with postgresql:// (got {self.db_url[:20]!r}...)")
        if self.db_path is not None:
            object.__setattr__(self, "db_path", Path(self.db_path))
        if not isinstance(self.verify_cache_dir, Path):
            from .verify_cache import resolve

            object.__setattr__(self, "verify_cache_dir", resolve(self.verify_cache_dir, self.db_path, self.db_url))
        if not re.fullmatch(SERVER_ID_PATTERN, self.server_id):
            raise ValueError(f"server id {self.server_id!r} must match {SERVER_ID_PATTERN}")
        if self.operator_token and self.operator_token == self.analyst_token:
            raise ValueError("the operator and analyst tokens must differ (they grant different roles)")
        for role in ("operator", "analyst"):
            token = getattr(self, f"{role}_token")
            if token:
                warn_if_short(role, token)
                object.__setattr__(self, f"{role}_digests",
                                   getattr(self, f"{role}_digests") + (digest_of(token),))
                object.__setattr__(self, f"{role}_token", "")  # never keep the plain token
        if self.tokens_file is not None:  # fail fast on an unusable file (ValueError naming it)
            from .auth import TokenRegistry

            TokenRegistry({"operator": self.operator_digests, "analyst": self.analyst_digests}, self.tokens_file)
        elif not (self.operator_digests and self.analyst_digests):
            raise ValueError("both an operator token and an analyst token are required")
        if set(self.operator_digests) & set(self.analyst_digests):
            raise ValueError("the operator and analyst tokens must differ (they grant different roles)")
        if not 0 < self.max_epsilon <= 100:
            raise ValueError("max_epsilon must be in (0, 100]")
        if not 0 < self.max_delta < 1:
            raise ValueError("max_delta must be in (0, 1)")
        if self.min_reports_floor < 1:
            raise ValueError("min_reports_floor must be at least 1")
        if self.min_lambda_star < 1:
            raise ValueError("min_lambda_star must be at least 1 (every study has lambda_star >= 1)")
        if self.retention_after_commit_s is not None and self.retention_after_commit_s < 0:
            raise ValueError("retention_after_commit_s must be >= 0 (or None to keep shares)")
        if self.retention_sweep_s <= 0:
            raise ValueError("retention_sweep_s must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        from dpsketch.origins import check_origins

        object.__setattr__(self, "cors_origins", check_origins(self.cors_origins, "$DPSKETCH_CORS_ORIGINS"))
        if self.max_floor_epsilon is not None and not 0 < self.max_floor_epsilon <= 100:
            raise ValueError("max_floor_epsilon must be in (0, 100] (or None: no floor required)")
        if self.population_epsilon is not None and not 0 < self.population_epsilon <= 1e6:
            raise ValueError("population_epsilon must be in (0, 1e6] (or None: no population budget)")
        if self.population_floor_epsilon is not None and not 0 < self.population_floor_epsilon <= 1e6:
            raise ValueError("population_floor_epsilon must be in (0, 1e6] (or None: floors not bounded)")
        from dpsketch.protocol.study import POPULATION_PATTERN

        if not re.fullmatch(POPULATION_PATTERN, self.default_population):
            raise ValueError(f"default_population {self.default_population!r} must match {POPULATION_PATTERN}")
        if self.study_expiry_s is not None and not self.study_expiry_s > 0:
            raise ValueError("study_expiry_s must be > 0 (or None: studies never expire)")
        if self.max_open_studies < 1:
            raise ValueError("max_open_studies must be at least 1")
        if not 0 < self.population_delta < 1:
            raise ValueError("population_delta must be in (0, 1)")
        if self.population_neighbouring not in ("replace-one", "add-remove"):
            raise ValueError("population_neighbouring must be 'replace-one' or 'add-remove'")
        if not 0 <= self.max_excluded_fraction <= 1:
            raise ValueError("max_excluded_fraction must be in [0, 1]")
        if self.upload_auth not in ("tokens", "open"):
            raise ValueError("upload_auth must be 'tokens' or 'open'")
        if self.max_study_memory < 1 or self.memory_budget < self.max_study_memory:
            raise ValueError("need max_study_memory >= 1 and memory_budget >= max_study_memory")

    @property
    def store_location(self) -> str:
        """The store for logs and messages: the file, or the URL without its password."""
        if self.db_url is not None:
            from .backend import redact

            return redact(self.db_url)
        return str(self.db_path)
