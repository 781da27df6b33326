"""Command-line flags (and environment fallbacks) for the server's privacy policy, token file and
retention. Kept out of ``__main__`` so that file only wires them in."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from dpsketch.origins import split_origins
from dpsketch.protocol.study import DEFAULT_MAX_STUDY_BYTES

from .settings import (DEFAULT_POPULATION, DEFAULT_POPULATION_EPSILON, DEFAULT_POPULATION_FLOOR_EPSILON,
                       DEFAULT_STUDY_EXPIRY_S)
from .state import INDEX_BYTES_PER_REPORT


def _env(name: str, default: Any, kind):
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return kind(value)
    except ValueError:
        raise SystemExit(f"dpsketch server: ${name} = {value!r} is not a valid {kind.__name__}") from None


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """``"200000000"``, ``"512M"``, ``"50G"``, ``"2TiB"``: binary units, case-insensitive."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = value[-1:] if value[-1:] in _SIZE_UNITS else ""
    number = value[: len(value) - len(unit)].strip()
    try:
        size = float(number) * _SIZE_UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 500000000, 512M, 50G, 2T)") from None
    if not size >= 1 or size > 1 << 62:
        raise ValueError(f"a size must be between 1 byte and 4 EiB, got {text!r}")
    return int(size)


byte_size.__name__ = "size"  # argparse's "invalid size value" message


def byte_size_or_none(text: str) -> int | None:
    """A size, or ``none`` / ``unlimited`` for no limit."""
    if text.strip().lower() in ("none", "unlimited"):
        return None
    return byte_size(text)


byte_size_or_none.__name__ = "size"


def epsilon_or_none(text: str) -> float | None:
    """An epsilon, or ``none`` for no requirement."""
    if text.strip().lower() == "none":
        return None
    return float(text)


epsilon_or_none.__name__ = "epsilon"


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "privacy policy, tokens and retention",
        "Studies outside the policy are refused at provisioning (422 invalid-study naming the rule); "
        "GET /v1/info publishes it. Each flag also reads the environment variable shown.")
    g.add_argument("--max-epsilon", type=float, default=_env("DPSKETCH_MAX_EPSILON", 10.0, float),
                   help="largest study epsilon accepted ($DPSKETCH_MAX_EPSILON; default: %(default)s)")
    g.add_argument("--max-delta", type=float, default=_env("DPSKETCH_MAX_DELTA", 1e-5, float),
                   help="largest study delta accepted ($DPSKETCH_MAX_DELTA; default: %(default)s)")
    g.add_argument("--min-reports", dest="min_reports_floor", type=int,
                   default=_env("DPSKETCH_MIN_REPORTS", 50, int),
                   help="smallest study min_reports accepted ($DPSKETCH_MIN_REPORTS; default: %(default)s)")
    g.add_argument("--min-lambda-star", type=float, default=_env("DPSKETCH_MIN_LAMBDA_STAR", 1.0, float),
                   help="smallest study lambda_star accepted ($DPSKETCH_MIN_LAMBDA_STAR; default: %(default)s)")
    g.add_argument("--max-floor-epsilon", type=epsilon_or_none,
                   default=_env("DPSKETCH_MAX_FLOOR_EPSILON", 4.0, epsilon_or_none),
                   help="the floor: refuse a study unless each report stays (this, delta)-DP with no "
                        "other honest report (Sybils) and every other server colluding, from its own "
                        "noise and this server's; 'none' accepts studies without a floor "
                        "($DPSKETCH_MAX_FLOOR_EPSILON; default: %(default)s)")
    g.add_argument("--max-excluded-fraction", type=float,
                   default=_env("DPSKETCH_MAX_EXCLUDED_FRACTION", 0.1, float),
                   help="batch rule: refuse a commit whose inclusion set leaves out more than this "
                        "fraction of the reports this server holds, so an analyst cannot release a "
                        "victim among reports of its own choosing ($DPSKETCH_MAX_EXCLUDED_FRACTION; "
                        "default: %(default)s)")
    g.add_argument("--upload-auth", choices=("tokens", "open"),
                   default=_env("DPSKETCH_UPLOAD_AUTH", "tokens", str),
                   help="tokens: studies take uploads only with upload tokens this server's operator "
                        "issues (POST /v1/studies/{id}/upload-tokens, each good for its quota of "
                        "reports), which bounds Sybil reports; open: anyone may upload until a study's "
                        "first token is issued ($DPSKETCH_UPLOAD_AUTH; default: %(default)s)")
    g.add_argument("--relayed-uploads", choices=("on", "off"),
                   default=_env("DPSKETCH_RELAYED_UPLOADS", "on", str),
                   help="on: take relayed uploads (many devices' sealed batches in one request from a "
                        "relay, each with its upload token's MAC: docs/relay.md); off: refuse them "
                        "(403), for a server whose devices never use a relay, since a reader of this "
                        "server's store could make such uploads here (docs/trust.md) "
                        "($DPSKETCH_RELAYED_UPLOADS; default: %(default)s)")
    g.add_argument("--max-study-bytes", type=byte_size_or_none,
                   default=_env("DPSKETCH_MAX_STUDY_BYTES", DEFAULT_MAX_STUDY_BYTES, byte_size_or_none),
                   help="largest storage a study may claim: max_reports x (16 + 8 x values per "
                        "share) bytes, e.g. 50G, or 'none'; gram studies share d^2/2 values per "
                        "report ($DPSKETCH_MAX_STUDY_BYTES; default: 32G)")
    g.add_argument("--max-study-memory", type=byte_size,
                   default=_env("DPSKETCH_MAX_STUDY_MEMORY", 256 << 20, byte_size),
                   help="largest running totals one study may keep in memory: 8 k (width + k) bytes "
                        "($DPSKETCH_MAX_STUDY_MEMORY; default: 256M)")
    g.add_argument("--memory-budget", type=byte_size,
                   default=_env("DPSKETCH_MEMORY_BUDGET", 4 << 30, byte_size),
                   help="memory for all open studies: the rows of their running totals their reports "
                        f"have written into plus about {INDEX_BYTES_PER_REPORT} bytes per held report "
                        "(charged as reports arrive, not at provisioning); uploads beyond it are refused "
                        "($DPSKETCH_MEMORY_BUDGET; default: 4G)")
    g.add_argument("--population-epsilon", type=epsilon_or_none,
                   default=_env("DPSKETCH_POPULATION_EPSILON", DEFAULT_POPULATION_EPSILON, epsilon_or_none),
                   help="privacy budget of every population (docs/ledger.md): refuse to charge a study "
                        "to a population (its first upload token of it) if the studies' certified "
                        "guarantees would compose past this epsilon; 'none': no such bound "
                        "($DPSKETCH_POPULATION_EPSILON; default: %(default)s)")
    g.add_argument("--population-floor-epsilon", type=epsilon_or_none,
                   default=_env("DPSKETCH_POPULATION_FLOOR_EPSILON", DEFAULT_POPULATION_FLOOR_EPSILON,
                                epsilon_or_none),
                   help="... or if their floors (each study's guarantee with no other honest report: "
                        "what a report keeps when every study is filled with Sybils) would compose past "
                        "this epsilon; 'none': no such bound ($DPSKETCH_POPULATION_FLOOR_EPSILON; "
                        "default: %(default)s)")
    g.add_argument("--default-population", default=_env("DPSKETCH_DEFAULT_POPULATION", DEFAULT_POPULATION, str),
                   help="the population of upload tokens issued without one, and of uploads without a "
                        "token (--upload-auth open) ($DPSKETCH_DEFAULT_POPULATION; default: %(default)s)")
    g.add_argument("--study-expiry-seconds", dest="study_expiry_s", type=epsilon_or_none,
                   default=_env("DPSKETCH_STUDY_EXPIRY", DEFAULT_STUDY_EXPIRY_S, epsilon_or_none),
                   help="a study not committed this long after it was provisioned expires: its shares "
                        "are deleted, it never releases, its population charges are refunded; 'none': "
                        "never ($DPSKETCH_STUDY_EXPIRY; default: %(default)s, a week)")
    g.add_argument("--max-open-studies", type=int, default=_env("DPSKETCH_MAX_OPEN_STUDIES", 1000, int),
                   help="most studies open at once; provisioning more is refused "
                        "($DPSKETCH_MAX_OPEN_STUDIES; default: %(default)s)")
    g.add_argument("--cors-origins", type=split_origins, default=_env("DPSKETCH_CORS_ORIGINS", (), split_origins),
                   metavar="ORIGIN,...",
                   help="web pages allowed to call this server from a browser (CORS), e.g. "
                        "https://survey.example.org, comma-separated, or '*' for any page; upload "
                        "tokens still gate uploads ($DPSKETCH_CORS_ORIGINS; default: none)")
    g.add_argument("--tokens-file", type=Path, default=_env("DPSKETCH_TOKENS_FILE", None, Path),
                   help='JSON {"operator": [...], "analyst": [...]} of more tokens ("sha256:<hex>" digests or '
                        "plain tokens), re-read when it changes or on SIGHUP ($DPSKETCH_TOKENS_FILE)")
    g.add_argument("--retention-after-commit-seconds", dest="retention_after_commit_s", type=float,
                   default=_env("DPSKETCH_RETENTION_AFTER_COMMIT_SECONDS", None, float),
                   help="delete a committed study's individual shares this long after the commit "
                        "(0: at once; $DPSKETCH_RETENTION_AFTER_COMMIT_SECONDS; default: keep them)")


def policy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Settings keyword arguments of :func:`add_policy_arguments`'s flags."""
    relayed = {"relayed_uploads": args.relayed_uploads == "on"} if hasattr(args, "relayed_uploads") else {}
    return relayed | {name: getattr(args, name) for name in (
        "max_epsilon", "max_delta", "min_reports_floor", "min_lambda_star", "max_floor_epsilon",
        "max_excluded_fraction", "upload_auth", "max_study_bytes", "max_study_memory", "memory_budget",
        "tokens_file", "retention_after_commit_s", "population_epsilon", "population_floor_epsilon",
        "default_population", "study_expiry_s", "max_open_studies", "cors_origins") if hasattr(args, name)}
