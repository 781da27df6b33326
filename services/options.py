"""Command-line flags (and environment fallbacks) for the server's privacy policy, token file and
retention. Kept out of ``__main__`` so that file only wires them in."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def _env(name: str, default: Any, kind):
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return kind(value)
    except ValueError:
        raise SystemExit(f"dpsketch server: ${name} = {value!r} is not a valid {kind.__name__}") from None


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
    g.add_argument("--tokens-file", type=Path, default=_env("DPSKETCH_TOKENS_FILE", None, Path),
                   help='JSON {"operator": [...], "analyst": [...]} of more tokens ("sha256:<hex>" digests or '
                        "plain tokens), re-read when it changes or on SIGHUP ($DPSKETCH_TOKENS_FILE)")
    g.add_argument("--retention-after-commit-seconds", dest="retention_after_commit_s", type=float,
                   default=_env("DPSKETCH_RETENTION_AFTER_COMMIT_SECONDS", None, float),
                   help="delete a committed study's individual shares this long after the commit "
                        "(0: at once; $DPSKETCH_RETENTION_AFTER_COMMIT_SECONDS; default: keep them)")


def policy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Settings keyword arguments of :func:`add_policy_arguments`'s flags."""
    return {name: getattr(args, name) for name in (
        "max_epsilon", "max_delta", "min_reports_floor", "min_lambda_star", "tokens_file",
        "retention_after_commit_s") if hasattr(args, name)}
