"""Fresh uploads keep their rate through a retry storm (issue 46), over real HTTP to a real
share server (tools/retry_storm.py drives it; services/resend_gate.py is what is tested).

32 clients re-send reports the server holds (single JSON reports and batches of 8, the same
bytes), one request in flight each, while 4 clients send fresh single reports; before and after
the storm the 4 alone. Before the gate the server shared itself fairly among the 36 clients and
the 4 fresh ones fell to a fraction of their calm rate (0.11-0.33x with 8 of 72 in
benchmarks/retry_storm.py; a fair share here is 4/36). Now a re-send's answer is held while
fresh uploads arrive, so the storm's clients slow down and fresh uploads keep their pace.

Asserted as ratios within the run that the machine's other load does not move (the suite runs
on a loaded 2-core machine, where another worker's CPU bursts can fall on the storm's seconds
more than on the calm ones: the plain rate ratio, storm over calm, read 0.33 in one CI run at
load 8.4 and 0.78-1.02 elsewhere; it is measured by benchmarks/retry_storm.py, figures in
docs/operations.md). Fresh uploads answered per CPU second of the server, in the storm against
calm, at least 0.5 (measured 0.90-0.93 at load 2-4 and 0.81 at load 8-9 with four CPU hogs
beside it; with the hold off, as before the gate, 0.18-0.19); fresh uploads at least half of
every upload request answered in the storm (measured 0.91-0.93 and 0.79-0.83 under the hogs;
with the hold off 0.114-0.115, the clients' fair share 4/36 = 0.111), so the test fails without
the gate whatever the load; every answer 200, every re-send acknowledged as duplicates only and within its bound (2 s held at most, plus the time to
answer it: under 5 s), the storm's clients answered again and again (no re-send starves); the
server then holds exactly the base plus the fresh reports acknowledged, each once; and its
memory does not grow with the storm. The caps on held answers (count, bytes) and their leaving
the admission counts are tested on the gate itself, tests/test_retry_storm_gate.py.
"""

from __future__ import annotations

import numpy as np

from dpsketch.tools import retry_storm

BASE = 4_000


def _stored(tmp_path, env: dict[str, str]):
    proc, spec, study, token = retry_storm.start_server(tmp_path, {"DPSKETCH_MAX_INFLIGHT_UPLOADS": "128", **env})
    try:
        base = retry_storm.Reports.random(study, BASE, np.random.default_rng(11))
        retry_storm.store_base(proc.url, study, token, base, batch_rows=8)
        assert retry_storm.held(proc.url, study, spec.operator_token) == BASE
    except BaseException:
        proc.stop()
        raise
    return proc, spec, study, token, base


def _everything_counted_once(proc, spec, study, base, out) -> None:
    assert out["problems"] == [], (len(out["problems"]), out["problems"][:5])
    for phase in out["phases"]:
        assert set(phase.statuses) == {200}, phase.figures()
    fresh = out["fresh_acked"]
    assert len(set(fresh)) == len(fresh)
    assert retry_storm.held(proc.url, study, spec.operator_token) == BASE + len(fresh)
    ids = retry_storm.held_ids(proc.url, study, spec.analyst_token)
    assert len(ids) == BASE + len(fresh) and ids.issuperset(fresh) and ids.issuperset(base.ids)


def test_fresh_uploads_keep_their_rate_while_every_other_client_resends(tmp_path):
    proc, spec, study, token, base = _stored(tmp_path, {})  # the default hold: 2 s at most
    try:
        # two storms of 2 s between three calm parts of 4/3 s: calm and storm under the same drift
        out = retry_storm.storm(proc.url, study, token, base, seconds=4.0, calm_seconds=4.0,
                                fresh_clients=4, storm_clients=32, resend_batch_rows=8, seed=11,
                                server_pid=proc.proc.pid, rounds=2)
        _everything_counted_once(proc, spec, study, base, out)
        gate = retry_storm.gate_figures(proc.url, spec.operator_token)
    finally:
        proc.stop()
    before, during, after = out["phases"]
    figures = {k: v for k, v in out.items() if k not in ("phases", "fresh_acked", "problems")}
    # the storm happened, both kinds of re-send, and every storm client was answered repeatedly
    assert len(during.resend_latencies) >= 32, figures
    assert during.resent_records > len(during.resend_latencies), figures  # batches among them
    # the target: fresh uploads keep (nearly) their calm share of the server, not a 4/36 share
    assert out["storm_over_calm_per_server_cpu"] >= 0.5, figures
    assert out["storm_fresh_share"] >= 0.5, figures
    assert gate["resend_answers_held"] >= 32 and 1 <= gate["resends_held_peak"] <= 32, gate
    assert gate["resends_held"] == 0, gate  # nothing left waiting
    # bounded: no re-send waited much past its 2 s hold
    assert max(during.resend_latencies) < 5.0, figures
    # memory: the storm left the server's resident set where it was (the held answers are few
    # and small; MiB)
    rss = out["server_rss_mib"]
    assert rss["peak after storm"] - rss["after calm before"] < 48, rss

