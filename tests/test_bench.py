"""The benchmark commands run and report figures that add up (their timing is not judged here).

Benchmarks are measured with ``dpsketch bench``, never in timed tests; this only checks that the
quick forms of the upload benches still work end to end against a real server process and that
every acknowledged report reached the server.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("which", ["upload", "sealed"])
def test_quick_upload_benches_store_every_row(which, tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "-m", "dpsketch.cli", "bench", which, "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    if which == "upload":
        bulk = figures["bulk_upload"]
        assert bulk["errors"] == 0 and bulk["server_report_count"] == bulk["n"]
        assert bulk["rows_per_s"] > 0 and 0 < bulk["ratio_to_raw_sqlite"]
        single = figures["single_upload"]
        assert single["server_report_count"] == single["acknowledged"] > 0
    else:
        up = figures["sealed_upload"]
        for mode in ("plaintext", "sealed"):
            assert up[mode]["errors"] == 0 and up[mode]["server_report_count"] == up["n"]
        # a sealed record is the plaintext one plus 57 bytes of HPKE header and tag
        assert up["sealed"]["bytes_per_report"] == pytest.approx(up["plaintext"]["bytes_per_report"] + 57)
