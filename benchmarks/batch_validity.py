"""What batch proofs with wrap-around checks cost a bulk owner's batch (issue 40's cost targets;
docs/validity.md section 15), as ratios to the same study without proofs, in one run.

For a sketch study of d columns designed twice from the same arguments (with ``validity=True``
and without, 3 servers, as benchmarks/validity.py), the same rows go through, for each batch size
m:

* upload: bytes per row to all N servers. Without proofs the leader's w ring elements and a
  32-byte seed per helper (benchmarks/validity.py's count: ids and binding proofs left out, both
  sides have them per row or per batch); with batch proofs (dpsketch/protocol/batch_validity.py)
  the leader's input and proof shares (8 bytes an element), one 32-byte seed per helper per
  batch and the batch's parts (32 bytes each, N + 1 to every server), over m;
* client: ``prepare_batch`` (seed-compressed: clipping, signs, noise, sharing, ids, binding)
  against the same clipping, signs and noise (``signed_vectors``, ``report.noisy_encoded``) then
  ``batch_validity.prove`` (witness, sharing, parts, projections, proof);
* server (one helper, in process): without proofs its seed expansion (``ring.expand_seeds``)
  and the sketch's accumulation; with batch proofs its seed's expansion and part check
  (``batch_validity.receive``), the rows' ids from the batch id, the signed F_p sums of its
  coordinate shares into the same sketch cells (``batch_validity.aggregate``), its verifier
  share at one query point (the wrap bits and projections, flp.query) and the batch's decision
  from the three servers' messages. ``--threads N`` runs the projections on N threads and
  measures the server's wall clock too (its CPU time stays the ratio that counts: the plain
  side is one thread).

Times are CPU seconds of this process (``time.process_time``: the machine is shared, and a
descheduled wall-clock interval says nothing about the code), the median of ``--reps``
interleaved repetitions (plain, proved, plain, ...), per row; the load average is printed.

    .venv/bin/python benchmarks/batch_validity.py                       # d = 10, 100; m = 1000, 5000, the SDK's
    .venv/bin/python benchmarks/batch_validity.py --d 10 --m 1000 --reps 3 --json
    .venv/bin/python benchmarks/batch_validity.py --d 100 --m 9709 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpsketch.client_sdk.prepare import prepare_batch, signed_vectors  # noqa: E402
from dpsketch.client_sdk.upload import default_batch_rows  # noqa: E402
from dpsketch.protocol import batch_validity, field, kernels, ring, sketch, validity, wraparound  # noqa: E402
from dpsketch.protocol import report as report_path  # noqa: E402
from dpsketch.protocol.keystream import Keystream  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402

SERVERS = ["s0", "s1", "s2"]


def _studies(d: int, expected: int):
    args = dict(name="bench", columns=[f"c{i}" for i in range(d)], label="c0", servers=SERVERS,
                expected_reports=expected)
    return design(**args)[0], design(**args, validity=True)[0]


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _units(study, plan, rows, stream):
    """An honest client's grid units for these rows (its noise redrawn for a row outside the
    bound: probability 2^-96, never seen)."""
    encoded = report_path.noisy_encoded(signed_vectors(rows, study, stream), study, stream)
    return validity.grid_units(plan, encoded)


def _wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(d: int, m: int, reps: int, expected: int, threads: int = 1) -> dict:
    plain, proved = _studies(d, expected)
    plan = validity.plan(proved)
    bplan = batch_validity.study_plan(proved, m)
    c = bplan.circuit
    rows = np.random.default_rng(d).normal(size=(m, d)) * (0.6 / np.sqrt(d))
    n = len(SERVERS)
    stream = Keystream()
    batch = batch_validity.prove(bplan, _units(proved, plan, rows, stream), stream)  # warm the loops
    plain_batch = prepare_batch(plain, rows, compress=True)
    plain_seeds = next(s for s in plain_batch.seeds if s is not None)
    helper = next(j for j in range(n) if j != batch.leader)
    query_seed = validity.query_seed(proved.study_id, [b"\0" * 32] * n)
    views = [batch_validity.receive(bplan, j, batch.payload(j), batch.parts, batch.digits_part, batch.leader)
             for j in range(n)]
    messages = [(v.batch_id, batch_validity.verifier_share(bplan, v, query_seed)) for v in views]
    if not batch_validity.decide(bplan, messages):
        raise AssertionError("an honest batch was refused")

    def proved_client():
        s = Keystream()
        batch_validity.prove(bplan, _units(proved, plan, rows, s), s)

    def plain_server():
        share = ring.expand_seeds(plain_seeds, plain.width)
        acc = np.zeros(plain.aggregate_shape, dtype=np.uint64)
        r, sg = plain.hash_report_ids(plain_batch.report_ids)
        sketch.accumulate(acc, r, sg, share)

    def proved_server():
        view = batch_validity.receive(bplan, helper, batch.payload(helper), batch.parts, batch.digits_part,
                                      batch.leader)
        ids = batch_validity.row_ids(view.batch_id, m)
        r, sg = proved.hash_report_ids(ids, joined=ids.tobytes())  # the compiled hash reads the joined ids
        batch_validity.aggregate(bplan, view, r, sg, np.zeros((proved.k, c.w), dtype=np.uint64))
        mine = batch_validity.verifier_share(bplan, view, query_seed, threads=threads)
        msgs = [(view.batch_id, mine) if j == helper else messages[j] for j in range(n)]
        if not batch_validity.decide(bplan, msgs):
            raise AssertionError("an honest batch was refused")

    times: dict[str, list[float]] = {k: [] for k in ("client_plain", "client", "server_plain", "server")}
    if threads > 1:
        times.update(server_plain_wall=[], server_wall=[])
    for _ in range(reps):
        times["client_plain"].append(_cpu(lambda: prepare_batch(plain, rows, compress=True)))
        times["client"].append(_cpu(proved_client))
        times["server_plain"].append(_cpu(plain_server))
        times["server"].append(_cpu(proved_server))
        if threads > 1:  # wall clock: what the threads save (each CPU time is measured above)
            times["server_plain_wall"].append(_wall(plain_server))
            times["server_wall"].append(_wall(proved_server))
    med = {k: statistics.median(v) for k, v in times.items()}
    upload_plain = 8 * plain.width + 32 * (n - 1)
    upload = bplan.upload_bytes()
    sound = c.soundness()
    return {
        "d": d, "w": c.w, "m": m, "reps": reps, "load": os.getloadavg()[0],
        "r2": c.r2, "threshold": c.threshold, "wrap_digits": c.wrap_digits, "rows_per_call": c.rows_per_call,
        "input_len": c.input_len, "proof_len": c.proof_len, "verifier_len": c.verifier_len,
        "elements_per_row": (c.input_len + c.proof_len) / m,
        "upload_bytes_per_row": upload["total"] / m, "upload_bytes_plain": upload_plain,
        "upload_ratio": upload["total"] / m / upload_plain,
        "client_us": 1e6 * med["client"] / m, "client_us_plain": 1e6 * med["client_plain"] / m,
        "client_ratio": med["client"] / med["client_plain"],
        "server_us": 1e6 * med["server"] / m, "server_us_plain": 1e6 * med["server_plain"] / m,
        "server_ratio": med["server"] / med["server_plain"],
        "threads": threads,
        **({"server_wall_us": 1e6 * med["server_wall"] / m, "server_wall_us_plain": 1e6 * med["server_plain_wall"] / m,
            "server_wall_ratio": med["server_wall"] / med["server_plain_wall"]} if threads > 1 else {}),
        "verifier_bytes_per_server": 16 * c.verifier_len + 16,
        "flp_soundness_log2": float(np.log2(float(sound["total"]))),
        "flp_soundness_log2_grinding_2_64": float(np.log2(float(c.soundness(grinding=2 ** 64)["total"]))),
        "wrap_soundness_log2": -c.reps,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--m", type=int, nargs="+", default=None,
                        help="rows per batch (default 1000, 5000 and the SDK's default batch at each d)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--expected", type=int, default=100_000, help="the studies' expected reports")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads for a server's wrap projections; above 1 the server's wall-clock time is "
                             "measured too (its CPU time is the ratio that counts: the plain side is one thread)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    kernels.warm_up_all()  # every compiled loop on both sides, whatever the batch size (MIN_ROWS)
    field.warm_up()
    wraparound.WRAP.warm_up()
    results = []
    for d in args.d:
        for m in args.m or [1000, 5000, default_batch_rows(d, len(SERVERS))]:
            results.append(measure(d, m, args.reps, args.expected, args.threads))
            if not args.json:
                print(f"d = {d}, m = {m}: done (load {results[-1]['load']:.1f})", file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("| d | m | elements/row (n + P) / m | upload B/row (plain) | upload x | client us/row (plain) | client x "
          "| server us/row (plain) | server x | FLP soundness (2^64 tries) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['d']} | {r['m']:,} | {r['elements_per_row']:.2f} | {r['upload_bytes_per_row']:.1f} "
              f"({r['upload_bytes_plain']}) | {r['upload_ratio']:.2f}x | {r['client_us']:.2f} ({r['client_us_plain']:.2f}) "
              f"| {r['client_ratio']:.2f}x | {r['server_us']:.2f} ({r['server_us_plain']:.2f}) | {r['server_ratio']:.2f}x "
              f"| 2^{r['flp_soundness_log2']:.1f} (2^{r['flp_soundness_log2_grinding_2_64']:.1f}) | {r['load']:.1f} |")
    if args.threads > 1:
        print(f"\nserver wall clock, wrap projections on {args.threads} threads (the plain side on one):\n")
        print("| d | m | server wall us/row (plain) | server wall x | server CPU x |")
        print("|---|---|---|---|---|")
        for r in results:
            print(f"| {r['d']} | {r['m']:,} | {r['server_wall_us']:.2f} ({r['server_wall_us_plain']:.2f}) "
                  f"| {r['server_wall_ratio']:.2f}x | {r['server_ratio']:.2f}x |")


if __name__ == "__main__":
    main()
