"""CPU a fresh share server spends on a study's first upload token (its population budget check:
docs/ledger.md), over a real server process.

Starts one server with the default policy (tokens, budgets on) and an empty PLD disk cache (as a
fresh container has), provisions a study (design()'s defaults: signed, epsilon 1, floor 4),
issues its first token at once (as an operator's script does right after provisioning), then a
second token, then a second study of the same population (same design target: it shares the
first one's PLDs) and a third with other targets (epsilon 0.8, floor 3.5: PLDs of its own), each
provisioned and given its first token at once. Then a fourth study of targets of its own
(epsilon 0.7, floor 3.0) and a fifth of the default ones are provisioned one after the other, and
the fifth's first token issued at once, while the fourth's PLDs are being built in the background
(``default_study_first_token_behind_another_build``: it needs nothing of that build), then the
fourth's (``its_first_token``). Last, two studies of targets of their own again (epsilon 0.9,
floor 3.6; epsilon 0.85, floor 3.3; charged to another population, "lab", so that the budget
takes them) provisioned one after the other, and the second's first token issued at once, while
the first's PLDs are being built (``other_targets_first_token_behind_another_build``: it needs
its own build only), then the first's (``its_first_token_too``). Prints, per step, the server
process's CPU seconds (user + system, every thread, from /proc) and the wall seconds of the
request(s).

    .venv/bin/python benchmarks/first_token.py [--settle SECONDS] [--pld-cache DIR] [--shipped]

``--settle``: wait this long after provisioning before the token (default 0: at once; the
provisioning's background build then overlaps the token's request). ``--shipped``: first build
the default targets' PLDs (services/store.warm_charges, not measured) into a directory the server
reads as its image's ($DPSKETCH_PLD_SHIPPED), as the server image ships them.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu(pid: int) -> float:
    """utime + stime of the process (every thread), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settle", type=float, default=0.0)
    p.add_argument("--pld-cache", default=None, help="DPSKETCH_PLD_CACHE of the server (default: a new "
                   "empty directory; 'none': no disk cache)")
    p.add_argument("--shipped", action="store_true")
    args = p.parse_args(argv)

    import httpx

    from dpsketch.protocol import design
    from dpsketch.tools.cluster import ServerSpec, share_server

    servers = ["s1", "s2"]

    def study(i: int, epsilon: float = 1.0, floor: float = 4.0):
        return design(name=f"t{i}", columns=["a", "b"], label=None, servers=servers, expected_reports=200,
                      epsilon=epsilon, epsilon_floor=floor, delta=1e-6, seed=f"{i + 1:064x}")[0]

    with tempfile.TemporaryDirectory(prefix="dpsketch-first-token-") as wd:
        cache = args.pld_cache or str(Path(wd) / "pld")
        env = {"DPSKETCH_PLD_CACHE": cache}
        if args.shipped:
            from dpsketch.services.store import warm_charges

            os.environ["DPSKETCH_PLD_CACHE"] = env["DPSKETCH_PLD_SHIPPED"] = str(Path(wd) / "shipped")
            assert warm_charges()
        spec = ServerSpec("s1", "op-" + secrets.token_hex(8), "an-" + secrets.token_hex(8), Path(wd) / "s1.sqlite3")
        proc = share_server(spec, Path(wd), env).start()
        pid = proc.proc.pid
        out: dict[str, object] = {"settle_s": args.settle, "pld_cache": "fresh" if args.pld_cache is None
                                  else args.pld_cache, "shipped": args.shipped}
        try:
            with httpx.Client(timeout=600) as client:
                def put(s) -> None:
                    r = client.put(f"{proc.url}/v1/studies/{s.study_id}", content=s.canonical(),
                                   headers={"Authorization": f"Bearer {spec.analyst_token}",
                                            "Content-Type": "application/json"})
                    assert r.status_code in (200, 201), r.text

                def token(s, population: str = "clinic") -> None:
                    r = client.post(f"{proc.url}/v1/studies/{s.study_id}/upload-tokens",
                                    json={"quota": 5, "population": population},
                                    headers={"Authorization": f"Bearer {spec.operator_token}"})
                    assert r.status_code == 201, r.text

                def step(name: str, *calls) -> None:
                    c0, t0 = _cpu(pid), time.perf_counter()
                    for call in calls:
                        call()
                    out[name] = {"cpu_s": round(_cpu(pid) - c0, 2), "wall_s": round(time.perf_counter() - t0, 2)}

                first, same, other = study(0), study(1), study(2, epsilon=0.8, floor=3.5)
                for name, s in (("first_study", first), ("second_study_same_targets", same),
                                ("third_study_other_targets", other)):
                    put(s)
                    time.sleep(args.settle)
                    step(f"{name}_first_token", lambda s=s: token(s))
                    if s is first:
                        step("first_study_second_token", lambda: token(first))
                behind, ahead = study(3, epsilon=0.7, floor=3.0), study(4)
                put(behind)  # its PLDs built in the background from now on
                put(ahead)  # the default targets: the first study's PLDs
                step("default_study_first_token_behind_another_build", lambda: token(ahead))
                step("its_first_token", lambda: token(behind))
                behind, other = study(5, epsilon=0.9, floor=3.6), study(6, epsilon=0.85, floor=3.3)
                put(behind)
                put(other)
                step("other_targets_first_token_behind_another_build", lambda: token(other, "lab"))
                step("its_first_token_too", lambda: token(behind, "lab"))
                out["server_cpu_total_s"] = round(_cpu(pid), 2)
        except Exception:
            print(proc.log_tail(), file=sys.stderr)
            raise
        finally:
            proc.stop()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
