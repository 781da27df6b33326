"""The `dpsketch` command's map of subcommands to extras agrees with pyproject.toml, and its check
reads the installed metadata (tests/test_install_client.py runs it where the extras are missing)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from dpsketch.tools import cli

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_every_extra_a_command_names_exists_and_the_client_commands_need_none():
    named = {extra for _, _, extras in cli.COMMANDS.values() for extra in extras}
    assert named <= set(EXTRAS), named - set(EXTRAS)
    assert {name for name, (_, _, extras) in cli.COMMANDS.items() if not extras} >= {"submit", "study", "tokens"}
    # the base install holds no server library: they are the server and analyzer extras'
    base = " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    for library in ("fastapi", "uvicorn", "psycopg", "prometheus-client", "numba"):
        assert library not in base and any(library in r for r in EXTRAS["server"]), library


def test_the_check_reads_the_installed_metadata():
    # this environment is the test one: every role's distributions are there
    assert cli.missing_distributions(("server", "analyzer", "research")) == []
    # an extra nobody declared requires nothing, so nothing is missing
    assert cli.missing_distributions(("no-such-extra",)) == []


def test_a_missing_library_at_run_time_is_one_line(monkeypatch, capsys):
    """If a command still meets a missing library (metadata unreadable, a stale install), the
    command says which and what to install, in one line, and exits 2."""
    def main(argv):
        raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")

    monkeypatch.setattr(cli, "missing_distributions", lambda extras: [])
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: type("M", (), {"main": staticmethod(main)}))
    assert cli.main(["server", "--server-id", "s1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'fastapi'" in err and "pip install 'dpsketch[server]'" in err, err


def test_the_research_harness_outside_a_checkout_is_one_line(monkeypatch, capsys, tmp_path):
    """research/ is not in the wheel: where this dpsketch has no checkout beside it, a research
    command says so in one line and exits 2 (tests/test_install_client.py runs it installed)."""
    assert cli.research_on_path(ROOT)  # this checkout has it
    monkeypatch.setattr(cli, "CHECKOUT", tmp_path)  # an installed wheel: no research/ beside tools/
    assert cli.main(["experiments", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dpsketch experiments: ") and "source checkout" in err, err


def test_a_demo_against_running_services_needs_no_extra(monkeypatch, capsys):
    """`dpsketch demo --analyzer URL --servers URLs` (the compose demo service, in the client image)
    starts nothing, so it asks for no extra; `dpsketch demo` alone starts a cluster and needs the
    server and analyzer extras."""
    asked = []

    def missing(extras):
        asked.append(extras)
        return ["fastapi"] if extras else []

    monkeypatch.setattr(cli, "missing_distributions", missing)
    assert cli.main(["demo", "--clients", "10"]) == 2
    assert asked == [("server", "analyzer")] and "needs the server and analyzer extras" in capsys.readouterr().err
    ran = []
    monkeypatch.setattr(cli.importlib, "import_module",
                        lambda name: type("M", (), {"main": staticmethod(lambda argv: ran.append(argv) or 0)}))
    for argv in (["--analyzer", "https://analyzer:8100", "--servers", "https://s1:8101,https://s2:8101"],
                 ["--analyzer=https://analyzer:8100", "--servers=https://s1:8101,https://s2:8101"]):
        assert cli.main(["demo", *argv]) == 0
    assert len(ran) == 2 and asked == [("server", "analyzer")]  # no extra was looked up for them
