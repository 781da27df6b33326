"""What a client's retry costs the server: re-sending one report it already holds, against a
fresh single upload, at a large stored count (issue 46).

A study holds ``--n`` reports stored as batch rows of ``--m`` reports each (single uploads
grouped by the writer make rows of a few reports; 10^6 reports in rows of 8 are 125,000 rows).
The rows are written straight into a SQLite store in one transaction (writing 10^6 reports as
125,000 acknowledged uploads would take minutes), then a real :class:`services.store.Store`
opens it and rebuilds its report index from them, as a restarted server does. Then, one at a
time and interleaved, ``--reps`` fresh one-report uploads and ``--reps`` re-sends of a random
stored report go through the store's writer (the path every HTTP upload takes after parsing);
each is timed until its acknowledgement. Medians, and their ratio.

Before issue 46 a re-send read every batch header of the study to find the one batch holding
the stored copy it compares bytes with (0.05 s at 125,000 rows); now the report index gives the
rowid and the batch is found by its primary key.

    .venv/bin/python benchmarks/resend.py [--n 1000000] [--m 8] [--d 8] [--reps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def run(n: int, m: int, d: int, reps: int, workdir: Path) -> dict:
    from dpsketch.protocol.study import design
    from dpsketch.services import backend as backends
    from dpsketch.services import batches
    from dpsketch.services.settings import Settings
    from dpsketch.services.store import Store

    db = workdir / "resend.sqlite3"
    settings = Settings(server_id="s1", db_path=db, operator_token="operator-token-0123456789",
                        analyst_token="analyst-token-0123456789", upload_auth="open", max_floor_epsilon=None,
                        warm_start=False, max_study_bytes=None, max_study_memory=8 << 30, memory_budget=32 << 30,
                        population_epsilon=None, population_floor_epsilon=None)
    study = design(name="resend", columns=[f"x{i}" for i in range(d)], label=None, servers=["s1", "s2"],
                   expected_reports=2 * n, k=16, s=2, min_reports=max(100, n // 2), max_reports=4 * n,
                   epsilon_floor=None)[0]
    store = Store(settings)
    store.provision(study)
    seq = store.record(study.study_id).seq
    store.close()

    rng = np.random.default_rng(0)
    ids = np.frombuffer(os.urandom(16 * n), dtype="V16")
    shares = rng.integers(0, 2**63, size=(n, d), dtype=np.uint64)
    t0 = time.perf_counter()
    backend = backends.SqliteBackend(db, 30.0)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    first = batches.next_rowid(conn)
    for start in range(0, n, m):
        batches.insert(conn, backend, first + start, seq, ids[start:start + m].tobytes(),
                       shares[start:start + m].astype("<u8").tobytes())
    conn.execute("UPDATE studies SET report_count = ? WHERE seq = ?", (n, seq))
    conn.execute("COMMIT")
    conn.close()
    write_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    store = Store(settings)
    record = store.record(study.study_id)
    store.ensure_state(record)  # the rebuild of a restarted server
    rebuild_s = time.perf_counter() - t0
    try:
        fresh, resend = [], []
        picks = rng.integers(0, n, size=reps)
        for i in range(reps):
            new_id = os.urandom(16)
            new_share = rng.integers(0, 2**63, size=(1, d), dtype=np.uint64)
            t = time.perf_counter()
            done = store.submit_upload(record, [new_id], new_share).result(60)
            fresh.append(time.perf_counter() - t)
            assert done.accepted == 1
            j = int(picks[i])
            t = time.perf_counter()
            done = store.submit_upload(record, [ids[j].tobytes()], shares[j:j + 1]).result(60)
            resend.append(time.perf_counter() - t)
            assert (done.accepted, done.duplicates) == (0, 1)
    finally:
        store.close()
    fresh_ms, resend_ms = statistics.median(fresh) * 1e3, statistics.median(resend) * 1e3
    return {"n": n, "rows_per_batch": m, "batch_rows": -(-n // m), "d": d, "reps": reps,
            "write_s": round(write_s, 1), "rebuild_s": round(rebuild_s, 1),
            "fresh_upload_ms_median": round(fresh_ms, 3), "resend_ms_median": round(resend_ms, 3),
            "resend_over_fresh": round(resend_ms / fresh_ms, 2), "load_average_1min": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=10**6)
    p.add_argument("--m", type=int, default=8, help="reports per stored batch row")
    p.add_argument("--d", type=int, default=8)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dpsketch-resend-") as wd:
        print(json.dumps(run(args.n, args.m, args.d, args.reps, Path(wd))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
