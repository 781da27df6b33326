"""``dpsketch enrol`` and ``dpsketch submit --relay`` (docs/relay.md): the real CLI (enrolment and a
submission as ``dpsketch`` processes, the other runs through the same ``main`` in-process, a
process costing about 1.3 s of CPU in imports), two real share servers that require upload
tokens, a real ``dpsketch relay``.

What must hold: the enrolment read from the servers lets the CLI store every row of a CSV once at
every server through the relay; a run whose request reached the servers but whose answer never
came back (here: the relay unreachable, then that very request delivered) is completed by
running the same command again without counting a row twice, and a run after completion sends
nothing; misuse is one line with exit 2, a study not at every server or a server that cannot be
reached one line with exit 1.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import pytest

from dpsketch.client_sdk import Client, relay_cli
from dpsketch.client_sdk.cli import main as submit
from dpsketch.client_sdk.relayed import Enrolment, RelayClient, enrol
from dpsketch.protocol import relayed
from dpsketch.tools.cluster import free_port, share_server, start_all
from dpsketch.tools.cluster import relay as relay_process
from conftest import NO_BUDGET, Servers
from studies import make_study, provision_with_token

COLUMNS = ["x0", "x1", "x2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Servers "a" and "b" (make_study's) requiring upload tokens, and a relay before them."""
    pool = Servers(tmp_path_factory.mktemp("relay-cli"))
    env = {"DPSKETCH_MAX_FLOOR_EPSILON": "none", **NO_BUDGET}
    specs = [pool.spec(s) for s in ("a", "b")]
    procs = [share_server(spec, pool.workdir, env) for spec in specs]  # uploads need tokens (the default)
    relay = relay_process({s.server_id: p.url for s, p in zip(specs, procs)}, pool.workdir, None, "--window", "10")
    pool.started.extend([*procs, relay])
    try:
        start_all(pool.started)  # all three at once
        yield specs, procs, relay
    finally:
        pool.stop_all()


def _study(setup, seed: str, servers=2):
    """A study on the first ``servers`` servers, and its upload token at each."""
    specs, procs, _ = setup
    study = make_study(COLUMNS, 100, seed=seed, epsilon_floor=None)
    tokens = [provision_with_token(p.url, s.operator_token, study) for s, p in zip(specs[:servers], procs)]
    return study, tokens


def _counts(setup, study_id: str) -> list[int]:
    return [httpx.get(f"{p.url}/v1/studies/{study_id}").json()["report_count"] for p in setup[1]]


def _dpsketch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_enrol_then_submit_through_the_relay_stores_each_row_once_across_reruns(setup, tmp_path, capsys):
    """6 rows, 4 a request: the first run finds no relay (exit 3, its first request kept in the
    journal); that request then reaches the servers anyway; the second run resends it as it was
    (duplicates) and sends the rest; a third run sends nothing. Each server holds 6 reports."""
    specs, procs, relay = setup
    study, tokens = _study(setup, "relay-cli-e2e")
    sid = study.study_id
    enrolment_file = tmp_path / "enrolment.json"
    r = _dpsketch("enrol", "--study", sid, "--servers", ",".join(p.url for p in procs), "--out", str(enrolment_file))
    assert r.returncode == 0 and f"wrote {enrolment_file}" in r.stdout, r.stderr
    enrolment = Enrolment.load(enrolment_file)
    assert enrolment.study_id == sid and [x.server_id for x in enrolment.recipients] == ["a", "b"]
    csv = tmp_path / "data.csv"
    csv.write_text("x2,x0,x1\n" + "".join(f"{i / 10},{-i / 10},0.05\n" for i in range(6)))
    journal = tmp_path / "journal"
    argv = ["submit", "--enrolment", str(enrolment_file), "--token", ",".join(tokens), "--batch-size", "4",
            "--journal-dir", str(journal), "-q", str(csv)]

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert submit([*argv[1:], "--relay", dead, "--max-retries", "0"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "0 of 6 rows are stored at every server; run the same command again" in err
    assert _counts(setup, sid) == [0, 0]
    # the file changed under the unfinished submission: refused, nothing sent
    rows = csv.read_text()
    csv.write_text(rows + "0.7,-0.7,0.05\n")
    assert submit([*argv[1:], "--relay", relay.url]) == 1
    assert "changed since an unfinished relayed submission" in capsys.readouterr().err
    csv.write_text(rows)
    # the request in flight reached the servers after all (its answer was what got lost)
    [file] = journal.glob("*.json")
    pending = json.loads(file.read_text().splitlines()[-1])
    assert (pending["first"], pending["rows"]) == (0, 4)
    with RelayClient(relay.url, enrolment, tokens) as rc:
        rc.send(relayed.decode(base64.b64decode(pending["bundle"])))
    assert _counts(setup, sid) == [4, 4]

    r = _dpsketch(*[a for a in argv if a != "-q"], "--relay", relay.url)
    assert r.returncode == 0, r.stderr
    assert "submitted 6 rows of data.csv" in r.stdout and "already held: 8" in r.stdout, r.stdout
    assert _counts(setup, sid) == [6, 6]
    assert submit([a for a in argv[1:] if a != "-q"] + ["--relay", relay.url]) == 0
    out = capsys.readouterr().out
    assert "were already stored at every server" in out and "nothing sent" in out
    assert _counts(setup, sid) == [6, 6]


def test_usage_errors_exit_2_with_one_line(setup, tmp_path, capsys):
    study, tokens = _study(setup, "relay-cli-usage")
    assert submit(["--relay", setup[2].url, str(tmp_path / "x.csv")]) == 2
    assert capsys.readouterr().err == ("dpsketch submit: error: --relay URL and --enrolment FILE go "
                                       "together (dpsketch enrol writes the file)\n")
    enrolment_file = tmp_path / "enrolment.json"
    with Client([p.url for p in setup[1]], encrypt=True) as client:
        enrol(client, study.study_id).save(enrolment_file)
    csv = tmp_path / "data.csv"
    csv.write_text("x0,x1,x2\n0.1,0.2,0.3\n")
    base = ["--relay", setup[2].url, "--enrolment", str(enrolment_file), "--no-journal", "-q"]
    for extra, message in [(["--servers", "http://x"], "--servers does not go with --relay"),
                           (["--token", "t1,t2,t3"], "--token lists 3 tokens for the study's 2 servers"),
                           (["--study", "cd" * 32], "is not the enrolment's study"),
                           (["--batch-size", "0"], "--batch-size must be at least 1"),
                           (["--privacy-limit", "1.0"], "--privacy-limit '1.0': expected EPSILON,DELTA")]:
        assert submit([*base, *extra, str(csv)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (extra, err)
    assert submit([*base[2:], str(csv)]) == 2  # --enrolment without --relay
    assert "go together" in capsys.readouterr().err
    assert _counts(setup, study.study_id) == [0, 0]  # nothing was sent


def test_enrol_refuses_a_study_not_at_every_server_and_an_unreachable_one(setup, tmp_path, capsys):
    study, _ = _study(setup, "relay-cli-one-server", servers=1)
    out = tmp_path / "enrolment.json"
    urls = [p.url for p in setup[1]]
    assert relay_cli.main(["--study", study.study_id, "--servers", ",".join(urls), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dpsketch enrol: error: ") and urls[1] in err, err
    assert "404" in err and not out.exists()
    dead = f"http://127.0.0.1:{free_port()}"
    assert relay_cli.main(["--study", study.study_id, "--servers", f"{urls[0]},{dead}", "--max-retries", "0",
                           "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and dead in err and "connection refused" in err and not out.exists(), err
