"""The TypeScript client against the Python SDK: rows per CPU second (one core) to prepare
(clip, secret signs, exact discrete Gaussian noise, seed-compressed shares with the full share
rotating, binding, bodies) and to prepare and seal (version 4, classical suite, to fresh keys),
on the same rows of the same study, in the same run, modes and clients interleaved; medians.

    .venv/bin/python benchmarks/ts_client.py --rows 20000 --d 10 --repeats 3
    .venv/bin/python benchmarks/ts_client.py --rows 2000 --batch 500 --repeats 3 --validity
    .venv/bin/python benchmarks/ts_client.py --rows 2000 --batch 500 --repeats 3 --validity --parties --d 10

``--parties``: a signed study with two parties (the first d/2 columns, the rest), timing the
first party's blocks (d_j = d/2; proved with the party's own plan under ``--validity``), the
leader rotating batch by batch, each individual a fresh pseudonym.

Needs clients/typescript built (``npm run build:test`` there; tests/test_ts_client.py
does it). CPU seconds: time.process_time for Python, process.cpuUsage for Node (each one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dpsketch.client_sdk.prepare import prepare_batch, prepare_blocks  # noqa: E402
from dpsketch.protocol import envelope, parties, proved_shares  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402

PACKAGE = ROOT / "clients" / "typescript"


def python_run(study, rows: np.ndarray, batch: int, sealed: bool, recipients) -> float:
    party = None if study.parties is None else study.parties[0].name
    width = proved_shares.upload_width(study, None if party is None else 0)  # sealed at the leader's width
    key = parties.new_key() if party else None
    t0 = time.process_time()
    n = study.n_servers
    for b in range(0, len(rows), batch):
        chunk = rows[b:b + batch]
        if party is None:
            p = prepare_batch(study, chunk, compress=True, full=(b // batch) % n)
        else:  # as client_sdk.parties.prepared_blocks: fresh pseudonyms, their party-key signs
            ps = [os.urandom(16) for _ in range(len(chunk))]
            p = prepare_blocks(study, party, ps, chunk, signs=parties.signs(key, study.study_id, ps) if study.secret_sign
                               else None, full=(b // batch) % n)
        for j in range(n):
            body = p.body(j)
            if sealed:
                envelope.seal_body(recipients[j], study.study_id, body, p.media_type(j), width, n,
                                   **({} if party is None else {"party": 0}))
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--d", type=int, default=10)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--validity", action="store_true", help="a study with validity proofs (norm-bound/1)")
    ap.add_argument("--parties", action="store_true", help="a signed study with two parties: the first one's blocks")
    args = ap.parse_args()
    columns = [f"x{i}" for i in range(args.d)]
    split = {} if not args.parties else {
        "parties": [{"name": "a", "columns": columns[:args.d // 2]}, {"name": "b", "columns": columns[args.d // 2:]}],
        "secret_sign": True}
    study = design(name="ts bench", columns=columns, label=None,
                   servers=[f"s{j + 1}" for j in range(args.servers)], expected_reports=100_000, k=40, s=4,
                   validity=args.validity, **split)[0]
    d = args.d // 2 if args.parties else args.d
    rows = np.random.default_rng(0).normal(0.0, 0.3 / np.sqrt(d / 3), size=(args.rows, d))
    keys = [envelope.generate_private_key() for _ in range(args.servers)]
    recipients = [envelope.Recipient(f"s{j + 1}", envelope.public_key_of(k), version=envelope.VERSION_4)
                  for j, k in enumerate(keys)]
    cfg = {"study": json.loads(study.model_dump_json(exclude_none=False)), "studyId": study.study_id,
           "rows": rows.tolist(), "batchSize": args.batch, "repeats": 1,
           **({"party": study.parties[0].name} if args.parties else {})}
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
    what = f"party a's blocks (d_j = {d}, of 2 parties)" if args.parties else f"{study.width} values a row"
    print(f"study: d = {args.d} ({what}), {args.servers} servers, k = {study.k}, "
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
