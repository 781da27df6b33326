"""What batch proofs cost end to end (issue 40's cost targets): a bulk owner's rows through real
share servers and the analyzer's finalization, a study with batch proofs against the same study
without proofs, in one run.

Three real share-server processes (SQLite files) on loopback and the analyzer's Coordinator in
this process, as benchmarks/verify_round.py. For n rows of d columns, two sketch studies designed
from the same arguments, one with ``validity=True, batch_proofs=True`` (and, with
``--per-report``, a third with per-report proofs). For each:

* client: the CPU seconds of this process preparing the rows a batch at a time (without proofs
  ``report.prepare``, seed-compressed, as the SDK uploads; with batch proofs
  ``report.prepare_proof_batch``: one proof per batch, the leader rotating);
* upload bytes per row: every request body to every server over n;
* server ingest: the CPU seconds the three server processes spent while the prepared bodies were
  posted (raw HTTP, one batch at a time to each server), read from /proc;
* finalization: the wall clock of ``Coordinator.finalize`` (with proofs: the verification round,
  section 6d, then the commit and the release) and the servers' CPU seconds during it;
* server total: ingest + finalization CPU of the servers, the figure issue 40 bounds at 3x.

Each arm runs ``--reps`` times, interleaved (plain, proved, plain, ...) with fresh studies; the
figures are medians, the ratios of medians; the load average is recorded before and after.

    .venv/bin/python benchmarks/batch_ingest.py --n 100000 --d 100 --batch 9900
    .venv/bin/python benchmarks/batch_ingest.py --n 1000000 --d 100 --batch 9900 --reps 2
    .venv/bin/python benchmarks/batch_ingest.py --n 1000000 --d 10 --batch 69292 --reps 2

Measured here (2 shared cores; the batches the SDK's defaults, ``upload.proof_batch_rows``; ratios
with proofs over without, medians, the per-repetition ratios in brackets):

| n, d | load | servers' CPU (ingest + finalization) | ingest alone | client CPU | bytes a row |
|---|---|---|---|---|---|
| 10^6, 100 | 1.2-2.1 | 2.57x (2.39, 2.79) | 1.22x | 1.54x (1.27, 1.94) | 855 / 1,056 = 0.81x |
| 10^6, 10 | 0.7-3.8 | 2.21x (2.26, 2.13) | 1.10x | 1.33x (1.14, 1.67) | 129 / 336 = 0.38x |
| 10^5, 100 | 1.2 | 2.73x (4.38 with the servers' first load of the loops, 2.73, 2.72) | 1.38x | 2.26x | 0.80x |
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPERATOR = "bench-operator-token-0123456789"
ANALYST = "bench-analyst-token-0123456789"
SERVERS = ("s1", "s2", "s3")
OPEN = {"DPSKETCH_UPLOAD_AUTH": "open", "DPSKETCH_POPULATION_EPSILON": "none",
        "DPSKETCH_POPULATION_FLOOR_EPSILON": "none", "DPSKETCH_MAX_FLOOR_EPSILON": "none",
        "DPSKETCH_MAX_STUDY_BYTES": "none"}
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its waited-for children (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / TICK


def _study(n: int, d: int, k: int, arm: str, rep: int):
    from dpsketch.protocol.study import design

    flags = {"plain": {}, "batch": {"validity": True, "batch_proofs": True}, "report": {"validity": True}}[arm]
    return design(name=f"bench-batch-{arm}-{n}-{rep}", columns=[f"x{i}" for i in range(d)], label=None,
                  servers=list(SERVERS), expected_reports=n, k=k, min_reports=int(0.9 * n),
                  max_reports=2 * n, **flags)[0]


def _prepare(study, rows: np.ndarray, batch: int, arm: str) -> list:
    from dpsketch.protocol import report

    out = []
    for i, start in enumerate(range(0, len(rows), batch)):
        part = rows[start:start + batch]
        if arm == "batch":
            out.append(report.prepare_proof_batch(study, part, leader=i % len(SERVERS)))
        else:
            out.append(report.prepare(study, part, compress=True, full=i % len(SERVERS)))
    return out


def run_arm(http, procs, config, astore, n: int, d: int, k: int, batch: int, arm: str, rep: int,
            rows: np.ndarray) -> dict:
    from dpsketch.analyzer.coordinator import Coordinator

    study = _study(n, d, k, arm, rep)
    urls = [p.url for p in procs]
    for url in urls:
        http.put(f"{url}/v1/studies/{study.study_id}", content=study.canonical(),
                 headers={"Content-Type": "application/json",
                          "Authorization": f"Bearer {OPERATOR}"}).raise_for_status()
    astore.add_study(study, [])
    c0 = time.process_time()
    prepared = _prepare(study, rows, batch, arm)
    client = time.process_time() - c0
    sent = sum(len(b.body(j)) for b in prepared for j in range(len(urls)))
    pids = [p.proc.pid for p in procs]
    s0 = sum(cpu_seconds(pid) for pid in pids)
    for b in prepared:
        for j, url in enumerate(urls):
            http.post(f"{url}/v1/studies/{study.study_id}/batches", content=b.body(j),
                      headers={"Content-Type": b.media_type(j)}).raise_for_status()
    s1 = sum(cpu_seconds(pid) for pid in pids)
    coordinator = Coordinator(config, astore, log=lambda _m: None)
    t0 = time.perf_counter()
    rec = coordinator.finalize(study.study_id)
    wall = time.perf_counter() - t0
    s2 = sum(cpu_seconds(pid) for pid in pids)
    coordinator.close()
    assert rec.state == "released" and rec.n_reports == n, (rec.state, rec.n_reports)
    return {"client_cpu_s": client, "bytes_per_row": sent / n, "server_ingest_cpu_s": s1 - s0,
            "finalize_s": wall, "server_finalize_cpu_s": s2 - s1, "server_total_cpu_s": s2 - s0}


def bench(n: int, d: int, k: int, batch: int, reps: int, per_report: bool, workdir: Path | None) -> dict:
    import httpx

    from dpsketch.analyzer.config import ClusterConfig, ServerEndpoint
    from dpsketch.analyzer.store import AnalyzerStore
    from dpsketch.tools.cluster import ServerSpec, share_server, start_all, stop_all

    wd = workdir or Path(tempfile.mkdtemp(prefix="dpsketch-bench-batch-"))
    shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True)
    arms = ["plain", "batch"] + (["report"] if per_report else [])
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    rows = np.random.default_rng(n).normal(0, 0.3 / np.sqrt(d), (n, d))
    out: dict = {"n": n, "d": d, "k": k, "batch": batch, "reps": reps, "load_before": round(os.getloadavg()[0], 2)}
    with ExitStack() as stack:
        specs = [ServerSpec(sid, OPERATOR, ANALYST, wd / f"{sid}.sqlite3") for sid in SERVERS]
        procs = [share_server(spec, wd, OPEN) for spec in specs]
        start_all(procs, timeout=600)
        stack.callback(stop_all, procs)
        config = ClusterConfig(servers=[ServerEndpoint(server_id=p.name, url=p.url, analyst_token=ANALYST)
                                        for p in procs])
        astore = AnalyzerStore(wd / "analyzer.sqlite3")
        stack.callback(astore.close)
        http = stack.enter_context(httpx.Client(timeout=1800, headers={"Authorization": f"Bearer {ANALYST}"}))
        for rep in range(reps):
            for arm in arms:
                got = run_arm(http, procs, config, astore, n, d, k, batch, arm, rep, rows)
                runs[arm].append(got)
                print(json.dumps({"arm": arm, "rep": rep} | {a: round(b, 3) for a, b in got.items()}),
                      file=sys.stderr, flush=True)
    for arm in arms:
        for key in runs[arm][0]:
            out[f"{arm}_{key}"] = round(statistics.median(r[key] for r in runs[arm]), 3)
    for arm in arms[1:]:
        for key in ("client_cpu_s", "bytes_per_row", "server_ingest_cpu_s", "server_total_cpu_s", "finalize_s"):
            out[f"ratio_{arm}_{key}"] = round(out[f"{arm}_{key}"] / out[f"plain_{key}"], 2)
    out["load_after"] = round(os.getloadavg()[0], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--d", type=int, default=100)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--batch", type=int, default=9_900, help="rows a batch (a proof, for batch proofs)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--per-report", action="store_true", help="also a study with per-report proofs")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args(argv)
    print(json.dumps(bench(args.n, args.d, args.k, args.batch, args.reps, args.per_report, args.workdir)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
