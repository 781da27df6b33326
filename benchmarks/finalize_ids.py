"""The analyzer's intersection of the servers' report-id lists at finalization
(``messages.intersect_held``), against the Python sets of ``bytes`` it used before, on the
same lists in one run: time (median of ``--repeats``, alternating) and the peak of memory
allocated beyond the lists (tracemalloc, a separate pass, since tracing slows Python code).

Each of ``--servers`` lists holds each of ``--n`` random ids with probability 0.99, as servers
that each missed 1 % of the uploads.

With ``--parties P``, a study with P parties instead: each server's block index (each of ``--n``
individuals' P blocks, each held with probability 0.99) and the analyzer's completeness
(``analyzer.coordinator.completeness``), against the Python sets of tuples it used before.

    .venv/bin/python benchmarks/finalize_ids.py [--n 1000000] [--servers 3] [--repeats 3] [--parties P]
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
    """Now, as Coordinator.finalize does: every list at once, intersected in one pass (which
    also gives each server's commit bitmap, messages.intersect_held)."""
    return messages.intersect_held([messages.report_id_halves(ids) for ids in lists])[0]


def completeness_by_sets(names: list[str], held: list[list[tuple[bytes, bytes, int]]],
                         server_ids: list[str]) -> tuple:
    """Before: the completeness of a study with parties on Python sets of (block id, pseudonym,
    party) tuples; (complete, included, missing_by_party, complete_by_server, individuals_seen).
    tests/test_properties.py holds the array version to it."""
    everywhere = set.intersection(*(set(h) for h in held))
    parts: dict[bytes, list[bytes]] = {}
    for bid, pseudonym, _party in everywhere:
        parts.setdefault(pseudonym, []).append(bid)
    complete = {p for p, bids in parts.items() if len(bids) == len(names)}
    seen = {pseudonym for h in held for _bid, pseudonym, _party in h}
    have = {(pseudonym, party) for _bid, pseudonym, party in everywhere}
    missing = {name: sum(1 for p in seen if (p, j) not in have) for j, name in enumerate(names)}
    by_server = {}
    for sid, h in zip(server_ids, held):
        count: dict[bytes, int] = {}
        for _bid, pseudonym, _party in h:
            count[pseudonym] = count.get(pseudonym, 0) + 1
        by_server[sid] = sum(1 for c in count.values() if c == len(names))
    included = b"".join(sorted(bid for p in complete for bid in parts[p]))
    return len(complete), included, missing, by_server, len(seen)


def _parties_methods(n: int, n_servers: int, n_parties: int):
    """The block indexes of a study with parties, and the two ways to judge them."""
    from types import SimpleNamespace

    from dpsketch.analyzer.coordinator import completeness

    names = [f"p{j}" for j in range(n_parties)]
    server_ids = [f"s{i}" for i in range(n_servers)]
    pseudonyms = np.frombuffer(os.urandom(16 * n), dtype="V16")
    block_ids = np.frombuffer(os.urandom(16 * n * n_parties), dtype="V16")
    rng = np.random.default_rng(1)
    bodies = []
    for _ in range(n_servers):
        keep = np.flatnonzero(rng.random(n * n_parties) < 0.99)
        bodies.append(messages.encode_block_index(block_ids[keep].tolist(), pseudonyms[keep // n_parties].tolist(),
                                                  (keep % n_parties).tolist()))
    study = SimpleNamespace(parties=[SimpleNamespace(name=name) for name in names])

    def with_sets(bodies: list[bytes]) -> tuple:
        held = [[(bytes(r[0:16]), bytes(r[16:32]), r[32]) for r in (b[i:i + 33] for i in range(0, len(b), 33))]
                for b in bodies]
        return completeness_by_sets(names, held, server_ids)

    def with_arrays(bodies: list[bytes]) -> tuple:
        c = completeness(study, [messages.decode_block_index(b) for b in bodies], server_ids)
        return c.complete, c.included, c.missing_by_party, c.complete_by_server, c.individuals_seen

    return bodies, {"sets": with_sets, "arrays": with_arrays}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parties", type=int, default=0, help="a study with this many parties (default: none)")
    args = p.parse_args()
    if args.parties:
        lists, methods = _parties_methods(args.n, args.servers, args.parties)
    else:
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
    common = results["arrays"][0] if args.parties else len(results["arrays"]) // 16
    out = {"n": args.n, "servers": args.servers, "parties": args.parties, "common": common,
           "load_average_1min": round(os.getloadavg()[0], 2)}
    for name in methods:
        out[f"{name}_s"] = round(statistics.median(seconds[name]), 3)
        out[f"{name}_peak_bytes_per_id"] = round(peak[name] / args.n)
    out["speedup"] = round(out["sets_s"] / out["arrays_s"], 1)
    out["memory_ratio"] = round(peak["sets"] / peak["arrays"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
