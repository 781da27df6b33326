"""Cost of the validity proofs' core (docs/validity.md): prove, query and decide per report for
NormBound circuits, against today's client preparation of the same rows, as ratios in one run.

For each width w (d + 1 coordinates: a sketch study of d columns with bounds appends the constant
one) and digit base beta, rows of integers at the fixed-point scale (|x_i| < H, H >= 2^21, norm at
most R = 2^20) go through the core as a client and N = 3 servers would run it:

* client: the digits (``NormBound.encode``), prove randomness, the joint randomness from the
  report ids, ``flp.prove``, and the seed-compressed sharing of input and proof;
* each server: a helper expands its seed into its input and proof shares, every server runs
  ``flp.query`` at one query point (the table shows one server's time), and the sum is decided
  (``flp.decide``, once per report wherever it runs).

Reported per configuration: the input length n (digits), the proof length and the verifier
length (F_p elements; the verifier in F_(p^2) elements), the share bytes one report uploads to the
N servers (the leader's input and proof shares at 8 bytes an element, 32 bytes of seed to each
helper) against today's (the leader's share of w ring elements, 32 bytes to each helper), the
verifier bytes one server hands the analyzer per report, and the microseconds per report of
prove, of the client's whole path, of one server's query (with the helper's expansion) and of
decide. The last columns are ratios to ``client_sdk.prepare.prepare_batch`` on a sketch study of
the same width (its whole path: clip, noise, encode, share, bind), timed in the same run.

Reports are processed in client batches of ``--batch`` (memory stays bounded; the time is linear
in the number of reports). A configuration whose prover would take more than ``--budget`` CPU
seconds for m reports is timed on fewer (the table's ``timed`` column) and scaled: beta = 256
costs tens of milliseconds a report. Timings are CPU seconds of this process
(``time.process_time``: a machine shared with other work slows the wall clock, not this), the
best of ``--repeat`` passes for the baseline.

    .venv/bin/python benchmarks/flp.py                          # m = 10^4 and 10^5, w = 11, 101
    .venv/bin/python benchmarks/flp.py --m 10000 --w 11 --beta 2 16 --json
    .venv/bin/python benchmarks/flp.py --batch-proofs 100 1000 --beta 2 4 16 64   # batch proofs

``--batch-proofs`` measures instead the range part of one proof over a whole batch of rows (the
proof amortised over the batch; the digits stay per row).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpsketch.client_sdk.prepare import prepare_batch  # noqa: E402
from dpsketch.protocol import binding, chacha, circuits, field, flp  # noqa: E402
from dpsketch.protocol.keystream import Keystream  # noqa: E402
from dpsketch.protocol.study import design  # noqa: E402

SERVERS = 3
R = 1 << 20
COORD_BITS = 22  # |x_i| < H = 2^21 at least


def circuit_for(w: int, beta: int) -> circuits.NormBound:
    k = beta.bit_length() - 1
    return circuits.NormBound(w=w, beta=beta, q=-(-COORD_BITS // k), r2=R * R)


def rows_in_ball(m: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """Integer rows of norm at most R (benchmark data: directions uniform, radii uniform)."""
    g = rng.normal(size=(m, w))
    g *= (rng.uniform(0, 1, size=(m, 1)) * (R - w)) / np.linalg.norm(g, axis=1, keepdims=True)
    return np.rint(g).astype(np.int64)


def prepare_per_row(w: int, m: int, repeat: int) -> float:
    """Today's client: prepare_batch on a sketch study of d = w - 1 columns with bounds (width w),
    seed-compressed as the SDK sends; CPU seconds per row."""
    d = w - 1
    study, _ = design(name="bench", columns=[f"c{i}" for i in range(d)], label=None, kind="sketch",
                      servers=[f"s{i}" for i in range(SERVERS)], expected_reports=10**6, epsilon=1.0,
                      delta=1e-6, bounds=[[-1.0, 1.0]] * d)
    assert study.width == w, (study.width, w)
    rows = np.random.default_rng(0).uniform(-1, 1, size=(m, d)) / np.sqrt(d)  # benchmark data only
    prepare_batch(study, rows[:100], compress=True)
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        prepare_batch(study, rows, compress=True)
        best = min(best, time.process_time() - start)
    return best / m


def client_path(c, x: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, flp.ClientShares, float]:
    """The client's path for one batch: (inputs, joint randomness, shares, CPU seconds in prove)."""
    stream = Keystream()
    inputs = c.encode(x)
    jr = flp.joint_rand(c, ids)
    pr = flp.prove_rand(c, len(x), stream)
    shares = flp.share_inputs(c, inputs, SERVERS, stream)
    start = time.process_time()
    proofs = flp.prove(c, inputs, jr, pr)
    prove_s = time.process_time() - start
    flp.share_proofs(shares, proofs)
    return inputs, jr, shares, prove_s


def measure(w: int, beta: int, m: int, batch: int, budget: float, rng: np.random.Generator) -> dict:
    c = circuit_for(w, beta)
    probe = min(200, m)  # a short run to size the timed part
    x = rows_in_ball(probe, w, rng)
    ids = np.frombuffer(Keystream().bytes(16 * probe), dtype=np.uint8).reshape(probe, 16)
    _, _, _, probe_s = client_path(c, x, ids)
    timed = int(min(m, max(probe, budget / max(probe_s / probe, 1e-9))))
    totals = dict(client=0.0, prove=0.0, expand=0.0, query=0.0, decide=0.0)
    accepted = 0
    t = flp.query_point(Keystream().bytes(32))
    query = flp.Query(c, t)
    for start in range(0, timed, batch):
        size = min(batch, timed - start)
        x = rows_in_ball(size, w, rng)
        ids = np.frombuffer(Keystream().bytes(16 * size), dtype=np.uint8).reshape(size, 16)
        begin = time.process_time()
        inputs, jr, shares, prove_s = client_path(c, x, ids)
        totals["client"] += time.process_time() - begin
        totals["prove"] += prove_s
        begin = time.process_time()
        helper = flp.expand_share(c, shares.helper_seeds[0])  # one helper's expansion
        totals["expand"] += time.process_time() - begin
        others = [flp.expand_share(c, s) for s in shares.helper_seeds[1:]]
        begin = time.process_time()
        mine = flp.query(c, helper[0], helper[1], jr, query, SERVERS)  # one server's query
        totals["query"] += time.process_time() - begin
        rest = [flp.query(c, xs, ps, jr, query, SERVERS) for xs, ps in others]
        rest.append(flp.query(c, shares.leader_inputs, shares.leader_proofs, jr, query, SERVERS))
        verifier = flp.reconstruct([mine] + rest)
        begin = time.process_time()
        accepted += int(flp.decide(c, verifier, jr).sum())
        totals["decide"] += time.process_time() - begin
    per = {k: v / timed for k, v in totals.items()}
    s = c.soundness()
    return {
        "w": w, "beta": beta, "q": c.q, "m": m, "timed": timed, "accepted": f"{accepted}/{timed}",
        "input_len": c.input_len, "proof_len": c.proof_len, "verifier_len": c.verifier_len,
        "gadgets": [g["gadget"] + f" x {g['calls']}" for g in c.describe()["gadgets"]],
        "upload_bytes": 8 * (c.input_len + c.proof_len) + 32 * (SERVERS - 1),
        "today_upload_bytes": 8 * w + 32 * (SERVERS - 1),
        "verifier_bytes_per_server": 16 * c.verifier_len,
        "us_prove": 1e6 * per["prove"], "us_client": 1e6 * per["client"],
        "us_server": 1e6 * (per["expand"] + per["query"]), "us_decide": 1e6 * per["decide"],
        "soundness_query_log2": float(np.log2(float(s["query"]))),
        "soundness_joint_log2": float(np.log2(float(s["joint"]))),
    }


def batch_proof(w: int, beta: int, rows: int) -> dict:
    """The range part of one proof over a batch of ``rows`` rows (RangeDigits over the batch's
    rows * w * q digits: the per-row norm checks add a few elements and plain products): proof
    elements and CPU microseconds per row, the second of two passes (the first builds the
    circuit's tables)."""
    k = beta.bit_length() - 1
    q = -(-COORD_BITS // k)
    c = circuits.RangeDigits(width=rows * w, digits=q, beta=beta)
    inputs = c.encode(np.random.default_rng(2).integers(0, beta ** q, size=(1, rows * w)))  # benchmark data
    stream = Keystream()
    jr = field.sample_ext(stream, c.joint_rand_len).reshape(1, -1, 2)
    pr = flp.prove_rand(c, 1, stream)
    query = flp.Query(c, flp.query_point(stream.bytes(32)))
    times = {}
    for _ in range(2):
        begin = time.process_time()
        proof = flp.prove(c, inputs, jr, pr)
        times["prove"] = time.process_time() - begin
        begin = time.process_time()
        verifier = flp.query(c, inputs, proof, jr, query, 1)
        times["query"] = time.process_time() - begin
        begin = time.process_time()
        assert flp.decide(c, verifier, jr).all()
        times["decide"] = time.process_time() - begin
    g = c.gadgets[0]
    return {"w": w, "beta": beta, "rows": rows, "digits_per_row": w * q, "arity": g.arity, "calls": g.calls,
            "proof_per_row": c.proof_len / rows, "verifier_len": c.verifier_len,
            "us_prove": 1e6 * times["prove"] / rows, "us_query": 1e6 * times["query"] / rows,
            "us_decide": 1e6 * times["decide"] / rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--w", type=int, nargs="+", default=[11, 101])
    parser.add_argument("--beta", type=int, nargs="+", default=[2, 16, 256])
    parser.add_argument("--batch", type=int, default=10_000, help="reports per client batch")
    parser.add_argument("--budget", type=float, default=60.0, help="CPU seconds of proving per configuration")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--batch-proofs", type=int, nargs="+", metavar="ROWS",
                        help="instead: the range part of one proof per batch of ROWS rows")
    args = parser.parse_args()
    if args.batch_proofs:
        field.warm_up()
        rows = [batch_proof(w, beta, size) for w in args.w for beta in args.beta for size in args.batch_proofs]
        if args.json:
            print(json.dumps({"machine": platform.processor() or platform.machine(), "batch_proofs": rows}, indent=1))
            return
        print("| w | beta | rows per proof | digits per row | ParallelSum arity x calls | proof elements per row | "
              "prove us/row | query us/row | decide us/row |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['w']} | {r['beta']} | {r['rows']} | {r['digits_per_row']} | {r['arity']} x {r['calls']} | "
                  f"{r['proof_per_row']:.1f} | {r['us_prove']:.1f} | {r['us_query']:.1f} | {r['us_decide']:.1f} |")
        return

    field.warm_up()  # every compiled loop the paths use, loaded before anything is timed
    chacha.warm_up()
    binding.warm_up()
    rng = np.random.default_rng(1)  # benchmark data only
    baseline = {w: prepare_per_row(w, min(args.m), args.repeat) for w in args.w}
    results = []
    for w in args.w:
        for beta in args.beta:
            for m in args.m:
                r = measure(w, beta, m, args.batch, args.budget, rng)
                r["us_prepare_today"] = 1e6 * baseline[w]
                r["ratio_prove"] = r["us_prove"] / r["us_prepare_today"]
                r["ratio_client"] = (r["us_client"] + r["us_prepare_today"]) / r["us_prepare_today"]
                r["ratio_upload"] = r["upload_bytes"] / r["today_upload_bytes"]
                results.append(r)
                if not args.json:
                    print(f"w={w:3d} beta={beta:3d} m={m:6d} done", file=sys.stderr)
    if args.json:
        print(json.dumps({"machine": platform.processor() or platform.machine(), "results": results}, indent=1))
        return
    head = ("| w | beta | m (timed) | n | proof | verifier | upload B (today) | verifier B/server | "
            "prove us | client us | server us | decide us | prepare today us | prove / prepare | "
            "client with proofs / today | upload / today | accepted |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        print(f"| {r['w']} | {r['beta']} | {r['m']} ({r['timed']}) | {r['input_len']} | {r['proof_len']} | "
              f"{r['verifier_len']} | {r['upload_bytes']} ({r['today_upload_bytes']}) | "
              f"{r['verifier_bytes_per_server']} | {r['us_prove']:.1f} | {r['us_client']:.1f} | "
              f"{r['us_server']:.1f} | {r['us_decide']:.1f} | {r['us_prepare_today']:.2f} | "
              f"{r['ratio_prove']:.1f}x | {r['ratio_client']:.1f}x | {r['ratio_upload']:.1f}x | {r['accepted']} |")
    print()
    for w in args.w:
        for beta in args.beta:
            r = next(x for x in results if x["w"] == w and x["beta"] == beta)
            print(f"w={w} beta={beta}: {'; '.join(r['gadgets'])}; soundness per report: query "
                  f"2^{r['soundness_query_log2']:.1f}, joint randomness 2^{r['soundness_joint_log2']:.1f} per draw")


if __name__ == "__main__":
    main()
