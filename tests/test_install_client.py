"""`pip install dpsketch` is the client, and the client alone submits to real servers.

The wheel is built from this tree (``pip wheel --no-deps --no-build-isolation``, setuptools from
the test extra) and installed WITHOUT extras into a fresh virtual environment, away from the
source tree. Then, in that environment's own Python:

* none of the server's libraries is there (fastapi, starlette, uvicorn, psycopg,
  prometheus_client) and neither is numba (the client runs its reference code; docs/install.md);
* ``dpsketch server`` says in one line which extra to install, with no traceback;
* the SDK submits rows to a live cluster of real share servers and a real analyzer started by
  this test (from the repository's own environment), without a warning about numba, and after
  finalization every server has committed exactly the reports the installed client returned:
  the same count, the same inclusion hash over the same ids.

The fresh environment's dependencies come from a wheelhouse kept between runs
(``$DPSKETCH_WHEELHOUSE``, default ~/.cache/dpsketch/client-wheelhouse): the first run fills it
from PyPI with ``pip download`` (network, bounded by timeouts), later runs install offline
(``--no-index``) in seconds. Without PyPI on a first run the test skips, or fails under CI
(tests/envguard.py), with pip's last lines; it never hangs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
import dpsketch
from conftest import Cluster, Servers
from dpsketch.protocol import messages
from envguard import unavailable

ROOT = Path(__file__).resolve().parents[1]
#: what the wheel is built from (nothing else of the tree: no tests, no stale build/ directory)
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "dpsketch", "client_sdk", "services", "analyzer", "tools")
#: modules that belong to the server, analyzer or fast extras, never to the client's install
#: the runtime parts' folder names, which the wheel installs only as dpsketch.<name>
BARE_NAMES = ("services", "analyzer", "client_sdk", "tools")
NOT_IN_THE_CLIENT = ("fastapi", "starlette", "uvicorn", "psycopg", "prometheus_client", "numba")
WHEELHOUSE = Path(os.environ.get("DPSKETCH_WHEELHOUSE", Path.home() / ".cache" / "dpsketch" / "client-wheelhouse"))
N_ROWS = 400
COLUMNS = ["x0", "x1", "y"]

#: the installed client's side: submit a CSV with the SDK, print the report ids it returns
SUBMIT = """
import json, sys
import dpsketch.client_sdk
from dpsketch.client_sdk import Client
study_id, csv_path, urls = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
with Client(urls) as client:
    ids = client.submit_many(study_id, csv_path)
print(json.dumps({"sdk": dpsketch.client_sdk.__file__, "ids": list(ids)}))
"""


def _run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def _pip(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """The repository environment's pip (it can drive another environment with --python)."""
    return _run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], timeout)


@pytest.fixture(scope="module")
def client_env(tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel built from this tree, without extras;
    returns its bin directory."""
    work = tmp_path_factory.mktemp("client-install")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(
            ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                        if (ROOT / name).is_dir() else {}))
    built = _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"), str(src),
                 timeout=180)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("dpsketch-*.whl")
    venv = work / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], 120)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    install = ("--python", str(python), "install", "-q", "--no-compile", "--no-index", "--find-links", str(WHEELHOUSE), str(wheel))
    done = _pip(*install, timeout=240)
    if done.returncode != 0:  # a first run, or the requirements changed: fill the wheelhouse
        try:
            fetched = _pip("download", "-q", "--timeout", "30", "--retries", "2", "--only-binary", ":all:",
                           "-d", str(WHEELHOUSE), str(wheel), timeout=420)
        except subprocess.TimeoutExpired:
            unavailable("pip download from PyPI took over 7 minutes (is PyPI reachable?)")
        if fetched.returncode != 0:
            unavailable(f"cannot fetch the client's dependencies from PyPI: {fetched.stderr.strip()[-800:]}")
        for copy in WHEELHOUSE.glob("dpsketch-*.whl"):  # pip download copies the wheel too
            copy.unlink()
        done = _pip(*install, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv / "bin"


def test_the_client_install_has_none_of_the_server_libraries(client_env):
    probe = _run([str(client_env / "python"), "-c",
                  "import importlib.util, json, sys; "
                  "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in sys.argv[1:]}))",
                  *NOT_IN_THE_CLIENT, *BARE_NAMES, "numpy", "httpx", "cryptography", "pydantic", "dpsketch.client_sdk"],
                 60, cwd="/")
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert not any(found[m] for m in NOT_IN_THE_CLIENT), found
    # one namespace: the wheel puts no generic top-level package into site-packages (issue 42)
    assert not any(found[m] for m in BARE_NAMES), found
    assert all(found[m] for m in ("numpy", "httpx", "cryptography", "pydantic", "dpsketch.client_sdk")), found


def test_the_installed_version_is_the_trees_one(client_env):
    """The wheel's metadata and the installed `dpsketch --version` both say dpsketch.__version__
    (pyproject.toml reads it: docs/install.md, "Versions and releases")."""
    out = _run([str(client_env / "dpsketch"), "--version"], 60, cwd="/")
    assert out.returncode == 0 and out.stdout == f"dpsketch {dpsketch.__version__}\n", (out.stdout, out.stderr)
    meta = _run([str(client_env / "python"), "-c", "from importlib.metadata import version; print(version('dpsketch'))"],
                60, cwd="/")
    assert meta.returncode == 0 and meta.stdout.strip() == dpsketch.__version__, (meta.stdout, meta.stderr)


def test_a_server_command_names_the_extra_in_one_line(client_env, tmp_path):
    out = _run([str(client_env / "dpsketch"), "server", "--server-id", "s1", "--db", str(tmp_path / "s1.db")],
               60, cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "pip install 'dpsketch[server]'" in out.stderr and "fastapi" in out.stderr, out.stderr
    assert not (tmp_path / "s1.db").exists()  # nothing started
    # help needs no extra; the client's own command runs (its usage, without the server's libraries)
    assert _run([str(client_env / "dpsketch"), "server", "--help"], 60, cwd=tmp_path).returncode == 0
    assert _run([str(client_env / "dpsketch"), "submit", "--help"], 60, cwd=tmp_path).returncode == 0


def test_the_research_harness_is_not_installed_and_its_command_says_so(client_env, tmp_path):
    probe = _run([str(client_env / "python"), "-c", "import importlib.util; print(importlib.util.find_spec('research'))"],
                 60, cwd="/")
    assert probe.returncode == 0 and probe.stdout.strip() == "None", (probe.stdout, probe.stderr)
    out = _run([str(client_env / "dpsketch"), "experiments", "--quick", "--out", str(tmp_path / "out")], 60,
               cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr and "source checkout" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()  # nothing ran


def test_the_installed_client_submits_to_a_live_cluster(client_env, tmp_path):
    pool = Servers(tmp_path)
    try:
        cluster = Cluster(pool, 3, api_token="analyst-api-token")
        with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as an:
            # min_reports 0.9 N_ROWS, not N_ROWS: the sketch seed and the report ids are fresh
            # each run, and with all 400 reports at exactly min_reports = 400 (k = 8) the
            # certificate refused 1 of 1000 simulated draws (lambda_min / lambda_star 0.985 at
            # worst); at min_reports 360, 0 of 2000 (1.10 at worst, 1.36 +- 0.07)
            created = an.create_study(name="client-install", columns=COLUMNS, label="y",
                                      expected_reports=N_ROWS, k=8, s=2, min_reports=N_ROWS * 9 // 10)
        study_id = created["study_id"]
        rows = np.random.default_rng(3).uniform(-0.5, 0.5, size=(N_ROWS, len(COLUMNS)))  # test data
        csv_path = tmp_path / "rows.csv"
        np.savetxt(csv_path, rows, delimiter=",", header=",".join(COLUMNS), comments="")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        sent = _run([str(client_env / "python"), "-c", SUBMIT, study_id, str(csv_path),
                     ",".join(cluster.server_urls)], 240, cwd=tmp_path, env=env)
        assert sent.returncode == 0, sent.stderr[-3000:]
        # no numba is the client's normal state, not a fault: the seed expansion's loop (which the
        # SDK tries to load as it opens the study) falls back without a warning or a traceback
        assert "Traceback" not in sent.stderr and "compiled loop" not in sent.stderr, sent.stderr[-3000:]
        result = json.loads(sent.stdout.strip().splitlines()[-1])
        # the installed copy ran, not this tree's
        assert Path(result["sdk"]).resolve().is_relative_to(client_env.parent.resolve()), result["sdk"]
        ids = result["ids"]
        assert len(ids) == len(set(ids)) == N_ROWS
        with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as an:
            assert [s["report_count"] for s in an.progress(study_id)["servers"]] == [N_ROWS] * 3
            fin = an.finalize(study_id)
        assert fin["state"] == "released" and fin["n_reports"] == N_ROWS
        # every server committed exactly the reports the installed client said it sent
        assert fin["inclusion_hash"] == messages.inclusion_hash(sorted(bytes.fromhex(i) for i in ids))
    finally:
        pool.stop_all()
