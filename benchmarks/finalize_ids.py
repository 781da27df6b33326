"""The analyzer's intersection of the servers' report-id lists at finalization
(``messages.common_report_ids``), against the Python sets of ``bytes`` it used before, on the
same lists in one run: time (median of ``--repeats``, alternating) and the peak of memory
allocated beyond the lists (tracemalloc, a separate pass, since tracing slows Python code).

Each of ``--servers`` lists holds each of ``--n`` random ids with probability 0.99, as servers
that each missed 1 % of the uploads.

    .venv/bin/python benchmarks/finalize_ids.py [--n 1000000] [--servers 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import tracemalloc

import numpy as np

from dpsketch.protocol import messages


def with_sets(lists: list[bytes]) -> bytes:
    """Before: every list decoded to ``bytes`` objects in a set, intersected and sorted."""
    held = [set(messages.decode_report_ids(ids)) for ids in lists]
    return b"".join(sorted(set.intersection(*held)))


def with_arrays(lists: list[bytes]) -> bytes:
    """Now, as Coordinator.finalize does: one list at a time against the running intersection."""
    common = lists[0]
    for ids in lists[1:]:
        common = messages.common_report_ids([common, ids])
    return common


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    halves = np.frombuffer(os.urandom(16 * args.n), dtype=">u8").reshape(-1, 2)
    everything = halves[np.lexsort((halves[:, 1], halves[:, 0]))]
    rng = np.random.default_rng(1)
    lists = [np.ascontiguousarray(everything[rng.random(args.n) < 0.99]).tobytes()
             for _ in range(args.servers)]
    methods = {"sets": with_sets, "arrays": with_arrays}
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    results = {}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            results[name] = fn(lists)
            seconds[name].append(time.perf_counter() - t0)
    assert results["sets"] == results["arrays"]
    peak = {}
    for name, fn in methods.items():
        tracemalloc.start()
        fn(lists)
        peak[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    out = {"n": args.n, "servers": args.servers, "common": len(results["arrays"]) // 16,
           "load_average_1min": round(os.getloadavg()[0], 2)}
    for name in methods:
        out[f"{name}_s"] = round(statistics.median(seconds[name]), 3)
        out[f"{name}_peak_bytes_per_id"] = round(peak[name] / args.n)
    out["speedup"] = round(out["sets_s"] / out["arrays_s"], 1)
    out["memory_ratio"] = round(peak["sets"] / peak["arrays"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
