"""The SDK's first seed-compressed batch in a fresh process (dpsketch/protocol/kernels.py).

``Client(compress=True)`` starts loading the compiled ChaCha20 loop in a background thread; a
batch prepared before that load is done either waits for it or expands its seeds with the
reference (a ``cryptography`` cipher per key). This starts that warm-up thread the same way,
prepares one batch at once, then a second one, and prints both times: run it a few times (the
first run on a machine may compile numba's loops).

    .venv/bin/python benchmarks/first_batch.py [--rows 10000] [--servers 3]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--d", type=int, default=10)
    args = p.parse_args()
    from dpsketch.client_sdk.prepare import prepare_batch
    from dpsketch.protocol import chacha
    from dpsketch.protocol.study import design

    study = design(name="first batch", columns=[f"c{i}" for i in range(args.d)], label=None,
                   servers=[f"s{j}" for j in range(args.servers)], expected_reports=100_000)[0]
    rows = np.random.default_rng(1).uniform(-0.1, 0.1, (args.rows, args.d))
    threading.Thread(target=chacha.warm_up, daemon=True).start()  # as Client(compress=True) does
    t0 = time.perf_counter()
    prepare_batch(study, rows, True)
    t1 = time.perf_counter()
    prepare_batch(study, rows, True)
    print(json.dumps({"rows": args.rows, "servers": args.servers, "first_batch_s": round(t1 - t0, 3),
                      "second_batch_s": round(time.perf_counter() - t1, 3)}))


if __name__ == "__main__":
    main()
