"""``dpsketch bench``: the figures we promise, measured on this machine, as ratios in one run.

* ``commit``   - commit + aggregate over 10^6 stored reports (d = 100, k = 400, s = 4) on one
                 server, against the exact scipy.sparse sketch of the same shares;
* ``upload``   - bulk upload rows/s over loopback HTTP (d = 32) against raw SQLite inserts and
                 the exact sketch, as full shares, as the seeds every server but one
                 receives, and as one server of 3 receives an SDK upload (full shares in every
                 third batch; with each store's bytes on disk per report), and single-report
                 uploads from 64 concurrent clients against one fsync per report;
* ``sealed``   - HPKE-sealed shares (docs/protocol.md section 7a) against plaintext: bytes per
                 report, sealing and opening time per share (version 4 batches), and bulk upload
                 rows/s to one real server over loopback (d = 32) of plaintext and version 4
                 classical and post-quantum batches, with each one's ratio to plaintext; not
                 part of ``all``;
* ``load``     - 64 concurrent clients uploading single reports to one server for 60 s (the load
                 test of tests/test_faults.py, one driver in tools/loadtest.py): throughput,
                 p50/p99, errors, server RSS start/end, against the same driver on the server's
                 GET /healthz; ``--seconds``, ``--clients``; not part of ``all``;
* ``overload`` - offered load at ``--factor`` (default 2) x capacity for ``--seconds`` (default
                 10) against one durable server, with and without its in-flight upload limits
                 (services/admission.py; the second run offered the first one's rate):
                 capacity from closed-loop clients, then an open-loop flood of 500-row
                 batches: accepted throughput, p99, refusals with Retry-After,
                 server RSS, and every acknowledged report id checked in the store (lost = 0);
                 not part of ``all``;
* ``seeds``    - seed-compressed shares against full shares at d = 10 and d = 100 (N = 3, 10^5
                 rows): a client's prepare time (noise, encode, share, bind) and bytes per row;
                 a server's decode + binding check + expansion of a seed body against the same
                 reports' full-share body, expansion rows/s, and the speed-up over one
                 ``cryptography`` cipher per seed; seconds until a fresh process can expand
                 seeds (compiled, then from numba's cache); not part of ``all``;
* ``accuracy`` - the demo's error ratios (LTM, local, central) at n = 10^4, 10^5, 10^6 through
                 the real pipeline (real processes, SDK over HTTP, analyzer REST);
* ``finalize`` - what the analyst waits for: a study finalized on 3 real server processes
                 holding 10^4, 10^5, 10^6 reports (d = 100, k = 400, s = 4, each server missing
                 1 %), end to end with its phases, the servers' own commit + aggregate time and
                 peak RSS, and seconds per 10^6 reports at each size (linear growth: flat); the
                 same with more sizes or PostgreSQL: ``python -m dpsketch.tools.finalize_bench``; not
                 part of ``all``;
* ``histogram`` - the whole path of a histogram study (10^6 clients, 10 bins x 3 classes, through
                 the SDK to 3 servers, finalize, every statistic over REST) with its times and
                 each statistic's error against the non-private value; not part of ``all``.

Timings on a shared machine are noisy, so each figure comes with its baseline from the same run.
``--quick`` runs everything at small sizes (what CI can afford).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def bench_accuracy(ns: list[int], d: int = 10, epsilon: float = 1.0, delta: float = 1e-6,
                   seed: int = 0) -> list[dict[str, Any]]:
    from dpsketch.tools import demo

    rows = []
    for n in ns:
        args = demo.build_parser().parse_args(
            ["--clients", str(n), "--d", str(d), "--epsilon", str(epsilon), "--delta", str(delta),
             "--seed", str(seed), "--kind", "sketch", "--json"]
        )
        t0 = time.perf_counter()
        result = demo.run(args)
        rows.append({
            "n": n,
            **{task: {"ltm": result[task]["sketch"], "local": result[task]["local"],
                      "central": result[task]["central"]} for task in ("ridge", "pca")},
            "k": result["studies"]["sketch"]["ridge"]["k"],
            "seconds": round(time.perf_counter() - t0, 1),
        })
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def bench_histogram(n: int = 10**6, seed: int = 0) -> dict[str, Any]:
    """A histogram study end to end on a local cluster of real processes: upload, finalize, and
    every statistic the analyzer serves, timed; errors against the non-private statistics of the
    same binned data."""
    import shutil
    import tempfile
    from contextlib import ExitStack
    from pathlib import Path

    import numpy as np

    from dpsketch.analyzer.client import AnalyzerClient
    from dpsketch.client_sdk import Client
    from dpsketch.tools import demo
    from dpsketch.client_sdk.prepare import prepare_batch
    from dpsketch.client_sdk.upload import default_batch_rows
    from dpsketch.protocol import Study
    from dpsketch.protocol.histogram import HistogramSpec

    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.0, n)
    label = np.where(rng.random(n) < 1.0 / (1.0 + np.exp(-1.5 * x)), "1", "0")
    spec = {"axes": [{"column": "x", "edges": [float(e) for e in np.linspace(-2.0, 2.0, 9)]},
                     {"column": "label", "categories": ["0", "1"]}]}  # 10 x 3 cells
    out: dict[str, Any] = {"n": n, "cells": HistogramSpec.model_validate(spec).cells}
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="dpsketch-bench-hist-"))
        stack.callback(shutil.rmtree, workdir, True)
        cluster = demo.start_local_cluster(3, workdir, stack)
        with AnalyzerClient(cluster.analyzer_url, cluster.analyzer_token) as an:
            created = an.create_study(name="bench-histogram", kind="histogram", histogram=spec,
                                      expected_reports=n, min_reports=n)
            sid = created["study_id"]
            tokens = cluster.upload_tokens(sid, n)
            rows = np.column_stack([x, label]).astype(object)
            t0 = time.perf_counter()
            with Client(cluster.server_urls, token=tokens) as client:
                client.submit_many(sid, rows)
            out["upload_s"] = round(time.perf_counter() - t0, 1)
            # baseline from the same run: the client's own work alone (cells, noise, shares),
            # in the SDK's batches, with nothing sent
            study = Study.model_validate(created["study"])
            per_batch = default_batch_rows(study.width, study.n_servers)
            t0 = time.perf_counter()
            for i in range(0, n, per_batch):
                prepare_batch(study, rows[i:i + per_batch])
            out["prepare_only_s"] = round(time.perf_counter() - t0, 1)
            out["upload_rows_per_s"] = round(n / out["upload_s"])
            out["upload_over_prepare_only"] = round(out["upload_s"] / max(out["prepare_only_s"], 1e-9), 2)
            t0 = time.perf_counter()
            an.finalize(sid)
            out["finalize_s"] = round(time.perf_counter() - t0, 1)
            t0 = time.perf_counter()
            got = {"auc": an.statistic(sid, "auc", score="x", label="label", positive="1"),
                   "kendall_tau": an.statistic(sid, "kendall-tau"),
                   "gini_mean_difference": an.statistic(sid, "gini-mean-difference", column="x"),
                   "gini_simpson": an.statistic(sid, "gini-simpson", column="label"),
                   "mean": an.statistic(sid, "moments", column="x")}
            quantiles = an.statistic(sid, "quantiles", column="x", probabilities=[0.1, 0.5, 0.9])
            out["statistics_s"] = round(time.perf_counter() - t0, 2)
    from dpsketch.analyzer.analyses.histogram import (AUC, BinnedMoments, GiniMeanDifference, GiniSimpson, KendallTau,
                                    NoisyHistogram)

    h = HistogramSpec.model_validate(spec)
    exact = NoisyHistogram(spec=h, counts=np.bincount(h.cell_index(np.column_stack([x, label]).astype(object)),
                                                      minlength=h.cells).astype(float),
                           noise_variance=0.0, n_reports=n)
    truth = {"auc": AUC("x", "label", "1").fit(exact).auc_, "kendall_tau": KendallTau().fit(exact).tau_,
             "gini_mean_difference": GiniMeanDifference("x").fit(exact).gmd_,
             "gini_simpson": GiniSimpson("label").fit(exact).diversity_,
             "mean": BinnedMoments("x").fit(exact).mean_}
    out["statistics"] = {k: {"value": v["value"], "se": v["se"], "true": float(truth[k]),
                             "error": abs(v["value"] - float(truth[k]))} for k, v in got.items()}
    out["quantiles"] = quantiles["quantiles"]
    return out


def accuracy_table(rows: list[dict[str, Any]]) -> str:
    out = [f"{'n':>9} {'k':>5} | {'ridge LTM':>9} {'local':>9} {'central':>8} | "
           f"{'PCA LTM':>8} {'local':>9} {'central':>8}"]
    for r in rows:
        out.append(
            f"{r['n']:>9} {r['k']:>5} | {r['ridge']['ltm']:>9.3f} {r['ridge']['local']:>9.3f} "
            f"{r['ridge']['central']:>8.3f} | {r['pca']['ltm']:>8.3f} {r['pca']['local']:>9.3f} "
            f"{r['pca']['central']:>8.3f}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dpsketch bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", nargs="?", default="all",
                   choices=["commit", "upload", "sealed", "seeds", "load", "overload", "accuracy", "histogram",
                            "finalize", "all"])
    p.add_argument("--seconds", type=float, help="load: how long to drive uploads (default: 60; --quick: 5); "
                   "overload: how long to offer the overload (default: 10; --quick: 4)")
    p.add_argument("--factor", type=float, default=2.0,
                   help="overload: offered load as a multiple of the measured capacity (default: %(default)s)")
    p.add_argument("--clients", type=int, default=64, help="load: concurrent clients (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="small sizes: seconds, not minutes")
    p.add_argument("--out", help="also write the figures as JSON to this file")
    args = p.parse_args(argv)

    from dpsketch.tools import server_bench

    figures: dict[str, Any] = {}
    if args.which in ("commit", "all"):
        n = 50_000 if args.quick else 10**6
        figures["commit"] = server_bench.bench_commit(n=n, d=100, k=400, s=4)
        print(json.dumps({"commit": figures["commit"]}), flush=True)
    if args.which in ("upload", "all"):
        n = 40_000 if args.quick else 400_000
        figures["bulk_upload"] = server_bench.bench_bulk_upload(n=n, d=32)
        print(json.dumps({"bulk_upload": figures["bulk_upload"]}), flush=True)
        figures["bulk_upload_seeds"] = server_bench.bench_bulk_upload(n=n, d=32, seeds=True)
        print(json.dumps({"bulk_upload_seeds": figures["bulk_upload_seeds"]}), flush=True)
        figures["bulk_upload_one_of_3"] = server_bench.bench_bulk_upload(n=n, d=32, rotation=3)
        print(json.dumps({"bulk_upload_one_of_3": figures["bulk_upload_one_of_3"]}), flush=True)
        figures["single_upload"] = server_bench.bench_single_upload(
            clients=64, seconds=1.5 if args.quick else 20.0, d=32)
        print(json.dumps({"single_upload": figures["single_upload"]}), flush=True)
    if args.which == "sealed":
        from dpsketch.tools.client_bench import bench_encryption

        figures["sealed_envelope"] = bench_encryption(n=2_000 if args.quick else 20_000, d=32, n_servers=3)
        print(json.dumps({"sealed_envelope": figures["sealed_envelope"]}), flush=True)
        figures["sealed_upload"] = server_bench.bench_sealed_upload(n=20_000 if args.quick else 100_000, d=32)
        print(json.dumps({"sealed_upload": figures["sealed_upload"]}), flush=True)
    if args.which == "seeds":
        from dpsketch.tools.client_bench import bench_compression

        n = 10_000 if args.quick else 100_000
        figures["seeds_warm_up"] = server_bench.bench_seed_warm_up()
        print(json.dumps({"seeds_warm_up": figures["seeds_warm_up"]}), flush=True)
        for d in (10, 100):
            for key, fig in ((f"seeds_client_d{d}", bench_compression(n=n, d=d, n_servers=3)),
                             (f"seeds_server_d{d}", server_bench.bench_seed_expansion(n=n, d=d, n_servers=3))):
                figures[key] = fig
                print(json.dumps({key: fig}), flush=True)
    if args.which == "load":
        from dpsketch.tools import loadtest

        seconds = args.seconds or (5.0 if args.quick else 60.0)
        figures["load"] = loadtest.bench_load(seconds=seconds, clients=args.clients)
        print(json.dumps({"load": figures["load"]}), flush=True)
        print(loadtest.summary(figures["load"]), flush=True)
    if args.which == "overload":
        from dpsketch.tools import loadtest

        seconds = args.seconds or (4.0 if args.quick else 10.0)
        rate = None  # the second run is offered the first one's rate: one offered load, two servers
        for admission in (True, False):
            key = "overload" if admission else "overload_without_admission"
            figures[key] = loadtest.bench_overload(seconds=seconds, factor=args.factor, admission=admission,
                                                   capacity_seconds=3.0 if args.quick else 6.0, rate=rate)
            rate = figures[key]["offered_batches_per_s"]
            print(json.dumps({key: figures[key]}), flush=True)
            print(loadtest.overload_summary(figures[key]), flush=True)
    if args.which == "finalize":
        from dpsketch.tools.finalize_bench import bench_finalize

        figures["finalize"] = bench_finalize([10**4, 10**5] if args.quick else [10**4, 10**5, 10**6])
        print(json.dumps({"finalize": figures["finalize"]}), flush=True)
    if args.which == "histogram":
        figures["histogram"] = bench_histogram(n=20_000 if args.quick else 10**6)
        print(json.dumps({"histogram": figures["histogram"]}), flush=True)
    if args.which in ("accuracy", "all"):
        ns = [2_000, 10_000] if args.quick else [10**4, 10**5, 10**6]
        figures["accuracy"] = bench_accuracy(ns)
        print(accuracy_table(figures["accuracy"]), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(figures, fh, indent=1)
    return 0
