"""benchmarks/peer_flower.py runs at HEAD (issue 46: its bulk path crashed with a TypeError once
``prepare_batch`` gained ``full``, and nothing ran it). Imported and run on its dpsketch side at
n = 5 (Flower is an optional extra that CI does not install; with it installed, the slow test
below runs one tiny SecAgg+ round too): the three upload paths through a real local cluster (the
relay path through a real ``dpsketch relay``), each client of the single and relay paths its own
``Client`` or ``RelayClient`` with its own tokens that checks the study itself,
each release checked bit for bit by the benchmark against the ring sum of what its clients sent
and here against the true sum of the rows."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _peer():
    spec = importlib.util.spec_from_file_location("peer_flower", ROOT / "benchmarks" / "peer_flower.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer


def test_peer_flower_sums_five_clients_on_both_dpsketch_paths(tmp_path):
    peer = _peer()
    out, page = tmp_path / "peer.json", tmp_path / "peer.md"
    page.write_text(f"before\n{peer.TABLE_START}\nold table\n{peer.TABLE_END}\nafter\n")
    assert peer.main(["--skip-flower", "--n", "5", "--d", "4", "--paths", "single,relay,bulk,floor", "--workers", "4",
                      "--cold-check", "--json", str(out), "--write-docs", str(page)]) == 0
    every = json.loads(out.read_text())["results"]
    floor = {r["system"]: r for r in every if r["system"].startswith("http-floor-")}
    results = [r for r in every if r["system"].startswith("dpsketch-")]
    assert sorted(r["system"] for r in results) == ["dpsketch-bulk", "dpsketch-relay", "dpsketch-single"]
    # the floor: each pattern's requests, every one answered 200, by servers that only read and answer,
    # with the single path's request sizes at d = 4 (a study's JSON; a report of 4 values)
    assert sorted(floor) == ["http-floor-1", "http-floor-2N", "http-floor-N"]
    assert [floor[f"http-floor-{k}"]["http_requests"] for k in ("1", "N", "2N")] == [5, 15, 30]
    assert all(r["post_bytes"] > 100 and r["get_bytes"] > 1000 and r["seconds"] > 0 for r in floor.values())
    truth = peer.rows(0, 5, 4).sum(axis=0)
    for r in results:
        assert r["n"] == 5 and r["d"] == 4
        # the release is exactly what the 5 clients sent (finalize counted 5 reports, or the
        # benchmark's own assertion fails), and that is the true sum plus the clients' noise only
        assert r["release_equals_ring_sum"] is True, r
        assert r["max_abs_error_vs_ring_sum"] == 0.0
        assert r["noise_sd"] == pytest.approx(np.sqrt(5) * r["sigma"])
        assert r["max_abs_error"] < 6 * r["noise_sd"], r
        assert not np.allclose(truth, 0)
    single = next(r for r in results if r["system"] == "dpsketch-single")
    assert single["http_requests_per_client"] == 6 and single["cold_check"] is True
    relay = next(r for r in results if r["system"] == "dpsketch-relay")  # one request per device, to the relay
    assert relay["http_requests_per_client"] == 1 and relay["http_requests"] == 5 and relay["cold_check"] is True
    # the relay as shipped (its own window and group size: what a user runs), named in the table
    from dpsketch.services import relay as relay_service
    assert relay["relay_window_ms"] == relay_service.DEFAULT_WINDOW_S * 1000
    assert relay["relay_max_entries"] == relay_service.DEFAULT_MAX_ENTRIES
    assert f"relay window {relay_service.DEFAULT_WINDOW_S * 1000:g} ms, groups of up to " \
           f"{relay_service.DEFAULT_MAX_ENTRIES}" in page.read_text()
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old table" not in text
    assert "| 5 | — | — |" in text and "each checking the study itself" in text
    assert "The bare-HTTP floor" in text and "| dpsketch single / its floor (N GETs + N POSTs) |" in text
    assert "| 5 | " in text.split("The bare-HTTP floor")[1]


def test_the_table_pairs_each_repetition_and_takes_medians():
    peer = _peer()

    def res(system, n, seconds, rep):
        return {"system": system, "n": n, "seconds": seconds, "total_seconds": seconds + 1, "rep": rep,
                "max_abs_error": 1e-6, "release_equals_ring_sum": True, "max_abs_error_in_sd": 1.0,
                "workers": 64 if system == "dpsketch-single" else None, "load_before": 2.0, "load_after": 3.5}

    results = [res("flower-secagg+", 1000, f, k) for k, f in enumerate((100.0, 120.0, 90.0))]
    results += [res("dpsketch-single", 1000, s, k) for k, s in enumerate((5.0, 4.0, 9.0))]
    assert peer.ratios(results, "flower-secagg+", "dpsketch-single", 1000) == [20.0, 30.0, 10.0]
    table = peer.render(results, {"d": 100, "machine": "2 CPUs", "date": "today"})
    assert "median (range) of 3 interleaved runs" in table and "64 clients at a time" in table
    assert "| 1,000 | 100.0 (90.0-120.0) | 101.0 (91.0-121.0) | 5.00 (4.00-9.00) | — | — | 20.0 (10.0-30.0) | — |" in table
    assert table.rstrip().endswith("| 2.0-3.5 |")
    # the floor's own table pairs each repetition too: single over its floor, Flower over a 1-request floor
    floor = [{**res(f"http-floor-{k}", 1000, t, rep), "get_bytes": 3709, "post_bytes": 1200}
             for k, times in (("1", (1.0, 2.0, 1.5)), ("N", (2.0, 3.0, 2.5)), ("2N", (4.0, 2.0, 3.0)))
             for rep, t in enumerate(times)]
    table = peer.render(results + floor, {"d": 100, "machine": "2 CPUs", "date": "today"})
    assert ("| 1,000 | 1.50 (1.00-2.00) | 60.0 (60.0-100.0) | 2.50 (2.00-3.00) | 40.0 (36.0-50.0) | "
            "3.00 (2.00-4.00) | 30.0 (25.0-60.0) | 2.00 (1.25-3.00) | 2.0-3.5 |") in table
    assert "a GET 3,709 bytes, a POST body 1,200 bytes" in table


# The Flower side is not run here: Flower (the 'peer' extra) would downgrade FastAPI, Starlette and
# uvicorn under the share servers, so it lives in its own venv (docs/peer.md, --flower-python) and
# the test install has none; a test that could only skip in CI is left out rather than skipped.
