"""Restart time of a share server holding one large open study: rebuilding its running totals
from every stored share (no checkpoint) against starting from a checkpoint
(services/checkpoint.py), in one run on this machine.

    .venv/bin/python benchmarks/restart.py [--n 1000000] [--d 100] [--postgres]

Loads n reports (d values each, k = 400, s = 4) through the store's writer in-process, then times
three restarts of the same store (open the store, then the study's state is ready):
* ``full``: the checkpoint deleted first, so every share is read back and sketched (what a restart
  cost before checkpoints, and still costs for a study below CHECKPOINT_MIN_REPORTS);
* ``crash``: after a SIGKILL-like stop (no shutdown checkpoint): the writer's last checkpoint plus
  the reports stored after it (up to CHECKPOINT_GROWTH of the study);
* ``clean``: after a clean shutdown, which checkpoints every open study.
Each restart's state is checked equal to the state before it. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _restart(settings, study_id: str):
    from dpsketch.services.store import Store

    t0 = time.perf_counter()
    store = Store(settings)
    opened = time.perf_counter() - t0
    state = store.ensure_state(store.record(study_id))
    return store, state, opened, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000, help="reports in the study (default: %(default)s)")
    p.add_argument("--d", type=int, default=100, help="values per share (default: %(default)s)")
    p.add_argument("--postgres", action="store_true", help="a PostgreSQL store (scripts/ensure-postgres.sh) "
                   "instead of a SQLite file")
    args = p.parse_args(argv)

    from dpsketch.tools import server_bench as bench
    from dpsketch.services.settings import Settings
    from dpsketch.services.store import Store
    from dpsketch.services.writer import CallJob

    directory = admin = None
    with tempfile.TemporaryDirectory(prefix="dpsketch-restart-") as wd:
        if args.postgres:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from pg_store import _new_database, _start_postgres

            directory, admin = _start_postgres()
            db = _new_database(admin)
        else:
            db = Path(wd) / "restart.sqlite3"
        settings = Settings(server_id="bench", db_path=db, operator_token=bench.OPERATOR,
                            analyst_token=bench.ANALYST, warm_start=False)
        try:
            store = Store(settings)
            study = bench._study(args.n, args.d, 400, 4, ["bench", "other"])
            store.provision(study)
            record = store.record(study.study_id)
            rng = np.random.default_rng(5)
            t0 = time.perf_counter()
            window = []
            for start in range(0, args.n, 20_000):
                ids, shares = bench._random_rows(rng, min(20_000, args.n - start), args.d)
                window.append(store.submit_upload(record, ids, shares))
                if len(window) >= 4:
                    window.pop(0).result()
            for fut in window:
                fut.result()
            store.writer.submit(CallJob(lambda conn: (None, None))).result()  # its checkpoint too
            load_s = time.perf_counter() - t0
            before = (record.state.aggregate.copy(), record.state.gram.copy(),
                      [a.copy() for a in record.state.ids.sorted()])
            writer_checkpoint = record.state.checkpointed

            out: dict = {"n": args.n, "d": args.d, "store": "postgres" if args.postgres else "sqlite",
                         "load_rows_per_s": round(args.n / load_s), "writer_checkpoint_at": writer_checkpoint}

            def check(state) -> None:
                assert np.array_equal(state.aggregate, before[0]) and np.array_equal(state.gram, before[1])
                assert all(np.array_equal(a, b) for a, b in zip(state.ids.sorted(), before[2]))

            real_checkpoint_all = Store._checkpoint_all
            Store._checkpoint_all = lambda self: None  # stop like a SIGKILL: no shutdown checkpoint
            store.close()
            store, state, opened, ready = _restart(settings, study.study_id)  # crash: checkpoint + tail
            check(state)
            out["crash"] = {"open_s": round(opened, 3), "ready_s": round(ready, 3),
                            "from_checkpoint": state.checkpointed, "tail": len(state.ids) - state.checkpointed}
            Store._checkpoint_all = real_checkpoint_all
            store.close()  # clean: checkpoints the whole study
            store, state, opened, ready = _restart(settings, study.study_id)
            check(state)
            out["clean"] = {"open_s": round(opened, 3), "ready_s": round(ready, 3),
                            "from_checkpoint": state.checkpointed}
            store.writer.submit(CallJob(lambda conn: (conn.execute("DELETE FROM checkpoints"), (None, None))[1])).result()
            Store._checkpoint_all = lambda self: None
            store.close()
            store, state, opened, ready = _restart(settings, study.study_id)  # full rebuild
            check(state)
            out["full"] = {"open_s": round(opened, 3), "ready_s": round(ready, 3)}
            store.close()
            out["ratios"] = {"full_over_clean": round(out["full"]["ready_s"] / out["clean"]["ready_s"], 1),
                             "full_over_crash": round(out["full"]["ready_s"] / out["crash"]["ready_s"], 1)}
        finally:
            if directory is not None:
                import subprocess

                subprocess.run(["bash", str(ROOT / "scripts" / "ensure-postgres.sh"), "--stop", str(directory)],
                               capture_output=True, timeout=120)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
