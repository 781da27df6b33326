"""The TypeScript client against the Python SDK: rows per CPU second (one core) to prepare
(clip, secret signs, exact discrete Gaussian noise, seed-compressed shares with the full share
rotating, binding, bodies) and to prepare and seal (version 4, classical suite, to fresh keys),
on the same rows of the same study, in the same run, modes and clients interleaved; medians.

    .venv/bin/python benchmarks/ts_client.py --rows 20000 --d 10 --repeats 3
    .venv/bin/python benchmarks/ts_client.py --rows 2000 --batch 500 --repeats 3 --validity

Needs clients/typescript built (``npx tsc -p tsconfig.test.json`` there; tests/test_ts_client.py
does it). CPU seconds: time.process_time for Python, process.cpuUsage for Node (each one thread).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dpsketch.client_sdk.prepare import prepare_batch  # noqa: E402
from dpsketch.protocol import envelope, validity  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402

PACKAGE = ROOT / "clients" / "typescript"


def python_run(study, rows: np.ndarray, batch: int, sealed: bool, recipients) -> float:
    width = validity.plan(study).leader_width if study.validity else study.width  # sealed at the leader's width
    t0 = time.process_time()
    n = study.n_servers
    for b in range(0, len(rows), batch):
        p = prepare_batch(study, rows[b:b + batch], compress=True, full=(b // batch) % n)
        for j in range(n):
            body = p.body(j)
            if sealed:
                envelope.seal_body(recipients[j], study.study_id, body, p.media_type(j), width, n)
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--d", type=int, default=10)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--validity", action="store_true", help="a study with validity proofs (norm-bound/1)")
    args = ap.parse_args()
    study = design(name="ts bench", columns=[f"x{i}" for i in range(args.d)], label=None,
                   servers=[f"s{j + 1}" for j in range(args.servers)], expected_reports=100_000, k=40, s=4,
                   validity=args.validity)[0]
    rows = np.random.default_rng(0).normal(0.0, 0.3 / np.sqrt(args.d / 3), size=(args.rows, args.d))
    keys = [envelope.generate_private_key() for _ in range(args.servers)]
    recipients = [envelope.Recipient(f"s{j + 1}", envelope.public_key_of(k), version=envelope.VERSION_4)
                  for j, k in enumerate(keys)]
    cfg = {"study": json.loads(study.model_dump_json(exclude_none=False)), "studyId": study.study_id,
           "rows": rows.tolist(), "batchSize": args.batch, "repeats": 1}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
        path = f.name
    python_run(study, rows[: args.batch], args.batch, True, recipients)  # warm-up (compiled loops)
    py = {"prepare": [], "prepare_seal": []}
    node = {"prepare": [], "prepare_seal": []}
    for _ in range(args.repeats):
        py["prepare"].append(python_run(study, rows, args.batch, False, recipients))
        py["prepare_seal"].append(python_run(study, rows, args.batch, True, recipients))
        out = subprocess.run(["node", "dist-test/bench/prepare_seal.js", path], cwd=PACKAGE, check=True,
                             capture_output=True, text=True).stdout
        got = json.loads(out)
        for k in node:
            node[k] += got["seconds"][k]
    print(f"study: d = {args.d} ({study.width} values a row), {args.servers} servers, k = {study.k}, "
          f"signed = {bool(study.secret_sign)}, validity = {study.validity}, seed-compressed; "
          f"{args.rows} rows in batches of {args.batch}; "
          f"node {got['node']}")
    print("| mode | Python SDK rows/s | TypeScript (Node) rows/s | Node / Python |")
    print("|---|---|---|---|")
    for k in ("prepare", "prepare_seal"):
        p, n = float(np.median(py[k])), float(np.median(node[k]))
        print(f"| {k.replace('_', ' + ')} | {args.rows / p:,.0f} | {args.rows / n:,.0f} | {p / n:.2f}x |")


if __name__ == "__main__":
    main()
