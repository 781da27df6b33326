"""``dpsketch tokens``: a share server operator's upload tokens, from the shell or Python.

Upload tokens are how an organisation bounds who reports to its server: each token is good for
its quota of new reports (one by default), so Sybil reports cost the adversary a token each,
and only this server's operator can issue them (not the analyst: docs/trust.md). Hand each
data owner (or each enrolled device) its tokens from every server; ``dpsketch submit --token
t1,t2,t3`` or ``Client(urls, token=[t1, t2, t3])`` then uploads with them.

``issue --output token`` prints the new tokens alone, one per line, so that a shell captures them:
``TOKEN1=$(dpsketch tokens --server URL issue STUDY_ID --output token)``.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
from typing import Any

import httpx

from dpsketch.plain_errors import unreachable
from dpsketch.protocol.messages import IssuedUploadTokens, UploadTokenList
from dpsketch.protocol.problems import ProblemError


class ServerAdmin:
    """The operator's calls to one share server (bearer: its operator token)."""

    def __init__(self, url: str, operator_token: str, *, verify: bool | ssl.SSLContext = True,
                 timeout: float = 120.0):
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout, verify=verify,
                                 headers={"Authorization": f"Bearer {operator_token}"})

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "ServerAdmin":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self.http.request(method, path, **kwargs)
        if r.status_code >= 400:
            raise ProblemError.from_http(r.status_code, r.content)
        return r.json()

    def issue_upload_tokens(self, study_id: str, count: int = 1, quota: int | None = 1,
                            party: str | None = None, population: str | None = None) -> IssuedUploadTokens:
        """``count`` new tokens, each good for ``quota`` new reports (None: no limit); a study
        with parties issues them to one ``party``. Their reports are charged to ``population``
        (the server's default population if None); the first token of a population for a study
        charges the study to it, or is refused past its budget (docs/ledger.md)."""
        ask: dict[str, Any] = {"count": count, "quota": quota}
        if party is not None:
            ask["party"] = party
        if population is not None:
            ask["population"] = population
        return IssuedUploadTokens.model_validate(self._call(
            "POST", f"/v1/studies/{study_id}/upload-tokens", json=ask))

    def upload_tokens(self, study_id: str) -> UploadTokenList:
        return UploadTokenList.model_validate(self._call("GET", f"/v1/studies/{study_id}/upload-tokens"))

    def revoke_upload_token(self, study_id: str, token_id: str) -> UploadTokenList:
        return UploadTokenList.model_validate(
            self._call("DELETE", f"/v1/studies/{study_id}/upload-tokens/{token_id}"))

    def drop_study(self, study_id: str) -> dict[str, Any]:
        """Drop an open study: shares deleted, never released, population charges refunded."""
        return self._call("DELETE", f"/v1/studies/{study_id}")


def issue_for_data_owner(servers: list[tuple[str, str]], study_id: str, quota: int | None,
                         verify: bool | ssl.SSLContext = True, party: str | None = None,
                         population: str | None = None) -> list[str]:
    """One token per server (url, operator token) for one data owner with ``quota`` rows (or one
    party of a study with parties): what each organisation hands a data owner it enrolled.
    Returns them in server order."""
    out = []
    for url, operator_token in servers:
        with ServerAdmin(url, operator_token, verify=verify) as admin:
            out.append(admin.issue_upload_tokens(study_id, 1, quota, party, population).token)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpsketch tokens",
        description="Issue, list and revoke a study's upload tokens on one share server (operator "
        "token: $DPSKETCH_OPERATOR_TOKEN). A token is good for its quota of new reports; retries "
        "of the same reports cost nothing. Tokens are printed once and never stored in clear.")
    p.add_argument("--server", required=True, help="the share server's base URL")
    p.add_argument("--ca-file", default=os.environ.get("DPSKETCH_CA_FILE"), metavar="PEM",
                   help="verify the server's TLS certificate against this CA (default: $DPSKETCH_CA_FILE)")
    sub = p.add_subparsers(dest="command", required=True)
    issue = sub.add_parser("issue", help="issue upload tokens for a study")
    issue.add_argument("study_id", help="the study (64 hex characters)")
    issue.add_argument("--count", type=int, default=1, help="how many tokens (default: 1)")
    quota = issue.add_mutually_exclusive_group()
    quota.add_argument("--quota", type=int, default=1,
                       help="new reports each token may add (default: 1; a data owner with m rows gets m)")
    quota.add_argument("--unlimited", action="store_true", help="tokens without a quota")
    issue.add_argument("--party", metavar="NAME",
                       help="a study with parties: the party whose blocks the tokens upload (required there)")
    issue.add_argument("--output", choices=("json", "token"), default="json",
                       help="json: the server's answer (token ids, quotas and the tokens); token: the "
                            "tokens alone, one per line, for the shell to capture: "
                            "TOKEN=$(dpsketch tokens ... issue STUDY_ID --output token) (default: json)")
    issue.add_argument("--population", metavar="ID",
                       help="the population (yours, the operator's) the tokens' reports are charged to, "
                       "whatever the study says; the first token of a population for a study charges "
                       "the study to its privacy budget, refused past it (default: the server's "
                       "default population; docs/ledger.md)")
    ls = sub.add_parser("list", help="list a study's tokens (ids, quotas, use; never the tokens)")
    ls.add_argument("study_id", help="the study (64 hex characters)")
    rv = sub.add_parser("revoke", help="revoke one token at once")
    rv.add_argument("study_id", help="the study (64 hex characters)")
    rv.add_argument("token_id", help="the token's id, as issue and list show it (not the token)")
    drop = sub.add_parser("drop-study", help="drop an open study: its shares are deleted, it never "
                          "releases, its population charges are refunded (logged as an audit record)")
    drop.add_argument("study_id", help="the study (64 hex characters)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = os.environ.get("DPSKETCH_OPERATOR_TOKEN", "").strip()
    if not token:
        print("dpsketch tokens: set DPSKETCH_OPERATOR_TOKEN to the server's operator token", file=sys.stderr)
        return 2
    verify: bool | ssl.SSLContext = ssl.create_default_context(cafile=args.ca_file) if args.ca_file else True
    try:
        with ServerAdmin(args.server, token, verify=verify) as admin:
            if args.command == "issue":
                out: Any = admin.issue_upload_tokens(args.study_id, args.count,
                                                     None if args.unlimited else args.quota, args.party,
                                                     args.population)
            elif args.command == "list":
                out = admin.upload_tokens(args.study_id)
            elif args.command == "drop-study":
                print(json.dumps(admin.drop_study(args.study_id), indent=2))
                return 0
            else:
                out = admin.revoke_upload_token(args.study_id, args.token_id)
    except ProblemError as exc:
        print(f"dpsketch tokens: {exc}", file=sys.stderr)
        return 1
    except httpx.TransportError as exc:
        print(f"dpsketch tokens: {unreachable(args.server, exc)}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"dpsketch tokens: {args.server}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.command == "issue" and args.output == "token":
        print("\n".join(out.tokens))
        return 0
    print(json.dumps(out.model_dump(mode="json"), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
