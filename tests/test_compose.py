"""The docker compose cluster on a real Docker engine: build, bring up (TLS, the default), use from
the host, survive a share server being killed mid-upload, run the demo service, switch to plain
HTTP, tear down.

The cluster runs from docker-compose.yml, which serves HTTPS by default (issue 41), with
certificates from deploy/make-certs.py, as the README tells an operator to: the host's SDK and
analyzer client verify the servers against the generated CA, the analyzer verifies them from
inside the network, the healthchecks and the demo service verify too. The last test brings the
same project up with the development overlay deploy/compose.http.yml (plain HTTP), on the same
volumes.

Needs root (or a usable engine already) because it installs and starts what is missing:
deploy/ensure-docker.sh (Debian's docker.io + the Compose v2 plugin, dockerd started in the
background and stopped again at the end if this test started it) and deploy/base-image.sh (a local
python:3.11-slim stand-in when no registry can be reached). Skipped, with the reason, when neither
a running engine nor root with apt-get is available, or with DPSKETCH_SKIP_DOCKER=1.

Everything runs under compose project ``dpsketch-test-<pid>`` on free loopback ports, with fresh random
tokens, and is removed with ``down -v`` afterwards. The image build is cached by the engine, so
only the first run on a machine pays for it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.protocol import Study, messages, ring, sketch
from dpsketch.tools.cluster import free_ports
from envguard import unavailable

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
#: one project per test process: two runs on one engine (two checkouts) never share containers
PROJECT = f"dpsketch-test-{os.getpid()}"
TLS = ["-f", "docker-compose.yml"]  # the default
PLAIN = [*TLS, "-f", "deploy/compose.http.yml"]  # the development overlay
SERVERS = ["s1", "s2", "s3"]
COLUMNS = ["x0", "x1", "x2", "x3", "y"]


def _engine_up() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True).returncode == 0


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 900,
         check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n"
                             f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


@dataclass
class ComposeCluster:
    env: dict[str, str]
    ports: list[int]  # analyzer, s1, s2, s3
    analyst_tokens: list[str]
    operator_tokens: list[str]
    api_token: str
    docker: object  # docker.DockerClient
    timings: dict[str, float]
    certs: Path
    files: list[str]  # TLS or PLAIN: the compose files the project is up with

    @property
    def scheme(self) -> str:
        return "https" if self.files == TLS else "http"

    @property
    def analyzer_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.ports[0]}"

    @property
    def server_urls(self) -> list[str]:
        return [f"{self.scheme}://127.0.0.1:{p}" for p in self.ports[1:]]

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What the host's clients verify the cluster with: the generated CA, and nothing else."""
        return ssl.create_default_context(cafile=str(self.certs / "ca.pem")) if self.files == TLS else True

    def analyzer(self) -> AnalyzerClient:
        return AnalyzerClient(self.analyzer_url, self.api_token, verify=self.verify)

    def upload_tokens(self, study_id: str, rows: int) -> list[str]:
        """One token per server for ``rows`` reports, issued with each operator's token, for a
        population of the study's own: the module runs more studies than one population's
        default budget takes (eight default studies, docs/ledger.md), and the demo spends the
        default population's."""
        from dpsketch.services.admin import issue_for_data_owner

        return issue_for_data_owner(list(zip(self.server_urls, self.operator_tokens)), study_id, rows,
                                    verify=self.verify, population=f"test-{study_id[:12]}")

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        return _run(["docker", "compose", "-p", PROJECT, *self.files, *args], env=self.env,
                    timeout=timeout, check=check)

    def container(self, service: str):
        found = self.docker.containers.list(all=True, filters={
            "label": [f"com.docker.compose.project={PROJECT}",
                      f"com.docker.compose.service={service}"]})
        assert len(found) == 1, f"expected one {service} container, found {found}"
        return found[0]

    def wait_healthy(self, services: list[str], timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = {}
            for s in services:
                c = self.container(s)
                c.reload()
                states[s] = c.attrs["State"].get("Health", {}).get("Status", c.status)
            if all(v == "healthy" for v in states.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy after {timeout:.0f} s: {states}")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def compose_cluster(tmp_path_factory):
    if os.environ.get("DPSKETCH_SKIP_DOCKER") == "1":
        unavailable("DPSKETCH_SKIP_DOCKER=1")
    was_up = _engine_up()
    if not was_up:
        if os.geteuid() != 0:
            unavailable("no running Docker engine, and not root: cannot install or start one")
        if shutil.which("dockerd") is None and shutil.which("apt-get") is None:
            unavailable("no Docker engine and no apt-get to install Debian's docker.io")
    docker = pytest.importorskip("docker", reason="the 'docker' Python package (test extra) is missing")

    timings: dict[str, float] = {}
    t0 = time.monotonic()
    _run(["bash", str(DEPLOY / "ensure-docker.sh")], timeout=600)
    started_engine = not was_up
    timings["ensure_docker_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    _run(["bash", str(DEPLOY / "base-image.sh")], timeout=900)
    timings["base_image_s"] = time.monotonic() - t0

    # Certificates as the README makes them. The service keys get mode 0640 and a group that is
    # not the image's own (10001), so the containers read them only through the overlay's
    # group_add; as a non-root user, its own group.
    certs = tmp_path_factory.mktemp("compose-certs")
    key_gid = 23456 if os.geteuid() == 0 else os.getgid()
    _run([sys.executable, str(DEPLOY / "make-certs.py"), str(certs), "--hosts",
          "s1,s2,s3,analyzer,localhost,127.0.0.1", "--key-group", str(key_gid)], timeout=60)

    ports = free_ports(4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPSKETCH_", "COMPOSE_"))}
    env.update(ANALYZER_PORT=str(ports[0]), DPSKETCH_BIND="127.0.0.1", COMPOSE_BAKE="false",
               DEMO_CLIENTS="3000", DPSKETCH_CERTS=str(certs), DPSKETCH_CERTS_GID=str(key_gid))
    analyst_tokens, operator_tokens = [], []
    for i, port in enumerate(ports[1:], start=1):
        env[f"S{i}_PORT"] = str(port)
        env[f"S{i}_OPERATOR_TOKEN"] = op = secrets.token_hex(16)
        env[f"S{i}_ANALYST_TOKEN"] = tok = secrets.token_hex(16)
        analyst_tokens.append(tok)
        operator_tokens.append(op)
    env["ANALYZER_API_TOKEN"] = api_token = secrets.token_hex(16)

    client = docker.from_env(timeout=120)
    cluster = ComposeCluster(env=env, ports=ports, analyst_tokens=analyst_tokens,
                             operator_tokens=operator_tokens, api_token=api_token, docker=client,
                             timings=timings, certs=certs, files=TLS)
    try:
        cluster.compose("--profile", "demo", "down", "-v", "--remove-orphans", timeout=180)  # leftovers
        t0 = time.monotonic()
        cluster.compose("up", "-d", "--build", "--wait", "--wait-timeout", "240", timeout=1200)
        timings["up_build_s"] = time.monotonic() - t0
        cluster.wait_healthy(SERVERS + ["analyzer"])
        yield cluster
    finally:
        try:
            logs = cluster.compose("logs", "--no-color", "--tail", "30", timeout=60, check=False).stdout
            print(f"--- compose logs (tail)\n{logs}")
            t0 = time.monotonic()
            cluster.compose("--profile", "demo", "down", "-v", "--remove-orphans", timeout=300,
                            check=False)
            timings["down_s"] = time.monotonic() - t0
            left = client.volumes.list(filters={"label": f"com.docker.compose.project={PROJECT}"})
            assert not left, f"volumes left behind: {left}"
        finally:
            client.close()
            if started_engine:
                _run(["bash", str(DEPLOY / "ensure-docker.sh"), "--stop"], timeout=120, check=False)
            print(f"compose test timings: {timings}")


def test_build_context_holds_only_what_the_image_copies():
    """The context is the repository root. Its filter must be the root .dockerignore: the legacy
    builder (Debian's docker 20.10, and Compose without buildx) reads no Dockerfile-specific
    ignore file, and then sent .venv (528 MB) and any certs/ or databases to the engine. Checked
    with the docker SDK's own context filter, so no engine is needed."""
    from docker.utils.build import exclude_paths

    ignore = ROOT / ".dockerignore"
    assert ignore.is_file() and not (DEPLOY / "Dockerfile.dockerignore").exists()
    patterns = [line.strip() for line in ignore.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    included = exclude_paths(str(ROOT), patterns, dockerfile="deploy/Dockerfile")
    tops = {path.split("/")[0] for path in included}
    assert tops <= {".dockerignore", "deploy", "pyproject.toml", "README.md", "dpsketch",
                    "client_sdk", "services", "analyzer", "tools"}, tops
    assert not [p for p in included if p.endswith((".pem", ".sqlite3", ".pyc")) or "/." in p
                or p.startswith("deploy/") and p not in ("deploy/Dockerfile", "deploy/image-role.py")]
    # every source the Dockerfile COPYs from the context is still in it
    copied = [line.split()[1] for line in (DEPLOY / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and "--from" not in line]
    assert copied and all(any(p == src or p.startswith(src + "/") for p in included) for src in copied), copied
    size = sum((ROOT / p).stat().st_size for p in included)
    assert size < 5 * 2**20, f"build context is {size / 2**20:.1f} MiB"


def test_image_ships_the_compiled_loops(compose_cluster):
    """A fresh container loads every compiled loop (the sketch hash, running totals, ChaCha20,
    the binding's SHA-256, the index's merges, the validity proofs' field arithmetic) from the
    numba cache the image was built with:
    it compiles none (about 16 s of CPU each time a new volume, replica or replacement task
    opened its first large study) and writes nothing to the cache."""
    out = compose_cluster.docker.containers.run(
        "dpsketch-server:local", entrypoint="python", environment={"NUMBA_DEBUG_CACHE": "1"}, remove=True,
        command=["-c", "from dpsketch.services.store import warm_install; print('ready', warm_install())"]).decode()
    assert "ready True" in out, out[-2000:]
    loaded = [line for line in out.splitlines() if line.startswith("[cache] data loaded from")]
    assert len(loaded) >= 10 and "saved to" not in out, out[-3000:]
    # a container on a CPU the image was not built on loads the loops compiled for a generic CPU
    other = ('import json, os\n'
             'path = os.path.join(os.environ["NUMBA_CACHE_DIR"], "dpsketch-build-cpu.json")\n'
             'built = json.load(open(path))\n'
             'json.dump({"name": "not-" + built["name"], "features": ""}, open(path, "w"))\n'
             'import numba\nfrom dpsketch.services.store import warm_install\n'
             'print("ready", warm_install(), numba.config.CPU_NAME)\n')
    out = compose_cluster.docker.containers.run(
        "dpsketch-server:local", entrypoint="python", environment={"NUMBA_DEBUG_CACHE": "1"}, remove=True,
        command=["-c", other]).decode()
    assert "ready True generic" in out, out[-2000:]
    generic = [line for line in out.splitlines() if line.startswith("[cache] data loaded from")]
    assert len(generic) == len(loaded) and "saved to" not in out, out[-3000:]


#: image -> modules it must hold and modules it must not (its role's libraries only: docs/install.md)
ROLE_MODULES = {
    "dpsketch-server:local": (("fastapi", "uvicorn", "psycopg", "numba", "dpsketch.services.app"), ()),
    "dpsketch-analyzer:local": (("fastapi", "uvicorn", "dpsketch.analyzer.app"), ("numba", "psycopg", "threadpoolctl")),
    "dpsketch-client:local": (("dpsketch.client_sdk", "httpx", "numpy", "scipy", "cryptography", "dpsketch.tools.demo"),
                              ("fastapi", "starlette", "uvicorn", "psycopg", "prometheus_client", "numba")),
}


def test_each_roles_image_holds_its_libraries_and_no_others(compose_cluster):
    """The three images compose builds (deploy/Dockerfile's targets) hold their role's libraries
    and not the others'; the client image is the smallest. Their sizes are printed (docs/install.md
    states them as deploy/build-images.sh measures them)."""
    compose_cluster.compose("--profile", "demo", "build", "demo", timeout=1200)  # the client image
    probe = ("import importlib.util, json, sys; "
             "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in sys.argv[1:]}))")
    sizes = {}
    for image, (present, absent) in ROLE_MODULES.items():
        out = compose_cluster.docker.containers.run(image, entrypoint="python", remove=True,
                                                    command=["-c", probe, *present, *absent]).decode()
        found = json.loads(out)
        assert all(found[m] for m in present) and not any(found[m] for m in absent), (image, found)
        sizes[image] = compose_cluster.docker.images.get(image).attrs["Size"]
    print("image sizes (MB):", {k: round(v / 1e6) for k, v in sizes.items()})
    assert sizes["dpsketch-client:local"] < sizes["dpsketch-analyzer:local"] < sizes["dpsketch-server:local"]


def _regression_rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)  # test data; the privacy noise comes from the SDK's CSPRNG
    X = rng.normal(size=(n, 4))
    y = X @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.1 * rng.normal(size=n)
    A = np.column_stack([X, y])
    return A / np.linalg.norm(A, axis=1).max()


def test_tls_everywhere_and_keys_private(compose_cluster):
    """Every published port speaks HTTPS with a certificate from the generated CA only; each
    container holds its own key and nothing else, and every container is healthy over HTTPS."""
    c = compose_cluster
    for url in [c.analyzer_url, *c.server_urls]:
        assert url.startswith("https://")
        r = httpx.get(f"{url}/healthz", verify=c.verify, timeout=10)
        assert r.status_code == 200, r.text
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/healthz", timeout=10)  # the system trust store: not our CA
        with pytest.raises(httpx.TransportError):
            httpx.get(url.replace("https://", "http://", 1) + "/healthz", timeout=10)
    for service in [*SERVERS, "analyzer"]:
        box = c.container(service)
        box.reload()
        assert box.attrs["State"]["Health"]["Status"] == "healthy"
        # the healthcheck itself verified https against the CA (one of its last checks may have
        # timed out on a loaded machine: the status is what counts, and a pass shows the CA works)
        log = box.attrs["State"]["Health"]["Log"]
        assert any(entry["ExitCode"] == 0 for entry in log), log
        assert box.attrs["Config"]["Env"].count(f"DPSKETCH_HEALTH_URL=https://127.0.0.1:"
                                                f"{8100 if service == 'analyzer' else 8101}/healthz") == 1
        code, out = box.exec_run(["python", "-c", "import os, sys; d = '/run/dpsketch/tls'; "
                                  "print(os.getuid(), sorted(os.listdir(d))); "
                                  "print(all(os.access(os.path.join(d, f), os.R_OK) for f in os.listdir(d)))"])
        assert code == 0, out
        lines = out.decode().splitlines()
        assert lines[0] == f"10001 {sorted(['ca.pem', f'{service}.pem', f'{service}-key.pem'])}", lines
        assert lines[1] == "True", lines  # its own key readable through the group, as uid 10001
    # on the host the keys are owner + group only, and the CA key owner only
    assert (c.certs / "s1-key.pem").stat().st_mode & 0o777 == 0o640
    assert (c.certs / "ca-key.pem").stat().st_mode & 0o777 == 0o600


def test_study_through_published_ports(compose_cluster):
    """Create, submit, finalize, analyse from the host; the shares add up to the release."""
    c = compose_cluster
    n = 3000
    with c.analyzer() as an:
        created = an.create_study(name="compose", columns=COLUMNS, label="y", expected_reports=n,
                                  k=8, s=2, min_reports=n)
        sid = created["study_id"]
        study = Study.model_validate(created["study"])
        assert study.servers == SERVERS and (study.k, study.s, study.d) == (8, 2, 5)
        assert study.server_sigma > 0  # the default floor: each server adds its own noise
        # the servers take uploads only with tokens their operators issue
        with Client(c.server_urls, verify=c.verify) as client:
            with pytest.raises(Exception) as refused:
                client.submit_many(sid, _regression_rows(10, 3))
            assert getattr(refused.value, "status", None) == 401 or "401" in str(refused.value)
        with Client(c.server_urls, verify=c.verify, token=c.upload_tokens(sid, n)) as client:
            result = client.submit_many(sid, _regression_rows(n, 3), batch_size=1000)
        assert result.n_reports == n and set(result.report_counts.values()) == {n}
        fin = an.finalize(sid)
        assert fin["state"] == "released" and fin["n_reports"] == n
        ridge = an.ridge(sid, label="y")
        pca = an.pca(sid, n_components=2)
        released = an.sketch(sid)
    assert ridge["features"] == COLUMNS[:-1] and len(ridge["coef"]) == 4
    assert np.all(np.isfinite(ridge["coef"]))
    comps = np.array(pca["components"])
    np.testing.assert_allclose(comps @ comps.T, np.eye(2), atol=1e-8)

    # the analyst tokens the compose file handed each server guard its aggregate ...
    url0 = f"{c.server_urls[0]}/v1/studies/{sid}/aggregate"
    assert httpx.get(url0, headers={"Authorization": "Bearer wrong"}, verify=c.verify).status_code == 401
    assert httpx.get(url0, headers={"Authorization": f"Bearer {c.analyst_tokens[1]}"},
                     verify=c.verify).status_code == 401
    # ... and the three shares fetched through the published ports add up to the release
    shares, hashes = [], set()
    for url, tok in zip(c.server_urls, c.analyst_tokens):
        r = httpx.get(f"{url}/v1/studies/{sid}/aggregate", headers={"Authorization": f"Bearer {tok}"},
                      verify=c.verify)
        assert r.status_code == 200, r.text
        shares.append(messages.decode_aggregate(r.content, study.k, study.d))
        hashes.add(r.headers[messages.INCLUSION_HASH_HEADER])
    assert hashes == {fin["inclusion_hash"]}
    # the README's host command: the study CLI with the CA file
    listed = _run([sys.executable, "-m", "dpsketch.tools.cli", "study", "--analyzer", c.analyzer_url,
                   "--ca-file", str(c.certs / "ca.pem"), "--token", c.api_token, "list"], timeout=60).stdout
    assert sid in listed
    assert not any(np.array_equal(s, np.zeros_like(s)) for s in shares)
    expected = ring.decode(ring.reconstruct(shares), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(np.array(released["sketch"]), expected)


def test_prometheus_scrapes_the_compose_cluster(compose_cluster, tmp_path):
    """A real Prometheus (Debian's, scripts/ensure-prometheus.sh) scrapes every service of the
    compose cluster through its published port, over TLS with the generated CA and each
    server's operator token, and sees exactly the reports of a known upload (docs/operations.md)."""
    from prom import prometheus_binary, running_prometheus, scrape_job, wait_for

    binary = prometheus_binary()
    c = compose_cluster
    n = 600
    with c.analyzer() as an:
        sid = an.create_study(name="scraped", columns=COLUMNS, label="y", expected_reports=n, k=8, s=2,
                              min_reports=n)["study_id"]
    with Client(c.server_urls, verify=c.verify, token=c.upload_tokens(sid, n)) as client:
        assert client.submit_many(sid, _regression_rows(n, 5), batch_size=200).n_reports == n
    ca = c.certs / "ca.pem" if c.scheme == "https" else None
    jobs = [scrape_job(f"dpsketch-{sid_}", f"127.0.0.1:{port}", tok, labels={"server_id": sid_},
                       scheme=c.scheme, ca_file=ca)
            for sid_, port, tok in zip(SERVERS, c.ports[1:], c.operator_tokens)]
    jobs.append(scrape_job("dpsketch-analyzer", f"127.0.0.1:{c.ports[0]}", c.api_token, scheme=c.scheme,
                           ca_file=ca))
    text = f'dpsketch_reports_total{{study_id="{sid}",outcome="accepted"}}'
    seen: dict = {}

    def done(query) -> bool:
        seen["got"] = {r["metric"]["server_id"]: float(r["value"][1]) for r in query(text)}
        seen["up"] = {r["metric"]["job"]: r["value"][1] for r in query("up")}
        return len(seen["got"]) == 3 and len(seen["up"]) == 4

    with running_prometheus(binary, jobs, tmp_path) as query:
        wait_for(query, done, timeout=60)
    assert seen.get("got") == {s: n for s in SERVERS}, seen
    assert set(seen.get("up", {}).values()) == {"1"}, seen
    # readiness is separate from liveness, and both answer without a token
    for url in [c.analyzer_url, *c.server_urls]:
        assert httpx.get(f"{url}/readyz", verify=c.verify).json() == {"status": "ready"}


class _RecordingTransport(httpx.HTTPTransport):
    """Notes every batch upload a server acknowledged (200), and every failed attempt."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lock = threading.Lock()
        self.acked: dict[int, list[tuple[bytes, str]]] = {}  # port -> (body, media type) acknowledged
        self.errors: dict[int, int] = {}          # port -> transport errors / 5xx seen

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        port = request.url.port
        try:
            resp = super().handle_request(request)
        except httpx.TransportError:
            with self.lock:
                self.errors[port] = self.errors.get(port, 0) + 1
            raise
        with self.lock:
            if resp.status_code >= 500:
                self.errors[port] = self.errors.get(port, 0) + 1
            elif (resp.status_code == 200 and request.method == "POST"
                  and request.url.path.endswith("/batches")):
                self.acked.setdefault(port, []).append((request.content, request.headers["content-type"]))
        return resp

    def acked_ids(self, port: int, d: int) -> set[bytes]:
        """The report ids of the acknowledged batches (full shares or seeds, the SDK's default)."""
        with self.lock:
            bodies = list(self.acked.get(port, []))
        return {rid for body, media_type in bodies
                for rid in messages.decode_upload(body, media_type, d, len(SERVERS)).ids}


def _report_ids(url: str, sid: str, token: str, verify: ssl.SSLContext | bool) -> set[bytes]:
    r = httpx.get(f"{url}/v1/studies/{sid}/report-ids", headers={"Authorization": f"Bearer {token}"},
                  timeout=60, verify=verify)
    assert r.status_code == 200, r.text
    return set(messages.decode_report_ids(r.content))


def test_share_server_killed_mid_upload_keeps_acknowledged_reports(compose_cluster):
    """docker kill s2 during a bulk upload, start it again: nothing it acknowledged is lost, and
    the SDK's retries finish the upload at all three servers."""
    c = compose_cluster
    n, batch = 60_000, 2000  # 30 batches: the kill lands after 8, mid-upload
    victim = 1  # s2
    victim_port = int(c.server_urls[victim].rsplit(":", 1)[1])
    with c.analyzer() as an:
        created = an.create_study(name="compose-kill", columns=COLUMNS, label="y",
                                  expected_reports=n, k=8, s=2, min_reports=n)
    sid = created["study_id"]
    study = Study.model_validate(created["study"])
    box = c.container("s2")
    box.reload()
    started_before = box.attrs["State"]["StartedAt"]

    transport = _RecordingTransport(verify=c.verify)
    uploading = threading.Event()
    killed: dict[str, object] = {}

    def chaos() -> None:
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # wait until s2 has acknowledged a few batches
                with transport.lock:
                    done = len(transport.acked.get(victim_port, []))
                if done >= 8 or not uploading.is_set():
                    break
                time.sleep(0.01)
            killed["acked_before"] = transport.acked_ids(victim_port, study.d)
            killed["upload_running"] = uploading.is_set()
            box.kill()
            killed["at"] = time.monotonic()
            for _ in range(100):  # let it be seen down for a moment (retries in the SDK)
                box.reload()
                if box.status != "running":
                    break
                time.sleep(0.05)
            time.sleep(2.0)
            box.reload()
            if box.status != "running":
                box.start()
            c.wait_healthy(["s2"], timeout=120)
            killed["healthy_again"] = time.monotonic()
        except BaseException as exc:  # reported by the main thread
            killed["error"] = exc

    t_upload = time.monotonic()
    killer = threading.Thread(target=chaos, daemon=True)
    # 20 retries, at most 4 s apart with jitter: 34-68 s for s2 to come back (the container
    # restarts and loads its study; on a loaded test machine 12 retries, 18-36 s, ran out once)
    with Client(c.server_urls, transport=transport, max_retries=20, backoff=0.25,
                max_backoff=4.0, token=c.upload_tokens(sid, n)) as client:
        uploading.set()
        killer.start()
        try:
            result = client.submit_many(sid, _regression_rows(n, 7), batch_size=batch)
        finally:
            uploading.clear()
    killer.join(timeout=180)
    upload_s = time.monotonic() - t_upload
    assert "error" not in killed, killed.get("error")
    assert killed.get("upload_running"), "the upload finished before s2 could be killed"
    assert "healthy_again" in killed
    assert transport.errors.get(victim_port, 0) > 0, "the SDK never saw s2 down"

    box.reload()
    assert box.attrs["State"]["StartedAt"] != started_before  # a new process, same volume
    acked_before: set[bytes] = killed["acked_before"]  # type: ignore[assignment]
    assert len(acked_before) >= 8 * batch
    # the SDK completed the upload everywhere ...
    assert result.n_reports == n and set(result.report_counts.values()) == {n}
    ids = {bytes.fromhex(h) for h in result}
    assert len(ids) == n
    # ... every report s2 acknowledged before the kill survived it, and all servers agree
    held = [_report_ids(url, sid, tok, c.verify) for url, tok in zip(c.server_urls, c.analyst_tokens)]
    assert acked_before <= held[victim]
    for h in held:
        assert h == ids
    with c.analyzer() as an:
        assert [s["report_count"] for s in an.progress(sid)["servers"]] == [n, n, n]
    c.timings["kill_upload_s"] = upload_s
    c.timings["s2_down_s"] = killed["healthy_again"] - killed["at"]  # type: ignore[operator]


def test_compose_refuses_to_start_without_tokens(compose_cluster):
    """No well-known tokens: without the generated ones compose stops before creating anything."""
    c = compose_cluster
    env = {k: v for k, v in c.env.items() if not k.endswith("_TOKEN")}
    for files in (PLAIN, TLS):
        out = _run(["docker", "compose", "--env-file", os.devnull, "-p", "dpsketch-no-tokens", *files, "up", "--no-start"], env=env,
                   check=False, timeout=60)
        assert out.returncode != 0
        assert "make-tokens.sh" in out.stderr, out.stderr[-2000:]
    assert not c.docker.containers.list(all=True, filters={"label": "com.docker.compose.project=dpsketch-no-tokens"})


def _leaked_tokens(c: ComposeCluster) -> tuple[list[int], str]:
    """Which of the cluster's tokens ``docker inspect`` of its containers shows (environment,
    command line, labels: what anyone who can reach the engine's API reads), and that text."""
    boxes = c.docker.containers.list(all=True, filters={"label": f"com.docker.compose.project={PROJECT}"})
    assert len(boxes) >= 4, boxes
    seen = "".join(_run(["docker", "inspect", box.id], timeout=60).stdout for box in boxes)
    hidden = [c.api_token, *c.operator_tokens, *c.analyst_tokens]
    return [i for i, value in enumerate(hidden) if value in seen], seen


def test_tokens_are_secret_files_not_container_config(compose_cluster):
    """Compose hands each token over as a file under /run/secrets: none of the 7 is in any
    container's configuration, and each container holds only its own (a server its two, the
    analyzer the analyst tokens and its API token, no operator token)."""
    c = compose_cluster
    leaked, seen = _leaked_tokens(c)
    assert "--operator-token-file" in seen and "analyst_token_file" in seen  # the text is the config
    assert not leaked, f"tokens {leaked} of 7 readable through docker inspect"
    for j, service in enumerate(SERVERS):
        code, out = c.container(service).exec_run(["sh", "-c", "ls /run/secrets; cat /run/secrets/*"])
        assert code == 0, out
        text = out.decode()
        assert text.split()[:2] == ["analyst_token", "operator_token"], text
        assert c.operator_tokens[j] in text and c.analyst_tokens[j] in text
        others = [t for i, t in enumerate(c.operator_tokens + c.analyst_tokens) if i % 3 != j]
        assert not [t for t in others + [c.api_token] if t in text]
    code, out = c.container("analyzer").exec_run(["sh", "-c", "cat /run/secrets/*"])
    assert code == 0 and all(t in out.decode() for t in [*c.analyst_tokens, c.api_token])
    assert not [t for t in c.operator_tokens if t in out.decode()]


def test_demo_service_prints_its_table(compose_cluster):
    c = compose_cluster
    t0 = time.monotonic()
    out = c.compose("--profile", "demo", "run", "--rm", "demo", timeout=600).stdout
    c.timings["demo_s"] = time.monotonic() - t0
    m = re.search(r"dpsketch demo: n = (\d+) clients, (\d+) share servers", out)
    assert m, out
    assert m.groups() == ("3000", "3")
    assert re.search(r"^task\s+LTM sketch\s+LTM gram\s+local model\s+central model$", out, re.M), out
    for task in ("ridge", "PCA"):
        row = re.search(rf"^{task}\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$", out, re.M)
        assert row, out
        values = [float(v) for v in row.groups()]
        assert all(np.isfinite(v) and v > 0 for v in values), row.group(0)
    # the one-shot container is gone; the cluster is still healthy
    demo_left = c.docker.containers.list(all=True, filters={
        "label": [f"com.docker.compose.project={PROJECT}", "com.docker.compose.service=demo"]})
    assert demo_left == []
    c.wait_healthy(SERVERS + ["analyzer"], timeout=30)


def test_plain_compose_file_serves_http_on_the_same_volumes(compose_cluster):
    """Last: the same project with the development overlay (deploy/compose.http.yml) recreates
    every service on plain HTTP with the healthchecks passing, mounts no certificate, and keeps
    each database (the studies above)."""
    c = compose_cluster
    with c.analyzer() as an:
        before = {s["study_id"] for s in an.studies()}
    assert before
    t0 = time.monotonic()
    c.files = PLAIN
    c.compose("up", "-d", "--wait", "--wait-timeout", "120", timeout=300)
    c.timings["switch_to_plain_s"] = time.monotonic() - t0
    c.wait_healthy(SERVERS + ["analyzer"], timeout=30)
    for url in [c.analyzer_url, *c.server_urls]:
        assert url.startswith("http://")
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    with c.analyzer() as an:
        assert {s["study_id"] for s in an.studies()} == before
        created = an.create_study(name="compose-plain", columns=COLUMNS, label="y",
                                  expected_reports=2000, k=8, s=2, min_reports=2000)
        with Client(c.server_urls, token=c.upload_tokens(created["study_id"], 2000)) as client:
            result = client.submit_many(created["study_id"], _regression_rows(2000, 11), batch_size=1000)
        assert set(result.report_counts.values()) == {2000}
        assert an.finalize(created["study_id"])["state"] == "released"
    assert c.container("s1").exec_run(["ls", "/run/dpsketch"]).exit_code != 0  # no certificates
    assert _leaked_tokens(c)[0] == []  # the plain overlay hands the tokens over as files too


# --- the replicated layout as a Docker Swarm stack ---------------------------------------------

STACK = f"dpsketch-swarm-{os.getpid()}"


def _stack_tasks(service: str, running_only: bool = True) -> list[dict]:
    """The service's tasks; with ``running_only=False`` also those that ended (the history)."""
    which = ["--filter", "desired-state=running"] if running_only else []
    out = _run(["docker", "service", "ps", f"{STACK}_{service}", "--no-trunc", "--format", "{{json .}}",
                *which], timeout=60, check=False).stdout
    import json

    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _wait_http(url: str, timeout: float = 240, verify: ssl.SSLContext | bool = True) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2, verify=verify).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer 200 within {timeout:.0f} s")
        time.sleep(0.5)


REPLICATED_IMAGES = [("dpsketch-postgres:local", "deploy/replicated/postgres.Dockerfile"),
                     ("dpsketch-lb:local", "deploy/replicated/lb.Dockerfile")]


def test_replicated_images_stop_on_their_stop_signal(compose_cluster):
    """docker stop (and stack rm, and a rolling update) sends an image's stop signal and kills
    what is still running after the grace period. haproxy as PID 1 has no SIGTERM handler, and
    SIGTERM is PostgreSQL's smart shutdown, which waits for every client: both used to be killed
    (exit 137; the database then recovers from a crash at its next start). Each stops by itself
    now, the database with a client still in a query."""
    for tag, dockerfile in REPLICATED_IMAGES:
        _run(["docker", "build", "-q", "-t", tag, "-f", dockerfile, "deploy/replicated"], timeout=900)
    name = f"dpsketch-stop-{os.getpid()}"
    try:
        _run(["docker", "run", "-d", "--name", f"{name}-db", "-e", "POSTGRES_PASSWORD=x", REPLICATED_IMAGES[0][0]],
             timeout=120)
        _run(["docker", "run", "-d", "--name", f"{name}-lb", "--add-host", "s1-replica:127.0.0.1",
              REPLICATED_IMAGES[1][0]], timeout=120)
        deadline = time.monotonic() + 120
        while _run(["docker", "exec", f"{name}-db", "pg_isready", "-h", "127.0.0.1", "-q"], timeout=60,
                   check=False).returncode != 0:
            assert time.monotonic() < deadline, "PostgreSQL did not start"
            time.sleep(0.5)
        _run(["docker", "exec", "-d", f"{name}-db", "psql", "-U", "postgres", "-c", "SELECT pg_sleep(600)"], timeout=60)
        time.sleep(1)  # the session is in its query
        for box in (f"{name}-db", f"{name}-lb"):
            _run(["docker", "stop", "-t", "20", box], timeout=120)
            state = _run(["docker", "inspect", "-f", "{{.State.ExitCode}}", box], timeout=60).stdout.strip()
            assert state == "0", f"{box} exited {state} (137: killed after the grace period)"
        logs = _run(["docker", "logs", f"{name}-db"], timeout=60).stdout + _run(
            ["docker", "logs", f"{name}-db"], timeout=60).stderr
        assert "fast shutdown request" in logs and "database system is shut down" in logs, logs[-2000:]
    finally:
        _run(["docker", "rm", "-f", f"{name}-db", f"{name}-lb"], timeout=120, check=False)


def test_swarm_stack_with_replicas(compose_cluster, tmp_path):
    """deploy/stack.yml on a one-node swarm (the engine's swarm mode): s1 as two replicas on its
    own PostgreSQL behind haproxy, built from the same base image. A study goes through the
    published ports while one s1 replica container is killed mid-upload: swarm replaces it,
    every report s1 acknowledged is held once, and the study releases over all of them. The
    tokens and the database password travel as swarm secrets (deploy/make-secrets.sh): what
    `docker service inspect` and `docker inspect` show of every service and task holds none.
    Every service serves HTTPS with the compose cluster's certificates (issue 41: TLS on by
    default; haproxy passes s1's TLS through to the replicas), verified here against its CA."""
    c = compose_cluster
    t0 = time.monotonic()

    def phase(name: str) -> None:  # shown with the failure's captured output: where the time went
        print(f"[swarm] {name}: {time.monotonic() - t0:.1f} s", flush=True)

    for tag, dockerfile in REPLICATED_IMAGES:
        _run(["docker", "build", "-q", "-t", tag, "-f", dockerfile, "deploy/replicated"], timeout=900)
    state = _run(["docker", "info", "--format", "{{.Swarm.LocalNodeState}}"], timeout=30).stdout.strip()
    joined = state != "active"
    phase("images built")
    if joined:
        _run(["docker", "swarm", "init", "--advertise-addr", "127.0.0.1"], timeout=120)
    phase("swarm ready")
    ports = free_ports(4)
    env = {k: v for k, v in c.env.items() if not k.endswith("_PORT")}
    db_password = secrets.token_hex(16)
    secrets_dir = tmp_path / "secrets"
    _run(["bash", "deploy/make-secrets.sh", str(secrets_dir)], env={**env, "S1_DB_PASSWORD": db_password}, timeout=60)
    assert oct(secrets_dir.stat().st_mode & 0o777) == "0o700"
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in secrets_dir.iterdir())
    # the stack is deployed without a token or password in its environment: only the files
    env = {k: v for k, v in env.items() if not (k.endswith("_TOKEN") or k.endswith("_PASSWORD"))}
    env.update(ANALYZER_PORT=str(ports[0]), S1_PORT=str(ports[1]), S2_PORT=str(ports[2]),
               S3_PORT=str(ports[3]), DPSKETCH_SECRETS_DIR=str(secrets_dir), DPSKETCH_CERTS=str(c.certs))
    hidden = [db_password, c.api_token, *c.operator_tokens, *c.analyst_tokens]
    urls = [f"https://127.0.0.1:{p}" for p in ports[1:]]
    analyzer_url = f"https://127.0.0.1:{ports[0]}"
    ca = ssl.create_default_context(cafile=str(c.certs / "ca.pem"))
    try:
        _run(["docker", "stack", "deploy", "-c", "deploy/stack.yml", STACK], env=env, timeout=300)
        phase("stack deployed")
        for url in urls + [analyzer_url]:
            _wait_http(url + "/healthz", verify=ca)
        _wait_http(urls[0] + "/readyz", verify=ca)
        deadline = time.monotonic() + 180
        while len([t for t in _stack_tasks("s1-replica") if t["CurrentState"].startswith("Running")]) < 2:
            assert time.monotonic() < deadline, _stack_tasks("s1-replica")
            time.sleep(1)

        phase("services healthy")
        # the replicas started with their database and waited for it (--db-wait): none exited
        # to be replaced (before the wait, two or three tasks failed here at every deploy)
        history = _stack_tasks("s1-replica", running_only=False)
        assert len(history) == 2, [(t["Name"], t["CurrentState"], t["Error"]) for t in history]
        # nothing a reader of the swarm's API sees holds a secret: the services' specs, and the
        # running containers' configuration (environment, command line)
        services = _run(["docker", "service", "ls", "-q", "--filter", f"name={STACK}_"], timeout=60).stdout.split()
        assert len(services) == 6, services  # s1-db, s1-replica, s1 (haproxy), s2, s3, analyzer
        seen = _run(["docker", "service", "inspect", *services], timeout=60).stdout
        seen += "".join(_run(["docker", "inspect", box.id], timeout=60).stdout for box in c.docker.containers.list(
            sparse=True, filters={"label": f"com.docker.stack.namespace={STACK}"}))
        assert "/run/secrets/s1_pgpass" in seen and "--operator-token-file" in seen
        leaked = [i for i, value in enumerate(hidden) if value in seen]
        assert not leaked, f"secrets {leaked} of {len(hidden)} readable through docker inspect"
        # 30 batches of 200 rows: the kill lands mid-upload (after 6 acknowledged batches), and
        # the upload through the swarm (PostgreSQL behind haproxy) stays short
        n, batch = 6_000, 200
        with AnalyzerClient(analyzer_url, c.api_token, verify=ca) as an:
            created = an.create_study(name="swarm", columns=COLUMNS, label="y", expected_reports=n,
                                      k=8, s=2, min_reports=n)
        sid = created["study_id"]
        study = Study.model_validate(created["study"])
        from dpsketch.services.admin import issue_for_data_owner

        tokens = issue_for_data_owner(list(zip(urls, c.operator_tokens)), sid, n, verify=ca,
                                      population=f"test-{sid[:12]}")
        s1_port = ports[1]
        transport = _RecordingTransport(verify=ca)
        killed: dict[str, object] = {}

        def chaos() -> None:
            try:
                # generous: on a loaded 2-core machine the swarm's first batches can take minutes
                deadline = time.monotonic() + 600
                while len(transport.acked.get(s1_port, [])) < 6:
                    if time.monotonic() > deadline:
                        raise AssertionError("s1 acknowledged fewer than 6 batches in 600 s")
                    time.sleep(0.01)
                killed["acked_before"] = transport.acked_ids(s1_port, study.d)
                boxes = c.docker.containers.list(sparse=True, filters={
                    "label": f"com.docker.swarm.service.name={STACK}_s1-replica", "status": "running"})
                killed["replicas_seen"] = len(boxes)
                boxes[0].kill()
                killed["id"] = boxes[0].id
            except BaseException as exc:
                killed["error"] = exc

        killer = threading.Thread(target=chaos, daemon=True)
        with Client(urls, transport=transport, max_retries=12, backoff=0.25, max_backoff=4.0,
                    token=tokens) as client:
            killer.start()
            result = client.submit_many(sid, _regression_rows(n, 11), batch_size=batch)
        killer.join(timeout=180)
        phase("uploaded")
        assert "error" not in killed, killed.get("error")
        assert killed.get("replicas_seen") == 2 and "id" in killed, killed
        assert result.n_reports == n and set(result.report_counts.values()) == {n}
        ids = {bytes.fromhex(h) for h in result}
        held = [_report_ids(url, sid, tok, ca) for url, tok in zip(urls, c.analyst_tokens)]
        acked_before: set[bytes] = killed["acked_before"]  # type: ignore[assignment]
        assert len(acked_before) >= 6 * batch and acked_before <= held[0]
        assert all(h == ids for h in held)
        with AnalyzerClient(analyzer_url, c.api_token, verify=ca) as an:
            fin = an.finalize(sid)
            assert fin["state"] == "released" and fin["n_reports"] == n
        phase("finalized")
        deadline = time.monotonic() + 180  # swarm replaced the killed replica
        while True:
            running = [t for t in _stack_tasks("s1-replica") if t["CurrentState"].startswith("Running")]
            if len(running) == 2:
                break
            assert time.monotonic() < deadline, _stack_tasks("s1-replica")
            time.sleep(1)
        bodies = {httpx.get(f"{urls[0]}/v1/studies/{sid}/aggregate", timeout=30, verify=ca,
                            headers={"Authorization": f"Bearer {c.analyst_tokens[0]}"}).content
                  for _ in range(4)}  # round robin over both replicas: one release
        assert len(bodies) == 1
        phase("replica replaced, one release")
    finally:
        _run(["docker", "stack", "rm", STACK], timeout=120, check=False)
        deadline = time.monotonic() + 120
        # sparse: no inspect of each container, which races with swarm removing them (404)
        while c.docker.containers.list(all=True, sparse=True,
                                       filters={"label": f"com.docker.stack.namespace={STACK}"}):
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        left = _run(["docker", "secret", "ls", "-q", "--filter", f"label=com.docker.stack.namespace={STACK}"],
                    timeout=60, check=False).stdout.split()
        if left:  # stack rm removes them; a failed deploy may leave some
            _run(["docker", "secret", "rm", *left], timeout=60, check=False)
        for volume in c.docker.volumes.list(filters={"label": f"com.docker.stack.namespace={STACK}"}):
            try:
                volume.remove(force=True)
            except Exception:  # noqa: BLE001 - a volume still in use is reported by the next run
                pass
        phase("stack removed")
        if joined:
            _run(["docker", "swarm", "leave", "--force"], timeout=120, check=False)
        phase("done")
