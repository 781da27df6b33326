"""The import arrows between the layers point one way (README, "Architecture").

    research  ->  tools  ->  services, client_sdk, analyzer  ->  dpsketch (protocol/ and the shared
                                                                 service infrastructure: serving,
                                                                 observability, problem_http)

* nothing in dpsketch/, services/, client_sdk/ or analyzer/ imports ``tools`` (the command, the
  process launcher, the demo and the benchmarks start and drive the parts, never the reverse);
* dpsketch/ imports none of services, client_sdk, analyzer;
* services/, client_sdk/ and analyzer/ do not import each other, except the edges listed in
  ALLOWED, each with its reason;
* nothing in the runtime packages (dpsketch/, services/, client_sdk/, analyzer/, tools/) imports
  ``research``: the evaluation harness is not installed with them, so an import of it would
  fail in every install (research/ may import them all).

The runtime parts are folders at the top of the repository (``services/``, ``client_sdk/``,
``analyzer/``, ``tools/``) and are imported, and installed, under the one ``dpsketch`` namespace
(``dpsketch.services`` ...: ``dpsketch/services`` is a link to ``services/``; issue 42). Their bare
top-level names are never imported: the wheel has no ``services`` or ``tools`` to collide with.

Read from the source with ``ast`` (no imports run, no servers): every ``import`` and
``from ... import`` anywhere in a module, at the top or inside a function, relative ones resolved,
and ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

#: The parts, and the core below them.
PARTS = ("services", "client_sdk", "analyzer")
CORE = "dpsketch"
TOOLS = "tools"
#: The evaluation harness, in the source checkout only: above everything, imported by nothing.
RESEARCH = "research"

#: Imports between the parts that are there on purpose: (importing module, imported module) ->
#: why. Anything else between services, client_sdk and analyzer fails the test.
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    """The name a file is imported by: ``services/app.py`` is ``dpsketch.services.app``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in (*PARTS, TOOLS):
        parts.insert(0, CORE)
    return ".".join(parts)


def layer(module: str) -> str | None:
    """Which layer a module belongs to: one of PARTS, TOOLS, CORE or RESEARCH, ``bare`` for a
    part's bare top-level name (never to be imported), None for anything not ours."""
    head = module.split(".")
    if head[0] == CORE:
        return head[1] if len(head) > 1 and head[1] in (*PARTS, TOOLS) else CORE
    if head[0] == RESEARCH:
        return RESEARCH
    if head[0] in (*PARTS, TOOLS):
        return "bare"
    return None


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, the source of ``module``."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                   or isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))):
            name = node.args[0].value
            if name.startswith("."):  # import_module(".x", __package__)
                dots = len(name) - len(name.lstrip("."))
                name = ".".join(package[: len(package) - (dots - 1)] + [name.lstrip(".")]).rstrip(".")
            found.append((node.lineno, name))
    return found


def edges() -> list[tuple[str, int, str, str]]:
    """(file, line, importing module, imported module) for every import leaving its own
    top-level package towards one of ours."""
    out = []
    for top in (CORE, *PARTS, TOOLS, RESEARCH):
        for path in sorted((ROOT / top).rglob("*.py")):  # rglob does not follow dpsketch/'s links
            module = module_name(path)
            for line, target in imports_of(path.read_text(encoding="utf-8"), module,
                                           is_package=path.name == "__init__.py"):
                if layer(target) is not None and layer(target) != layer(module):
                    out.append((str(path.relative_to(ROOT)), line, module, target))
    return out


def _where(found: list[tuple[str, int, str, str]]) -> str:
    return "\n".join(f"  {file}:{line}: {module} imports {target}" for file, line, module, target in found)


def test_the_scanner_sees_every_kind_of_import():
    source = (
        "import dpsketch.tools.cluster\n"
        "from . import sibling\n"
        "from ..other import thing\n"
        "def f():\n"
        "    from dpsketch.services.admin import ServerAdmin\n"
        "    import importlib\n"
        "    return importlib.import_module('dpsketch.tools.demo'), __import__('client_sdk')\n"
    )
    names = sorted(name for _, name in imports_of(source, "dpsketch.analyzer.sub.mod"))
    assert names == sorted(["dpsketch.tools.cluster", "dpsketch.analyzer.sub", "dpsketch.analyzer.other",
                            "dpsketch.services.admin", "importlib", "dpsketch.tools.demo", "client_sdk"])
    assert sorted(name for _, name in imports_of("from .client import Client\n", "dpsketch.client_sdk",
                                                   is_package=True)) == ["dpsketch.client_sdk.client"]
    assert [layer(n) for n in ("dpsketch.services.app", "dpsketch.protocol.ring", "dpsketch.tools.cli",
                               "research.report", "client_sdk" + ".client", "numpy")] == [
        "services", CORE, TOOLS, RESEARCH, "bare", None]
    assert module_name(ROOT / "services" / "app.py") == "dpsketch.services.app"
    # and it finds the arrows that are meant to be there (services on the core), so an empty
    # answer below is not a scanner reading nothing
    assert any(module.startswith("dpsketch.services.") and target.startswith("dpsketch.protocol")
               for _, _, module, target in edges())


def test_nothing_imports_a_part_by_its_bare_name():
    """``import services`` would load a second copy of the module in a checkout (the folder is on
    the path there) and fail in an install (the wheel has only ``dpsketch``)."""
    found = [e for e in edges() if layer(e[3]) == "bare"]
    for top in ("tests", "benchmarks", "scripts", "examples", "deploy"):  # not layers, but no bare names either
        for path in sorted((ROOT / top).rglob("*.py")):
            found += [(str(path.relative_to(ROOT)), line, path.stem, target)
                      for line, target in imports_of(path.read_text(encoding="utf-8"), path.stem) if layer(target) == "bare"]
    assert not found, ("import the parts as dpsketch.services, dpsketch.analyzer, dpsketch.client_sdk, "
                       "dpsketch.tools:\n" + _where(found))


#: An import statement of a part by its bare name anywhere in the tree's text: Python source, but
#: also code inside strings (``python -c "from dpsketch.services.store import ..."`` in deploy/Dockerfile
#: and scripts/install.sh, subprocess arguments, docstrings and docs), which ast does not see.
BARE_IN_TEXT = re.compile(r"(^|[;\"'`]|\\n)\s*(>>> )?(from (services|analyzer|client_sdk|tools)(\.\w+)* import\b"
                          r"|import (services|analyzer|client_sdk|tools)(\.\w+)*(?!\w))", re.M)


def test_no_text_in_the_tree_imports_a_part_by_its_bare_name():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    found = []
    for name in files:
        path = ROOT / name
        if not name or name in ("CHANGELOG.md", "tests/test_layering.py") or name.startswith(("clients/", "conformance/")) \
                or path.is_symlink() or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"  {name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()}"
                  for m in BARE_IN_TEXT.finditer(text)]
    assert not found, "the parts are dpsketch.services, dpsketch.analyzer, dpsketch.client_sdk, dpsketch.tools:\n" + "\n".join(found)
    # and the pattern sees the forms it is for (one of them hid in deploy/Dockerfile's build step)
    bare = "services"  # spelled apart, so that no rewrite of the tree's imports touches these samples
    assert BARE_IN_TEXT.search(f'python -c "import sys; from {bare}.store import warm_kernels"')
    assert BARE_IN_TEXT.search("import " + "client_sdk.cli") and not BARE_IN_TEXT.search("from x import analyzer")


def test_the_parts_are_linked_into_the_namespace():
    for part in (*PARTS, TOOLS):
        link = ROOT / CORE / part
        assert link.is_symlink() and link.resolve() == (ROOT / part).resolve(), link


def test_nothing_below_tools_imports_tools():
    found = [e for e in edges() if layer(e[3]) == TOOLS and layer(e[2]) != RESEARCH]
    assert not found, ("tools/ starts and drives the parts; they must not import it "
                       "(move what they need into the part or into dpsketch/):\n" + _where(found))


def test_the_core_imports_none_of_the_parts():
    found = [e for e in edges() if layer(e[2]) == CORE]
    assert not found, ("dpsketch/ is the core the parts import; it imports none of them "
                       "(the tools that drive them live in tools/):\n" + _where(found))


def test_the_parts_import_each_other_only_where_allowed():
    found = [e for e in edges()
             if layer(e[2]) in PARTS and layer(e[3]) in PARTS and (e[2], e[3]) not in ALLOWED]
    assert not found, ("services, client_sdk and analyzer talk over HTTP, not by import; an import "
                       "between them needs a reason in ALLOWED (tests/test_layering.py):\n" + _where(found))


def test_no_runtime_package_imports_the_research_harness():
    found = [e for e in edges() if layer(e[3]) == RESEARCH]
    assert not found, ("research/ is not installed with dpsketch; what a runtime package needs from it "
                       "belongs in that package (the analyzer's simulations are analyzer/simulation.py):\n"
                       + _where(found))
    # the harness is there to be imported, and does import the runtime packages (so an empty
    # answer above is not a scanner that never looked at research/ as a target)
    harness = ROOT / RESEARCH
    assert (harness / "__init__.py").is_file()
    assert any(layer(target) == "analyzer" for path in harness.glob("*.py")
               for _, target in imports_of(path.read_text(encoding="utf-8"), module_name(path)))


def test_the_wheel_leaves_the_research_harness_out():
    """pyproject.toml's package list names the runtime packages only."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include == ["dpsketch*"], include  # one namespace; research/ is outside it


def test_every_allowed_edge_is_still_there():
    """An exception in ALLOWED that the code no longer needs is dropped (none is left today:
    the research harness was the last, issue 42)."""
    present = {(module, target) for _, _, module, target in edges()}
    stale = [edge for edge in sorted(ALLOWED) if edge not in present]
    assert not stale, f"no longer imported, drop from ALLOWED: {stale}"


#: What the protocol core must not reach for: transport, servers and storage belong to the thin
#: layers above it (a new study kind is a module in dpsketch/protocol/ plus service code).
IO_MODULES = ("httpx", "fastapi", "starlette", "uvicorn", "asyncio", "socket", "sqlite3", "psycopg",
              "dpsketch.serving", "dpsketch.observability", "dpsketch.problem_http", "dpsketch.pld_cache")


def test_the_protocol_core_does_no_io():
    found = []
    for path in sorted((ROOT / CORE / "protocol").rglob("*.py")):
        module = module_name(path)
        for line, target in imports_of(path.read_text(encoding="utf-8"), module,
                                       is_package=path.name == "__init__.py"):
            if any(target == name or target.startswith(name + ".") for name in IO_MODULES):
                found.append((str(path.relative_to(ROOT)), line, module, target))
    assert not found, ("dpsketch/protocol/ is the I/O-free core: messages, formats and arithmetic; "
                       "HTTP, servers and stores live in the layers above it:\n" + _where(found))


#: What reads the environment or files (dotted names as written in the source): the core's
#: arithmetic takes its inputs as arguments, and what is kept between processes is kept by a layer
#: above it (the ledger's built PLDs: dpsketch/pld_cache.py, injected with ledger.keep_plds_in).
FILE_IO_CALLS = frozenset({"open", "os.environ", "os.getenv", "os.replace", "os.remove", "os.unlink",
                           "np.load", "np.save", "np.savez", "np.savez_compressed", "np.fromfile",
                           "np.loadtxt", "np.savetxt", "Path.home", "os.path.expanduser"})

#: The core's files that do touch them, each with its reason. Anything else fails the test.
FILE_IO_ALLOWED: dict[str, str] = {
    "dpsketch/protocol/kernels.py": "numba's compiled loops: the CPU the image's cache was built for, a file in "
                                    "numba's cache directory, and the operator's NUMBA_CPU_NAME/FEATURES",
    "dpsketch/protocol/_sha256_kernel.py": "finds the libcrypto hashlib loaded, in /proc/self/maps",
}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head is not None else None
    return None


def file_io_of(source: str) -> list[tuple[int, str]]:
    """(line, name) of every use of a name in FILE_IO_CALLS in ``source`` (called or not: a
    ``getattr``-free read of ``os.environ[...]`` counts)."""
    return sorted({(node.lineno, name) for node in ast.walk(ast.parse(source))
                   if isinstance(node, (ast.Name, ast.Attribute)) and (name := _dotted(node)) in FILE_IO_CALLS})


def test_the_protocol_core_reads_no_environment_and_no_files():
    """The ledger kept its built PLDs on disk itself (reading $DPSKETCH_PLD_CACHE ...) until they
    moved to dpsketch/pld_cache.py; nothing in the core but the files in FILE_IO_ALLOWED does."""
    found, seen = [], set()
    for path in sorted((ROOT / CORE / "protocol").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        uses = file_io_of(path.read_text(encoding="utf-8"))
        if uses:
            seen.add(name)
        if name not in FILE_IO_ALLOWED:
            found += [f"  {name}:{line}: {what}" for line, what in uses]
    assert not found, ("dpsketch/protocol/ reads no environment and no files; keep that in a layer above it "
                       "(as dpsketch/pld_cache.py keeps the ledger's PLDs):\n" + "\n".join(found))
    assert seen == set(FILE_IO_ALLOWED), f"no longer doing I/O, drop from FILE_IO_ALLOWED: {set(FILE_IO_ALLOWED) - seen}"
    # the scanner sees the forms the ledger used (and so is not an empty answer by reading nothing)
    old = ("given = os.environ.get('DPSKETCH_PLD_CACHE', '')\nwith np.load(known) as saved:\n    pass\n"
           "with open(tmp, 'wb') as out:\n    np.savez(out, probs=p)\nos.replace(tmp, path)\n")
    assert [what for _, what in file_io_of(old)] == ["os.environ", "np.load", "open", "np.savez", "os.replace"]
    assert file_io_of("np.asarray(x); os.cpu_count(); self.open_batches") == []
