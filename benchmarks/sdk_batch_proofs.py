"""What a data owner's client pays to prepare rows of a sketch study with validity, by how its
rows are proved: batch proofs (``batch_proofs``, docs/protocol.md section 4d: one proof a batch,
``report.prepare_proof_batch``), per-report proofs (section 4c, ``report.prepare``), and the same
study without validity (no proofs, seed-compressed shares). No network: what ``submit_many``
prepares, in its default batches (``client_sdk.upload.proof_batch_rows`` / ``batch_rows``), the
leader (or full-share server) rotating; the three modes alternate in each repeat and the ratios
are of the same run (they transfer between machines; seconds do not). The load average is
printed before and after.

    .venv/bin/python benchmarks/sdk_batch_proofs.py [--rows 100000] [--d 100] [--servers 3] [--reps 3]

Measured (session 56, 2 shared cores with the lead's and another helper's work, load 2.1-2.5;
--rows 100000 --d 100 --reps 3, N = 3, median of 3; seconds per 10^5 rows, wall):

| mode | batch rows | s / 10^5 rows | bytes / row | batch proofs / this |
|---|---|---|---|---|
| batch proofs | 9,900 | 2.47 | 847 | 1 |
| per-report proofs | 1,025 | 12.9 | 8,376 | 0.19x time, 0.10x bytes |
| no proofs (seeds) | 9,709 | 1.35 | 1,056 | 1.83x time, 0.80x bytes |

(CPU time gives the same ratios within 0.02.) At d = 10 (--d 10, load 2.4-2.6): batch proofs
0.50 s in batches of 69,292 rows, 121 bytes a row; 0.21x the time of per-report proofs (2.36 s,
1,784 bytes) and 1.48x that without proofs (0.34 s, 336 bytes). Nearly all of a proved batch's time is the core's
(``batch_validity.prove``: the FLP's NTTs, the wrap projections, the helpers' expansion; the noise
about a fifth); the SDK adds nothing measurable.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def studies(d: int, n_servers: int):
    from dpsketch.protocol.study import design

    kwargs = dict(name=f"bench-bp{d}", columns=[f"x{i}" for i in range(d)], label="x0",
                  servers=[f"s{j + 1}" for j in range(n_servers)], expected_reports=1_000_000,
                  epsilon_floor=None, seed="ab" * 32)
    return {"batch_proofs": design(validity=True, batch_proofs=True, **kwargs)[0],
            "per_report": design(validity=True, **kwargs)[0],
            "no_proofs": design(**kwargs)[0]}


def batch_size(mode: str, study) -> int:
    from dpsketch.client_sdk.upload import MAX_BATCH_BYTES, batch_rows, proof_batch_rows
    from dpsketch.protocol import messages, proved_shares

    if mode == "batch_proofs":
        return proof_batch_rows(study, None, MAX_BATCH_BYTES)
    record = messages.record_bytes(messages.SHARES_MEDIA_TYPE, proved_shares.upload_width(study), study.n_servers)
    return batch_rows(None, record, MAX_BATCH_BYTES)


def prepare_all(mode: str, study, rows: np.ndarray, size: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, bytes sent) to prepare every batch of ``rows`` as submit_many does."""
    from dpsketch.client_sdk.prepare import prepare_batch, prepare_proof_batch

    n = study.n_servers
    sent = 0
    w0, c0 = time.perf_counter(), time.process_time()
    for i, start in enumerate(range(0, len(rows), size)):
        chunk = rows[start:start + size]
        batch = (prepare_proof_batch(study, chunk, i % n) if mode == "batch_proofs"
                 else prepare_batch(study, chunk, compress=True, full=i % n))
        sent += sum(len(batch.body(j)) for j in range(n))
    return time.perf_counter() - w0, time.process_time() - c0, sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--d", type=int, default=100)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    load_before = os.getloadavg()
    by_mode = studies(args.d, args.servers)
    rows = np.random.default_rng(0).normal(0.0, 1.0, size=(args.rows, args.d))
    rows *= 0.95 / np.linalg.norm(rows, axis=1, keepdims=True).max()
    sizes = {mode: batch_size(mode, study) for mode, study in by_mode.items()}
    for mode, study in by_mode.items():  # compiled loops loaded, plans built (as a first batch would)
        prepare_all(mode, study, rows[:min(args.rows, sizes[mode])], sizes[mode])
    wall: dict[str, list[float]] = {m: [] for m in by_mode}
    cpu: dict[str, list[float]] = {m: [] for m in by_mode}
    sent: dict[str, int] = {}
    for _ in range(args.reps):
        for mode, study in by_mode.items():
            w, c, b = prepare_all(mode, study, rows, sizes[mode])
            wall[mode].append(w)
            cpu[mode].append(c)
            sent[mode] = b
    per = 100_000 / args.rows
    out = {mode: {"batch_rows": sizes[mode], "wall_s_per_1e5_rows": round(float(np.median(wall[mode])) * per, 3),
                  "cpu_s_per_1e5_rows": round(float(np.median(cpu[mode])) * per, 3),
                  "bytes_per_row": round(sent[mode] / args.rows, 1)} for mode in by_mode}
    b = out["batch_proofs"]
    ratios = {f"batch_proofs / {other}": {key: round(b[key] / out[other][key], 3)
                                          for key in ("wall_s_per_1e5_rows", "cpu_s_per_1e5_rows", "bytes_per_row")}
              for other in ("per_report", "no_proofs")}
    print(json.dumps({"rows": args.rows, "d": args.d, "n_servers": args.servers, "reps": args.reps,
                      "load_before": [round(x, 2) for x in load_before],
                      "load_after": [round(x, 2) for x in os.getloadavg()], "modes": out, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
