"""The error catalogue: one problem type per thing a client can get wrong (docs/protocol.md).

Every dpsketch service answers errors as ``application/problem+json`` (RFC 9457) with a stable
``type`` of the form ``urn:dpsketch:problem:<slug>``; the SDK raises :class:`ProblemError` with
the same slug, so callers can branch on it.
"""

from __future__ import annotations

from typing import Any

#: slug -> (HTTP status, title)
CATALOGUE: dict[str, tuple[int, str]] = {
    "malformed-body": (400, "The request body could not be parsed"),
    "malformed-request": (400, "The request is not valid HTTP/1.1"),
    "unauthorized": (401, "A valid bearer token is required"),
    "forbidden": (403, "This token may not do that"),
    "origin-not-allowed": (403, "This server does not take requests from that web page's origin"),
    "not-found": (404, "No such resource"),
    "unknown-study": (404, "No such study on this server"),
    "method-not-allowed": (405, "Method not allowed"),
    "study-mismatch": (409, "A different study is already provisioned under this id"),
    "report-conflict": (409, "A report with this id is held with different bytes"),
    "study-closed": (409, "The study is closed (committed, expired or dropped); it takes no more reports"),
    "study-open": (409, "The study is not committed yet; nothing is released"),
    "inclusion-conflict": (409, "The study is committed to a different inclusion set"),
    "inclusion-stale": (409, "The inclusion bitmap was made for a different list of held reports"),
    "capacity-exceeded": (409, "The study holds its maximum number of reports"),
    "budget-exceeded": (409, "The study would take its population past this server's privacy budget"),
    "unknown-reports": (422, "The inclusion set names reports this server does not hold"),
    "certificate-refused": (422, "The release certificate is not met"),
    "invalid-study": (422, "The study parameters are invalid"),
    "invalid-request": (422, "The request is invalid"),
    "sealed-share-refused": (422, "A sealed share does not open at this server"),
    "binding-refused": (422, "A share is not the one its report id commits to"),
    "inclusion-refused": (422, "The inclusion set leaves out more than this server's policy allows"),
    "upload-quota-exceeded": (403, "The upload token has added all the reports it may"),
    "wrong-party": (403, "The upload token belongs to another party of the study"),
    "incomplete-individuals": (422, "The inclusion set holds an individual without every party's block"),
    "uploads-closed": (409, "The study's verification round has begun; it takes no more reports"),
    "verification-pending": (409, "An earlier step of the study's verification round is not done"),
    "verification-conflict": (409, "The study's verification round was already run with other messages"),
    "verification-refused": (422, "A message of the verification round does not check"),
    "report-refused": (422, "The inclusion set holds a report this server refused or did not verify"),
    "key-in-use": (409, "The key may still be needed to open shares of an open study"),
    "request-timeout": (408, "The request did not arrive in time"),
    "payload-too-large": (413, "The request body is too large"),
    "unsupported-media-type": (415, "Unsupported content type"),
    "unavailable": (503, "The service cannot take this request now; retry later"),
    "upstream-failure": (502, "A share server answered with an error"),
    "internal-error": (500, "Internal error"),
}

PREFIX = "urn:dpsketch:problem:"


def type_uri(slug: str) -> str:
    return PREFIX + slug


class ProblemError(Exception):
    """A documented protocol error, raised by services and surfaced by the SDK."""

    def __init__(self, slug: str, detail: str, *, status: int | None = None,
                 headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None):
        if slug not in CATALOGUE:
            raise ValueError(f"unknown problem slug {slug!r}")
        default_status, title = CATALOGUE[slug]
        self.slug = slug
        self.status = status or default_status
        self.title = title
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra or {}
        super().__init__(f"{self.status} {slug}: {detail}")

    @classmethod
    def unavailable(cls, reason: str, retry_after_s: int = 1) -> "ProblemError":
        """503 ``unavailable`` for a store that cannot take a request now: nothing was stored,
        and ``Retry-After`` says when to try again."""
        return cls("unavailable", f"{reason}; nothing of this request was stored, retry later",
                   headers={"Retry-After": str(retry_after_s)})

    def body(self, instance: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": type_uri(self.slug),
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if instance:
            out["instance"] = instance
        out.update(self.extra)
        return out

    @classmethod
    def from_http(cls, status: int, content: bytes) -> "ProblemError":
        """The error an HTTP answer of ``status`` >= 400 carries: its problem JSON, or (a proxy's
        HTML page, a truncated body) the start of its text under a generic slug."""
        import json

        try:
            body = json.loads(content)
        except ValueError:
            body = None
        if isinstance(body, dict):
            return cls.from_body(status, body)
        text = content[:300].decode("utf-8", "replace")
        return cls("internal-error" if status >= 500 else "invalid-request", text, status=status)

    @classmethod
    def from_body(cls, status: int, body: dict[str, Any]) -> "ProblemError":
        t = str(body.get("type", ""))
        slug = t[len(PREFIX):] if t.startswith(PREFIX) else ""
        if slug not in CATALOGUE:
            slug = "internal-error" if status >= 500 else "invalid-request"
        return cls(slug, str(body.get("detail", body)), status=status)


def summarize_errors(errors: list[dict[str, Any]], limit: int = 5) -> str:
    """pydantic errors as one readable line naming each offending field (``columns: column name
    '1b' must match ...``), without echoing (possibly huge) inputs or pydantic's boilerplate."""
    parts = []
    for err in errors[:limit]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        msg = str(err.get("msg", "invalid"))
        for prefix in ("Value error, ", "Assertion failed, "):
            if msg.startswith(prefix):
                msg = msg[len(prefix):]
        parts.append(f"{loc}: {msg}")
    more = f" (and {len(errors) - limit} more)" if len(errors) > limit else ""
    return "; ".join(parts) + more
