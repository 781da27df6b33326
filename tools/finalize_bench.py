"""``dpsketch bench finalize``: what the analyst waits for when a study is finalized, cluster-wide.

Three real share-server processes (SQLite files, or one PostgreSQL database each) hold ``n``
reports of one study at d = 100, k = 400, s = 4, each server missing 1 % of them at random (as
servers that each missed some uploads); the analyzer's :class:`~analyzer.coordinator.Coordinator`
(in this process, over loopback HTTP, as the analyzer service runs it) finalizes the study:
collect every server's report ids, intersect them, record the inclusion set, commit it at every
server (certificate, floor noise, durable commit), fetch and add the aggregate shares. Timed end
to end, with the time of each phase (from the coordinator's log lines) and, as the anchor of the
same run, the servers' own commit + aggregate time (their /metrics) and each server's peak RSS.

Why the servers are filled in process: the figure is the finalization, not the upload, and
10^6 reports at d = 100 through HTTP to three servers takes minutes on a shared 2-core machine.
Each server's store is filled through its writer's bulk path (seeds stored, as the SDK's seed
servers store them; the running totals and the report index exactly as an upload builds them),
checkpointed at its clean stop, and then served by a real ``dpsketch server`` process that
restarts from that checkpoint; one GET of the report ids warms each server (a long-running
server holds its totals in memory), and the clock starts once every server process is idle (it
has rebuilt its studies and loaded its compiled loops, as a long-running server has).

A run is reproducible: ``seed`` fixes the report ids, which reports each server misses, the
payloads and each study's sketch seed.

``--sizes`` runs several n in one run (default 10^4, 10^5, 10^6), so the growth is measured on
one machine state: finalize seconds per 10^6 reports should stay flat from one size to the next
(linear growth).
"""

from __future__ import annotations

import cProfile
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from dpsketch.tools.loadtest import cpu_seconds, wait_idle

OPERATOR = "bench-operator-token-0123456789"
ANALYST = "bench-analyst-token-0123456789"
SERVERS = ("s1", "s2", "s3")


def _study(n: int, d: int, k: int, s: int, name: str, seed: int):
    """The bench's study; its sketch seed follows from ``seed`` and ``name``, so a run is
    reproducible: the certificate's lambda_min depends on the sketch and the report ids, and a
    fresh random draw of both put it within 0.5 % of lambda_star in one CI run in about 60."""
    import hashlib

    from dpsketch.protocol.study import design

    return design(name=name, columns=[f"x{i}" for i in range(d)], label=None, servers=list(SERVERS),
                  expected_reports=n, k=k, s=s, min_reports=max(1, int(0.9 * n)),
                  max_reports=max(2 * n, 1000),
                  seed=hashlib.sha256(f"{seed}:{name}".encode()).hexdigest())[0]


def fill_store(db: str | Path, server_id: str, keep: np.ndarray, seed: int, *, studies: list, ids: bytes,
               d: int, chunk_rows: int = 50_000) -> float:
    """Fill a server's store with the kept ids of every study (random seeds as the payloads),
    through its writer; seconds taken. ``db``: a SQLite path or a postgresql:// URL."""
    from dpsketch.protocol import ring
    from dpsketch.protocol.messages import IdList
    from dpsketch.services.settings import Settings
    from dpsketch.services.store import Store, warm_kernels

    rng = np.random.default_rng(seed)
    url = str(db).startswith("postgresql://")
    settings = Settings(server_id=server_id, db_path=None if url else Path(db), db_url=str(db) if url else None,
                        operator_token=OPERATOR, analyst_token=ANALYST, warm_start=False,
                        max_study_bytes=None, max_study_memory=8 << 30, memory_budget=32 << 30)
    store = Store(settings)
    warm_kernels()
    t0 = time.perf_counter()
    try:
        held = np.flatnonzero(keep)
        for study in studies:
            store.provision(study)
            record = store.record(study.study_id)
            window = []
            for start in range(0, len(held), chunk_rows):
                rows_at = held[start:start + chunk_rows]
                joined = np.frombuffer(ids, dtype="V16")[rows_at].tobytes()
                seeds = rng.integers(0, 256, size=(len(rows_at), ring.SEED_BYTES), dtype=np.uint8)
                shares = ring.expand_seeds(seeds, d)
                id_list = IdList(joined)
                rows, signs = study.hash_report_ids(id_list, joined)
                window.append(store.submit_upload(record, id_list, shares, rows, signs, seeds=seeds))
                if len(window) >= 4:
                    window.pop(0).result()
            for fut in window:
                fut.result()
    finally:
        store.close()  # checkpoints every open study: the server process restarts from it
    return time.perf_counter() - t0


def _start_postgres(base: Path, options: str = "") -> tuple[Path, str]:
    """A throwaway PostgreSQL cluster (scripts/ensure-postgres.sh: fsync and synchronous_commit
    on, plus ``options``, server settings as ``-c name=value``); its directory and superuser URL."""
    import subprocess

    # a directory of its own directly under /tmp, as tests/pg.py makes: the cluster's owner
    # (postgres, when we are root) must reach it, and ``base`` is private to us
    del base
    directory = Path(tempfile.mkdtemp(prefix="dpsketch-bench-pg-", dir="/tmp"))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", str(root / "scripts" / "ensure-postgres.sh"), str(directory)],
                          capture_output=True, text=True, timeout=900, check=True,
                          env={**os.environ, "DPSKETCH_PG_OPTIONS": options})
    return directory, done.stdout.strip().splitlines()[-1]


def _stop_postgres(directory: Path) -> None:
    import subprocess

    root = Path(__file__).resolve().parents[1]
    subprocess.run(["bash", str(root / "scripts" / "ensure-postgres.sh"), "--stop", str(directory)],
                   capture_output=True, timeout=120, check=False)
    shutil.rmtree(directory, ignore_errors=True)


def _new_database(admin_url: str) -> str:
    import secrets

    import psycopg

    name = "bench_" + secrets.token_hex(4)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin_url.rsplit("/", 1)[0] + "/" + name


def _mark(marks: list[tuple[float, str]], message: str) -> None:
    marks.append((time.perf_counter(), message))


def _metric(text: str, name: str) -> float:
    """The sum of a Prometheus histogram's ``_sum`` samples (every label set)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def bench_finalize(sizes: list[int], d: int = 100, k: int = 400, s: int = 4, repeats: int = 1,
                   missing: float = 0.01, workdir: Path | None = None, pg: bool = False, pg_options: str = "",
                   seed: int = 5, profile: str | None = None) -> dict[str, Any]:
    """Finalize ``repeats`` studies of each size on a 3-server cluster of real processes (module
    docstring); per size the median finalize seconds, seconds per 10^6 reports, the phases, the
    servers' own commit + aggregate seconds and peak RSS, and the load. ``profile``: a path
    prefix; each finalization's cProfile of the analyzer (this process, every thread that
    calls into the profiled function's own thread only) is written to ``<profile>.n<n>.<rep>``."""
    import httpx

    from dpsketch.analyzer.config import ClusterConfig, ServerEndpoint
    from dpsketch.analyzer.coordinator import Coordinator
    from dpsketch.analyzer.store import AnalyzerStore
    from dpsketch.tools.cluster import ServerSpec, share_server, start_all, stop_all

    out: dict[str, Any] = {"d": d, "k": k, "s": s, "servers": len(SERVERS), "missing_per_server": missing,
                           "store": "postgresql" if pg else "sqlite", "pg_options": pg_options if pg else None,
                           "sizes": []}
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="dpsketch-bench-finalize-"))
    base.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pg_dir, pg_admin = _start_postgres(base, pg_options) if pg else (None, "")
    try:
        for n in sizes:
            wd = base / f"n{n}"
            shutil.rmtree(wd, ignore_errors=True)
            wd.mkdir(parents=True)
            with ExitStack() as stack:
                if pg:
                    dbs = [_new_database(pg_admin) for _ in SERVERS]
                else:
                    dbs = [wd / f"{sid}.sqlite3" for sid in SERVERS]
                studies = [_study(n, d, k, s, f"bench-finalize-{n}-{r}", seed) for r in range(repeats)]
                ids = rng.bytes(16 * n)
                keeps = [rng.random(n) >= missing for _ in SERVERS]
                t0 = time.perf_counter()
                with ThreadPoolExecutor(len(SERVERS)) as pool:
                    list(pool.map(partial(fill_store, studies=studies, ids=ids, d=d), dbs, SERVERS, keeps,
                                  [seed + j for j in range(len(SERVERS))]))
                fill_s = time.perf_counter() - t0
                specs = [ServerSpec(sid, OPERATOR, ANALYST, db) for sid, db in zip(SERVERS, dbs)]
                procs = [share_server(spec, wd) for spec in specs]
                start_all(procs, timeout=600)
                stack.callback(stop_all, procs)
                config = ClusterConfig(servers=[ServerEndpoint(server_id=p.name, url=p.url, analyst_token=ANALYST,
                                                               operator_token=OPERATOR) for p in procs])
                astore = AnalyzerStore(wd / "analyzer.sqlite3")
                for study in studies:
                    astore.add_study(study, [])
                with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {ANALYST}"}) as http:
                    for study in studies:  # warm: every server holds its totals in memory
                        for p in procs:
                            http.get(f"{p.url}/v1/studies/{study.study_id}/report-ids").raise_for_status()
                    idle_s = wait_idle([p.proc.pid for p in procs], quiet=0.05, window=0.5)
                    rss_before = [_status_kib(p.proc.pid, "VmRSS") for p in procs]
                    runs = []
                    for study in studies:
                        metrics_before = [http.get(f"{p.url}/metrics",
                                                   headers={"Authorization": f"Bearer {OPERATOR}"}).text
                                          for p in procs]
                        marks: list[tuple[float, str]] = []
                        coordinator = Coordinator(config, astore, log=partial(_mark, marks))
                        load = os.getloadavg()[0]
                        cpu0 = [cpu_seconds(p.proc.pid) for p in procs] + [time.process_time()]
                        profiler = cProfile.Profile() if profile else None
                        t0 = time.perf_counter()
                        if profiler is not None:
                            rec = profiler.runcall(coordinator.finalize, study.study_id)
                        else:
                            rec = coordinator.finalize(study.study_id)
                        seconds = time.perf_counter() - t0
                        if profiler is not None:
                            profiler.dump_stats(f"{profile}.n{n}.{len(runs)}")
                        cpu1 = [cpu_seconds(p.proc.pid) for p in procs] + [time.process_time()]
                        coordinator.close()
                        assert rec.state == "released", rec.state
                        metrics_after = [http.get(f"{p.url}/metrics",
                                                  headers={"Authorization": f"Bearer {OPERATOR}"}).text
                                         for p in procs]
                        server_s = [(_metric(a, "dpsketch_commit_duration_seconds") - _metric(b, "dpsketch_commit_duration_seconds"))
                                    + (_metric(a, "dpsketch_aggregate_duration_seconds") - _metric(b, "dpsketch_aggregate_duration_seconds"))
                                    for a, b in zip(metrics_after, metrics_before)]
                        cpu = [b - a for a, b in zip(cpu0, cpu1)]
                        runs.append({"seconds": seconds, "n_reports": rec.n_reports, "load": load,
                                     "cpu_s": cpu,
                                     "server_commit_aggregate_s": server_s,
                                     "phases": [(round(t - t0, 3), m[:90]) for t, m in marks]})
                    peak = [_status_kib(p.proc.pid, "VmHWM") for p in procs]
                astore.close() if hasattr(astore, "close") else None
            secs = [r["seconds"] for r in runs]
            row = {"n": n, "included": runs[0]["n_reports"], "fill_s": round(fill_s, 1),
                   "servers_idle_after_s": round(idle_s, 1), "finalize_s": round(statistics.median(secs), 3), "finalize_s_runs": [round(x, 3) for x in secs],
                   "finalize_s_per_million": round(statistics.median(secs) / n * 1e6, 3),
                   "server_commit_aggregate_s_max": round(max(max(r["server_commit_aggregate_s"]) for r in runs), 3),
                   "server_rss_before_mib": [round(x / 1024) for x in rss_before if x],
                   "server_peak_rss_mib": [round(x / 1024) for x in peak if x],
                   "load_average_1min": [round(r["load"], 2) for r in runs],
                   # CPU seconds each server process and the analyzer (this process) used during
                   # each finalize, and their sum over the wall time: near the number of cores
                   # (2 here), the finalize is CPU-bound and more cores would shorten it
                   "cpu_s_servers_analyzer": [[round(x, 2) for x in r["cpu_s"]] for r in runs],
                   "cpu_over_wall": [round(sum(r["cpu_s"]) / r["seconds"], 2) for r in runs],
                   "phases": runs[0]["phases"]}
            out["sizes"].append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(wd, ignore_errors=True)
    finally:
        if pg_dir is not None:
            _stop_postgres(pg_dir)
        if workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    if len(out["sizes"]) > 1:
        per = [r["finalize_s_per_million"] for r in out["sizes"]]
        out["growth_per_million_last_over_first"] = round(per[-1] / per[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dpsketch.tools.finalize_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[1e4, 1e5, 1e6])
    p.add_argument("--d", type=int, default=100)
    p.add_argument("--repeats", type=int, default=1, help="studies finalized per size (median)")
    p.add_argument("--pg", action="store_true", help="the servers on PostgreSQL (scripts/ensure-postgres.sh)")
    p.add_argument("--pg-options", default="", metavar="'-c NAME=VALUE ...'",
                   help="with --pg: server settings for its cluster (default: PostgreSQL's own), e.g. "
                        "'-c shared_buffers=4GB -c max_wal_size=16GB', docs/operations.md's sizing")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--seed", type=int, default=5, help="fixes the report ids, which each server misses, the "
                   "payloads and each study's sketch seed (default: %(default)s)")
    p.add_argument("--profile", metavar="PREFIX", help="write each finalization's cProfile of the analyzer's "
                   "calling thread to PREFIX.n<n>.<rep> (pstats)")
    args = p.parse_args(argv)
    print(json.dumps(bench_finalize([int(x) for x in args.sizes], d=args.d, repeats=args.repeats,
                                    workdir=args.workdir, pg=args.pg, pg_options=args.pg_options,
                                    seed=args.seed, profile=args.profile)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
