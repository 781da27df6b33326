"""What validity proofs cost a study (issue 40), as ratios to the same study without them, in one run.

For a sketch study (with ``--kind``, a gram or moments study, whose client is then the SDK's
``prepare_batch`` on both sides) of d columns designed twice from the same arguments, once with
``validity=True`` (dpsketch/protocol/validity.py) and once without, the same rows go through:

* client: ``prepare_batch`` (seed-compressed) against ``validity.prepare`` after the same
  clipping, sign and noise: microseconds per report, and the share bytes one report uploads to
  its N servers (the leader's explicit elements, 32 bytes of seed to each helper; binding
  proofs and ids, equal on both sides, left out);
* servers: what every server does with a batch, in process: today a helper's seed expansion
  (``ring.expand_seeds``) and the sketch's accumulation; with proofs the helper's expansion of its
  input and proof shares, the coordinates' split words into the same accumulation, the verifier
  share at one query point, and (once per report, wherever it runs) the decision. The leader
  reads its explicit shares instead of expanding; a helper's is the larger work, shown here.

Timings are wall seconds of this process, the median of ``--reps`` interleaved repetitions
(baseline, proved, baseline, ...), with the load average printed: on a shared machine the ratio
is what transfers, not the figures.

    .venv/bin/python benchmarks/validity.py                    # d = 10 and 100, 20,000 reports
    .venv/bin/python benchmarks/validity.py --d 100 --m 100000 --reps 5 --json
    .venv/bin/python benchmarks/validity.py --kind gram --d 10 --m 5000
    .venv/bin/python benchmarks/validity.py --kind parties --d 10 100 --m 5000
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

from dpsketch.protocol import report as report_path  # noqa: E402
from dpsketch.client_sdk.prepare import prepare_batch, signed_vectors  # noqa: E402
from dpsketch.protocol import ring, sketch, validity  # noqa: E402
from dpsketch.protocol.keystream import Keystream  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402

SERVERS = ["s0", "s1", "s2"]


def _studies(d: int, expected: int, kind: str = "sketch"):
    args = dict(name="bench", columns=[f"c{i}" for i in range(d)], label="c0", servers=SERVERS,
                expected_reports=expected, kind=kind)
    return design(**args)[0], design(**args, validity=True)[0]


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(d: int, m: int, reps: int, expected: int, kind: str = "sketch") -> dict:
    plain, proved = _studies(d, expected, kind)
    plan = validity.plan(proved)
    rows = np.random.default_rng(d).normal(size=(m, d)) * (0.6 / np.sqrt(d))
    stream = Keystream()
    if kind == "sketch":
        encoded = report_path.noisy_encoded(signed_vectors(rows, proved, stream), proved, stream)
        batch = validity.prepare(proved, encoded, stream)  # warm the compiled loops
    else:  # a gram or moments study: the SDK's path (features, scaled noise, witness, proof)
        batch = prepare_batch(proved, rows)
    plain_batch = prepare_batch(plain, rows, compress=True)
    helper_seeds = next(s for s in batch.seeds if s is not None)
    plain_seeds = next(s for s in plain_batch.seeds if s is not None)
    query_seed = validity.query_seed(proved.study_id, [b"\0" * 32] * len(SERVERS))
    client_plain, client_proved, server_plain, server_proved = [], [], [], []

    def proved_client():
        if kind != "sketch":
            prepare_batch(proved, rows)
            return
        s = Keystream()
        enc = report_path.noisy_encoded(signed_vectors(rows, proved, s), proved, s)
        validity.prepare(proved, enc, s)

    def plain_server():
        share = ring.expand_seeds(plain_seeds, plain.width)
        acc = np.zeros(plain.aggregate_shape, dtype=np.uint64)
        r, sg = plain.hash_report_ids(plain_batch.report_ids)
        sketch.accumulate(acc, r, sg, share)

    def proved_server():
        inputs, proofs = validity.server_shares(plan, helper_seeds, True)
        acc = np.zeros((proved.k, plan.state_width), dtype=np.uint64)
        r, sg = proved.hash_report_ids(batch.report_ids)
        sketch.accumulate(acc, r, sg, validity.aggregand(plan, inputs))
        shares = validity.verifier_shares(plan, query_seed, batch.report_ids, inputs, proofs)
        validity.decide(plan, batch.report_ids, shares)  # the sum's decision costs the same

    for _ in range(reps):
        client_plain.append(_time(lambda: prepare_batch(plain, rows, compress=True)))
        client_proved.append(_time(proved_client))
        server_plain.append(_time(plain_server))
        server_proved.append(_time(proved_server))
    n = len(SERVERS)
    upload_plain = 8 * plain.width + 32 * (n - 1)
    upload_proved = 8 * plan.leader_width + 32 * (n - 1)
    med = statistics.median
    return {
        "kind": kind, "d": d, "w": plan.w, "m": m, "reps": reps, "load": os.getloadavg()[0],
        "input_len": plan.input_len, "proof_len": plan.proof_len, "verifier_len": plan.verifier_len,
        "digits_per_coordinate": plan.circuit.q, "slack_digits": plan.circuit.slack_digits,
        "upload_bytes": upload_proved, "upload_bytes_plain": upload_plain,
        "upload_ratio": upload_proved / upload_plain,
        "verifier_bytes_per_server": 16 * plan.verifier_len,
        "client_us": 1e6 * med(client_proved) / m, "client_us_plain": 1e6 * med(client_plain) / m,
        "client_ratio": med(client_proved) / med(client_plain),
        "server_us": 1e6 * med(server_proved) / m, "server_us_plain": 1e6 * med(server_plain) / m,
        "server_ratio": med(server_proved) / med(server_plain),
        "soundness_log2": float(np.log2(float(plan.circuit.soundness()["total"]))),
        "soundness_log2_grinding_2_64": float(np.log2(float(plan.circuit.soundness(grinding=2 ** 64)["total"]))),
    }


def measure_parties(d: int, m: int, reps: int, expected: int) -> dict:
    """A study with two parties (the first d // 2 columns, then the rest), designed with and
    without ``validity``: every party's blocks of m individuals through ``report.prepare_blocks``
    (clip, noise, share and bind; with proofs, prove and share in F_p, the leader rotating), the
    median client time of ``reps`` interleaved repetitions, and every byte an individual's
    blocks cost on the wire to all N servers (records with their block ids, pseudonyms and
    binding proofs, the leader's explicit elements or a helper's seed; without proofs every
    server gets a full share: blocks are never seed-compressed)."""
    from dpsketch.protocol import parties, report

    cols = [f"c{i}" for i in range(d)]
    spec = [{"name": "a", "columns": cols[:d // 2]}, {"name": "b", "columns": cols[d // 2:]}]
    args = dict(name="bench-parties", columns=cols, label="c0", servers=SERVERS, expected_reports=expected,
                parties=spec)
    plain, proved = design(**args)[0], design(**args, validity=True)[0]
    rows = np.random.default_rng(d).normal(size=(m, d)) * (0.6 / np.sqrt(d))
    key = parties.new_key()
    ps = parties.pseudonyms(key, plain.study_id, [str(i) for i in range(m)])

    def run(study):
        out = []
        for index, q in enumerate(study.parties):
            cut = parties.slices(study.parties)[index]
            out.append(report.prepare_blocks(study, q.name, ps, rows[:, cut], full=index % len(SERVERS)))
        return out

    wire = {}
    for name, study in (("plain", plain), ("proved", proved)):
        batches = run(study)  # warm
        wire[name] = sum(len(b.body(j)) for b in batches for j in range(len(SERVERS))) / m
    times: dict[str, list[float]] = {"plain": [], "proved": []}
    for _ in range(reps):
        for name, study in (("plain", plain), ("proved", proved)):
            times[name].append(_time(lambda s=study: run(s)))
    med = statistics.median
    plans = validity.plans(proved)
    return {"kind": "parties", "d": d, "m": m, "reps": reps, "load": os.getloadavg()[0],
            "party_widths": [q.width for q in proved.parties],
            "input_len": [p.input_len for p in plans], "proof_len": [p.proof_len for p in plans],
            "verifier_len": validity.verifier_len(proved),
            "wire_bytes": wire["proved"], "wire_bytes_plain": wire["plain"],
            "wire_ratio": wire["proved"] / wire["plain"],
            "client_us": 1e6 * med(times["proved"]) / m, "client_us_plain": 1e6 * med(times["plain"]) / m,
            "client_ratio": med(times["proved"]) / med(times["plain"])}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--m", type=int, default=20_000, help="reports per repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--expected", type=int, default=100_000, help="the studies' expected reports")
    parser.add_argument("--kind", choices=["sketch", "gram", "moments", "parties"], default="sketch",
                        help="the study kind (gram and moments: circuit GramNorm, d columns give w features; "
                             "parties: a sketch study with two parties, measure_parties)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.kind == "parties":
        found = [measure_parties(d, args.m, args.reps, args.expected) for d in args.d]
        if args.json:
            print(json.dumps(found, indent=2))
            return
        print("| d (party widths) | n per party | proof per party | wire B per individual (plain) | wire x "
              "| client us per individual (plain) | client x | verifier B/server | load |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in found:
            print(f"| {r['d']} ({', '.join(map(str, r['party_widths']))}) | {r['input_len']} | {r['proof_len']} | "
                  f"{r['wire_bytes']:,.0f} ({r['wire_bytes_plain']:,.0f}) | {r['wire_ratio']:.1f}x | "
                  f"{r['client_us']:.1f} ({r['client_us_plain']:.2f}) | {r['client_ratio']:.1f}x | "
                  f"{16 * r['verifier_len']} | {r['load']:.1f} |")
        return
    results = [measure(d, args.m, args.reps, args.expected, args.kind) for d in args.d]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("| kind | d (w) | digits/coord | n | proof | upload B (plain) | upload x | client us (plain) | client x "
          "| server us (plain) | server x | verifier B/server | soundness (2^64 tries) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['kind']} | {r['d']} ({r['w']}) | {r['digits_per_coordinate']} | {r['input_len']} | {r['proof_len']} | "
              f"{r['upload_bytes']:,} ({r['upload_bytes_plain']}) | {r['upload_ratio']:.1f}x | "
              f"{r['client_us']:.1f} ({r['client_us_plain']:.2f}) | {r['client_ratio']:.1f}x | "
              f"{r['server_us']:.1f} ({r['server_us_plain']:.2f}) | {r['server_ratio']:.1f}x | "
              f"{r['verifier_bytes_per_server']} | 2^{r['soundness_log2']:.1f} (2^{r['soundness_log2_grinding_2_64']:.1f}) | "
              f"{r['load']:.1f} |")


if __name__ == "__main__":
    main()
