"""The newcomer's trips (issue 39), each as one clear sentence: every option of the operator's and
data owner's commands has help text; a refused connection names the URL it tried (the SDK,
``dpsketch submit``, ``dpsketch tokens``, ``dpsketch study``); a malformed cluster.json names
the offending field, never pydantic's dump; a share server whose port is taken says so and
leaves no new database behind (also when the port is taken between its check and uvicorn's bind)."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dpsketch.tools.cluster import free_port

ROOT = Path(__file__).resolve().parent.parent
STUDY_ID = "ab" * 32
TOKENS = {"DPSKETCH_OPERATOR_TOKEN": "op-" + "1" * 24, "DPSKETCH_ANALYST_TOKEN": "an-" + "2" * 24}


def _undocumented(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _undocumented(sub, f"{prefix} {name}")
        elif not action.help or action.help == argparse.SUPPRESS:
            out.append(f"{prefix} {'/'.join(action.option_strings) or action.dest}")
    return out


def test_every_option_has_help_text(monkeypatch):
    monkeypatch.setenv("DPSKETCH_DB", "unused.sqlite3")  # --db is required without it
    from dpsketch.analyzer.__main__ import build_parser as analyzer
    from dpsketch.client_sdk.cli import _parser as submit
    from dpsketch.client_sdk.relay_cli import _enrol_parser as enrol
    from dpsketch.services.__main__ import build_parser as server
    from dpsketch.services.admin import build_parser as tokens

    parsers = {"submit": submit(), "enrol": enrol(), "server": server(), "tokens": tokens(), "analyzer": analyzer()}
    assert {name: _undocumented(p, name) for name, p in parsers.items()} == {name: [] for name in parsers}


def test_a_refused_connection_names_the_url(capsys):
    from dpsketch.analyzer.client import AnalyzerClient, AnalyzerUnreachable
    from dpsketch.client_sdk import Client, ServerUnreachable
    from dpsketch.client_sdk.cli import main as submit
    from dpsketch.services.admin import main as tokens

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with AnalyzerClient(url) as an, pytest.raises(AnalyzerUnreachable) as err:
        an.progress(STUDY_ID)
    assert str(err.value) == (f"cannot reach the analyzer at {url} (--analyzer, $DPSKETCH_ANALYZER): "
                              f"connection refused (is the service running and listening on that port?)")
    with Client([url, url + "1"], max_retries=0) as client, pytest.raises(ServerUnreachable) as err:
        client.study(STUDY_ID)
    assert err.value.url == url and str(err.value).startswith(f"{url}: not reachable: connection refused")

    csv = ROOT / "README.md"  # any existing file: the study is fetched before the file is read
    assert submit(["--study", STUDY_ID, "--servers", f"{url},{url}1", "--max-retries", "0", "-q",
                   str(csv)]) == 1
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and url in line and "connection refused" in line, line
    import os

    os.environ.update(TOKENS)
    try:
        assert tokens(["--server", url, "issue", STUDY_ID, "--output", "token"]) == 1
    finally:
        for name in TOKENS:
            os.environ.pop(name, None)
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"dpsketch tokens: cannot reach {url}: connection refused"), line

    from dpsketch.analyzer.cli import main as study

    assert study(["--analyzer", url, "progress", STUDY_ID]) == 1
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and f"cannot reach the analyzer at {url}" in line, line


def test_a_malformed_cluster_configuration_names_the_field(tmp_path):
    from dpsketch.analyzer.config import ClusterConfig

    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"servers": [
        {"server_id": "s1", "url": "http://127.0.0.1:8101", "analyst_token": "a"},
        {"server_id": "s2", "analyst_token": "b"}], "api_tokn": "x"}))
    with pytest.raises(ValueError) as err:
        ClusterConfig.load(path)
    assert str(err.value) == f"{path}: servers.1.url: Field required; api_tokn: Extra inputs are not permitted"
    out = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "analyzer", "--config", str(path),
                          "--db", str(tmp_path / "a.sqlite3")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"dpsketch analyzer: cannot load the cluster configuration: {path}: "
                                  f"servers.1.url: Field required; api_tokn: Extra inputs are not permitted")
    assert "pydantic" not in out.stderr and "validation error" not in out.stderr
    path.write_text('{"servers": [')
    with pytest.raises(ValueError, match=r"cluster.json is not JSON: Expecting value: line 1"):
        ClusterConfig.load(path)
    path.write_text(json.dumps({"servers": [{"server_id": "s1", "url": "http://a", "analyst_token": "a"}]}))
    with pytest.raises(ValueError, match=r"servers: List should have at least 2 items"):
        ClusterConfig.load(path)


@pytest.mark.parametrize("race", [False, True], ids=["taken", "taken-after-the-check"])
def test_a_server_whose_port_is_taken_leaves_no_database(tmp_path, race):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    db = tmp_path / "s1.sqlite3"
    argv = ["--server-id", "s1", "--db", str(db), "--port", str(port)]
    # taken-after-the-check: the check passes (as if another process bound the port just after
    # it), so the store is created and uvicorn's bind fails; the server removes what it created
    code = ("import sys, services.__main__ as m\n"
            + ("m.check_port = lambda host, port: None\n" if race else "")
            + f"sys.exit(m.main({argv!r}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             cwd=ROOT, env={**TOKENS, "PATH": "/usr/bin:/bin"})
    finally:
        taken.close()
    assert out.returncode != 0
    if not race:
        assert out.returncode == 1 and out.stderr.strip() == (
            f"dpsketch server: cannot listen on 127.0.0.1:{port}: Address already in use (is another "
            f"server running there? choose another --port); nothing was created")
    assert sorted(p.name for p in tmp_path.iterdir()) == [], out.stderr[-2000:]
