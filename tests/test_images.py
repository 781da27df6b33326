"""One container image per role, checked without an engine: deploy/Dockerfile's targets install
what pyproject.toml gives their role and nothing else, and every deployment (docker-compose.yml,
deploy/stack.yml, deploy/k8s) runs each program from the image of its role, whose libraries that
program needs no more than. tests/test_compose.py builds and runs the images on a real engine."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import yaml

from envguard import unavailable
from dpsketch.tools import cli

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: image -> the role (deploy/Dockerfile target) it is built from
IMAGES = {f"dpsketch-{role}:local": role for role in ("server", "analyzer", "client")}


def _image_role():
    spec = importlib.util.spec_from_file_location("image_role", ROOT / "deploy" / "image-role.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined), in file order."""
    lines = re.sub(r"\\\n", " ", DOCKERFILE).splitlines()
    stages: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.startswith("FROM "):
            current = line.split(" AS ")[1].strip()
            stages[current] = [line]
        elif current and line.strip() and not line.startswith("#"):
            stages[current].append(line)
    return stages


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def test_each_target_installs_its_role_from_its_own_build():
    stages = _stages()
    assert list(stages)[-1] == "server"  # `docker build` without --target: the share server
    roles = _image_role().ROLES
    assert set(roles) == set(IMAGES.values())
    for role in roles:
        target = stages[role]
        assert f"COPY --from={role}-build /opt/dpsketch /opt/dpsketch" in target, target
        build = " ".join(stages[f"{role}-build"])
        assert f"dpsketch-image-role.py deps {role}" in build and f"dpsketch-image-role.py project {role}" in build
        # the libraries are installed before the sources arrive (a source edit reinstalls none)
        assert build.index(f"deps {role}") < build.index("COPY --from=sources") < build.index(f"project {role}")
        # nothing else's venv ends up in it
        others = [line for line in target if "--from=" in line and f"--from={role}-build" not in line]
        assert not others, others
    assert "numba-cache" in " ".join(stages["server"]) and "numba" not in " ".join(stages["client"])


def test_each_role_gets_pyprojects_libraries_for_it_and_no_others():
    image_role = _image_role()
    base, extras = _names(PROJECT["dependencies"]), PROJECT["optional-dependencies"]
    server_only = {"fastapi", "uvicorn", "prometheus-client", "psycopg", "numba", "threadpoolctl"}
    for role, (role_extras, _) in image_role.ROLES.items():
        got = _names(image_role.requirements(ROOT / "pyproject.toml", role_extras))
        assert got == base | {n for e in role_extras for n in _names(extras[e])}, role
    client = _names(image_role.requirements(ROOT / "pyproject.toml", image_role.ROLES["client"][0]))
    analyzer = _names(image_role.requirements(ROOT / "pyproject.toml", image_role.ROLES["analyzer"][0]))
    assert not client & server_only and client == base
    assert not analyzer & {"numba", "psycopg", "threadpoolctl"}
    assert analyzer & server_only == {"fastapi", "uvicorn", "prometheus-client"}


def _runs_in(role: str, command: list[str]) -> None:
    """The program a service runs needs no extra beyond its image's role (as the `dpsketch`
    command itself checks before running: tools/cli.py)."""
    name, rest = command[0], command[1:]
    needed = set(cli.COMMANDS[name][2])
    if name in cli.REMOTE_OPTION and any(a.split("=")[0] == cli.REMOTE_OPTION[name] for a in rest):
        needed = set()
    has = set(_image_role().ROLES[role][0])
    assert needed <= has, f"{command[:2]} runs in the {role} image, which lacks the {needed - has} extra"


def test_compose_runs_each_program_from_its_roles_image():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    builders: dict[str, list[str]] = {}
    for name, service in services.items():
        role = IMAGES[service["image"]]
        assert service["pull_policy"] == "never", name
        _runs_in(role, service["command"])
        if "build" in service:
            assert service["build"]["target"] == role and service["build"]["dockerfile"] == "deploy/Dockerfile"
            builders.setdefault(service["image"], []).append(name)
    # every image is built by exactly one service (the others wait for it); none is pulled
    assert {image: len(names) for image, names in builders.items()} == {image: 1 for image in IMAGES}
    assert {services[n]["image"] for n in ("s1", "s2", "s3")} == {"dpsketch-server:local"}
    assert services["analyzer"]["image"] == "dpsketch-analyzer:local"
    assert services["demo"]["image"] == "dpsketch-client:local"


def test_the_swarm_stack_and_kubernetes_run_the_roles_images():
    stack = yaml.safe_load((ROOT / "deploy" / "stack.yml").read_text())["services"]
    ours = {name: s for name, s in stack.items() if s["image"].startswith(("dpsketch-server", "dpsketch-analyzer",
                                                                            "dpsketch-client"))}
    assert set(ours) == {"s1-replica", "s2", "s3", "analyzer"}
    for service in ours.values():
        _runs_in(IMAGES[service["image"]], service["command"])
    k8s = [d for p in sorted((ROOT / "deploy" / "k8s").rglob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
           if d and d.get("kind") in ("Deployment", "StatefulSet")]
    containers = [c for d in k8s for c in d["spec"]["template"]["spec"]["containers"] if c["image"] in IMAGES]
    assert sorted(c["image"] for c in containers) == ["dpsketch-analyzer:local", "dpsketch-server:local"]
    for c in containers:
        _runs_in(IMAGES[c["image"]], c["args"])
    assert "dpsketch:local" not in DOCKERFILE + (ROOT / "docker-compose.yml").read_text()


def test_docker_compose_accepts_the_files():
    """`docker compose config` (the real parser and its interpolation; no engine needed) accepts
    the default file and the HTTP overlay and resolves each service to its role's target."""
    if shutil.which("docker") is None or subprocess.run(["docker", "compose", "version"],
                                                       capture_output=True).returncode != 0:
        unavailable("no docker compose CLI on this machine (the YAML checks above still ran)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPSKETCH_", "COMPOSE_"))}
    env.update({f"S{i}_{kind}_TOKEN": "t" * 32 for i in (1, 2, 3) for kind in ("OPERATOR", "ANALYST")})
    env["ANALYZER_API_TOKEN"] = "t" * 32
    for files in (["-f", "docker-compose.yml"], ["-f", "docker-compose.yml", "-f", "deploy/compose.http.yml"]):
        out = subprocess.run(["docker", "compose", "-p", "dpsketch-config-check", *files, "--profile", "demo",
                              "config", "--format", "json"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        services = yaml.safe_load(out.stdout)["services"]
        targets = {name: (s["image"], s.get("build", {}).get("target")) for name, s in services.items()}
        assert targets == {"s1": ("dpsketch-server:local", "server"), "s2": ("dpsketch-server:local", None),
                           "s3": ("dpsketch-server:local", None), "analyzer": ("dpsketch-analyzer:local", "analyzer"),
                           "demo": ("dpsketch-client:local", "client")}, targets


def _kernel_stage() -> dict[str, Path]:
    """deploy/Dockerfile's kernel-sources stage: module name -> the source file it copies."""
    stage = _stages()["kernel-sources"]
    workdir = next(line.split()[1] for line in stage if line.startswith("WORKDIR "))
    package = Path(workdir).relative_to("/kernels")  # paths in the installed package
    copied: dict[str, Path] = {}
    for line in stage:
        if line.startswith("COPY "):
            *sources, dest = line.split()[1:]
            for source in sources:
                module = (package / dest / Path(source).name).with_suffix("")
                copied[".".join(module.parts)] = ROOT / source
    return copied


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module, not a package
        return False


def _imported_modules(source: Path, module: str) -> set[str]:
    """The dpsketch modules ``source`` (the module ``module``) imports anywhere in it; a package
    itself where it imports a name its ``__init__`` defines."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.rpartition(".")[0])
            targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                       for a in node.names] if base.startswith("dpsketch") else []
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] == "dpsketch")
    return found


def test_the_server_images_kernel_layer_holds_every_loop_it_warms_and_what_they_import(monkeypatch):
    """The server image's numba cache is compiled from the kernel-sources stage alone
    (deploy/image-role.py kernels), so that editing any other source reuses that layer. Every loop
    services/store.warm_install loads must be among those sources (else each fresh container
    compiles it: tests/test_compose.py checks a real image), and each of them may import only the
    others (the packages' __init__ files there are empty ones)."""
    from dpsketch.protocol import kernels
    from dpsketch.services import store

    warmed: list[str] = []

    def record(kernel: kernels.Kernel) -> bool:
        warmed.append(importlib.util.resolve_name(kernel.module, "dpsketch.protocol"))
        return True

    monkeypatch.setattr(kernels.Kernel, "warm_up", record)
    assert store.warm_install() and len(warmed) >= 5, warmed
    copied = _kernel_stage()
    kernel_modules = {m for m in copied if m.rpartition(".")[2].endswith("_kernel")}
    assert kernel_modules == set(warmed), (kernel_modules, warmed)  # nothing compiled in vain either
    for module, source in copied.items():
        assert source.is_file(), source
        assert Path(importlib.util.find_spec(module).origin).resolve() == source.resolve(), module
        assert _imported_modules(source, module) <= set(copied), (module, _imported_modules(source, module))
