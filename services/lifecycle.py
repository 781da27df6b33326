"""What ends an open study without a release, and which population each upload token charges.

Two tables beside the original schema (created at start in both stores, so no file or database
made before them needs converting):

* ``token_populations``: the population an upload token was issued for (docs/ledger.md). A
  report is charged to its token's population, whatever the study says; the study itself was
  charged to that population when the population's first token for it was issued.
* ``closures``: a study that ended without a release, why and when. ``expired``: it was not
  committed within the server's ``study_expiry_s`` of being provisioned; ``dropped``: the
  operator dropped it (DELETE /v1/studies/{id}). Either way its shares are deleted at once, it
  takes no more reports, it can never commit, its running totals are freed and its population
  charges are refunded: nothing about its reports was ever released, so nothing was spent (a
  committed study is never closed this way; its charges stay for good).

Why expiry and drop exist: an analyst could otherwise open studies that never fill, each holding
memory and population budget until an operator restarted the server (issue 41). Expiry does not
depend on the report count (a study that expires or not would otherwise tell an outsider whether
it reached min_reports), only on the time since provisioning, which is public.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_POPULATIONS_SCHEMA = """
CREATE TABLE IF NOT EXISTS token_populations (
    study      BIGINT NOT NULL,
    digest     BLOB NOT NULL,
    population TEXT NOT NULL,
    PRIMARY KEY (study, digest)
)"""

CLOSURES_SCHEMA = """
CREATE TABLE IF NOT EXISTS closures (
    study      BIGINT PRIMARY KEY,
    reason     TEXT NOT NULL CHECK (reason IN ('expired', 'dropped')),
    closed_at  REAL NOT NULL,
    reports    BIGINT NOT NULL,
    refunded   TEXT NOT NULL
)"""

SCHEMAS = (TOKEN_POPULATIONS_SCHEMA, CLOSURES_SCHEMA)


@dataclass(frozen=True)
class Closure:
    """Why and when an open study ended without a release."""

    reason: str  # "expired" or "dropped"
    closed_at: float
    reports: int  # reports it held (and whose shares were deleted)
    refunded: str  # the populations whose charge was refunded, comma-separated
