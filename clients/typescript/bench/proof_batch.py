"""Node's batch prover against the Python SDK's on the same rows and key (issue 40's TS piece).

    cd clients/typescript && npm run build:test && \
        PYTHONPATH=../.. python bench/proof_batch.py [d ...]

For each d (default 10 and 100): a sketch study of d columns with validity and batch proofs
(three servers), one batch of the SDK's default size (client_sdk.upload.proof_batch_rows: the
leader's record within 8 MiB), proved by dpsketch.client_sdk.prepare_proof_batch and by the Node
client's prepareProofBatch (dist-test/bench/proof_batch.js) from the same keystream key: CPU
seconds of each (one thread each; both cold, the batch's plan built in the run: Python's first
run, Node's best of ``--repeats`` fresh processes; Python's best warm run, its plan cached, too),
their ratio, the load average, and whether the records are the same bytes (they must be).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from dpsketch.client_sdk import prepare_proof_batch  # noqa: E402
from dpsketch.client_sdk.upload import MAX_BATCH_BYTES, proof_batch_rows  # noqa: E402
from dpsketch.protocol.keystream import Keystream  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(d: int, repeats: int, rows_override: int | None) -> dict:
    columns = [f"x{i}" for i in range(d - 1)] + ["y"]
    study = design(name=f"bench-{d}", columns=columns, label="y", servers=["s0", "s1", "s2"],
                   expected_reports=200_000, seed="ab" * 32, validity=True, batch_proofs=True)[0]
    m = rows_override or proof_batch_rows(study, None, MAX_BATCH_BYTES)
    rng = np.random.default_rng(d)
    rows = 0.9 * rng.uniform(-1, 1, size=(m, d)) / np.sqrt(d)
    key = hashlib.sha256(f"bench/{d}".encode()).digest()
    py = []
    for _ in range(repeats):
        t0 = cpu()
        batch = prepare_proof_batch(study, rows, leader=0, stream=Keystream.from_key(key))
        py.append(cpu() - t0)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"study": study.model_dump(mode="json"), "rows": rows.tolist(), "key": key.hex(), "leader": 0}, f)
    node = []
    try:
        for _ in range(repeats):
            out = subprocess.run(["node", "dist-test/bench/proof_batch.js", f.name],
                                 cwd=HERE.parent, capture_output=True, text=True, check=True)
            node.append(json.loads(out.stdout))
    finally:
        os.unlink(f.name)
    same = node[0]["records"] == [hashlib.sha256(batch.body(j)).hexdigest() for j in range(3)]
    best_node = min(n["seconds"] for n in node)
    return {"d": d, "rows": m, "leader_bytes": len(batch.body(0)), "python_cpu_s": round(py[0], 3), "python_warm_cpu_s": round(min(py), 3),
            "node_cpu_s": round(best_node, 3), "ratio": round(best_node / py[0], 2), "same_bytes": same,
            "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("d", nargs="*", type=int, default=[10, 100])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--rows", type=int, default=None, help="rows per batch instead of the SDK's default")
    args = ap.parse_args()
    for d in args.d:
        print(json.dumps(run(d, args.repeats, args.rows)), flush=True)


if __name__ == "__main__":
    main()
