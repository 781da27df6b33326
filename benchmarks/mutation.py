"""Mutation testing of the privacy and integrity guards with cosmic-ray (docs/testing.md).

Why. The suite asserts what it checks honestly, but a guard (the release certificate, the batch
rule, the sampler, the ledger, ...) can still be broken by a one-line change that no test
notices: issue 47 found 8 such mutants by hand. This script makes that check routine: it mutates
exactly the guard functions listed in ``benchmarks/mutation.toml`` with cosmic-ray's operators
and runs each mutant against the test files that cover its guard. A mutant is killed when those
tests fail (or hang past the timeout); a survivor is a change of a guard that no test sees.

How. The tree's tracked files are copied to a scratch directory (the worktree is never
touched); each mutant is applied there by cosmic-ray (``mutate_and_test``), the guard's tests run
with ``PYTHONPATH`` on the copy (``pytest -x``), and the file is restored. Results go to one
cosmic-ray session database per guard under ``--sessions`` (``cr-report FILE`` reads them) and to
a JSON summary. Mutants listed as equivalent in the config are reported apart, with the reason.

    .venv/bin/python benchmarks/mutation.py                 # a sample of 8 mutants (minutes)
    .venv/bin/python benchmarks/mutation.py --sample 40 --seed 3
    .venv/bin/python benchmarks/mutation.py --full --sessions /tmp/mut --json /tmp/mut/summary.json
    .venv/bin/python benchmarks/mutation.py --list --full   # what would run, without running it
    .venv/bin/python benchmarks/mutation.py --full --guard commit --resume --sessions /tmp/mut

``--sample N`` draws N mutants at random (``--seed``) over all guards; ``--full`` runs every one.
``--resume`` keeps the results already in the session databases and runs only what is pending.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = Path(__file__).with_suffix(".toml")


@dataclass(frozen=True)
class Guard:
    name: str
    module: str
    functions: tuple[str, ...]
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Equivalent:
    module: str
    before: str  # the original line, stripped
    after: str  # the mutated line, stripped
    reason: str


@dataclass(frozen=True)
class Hand:
    """A mutant written by hand (issue 47's survivors): ``before`` replaced by ``after`` once."""

    name: str
    module: str
    before: str
    after: str
    tests: tuple[str, ...]


@dataclass
class Config:
    operators: list[str]
    timeout: float
    guards: list[Guard]
    equivalents: list[Equivalent] = field(default_factory=list)
    hand: list[Hand] = field(default_factory=list)

    def operator_names(self) -> list[str]:
        import cosmic_ray.plugins

        patterns = [re.compile(p) for p in self.operators]
        return sorted(n for n in cosmic_ray.plugins.operator_names() if any(p.search(n) for p in patterns))


def load_config(path: Path = CONFIG) -> Config:
    raw = tomllib.loads(path.read_text())
    guards = [Guard(g["name"], g["module"], tuple(g["functions"]), tuple(g["tests"])) for g in raw["guard"]]
    equivalents = [Equivalent(e["module"], e["before"].strip(), e["after"].strip(), e["reason"])
                   for e in raw.get("equivalent", [])]
    hand = [Hand(h["name"], h["module"], h["before"], h["after"], tuple(h["tests"])) for h in raw.get("hand", [])]
    return Config(list(raw["operators"]), float(raw.get("timeout", 240)), guards, equivalents, hand)


def run_hand(config: Config, copy: Path, log=print) -> list[dict]:
    """Each hand mutant applied in the copy (its ``before`` must occur exactly once), its tests
    run, the file restored: the outcome and the test that killed it."""
    out = []
    for h in config.hand:
        path = copy / h.module
        original = path.read_text()
        if original.count(h.before) != 1:
            raise SystemExit(f"hand mutant {h.name!r}: {h.before!r} occurs {original.count(h.before)} times "
                             f"in {h.module}, not once")
        for pyc in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
            pyc.unlink()
        try:
            path.write_text(original.replace(h.before, h.after))
            t0 = time.monotonic()
            outcome, output = run_tests_in(copy, test_command(Guard(h.name, h.module, (), h.tests)), config.timeout)
        finally:
            path.write_text(original)
        killed = outcome.value != "survived"
        entry = {"name": h.name, "module": h.module, "outcome": "killed" if killed else "survived",
                 "killed_by": _failing_test(output) if killed else None}
        log(f"hand: {h.name}: {entry['outcome']} ({entry['killed_by']}) in {time.monotonic() - t0:.0f}s")
        out.append(entry)
    return out


# --- mutants ------------------------------------------------------------------------------------


def _enclosing(node) -> list[str]:
    """Names of every function and class around a parso node, innermost first."""
    import parso

    names = []
    obj = node.parent
    while obj is not None:
        if isinstance(obj, (parso.python.tree.Function, parso.python.tree.Class)) and \
                not isinstance(obj, parso.python.tree.Lambda):
            names.append(obj.name.value)
        obj = obj.parent
    return names


def mutants(guard: Guard, root: Path, operator_names: list[str]):
    """cosmic-ray MutationSpecs of every mutation site inside the guard's functions. The
    occurrence index counts every site of the operator in the module, as cosmic-ray's own
    ``init`` does, so that ``mutate_and_test`` finds the same site."""
    import cosmic_ray.plugins
    from cosmic_ray.ast import ast_nodes, get_ast_from_path
    from cosmic_ray.work_item import MutationSpec

    path = root / guard.module
    module_ast = get_ast_from_path(path)
    wanted = set(guard.functions)
    out = []
    for name in operator_names:
        operator = cosmic_ray.plugins.get_operator(name)()
        positions = ((node, start, end) for node in ast_nodes(module_ast)
                     for start, end in operator.mutation_positions(node))
        for occurrence, (node, start, end) in enumerate(positions):
            chain = _enclosing(node)
            if wanted.isdisjoint(chain):
                continue
            if _in_docstring_or_message(node) or _in_annotation(node):
                continue
            out.append(MutationSpec(module_path=str(guard.module), operator_name=name, occurrence=occurrence,
                                    start_pos=start, end_pos=end, definition_name=chain[0] if chain else None))
    return out


def _in_annotation(node) -> bool:
    """Type annotations are not code here (every guard module has ``from __future__ import
    annotations``): a parameter's, a return's or a variable's annotation."""
    child, obj = node, node.parent
    while obj is not None:
        kind = getattr(obj, "type", None)
        if kind == "tfpdef" and child is not obj.children[0]:
            return True
        if kind == "funcdef" and any(getattr(c, "value", None) == "->" for c in obj.children):
            arrow = [i for i, c in enumerate(obj.children) if getattr(c, "value", None) == "->"][0]
            if child is obj.children[arrow + 1]:
                return True
        if kind == "annassign" and child is obj.children[1]:
            return True
        if kind == "param":
            break
        child, obj = obj, obj.parent
    return False


def _in_docstring_or_message(node) -> bool:
    """Numbers inside f-strings (error texts) are not guards."""
    obj = node
    while obj is not None:
        if getattr(obj, "type", None) in ("fstring", "string"):
            return True
        obj = obj.parent
    return False


def mutated_lines(root: Path, spec) -> tuple[str, str]:
    """(original line, mutated line) at the mutant's site: how the config names an equivalent."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    source = (root / spec.module_path).read_text()
    operator = cosmic_ray.plugins.get_operator(spec.operator_name)()
    mutated = mutate_code(source, operator, spec.occurrence)
    line = spec.start_pos[0] - 1
    before = source.splitlines()[line].strip()
    after = mutated.splitlines()[line].strip() if mutated is not None else before
    return before, after


# --- the scratch tree ------------------------------------------------------------------------


def scratch_copy(dest: Path | None = None) -> Path:
    """The worktree's tracked files (and uncommitted edits to them) in a fresh directory, with
    their mtimes (numba's on-disk cache stays valid where a file is not mutated)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    dest = Path(tempfile.mkdtemp(prefix="dpsketch-mutation-")) if dest is None else dest
    for rel in files.decode().split("\0"):
        if not rel:
            continue
        src = ROOT / rel
        if not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    # numba's on-disk cache of the compiled loops (keyed by the source's mtime and size, which
    # copy2 kept): each copy would otherwise compile them again (tens of CPU-seconds)
    for cached in ROOT.glob("*/**/__pycache__/*.nb[ic]"):
        rel = cached.relative_to(ROOT)
        if rel.parts[0] in (".venv", ".git"):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cached, target)
    # untracked new test files of this worktree count too (a guard's tests may be new)
    for extra in (ROOT / "tests").glob("test_guards_*.py"):
        if not (dest / "tests" / extra.name).exists():
            shutil.copy2(extra, dest / "tests" / extra.name)
    return dest


def test_command(guard: Guard, python: str = sys.executable) -> str:
    tests = " ".join(guard.tests)
    return (f"{python} -m pytest -x -q -p no:cacheprovider -p no:randomly -o addopts= "
            f"-W ignore::DeprecationWarning {tests}")


#: pytest's plugins from entry points (schemathesis, hypothesis, xdist, ...) are not loaded for a
#: mutant's run: no guard test needs them, and loading them was half of each run's start
_ENV = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


@contextlib.contextmanager
def _in_copy(copy: Path):
    """Run inside the copy: its directory, its tree first on PYTHONPATH (before the editable
    install's finder, and in the processes the tests start) and _ENV; on exit each variable is
    as it was (a test that ran a mutant once left plugin autoloading off for every later test of
    its worker, so every server those started was exec'd, not forked: tests/forkstart.py)."""
    old_cwd = os.getcwd()
    saved = {key: os.environ.get(key) for key in ("PYTHONPATH", *_ENV)}
    os.chdir(copy)
    os.environ["PYTHONPATH"] = str(copy)
    os.environ.update(_ENV)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_tests_in(copy: Path, command: str, timeout: float):
    """cosmic-ray's test runner, in the copy (:func:`_in_copy`)."""
    from cosmic_ray.testing import run_tests

    with _in_copy(copy):
        return run_tests(command, timeout)


def run_mutant(copy: Path, spec, command: str, timeout: float):
    """Apply one mutant in the copy, run the tests, restore: a cosmic-ray WorkResult."""
    from cosmic_ray.mutating import mutate_and_test

    with _in_copy(copy):
        # a pyc compiled from the original could be taken for the mutant if both have the same
        # size and the same mtime second: no bytecode of the mutated module may exist
        for pyc in (copy / spec.module_path).parent.glob(f"__pycache__/{Path(spec.module_path).stem}.*.pyc"):
            pyc.unlink()
        return mutate_and_test([spec], command, timeout)


# --- a campaign ------------------------------------------------------------------------------


def equivalent_reason(config: Config, module: str, before: str, after: str) -> str | None:
    for e in config.equivalents:
        if e.module == module and e.before == before and e.after == after:
            return e.reason
    return None


def campaign(config: Config, guards: list[Guard], sample: int | None, seed: int, sessions: Path,
             resume: bool, copy: Path, log=print, on_guard=None, retry_survivors: bool = False,
             report_only: bool = False, shard: tuple[int, int] | None = None,
             survivors_only: bool = False, check_first: bool = False) -> dict:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkItem, WorkResult

    operator_names = config.operator_names()
    plan = {g.name: mutants(g, copy, operator_names) for g in guards}
    chosen: dict[str, set[int]] = {g.name: set(range(len(plan[g.name]))) for g in guards}
    if sample is not None:
        every = [(g.name, i) for g in guards for i in range(len(plan[g.name]))]
        picked = random.Random(seed).sample(every, min(sample, len(every)))
        chosen = {g.name: {i for name, i in picked if name == g.name} for g in guards}
    sessions.mkdir(parents=True, exist_ok=True)
    summary = {"sample": sample, "seed": seed, "guards": {}, "mutants": []}
    started = time.monotonic()
    for guard in guards:
        specs = plan[guard.name]
        command = test_command(guard)
        db_path = sessions / (f"{guard.name}.sqlite" if shard is None
                              else f"{guard.name}.shard{shard[0]}of{shard[1]}.sqlite")
        if db_path.exists() and not (resume or report_only):
            db_path.unlink()
        prior = {}  # a sharded run reuses what an unsharded run of the guard already has
        if shard is not None and resume and (sessions / f"{guard.name}.sqlite").exists():
            with use_db(str(sessions / f"{guard.name}.sqlite"), WorkDB.Mode.open) as old:
                items = {it.job_id: it.mutations[0] for it in old.work_items}
                prior = {(items[j].operator_name, items[j].occurrence): r for j, r in old.results if j in items}
        with use_db(str(db_path), WorkDB.Mode.create) as db:
            existing = {(it.mutations[0].operator_name, it.mutations[0].occurrence): it.job_id for it in db.work_items}
            for i, spec in enumerate(specs):
                key = (spec.operator_name, spec.occurrence)
                if key not in existing:
                    item = WorkItem.single(job_id=f"{guard.name}-{i}-{spec.operator_name}-{spec.occurrence}",
                                           mutation=spec)
                    db.add_work_item(item)
                    existing[key] = item.job_id
            ran = {job_id for job_id, _ in db.results}
            done = {job_id for job_id, result in db.results
                    if not (retry_survivors and result.test_outcome is not None
                            and result.test_outcome.value == "survived")}
            counts = {"mutants": len(specs), "run": 0, "killed": 0, "survived": 0, "equivalent": 0,
                      "incompetent": 0}
            # a random order (fixed by the seed), so that a run stopped early has run a random
            # sample of the guard's mutants, not its first operators
            order = sorted(chosen[guard.name], key=lambda i: random.Random(f"{seed}/{guard.name}/{i}").random())
            if shard is not None:
                order = [i for i in order if i % shard[1] == shard[0]]
            if retry_survivors:  # what survived before first (stable: the rest keeps its order)
                survived = {key for key, r in prior.items() if r.test_outcome is not None
                            and r.test_outcome.value == "survived"}
                survived |= {(it.mutations[0].operator_name, it.mutations[0].occurrence)
                             for it in db.work_items if it.job_id in ran and it.job_id not in done}
                order.sort(key=lambda i: (specs[i].operator_name, specs[i].occurrence) not in survived)
            checked = not check_first
            for i in order:
                spec = specs[i]
                if not checked and existing[(spec.operator_name, spec.occurrence)] not in done \
                        and not report_only:
                    # the guard's tests must pass unmutated, else every mutant would look killed
                    baseline(copy, [guard], config.timeout, log=log)
                    checked = True
                job_id = existing[(spec.operator_name, spec.occurrence)]
                if job_id not in done and (spec.operator_name, spec.occurrence) in prior:
                    result = prior[(spec.operator_name, spec.occurrence)]
                    if not (retry_survivors and result.test_outcome is not None
                            and result.test_outcome.value == "survived"):
                        db.set_result(job_id, result)
                        done.add(job_id)
                if job_id in done:
                    result = dict(db.results)[job_id]
                elif report_only or (survivors_only and job_id not in ran
                                     and (spec.operator_name, spec.occurrence) not in prior):
                    continue
                else:
                    t0 = time.monotonic()
                    result = run_mutant(copy, spec, command, config.timeout)
                    if result.worker_outcome == WorkerOutcome.NO_TEST:
                        result = WorkResult(worker_outcome=WorkerOutcome.NO_TEST)
                    db.set_result(job_id, result)
                    log(f"[{time.monotonic() - started:7.0f}s] {guard.name} {spec.operator_name.split('/')[-1]} "
                        f"line {spec.start_pos[0]} ({spec.definition_name}): "
                        f"{result.test_outcome.value if result.test_outcome else result.worker_outcome.value}"
                        f" in {time.monotonic() - t0:.0f}s")
                entry = _entry(config, copy, guard, spec, result)
                summary["mutants"].append(entry)
                if entry["outcome"] == "no-mutation":
                    continue
                counts["run"] += 1
                counts[entry["outcome"]] += 1
        summary["guards"][guard.name] = counts
        if on_guard is not None:
            on_guard(summary)
    summary["totals"] = _totals(summary)
    summary["seconds"] = round(time.monotonic() - started, 1)
    return summary


def merged_report(config: Config, guards: list[Guard], sessions: Path) -> dict:
    """The results in every session file of ``sessions`` (a guard's own and its shards'; a shard's
    result, being the later run, wins), summarised as ``campaign`` does; nothing is run."""
    from cosmic_ray.work_db import WorkDB, use_db

    summary = {"sample": None, "guards": {}, "mutants": []}
    names = config.operator_names()
    for guard in guards:
        results = {}
        files = [sessions / f"{guard.name}.sqlite"] + sorted(sessions.glob(f"{guard.name}.shard*.sqlite"))
        for path in files:
            if not path.exists():
                continue
            with use_db(str(path), WorkDB.Mode.open) as db:
                items = {it.job_id: it.mutations[0] for it in db.work_items}
                for job_id, result in db.results:
                    if job_id in items:
                        results[(items[job_id].operator_name, items[job_id].occurrence)] = result
        specs = mutants(guard, ROOT, names)
        counts = {"mutants": len(specs), "run": 0, "killed": 0, "survived": 0, "equivalent": 0, "incompetent": 0}
        for spec in specs:
            result = results.get((spec.operator_name, spec.occurrence))
            if result is None:
                continue
            entry = _entry(config, ROOT, guard, spec, result)
            summary["mutants"].append(entry)
            if entry["outcome"] == "no-mutation":
                continue
            counts["run"] += 1
            counts[entry["outcome"]] += 1
        summary["guards"][guard.name] = counts
    summary["totals"] = _totals(summary)
    summary["seconds"] = 0.0
    return summary


def _totals(summary: dict) -> dict:
    """Every guard's counts summed, with the score: killed over the mutants judged (run, less
    the equivalent and the incompetent ones)."""
    totals = {k: sum(c[k] for c in summary["guards"].values())
              for k in ("mutants", "run", "killed", "survived", "equivalent", "incompetent")}
    judged = totals["run"] - totals["equivalent"] - totals["incompetent"]
    totals["score"] = totals["killed"] / judged if judged else None
    return totals


def _entry(config: Config, copy: Path, guard: Guard, spec, result) -> dict:
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    before, after = mutated_lines(copy, spec)
    entry = {"guard": guard.name, "module": guard.module, "function": spec.definition_name,
             "operator": spec.operator_name, "occurrence": spec.occurrence, "line": spec.start_pos[0],
             "before": before, "after": after}
    if result.worker_outcome in (WorkerOutcome.NO_TEST, WorkerOutcome.SKIPPED):
        entry["outcome"] = "no-mutation"
    elif result.worker_outcome == WorkerOutcome.EXCEPTION:
        entry["outcome"] = "incompetent"
        entry["output"] = (result.output or "")[-2000:]
    elif result.test_outcome == TestOutcome.SURVIVED:
        reason = equivalent_reason(config, guard.module, before, after)
        entry["outcome"] = "equivalent" if reason else "survived"
        if reason:
            entry["reason"] = reason
    else:
        entry["outcome"] = "killed"
        entry["killed_by"] = _failing_test(result.output or "")
    return entry


def _failing_test(output: str) -> str | None:
    """The first failing test pytest names ('FAILED tests/x.py::name'), or what stopped the run."""
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if m:
        return m.group(1)
    return "timeout" if output.strip() == "timeout" else "(collection or import error)"


def baseline(copy: Path, guards: list[Guard], timeout: float, log=print) -> dict[str, float]:
    """Each guard's tests on the unmutated copy: they must pass (else every mutant would look
    killed); their times bound a campaign's."""
    times = {}
    for guard in guards:
        t0 = time.monotonic()
        outcome, output = run_tests_in(copy, test_command(guard), timeout)
        times[guard.name] = round(time.monotonic() - t0, 1)
        if outcome.value != "survived":
            raise SystemExit(f"the tests of guard {guard.name} fail without a mutant:\n{output[-3000:]}")
        log(f"baseline {guard.name}: passed in {times[guard.name]} s")
    return times


def warm(copy: Path) -> None:
    """numba's loops compiled once into the copy's cache (else the first mutants pay it)."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    subprocess.run([sys.executable, "-c", "from dpsketch.services.store import warm_kernels; warm_kernels()"],
                   cwd=copy, env=env, check=False, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--sample", type=int, default=8, help="mutants drawn at random over all guards (default 8)")
    size.add_argument("--full", action="store_true", help="every mutant of every guard chosen")
    ap.add_argument("--seed", type=int, default=None, help="the sample's seed (default: random, printed)")
    ap.add_argument("--guard", action="append", help="only this guard (repeatable; run in the order given)")
    ap.add_argument("--sessions", type=Path, default=None, help="directory of the cosmic-ray session files")
    ap.add_argument("--resume", action="store_true", help="keep results already in the session files")
    ap.add_argument("--retry-survivors", action="store_true",
                    help="with --resume: run the mutants that survived again (after new tests)")
    ap.add_argument("--survivors-only", action="store_true",
                    help="with --retry-survivors: run nothing that has not run before")
    ap.add_argument("--report", action="store_true",
                    help="summarise the results in --sessions (with --resume), run nothing")
    ap.add_argument("--shard", default=None, help="I/N: only the mutants whose index is I mod N (run N "
                    "processes with separate --sessions to share a guard)")
    ap.add_argument("--hand", action="store_true", help="run issue 47's hand mutants ([[hand]]) only")
    ap.add_argument("--markdown", type=Path, default=None, help="write the summary's tables here (markdown)")
    ap.add_argument("--json", type=Path, default=None, help="write the summary here")
    ap.add_argument("--list", action="store_true", help="list the mutants chosen, run nothing")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the unmutated run of a guard's tests before its first mutant")
    args = ap.parse_args(argv)

    config = load_config()
    by_name = {g.name: g for g in config.guards}
    guards = [by_name[n] for n in args.guard if n in by_name] if args.guard else config.guards
    if args.guard and len(guards) != len(set(args.guard)):
        ap.error(f"unknown guard among {args.guard}; known: {[g.name for g in config.guards]}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    sample = None if args.full else args.sample
    if args.list:
        names = config.operator_names()
        total = 0
        for g in guards:
            specs = mutants(g, ROOT, names)
            total += len(specs)
            print(f"{g.name:18s} {len(specs):4d} mutants in {g.module} ({', '.join(g.functions)})")
        print(f"{'total':18s} {total:4d}")
        return 0
    if args.report:
        if args.sessions is None:
            ap.error("--report reads --sessions")
        summary = merged_report(config, guards, args.sessions)
        return _print_summary(summary, args.json, args.markdown)
    copy = scratch_copy()
    sessions = args.sessions or copy / ".mutation-sessions"
    print(f"scratch tree {copy}; sessions in {sessions}; sample {sample} (seed {seed})", flush=True)
    try:
        if not args.report:
            warm(copy)
        if args.hand:
            results = run_hand(config, copy, log=lambda s: print(s, flush=True))
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
            return 1 if any(r["outcome"] == "survived" for r in results) else 0
        def partial(summary):  # what is done so far, for a long run's reader
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({**summary, "partial": True}, indent=1))

        summary = campaign(config, guards, sample, seed, sessions, args.resume, copy,
                           log=lambda s: print(s, flush=True), on_guard=partial,
                           retry_survivors=args.retry_survivors, report_only=args.report,
                           shard=tuple(int(x) for x in args.shard.split("/")) if args.shard else None,
                           survivors_only=args.survivors_only, check_first=not args.no_baseline)
    finally:
        if args.sessions is not None:
            shutil.rmtree(copy, ignore_errors=True)
    return _print_summary(summary, args.json, args.markdown)


def markdown(summary: dict) -> str:
    """The summary as the tables of docs/testing.md: per guard, and the tests that killed."""
    from collections import Counter

    rows = ["| guard | mutants | run | killed | survived | equivalent | killed / (run - equivalent) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, c in summary["guards"].items():
        judged = c["run"] - c["equivalent"] - c["incompetent"]
        score = f"{c['killed'] / judged:.1%}" if judged else "-"
        rows.append(f"| {name} | {c['mutants']} | {c['run']} | {c['killed']} | {c['survived']} | "
                    f"{c['equivalent']} | {score} |")
    t = summary["totals"]
    score = f"{t['score']:.1%}" if t["score"] is not None else "-"
    rows.append(f"| **all** | {t['mutants']} | {t['run']} | {t['killed']} | {t['survived']} | "
                f"{t['equivalent']} | **{score}** |")
    killers = Counter((m["guard"], (m.get("killed_by") or "").split("::")[0]) for m in summary["mutants"]
                      if m["outcome"] == "killed")
    rows += ["", "| guard | test file | mutants it killed first |", "|---|---|---:|"]
    for (guard, test), n in sorted(killers.items(), key=lambda kv: (kv[0][0], -kv[1])):
        rows.append(f"| {guard} | `{test}` | {n} |")
    survivors = [m for m in summary["mutants"] if m["outcome"] == "survived"]
    if survivors:
        rows += ["", "| survivor | line | original | mutant |", "|---|---:|---|---|"]
        for m in survivors:
            rows.append(f"| {m['guard']} ({m['function']}) | {m['module']}:{m['line']} | `{m['before']}` | "
                        f"`{m['after']}` |")
    return "\n".join(rows) + "\n"


def _print_summary(summary: dict, json_path: Path | None, markdown_path: Path | None = None) -> int:
    if markdown_path:
        markdown_path.write_text(markdown(summary))
    print(json.dumps({"guards": summary["guards"], "totals": summary["totals"], "seconds": summary["seconds"]},
                     indent=1))
    for m in summary["mutants"]:
        if m["outcome"] in ("survived", "incompetent"):
            print(f"{m['outcome'].upper()}: {m['guard']} {m['module']}:{m['line']} ({m['function']}) "
                  f"{m['before']!r} -> {m['after']!r}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(summary, indent=1))
    return 1 if summary["totals"]["survived"] else 0


if __name__ == "__main__":
    sys.exit(main())
