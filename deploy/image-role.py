"""Install one role of dpsketch into the image's virtual environment (deploy/Dockerfile runs it).

    python image-role.py deps ROLE      # the role's libraries, from pyproject.toml alone
    python image-role.py project ROLE   # then dpsketch itself; drop pip; import the role's modules

A role is what one image runs (docs/install.md, "Container images"): ``server`` (the base
dependencies plus the ``server`` extra), ``analyzer`` (plus the ``analyzer`` extra) or ``client``
(the base alone: the SDK, ``dpsketch submit`` and ``dpsketch demo`` against a running cluster).
pyproject.toml stays the one list of what each role needs: ``deps`` reads it, so the layer that
installs the libraries is rebuilt only when that file changes, not when a source file does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

VENV = Path("/opt/dpsketch")
#: role -> (the extras it installs beyond the base, the modules a working image of it imports)
ROLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "server": (("server",), ("dpsketch.services.app", "dpsketch.services.store", "dpsketch.tools.cli")),
    "analyzer": (("analyzer",), ("dpsketch.analyzer.app", "dpsketch.analyzer.coordinator", "dpsketch.tools.cli")),
    "client": ((), ("dpsketch.client_sdk", "dpsketch.analyzer.client", "dpsketch.services.admin", "dpsketch.tools.cli", "dpsketch.tools.demo")),
}


def requirements(pyproject: Path, extras: tuple[str, ...]) -> list[str]:
    """The base dependencies and those of ``extras``, in order, each once."""
    project = tomllib.loads(pyproject.read_text())["project"]
    listed = list(project["dependencies"])
    for extra in extras:
        listed += project["optional-dependencies"][extra]
    return list(dict.fromkeys(listed))


def pip(*args: str) -> None:
    subprocess.run([str(VENV / "bin" / "pip"), *args], check=True)


def deps(role: str) -> None:
    extras, _ = ROLES[role]
    pip("install", *requirements(Path("pyproject.toml"), extras))


def project(role: str) -> None:
    """dpsketch without its dependencies (``deps`` installed them), then what a runtime image needs
    none of: pip, setuptools and wheel, numpy's and scipy's own test suites. Last, the role's
    modules are imported from / (the installed package, not /src's copy): a missing library
    fails the build, not the first container."""
    _, modules = ROLES[role]
    pip("install", "--no-deps", ".")
    pip("uninstall", "--yes", "pip", "setuptools", "wheel")
    site = next((VENV / "lib").glob("python3.*/site-packages"))
    for lib in ("numpy", "scipy"):
        for tests in sorted((site / lib).rglob("tests"), reverse=True) if (site / lib).is_dir() else []:
            if tests.is_dir():
                shutil.rmtree(tests)
    code = f"import {', '.join(modules)}"
    subprocess.run([str(VENV / "bin" / "python"), "-c", code], check=True, cwd="/",
                   env={**os.environ, "PYTHONPATH": ""})


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("deps", "project") or argv[1] not in ROLES:
        usage = "\n".join(__doc__.strip().splitlines()[2:4])
        print(f"usage:\n{usage}\nroles: {', '.join(ROLES)}", file=sys.stderr)
        return 2
    (deps if argv[0] == "deps" else project)(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
