"""The ``dpsketch`` command: one entry point, one subcommand per program.

Each subcommand lives with the part it runs (``services``, ``analyzer``, ``client_sdk``; the demo
and the benchmarks here in ``tools``) and has its own ``--help``; this module only dispatches,
importing nothing heavy until a command runs.

``pip install dpsketch`` installs the client's dependencies only; a command that runs a server,
the analyzer or the research harness needs its role's extra (docs/install.md). Before such a
command runs, the distributions its extras list (read from the installed package's metadata, so
pyproject.toml stays the one list) are checked, and a missing one is one line naming the extra
to install, not a traceback from deep inside the command.

The research harness (``research/``: ``dpsketch experiments``) is no part of the installed
package: it runs from a source checkout, whose ``research/`` folder stands beside ``tools/``.
Outside one, such a command says so in one line.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

#: command -> (module whose main() runs it, what it does, the extras it needs beyond the base)
COMMANDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "server": ("dpsketch.services.__main__", "run one share server (FastAPI + SQLite or PostgreSQL)", ("server",)),
    "analyzer": ("dpsketch.analyzer.__main__", "run the analyzer service (create, finalize, analyse)", ("analyzer",)),
    "relay": ("dpsketch.services.relay", "run a relay: one request per device in, one per share server out", ("server",)),
    "tokens": ("dpsketch.services.admin", "a share server operator's upload tokens: issue, list, revoke", ()),
    "submit": ("dpsketch.client_sdk.cli", "submit rows from a CSV file to the share servers (or through a relay)", ()),
    "enrol": ("dpsketch.client_sdk.relay_cli", "read a study and its servers' keys for submitting through a relay", ()),
    "study": ("dpsketch.analyzer.cli", "talk to a running analyzer: create, progress, finalize, analyse", ()),
    "demo": ("dpsketch.tools.demo", "run a local cluster end to end and print the error ratios", ("server", "analyzer")),
    "bench": ("dpsketch.tools.bench", "measure commit, upload and accuracy figures on this machine", ("server", "analyzer")),
    "experiments": ("research.experiments", "paper 000 section 5 figures and tables on the real code paths",
                    ("research",)),
    "recommend": ("dpsketch.analyzer.recommend", "which study kind (gram or sketch) suits d and n, and its cost", ()),
}

#: command -> its option that points it at running services instead of starting them: given that
#: option the command only talks HTTP, and the client's install runs it (the compose demo service,
#: in the client image, runs ``dpsketch demo --analyzer ...``)
REMOTE_OPTION = {"demo": "--analyzer"}

#: the top-level packages of dpsketch itself: a missing one of these is a broken install, not an extra
OWN_PACKAGES = ("dpsketch", "research")

USAGE = "usage: dpsketch <command> [options]   (dpsketch <command> --help for each)\n\ncommands:\n" + "\n".join(
    f"  {name:<11} {text}" for name, (_, text, _) in COMMANDS.items()
)


#: the source checkout this command runs from, if it does (tools/ is one of its folders)
CHECKOUT = Path(__file__).resolve().parents[1]
RESEARCH_MISSING = ("the research harness is not installed with dpsketch (research/ is in the source "
                    "repository only); run it from a source checkout: pip install -e '.[research]' there")


def research_on_path(checkout: Path | None = None) -> bool:
    """Put the checkout's (default: this one's) ``research/`` on the import path; False where
    there is none (an installed wheel holds no research harness)."""
    checkout = CHECKOUT if checkout is None else checkout
    if not (checkout / "research" / "__init__.py").is_file():
        return False
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    return True


def _install_hint(extras: tuple[str, ...]) -> str:
    return f"pip install 'dpsketch[{','.join(extras)}]'" if extras else "pip install --force-reinstall dpsketch"


def missing_distributions(extras: tuple[str, ...]) -> list[str]:
    """The distributions that ``extras`` of the installed dpsketch require and that are not
    installed (environment markers other than the extra's own are not evaluated: every role's
    requirement here is unconditional). Empty where dpsketch's metadata cannot be read (run from
    a source tree that was never installed): the command then runs and fails where it fails."""
    from importlib import metadata

    try:
        requirements = metadata.requires("dpsketch") or []
    except metadata.PackageNotFoundError:
        return []
    missing = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if not extra or extra.group(1) not in extras:
            continue
        name = re.match(r"\s*([A-Za-z0-9._-]+)", spec)
        if name is None or name.group(1).lower() == "dpsketch":
            continue
        try:
            metadata.version(name.group(1))
        except metadata.PackageNotFoundError:
            missing.append(name.group(1))
    return sorted(set(missing))


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
    module_name, _, extras = COMMANDS[name]
    if module_name.startswith("research.") and not research_on_path():
        print(f"dpsketch {name}: {RESEARCH_MISSING}", file=sys.stderr)
        return 2
    wants_help = any(a in ("-h", "--help") for a in rest)  # help needs no extra
    remote = name in REMOTE_OPTION and any(a.split("=")[0] == REMOTE_OPTION[name] for a in rest)
    if remote:
        extras = ()
    missing = [] if wants_help or not extras else missing_distributions(extras)
    if missing:
        what = f"the {extras[0]} extra" if len(extras) == 1 else f"the {' and '.join(extras)} extras"
        print(f"dpsketch {name}: needs {what}, not installed here (missing: "
              f"{', '.join(missing)}); install it with: {_install_hint(extras)}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(module_name)
        return int(module.main(rest) or 0)
    except ModuleNotFoundError as exc:
        # the metadata check above passed (or could not run) and still a library is missing: say
        # which, and what would bring it, in one line
        top = (exc.name or "").split(".")[0]
        if not top or top in OWN_PACKAGES:
            raise
        print(f"dpsketch {name}: the Python module {top!r} is not installed; install it with: "
              f"{_install_hint(extras)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
