"""The analyst console: static files under ``/console/`` served by the analyzer itself.

The console (``analyzer/console/``: plain ES modules, CSS and hand-written SVG charts, no build
step, nothing fetched from elsewhere) is a client of the analyzer's public REST API like the CLI:
it holds the API token in the browser's session storage and sends it as ``Authorization:
Bearer`` on every ``/v1`` call. Serving it needs no token: the files are the same for everyone and
carry no data.

Why the headers: the console shows released statistics and holds a token, so its pages refuse
everything they do not need. The Content-Security-Policy allows scripts, styles and fetches from
the analyzer's own origin only (no inline script, no eval, no CDN), images from the page's own
blob: URLs (an SVG figure drawn onto a canvas for the PNG download) and no framing
(``frame-ancestors 'none'``, clickjacking); ``nosniff`` keeps a browser from reading a file as
anything but its declared type. Nothing here adds CORS: the analyzer answers no
``Access-Control-Allow-Origin``, so a page from another origin can neither read its answers nor
send the ``Authorization`` header (the preflight fails), and a browser never attaches a bearer
token by itself the way it attaches cookies, which is what makes the state-changing calls safe
against cross-site requests.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

from dpsketch.protocol import ProblemError

#: The policy of every console response (see the module docstring for each directive's reason).
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' blob:",
    "connect-src 'self'",
    "font-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
    "require-trusted-types-for 'script'",
    "trusted-types 'none'",
])

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Permissions-Policy": "camera=(), microphone=(), geolocation=(), payment=(), usb=()",
    # small files, and a new analyzer version must not run an old console's modules
    "Cache-Control": "no-cache",
}

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".txt": "text/plain; charset=utf-8",
}


def console_files() -> dict[str, tuple[bytes, str]]:
    """Every file of the console (path relative to ``analyzer/console/`` -> bytes, media type),
    read once from the installed package (a wheel ships them as package data, pyproject.toml)."""
    root = resources.files("dpsketch.analyzer") / "console"
    files: dict[str, tuple[bytes, str]] = {}

    def walk(node, prefix: str) -> None:
        for child in node.iterdir():
            name = prefix + child.name
            if child.is_dir():
                walk(child, name + "/")
                continue
            suffix = "." + child.name.rsplit(".", 1)[-1] if "." in child.name else ""
            if suffix in MEDIA_TYPES:
                files[name] = (child.read_bytes(), MEDIA_TYPES[suffix])

    if root.is_dir():
        walk(root, "")
    return files


def install(app: FastAPI) -> None:
    """Add ``GET /console`` (a redirect), ``/console/`` and ``/console/{path}`` to the app."""
    files = console_files()

    def serve(path: str) -> Response:
        entry = files.get(path)
        if entry is None:
            raise ProblemError("not-found", f"the console has no file {path[:200]!r}")
        body, media_type = entry
        return Response(body, media_type=media_type, headers=SECURITY_HEADERS)

    @app.get("/console", include_in_schema=False)
    def console_root() -> Response:
        return RedirectResponse("console/", status_code=308, headers=SECURITY_HEADERS)

    @app.get("/console/", include_in_schema=False)
    def console_index() -> Response:
        return serve("index.html")

    @app.get("/console/{path:path}", include_in_schema=False)
    def console_file(path: str) -> Response:
        return serve(path)
