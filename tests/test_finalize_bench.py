"""``dpsketch bench finalize`` (tools/finalize_bench.py) runs: the figures docs/operations.md
quotes come from it, so it must not rot. At n = 10^4 on 3 real server processes: the study is
released over the reports every server holds (each misses 1 % at random), every server commits,
and the figures it reports are there."""

from __future__ import annotations

from dpsketch.tools.finalize_bench import bench_finalize


def test_finalize_bench_releases_over_what_every_server_holds(tmp_path):
    out = bench_finalize([10_000], workdir=tmp_path)
    (row,) = out["sizes"]
    assert row["n"] == 10_000 and 0.95 * 10_000 < row["included"] < 0.995 * 10_000
    assert row["finalize_s"] > 0 and row["server_commit_aggregate_s_max"] > 0
    commits = [message for _t, message in row["phases"] if "committed" in message]
    assert len(commits) == 3 and all(f"committed {row['included']} reports" in m for m in commits)
    assert len(row["server_peak_rss_mib"]) == 3
