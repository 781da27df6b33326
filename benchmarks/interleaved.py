"""Before and after on a noisy machine: a server bench run for two (or more) source trees in turn.

On a shared VM the same bench moves by 20-40 % between runs (the echo, the exact sketch and the
server alike), so a change is measured by running the trees alternately, each in fresh server
processes with ``PYTHONPATH=<tree>``, round after round, and comparing the rounds pairwise. Each
round runs ``python -m dpsketch.tools.server_bench <which>`` once per tree (the order alternates), and the
script prints every round's figures and each tree's median. A tree is a checkout of this
repository (``git worktree add /tmp/before <commit>``); its compiled loops are loaded once
before the first round, so no round compiles them.

    python benchmarks/interleaved.py single /tmp/before . --rounds 4 -- --seconds 15 --rounds 5
    python benchmarks/interleaved.py bulk /tmp/before . --rounds 3 -- --n 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

#: the figures printed per run: (key in the bench's JSON, how it is shown)
FIGURES = {
    "single": [("reports_per_s", "{:,.0f}/s"), ("ratio_to_echo", "{:.3f} x echo"), ("p99_ms", "p99 {:.0f} ms")],
    "bulk": [("rows_per_s", "{:,.0f} rows/s"), ("ratio_to_exact_sketch", "{:.3f} x exact sketch"),
             ("ratio_to_reference_sketch", "{:.2f} x reference"),
             ("baseline_exact_sketch_rows_per_s", "(sketch {:,.0f})"), ("ratio_to_executemany", "{:.2f} x executemany"),
             ("p99_ms", "p99 {:.0f} ms")],
}


def run(tree: Path, which: str, extra: list[str]) -> dict:
    """One bench run of ``tree`` in its own processes; the bench's figures."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-m", "dpsketch.tools.server_bench", which, *extra], env=env, cwd=tree,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])[which]


def warm(tree: Path) -> None:
    """Load (compiling on first use) the tree's compiled loops into its numba cache."""
    code = ("from dpsketch.protocol import kernels; kernels.warm_up_all()\n"
            "try:\n    from dpsketch.services import idsets; idsets.MERGE.warm_up()\nexcept (ImportError, AttributeError):\n    pass")
    subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(tree)), cwd=tree, check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=sorted(FIGURES))
    p.add_argument("trees", nargs="+", type=Path, help="checkouts to compare, in this order")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each running every tree once (default 3)")
    p.epilog = (p.epilog or "") + "Arguments after -- go to tools.server_bench."
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = p.parse_args(argv[:cut]), argv[cut + 1:]
    trees = [t.resolve() for t in args.trees]
    for tree in trees:
        warm(tree)
    results: dict[Path, list[dict]] = {t: [] for t in trees}
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for tree in order:
            got = run(tree, args.which, extra)
            results[tree].append(got)
            shown = "  ".join(fmt.format(got[key]) for key, fmt in FIGURES[args.which] if key in got)
            print(f"round {r + 1}  {tree}: {shown}", flush=True)
    for tree in trees:
        medians = "  ".join(fmt.format(statistics.median(g[key] for g in results[tree]))
                            for key, fmt in FIGURES[args.which] if key in results[tree][0])
        print(f"median   {tree}: {medians}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
