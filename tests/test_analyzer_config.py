"""The analyzer's cluster configuration with its tokens in files (analyst_token_file,
api_token_file): what docker compose hands over as secret files, so no token is in a container's
environment. Unit checks of the model, then a real analyzer process over real share servers whose
configuration holds no token at all."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from pydantic import ValidationError

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.analyzer.config import ClusterConfig
from dpsketch.protocol import ProblemError
from dpsketch.tools.cluster import analyzer


def _config(**top) -> dict:
    return {"servers": [{"server_id": "s1", "url": "http://a:1", "analyst_token": "an-1"},
                        {"server_id": "s2", "url": "http://b:1", "analyst_token": "an-2"}], **top}


def test_tokens_are_read_from_files_and_stripped(tmp_path):
    (tmp_path / "s2").write_text("an-from-file\n")
    (tmp_path / "api").write_text("  api-from-file \n")
    raw = _config(api_token_file=str(tmp_path / "api"))
    raw["servers"][1] = {"server_id": "s2", "url": "http://b:1", "analyst_token_file": str(tmp_path / "s2")}
    config = ClusterConfig.model_validate(raw)
    assert [s.analyst_token for s in config.servers] == ["an-1", "an-from-file"]
    assert config.api_token == "api-from-file"
    # the same from a --config file
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(raw))
    assert ClusterConfig.load(path).api_token == "api-from-file"


@pytest.mark.parametrize("change, message", [
    ({"analyst_token_file": "MISSING"}, "cannot read the token file"),  # a path that is not there
    ({"analyst_token_file": "EMPTY"}, "is empty"),
    ({"analyst_token": "x", "analyst_token_file": "EMPTY"}, "not both"),
    ({"analyst_token": None}, "analyst_token is missing"),
])
def test_a_token_file_that_cannot_serve_is_refused(tmp_path, change, message):
    (tmp_path / "EMPTY").write_text(" \n")
    raw = _config()
    server = {k: v for k, v in raw["servers"][0].items() if k != "analyst_token"}
    for key, value in change.items():
        if value is not None:
            server[key] = str(tmp_path / value) if key.endswith("_file") else value
    raw["servers"][0] = server
    with pytest.raises(ValidationError, match=message):
        ClusterConfig.model_validate(raw)


def test_api_token_inline_and_in_a_file_is_refused(tmp_path):
    (tmp_path / "api").write_text("a")
    with pytest.raises(ValidationError, match="not both"):
        ClusterConfig.model_validate(_config(api_token="b", api_token_file=str(tmp_path / "api")))
    assert ClusterConfig.model_validate(_config()).api_token is None  # optional, as before


def test_analyzer_with_token_files_over_real_servers(servers, tmp_path):
    """The configuration names files only; the analyzer serves its API with the file's token
    and reaches the servers with theirs (a study is provisioned on both)."""
    procs, entries, specs = [], [], []
    for j in (1, 2):
        spec = servers.spec(f"s{j}")
        specs.append(spec)
        procs.append(servers.start(spec))
        token_file = tmp_path / f"s{j}.analyst"
        token_file.write_text(spec.analyst_token + "\n")
        entries.append({"server_id": spec.server_id, "url": procs[-1].url, "analyst_token_file": str(token_file)})
    (tmp_path / "api.token").write_text("api-" + "7" * 20)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"servers": entries, "api_token_file": str(tmp_path / "api.token")}))
    text = path.read_text()
    assert "api-7777" not in text and not any(s.analyst_token in text for s in specs)
    proc = analyzer(path, tmp_path / "analyzer.sqlite3", tmp_path).start()
    servers.started.append(proc)
    assert httpx.get(f"{proc.url}/v1/studies", timeout=30).status_code == 401
    with AnalyzerClient(proc.url, "api-" + "7" * 20) as an:
        view = an.create_study(name="files", columns=["x", "y"], label="y", expected_reports=5000)
        study_id = view["study_id"]
    for p in procs:  # provisioned on each server with the analyst token read from its file
        assert httpx.get(f"{p.url}/v1/studies/{study_id}", timeout=30).status_code == 200
    with AnalyzerClient(proc.url, "wrong") as an, pytest.raises(ProblemError) as refused:
        an.studies()
    assert refused.value.status == 401


def test_analyzer_refuses_to_start_on_an_unreadable_token_file(tmp_path):
    path = tmp_path / "cluster.json"
    raw = _config()
    raw["servers"][0] = {"server_id": "s1", "url": "http://a:1", "analyst_token_file": str(tmp_path / "gone")}
    path.write_text(json.dumps(raw))
    out = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "analyzer", "--config", str(path),
                          "--db", str(tmp_path / "a.sqlite3")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "cannot load the cluster configuration" in out.stderr and str(tmp_path / "gone") in out.stderr
    assert not (tmp_path / "a.sqlite3").exists()

