"""A retry storm over real HTTP at scale (issue 46): one real share server holding ``--n``
reports (uploaded as share batches of 5,000), then ``--storm-clients`` clients re-sending stored
reports (single JSON reports and share batches of ``--batch-rows``, the same bytes) for
``--seconds`` while ``--fresh-clients`` clients send fresh single reports; before and after
the storm the fresh clients alone, ``--calm-seconds`` in all; last, for ``--crowd-seconds``,
as many clients as in the storm all sending fresh reports (the control: the server's rate at the
storm's concurrency when nothing is a re-send) (tools/retry_storm.py).

Prints one JSON line per phase and a summary: the fresh-upload rate calm and in the storm and
their ratio, every upload request answered a second in the storm against the calm fresh rate
and against the crowd's (what a re-send request costs the server against a fresh one), a fresh client's answers a
second against a re-sending client's (1: a fair share), the median latencies of a re-send and a
fresh upload in the storm, every non-200 answer, and whether the server holds exactly the base
plus the fresh reports acknowledged; the server's RSS after each phase and its peak, and its
held re-send answers (services/resend_gate.py: held at most at once, in all, past a cap).
``--max-inflight`` sets the server's upload admission limit (``DPSKETCH_MAX_INFLIGHT_UPLOADS``;
64 is the default, under which more than 64 clients with a request in flight get 503 +
Retry-After for the excess by design); ``--hold-s`` the longest wait of a re-send's answer while
fresh uploads arrive (``DPSKETCH_RESEND_HOLD_S``; 0: answered at once, the fair share before);
``--rounds`` splits the storm into parts between calm parts (calm and storm under the same drift
of the machine's load).

    .venv/bin/python benchmarks/retry_storm.py [--n 1000000] [--seconds 10] [--calm-seconds 10]
        [--crowd-seconds 5] [--storm-clients 64] [--fresh-clients 8] [--batch-rows 8] [--max-inflight 128]
        [--hold-s S] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    from dpsketch.tools import retry_storm

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=10**6, help="reports stored before the storm")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the storm")
    p.add_argument("--calm-seconds", type=float, default=10.0, help="fresh clients alone, half before, half after")
    p.add_argument("--crowd-seconds", type=float, default=5.0,
                   help="then the storm's number of clients all sending fresh reports (0: skip)")
    p.add_argument("--rounds", type=int, default=1,
                   help="the storm in this many parts, each between two calm parts (measured under the same drift "
                        "of the machine's load)")
    p.add_argument("--storm-clients", type=int, default=64)
    p.add_argument("--fresh-clients", type=int, default=8)
    p.add_argument("--batch-rows", type=int, default=8, help="rows of a re-sent batch (0: single reports only)")
    p.add_argument("--max-inflight", type=int, default=128, help="the server's DPSKETCH_MAX_INFLIGHT_UPLOADS")
    p.add_argument("--hold-s", type=float, default=None,
                   help="the server's DPSKETCH_RESEND_HOLD_S (longest wait of a re-send's answer while fresh "
                        "uploads arrive; 0: answered at once, the fair share before; default: the server's, 1 s)")
    args = p.parse_args(argv)

    wd = Path(tempfile.mkdtemp(prefix="dpsketch-storm-"))
    load_start = retry_storm.load_average()
    env = {"DPSKETCH_MAX_INFLIGHT_UPLOADS": str(args.max_inflight)}
    if args.hold_s is not None:
        env["DPSKETCH_RESEND_HOLD_S"] = str(args.hold_s)
    proc, spec, study, token = retry_storm.start_server(wd, env)
    try:
        t0 = time.perf_counter()
        base = retry_storm.Reports.random(study, args.n, np.random.default_rng(1))
        bind_s = time.perf_counter() - t0
        store_s = retry_storm.store_base(proc.url, study, token, base)
        out = retry_storm.storm(proc.url, study, token, base, seconds=args.seconds, calm_seconds=args.calm_seconds,
                                fresh_clients=args.fresh_clients, storm_clients=args.storm_clients,
                                resend_batch_rows=args.batch_rows,
                                crowd_seconds=args.crowd_seconds, seed=1, server_pid=proc.proc.pid,
                                rounds=args.rounds)
        held = retry_storm.held(proc.url, study, spec.operator_token)
        gate = retry_storm.gate_figures(proc.url, spec.operator_token)
    finally:
        proc.stop()
        shutil.rmtree(wd, ignore_errors=True)
    for phase in out.pop("phases"):
        print(json.dumps(phase.figures()))
    fresh, problems = out.pop("fresh_acked"), out.pop("problems")
    statuses: dict[str, int] = {}
    for m in problems:
        key = m.split(":", 1)[0]
        statuses[key] = statuses.get(key, 0) + 1
    out.update(n=args.n, d=study.width, rounds=args.rounds, max_inflight=args.max_inflight, hold_s=args.hold_s, resend_gate=gate,
               bind_s=round(bind_s, 1),
               store_base_s=round(store_s, 1), problems=len(problems), problems_by_kind=statuses,
               held=held, held_expected=args.n + len(fresh), fresh_unique=len(set(fresh)) == len(fresh),
               cpus=os.cpu_count(), load_average_1min_start=load_start,
               load_average_1min_end=retry_storm.load_average())
    print(json.dumps(out))
    return 0 if not problems and held == args.n + len(fresh) else 1


if __name__ == "__main__":
    raise SystemExit(main())
