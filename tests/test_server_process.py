"""The share server as a real process: real uvicorn, a real SQLite file or PostgreSQL database
(both, for the durability tests: ``BOTH_STORES``), real crashes.

The durability promise is checked the hard way: reports are uploaded while the process is
SIGKILLed; after a restart on the same store every acknowledged report is held exactly once, and
a commit releases exactly the sketch of the included shares (computed independently here).

Records are bound to their report ids as a client binds them for server s1 (tests/studies.py);
the study has no server noise and the server requires no floor, so the release is an exact sum.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from dpsketch.protocol import kernels, sketch
from dpsketch.protocol.messages import (
    REPORT_IDS_MEDIA_TYPE,
    SHARES_MEDIA_TYPE,
    Report,
    decode_aggregate,
    decode_report_ids,
    encode_batch,
)
from dpsketch.protocol.study import Study, design
from conftest import BOTH_STORES, OPEN_UPLOADS
from studies import bind_at

D = 4
#: No floor required: the study carries no server noise, so its release is the exact sum.
NO_FLOOR = {"DPSKETCH_MAX_FLOOR_EPSILON": "none"}


def make_study() -> Study:
    return design(name="process", columns=[f"x{i}" for i in range(D)], label=None, servers=["s1", "s2"],
                  expected_reports=300, k=8, s=2, min_reports=150, epsilon_floor=None)[0]


def bound_reports(study: Study, n: int):
    """n reports as server s1 (position 0) receives them: (ids, proofs, shares)."""
    shares = np.frombuffer(os.urandom(8 * n * D), dtype="<u8").reshape(n, D).copy()
    ids, proofs = bind_at(study, study.servers.index("s1"), shares)
    return ids, proofs, shares


def expected_aggregate(study: Study, ids: list[bytes], shares: np.ndarray) -> np.ndarray:
    dense = sketch.dense_matrix(study.seed_bytes, ids, study.k, study.s)
    signs = np.rint(dense * np.sqrt(study.s)).astype(int).astype(object)
    return (signs.dot(shares.astype(object)) % (1 << 64)).astype(np.uint64)


#: httpx's default 5 s is too short for a server that has just reconnected to a restarted
#: PostgreSQL on a loaded machine (a provision timed out at load 9); these are not speed checks
TIMEOUT = 60


def provision(url: str, token: str, study: Study) -> None:
    r = httpx.put(f"{url}/v1/studies/{study.study_id}", content=study.canonical(),
                  headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                  timeout=TIMEOUT)
    assert r.status_code in (200, 201), r.text


def upload_bound(url: str, study: Study, n: int) -> list[bytes]:
    """Upload n fresh bound reports in one batch; their ids, once acknowledged."""
    ids, proofs, shares = bound_reports(study, n)
    r = httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=encode_batch(ids, proofs, shares),
                   headers={"Content-Type": SHARES_MEDIA_TYPE}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return ids


def held(url: str, token: str, study: Study) -> list[bytes]:
    r = httpx.get(f"{url}/v1/studies/{study.study_id}/report-ids", headers={"Authorization": f"Bearer {token}"},
                  timeout=TIMEOUT)
    assert r.status_code == 200
    return decode_report_ids(r.content)


@BOTH_STORES
def test_acknowledged_reports_survive_sigkill(servers):
    spec = servers.spec("s1")
    proc = servers.start(spec, NO_FLOOR)
    study = make_study()
    assert study.server_sigma == 0
    provision(proc.url, spec.operator_token, study)
    n = 400
    ids, proofs, shares = bound_reports(study, n)
    acked: set[int] = set()
    lock = threading.Lock()
    killed = threading.Event()

    def single(worker: int) -> None:  # single uploads, each acknowledged on its own
        with httpx.Client(base_url=proc.url, timeout=5) as client:
            for i in range(worker, 200, 4):
                body = Report.of(ids[i], proofs[i], shares[i]).model_dump()
                try:
                    r = client.post(f"/v1/studies/{study.study_id}/reports", json=body)
                except httpx.TransportError:
                    return
                if r.status_code == 200:
                    with lock:
                        acked.add(i)

    def batches() -> None:
        with httpx.Client(base_url=proc.url, timeout=5) as client:
            for start in range(200, n, 20):
                part = range(start, start + 20)
                try:
                    r = client.post(f"/v1/studies/{study.study_id}/batches",
                                    content=encode_batch([ids[i] for i in part], proofs[start:start + 20],
                                                         shares[start:start + 20]),
                                    headers={"Content-Type": SHARES_MEDIA_TYPE})
                except httpx.TransportError:
                    return
                if r.status_code == 200:
                    with lock:
                        acked.update(part)

    threads = [threading.Thread(target=single, args=(w,)) for w in range(4)] + [threading.Thread(target=batches)]
    for t in threads:
        t.start()
    while len(acked) < 150 and any(t.is_alive() for t in threads):
        threading.Event().wait(0.005)
    proc.kill()  # SIGKILL with uploads in flight
    killed.set()
    for t in threads:
        t.join()
    assert proc.proc.returncode == -9
    assert len(acked) >= 150

    proc = servers.start(spec, NO_FLOOR)  # same id, same file, same port
    stored = held(proc.url, spec.analyst_token, study)
    assert len(stored) == len(set(stored))
    index = {rid: i for i, rid in enumerate(ids)}
    assert {ids[i] for i in acked} <= set(stored)
    assert set(stored) <= set(ids)
    info = httpx.get(f"{proc.url}/v1/studies/{study.study_id}").json()
    assert info["report_count"] == len(stored)

    # clients retry everything: nothing is counted twice
    r = httpx.post(f"{proc.url}/v1/studies/{study.study_id}/batches", content=encode_batch(ids, proofs, shares),
                   headers={"Content-Type": SHARES_MEDIA_TYPE})
    assert r.json() == {"accepted": n - len(stored), "duplicates": len(stored), "report_count": n}

    # leave out 20 of the 400 held: the batch rule allows at most 10% (formerly 50 were left out)
    included = sorted(ids[:380])
    r = httpx.post(f"{proc.url}/v1/studies/{study.study_id}/commit", content=b"".join(included),
                   headers={"Authorization": f"Bearer {spec.analyst_token}", "Content-Type": REPORT_IDS_MEDIA_TYPE})
    assert r.status_code == 200, r.text
    r = httpx.get(f"{proc.url}/v1/studies/{study.study_id}/aggregate",
                  headers={"Authorization": f"Bearer {spec.analyst_token}"})
    got = decode_aggregate(r.content, study.k, study.d)
    rows = [index[rid] for rid in included]
    assert np.array_equal(got, expected_aggregate(study, included, shares[rows]))


@BOTH_STORES
def test_sigterm_stops_cleanly_and_keeps_everything(servers):
    spec = servers.spec("s1")
    proc = servers.start(spec, NO_FLOOR)
    study = make_study()
    provision(proc.url, spec.operator_token, study)
    ids = upload_bound(proc.url, study, 50)
    proc.stop()
    # uvicorn finishes the shutdown, then re-raises SIGTERM so the exit status says why it ended
    assert proc.proc.returncode in (0, -15)
    assert "Application shutdown complete" in proc.log_tail(50)
    proc = servers.start(spec, NO_FLOOR)
    assert sorted(held(proc.url, spec.analyst_token, study)) == sorted(ids)


def test_refuses_to_start_without_tokens(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPSKETCH_")}
    argv = [sys.executable, "-m", "dpsketch.tools.cli", "server", "--server-id", "s1", "--db", str(tmp_path / "x.db")]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "DPSKETCH_OPERATOR_TOKEN" in out.stderr and "DPSKETCH_ANALYST_TOKEN" in out.stderr
    same = env | {"DPSKETCH_OPERATOR_TOKEN": "same-token-123456", "DPSKETCH_ANALYST_TOKEN": "same-token-123456"}
    out = subprocess.run(argv, env=same, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "differ" in out.stderr
    assert not (tmp_path / "x.db").exists()
    helptext = subprocess.run(argv[:4] + ["--help"], capture_output=True, text=True, timeout=60)
    assert helptext.returncode == 0 and "--operator-token-file" in helptext.stdout


def test_admission_flags_override_the_environment(tmp_path, monkeypatch):
    """--max-inflight-uploads / --max-inflight-upload-bytes reach the admission middleware (which
    reads the environment when the app is built); a bad value stops the command with usage."""
    from dpsketch.services import __main__ as server_main
    from dpsketch.services.admission import DEFAULT_MAX_BYTES, Admission

    monkeypatch.setenv("DPSKETCH_MAX_INFLIGHT_UPLOADS", "7")
    monkeypatch.setenv("DPSKETCH_MAX_INFLIGHT_UPLOAD_BYTES", "")  # empty: the default (restored after)
    base = ["--server-id", "s1", "--db", str(tmp_path / "x.db")]
    args = server_main.build_parser().parse_args(base)
    server_main._export_admission_limits(args)
    limits = Admission.from_env()
    assert (limits.max_requests, limits.max_bytes) == (7, DEFAULT_MAX_BYTES)  # environment kept
    args = server_main.build_parser().parse_args(base + ["--max-inflight-uploads", "3",
                                                         "--max-inflight-upload-bytes", "0"])
    server_main._export_admission_limits(args)
    limits = Admission.from_env()
    assert (limits.max_requests, limits.max_bytes) == (3, 0)  # the flags win
    argv = [sys.executable, "-m", "dpsketch.tools.cli", "server", *base, "--max-inflight-uploads", "-1"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--max-inflight-uploads" in out.stderr
    assert not (tmp_path / "x.db").exists()


def _compiled_loops_loaded(pid: int) -> bool:
    """Whether the process has mapped llvmlite's shared library (numba's import loads it)."""
    with open(f"/proc/{pid}/maps") as maps:
        return "llvmlite" in maps.read()


def test_compiled_sketch_loops_load_only_for_a_large_study(servers):
    """A server loads numba's compiled sketch loops (about 0.7 s of CPU) in the background when it
    opens a study that needs thousands of reports, and not before: small studies use hashlib and
    scipy. The check reads the real process's memory maps."""
    spec = servers.spec("s1")
    proc = servers.start(spec, NO_FLOOR)
    small = make_study()
    provision(proc.url, spec.operator_token, small)
    upload_bound(proc.url, small, 50)
    assert not _compiled_loops_loaded(proc.proc.pid)
    large = design(name="process, large", columns=[f"x{i}" for i in range(D)], label=None, servers=["s1", "s2"],
                   expected_reports=20_000, k=8, s=2, min_reports=kernels.MIN_ROWS, epsilon_floor=None)[0]
    provision(proc.url, spec.operator_token, large)
    deadline = time.monotonic() + 60
    while not _compiled_loops_loaded(proc.proc.pid):
        assert time.monotonic() < deadline, "the compiled loops were not loaded for a large study"
        time.sleep(0.1)
    # after a restart, holding the open large study is enough
    proc.stop()
    proc = servers.start(spec, NO_FLOOR)
    deadline = time.monotonic() + 60
    while not _compiled_loops_loaded(proc.proc.pid):
        assert time.monotonic() < deadline, "a restart holding a large open study did not load them"
        time.sleep(0.1)


def _wait_for_log(proc, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.log_path.read_text(errors="replace"):
        assert proc.proc.poll() is None, f"{proc.name} exited ({proc.proc.returncode}):\n{proc.log_tail()}"
        assert time.monotonic() < deadline, f"{text!r} not logged in {timeout} s:\n{proc.log_tail()}"
        time.sleep(0.1)


def _exit_status(proc, timeout: float) -> tuple[int, float]:
    """The process's exit status, and how long after this call it came."""
    start = time.monotonic()
    proc.proc.wait(timeout)
    return proc.proc.returncode, time.monotonic() - start


@pytest.mark.parametrize("store_kind", ["postgres"], indirect=True)
def test_a_server_started_before_its_database_waits_for_it(servers, postgres):
    """A stack started at once (compose, swarm) starts a server before its PostgreSQL accepts
    connections. The same process waits and serves once the database comes up, instead of
    exiting to be restarted; a server whose wait runs out exits with a message saying so; and a
    database that refuses (no such database) is not waited for."""
    from dpsketch.tools.cluster import share_server

    spec = servers.spec("s1")  # a new database in the running cluster
    other = servers.spec("s3")
    wrong = servers.spec("s2")
    wrong.db_path = postgres.url_of("no_such_database")
    refused = share_server(wrong, servers.workdir, {**NO_FLOOR, **OPEN_UPLOADS, "DPSKETCH_DB_WAIT_SECONDS": "60"})
    servers.started.append(refused.spawn())
    status, took = _exit_status(refused, 60)
    assert status == 1, refused.log_tail()
    assert 'database "no_such_database" does not exist' in refused.log_tail()
    assert "attempts" not in refused.log_tail() and took < 30  # refused at the first, not after 60 s

    postgres.pg_ctl("stop")
    try:
        waiting = share_server(spec, servers.workdir, {**NO_FLOOR, **OPEN_UPLOADS, "DPSKETCH_DB_WAIT_SECONDS": "120"})
        short = share_server(other, servers.workdir, {**NO_FLOOR, **OPEN_UPLOADS, "DPSKETCH_DB_WAIT_SECONDS": "1.5"})
        for proc in (waiting, short):
            servers.started.append(proc.spawn())
        _wait_for_log(waiting, "not reachable yet")
        status, _ = _exit_status(short, 60)
        assert status == 1, short.log_tail()
        assert "Connection refused" in short.log_tail() and "in 1.5 s" in short.log_tail()
        time.sleep(1.0)  # still waiting, not answering, not exited
        assert waiting.proc.poll() is None
        with pytest.raises(httpx.TransportError):
            httpx.get(waiting.url + "/healthz", timeout=1)
    finally:
        postgres.pg_ctl("start")
    waiting.wait_healthy(60)
    assert waiting.proc.poll() is None  # the same process
    assert "reachable after" in waiting.log_tail(100)
    study = make_study()
    provision(waiting.url, spec.operator_token, study)
    ids = upload_bound(waiting.url, study, 20)
    assert sorted(held(waiting.url, spec.analyst_token, study)) == sorted(ids)
