"""What validity proofs cost a data owner through the SDK: upload bytes per report and rows/s,
a validity study (``validity="norm-bound/1"``, docs/protocol.md section 4c) against the same
sketch study without proofs, measured in the same run (ratios are what transfer between machines).

For each width: ``prepare_batch`` alone (CPU: clip, noise, encode, share, bind; with proofs also
digits, joint randomness, proof), alternating the two studies, best of ``--reps``; a server's
parse of a batch as leader and as helper (``ingest_costs``); then
``Client.submit_many`` over HTTP to N real share servers on loopback (tools/cluster.py, SQLite),
the two studies alternating, each run timed from the call to its return (every row stored at
every server). Bytes per report: the N request bodies of a batch over its rows, plaintext and
sealed (classical HPKE, version 3: a 16-byte tag a record and a header a body).

    .venv/bin/python benchmarks/validity_upload.py [--d 10 100] [--rows 10000] [--servers 3] [--reps 3]

Measured here (2 shared cores, load 4-6; --rows 10000 --reps 3, N = 3, best of 3; a batch below
kernels.MIN_ROWS = 4096 rows takes the uncompiled paths, so use 10^4 rows):

| d | bytes/report (plain) | validity / plain | prepare rows/s (plain) | slowdown | submit rows/s (plain) | slowdown |
|---|---|---|---|---|---|---|
| 10 | 1,784 (336) | 5.3x | 55,000 (641,000) | 11.6x | 19,300 (144,000) | 7.5x |
| 100 | 7,456 (1,056) | 7.1x | 7,200 (111,000) | 15.4x | 6,400 (50,700) | 8.0x |

A server's parse of a batch (us a report, leader / helper): d = 10 1.9 / 1.5 (plain 0.55 / 0.64),
d = 100 15.6 / 12.4 (plain 1.2 / 1.1). Sealed (version 4: one AEAD per body) adds a few bytes
per body, not per report.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def studies(d: int, n_servers: int, rows: int):
    from dpsketch.protocol.study import design

    kwargs = dict(name=f"bench-v{d}", columns=[f"x{i}" for i in range(d)], label="x0",
                  servers=[f"s{j + 1}" for j in range(n_servers)], expected_reports=100_000,
                  epsilon_floor=None)
    proved = design(validity=True, **kwargs)[0]
    plain = design(**kwargs)[0]
    return proved, plain


def body_bytes(study, batch) -> tuple[float, float]:
    """(plaintext, sealed) bytes per report of one prepared batch, over its N bodies."""
    from dpsketch.protocol import envelope, binding, proved_shares
    from dpsketch.protocol.messages import SEEDS_MEDIA_TYPE

    m = len(batch)
    plain = sum(len(batch.body(j)) for j in range(study.n_servers))
    sealed = sum(envelope.body_bytes(binding.CONTENT_SEED if batch.media_type(j) == SEEDS_MEDIA_TYPE
                                     else binding.CONTENT_SHARE, proved_shares.upload_width(study),
                                     study.n_servers, m) for j in range(study.n_servers))
    return plain / m, sealed / m


def prepare_rates(proved, plain, rows: np.ndarray, reps: int) -> dict:
    from dpsketch.client_sdk.prepare import prepare_batch

    best = {"validity": float("inf"), "plain": float("inf")}
    sizes = {}
    for _ in range(reps):
        for name, study in (("validity", proved), ("plain", plain)):
            t = time.perf_counter()
            batch = prepare_batch(study, rows, compress=True)
            best[name] = min(best[name], time.perf_counter() - t)
            sizes[name] = body_bytes(study, batch)
    return {f"{name}_prepare_rows_per_s": len(rows) / best[name] for name in best} | {
        f"{name}_{kind}_bytes_per_report": round(sizes[name][i], 1)
        for name in sizes for i, kind in enumerate(("upload", "sealed_upload"))}


def ingest_costs(proved, plain, rows: np.ndarray, reps: int) -> dict:
    """A server's parse of one batch (decode, binding check, a validity leader's field check, the
    seed expansion or the digits' map to what its totals fold: services.app._parse_batch), us a
    report, best of ``reps``, as the leader (explicit shares) and as a helper (seeds)."""
    from dpsketch.client_sdk.prepare import prepare_batch
    from dpsketch.services.app import _parse_batch

    out = {}
    for name, study in (("validity", proved), ("plain", plain)):
        batch = prepare_batch(study, rows, compress=True, full=0)
        for j, role in ((0, "leader"), (1, "helper")):
            body, media_type = batch.body(j), batch.media_type(j)
            _parse_batch(body, study, media_type, study.servers[j], None)  # warm
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                _parse_batch(body, study, media_type, study.servers[j], None)
                best = min(best, time.perf_counter() - t)
            out[f"{name}_{role}_ingest_us_per_report"] = 1e6 * best / len(rows)
    return out


def submit_rates(proved, plain, rows: np.ndarray, reps: int, n_servers: int, workdir: Path) -> dict:
    import httpx

    from dpsketch.client_sdk import Client
    from dpsketch.tools.cluster import ServerSpec, share_server, start_all, stop_all

    env = {"DPSKETCH_UPLOAD_AUTH": "open", "DPSKETCH_POPULATION_EPSILON": "none",
           "DPSKETCH_POPULATION_FLOOR_EPSILON": "none", "DPSKETCH_MAX_FLOOR_EPSILON": "none",
           "DPSKETCH_MAX_STUDY_BYTES": "none"}
    specs = [ServerSpec(server_id=f"s{j + 1}", operator_token=f"op-token-{j}-0123456789abcdef",
                        analyst_token=f"an-token-{j}-0123456789abcdef", db_path=workdir / f"s{j + 1}.sqlite3")
             for j in range(n_servers)]
    procs = [share_server(spec, workdir, env) for spec in specs]
    start_all(procs)
    best = {"validity": float("inf"), "plain": float("inf")}
    try:
        urls = [p.url for p in procs]
        for rep in range(reps):
            for name, study in (("validity", proved), ("plain", plain)):
                study = study.model_copy(update={"name": f"{study.name}-{rep}"})
                for spec, url in zip(specs, urls):
                    r = httpx.put(f"{url}/v1/studies/{study.study_id}", content=study.canonical(), timeout=120,
                                  headers={"Authorization": f"Bearer {spec.operator_token}",
                                           "Content-Type": "application/json"})
                    r.raise_for_status()
                with Client(urls, journal=False) as client:
                    client.study(study.study_id)
                    t = time.perf_counter()
                    result = client.submit_many(study.study_id, rows)
                    best[name] = min(best[name], time.perf_counter() - t)
                assert result.n_reports == len(rows)
    finally:
        stop_all(procs)
    return {f"{name}_submit_rows_per_s": len(rows) / best[name] for name in best}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, nargs="+", default=[10, 100])
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-http", action="store_true", help="prepare and bytes only")
    args = p.parse_args()
    out = []
    for d in args.d:
        proved, plain = studies(d, args.servers, args.rows)
        rows = 0.9 * np.random.default_rng(d).uniform(-1, 1, (args.rows, d)) / np.sqrt(d)  # inside the ball
        figures = {"d": d, "width": proved.width, "n_servers": args.servers, "rows": args.rows}
        figures |= prepare_rates(proved, plain, rows, args.reps)
        figures |= ingest_costs(proved, plain, rows, args.reps)
        if not args.no_http:
            with tempfile.TemporaryDirectory() as tmp:
                figures |= submit_rates(proved, plain, rows, args.reps, args.servers, Path(tmp))
        figures["upload_ratio"] = figures["validity_upload_bytes_per_report"] / figures["plain_upload_bytes_per_report"]
        figures["prepare_slowdown"] = figures["plain_prepare_rows_per_s"] / figures["validity_prepare_rows_per_s"]
        if not args.no_http:
            figures["submit_slowdown"] = figures["plain_submit_rows_per_s"] / figures["validity_submit_rows_per_s"]
        out.append({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()})
        print(json.dumps(out[-1]), flush=True)


if __name__ == "__main__":
    main()
