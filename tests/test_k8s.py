"""The Kubernetes manifests (deploy/k8s) agree with the code they deploy.

No Kubernetes cluster runs here, so these checks are what is tested (docs/operations.md says the
same): every manifest parses, every kustomization names files that exist, every secret and
config key a pod reads is one its overlay generates, the dpsketch containers' arguments parse
with the real command-line parsers, every environment variable they set is one the code reads,
the probes' paths answer on a real app (liveness 200, readiness 200 when the database answers),
the pods run as the image's user, and a share server runs two replicas on its PostgreSQL store
with a rolling update that keeps one serving."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
ORGS = ["s1", "s2", "s3"]


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _manifests() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def _workloads(base: str) -> list[dict]:
    return [d for p in sorted((K8S / base).glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in _docs(p) if d["kind"] in ("Deployment", "StatefulSet")]


#: each base's dpsketch image: the role's own target of deploy/Dockerfile (deploy/build-images.sh)
IMAGES = {"share-server": "dpsketch-server:local", "analyzer": "dpsketch-analyzer:local"}


def _containers(base: str) -> list[dict]:
    return [c for w in _workloads(base) for c in w["spec"]["template"]["spec"]["containers"]
            if c["image"] == IMAGES[base]]


def _env_file_keys(path: Path) -> set[str]:
    example = path.with_name(path.name + ".example")
    assert example.exists(), f"{path.relative_to(ROOT)} has no committed .example showing its keys"
    return {line.split("=", 1)[0].strip() for line in example.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")}


def _generated(kustomization: Path) -> dict[tuple[str, str], set[str]]:
    """(kind, name) -> keys of the ConfigMaps and Secrets an overlay generates."""
    k = yaml.safe_load(kustomization.read_text())
    out: dict[tuple[str, str], set[str]] = {}
    for kind, field in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for gen in k.get(field, []):
            keys = {lit.split("=", 1)[0] for lit in gen.get("literals", [])}
            for env in gen.get("envs", []):
                keys |= _env_file_keys(kustomization.parent / env)
            for f in gen.get("files", []):
                assert (kustomization.parent / (f + ".example")).exists(), f
                keys.add(f)
            out[(kind, gen["name"])] = keys
    return out


def test_every_manifest_parses_and_every_kustomization_resolves():
    files = _manifests()
    assert len(files) >= 6
    for path in files:
        for doc in _docs(path):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
            assert doc["metadata"].get("name"), path
    for k in K8S.rglob("kustomization.yaml"):
        spec = yaml.safe_load(k.read_text())
        for res in spec.get("resources", []):
            assert (k.parent / res).exists(), f"{k}: {res} missing"


@pytest.mark.parametrize("org", ORGS)
def test_each_org_overlay_provides_every_key_its_pods_read(org):
    overlay = K8S / "orgs" / org
    generated = _generated(overlay / "kustomization.yaml")
    assert generated[("ConfigMap", "share-server")] == {"server-id"}
    assert f"server-id={org}" in (overlay / "kustomization.yaml").read_text()
    ns = _docs(overlay / "namespace.yaml")[0]
    assert ns["metadata"]["name"] == yaml.safe_load((overlay / "kustomization.yaml").read_text())["namespace"]
    for workload in _workloads("share-server"):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {})
                for kind, field in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                    if field in ref:
                        key = (kind, ref[field]["name"])
                        assert key in generated, f"{org}: {c['name']} reads {key}, not generated"
                        assert ref[field]["key"] in generated[key], (org, c["name"], ref[field])


def test_analyzer_overlay_mounts_the_cluster_secret_it_generates():
    generated = _generated(K8S / "analyzer" / "kustomization.yaml")
    (c,) = _containers("analyzer")
    volumes = {v["name"]: v for w in _workloads("analyzer") for v in w["spec"]["template"]["spec"]["volumes"]}
    secret = volumes["cluster"]["secret"]["secretName"]
    assert ("Secret", secret) in generated and "cluster.json" in generated[("Secret", secret)]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "cluster")
    assert c["args"][c["args"].index("--config") + 1] == mount["mountPath"] + "/cluster.json"
    # the example is a configuration the analyzer accepts (same parser as --config)
    from dpsketch.analyzer.config import ClusterConfig

    example = (K8S / "analyzer" / "cluster.json.example").read_text()
    config = ClusterConfig.model_validate_json(example)
    assert [s.server_id for s in config.servers] == ORGS


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_container_arguments_parse_with_the_real_command_line():
    from dpsketch.analyzer.__main__ import build_parser as analyzer_parser
    from dpsketch.services.__main__ import build_parser as server_parser

    (server,) = _containers("share-server")
    env = {e["name"]: "s1" for e in server["env"]}
    args = _expand(server["args"], env)
    assert args[0] == "server"
    parsed = server_parser().parse_args(args[1:] + ["--db", "postgresql://dpsketch@share-db:5432/dpsketch"])
    assert parsed.server_id == "s1" and parsed.port == 8101
    assert server["ports"][0]["containerPort"] == parsed.port
    (analyzer,) = _containers("analyzer")
    assert analyzer["args"][0] == "analyzer"
    parsed = analyzer_parser().parse_args(analyzer["args"][1:])
    assert parsed.port == analyzer["ports"][0]["containerPort"] == 8100


def test_every_environment_variable_is_one_the_code_reads():
    sources = "\n".join(p.read_text() for d in ("services", "analyzer", "dpsketch")
                        for p in (ROOT / d).rglob("*.py"))
    (server,) = _containers("share-server")
    for env in server["env"]:
        name = env["name"]
        if name == "PGPASSWORD":  # read by libpq itself (psycopg), not by our code
            continue
        used_in_args = any(f"$({name})" in a for a in server["args"])
        assert used_in_args or f'"{name}"' in sources, f"{name} is read by nothing"


def test_pods_run_as_the_images_user_and_a_share_server_runs_replicas_on_postgres():
    uid = int(re.search(r"--uid (\d+)", (ROOT / "deploy" / "Dockerfile").read_text()).group(1))
    for base in ("share-server", "analyzer"):
        for w in _workloads(base):
            spec = w["spec"]["template"]["spec"]
            if any(c["image"] == IMAGES[base] for c in spec["containers"]):
                assert spec["securityContext"]["runAsUser"] == uid
                assert spec["securityContext"]["runAsNonRoot"] is True
    (deployment,) = [w for w in _workloads("share-server") if w["kind"] == "Deployment"]
    # replicas share one PostgreSQL store (tests/test_replicas.py); a rolling update keeps one serving
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    env = {e["name"]: e for c in deployment["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
    args = [a for c in deployment["spec"]["template"]["spec"]["containers"] for a in c.get("args", [])]
    assert "DPSKETCH_DB" in env or any(a.startswith("postgresql://") for a in args)


def test_probe_paths_answer_on_a_real_app(tmp_path):
    from fastapi.testclient import TestClient

    from dpsketch.services.app import create_app
    from dpsketch.services.settings import Settings

    (server,) = _containers("share-server")
    paths = {server[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert paths == {"/healthz", "/readyz"}
    settings = Settings(server_id="s1", db_path=tmp_path / "s1.sqlite3", operator_token="op-" + "1" * 16,
                        analyst_token="an-" + "2" * 16)
    with TestClient(create_app(settings)) as client:
        for path in paths:
            assert client.get(path).status_code == 200, path


def test_the_startup_allowances_outlast_the_database_wait():
    """A share server waits up to --db-wait for its PostgreSQL before it listens (services/pg.py):
    the k8s startupProbe and the swarm healthcheck must not restart it sooner, or a pod started
    beside its database would be killed while it waits, as it was restarted before the wait."""
    from dpsketch.services.__main__ import build_parser

    (server,) = _containers("share-server")
    env = {e["name"]: "s1" for e in server["env"]}
    args = _expand(server["args"], env)[1:] + ["--db", "postgresql://dpsketch@share-db:5432/dpsketch"]
    wait = float(build_parser().parse_args(args).db_wait_s)
    assert wait >= 30  # long enough for a database container's first start
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= wait + 30, startup

    stack = yaml.safe_load((ROOT / "deploy" / "stack.yml").read_text())
    health = stack["services"]["s1-replica"]["healthcheck"]
    seconds = {k: float(str(health[k]).removesuffix("s")) for k in ("start_period", "interval")}
    # failures in the start period do not count; after it, `retries` more before the task is replaced
    assert seconds["start_period"] + seconds["interval"] * health["retries"] >= wait + 30, health


def test_the_pods_serve_https_only():
    """TLS is on by default (issue 41): every dpsketch container serves HTTPS with a mounted
    certificate, its probes speak HTTPS, and the analyzer reaches the servers over https with a
    CA to verify them against."""
    from dpsketch.analyzer.config import ClusterConfig

    for base in ("share-server", "analyzer"):
        (c,) = _containers(base)
        args = c["args"]
        cert = args[args.index("--ssl-certfile") + 1]
        assert args[args.index("--ssl-keyfile") + 1].startswith("/run/dpsketch/tls/")
        assert any(m["name"] == "tls" and cert.startswith(m["mountPath"]) for m in c["volumeMounts"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["scheme"] == "HTTPS", (base, probe)
        assert [p["name"] for p in c["ports"]] == ["https"]
    config = ClusterConfig.model_validate_json((K8S / "analyzer" / "cluster.json.example").read_text())
    assert all(s.url.startswith("https://") for s in config.servers) and config.ca_file
