"""The ``dpsketch`` command: one entry point, one subcommand per program.

Each subcommand lives with the part it runs (``services``, ``analyzer``, ``client_sdk``; the demo
and the benchmarks here in ``tools``) and has its own ``--help``; this module only dispatches,
importing nothing heavy until a command runs.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "server": ("services.__main__", "run one share server (FastAPI + SQLite or PostgreSQL)"),
    "analyzer": ("analyzer.__main__", "run the analyzer service (create, finalize, analyse)"),
    "tokens": ("services.admin", "a share server operator's upload tokens: issue, list, revoke"),
    "submit": ("client_sdk.cli", "submit rows from a CSV file to the share servers"),
    "study": ("analyzer.cli", "talk to a running analyzer: create, progress, finalize, analyse"),
    "demo": ("tools.demo", "run a local cluster end to end and print the error ratios"),
    "bench": ("tools.bench", "measure commit, upload and accuracy figures on this machine"),
    "experiments": ("analyzer.experiments", "paper 000 section 5 figures and tables on the real code paths"),
    "recommend": ("analyzer.recommend", "which study kind (gram or sketch) suits d and n, and its cost"),
}

USAGE = "usage: dpsketch <command> [options]   (dpsketch <command> --help for each)\n\ncommands:\n" + "\n".join(
    f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()
)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if args[0] in ("--version", "version"):
        from dpsketch import __version__

        print(f"dpsketch {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"dpsketch: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
