"""Bytes and time of sealed shares (docs/sealing.md, docs/protocol.md section 7a): both suites
in version 4, the one sealed layout (one HPKE seal and one ChaCha20-Poly1305 message per batch),
and whether two batches opened on two threads overlap. (The per-record layouts of before,
versions 1 to 3, were dropped in issues 41 and 46; docs/sealing.md keeps their last figures.)

For each width d, one run seals the same shares (one server's records of ``--n`` reports of a
3-server study, as the SDK seals them) in each (suite, layout), and opens them as the server does
(``envelope.open_batch``); it reports bytes per report per server and microseconds per share,
and the ratio post-quantum / classical. Timings are CPU seconds of this
process (``time.process_time``), the best of ``--repeat`` passes over the whole batch, the
(suite, layout) pairs alternating so that a busy machine slows them alike; the ratios are within
one run, so they are what to compare across machines.

The last table opens two version 4 batches of ``--n`` records each (at least 20,000; d = the
first width), one after the other and on 2 threads at once (wall time, best of ``--repeat``), as
a server does for two concurrent uploads: below 1 the threads overlapped (the ``cryptography``
package lets the GIL go during large AEAD calls, or the rest of the work did), 1 they did not.
A batch is one AEAD message, so one batch is not split across workers.

    .venv/bin/python benchmarks/pq_sealing.py                 # d = 10 and 100, 2,000 shares
    .venv/bin/python benchmarks/pq_sealing.py --d 10 --n 500 --json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cryptography  # noqa: E402

from dpsketch.protocol import binding, envelope, messages, ring  # noqa: E402

STUDY_ID = "ab" * 32
N_SERVERS = 3
LAYOUTS = ("v4",)


def _bodies(d: int, n: int):
    encoded = ring.random_ring((n, d))
    shares = ring.share(encoded, N_SERVERS)
    ids, proofs = binding.bind(STUDY_ID, [envelope.CONTENT_SHARE] * N_SERVERS, shares)
    return shares[0], messages.encode_batch(ids, proofs[0], shares[0])  # server s1's plaintext body


def measure(d: int, n: int, repeat: int) -> dict:
    share, plain = _bodies(d, n)
    out = {"d": d, "shares": n, "plaintext_bytes_per_report": len(plain) // n}
    suites = (envelope.CLASSICAL, envelope.POST_QUANTUM)
    keys = {}
    for suite in suites:
        sk = suite.generate_private_key()
        keys[suite.name] = (suite.public_key_of(sk), suite.load_private_key(sk))
    best = {(s.name, lay, what): float("inf") for s in suites for lay in LAYOUTS for what in ("seal", "open")}
    size = {}
    for _ in range(repeat):  # the pairs alternate, so a busy machine slows all alike
        for suite in suites:
            for layout in LAYOUTS:
                public, key = keys[suite.name]
                version = envelope.VERSION_4
                me = envelope.Recipient("s1", public, suite, version)
                t0 = time.process_time()
                body = envelope.seal_body(me, STUDY_ID, plain, messages.SHARES_MEDIA_TYPE, d, N_SERVERS)
                t1 = time.process_time()
                upload = envelope.open_batch(body, d, N_SERVERS, STUDY_ID, "s1", lambda _kid, key=key: key)
                t2 = time.process_time()
                best[suite.name, layout, "seal"] = min(best[suite.name, layout, "seal"], t1 - t0)
                best[suite.name, layout, "open"] = min(best[suite.name, layout, "open"], t2 - t1)
                size[suite.name, layout] = len(body)
                upload.verify(STUDY_ID, N_SERVERS, 0)
                if not np.array_equal(upload.shares(d), share):  # pragma: no cover - a broken envelope
                    raise AssertionError("a sealed share did not open to itself")
    for suite in suites:
        for layout in LAYOUTS:
            out[f"{suite.name} {layout}"] = {
                "version": envelope.VERSION_4,
                "bytes_per_report": size[suite.name, layout] / n,
                "seal_us_per_share": best[suite.name, layout, "seal"] / n * 1e6,
                "open_us_per_share": best[suite.name, layout, "open"] / n * 1e6}
    return out


def _open(args) -> int:
    body, d, key = args
    return len(envelope.open_batch(body, d, N_SERVERS, STUDY_ID, "s1", lambda _kid: key))


def measure_parallel(d: int, n: int, repeat: int, workers: int = 2) -> dict:
    """Opening ``workers`` version 4 batches of n records each: one after the other, and on as
    many threads at once (what a server does with concurrent uploads); wall time per record."""
    sk = envelope.CLASSICAL.generate_private_key()
    key = envelope.CLASSICAL.load_private_key(sk)
    me = envelope.Recipient("s1", envelope.public_key_of(sk))
    jobs = [(envelope.seal_body(me, STUDY_ID, _bodies(d, n)[1], messages.SHARES_MEDIA_TYPE, d, N_SERVERS), d, key)
            for _ in range(workers)]
    best = {"one after another": float("inf"), f"{workers} threads": float("inf")}
    with ThreadPoolExecutor(workers) as threads:
        list(threads.map(_open, jobs))  # start the workers
        for _ in range(repeat):
            t0 = time.perf_counter()
            one = [_open(job) for job in jobs]
            t1 = time.perf_counter()
            both = list(threads.map(_open, jobs))
            t2 = time.perf_counter()
            if one != both or sum(one) != workers * n:  # pragma: no cover - a broken opener
                raise AssertionError("the batches opened to other records")
            for name, took in zip(best, (t1 - t0, t2 - t1)):
                best[name] = min(best[name], took)
    out = {"d": d, "records": workers * n, **{k: v / (workers * n) * 1e6 for k, v in best.items()}}
    out["threads / one after another"] = best[f"{workers} threads"] / best["one after another"]
    return out


def table(results: list[dict]) -> str:
    lines = ["| d | plaintext B | suite | layout | B/report/server | seal us/share | open us/share |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        for suite in ("classical", "post-quantum"):
            f = r[f"{suite} v4"]
            lines.append(f"| {r['d']} | {r['plaintext_bytes_per_report']} | {suite} | version {f['version']} | "
                         f"{f['bytes_per_report']:.1f} | {f['seal_us_per_share']:.2f} | "
                         f"{f['open_us_per_share']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, nargs="+", default=[10, 100], help="widths (default: 10 100)")
    ap.add_argument("--n", type=int, default=2000, help="shares per width (default: 2000)")
    ap.add_argument("--repeat", type=int, default=5, help="passes per measurement, best kept (default: 5)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args(argv)
    results = [measure(d, args.n, args.repeat) for d in args.d]
    parallel = measure_parallel(args.d[0], max(args.n, 20_000), args.repeat)
    print(f"# {N_SERVERS} servers, {args.n} shares per width, best of {args.repeat} (CPU time); cryptography "
          f"{cryptography.__version__}, Python {platform.python_version()}, {platform.machine()}")
    print(table(results))
    print(f"\n# opening 2 version 4 batches, {parallel['records']} records in all, d = {parallel['d']} "
          f"(wall time, us per record, best of {args.repeat}; the last column a ratio)")
    print("| " + " | ".join(k for k in parallel if k not in ("d", "records")) + " |")
    print("|" + "---|" * (len(parallel) - 2))
    print("| " + " | ".join(f"{v:.2f}" for k, v in parallel.items() if k not in ("d", "records")) + " |")
    if args.json:
        print(json.dumps({"layouts": results, "parallel_open": parallel}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
