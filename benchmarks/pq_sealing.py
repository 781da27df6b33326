"""Bytes and time of the post-quantum sealing suite against the classical one (docs/sealing.md).

For each width d, one run seals the same 2,000 shares (one server's records of 2,000 reports of
a 3-server study, as the SDK seals them) with the classical suite (X25519, version 1 records,
what ``Client(encrypt=True)`` sends) and with the post-quantum suite (MLKEM768-X25519, version 2),
and opens them as the server does (``envelope.open_batch``), and reports bytes per report per
server and microseconds per share, with the ratios post-quantum / classical. Timings are the
best of ``--repeat`` passes over the whole batch (the least disturbed by the machine); the
ratios are within one run, so they are what to compare across machines.

    .venv/bin/python benchmarks/pq_sealing.py                 # d = 10 and 100, 2,000 shares
    .venv/bin/python benchmarks/pq_sealing.py --d 10 --n 500 --json
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

import cryptography  # noqa: E402

from dpsketch.protocol import binding, envelope, messages, ring  # noqa: E402

STUDY_ID = "ab" * 32
N_SERVERS = 3


def measure(d: int, n: int, repeat: int) -> dict:
    encoded = ring.random_ring((n, d))
    shares = ring.share(encoded, N_SERVERS)
    ids, proofs = binding.bind(STUDY_ID, [envelope.CONTENT_SHARE] * N_SERVERS, shares)
    plain = messages.encode_batch(ids, proofs[0], shares[0])  # server s1's plaintext body
    out = {"d": d, "shares": n, "plaintext_bytes_per_report": len(plain) // n}
    suites = (envelope.CLASSICAL, envelope.POST_QUANTUM)
    keys = {}
    for suite in suites:
        sk = suite.generate_private_key()
        keys[suite.name] = (envelope.Recipient("s1", suite.public_key_of(sk), suite), suite.load_private_key(sk))
    best = {(s.name, what): float("inf") for s in suites for what in ("seal", "open")}
    size = {}
    for _ in range(repeat):  # the suites alternate, so a busy machine slows both alike
        for suite in suites:
            me, key = keys[suite.name]
            t0 = time.perf_counter()
            body = envelope.seal_body(me, STUDY_ID, plain, messages.SHARES_MEDIA_TYPE, d, N_SERVERS)
            t1 = time.perf_counter()
            upload = envelope.open_batch(body, d, N_SERVERS, STUDY_ID, "s1", lambda _kid, key=key: key)
            t2 = time.perf_counter()
            best[suite.name, "seal"] = min(best[suite.name, "seal"], t1 - t0)
            best[suite.name, "open"] = min(best[suite.name, "open"], t2 - t1)
            size[suite.name] = len(body)
            upload.verify(STUDY_ID, N_SERVERS, 0)
            if not np.array_equal(upload.shares(d), shares[0]):  # pragma: no cover - a broken envelope
                raise AssertionError("a sealed share did not open to itself")
    for suite in suites:
        out[suite.name] = {"bytes_per_report": size[suite.name] / n,
                           "seal_us_per_share": best[suite.name, "seal"] / n * 1e6,
                           "open_us_per_share": best[suite.name, "open"] / n * 1e6}
    c, p = out["classical"], out["post-quantum"]
    out["ratio"] = {k: p[k] / c[k] for k in c}
    return out


def table(results: list[dict]) -> str:
    lines = ["| d | plaintext B/report/server | classical B | post-quantum B | ratio | classical seal us/share "
             "| PQ seal us/share | ratio | classical open us/share | PQ open us/share | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c, p, q = r["classical"], r["post-quantum"], r["ratio"]
        lines.append(f"| {r['d']} | {r['plaintext_bytes_per_report']} | {c['bytes_per_report']:.0f} | "
                     f"{p['bytes_per_report']:.0f} | {q['bytes_per_report']:.2f} | "
                     f"{c['seal_us_per_share']:.1f} | {p['seal_us_per_share']:.1f} | {q['seal_us_per_share']:.2f} | "
                     f"{c['open_us_per_share']:.1f} | {p['open_us_per_share']:.1f} | {q['open_us_per_share']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, nargs="+", default=[10, 100], help="widths (default: 10 100)")
    ap.add_argument("--n", type=int, default=2000, help="shares per width (default: 2000)")
    ap.add_argument("--repeat", type=int, default=5, help="passes per measurement, best kept (default: 5)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args(argv)
    results = [measure(d, args.n, args.repeat) for d in args.d]
    print(f"# {N_SERVERS} servers, {args.n} shares per width, best of {args.repeat}; cryptography "
          f"{cryptography.__version__}, Python {platform.python_version()}, {platform.machine()}")
    print(table(results))
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
