"""``dpsketch analyzer``: run the analyzer service (FastAPI + uvicorn + its SQLite file)."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    from dpsketch.serving import add_connection_arguments, add_graceful_argument

    p = argparse.ArgumentParser(
        prog="dpsketch analyzer",
        description="Run the analyzer: it creates studies on the share servers, finalizes them "
        "(intersect report ids, commit the same set everywhere, add the aggregate shares) and "
        "serves ridge / least-squares / PCA analyses of the released noisy sketch over REST.",
        epilog="SIGTERM or Ctrl-C stops the analyzer cleanly: it stops accepting connections, lets "
        "in-flight requests finish (at most --graceful-timeout seconds; a finalization cut short "
        "resumes where it stopped when asked again) and exits with status 0.",
    )
    p.add_argument("--config", help="cluster JSON (servers with urls and tokens, each token inline or "
                   "as a file: analyst_token_file, api_token_file); default: the DPSKETCH_CLUSTER "
                   "environment variable holding the same JSON")
    p.add_argument("--db", default="analyzer.sqlite3", help="SQLite file for studies and releases "
                   "(default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8100, help="port (default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity (default: %(default)s)")
    p.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", help="private key for --ssl-certfile (PEM)")
    p.add_argument("--insecure-no-api-token", action="store_true",
                   help="serve the API without a token (anyone who reaches it can create, finalize "
                        "and read studies); without this flag the analyzer refuses to start unless "
                        "the cluster configuration sets api_token")
    add_graceful_argument(p)
    add_connection_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from dpsketch.serving import check_graceful_timeout, serve

    check_graceful_timeout(parser, args.graceful_timeout)
    from .app import create_app
    from .config import ClusterConfig
    from .coordinator import Coordinator
    from .store import AnalyzerStore

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        config = ClusterConfig.load(args.config)
        config.ssl_context()  # an unreadable ca_file: refuse now, not at the first request
    except OSError as exc:
        print(f"dpsketch analyzer: cannot read the cluster configuration {exc.filename or args.config}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # one line naming the offending field (ClusterConfig.load)
        print(f"dpsketch analyzer: cannot load the cluster configuration: {exc}", file=sys.stderr)
        return 2
    log = logging.getLogger("dpsketch.analyzer")
    if not config.api_token:
        if not args.insecure_no_api_token:
            print("dpsketch analyzer: refusing to start without an API token: set \"api_token\" in the "
                  "cluster configuration (analysts then send Authorization: Bearer <token>), or pass "
                  "--insecure-no-api-token to serve the API to anyone who can reach it", file=sys.stderr)
            return 2
        log.warning("INSECURE: --insecure-no-api-token: the analyzer API needs no token; anyone who "
                    "reaches %s:%s can create, finalize and read studies", args.host, args.port)
    import threading

    from dpsketch import pld_cache
    from dpsketch.protocol import accounting

    pld_cache.install()  # a budget check's built PLDs on disk (Coordinator's ledger check, docs/ledger.md)

    # the first study's calibration then waits for no import (about 1 s of dp-accounting and scipy)
    threading.Thread(target=accounting.warm_up, name="dpsketch-accounting-warm", daemon=True).start()
    coordinator = Coordinator(config, AnalyzerStore(args.db), log=log.info)
    app = create_app(coordinator)
    try:
        return serve(app, graceful_timeout=args.graceful_timeout, host=args.host, port=args.port,
                     log_level=args.log_level, ssl_certfile=args.ssl_certfile,
                     ssl_keyfile=args.ssl_keyfile, header_timeout=args.header_timeout,
                     body_timeout=args.body_timeout, min_rate=args.min_rate,
                     max_connections=args.max_connections,
                     max_connections_per_ip=args.max_connections_per_ip)
    finally:
        coordinator.close()


if __name__ == "__main__":
    sys.exit(main())
