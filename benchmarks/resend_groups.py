"""The writer's CPU per request for groups of single uploads that hold re-sends, against groups
of fresh ones (issue 46's retry storm).

A study holds ``--n`` reports (stored as batches of 5,000 through the store's writer). Then, in
alternating rounds, groups of ``--group`` one-report requests are queued at once on the store's
writer (the path every HTTP upload takes after parsing, so the writer takes them as one group):
all fresh, or one fresh to ``--resends`` re-sends of random stored reports (the same bytes). The
CPU this process uses per request (the writer's work; the queuing thread's is the same in both)
and the wall time per request, medians over ``--rounds``, and the ratio mixed / fresh.

Before issue 46's change a group holding any re-send left the grouped check
(``Writer._plan_singles``) and every request of it was planned one by one (``Writer._plan``,
with its own index lookups and its own read of the stored copy); now the group is checked at
once and the stored copies of all its re-sends are read in one pass.

    .venv/bin/python benchmarks/resend_groups.py [--n 200000] [--group 36] [--resends 8] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(n: int, group: int, resends: int, rounds: int, workdir: Path, d: int = 4) -> dict:
    from dpsketch.protocol.messages import IdList
    from dpsketch.protocol.study import design
    from dpsketch.services.settings import Settings
    from dpsketch.services.store import Store

    settings = Settings(server_id="s1", db_path=workdir / "groups.sqlite3", operator_token="operator-token-0123456789",
                        analyst_token="analyst-token-0123456789", upload_auth="open", max_floor_epsilon=None,
                        warm_start=False, max_study_bytes=None, max_study_memory=8 << 30, memory_budget=32 << 30,
                        population_epsilon=None, population_floor_epsilon=None)
    study = design(name="groups", columns=[f"x{i}" for i in range(d)], label=None, servers=["s1", "s2"],
                   expected_reports=2 * n, k=16, s=2, min_reports=max(100, n // 2), max_reports=4 * n,
                   epsilon_floor=None)[0]
    store = Store(settings)
    try:
        store.provision(study)
        record = store.record(study.study_id)
        rng = np.random.default_rng(0)
        ids = np.frombuffer(os.urandom(16 * n), dtype="V16")
        shares = rng.integers(0, 2**63, size=(n, d), dtype=np.uint64)
        for start in range(0, n, 5000):
            joined = ids[start:start + 5000].tobytes()
            rows, signs = study.hash_report_ids(IdList(joined), joined)
            store.submit_upload(record, IdList(joined), shares[start:start + 5000], rows, signs).result()

        def one_group(mixed: bool) -> None:
            futures = []
            for i in range(group):
                if not mixed or i % (resends + 1) == 0:
                    futures.append(store.submit_upload(record, [os.urandom(16)],
                                                       rng.integers(0, 2**63, size=(1, d), dtype=np.uint64)))
                else:
                    j = int(rng.integers(0, n))
                    futures.append(store.submit_upload(record, [ids[j].tobytes()], shares[j:j + 1]))
            for f in futures:
                f.result(60)

        per = {"fresh": [], "mixed": []}
        for _ in range(rounds):
            for kind in ("fresh", "mixed"):
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(5):
                    one_group(kind == "mixed")
                jobs = 5 * group
                per[kind].append(((time.process_time() - c0) / jobs * 1e3, (time.perf_counter() - t0) / jobs * 1e3))
    finally:
        store.close()
    out: dict = {"n": n, "group": group, "resends_per_fresh": resends, "rounds": rounds}
    for kind, values in per.items():
        out[f"{kind}_cpu_ms_per_request"] = round(statistics.median(c for c, _ in values), 4)
        out[f"{kind}_wall_ms_per_request"] = round(statistics.median(w for _, w in values), 4)
    out["mixed_over_fresh_cpu"] = round(out["mixed_cpu_ms_per_request"] / out["fresh_cpu_ms_per_request"], 2)
    out["mixed_over_fresh_wall"] = round(out["mixed_wall_ms_per_request"] / out["fresh_wall_ms_per_request"], 2)
    out["load_average_1min"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200_000, help="reports stored first")
    p.add_argument("--group", type=int, default=36, help="requests queued at once (one writer group)")
    p.add_argument("--resends", type=int, default=8, help="re-sends per fresh upload in a mixed group")
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dpsketch-resend-groups-") as wd:
        print(json.dumps(run(args.n, args.group, args.resends, args.rounds, Path(wd))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
