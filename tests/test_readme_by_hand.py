"""README "Running the parts by hand" runs as written: its shell block, extracted from README.md
and run with bash over real processes (three share servers, the analyzer, the CLI) on free
ports, in a fresh directory, with a small CSV in raw units. The block reads the ports and the
directory from DPSKETCH_PORTS and WORK (with defaults) and uses a rows.csv it finds there;
nothing else is substituted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import numpy as np

from dpsketch.tools.cluster import free_ports

ROOT = Path(__file__).resolve().parent.parent
N_ROWS = 3000


def by_hand_block() -> str:
    """The first ```bash block of the README's "Running the parts by hand" section."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Running the parts by hand", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, "no bash block in README 'Running the parts by hand'"
    return match.group(1)


def test_readme_by_hand_block_runs_verbatim(tmp_path):
    block = by_hand_block()
    assert "--output id" in block and "TOKEN1=$(" in block  # ids and tokens captured, not copied
    assert "--bounds" in block  # raw units in, answers in units out
    work = tmp_path / "by-hand"
    work.mkdir()
    rng = np.random.default_rng(7)  # test data in raw units, as a data owner's file would be
    age, hours = rng.uniform(18, 65, N_ROWS), rng.uniform(10, 50, N_ROWS)
    wage = 505 + 30 * age + 20 * hours + rng.normal(0, 300, N_ROWS)
    np.savetxt(work / "rows.csv", np.column_stack([age, hours, wage]), delimiter=",", fmt="%.2f",
               header="age,hours,wage", comments="")
    ports = free_ports(4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPSKETCH_")}
    env.update({"DPSKETCH_PORTS": " ".join(map(str, ports)), "WORK": str(work), "HOME": str(tmp_path),
                "PATH": "/usr/local/bin:/usr/bin:/bin"})  # a fresh shell: no .venv on PATH yet
    script = tmp_path / "by-hand.sh"
    script.write_text("set -euo pipefail\n" + block)
    proc = subprocess.Popen(["bash", str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the block left running
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    # the submit stored every row at every server, the study was finalized and analysed
    assert f"submitted {N_ROWS} rows of rows.csv to 3 servers" in out, out[-3000:]
    docs = _json_documents(out)
    finalized = next(d for d in docs if "n_reports" in d and d.get("state") == "released")
    assert finalized["n_reports"] == N_ROWS
    # ridge and PCA as tables, in the data's units, with the intercept and intervals
    assert "in the data's units" in out and "(intercept)" in out and "95% interval" in out, out[-3000:]
    assert "PC1" in out and "mean" in out, out[-3000:]
    # the journal went to the (test's) home directory, its key deleted once every row was stored
    (journal,) = (tmp_path / ".dpsketch" / "submissions").glob("*.json")
    assert json.loads(journal.read_text().splitlines()[0])["key"] is None


def _json_documents(text: str) -> list[dict]:
    """The JSON objects the commands printed one after another."""
    decoder, docs, i = json.JSONDecoder(), [], 0
    while (start := text.find("{", i)) != -1:
        try:
            doc, end = decoder.raw_decode(text, start)
        except ValueError:
            i = start + 1
            continue
        if isinstance(doc, dict):
            docs.append(doc)
        i = end
    return docs
