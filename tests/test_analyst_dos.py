"""The analyst cannot lock a server (issue 41, docs/trust.md "Secure defaults").

The issue's attack: fifteen empty studies of k = 4096 x width 4096, provisioned in 3 s with the
analyst token alone, used up a server's 4 GiB memory budget (declared totals were charged from
provisioning on), so honest uploads to an existing study got 409 and new studies 422 until an
operator restarted the server, while its real RSS was 393 MB. Scaled down here (a 256 MiB budget,
fifteen studies declaring 41 MiB each, 617 MiB in all), over a real server process:

* all fifteen are provisioned, the server's RSS grows by a few MiB and its memory budget counts
  nothing for them (totals are charged as reports arrive); an honest study provisioned after them
  takes its reports, and more honest studies can be opened;
* the open-study cap (``max_open_studies``) is the only thing the analyst can fill: then new
  studies are refused (422 naming the rule), honest uploads to open studies still succeed, and the
  operator's drop (audited) frees the slots at once; expiry frees them after a published time.
"""

from __future__ import annotations

import time

import httpx
import numpy as np

from dpsketch.client_sdk import Client
from dpsketch.protocol import design
from dpsketch.protocol.study import Study
from dpsketch.services.admin import ServerAdmin

SERVERS = ["s1", "s2"]
WIDTH, K = 4000, 1024


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024


def _settled_rss(pid: int, within: float = 60.0) -> int:
    """The server's RSS once its background warm-ups are done: two reads 1 s apart within
    256 KiB of each other (a fixed sleep was a guess that a loaded machine could outlast)."""
    deadline = time.monotonic() + within
    last = _rss(pid)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _rss(pid)
        if abs(now - last) < 256 << 10:
            return now
        last = now
    return last


def _memory_counted(proc, spec) -> float:
    text = httpx.get(f"{proc.url}/metrics", headers={"Authorization": f"Bearer {spec.operator_token}"}).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("dpsketch_store_memory_bytes ")))


def _put(client: httpx.Client, spec, study: Study) -> httpx.Response:
    return client.put(f"/v1/studies/{study.study_id}", content=study.canonical(),
                      headers={"Authorization": f"Bearer {spec.analyst_token}", "Content-Type": "application/json"})


def test_fifteen_empty_studies_leave_honest_uploads_and_new_studies_working(servers):
    env = {"DPSKETCH_MEMORY_BUDGET": str(256 << 20), "DPSKETCH_MAX_STUDY_MEMORY": str(64 << 20),
           "DPSKETCH_MAX_OPEN_STUDIES": "20", "DPSKETCH_UPLOAD_AUTH": "open",
           "DPSKETCH_POPULATION_EPSILON": "none", "DPSKETCH_POPULATION_FLOOR_EPSILON": "none"}
    specs = [servers.spec(s) for s in SERVERS]
    procs = [servers.start(spec, env, open_uploads=False) for spec in specs]
    proc, spec = procs[0], specs[0]
    columns = [f"c{i}" for i in range(WIDTH)]
    attack = [design(name=f"lock{i}", columns=columns, label=None, servers=SERVERS, expected_reports=10 ** 4,
                     k=K, s=4, seed=f"{i + 1:064x}")[0] for i in range(15)]
    declared = 8 * K * (WIDTH + K)
    assert 15 * declared > (256 << 20) >= 6 * declared  # the old budget refused the seventh
    pid = proc.proc.pid
    with httpx.Client(base_url=proc.url, timeout=60) as client:
        honest_old = design(name="honest", columns=["a", "b"], label=None, servers=SERVERS,
                            expected_reports=200, seed=f"{99:064x}")[0]
        for p, sp in zip(procs, specs):
            with httpx.Client(base_url=p.url, timeout=60) as c:
                assert _put(c, sp, honest_old).status_code == 201
        rows = np.random.default_rng(1).uniform(-0.5, 0.5, (20, 2))
        with Client([p.url for p in procs]) as sdk:
            sdk.submit_many(honest_old.study_id, rows[:10])
        # the first large study loads what any does (the compiled sketch loops, in the background)
        codes = [_put(client, spec, attack[0]).status_code]
        before = _settled_rss(pid)
        start = time.perf_counter()
        codes += [_put(client, spec, s).status_code for s in attack[1:]]
        took = time.perf_counter() - start
        grown = _rss(pid) - before
        counted = _memory_counted(proc, spec)
        print(f"\n15 studies declaring {15 * declared / 2**20:.0f} MiB provisioned (the last 14 in {took:.1f} s): RSS "
              f"+{grown / 2**20:.1f} MiB over the last 14, memory budget counts {counted / 2**20:.3f} MiB of 256")
        assert codes == [201] * 15
        assert grown < 14 * (1 << 20) and counted < 1 << 20  # under 1 MiB a study; counted: the honest reports
        # honest uploads to the existing study, and a new honest study, still work
        honest_new = design(name="honest2", columns=["a", "b"], label=None, servers=SERVERS,
                            expected_reports=200, seed=f"{98:064x}")[0]
        for p, sp in zip(procs, specs):
            with httpx.Client(base_url=p.url, timeout=60) as c:
                assert _put(c, sp, honest_new).status_code == 201
        with Client([p.url for p in procs]) as sdk:
            sdk.submit_many(honest_old.study_id, rows[10:])
            sdk.submit_many(honest_new.study_id, rows)
            assert set(sdk.report_counts(honest_old.study_id).values()) == {20}
            assert set(sdk.report_counts(honest_new.study_id).values()) == {20}

        # the open-study cap (20 here) is what the analyst can fill: 17 open, 3 more, then 422
        extra = [design(name=f"more{i}", columns=["a"], label=None, servers=SERVERS, expected_reports=200,
                        seed=f"{200 + i:064x}")[0] for i in range(4)]
        codes = [_put(client, spec, s) for s in extra]
        assert [r.status_code for r in codes] == [201, 201, 201, 422]
        assert codes[3].json()["policy_rule"] == "max_open_studies"
        with Client([p.url for p in procs]) as sdk:  # uploads to open studies go on
            sdk.submit_many(honest_old.study_id, rows[:5] + 0.1)
        # the operator drops the attacker's studies (audited): slots free at once
        with ServerAdmin(proc.url, spec.operator_token) as admin:
            for s in attack:
                assert admin.drop_study(s.study_id)["status"] == "dropped"
        assert _put(client, spec, extra[3]).status_code == 201
        assert proc.log_path.read_text().count("AUDIT study ") == 15
