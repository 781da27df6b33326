"""SQLite vs PostgreSQL store, in one run on this machine: bulk upload and single-upload
throughput through a real server process (and through two replicas on one PostgreSQL database
behind haproxy), and the restart cost (rebuilding a study's running totals from the store), each
as a ratio to SQLite.

    .venv/bin/python benchmarks/pg_store.py [--n 200000] [--d 32] [--seconds 5] [--rebuild-n 200000]

PostgreSQL is the throwaway cluster of scripts/ensure-postgres.sh (installed if missing, started
in a temporary directory on a free loopback port, stopped at the end), fsync and
synchronous_commit on: the same durability as SQLite's WAL with synchronous=FULL. Each store
gets an empty database. The figures print as one JSON object.

Why these three: bulk upload is the ingest path at scale (group commit of 10^4-row batches), single
upload is the per-request path (many clients, one report each: fsyncs are shared by the group
commit), and the rebuild is what a restart costs before a study is usable (issue 14's "fast
restart"). All share the machine with the load generator, so ratios, not absolute rates, matter.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _start_postgres() -> tuple[Path, str]:
    directory = Path(tempfile.mkdtemp(prefix="dpsketch-pg-bench-", dir="/tmp"))
    out = subprocess.run(["bash", str(ROOT / "scripts" / "ensure-postgres.sh"), str(directory)],
                         capture_output=True, text=True, timeout=900, check=True)
    return directory, out.stdout.strip().splitlines()[-1]


def _new_database(admin_url: str) -> str:
    import psycopg

    name = "bench_" + secrets.token_hex(4)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin_url.rsplit("/", 1)[0] + "/" + name


def rebuild(db, n: int, d: int, chunk_rows: int = 20_000) -> dict:
    """Load n reports through the store's writer (in-process), close, reopen as a restart does
    and time rebuilding the study's totals (Store.ensure_state streams every report back)."""
    from dpsketch.tools import server_bench as bench
    from dpsketch.services.settings import Settings
    from dpsketch.services.store import Store

    rng = np.random.default_rng(5)
    settings = Settings(server_id="bench", db_path=db, operator_token=bench.OPERATOR,
                        analyst_token=bench.ANALYST, warm_start=False)
    store = Store(settings)
    study = bench._study(n, d, 400, 4, ["bench", "other"])
    store.provision(study)
    record = store.record(study.study_id)
    t0 = time.perf_counter()
    window = []
    for start in range(0, n, chunk_rows):
        ids, shares = bench._random_rows(rng, min(chunk_rows, n - start), d)
        window.append(store.submit_upload(record, ids, shares))
        if len(window) >= 4:
            window.pop(0).result()
    for fut in window:
        fut.result()
    load_s = time.perf_counter() - t0
    before = record.state.aggregate.copy()
    store.close()
    t0 = time.perf_counter()
    store = Store(settings)  # a restart: open the store, then rebuild the study's totals
    opened_s = time.perf_counter() - t0
    state = store.ensure_state(store.record(study.study_id))
    rebuild_s = time.perf_counter() - t0
    assert len(state.ids) == n and np.array_equal(state.aggregate, before)
    store.close()
    return {"n": n, "d": d, "load_rows_per_s": round(n / load_s), "open_s": round(opened_s, 3),
            "rebuild_s": round(rebuild_s, 3), "rebuild_s_per_1e6": round(rebuild_s * 1e6 / n, 2)}


def main(argv: list[str] | None = None) -> int:
    from dpsketch.tools import server_bench as bench

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200_000, help="bulk-upload rows (default: %(default)s)")
    p.add_argument("--d", type=int, default=32, help="values per share (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=5.0, help="single-upload duration (default: %(default)s)")
    p.add_argument("--clients", type=int, default=64, help="single-upload clients (default: %(default)s)")
    p.add_argument("--rebuild-n", type=int, default=200_000, help="reports rebuilt at restart (default: %(default)s)")
    args = p.parse_args(argv)

    directory, admin = _start_postgres()
    out: dict = {"machine_cores": __import__("os").cpu_count()}
    try:
        with tempfile.TemporaryDirectory(prefix="dpsketch-bench-") as wd:
            stores = {"sqlite": lambda name: Path(wd) / f"{name}.sqlite3",
                      "postgres": lambda name: _new_database(admin)}
            for kind, new in stores.items():
                out[f"bulk_{kind}"] = bench.bench_bulk_upload(n=args.n, d=args.d, db=new("bulk"), baseline=False)
                out[f"single_{kind}"] = bench.bench_single_upload(clients=args.clients, seconds=args.seconds,
                                                                  d=args.d, db=new("single"), baseline=False)
                out[f"rebuild_{kind}"] = rebuild(new("rebuild"), args.rebuild_n, args.d)
                print(f"{kind}: done", file=sys.stderr)
            # two replicas of the server on one PostgreSQL database behind haproxy
            out["bulk_postgres_2_replicas"] = bench.bench_bulk_upload(
                n=args.n, d=args.d, db=_new_database(admin), baseline=False, replicas=2)
            out["single_postgres_2_replicas"] = bench.bench_single_upload(
                clients=args.clients, seconds=args.seconds, d=args.d, db=_new_database(admin),
                baseline=False, replicas=2)
    finally:
        subprocess.run(["bash", str(ROOT / "scripts" / "ensure-postgres.sh"), "--stop", str(directory)],
                       capture_output=True, timeout=120)
    out["ratios_postgres_over_sqlite"] = {
        "bulk_rows_per_s": round(out["bulk_postgres"]["rows_per_s"] / out["bulk_sqlite"]["rows_per_s"], 3),
        "single_reports_per_s": round(out["single_postgres"]["reports_per_s"]
                                      / out["single_sqlite"]["reports_per_s"], 3),
        "rebuild_s": round(out["rebuild_postgres"]["rebuild_s"] / out["rebuild_sqlite"]["rebuild_s"], 3),
        "in_process_load_rows_per_s": round(out["rebuild_postgres"]["load_rows_per_s"]
                                            / out["rebuild_sqlite"]["load_rows_per_s"], 3),
        "bulk_rows_per_s_2_replicas": round(out["bulk_postgres_2_replicas"]["rows_per_s"]
                                            / out["bulk_sqlite"]["rows_per_s"], 3),
        "single_reports_per_s_2_replicas": round(out["single_postgres_2_replicas"]["reports_per_s"]
                                                 / out["single_sqlite"]["reports_per_s"], 3),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
