"""benchmarks/mutation.py cannot rot (issue 47): its config names guards that exist, and one
mutant of the release certificate, applied by cosmic-ray in a scratch copy, is killed by a check
that the unmutated copy passes; the copy is restored afterwards and the worktree never touched.
The campaign itself (minutes to hours) is a benchmark: docs/testing.md."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("cosmic_ray")


def _harness():
    spec = importlib.util.spec_from_file_location("mutation_harness", ROOT / "benchmarks" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_config_names_guards_functions_and_tests_that_exist():
    m = _harness()
    config = m.load_config()
    names = config.operator_names()
    assert "core/ReplaceComparisonOperator_GtE_Gt" in names and "core/NumberReplacer" in names
    assert not any("Add_Pow" in n for n in names)  # one mutant per site, not cosmic-ray's dozen
    assert {g.name for g in config.guards} >= {"certificate", "calibration", "sampler", "ledger", "binding",
                                               "commit", "quotas", "floor", "sign"}
    for guard in config.guards:
        tree = ast.parse((ROOT / guard.module).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert set(guard.functions) <= defined, (guard.name, set(guard.functions) - defined)
        for test in guard.tests:
            assert (ROOT / test.split("::")[0]).is_file(), test
        assert m.mutants(guard, ROOT, names), guard.name
    for eq in config.equivalents:
        assert (ROOT / eq.module).is_file() and eq.reason.strip()
    # issue 47's hand mutants still apply: each original line occurs exactly once
    assert len(config.hand) >= 7
    for h in config.hand:
        assert (ROOT / h.module).read_text().count(h.before) == 1, (h.name, h.before)
        assert all((ROOT / t.split("::")[0]).is_file() for t in h.tests)


def test_a_certificate_mutant_is_applied_in_a_copy_killed_and_restored(tmp_path):
    m = _harness()
    config = m.load_config()
    guard = next(g for g in config.guards if g.name == "certificate")
    specs = m.mutants(guard, ROOT, config.operator_names())
    # the release rule itself: margin >= 0.0 becomes margin > 0.0
    spec = next(s for s in specs if s.operator_name.endswith("ReplaceComparisonOperator_GtE_Gt")
                and s.definition_name == "ok")
    assert m.mutated_lines(ROOT, spec) == ("return self.margin >= 0.0", "return self.margin > 0.0")
    copy = m.scratch_copy(tmp_path / "tree")
    before = {key: os.environ.get(key) for key in ("PYTHONPATH", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}
    cwd = os.getcwd()
    try:
        original = (copy / spec.module_path).read_text()
        check = (f"{sys.executable} -c \"from dpsketch.protocol.privacy import Certificate; "
                 f"assert Certificate(1, 10.0, 3, 7.0).ok\"")
        outcome, _ = m.run_tests_in(copy, check, 60)
        assert outcome.value == "survived"  # the unmutated copy passes the check
        result = m.run_mutant(copy, spec, check, 60)
        assert result.test_outcome.value == "killed", result.output
        assert "-        return self.margin >= 0.0" in result.diff
        assert (copy / spec.module_path).read_text() == original
        entry = m._entry(config, copy, guard, spec, result)
        assert entry["outcome"] == "killed" and entry["function"] == "ok"
        # the mutant's environment stays in its runs: this worker's later tests and the servers
        # they start see the environment they had (forked, not exec'd: tests/forkstart.py)
        assert {key: os.environ.get(key) for key in before} == before and os.getcwd() == cwd
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    assert "return self.margin >= 0.0" in (ROOT / spec.module_path).read_text()
