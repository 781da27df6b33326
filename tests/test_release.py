"""The version scheme (docs/install.md, "Versions and releases"): one version, read everywhere
from dpsketch.__version__, and scripts/release.sh, which tags a release only when the tree and
the change log agree on it.

The script runs for real in a scratch git repository holding its own copy and the two files it
reads, so the checkout's tags are never touched."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

import dpsketch
from envguard import unavailable
from dpsketch.tools import cli

ROOT = Path(__file__).resolve().parents[1]
VERSION_LINE = re.compile(r'^__version__ = "(.*)"$', re.M)


def test_one_version_read_everywhere(capsys):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dpsketch.__version__"}
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"dpsketch {dpsketch.__version__}\n"
    # PEP 440; between releases the next release's number with .dev0, and the change log has
    # that release's section (undated until it is released)
    match = re.fullmatch(r"(\d+\.\d+\.\d+)((a|b|rc)\d+)?(\.dev\d+)?", dpsketch.__version__)
    assert match, dpsketch.__version__
    assert re.search(rf"^## {re.escape(match.group(1))} \(", (ROOT / "CHANGELOG.md").read_text(), re.M)


def test_the_share_servers_report_that_version(tmp_path):
    from fastapi.testclient import TestClient

    from dpsketch.services.app import create_app
    from dpsketch.services.settings import Settings

    app = create_app(Settings(server_id="s1", db_path=tmp_path / "s1.sqlite3", operator_token="op-" + "1" * 16,
                              analyst_token="an-" + "2" * 16))
    with TestClient(app) as client:
        assert client.get("/v1/info").json()["version"] == dpsketch.__version__
        assert client.get("/openapi.json").json()["info"]["version"] == dpsketch.__version__


CHANGELOG = """# Changelog

## 1.3.0 (unreleased)

- next things

## 1.2.0 ({date})

### A heading the tag keeps
- a change

## 1.1.0 (2026-01-01)

- older
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    """A repository at version 1.2.0 with a dated change log: ready to tag."""
    if shutil.which("git") is None:
        unavailable("no git on this machine")  # skips a developer's machine, fails in CI
    (tmp_path / "scripts").mkdir()
    (tmp_path / "dpsketch").mkdir()
    shutil.copy2(ROOT / "scripts" / "release.sh", tmp_path / "scripts" / "release.sh")
    (tmp_path / "dpsketch" / "__init__.py").write_text('"""x"""\n\n__version__ = "1.2.0"\n')
    (tmp_path / "CHANGELOG.md").write_text(CHANGELOG.format(date="2026-11-29"))
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@example.org", "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-q", "-m", "1.2.0")
    return tmp_path


def _release(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "scripts" / "release.sh"), *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(repo), "GIT_AUTHOR_NAME": "t",
                               "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@example.org"}, timeout=60)


def test_release_tags_an_annotated_tag_with_the_change_log_section(repo):
    checked = _release(repo, "--check", "1.2.0")
    assert checked.returncode == 0, checked.stderr
    assert _git(repo, "tag") == ""  # --check tags nothing
    done = _release(repo, "1.2.0")
    assert done.returncode == 0, done.stderr
    assert _git(repo, "cat-file", "-t", "v1.2.0").strip() == "tag"  # annotated, not lightweight
    assert _git(repo, "rev-parse", "v1.2.0^{commit}") == _git(repo, "rev-parse", "HEAD")
    message = _git(repo, "tag", "-l", "--format=%(contents)", "v1.2.0")
    assert message.startswith("dpsketch 1.2.0\n\n### A heading the tag keeps\n- a change")
    assert "next things" not in message and "older" not in message
    again = _release(repo, "1.2.0")
    assert again.returncode == 1 and "exists already" in again.stderr


@pytest.mark.parametrize("change, version, says", [
    (None, "1.2.0.dev0", "not a release number"),
    (None, "1.2", "not a release number"),
    (None, "1.3.0", 'says __version__ = "1.2.0", not "1.3.0"'),
    (("CHANGELOG.md", CHANGELOG.format(date="unreleased")), "1.2.0", "is not dated"),
    (("CHANGELOG.md", CHANGELOG.replace("## 1.2.0 ({date})", "## 1.2.1 (2026-11-29)")), "1.2.0", "no section"),
    (("dpsketch/__init__.py", '__version__ = "1.2.0"\n# an uncommitted edit\n'), "1.2.0", "uncommitted"),
])
def test_release_refuses_what_does_not_agree(repo, change, version, says):
    if change is not None:
        (repo / change[0]).write_text(change[1])
    out = _release(repo, version)
    assert out.returncode == 1 and says in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert _git(repo, "tag") == ""
