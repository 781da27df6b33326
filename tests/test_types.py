"""The type gate: mypy, configured in pyproject.toml ([tool.mypy]), finds nothing in the protocol
core (dpsketch/protocol, numba's kernels aside) and the client SDK (client_sdk), the two packages
that ship a py.typed marker and so promise their annotations to whoever imports them.

What is excused, and why, is listed in pyproject.toml's [[tool.mypy.overrides]] and in
docs/testing.md ("The type gate"). mypy keeps its cache in .mypy_cache: the first run on a
fresh clone takes tens of seconds (numpy's stubs), later ones a second or two.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from envguard import unavailable

ROOT = Path(__file__).resolve().parents[1]


def _mypy() -> list[str]:
    try:
        import mypy  # noqa: F401
    except ImportError:
        unavailable("mypy is not installed (pip install -e '.[test]')")
    return [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]


def test_mypy_finds_nothing_in_the_protocol_core_and_the_sdk():
    out = subprocess.run([*_mypy(), "--no-error-summary"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    # it checked what it should: both packages are in the configured files
    config = (ROOT / "pyproject.toml").read_text()
    assert 'files = ["dpsketch/protocol", "dpsketch/client_sdk"]' in config


def test_the_gate_catches_a_wrong_annotation(tmp_path):
    """The configuration really checks: a function that returns a str where it promises an int
    fails it."""
    sample = tmp_path / "sample.py"
    sample.write_text("def count() -> int:\n    return 'three'\n")
    out = subprocess.run([*_mypy(), "--cache-dir", str(tmp_path / "cache"), str(sample)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 1 and "[return-value]" in out.stdout, out.stdout + out.stderr
