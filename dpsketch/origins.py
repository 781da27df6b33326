"""Web origins a CORS setting lists (the share server's ``cors_origins``, the relay's
``--cors-origins``): parsed and checked here, apart from dpsketch/problem_http.py's CORS layer,
so that the command line's options parse where FastAPI is not installed (``dpsketch server
--help`` in a client-only install)."""

from __future__ import annotations

import re
from collections.abc import Iterable

#: An origin a browser sends: scheme, host and an optional port, nothing after.
ORIGIN_PATTERN = r"^https?://[A-Za-z0-9.\-\[\]:]+$"


def split_origins(value: str) -> tuple[str, ...]:
    """Comma-separated web origins as an operator writes them (a trailing slash dropped);
    :func:`check_origins` checks each."""
    return tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())


def check_origins(origins: Iterable[str], setting: str) -> tuple[str, ...]:
    """The origins a CORS setting lists, each an exact origin (what a browser sends in
    ``Origin``: a path or a missing scheme never matches one) or ``*``; ValueError naming the
    first that is neither, and ``setting``, where the operator wrote it. The share server's
    ``cors_origins`` and the relay's ``--cors-origins`` are checked here alike."""
    origins = tuple(origins)
    for origin in origins:
        if origin != "*" and not re.fullmatch(ORIGIN_PATTERN, origin):
            raise ValueError(f"CORS origin {origin!r} is not an origin (scheme://host[:port], no "
                             f"path) nor '*' ({setting})")
    return origins
