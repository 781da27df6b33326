"""The lint gate: ruff with the rules in pyproject.toml ([tool.ruff.lint]) finds nothing.

The rules are few on purpose (names used but never defined, or defined and never used; syntax
errors; bugbear's likely mistakes). Two tests once computed a value and asserted nothing about
it, and an unused variable was the only sign; this gate catches that before review does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from envguard import unavailable

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> str:
    found = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(found).exists():
        unavailable("ruff is not installed (pip install -e '.[test]')")
    return found


def test_ruff_finds_nothing():
    out = subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_gate_catches_a_test_that_asserts_nothing(tmp_path):
    """The configuration really has the rule: a test that computes and checks nothing fails it."""
    sample = tmp_path / "test_sample.py"
    sample.write_text("def test_computes_and_checks_nothing():\n    bound = 1 + 1\n")
    out = subprocess.run([_ruff(), "check", "--no-cache", "--output-format", "concise",
                          "--config", str(ROOT / "pyproject.toml"), str(sample)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "F841" in out.stdout, out.stdout + out.stderr
