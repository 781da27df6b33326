"""Install one role of dpsketch into the image's virtual environment (deploy/Dockerfile runs it).

    python image-role.py deps ROLE      # the role's libraries, from pyproject.toml alone
    python image-role.py kernels ROLE   # numba's cache, from the compiled loops' sources alone (server)
    python image-role.py project ROLE   # then dpsketch itself; drop pip; import the role's modules

A role is what one image runs (docs/install.md, "Container images"): ``server`` (the base
dependencies plus the ``server`` extra), ``analyzer`` (plus the ``analyzer`` extra) or ``client``
(the base alone: the SDK, ``dpsketch submit`` and ``dpsketch demo`` against a running cluster).
pyproject.toml stays the one list of what each role needs: ``deps`` reads it, so the layer that
installs the libraries is rebuilt only when that file changes, not when a source file does.
Likewise ``kernels`` compiles the server's numba loops from their own sources alone (deploy/
Dockerfile's kernel-sources stage), so that its layer, about 140 s of a build, is rebuilt only
when one of those files changes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

VENV = Path("/opt/dpsketch")
#: where deploy/Dockerfile's kernel-sources stage puts the compiled loops' sources (the
#: ``_*_kernel.py`` modules, kernels.py and what loading them imports), as paths in the package
KERNELS = Path("/kernels")
#: numba's cache, as compiled in the build (the server image ships it as its NUMBA_CACHE_DIR)
NUMBA_CACHE = Path("/opt/numba-cache")
#: the roles whose image ships numba's cache
COMPILED = ("server",)
#: the modification time of each of those sources, where ``kernels`` compiles them and where
#: ``project`` installs them: numba keys its cache on a source file's path, modification time and
#: size (the bytes are the same: one build context), so the installed files load the cached loops
KERNEL_MTIME = 1_000_000_000
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


def python(code: str, **env: str) -> None:
    """``code`` in the image's interpreter, from / (the installed package, never /src's copy)."""
    subprocess.run([str(VENV / "bin" / "python"), "-c", code], check=True, cwd="/",
                   env={**os.environ, "PYTHONPATH": "", **env})


def site_packages() -> Path:
    return next((VENV / "lib").glob("python3.*/site-packages"))


def kernel_sources() -> list[Path]:
    """The compiled loops' sources (and what loading them imports), relative to the package root."""
    return sorted(p.relative_to(KERNELS) for p in KERNELS.rglob("*.py"))


def stamp_kernels(root: Path) -> None:
    for rel in kernel_sources():
        os.utime(root / rel, (KERNEL_MTIME, KERNEL_MTIME))


def _warm(modules: list[str], then: str = "True") -> str:
    """Code that compiles (or loads) each of ``modules``' loops by kernels.py's rule (each checked
    on its probe against its reference), then runs ``then``; it fails unless all are available."""
    return ("import sys; from dpsketch.protocol import kernels; "
            f"ready = all([kernels.Kernel(name, name).warm_up() for name in {modules!r}]); "
            f"sys.exit(not (ready and {then}))")


def kernels(role: str) -> None:
    """numba's cache of the role's compiled loops, from their sources alone: each is placed where
    ``project`` installs it later, with the same modification time, and the packages above them
    get empty ``__init__.py`` files (the real ones import much more); each loop is compiled for
    this machine's CPU (named in the cache: ``record_build_cpu``) and for a generic one
    (dpsketch/protocol/kernels.py); then the placed files are removed again."""
    if role not in COMPILED:
        raise SystemExit(f"image-role: the {role} image ships no compiled loops")
    site, sources = site_packages(), kernel_sources()
    for rel in sources:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(KERNELS / rel, site / rel)
        for package in rel.parents[:-1]:
            (site / package / "__init__.py").touch()
    stamp_kernels(site)
    modules = [".".join(rel.with_suffix("").parts) for rel in sources if rel.name.endswith("_kernel.py")]
    cache = {"NUMBA_CACHE_DIR": str(NUMBA_CACHE)}
    python(_warm(modules, then="kernels.record_build_cpu()"), **cache)
    python(_warm(modules), **cache, NUMBA_CPU_NAME="generic")
    for top in {rel.parts[0] for rel in sources}:
        shutil.rmtree(site / top)


def _cache_files() -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in NUMBA_CACHE.rglob("*") if p.is_file()}


def deps(role: str) -> None:
    extras, _ = ROLES[role]
    pip("install", *requirements(Path("pyproject.toml"), extras))


def project(role: str) -> None:
    """dpsketch without its dependencies (``deps`` installed them), then what a runtime image needs
    none of: pip, setuptools and wheel, numpy's and scipy's own test suites. Last, the role's
    modules are imported from / (the installed package, not /src's copy): a missing library
    fails the build, not the first container; a role with compiled loops then loads each from
    the cache ``kernels`` made, in the same interpreter, and the build fails if one compiled."""
    _, modules = ROLES[role]
    pip("install", "--no-deps", ".")
    pip("uninstall", "--yes", "pip", "setuptools", "wheel")
    site = site_packages()
    for lib in ("numpy", "scipy"):
        for tests in sorted((site / lib).rglob("tests"), reverse=True) if (site / lib).is_dir() else []:
            if tests.is_dir():
                shutil.rmtree(tests)
    imports = f"import {', '.join(modules)}"
    if role not in COMPILED:
        python(imports)
        return
    # the installed kernel sources get the modification time they were compiled with (and their
    # byte code is written again for it), then every loop the server warms must load from the
    # cache, in the same interpreter: a new cache file would mean a loop compiled, which the
    # build refuses
    stamp_kernels(site)
    subprocess.run([str(VENV / "bin" / "python"), "-m", "compileall", "-q",
                    *(str(site / rel) for rel in kernel_sources())], check=True)
    before = _cache_files()
    python(f"{imports}; import sys; from dpsketch.services.store import warm_install; sys.exit(not warm_install())",
           NUMBA_CACHE_DIR=str(NUMBA_CACHE))
    if _cache_files() != before:
        raise SystemExit("image-role: the installed kernel sources did not load numba's cache (compiled "
                         "again): their path, modification time or size differs from the compiled ones'")


def main(argv: list[str]) -> int:
    steps = {"deps": deps, "kernels": kernels, "project": project}
    if len(argv) != 2 or argv[0] not in steps or argv[1] not in ROLES:
        usage = "\n".join(__doc__.strip().splitlines()[2:5])
        print(f"usage:\n{usage}\nroles: {', '.join(ROLES)}", file=sys.stderr)
        return 2
    steps[argv[0]](argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
