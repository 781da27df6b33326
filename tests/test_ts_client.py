"""The TypeScript client (clients/typescript) against the product, over real processes.

(a) The package builds with tsc and its own tests pass under ``node --test``: every conformance
vector a client needs (study ids, ring, sketch, noise sampler and secret sign, whole batches,
binding, bounds, sealing of both suites), reproduced by code written from docs/protocol.md.
(b) Three real share servers and a real analyzer: a Node process using the package submits rows
to a sketch study (sealed classical, sealed post-quantum and plain, seed-compressed with the full
share rotating, upload tokens), the Python SDK submits other rows to the same study, and the
release equals S(A + G) over both clients' encoded rows bit for bit (no server noise: the
no-floor policy of test_e2e). Resubmitting with the same submission secret stores nothing new.
Needs Node 20+ and npm (dependencies from the npm registry, cached in clients/typescript/
node_modules by scripts/install.sh); the test fails, not skips, without them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from analyzer.client import AnalyzerClient
from client_sdk.prepare import prepare_batch
from conftest import cluster_for_module
from dpsketch.protocol import Study, messages, ring, sketch
from test_e2e import NO_FLOOR_POLICY, direct_sketch

PACKAGE = Path(__file__).resolve().parent.parent / "clients" / "typescript"
COLUMNS = ["x0", "x1", "x2", "x3", "y"]


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=PACKAGE, capture_output=True, text=True, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def built_package() -> Path:
    """The package's dependencies (npm ci, once: node_modules is kept) and its build."""
    assert shutil.which("node") and shutil.which("npm"), "the TypeScript client needs node and npm"
    major = int(_run(["node", "-p", "process.versions.node.split('.')[0]"]).stdout)
    assert major >= 20, f"Node 20+ needed, found {major}"
    lock = PACKAGE / "package-lock.json"
    stamp = PACKAGE / "node_modules" / ".package-lock.json"
    if not stamp.exists() or stamp.stat().st_mtime < lock.stat().st_mtime:
        r = _run(["npm", "ci", "--no-audit", "--no-fund"])
        assert r.returncode == 0, r.stderr[-2000:]
    r = _run(["npx", "tsc", "-p", "tsconfig.test.json"])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    r = _run(["npx", "tsc", "-p", "tsconfig.json"])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return PACKAGE


def test_node_test_runner_reproduces_the_vectors(built_package):
    r = _run(["node", "--test", "dist-test/test/"])
    assert r.returncode == 0, r.stdout[-6000:]
    summary = {line.split()[1]: int(line.split()[2]) for line in r.stdout.splitlines()
               if line.startswith("# ") and len(line.split()) == 3 and line.split()[2].isdigit()}
    assert summary["fail"] == 0 and summary["pass"] == summary["tests"] >= 60, summary


@pytest.fixture(scope="module")
def exact_cluster(tmp_path_factory):
    with cluster_for_module(tmp_path_factory, "ts-client",
                            server_env={f"s{j + 1}": NO_FLOOR_POLICY for j in range(3)}) as c:
        yield c


def node_submit(config: dict) -> dict:
    r = _run(["node", "scripts/submit.mjs"], input=json.dumps(config))
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


def test_typescript_and_python_clients_release_the_exact_sum(built_package, exact_cluster):
    c = exact_cluster
    n_py, parts = 400, [("classical", 300, 100), ("post-quantum", 120, 50), ("none", 150, 1000)]
    n = n_py + sum(p[1] for p in parts)
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name="ts interop", columns=COLUMNS, label="y", expected_reports=n,
                                  k=16, s=4, min_reports=n, epsilon_floor=None)
    study = Study.model_validate(created["study"])
    assert study.server_sigma == 0 and study.secret_sign  # exact release; signed rows
    tokens = c.upload_tokens(study.study_id, quota=None)  # from now on the study requires them
    endpoints = [{"url": u, "token": t} for u, t in zip(c.server_urls, tokens)]

    rng = np.random.default_rng(44)  # test data; the privacy noise comes from each client's CSPRNG
    ts_ids: list[bytes] = []
    ts_vectors: list[list[int]] = []
    first = None
    for sealing, m, batch_size in parts:
        rows = rng.normal(0, 0.3, size=(m, len(COLUMNS))).tolist()
        out = node_submit({"studyId": study.study_id, "servers": endpoints, "rows": rows,
                           "sealing": sealing, "batchSize": batch_size})
        assert out["accepted"] == [m] * 3 and out["duplicates"] == [0] * 3, out
        assert [p["rowsDone"] for p in out["progress"]][-1] == m
        ts_ids += [bytes.fromhex(i) for i in out["reportIds"]]
        ts_vectors += [[int(x) for x in v] for v in out["vectors"]]
        if first is None:
            first = (rows, out, sealing, batch_size)

    # idempotent resubmission: the same rows with the same submission secret are the same reports
    rows, out, sealing, batch_size = first
    again = node_submit({"studyId": study.study_id, "servers": endpoints, "rows": rows,
                         "sealing": sealing, "batchSize": batch_size, "secret": out["secret"]})
    assert again["reportIds"] == out["reportIds"]
    assert again["accepted"] == [0] * 3 and again["duplicates"] == [len(rows)] * 3

    # the Python SDK's reports of the same study, with the same upload tokens
    py_rows = rng.normal(0, 0.3, size=(n_py, len(COLUMNS)))
    batch = prepare_batch(study, py_rows)
    for j, (url, token) in enumerate(zip(c.server_urls, tokens)):
        r = httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=batch.body(j), timeout=60,
                       headers={"Content-Type": messages.SHARES_MEDIA_TYPE,
                                "Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.json()["accepted"] == n_py, r.text
    py_encoded = ring.reconstruct(batch.shares)

    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        assert [s["report_count"] for s in an.progress(study.study_id)["servers"]] == [n] * 3
        fin = an.finalize(study.study_id)
        assert fin["state"] == "released" and fin["n_reports"] == n
        released = np.array(an.sketch(study.study_id)["sketch"])

    ids = ts_ids + list(batch.report_ids)
    encoded = np.vstack([np.array(ts_vectors, dtype=np.uint64), py_encoded])
    expected = ring.decode(direct_sketch(study, ids, encoded), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(released, expected)  # bit for bit
    assert fin["inclusion_hash"] == messages.inclusion_hash(sorted(ids))
    # the TypeScript client's noise is of the study's size and its signs are coin flips: each
    # decoded vector is t a + g with t = +-1 secret and g the noise (rows inside the ball: unclipped)
    ts_rows = np.array(first[0])
    dec = ring.decode(np.array(ts_vectors[:len(ts_rows)], dtype=np.uint64), study.frac_bits)
    flipped = np.linalg.norm(dec + ts_rows, axis=1) < np.linalg.norm(dec - ts_rows, axis=1)
    inside = np.linalg.norm(ts_rows, axis=1) < 0.99
    noise = (dec - np.where(flipped[:, None], -ts_rows, ts_rows))[inside]
    assert np.std(noise) == pytest.approx(study.sigma, rel=0.1)
    assert 0.4 < flipped.mean() < 0.6


def test_validity_study_typescript_proofs_verify_and_release_exactly(built_package, exact_cluster):
    """A study with validity proofs (docs/protocol.md 4b, 4c): the Node client's proved batches
    (plain and sealed, the leader rotating) and the Python SDK's pass every server's
    verification round at finalize, and the release is the ring sketch of both clients' noisy
    vectors exactly."""
    from test_validity_e2e import encoded_vectors

    c = exact_cluster
    n_py, parts = 120, [("classical", 90, 30), ("none", 60, 25)]
    n = n_py + sum(p[1] for p in parts)
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name="ts validity", columns=COLUMNS, label="y", expected_reports=n,
                                  k=16, s=4, min_reports=n, epsilon_floor=None, validity=True)
    study = Study.model_validate(created["study"])
    assert study.validity == "norm-bound/1" and study.server_sigma == 0
    tokens = c.upload_tokens(study.study_id, quota=None)
    endpoints = [{"url": u, "token": t} for u, t in zip(c.server_urls, tokens)]

    rng = np.random.default_rng(4044)
    ts_ids: list[bytes] = []
    ts_vectors: list[list[int]] = []
    for sealing, m, batch_size in parts:
        rows = (0.9 * rng.uniform(-1, 1, size=(m, len(COLUMNS))) / np.sqrt(len(COLUMNS))).tolist()
        out = node_submit({"studyId": study.study_id, "servers": endpoints, "rows": rows,
                           "sealing": sealing, "batchSize": batch_size})
        assert out["accepted"] == [m] * 3, out
        ts_ids += [bytes.fromhex(i) for i in out["reportIds"]]
        ts_vectors += [[int(x) for x in v] for v in out["vectors"]]

    py_rows = 0.9 * rng.uniform(-1, 1, size=(n_py, len(COLUMNS))) / np.sqrt(len(COLUMNS))
    batch = prepare_batch(study, py_rows, full=1)
    for j, (url, token) in enumerate(zip(c.server_urls, tokens)):
        r = httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=batch.body(j), timeout=60,
                       headers={"Content-Type": batch.media_type(j), "Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and r.json()["accepted"] == n_py, r.text

    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        fin = an.finalize(study.study_id)  # the verification round: every report checked
        assert fin["state"] == "released" and fin["n_reports"] == n, fin
        released = np.array(an.sketch(study.study_id)["sketch"])

    ids = ts_ids + list(batch.report_ids)
    encoded = np.vstack([np.array(ts_vectors, dtype=np.uint64), encoded_vectors(study, batch)])
    expected = ring.decode(direct_sketch(study, ids, encoded), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(released, expected)
