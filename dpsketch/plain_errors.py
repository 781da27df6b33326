"""Errors in one plain sentence, for the command lines and the SDK's messages.

Data owners, operators and analysts read these, not developers: a refused connection names the
URL it tried (httpx's own text is "[Errno 111] Connection refused", or nothing), and a malformed
configuration names the offending field ("servers.1.url: Field required"), never pydantic's
multi-line dump with its documentation links. One implementation for every part (the SDK, the
tokens command, the analyzer and its client), so they all say it the same way.
"""

from __future__ import annotations

import httpx
from pydantic import ValidationError


def unreachable_reason(exc: BaseException) -> str:
    """A transport error in a few plain words: "connection refused", "timed out", ..."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "the connection timed out"
    if isinstance(exc, httpx.TimeoutException):
        return "no answer in time"
    text = str(exc).strip()
    if isinstance(exc, httpx.ConnectError):
        low = text.lower()
        if "refused" in low:
            return "connection refused (is the service running and listening on that port?)"
        if "name or service not known" in low or "nodename nor servname" in low or "name resolution" in low:
            return "the host name does not resolve"
        return f"cannot connect ({text or type(exc).__name__})"
    return f"{type(exc).__name__}: {text or 'no response'}"


def unreachable(url: str, exc: BaseException) -> str:
    """"cannot reach URL: reason", for an error raised while talking to ``url``."""
    return f"cannot reach {url}: {unreachable_reason(exc)}"


def validation_summary(exc: ValidationError) -> str:
    """Every error of a pydantic ValidationError as "field.path: message", joined by "; "
    (at most five, then how many more). A model-level check (no field) gives its message alone;
    pydantic's "Value error, " prefix is dropped."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        message = str(err.get("msg", "invalid"))
        message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        parts.append(f"{where}: {message}" if where else message)
    more = len(parts) - 5
    return "; ".join(parts[:5]) + (f"; and {more} more" if more > 0 else "")
