"""Replicas of one organisation's share server on one PostgreSQL database behind a real haproxy
(docs/operations.md, "Replicas"): real server processes, a real PostgreSQL server (tests/pg.py),
the SDK and the analyzer over real HTTP.

s1 runs as two replicas behind haproxy; s2 and s3 are single servers with SQLite files. One
replica is SIGKILLed in the middle of an SDK bulk upload: every report acknowledged through the
balancer is held, none twice, and the release equals S(A + G) computed independently from what
the SDK sent. Both replicas took uploads before the kill, and afterwards each replica (the killed
one restarted) answers the same aggregate bytes.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import httpx
import numpy as np

import dpsketch.client_sdk.client as sdk
from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.protocol import Study
from dpsketch.tools.cluster import analyzer as analyzer_process, free_ports, share_server, start_all

from conftest import OPEN_UPLOADS
from lb import running_haproxy
from test_faults import COLUMNS, NO_FLOOR, AckLog, Capture, expected_release, held_ids, study_info


def accepted_by(url: str, operator_token: str, study_id: str) -> float:
    """The replica's own count of reports it stored for the study (its /metrics)."""
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {operator_token}"}, timeout=10)
    assert r.status_code == 200, r.text
    total = 0.0
    for line in r.text.splitlines():
        if line.startswith("dpsketch_reports_total{") and f'study_id="{study_id}"' in line \
                and 'outcome="accepted"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_replica_sigkilled_mid_bulk_upload_behind_haproxy(servers, postgres, tmp_path, monkeypatch):
    workdir = servers.workdir
    env = {**OPEN_UPLOADS, **NO_FLOOR, "DPSKETCH_LOG_LEVEL": "info"}
    s1 = replace(servers.spec("s1"), db_path=postgres.new_database("s1"))
    lb_port, r2_port = free_ports(2)
    replicas = [share_server(s1, workdir, env), share_server(replace(s1, port=r2_port), workdir, env)]
    for i, proc in enumerate(replicas):
        proc.name, proc.log_path = f"s1-replica{i + 1}", workdir / f"s1-replica{i + 1}.log"
    others = [servers.spec("s2"), servers.spec("s3")]
    procs = replicas + [share_server(spec, workdir, env) for spec in others]
    servers.started.extend(procs)
    start_all(procs)
    try:
        with running_haproxy(lb_port, [("r1", replicas[0].port), ("r2", replicas[1].port)], workdir) as lb:
            _run(servers, workdir, s1, replicas, others, procs[2:], lb, monkeypatch)
    finally:
        postgres.drop_databases()


def _run(servers, workdir, s1, replicas, others, singles, lb, monkeypatch):
    urls = [lb] + [p.url for p in singles]
    config = {"servers": [{"server_id": "s1", "url": lb, "analyst_token": s1.analyst_token}]
              + [{"server_id": s.server_id, "url": p.url, "analyst_token": s.analyst_token}
                 for s, p in zip(others, singles)], "api_token": "analyst-api-token"}
    (workdir / "cluster.json").write_text(json.dumps(config))
    an_proc = analyzer_process(workdir / "cluster.json", workdir / "analyzer.sqlite3", workdir).start()
    servers.started.append(an_proc)

    n, batch_size, kill_after = 30_000, 500, 12
    with AnalyzerClient(an_proc.url, "analyst-api-token") as an:
        created = an.create_study(name="replicas", columns=COLUMNS, label="y", expected_reports=n,
                                  k=40, s=4, min_reports=n, epsilon_floor=None)
    study = Study.model_validate(created["study"])
    capture = Capture(monkeypatch)
    acks = AckLog(study)
    killed_at: list[float] = []
    spread: list[tuple[float, float]] = []
    chosen: list[int] = []
    lb_port = int(lb.rsplit(":", 1)[1])

    def kill() -> None:
        counts = tuple(accepted_by(r.url, s1.operator_token, study.study_id) for r in replicas)
        spread.append(counts)
        # the first replica, unless the balancer sent it nothing so far (it takes a replica out
        # of rotation while its /readyz is slow, e.g. while it compiles numba's loops): then the
        # one that holds reports, so the kill always loses a replica's worth of acknowledged work
        chosen.append(0 if counts[0] > 0 else 1)
        time.sleep(0.01)  # the next batch through the balancer is in flight
        replicas[chosen[0]].kill()
        killed_at.append(time.monotonic())

    def on_ack(port: int, count: int) -> None:
        if port == lb_port and count == kill_after:
            threading.Thread(target=kill, daemon=True).start()

    acks.listeners.append(on_ack)
    rows = np.random.default_rng(5).normal(0, 0.3, size=(n, len(COLUMNS)))
    with Client(urls, transport=acks, backoff=0.3) as client:
        try:
            client.submit_many(study.study_id, rows, batch_size=batch_size)
        except sdk.IncompleteUpload as exc:  # the SDK gave up on a batch: resend exactly those bytes
            client.resend(study.study_id, exc.pending)
            client.submit_many(study.study_id, rows[exc.rows_prepared:], batch_size=batch_size)
    assert killed_at and chosen, "the replica was not killed mid-upload"
    victim, survivor = replicas[chosen[0]], replicas[1 - chosen[0]]
    assert victim.proc.returncode == -9, "the replica was not killed mid-upload"
    assert spread[0][chosen[0]] > 0, f"the killed replica held no reports: {spread}"

    sent = capture.ids()
    assert len(sent) == n
    acked_before_kill = acks.acked_before(lb_port, killed_at[0])
    assert len(acked_before_kill) >= kill_after * batch_size
    stored = held_ids(lb, s1.analyst_token, study.study_id)
    assert len(stored) == len(set(stored)) == n, "a report is stored twice, or missing"
    assert acked_before_kill <= set(stored), "an acknowledged report was lost with the replica"
    assert set(stored) == set(sent)
    assert study_info(survivor.url, study.study_id)["report_count"] == n

    with AnalyzerClient(an_proc.url, "analyst-api-token") as an:
        fin = an.finalize(study.study_id)
        assert fin["state"] == "released" and fin["n_reports"] == n
        released = np.array(an.sketch(study.study_id)["sketch"])
    enc = capture.encoded()
    np.testing.assert_array_equal(released, expected_release(study, sent, np.stack([enc[r] for r in sent])))

    # the killed replica comes back: it serves the same release as the survivor and the balancer
    back = servers.start(replace(s1, port=victim.port), {**OPEN_UPLOADS, **NO_FLOOR})
    bodies = []
    for url in (back.url, survivor.url, lb):
        r = httpx.get(f"{url}/v1/studies/{study.study_id}/aggregate",
                      headers={"Authorization": f"Bearer {s1.analyst_token}"}, timeout=30)
        assert r.status_code == 200, r.text
        bodies.append(r.content)
    assert bodies[0] == bodies[1] == bodies[2]
    print(f"\nreplicas: {spread[0][0]:.0f} + {spread[0][1]:.0f} reports stored by the two replicas before "
          f"the kill; {len(acked_before_kill)} acknowledged through haproxy by then; {len(stored)} held after")
