"""``dpsketch server``: run one share server (uvicorn, one worker, one SQLite file or one
PostgreSQL database).

One worker on purpose: the store's single writer thread and in-memory running totals belong to
one process (a second process would need its own file or database). Tokens come from the environment or
from files, never from the command line, where other local users could read them in ``ps``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

# Before numpy is imported: no transparent huge pages for numpy's arrays in the server. A study's
# running totals (a k x width aggregate, k x k S S^T) are allocated whole but touched a few rows
# per report; with numpy's default madvise(MADV_HUGEPAGE) each touched row pins 2 MiB instead of
# 4 KiB, so a new study held megabytes after one report. The memory budget counts the totals whole
# either way (policy.study_memory).
os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")

MIB = 1 << 20

DESCRIPTION = """\
Run one dpsketch share server: an HTTP API (docs/protocol.md section 6) over one SQLite file
(the default) or one PostgreSQL database (--db postgresql://...).

The server stores the shares clients upload (durably: acknowledged only after the database
synced the commit: SQLite's fsync, PostgreSQL's synchronous_commit), keeps the
public sketch of them, and releases one aggregate share per study after checking the release
certificate. It never talks to other share servers.

Two bearer tokens are required and must differ:
  operator token  this organisation's own: issues upload tokens (dpsketch tokens), rotates HPKE
                  keys, deletes shares (retention); never give it to the analyzer
  analyst token   provisions studies (under this server's policy), lists report ids, commits a
                  study and fetches its aggregate
Give them in the environment (DPSKETCH_OPERATOR_TOKEN, DPSKETCH_ANALYST_TOKEN) or in files
(--operator-token-file, --analyst-token-file); a file wins over the environment. Tokens you
want to rotate without a restart go in --tokens-file (JSON {"operator": [...], "analyst": [...]},
plain tokens or "sha256:<hex>" digests), re-read when it changes and on SIGHUP. Only digests of
tokens are kept in memory. The privacy policy flags (--max-epsilon, ...) make the server refuse
studies outside its own policy; /v1/info publishes it. Every population (the operator's: upload
tokens are issued for one) has a privacy budget (docs/ledger.md): --population-epsilon and
--population-floor-epsilon, at DPSKETCH_POPULATION_DELTA (1e-6) under
DPSKETCH_POPULATION_NEIGHBOURING (replace-one).

Trust (docs/trust.md): by default the server takes uploads only with upload tokens its operator
issued (--upload-auth), adds its own noise to every release so that each report keeps the
study's floor even among Sybil reports (--max-floor-epsilon, 4), refuses inclusion sets that
leave out more than a tenth of what it holds (--max-excluded-fraction), and stores a share only
if the report id commits to it.

Sealed shares: at first start the server generates an HPKE key pair of each suite (X25519 and
the post-quantum MLKEM768-X25519, HKDF-SHA256, ChaCha20-Poly1305), stores them in --db (a SQLite
file is made mode 0600; a PostgreSQL database must be guarded like the shares it holds) and publishes the public keys in /v1/info; clients may then seal each share
to one (docs/protocol.md section 7a, docs/sealing.md). POST /v1/keys (operator token) rotates
the keys of both suites; older keys keep opening shares until DELETE /v1/keys/{key_id}.
"""

EPILOG = """\
example:
  DPSKETCH_OPERATOR_TOKEN=... DPSKETCH_ANALYST_TOKEN=... \\
    dpsketch server --server-id s1 --db /var/lib/dpsketch/s1.sqlite3 --port 8101
  PGPASSWORD=... DPSKETCH_OPERATOR_TOKEN=... DPSKETCH_ANALYST_TOKEN=... \\
    dpsketch server --server-id s1 --db postgresql://dpsketch@db.internal:5432/s1 --port 8101

SIGTERM or Ctrl-C stops the server cleanly: it stops accepting connections, in-flight requests
finish, queued writes commit, and it exits with status 0. The wait for open connections (idle TLS
keep-alive clients hold it up to 30 s otherwise) is bounded by --graceful-timeout.
"""


def build_parser() -> argparse.ArgumentParser:
    from dpsketch.serving import add_connection_arguments, add_graceful_argument

    p = argparse.ArgumentParser(prog="dpsketch server", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-id", required=True,
                   help="this server's id, as listed in the studies' 'servers' (e.g. s1)")
    db_default = os.environ.get("DPSKETCH_DB", "").strip() or None
    p.add_argument("--db", required=db_default is None, default=db_default, type=db_location,
                   help="the store: a SQLite file (created if missing), or a PostgreSQL URL "
                        "postgresql://user@host:port/dbname whose tables are created if missing "
                        "(libpq's PGPASSWORD / ~/.pgpass supply a password, so none need appear "
                        "in ps) ($DPSKETCH_DB)")
    p.add_argument("--db-wait", dest="db_wait_s", type=_seconds, metavar="SECONDS",
                   default=os.environ.get("DPSKETCH_DB_WAIT_SECONDS", "").strip() or 60.0,
                   help="a PostgreSQL --db that cannot be reached at start (not up yet) is retried "
                        "this long before the server exits; a refusal (wrong password, no such "
                        "database) exits at once; 0: no retry (default: $DPSKETCH_DB_WAIT_SECONDS "
                        "or 60)")
    p.add_argument("--verify-cache-dir", metavar="DIR",
                   default=os.environ.get("DPSKETCH_VERIFY_CACHE_DIR", "").strip() or "auto",
                   help="where a validity study's query answer is kept for its decision, which then "
                        "reads it instead of computing it again; 'auto': <SQLite file>.verify-cache, or "
                        "the system temp dir's dpsketch-verify-cache-<hash of the URL> for a PostgreSQL store; 'off': "
                        "none, every decision recomputes (default: $DPSKETCH_VERIFY_CACHE_DIR or auto; "
                        "docs/operations.md)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8101, help="port to listen on (default: %(default)s)")
    p.add_argument("--max-body-bytes", type=_whole, metavar="BYTES",
                   default=os.environ.get("DPSKETCH_MAX_BODY_BYTES", "").strip() or 64 * MIB,
                   help="largest request body accepted; larger ones get 413 (default: $DPSKETCH_MAX_BODY_BYTES "
                        "or 67108864 = 64 MiB; a commit's inclusion set may reach 16 bytes x the study's "
                        "max_reports instead)")
    p.add_argument("--operator-token-file", type=Path,
                   help="file holding the operator token (default: $DPSKETCH_OPERATOR_TOKEN)")
    p.add_argument("--analyst-token-file", type=Path,
                   help="file holding the analyst token (default: $DPSKETCH_ANALYST_TOKEN)")
    from .options import add_policy_arguments

    add_policy_arguments(p)  # --max-epsilon, --max-delta, --min-reports, --tokens-file, ...
    p.add_argument("--max-inflight-uploads", type=_whole, metavar="N",
                   default=os.environ.get("DPSKETCH_MAX_INFLIGHT_UPLOADS", "").strip() or None,
                   help="uploads worked on at once; more get 503 + Retry-After before any parsing "
                        "(0: no limit; default: $DPSKETCH_MAX_INFLIGHT_UPLOADS or 64; docs/operations.md, "
                        "Backpressure)")
    p.add_argument("--max-inflight-upload-bytes", type=_whole, metavar="BYTES",
                   default=os.environ.get("DPSKETCH_MAX_INFLIGHT_UPLOAD_BYTES", "").strip() or None,
                   help="body bytes of the uploads worked on at once (0: no limit; default: "
                        "$DPSKETCH_MAX_INFLIGHT_UPLOAD_BYTES or 128 MiB)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log verbosity (default: %(default)s)")
    p.add_argument("--access-log", action="store_true", help="log every request (off by default: it "
                   "costs throughput at thousands of uploads per second)")
    p.add_argument("--ssl-certfile", type=Path, help="serve HTTPS with this certificate chain (PEM)")
    p.add_argument("--ssl-keyfile", type=Path, help="private key for --ssl-certfile (PEM)")
    add_graceful_argument(p)
    add_connection_arguments(p)
    return p


def _seconds(text: str) -> float:
    """A wait: seconds, 0 or more."""
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError(text)
    return value


_seconds.__name__ = "number of seconds >= 0"


def _whole(text: str) -> int:
    """An admission limit: a whole number, 0 or more."""
    n = int(text)
    if n < 0:
        raise ValueError(text)
    return n


_whole.__name__ = "whole number >= 0"


def _export_admission_limits(args: argparse.Namespace) -> None:
    """The admission middleware (services/admission.py) reads its limits from the environment
    when the app is built; the flags win over what the environment said."""
    for name, value in (("DPSKETCH_MAX_INFLIGHT_UPLOADS", args.max_inflight_uploads),
                        ("DPSKETCH_MAX_INFLIGHT_UPLOAD_BYTES", args.max_inflight_upload_bytes)):
        if value is not None:
            os.environ[name] = str(value)


def db_location(text: str) -> Path | str:
    """``--db``: a ``postgresql://`` URL stays a string, anything else is a SQLite file path."""
    from .backend import is_url

    return text if is_url(text) else Path(text)


db_location.__name__ = "database"


def _token(path: Path | None, env: str, role: str) -> str:
    if path is not None:
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise SystemExit(f"dpsketch server: cannot read the {role} token file {path}: {exc}") from None
    return os.environ.get(env, "").strip()


def settings_from_args(args: argparse.Namespace):
    """Tokens first (cheap, clear refusal), then the validated Settings (imports the protocol)."""
    operator = _token(args.operator_token_file, "DPSKETCH_OPERATOR_TOKEN", "operator")
    analyst = _token(args.analyst_token_file, "DPSKETCH_ANALYST_TOKEN", "analyst")
    missing = [name for name, value in (("operator (DPSKETCH_OPERATOR_TOKEN or --operator-token-file)", operator),
                                        ("analyst (DPSKETCH_ANALYST_TOKEN or --analyst-token-file)", analyst))
               if not value]
    if missing and getattr(args, "tokens_file", None) is None:
        raise SystemExit("dpsketch server: refusing to start without tokens; set the " + " and the ".join(missing)
                         + " token")
    from .options import policy_kwargs
    from .settings import Settings

    try:
        store = {"db_url": args.db} if isinstance(args.db, str) else {"db_path": args.db}
        return Settings(server_id=args.server_id, **store, operator_token=operator,
                        analyst_token=analyst, max_body_bytes=args.max_body_bytes, db_wait_s=float(args.db_wait_s),
                        verify_cache_dir=args.verify_cache_dir, **policy_kwargs(args))
    except ValueError as exc:
        raise SystemExit(f"dpsketch server: {exc}") from None


#: the share server's sys.setswitchinterval (main() says why)
GIL_SWITCH_INTERVAL_S = 0.001


def check_port(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (None: it can, as far as a bind now tells).

    Checked before the store is opened, so that a server whose port is taken leaves no new
    database behind: it says so in one line and exits. Bound as uvicorn binds (SO_REUSEADDR), so a
    port in TIME_WAIT after a restart is not mistaken for a taken one."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot listen on {host}:{port}: the address does not resolve ({exc.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return (f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server "
                    f"running there? choose another --port)")
    return None


def _new_files(db: Path | str) -> list[Path]:
    """The SQLite files (database, WAL, shared memory) that do not exist yet: the ones this
    process may create, hence remove again if it never starts serving."""
    if isinstance(db, str):  # PostgreSQL: nothing on disk here
        return []
    return [p for p in (db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}-journal")) if not p.exists()]


def _remove(paths: list[Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from dpsketch.serving import STARTUP_FAILURE, check_graceful_timeout, serve

    check_graceful_timeout(parser, args.graceful_timeout)
    settings = settings_from_args(args)
    _export_admission_limits(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # (short tokens are warned about by Settings, which keeps only their SHA-256 digests)
    refused = check_port(args.host, args.port)
    if refused is not None:
        print(f"dpsketch server: {refused}; nothing was created", file=sys.stderr)
        return 1

    # The store's warm-up thread imports dp-accounting, whose absl.logging makes a logging handler
    # as it is imported; made while uvicorn's dictConfig clears every handler (just after
    # create_app starts that thread), a half-built handler without its lock crashed a server at
    # startup in CI ("'StreamHandler' object has no attribute 'lock'"). Imported here, first.
    import absl.logging  # noqa: F401

    from .app import create_app

    created = _new_files(args.db)
    try:
        app = create_app(settings)
    except Exception as exc:  # e.g. unreadable database: say so plainly, no traceback
        _remove(created)
        print(f"dpsketch server: cannot open the store {settings.store_location}: {exc}", file=sys.stderr)
        return 1
    # Two threads take turns at the GIL: the event loop and the writer (services/writer.py). When
    # the writer comes back from SQLite or an fsync it waits for the loop to let go, by default
    # up to 5 ms each time, and every reply waits on the writer: 1 ms gave single uploads about
    # 4 % more (docs/operations.md, "Single uploads"); 0.3 ms gave nothing.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # handles SIGTERM/SIGINT: stop accepting, finish requests (bounded), run the app's shutdown
    status: int | None = None  # an unexpected error leaves the store alone: it may hold shares
    try:
        status = serve(app, graceful_timeout=args.graceful_timeout, host=args.host, port=args.port, workers=1,
                       log_level=args.log_level, access_log=args.access_log, proxy_headers=False,
                       server_header=False, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                       header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                       min_rate=args.min_rate, max_connections=args.max_connections,
                       max_connections_per_ip=args.max_connections_per_ip)
    except SystemExit as exc:  # uvicorn exits with STARTUP_FAILURE when it cannot bind
        status = exc.code if isinstance(exc.code, int) else None
        raise
    finally:
        if status == STARTUP_FAILURE:  # never served (the port was taken after all): no client saw it
            _remove(created)
    return status


if __name__ == "__main__":
    sys.exit(main())
