"""``dpsketch enrol`` and ``dpsketch submit --relay`` (docs/relay.md): the real CLI (enrolment and a
submission as ``dpsketch`` processes, the other runs through the same ``main`` in-process, a
process costing about 1.3 s of CPU in imports), two real share servers that require upload
tokens, a real ``dpsketch relay``.

What must hold: the enrolment read from the servers lets the CLI store every row of a CSV once at
every server through the relay; a run whose request reached the servers but whose answer never
came back (here: the relay unreachable, then that very request delivered) is completed by
running the same command again without counting a row twice, and a run after completion sends
nothing; a histogram study's rows go through too, raw, and its release is exactly the ring sum
of what the devices prepared; rows clipped to the row bound give the direct route's one-line
warning; misuse is one line with exit 2, a study not at every server, a server that cannot be
reached, a server whose policy takes no relayed uploads, or a study with parties or batch proofs
one line with exit 1; the library's ``enrol()`` refuses the same two (``NotRelayable``), by the one
check the command line words.
"""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from dpsketch.client_sdk import Client, NotRelayable, SDKError, relay_cli
from dpsketch.client_sdk.cli import main as submit
from dpsketch.client_sdk.relayed import Enrolment, RelayClient, check_relayable, enrol
from dpsketch.protocol import relayed, ring
from dpsketch.protocol.messages import ServerInfo
from dpsketch.services.relayed_uploads import refusal
from dpsketch.tools.cluster import free_port, share_server, start_all
from dpsketch.tools.cluster import relay as relay_process
from conftest import NO_BUDGET, Servers
from studies import make_study, provision_with_token

COLUMNS = ["x0", "x1", "x2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Servers "a" and "b" (make_study's) requiring upload tokens, and a relay before them; and
    ``off``, another server "b" whose operator turned relayed uploads off."""
    pool = Servers(tmp_path_factory.mktemp("relay-cli"))
    env = {"DPSKETCH_MAX_FLOOR_EPSILON": "none", "DPSKETCH_MIN_REPORTS": "2", **NO_BUDGET}  # synthetic rows
    specs = [pool.spec(s) for s in ("a", "b")]
    procs = [share_server(spec, pool.workdir, env) for spec in specs]  # uploads need tokens (the default)
    relay = relay_process({s.server_id: p.url for s, p in zip(specs, procs)}, pool.workdir, None, "--window", "10")
    off_dir = pool.workdir / "off"  # its own log and database beside the other "b"
    off_dir.mkdir()
    off_spec = replace(pool.spec("b"), db_path=off_dir / "b.sqlite3")
    off = share_server(off_spec, off_dir, {**env, "DPSKETCH_RELAYED_UPLOADS": "off"})
    pool.started.extend([*procs, relay, off])
    try:
        start_all(pool.started)  # all four at once
        yield specs, procs, relay, SimpleNamespace(spec=off_spec, proc=off)
    finally:
        pool.stop_all()


def _study(setup, seed: str, servers=2):
    """A study on the first ``servers`` servers, and its upload token at each."""
    specs, procs = setup[:2]
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
    specs, procs, relay = setup[:3]
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


def test_enrol_refuses_a_server_whose_policy_takes_no_relayed_uploads(setup, tmp_path, capsys):
    """The study is at "a" and at both "b"s: enrolled with the "b" run with ``--relayed-uploads
    off`` (its /v1/info policy says so), dpsketch enrol names that server in one line, exit 1,
    nothing written; with the "b" that takes them, the same command writes the enrolment."""
    specs, procs, _, off = setup
    study, _ = _study(setup, "relay-cli-route-off")
    provision_with_token(off.proc.url, off.spec.operator_token, study)
    out = tmp_path / "enrolment.json"
    argv = ["--study", study.study_id, "--out", str(out), "-q"]
    assert relay_cli.main([*argv, "--servers", f"{procs[0].url},{off.proc.url}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dpsketch enrol: error: server b ") and off.proc.url in err, err
    assert "takes no relayed uploads" in err and not out.exists()
    assert relay_cli.main([*argv, "--servers", f"{procs[0].url},{procs[1].url}"]) == 0, capsys.readouterr().err
    assert Enrolment.load(out).study_id == study.study_id


def test_a_study_with_parties_or_batch_proofs_is_not_relayed_by_one_rule():
    """relayed.unrelayable is the rule (section 7b); the server's 415 detail and the command
    line's error each word it, and a plain study passes both."""
    plain = make_study(COLUMNS, 100, seed="relay-cli-plain", epsilon_floor=None)
    parties = make_study(COLUMNS, 100, seed="relay-cli-parties", epsilon_floor=None,
                         parties=[{"name": "p", "columns": ["x0"]}, {"name": "q", "columns": ["x1", "x2"]}])
    proofs = make_study(COLUMNS, 100, seed="relay-cli-proofs", epsilon_floor=None, validity=True,
                        batch_proofs=True)
    assert [relayed.unrelayable(s) for s in (plain, parties, proofs)] == [None, "parties", "batch proofs"]
    assert refusal(SimpleNamespace(study=plain)) is None and relay_cli._not_relayable(plain) is None
    assert refusal(SimpleNamespace(study=parties)).startswith(f"study {parties.study_id} has parties: ")
    assert refusal(SimpleNamespace(study=proofs)).startswith(f"study {proofs.study_id} has batch proofs: ")
    assert "a relay cannot carry them" in relay_cli._not_relayable(parties)
    assert "--party" in relay_cli._not_relayable(parties) and "--party" not in relay_cli._not_relayable(proofs)


def test_the_sdks_enrol_refuses_a_server_whose_policy_takes_no_relayed_uploads(setup, tmp_path):
    """The library's enrol() refuses as dpsketch enrol does: the study at "a" and at the "b" run
    with ``--relayed-uploads off``, enrol() raises NotRelayable naming that server (id and URL),
    why and what to do instead, and nothing is saved; at "a" and the "b" that takes them, the
    same call enrols."""
    specs, procs, _, off = setup
    study, _ = _study(setup, "relay-sdk-route-off")
    provision_with_token(off.proc.url, off.spec.operator_token, study)
    out = tmp_path / "enrolment.json"
    with Client([procs[0].url, off.proc.url], encrypt=True) as client:
        with pytest.raises(NotRelayable) as refused:
            enrol(client, study.study_id).save(out)
    err = refused.value
    assert (err.reason, err.server_id, err.url, err.study_id) == ("relayed uploads off", "b", off.proc.url,
                                                                  study.study_id)
    assert str(err).startswith(f"server b ({off.proc.url}) takes no relayed uploads (its /v1/info policy says "
                               f"relayed_uploads false"), str(err)
    assert "upload to the servers directly (Client.submit or Client.submit_many)" in str(err)
    assert isinstance(err, SDKError) and not out.exists()
    with Client([procs[0].url, procs[1].url], encrypt=True) as client:
        enrol(client, study.study_id).save(out)
    assert Enrolment.load(out).study_id == study.study_id


def test_the_sdks_enrol_and_dpsketch_enrol_refuse_a_study_with_parties(setup, tmp_path, capsys):
    """A study with parties, held by both servers (which take relayed uploads): enrol() raises
    NotRelayable saying it has parties and pointing to submit_blocks, nothing saved; dpsketch
    enrol says the same for the command line (--party), one line, exit 1, nothing written."""
    specs, procs = setup[:2]
    study = make_study(COLUMNS, 100, seed="relay-sdk-parties", epsilon_floor=None,
                       parties=[{"name": "p", "columns": ["x0"]}, {"name": "q", "columns": ["x1", "x2"]}])
    for spec, proc in zip(specs, procs):
        r = httpx.put(f"{proc.url}/v1/studies/{study.study_id}", content=study.canonical(), timeout=60,
                      headers={"Authorization": f"Bearer {spec.operator_token}", "Content-Type": "application/json"})
        assert r.status_code == 201, r.text
    out = tmp_path / "enrolment.json"
    urls = [p.url for p in procs]
    with Client(urls, encrypt=True) as client:
        with pytest.raises(NotRelayable) as refused:
            enrol(client, study.study_id).save(out)
    assert (refused.value.reason, refused.value.server_id) == ("parties", None)
    assert str(refused.value).startswith(f"study {study.study_id[:12]}... has parties: a relay cannot carry them")
    assert "Client.submit_blocks" in str(refused.value) and not out.exists()
    assert relay_cli.main(["--study", study.study_id, "--servers", ",".join(urls), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err == (f"dpsketch enrol: error: study {study.study_id[:12]}... has parties: each party uploads its "
                   f"blocks directly (dpsketch submit --servers ... --party), a relay cannot carry them "
                   f"(docs/relay.md)\n") and not out.exists()


def test_a_policy_without_relayed_uploads_is_let_through_only_false_refuses():
    """check_relayable reads each server's /v1/info as the Client read it (here given): a policy
    without the member, or no policy, passes (docs/protocol.md makes neither required); true
    passes; false refuses, naming the first server that says so."""
    study = make_study(COLUMNS, 100, seed="relay-sdk-policy", epsilon_floor=None)

    def client(*policies):
        infos = [ServerInfo(server_id=s, protocol="dpsketch/2", version="0", policy=p)
                 for s, p in zip(study.servers, policies)]
        return SimpleNamespace(encrypt=True, urls=["http://a.test", "http://b.test"], server_infos=lambda _: infos)

    for policies in [({}, None), ({"relayed_uploads": True}, {"max_epsilon": 10}), (None, {"relayed_uploads": True})]:
        check_relayable(study, client(*policies))  # no refusal
    with pytest.raises(NotRelayable) as refused:
        check_relayable(study, client({"relayed_uploads": True}, {"relayed_uploads": False}))
    assert (refused.value.server_id, refused.value.url) == ("b", "http://b.test")
    with pytest.raises(ValueError, match="encrypt=True"):
        check_relayable(study, SimpleNamespace(encrypt=False))


def test_rows_clipped_on_the_relay_route_warn_as_on_the_direct_route(setup, tmp_path, capsys):
    """One row of three is past the row bound: dpsketch submit --relay prints the direct route's
    data-limited warning, the same line (one function prints both), quiet or not; rows within
    the bound give none, and the summary says so without --quiet."""
    relay = setup[2]
    study, tokens = _study(setup, "relay-cli-limited")
    enrolment_file = tmp_path / "enrolment.json"
    with Client([p.url for p in setup[1]], encrypt=True) as client:
        enrol(client, study.study_id).save(enrolment_file)
    clipped, inside = tmp_path / "clipped.csv", tmp_path / "inside.csv"
    clipped.write_text("x0,x1,x2\n0.1,0.2,0.3\n2.0,0.0,0.0\n0.1,0.1,0.1\n")
    inside.write_text("x0,x1,x2\n0.1,0.2,0.3\n")
    common = ["--token", ",".join(tokens), "--no-journal"]
    relay_route = ["--relay", relay.url, "--enrolment", str(enrolment_file), *common]

    assert submit([*relay_route, "-q", str(clipped)]) == 0
    relayed_err = capsys.readouterr().err
    assert relayed_err == ("dpsketch submit: warning: 1 rows (33.3%) clipped to the study's row bound (it "
                           "declares no bounds: rows must already be scaled into its ball)\n")
    assert submit(["--study", study.study_id, "--servers", ",".join(p.url for p in setup[1]), *common, "-q",
                   str(clipped)]) == 0
    assert capsys.readouterr().err == relayed_err  # the direct route's line
    assert submit([*relay_route, str(inside)]) == 0
    got = capsys.readouterr()
    assert "warning" not in got.err and got.out.splitlines()[-1] == "no value was outside the study's bounds"
    assert _counts(setup, study.study_id) == [7, 7]


AGE = {"column": "age", "edges": [18, 30, 50, 70]}  # cells: <18, [18,30), [30,50), [50,70), >=70
SMOKER = {"column": "smoker", "categories": ["yes", "no"]}  # cells: yes, no, (other)

#: ``dpsketch`` in a process of its own, adding up the shares of every report it prepares (each
#: relayed row is one PreparedBatch, client_sdk/relayed.py), saved to argv[1] as the ring sum
RECORDING_DPSKETCH = """
import sys
import numpy as np
import dpsketch.client_sdk.relayed as sdk
from dpsketch.protocol import ring
from dpsketch.tools.cli import main

real, total = sdk.prepare_batch, []
def recording(study, *args, **kwargs):
    batch = real(study, *args, **kwargs)
    total.append(ring.reconstruct([batch.share(j) for j in range(study.n_servers)]).sum(axis=0, dtype=np.uint64))
    return batch
sdk.prepare_batch = recording
code = main(sys.argv[2:])
np.save(sys.argv[1], np.sum(total, axis=0, dtype=np.uint64))
sys.exit(code)
"""


def test_a_histogram_study_through_the_relay_cli_releases_exactly_its_ring_sum(setup, tmp_path):
    """Six rows of raw values (a category the bins do not name, ages past both outer edges), 4 a
    request, through dpsketch submit --relay in a process of its own: each server holds 6
    reports, the release (finalized by an analyzer's coordinator over the two servers) is exactly
    the ring sum of the reports the process prepared, and within 6 noise sd of the true counts."""
    from dpsketch.analyzer.config import ClusterConfig, ServerEndpoint
    from dpsketch.analyzer.coordinator import Coordinator
    from dpsketch.analyzer.release import release_from_ring_sum
    from dpsketch.analyzer.store import AnalyzerStore

    specs, procs, relay = setup[:3]
    study = make_study([], 100, seed="relay-cli-histogram", epsilon_floor=None, kind="histogram",
                       histogram={"axes": [AGE, SMOKER]}, min_reports=6)
    tokens = [provision_with_token(p.url, s.operator_token, study) for s, p in zip(specs, procs)]
    enrolment_file = tmp_path / "enrolment.json"
    assert relay_cli.main(["--study", study.study_id, "--servers", ",".join(p.url for p in procs),
                           "--out", str(enrolment_file), "-q"]) == 0
    rows = [("yes", "25"), ("no", "40"), ("maybe", "90"), ("no", "17"), ("yes", "55.5"), ("no", "-3")]
    csv = tmp_path / "data.csv"
    csv.write_text("smoker,age\n" + "".join(f"{s},{a}\n" for s, a in rows))
    recorded = tmp_path / "ring_sum.npy"
    r = subprocess.run([sys.executable, "-c", RECORDING_DPSKETCH, str(recorded), "submit", "--relay", relay.url,
                        "--enrolment", str(enrolment_file), "--token", ",".join(tokens), "--batch-size", "4",
                        "--no-journal", "-q", str(csv)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "dpsketch submit:" not in r.stderr, r.stderr  # raw values: nothing clamped
    assert _counts(setup, study.study_id) == [6, 6]

    config = ClusterConfig(servers=[ServerEndpoint(server_id=s.server_id, url=p.url, analyst_token=s.analyst_token)
                                    for s, p in zip(specs, procs)])
    coordinator = Coordinator(config, AnalyzerStore(":memory:"))
    try:
        coordinator.store.add_study(study, [])
        rec = coordinator.finalize(study.study_id)
    finally:
        coordinator.close()
    assert rec.n_reports == 6
    exact = np.load(recorded)
    np.testing.assert_array_equal(np.asarray(rec.ring_sum).reshape(-1), exact)
    hist = release_from_ring_sum(study, rec.ring_sum, rec.n_reports).histogram()
    np.testing.assert_array_equal(np.asarray(hist.counts).reshape(-1), ring.decode(exact, study.frac_bits))
    true = np.zeros(15)  # cell = 3 x age bin + smoker bin: 17 and -3 are < 18, 90 is >= 70, maybe is (other)
    true[[1, 3, 7, 9, 14]] = [2, 1, 1, 1, 1]
    assert np.all(np.abs(np.asarray(hist.counts).reshape(-1) - true) < 6 * math.sqrt(hist.noise_variance))
