"""Peak memory of a share server committing a large study (issue 41, docs/operations.md "Scale").

A real ``dpsketch server`` process (SQLite, open uploads, no population budget) takes ``--n``
reports of a one-column sum study (k = 1) in batches of ``--batch``; then, with the server's
peak RSS reset (``/proc/PID/clear_refs`` 5: VmHWM starts again from the current RSS), this
script

1. fetches its report ids (GET .../report-ids: streamed from the report index),
2. builds the compact inclusion bitmap leaving out ``--exclude`` of them (here, in this process),
3. posts a streamed junk body of ``--junk`` MiB as a bitmap (the issue's attack), and the plain
   report-id list of the set, which the server refuses (413) past --max-body-bytes (64 MiB: from
   about 4 x 10^6 reports on; below, it commits, and step 4 is a repeat),
4. commits with the bitmap,

reading the server's VmRSS and VmHWM after each step. Figures: the server's RSS before the
commit (its open study: index and totals), the peak during each step above that, the body
sizes, and the commit's time.

    .venv/bin/python benchmarks/commit_memory.py [--n 10000000] [--batch 100000] [--exclude 0.01]
        [--junk 768] [--json out.json]
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

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpsketch.protocol import binding, design, inclusion, messages  # noqa: E402
from dpsketch.tools.cluster import ServerSpec, free_port, share_server  # noqa: E402


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10_000_000)
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--exclude", type=float, default=0.01)
    p.add_argument("--junk", type=int, default=768, help="MiB of junk streamed as a commit body")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="commit-memory-"))
    spec = ServerSpec(server_id="s1", operator_token="op-" + secrets.token_hex(8),
                      analyst_token="an-" + secrets.token_hex(8), db_path=work / "s1.sqlite3", port=free_port())
    env = {"DPSKETCH_UPLOAD_AUTH": "open", "DPSKETCH_POPULATION_EPSILON": "none",
           "DPSKETCH_POPULATION_FLOOR_EPSILON": "none", "DPSKETCH_MEMORY_BUDGET": str(8 << 30)}
    proc = share_server(spec, work, env).start(60)
    pid = proc.proc.pid
    analyst = {"Authorization": f"Bearer {spec.analyst_token}"}
    out: dict = {"n": args.n, "exclude": args.exclude, "load": os.getloadavg()[0]}
    try:
        study, _ = design(name="commit-memory", columns=["x"], label=None, servers=["s1", "s2"],
                          expected_reports=args.n, min_reports=int(args.n * (1 - 2 * args.exclude)),
                          max_reports=args.n, k=1, s=1)
        with httpx.Client(base_url=proc.url, timeout=600) as http:
            r = http.put(f"/v1/studies/{study.study_id}", content=study.canonical(),
                         headers={**analyst, "Content-Type": "application/json"})
            assert r.status_code == 201, r.text
            start = time.perf_counter()
            for at in range(0, args.n, args.batch):
                m = min(args.batch, args.n - at)
                shares = np.frombuffer(os.urandom(8 * m), dtype="<u8").reshape(m, 1)
                ids, proofs = binding.bind_for_server(study.study_id, 2, 0, binding.CONTENT_SHARE, shares)
                r = http.post(f"/v1/studies/{study.study_id}/batches", content=messages.encode_batch(ids, proofs, shares),
                              headers={"Content-Type": messages.SHARES_MEDIA_TYPE})
                assert r.status_code == 200, r.text
            out["ingest_s"] = time.perf_counter() - start
            time.sleep(2)
            base = status(pid)["VmRSS"]
            out["rss_before_commit_mib"] = base / 2**20

            def step(name: str, fn):
                reset_peak(pid)
                t = time.perf_counter()
                result = fn()
                st = status(pid)
                out[name] = {"s": time.perf_counter() - t, "peak_over_base_mib": (st["VmHWM"] - base) / 2**20,
                             "rss_after_mib": st["VmRSS"] / 2**20}
                return result

            held = step("report_ids", lambda: http.get(f"/v1/studies/{study.study_id}/report-ids",
                                                       headers=analyst).content)
            assert len(held) == 16 * args.n
            rng = np.random.default_rng(0)
            keep = rng.random(args.n) >= args.exclude
            included = np.frombuffer(held, dtype="S16")[keep].tobytes()
            body = inclusion.encode_for(held, included)
            out["bitmap_bytes"] = len(body)
            out["id_list_bytes"] = len(included)
            del held

            def junk():
                chunk = bytes(1 << 20)

                def stream():
                    for _ in range(args.junk):
                        yield chunk

                try:
                    r = http.post(f"/v1/studies/{study.study_id}/commit", content=stream(),
                                  headers={**analyst, "Content-Type": inclusion.MEDIA_TYPE})
                    return r.status_code
                except httpx.HTTPError as exc:  # the server answered and closed mid-stream
                    return type(exc).__name__

            out["junk_status"] = step("junk_stream", junk)

            def plain():
                r = http.post(f"/v1/studies/{study.study_id}/commit", content=included,
                              headers={**analyst, "Content-Type": messages.REPORT_IDS_MEDIA_TYPE})
                return r.status_code

            out["plain_status"] = step("plain_id_list", plain)

            def commit():
                r = http.post(f"/v1/studies/{study.study_id}/commit", content=body,
                              headers={**analyst, "Content-Type": inclusion.MEDIA_TYPE})
                assert r.status_code == 200, r.text
                return r.json()

            result = step("bitmap_commit", commit)
            out["n_reports"] = result["n_reports"]
    finally:
        proc.stop()
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
