"""The import arrows between the top-level packages point one way (README, "Architecture").

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

Read from the source with ``ast`` (no imports run, no servers): every ``import`` and
``from ... import`` anywhere in a module, at the top or inside a function, relative ones resolved,
and ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name.
"""

from __future__ import annotations

import ast
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
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


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
    ours = {CORE, TOOLS, RESEARCH, *PARTS}
    out = []
    for top in (CORE, *PARTS, TOOLS):
        for path in sorted((ROOT / top).rglob("*.py")):
            module = module_name(path)
            for line, target in imports_of(path.read_text(encoding="utf-8"), module,
                                           is_package=path.name == "__init__.py"):
                target_top = target.split(".")[0]
                if target_top in ours and target_top != top:
                    out.append((str(path.relative_to(ROOT)), line, module, target))
    return out


def _where(found: list[tuple[str, int, str, str]]) -> str:
    return "\n".join(f"  {file}:{line}: {module} imports {target}" for file, line, module, target in found)


def test_the_scanner_sees_every_kind_of_import():
    source = (
        "import tools.cluster\n"
        "from . import sibling\n"
        "from ..other import thing\n"
        "def f():\n"
        "    from services.admin import ServerAdmin\n"
        "    import importlib\n"
        "    return importlib.import_module('tools.demo'), __import__('client_sdk')\n"
    )
    names = sorted(name for _, name in imports_of(source, "analyzer.sub.mod"))
    assert names == sorted(["tools.cluster", "analyzer.sub", "analyzer.other", "services.admin", "importlib",
                            "tools.demo", "client_sdk"])
    assert sorted(name for _, name in imports_of("from .client import Client\n", "client_sdk",
                                                   is_package=True)) == ["client_sdk.client"]
    # and it finds the arrows that are meant to be there (services on the core), so an empty
    # answer below is not a scanner reading nothing
    assert any(module.startswith("services.") and target.startswith("dpsketch.protocol")
               for _, _, module, target in edges())


def test_nothing_below_tools_imports_tools():
    found = [e for e in edges() if e[3].split(".")[0] == TOOLS]
    assert not found, ("tools/ starts and drives the parts; they must not import it "
                       "(move what they need into the part or into dpsketch/):\n" + _where(found))


def test_the_core_imports_none_of_the_parts():
    found = [e for e in edges() if e[2].split(".")[0] == CORE]
    assert not found, ("dpsketch/ is the core the parts import; it imports none of them "
                       "(the tools that drive them live in tools/):\n" + _where(found))


def test_the_parts_import_each_other_only_where_allowed():
    found = [e for e in edges()
             if e[2].split(".")[0] in PARTS and e[3].split(".")[0] in PARTS and (e[2], e[3]) not in ALLOWED]
    assert not found, ("services, client_sdk and analyzer talk over HTTP, not by import; an import "
                       "between them needs a reason in ALLOWED (tests/test_layering.py):\n" + _where(found))


def test_no_runtime_package_imports_the_research_harness():
    found = [e for e in edges() if e[3].split(".")[0] == RESEARCH]
    assert not found, ("research/ is not installed with dpsketch; what a runtime package needs from it "
                       "belongs in that package (the analyzer's simulations are analyzer/simulation.py):\n"
                       + _where(found))
    # the harness is there to be imported, and does import the runtime packages (so an empty
    # answer above is not a scanner that never looked at research/ as a target)
    harness = ROOT / RESEARCH
    assert (harness / "__init__.py").is_file()
    assert any(target.split(".")[0] == "analyzer" for path in harness.glob("*.py")
               for _, target in imports_of(path.read_text(encoding="utf-8"), module_name(path)))


def test_the_wheel_leaves_the_research_harness_out():
    """pyproject.toml's package list names the runtime packages only."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(pattern.split(".")[0].rstrip("*") == RESEARCH for pattern in include), include


def test_every_allowed_edge_is_still_there():
    """An exception in ALLOWED that the code no longer needs is dropped (none is left today:
    the research harness was the last, issue 42)."""
    present = {(module, target) for _, _, module, target in edges()}
    stale = [edge for edge in sorted(ALLOWED) if edge not in present]
    assert not stale, f"no longer imported, drop from ALLOWED: {stale}"


#: What the protocol core must not reach for: transport, servers and storage belong to the thin
#: layers above it (a new study kind is a module in dpsketch/protocol/ plus service code).
IO_MODULES = ("httpx", "fastapi", "starlette", "uvicorn", "asyncio", "socket", "sqlite3", "psycopg",
              "dpsketch.serving", "dpsketch.observability", "dpsketch.problem_http")


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
