"""benchmarks/peer_flower.py runs at HEAD (issue 46: its bulk path crashed with a TypeError once
``prepare_batch`` gained ``full``, and nothing ran it). Imported and run on its dpsketch side
alone at the smallest size it takes (n = 50, d = 4; Flower is an optional extra): both upload
paths through a real local cluster, each release checked bit for bit by the benchmark itself
against the ring sum of what its clients sent."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_peer_flower_runs_both_dpsketch_paths(tmp_path):
    spec = importlib.util.spec_from_file_location("peer_flower", ROOT / "benchmarks" / "peer_flower.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    out = tmp_path / "peer.json"
    assert peer.main(["--skip-flower", "--n", "50", "--d", "4", "--paths", "single,bulk", "--workers", "8",
                      "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert sorted(r["system"] for r in results) == ["dpsketch-bulk", "dpsketch-single"]
    for r in results:
        assert r["n"] == 50 and r["d"] == 4
        assert r["release_equals_ring_sum"] is True, r
        assert r["max_abs_error_in_sd"] < 6, r  # the clients' own noise, nothing else
