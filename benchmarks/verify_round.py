"""What a validity study's verification round adds to finalization (issue 40, docs/protocol.md
section 6d), against the same finalization of the same study without proofs, in one run.

Three real share-server processes (SQLite files) and the analyzer's Coordinator in this process
over loopback HTTP, as the analyzer service runs it. For each size n, two sketch studies designed
from the same arguments, one with ``validity=True``: the same rows are prepared by the SDK's
``prepare_batch`` (a rotating leader per batch) and uploaded as raw batches over HTTP; then each
study is finalized and timed, wall clock, with the round's phases from the coordinator's log
(commit + reveal, query, decide) and the bytes it moved: each server's query answer and the
decision's body (4 + 16 m + 16 m V bytes each: the verifier message, docs/protocol.md section 7).
Preparation and uploads are not timed. ``--trace-memory``: the analyzer's peak of traced
allocations during each finalization (tracemalloc; times are then not comparable).

    .venv/bin/python benchmarks/verify_round.py --sizes 10000 100000 --d 10 [--trace-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPERATOR = "bench-operator-token-0123456789"
ANALYST = "bench-analyst-token-0123456789"
SERVERS = ("s1", "s2", "s3")
OPEN = {"DPSKETCH_UPLOAD_AUTH": "open", "DPSKETCH_POPULATION_EPSILON": "none",
        "DPSKETCH_POPULATION_FLOOR_EPSILON": "none"}


def _studies(n: int, d: int, k: int):
    from dpsketch.protocol.study import design

    args = dict(columns=[f"x{i}" for i in range(d)], label=None, servers=list(SERVERS), expected_reports=n,
                k=k, s=4, min_reports=max(50, int(0.9 * n)), max_reports=2 * n)
    return [design(name=f"bench-verify-{n}-{v}", validity=v, **args)[0] for v in (False, True)]


def _upload(http, urls: list[str], study, n: int, batch: int, seed: int) -> None:
    from dpsketch.client_sdk.prepare import prepare_batch

    rng = np.random.default_rng(seed)
    for i, start in enumerate(range(0, n, batch)):
        rows = rng.normal(0, 0.3, (min(batch, n - start), study.d))
        prepared = prepare_batch(study, rows, compress=True, full=i % len(urls))
        for j, url in enumerate(urls):
            r = http.post(f"{url}/v1/studies/{study.study_id}/batches", content=prepared.body(j),
                          headers={"Content-Type": prepared.media_type(j)})
            r.raise_for_status()


def _mark(marks: list, message: str) -> None:
    marks.append((time.perf_counter(), message))


def bench(sizes: list[int], d: int, k: int, batch: int, workdir: Path | None,
          trace_memory: bool = False) -> list[dict]:
    import httpx

    from dpsketch.analyzer.config import ClusterConfig, ServerEndpoint
    from dpsketch.analyzer.coordinator import Coordinator
    from dpsketch.analyzer.store import AnalyzerStore
    from dpsketch.protocol import validity
    from dpsketch.tools.cluster import ServerSpec, share_server, start_all, stop_all

    base = workdir or Path(tempfile.mkdtemp(prefix="dpsketch-bench-verify-"))
    rows = []
    for n in sizes:
        wd = base / f"n{n}"
        shutil.rmtree(wd, ignore_errors=True)
        wd.mkdir(parents=True)
        with ExitStack() as stack:
            specs = [ServerSpec(sid, OPERATOR, ANALYST, wd / f"{sid}.sqlite3") for sid in SERVERS]
            procs = [share_server(spec, wd, OPEN) for spec in specs]
            start_all(procs, timeout=600)
            stack.callback(stop_all, procs)
            urls = [p.url for p in procs]
            config = ClusterConfig(servers=[ServerEndpoint(server_id=p.name, url=p.url, analyst_token=ANALYST)
                                            for p in procs])
            astore = AnalyzerStore(wd / "analyzer.sqlite3")
            plain, proved = _studies(n, d, k)
            with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {ANALYST}"}) as http:
                for study in (plain, proved):
                    for url in urls:
                        http.put(f"{url}/v1/studies/{study.study_id}", json=study.model_dump(mode="json")).raise_for_status()
                    astore.add_study(study, [])
                    t0 = time.perf_counter()
                    _upload(http, urls, study, n, batch, seed=n)
                    print(f"n={n} {'validity' if study.validity else 'plain'}: uploaded in "
                          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
                    for url in urls:  # warm: every server holds its totals in memory
                        http.get(f"{url}/v1/studies/{study.study_id}/report-ids").raise_for_status()
            row = {"n": n, "d": d, "k": k, "servers": len(SERVERS), "load_before": round(os.getloadavg()[0], 2)}
            for study in (plain, proved):
                marks: list = []
                coordinator = Coordinator(config, astore, log=partial(_mark, marks))
                if trace_memory:
                    tracemalloc.start()
                t0 = time.perf_counter()
                rec = coordinator.finalize(study.study_id)
                seconds = time.perf_counter() - t0
                if trace_memory:
                    # what the finalization allocated at most at once in this (the analyzer's)
                    # process: numpy's arrays and the bodies httpx read, beyond what it started with
                    row[f"{'validity' if study.validity else 'plain'}_analyzer_peak_mib"] = round(
                        tracemalloc.get_traced_memory()[1] / 2**20, 1)
                    tracemalloc.stop()
                coordinator.close()
                assert rec.state == "released" and rec.n_reports == n, (rec.state, rec.n_reports)
                key = "validity" if study.validity else "plain"
                row[f"{key}_finalize_s"] = round(seconds, 3)
                row[f"{key}_phases"] = [(round(t - t0, 3), m[:70]) for t, m in marks]
            plan = validity.plan(proved)
            row["verifier_elements_V"] = plan.verifier_len
            row["verifier_bytes_per_report_per_server"] = 16 + 16 * plan.verifier_len
            row["round_bytes_per_server"] = 2 * (4 + n * (16 + 16 * plan.verifier_len))
            row["ratio_validity_over_plain"] = round(row["validity_finalize_s"] / row["plain_finalize_s"], 2)
            row["load_after"] = round(os.getloadavg()[0], 2)
            astore.close()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--d", type=int, default=10)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--batch", type=int, default=5_000)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--trace-memory", action="store_true",
                    help="report the analyzer's peak of traced allocations during each finalization "
                         "(tracemalloc: slows it, so times are not comparable with a run without)")
    args = ap.parse_args(argv)
    bench(args.sizes, args.d, args.k, args.batch, args.workdir, args.trace_memory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
