"""A validity study's query answer kept for its decision (services/verify_cache.py): the
decision reads it instead of computing this server's verifier shares again, and decides exactly
as a recomputation would; a file that is not this server's answer for this study, seed and held
set (swapped, flipped, truncated), a query that stopped mid-answer, or a restart leave the
decision correct (it recomputes). Three servers' apps in process over real SQLite files, the
round's steps sent by the analyzer's own client (tests/test_verification_round.py's setup)."""

from __future__ import annotations

import os
import shutil
import threading
import time

import httpx
import pytest
import uvicorn

from dpsketch.protocol import messages, validity as V
from dpsketch.services import verification, verify_cache
from dpsketch.tools.cluster import free_ports
from test_verification_round import AN, Round, make_study, proved_batch, tampered


@pytest.fixture(scope="module")
def study():
    return make_study()


@pytest.fixture
def rnd(tmp_path, study):
    r = Round(lambda sid: tmp_path / f"{sid}.db", study)
    yield r
    r.close()


@pytest.fixture
def recomputed(monkeypatch):
    """How many chunks of verifier shares each server computed (``Rounds.verifiers`` calls)."""
    counts: dict[str, int] = {}
    real = verification.Rounds.verifiers

    def counting(self, *args, **kw):
        counts[self.server_id] = counts.get(self.server_id, 0) + 1
        return real(self, *args, **kw)

    monkeypatch.setattr(verification.Rounds, "verifiers", counting)
    return counts


def kept(rnd, j):
    """Server j's cache directory's files (complete and temporary); none if a clean shutdown
    removed the emptied directory."""
    directory = rnd.stores[j].verification.cache.directory
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def query_all(rnd, study):
    co = rnd.coordinator
    commitments = [bytes.fromhex(s.verify_commit(study.study_id).commitment) for s in co.servers]
    contributions = [bytes.fromhex(s.verify_reveal(study.study_id, commitments).contribution) for s in co.servers]
    answers = [s.verify_query(study.study_id, contributions, V.plan(study)) for s in co.servers]
    return contributions, answers


def decide(rnd, study, answers, j):
    """Server j's refused ids and decided count, told the true sum of the others' shares."""
    ids = answers[0][0]
    others = None
    for i, (_ids, shares) in enumerate(answers):
        if i != j:
            others = shares if others is None else V.add_verifiers(others, shares)
    refused, decided = rnd.coordinator.servers[j].verify_decide(study.study_id, V.encode_verifiers(ids, others))
    return set(messages.split_ids(refused)), decided


def test_the_decision_reads_the_kept_answer_and_decides_as_a_recomputation(rnd, study, recomputed, tmp_path):
    proved = proved_batch(study, 300, seed=11)
    views, bad = tampered(study, proved)
    rnd.put(proved, views=views)
    _, answers = query_all(rnd, study)
    for j in range(3):
        (name,) = kept(rnd, j)  # one complete file each, no temporary one left
        assert name.startswith(study.study_id) and name.endswith(f"-{rnd.stores[j].settings.server_id}.verifiers")
    recomputed.clear()
    decisions = [decide(rnd, study, answers, j) for j in range(3)]
    assert recomputed == {}  # no server computed a verifier share: each read its kept answer
    assert all(d == (set(bad), 300) for d in decisions)  # the tampered reports refused, exactly
    assert all(kept(rnd, j) == [] for j in range(3))  # removed once the decision is stored

    # the same reports at servers with no cache decide the same (recomputing)
    other = Round(lambda sid: tmp_path / f"off-{sid}.db", study)
    try:
        for app in other.apps:
            app.state.store.verification.cache.directory = None
        other.put(proved, views=views)
        _, plain = query_all(other, study)
        recomputed.clear()
        assert [decide(other, study, plain, j) for j in range(3)] == decisions
        assert all(recomputed[sid] >= 1 for sid in ("s1", "s2", "s3"))
    finally:
        other.close()


def _corrupt(rnd, j, how):
    directory = rnd.stores[j].verification.cache.directory
    (path,) = directory.iterdir()
    if how == "flip":  # one bit of one share
        data = bytearray(path.read_bytes())
        data[verify_cache.HEADER.size + 40] ^= 1
        path.write_bytes(bytes(data))
    elif how == "truncate":  # a crash after the rename, before the data reached the disk
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 7)
    elif how == "swap":  # another server's answer for the same study, seed and held set
        (theirs,) = rnd.stores[(j + 1) % 3].verification.cache.directory.iterdir()
        path.write_bytes(theirs.read_bytes())
    elif how == "zeros":  # the right size, nothing written (a sparse file after a crash)
        size = path.stat().st_size
        path.write_bytes(b"\0" * size)
    return path


@pytest.mark.parametrize("how", ["flip", "truncate", "swap", "zeros"])
def test_a_file_that_is_not_this_servers_answer_is_not_used(rnd, study, recomputed, how):
    """Used as is, a swapped file (server 2's shares at server 1) would make server 1 refuse every
    report, a flipped bit the reports it touches: the binding and the content digest catch each,
    the decision recomputes and refuses exactly the tampered reports, and the file is removed."""
    proved = proved_batch(study, 300, seed=12)
    views, bad = tampered(study, proved)
    rnd.put(proved, views=views)
    _, answers = query_all(rnd, study)
    path = _corrupt(rnd, 0, how)
    recomputed.clear()
    assert decide(rnd, study, answers, 0) == (set(bad), 300)
    assert recomputed.get("s1", 0) >= 1 and not path.exists()
    assert decide(rnd, study, answers, 1) == (set(bad), 300) and "s2" not in recomputed


def test_a_query_stopped_mid_answer_leaves_no_file(rnd, study, recomputed, monkeypatch):
    monkeypatch.setattr(verification, "CHUNK_BYTES", 1)  # 256 reports a chunk: 3 chunks
    proved = proved_batch(study, 600, seed=13)
    views, bad = tampered(study, proved)
    rnd.put(proved, views=views)
    contributions, answers = query_all(rnd, study)
    store = rnd.stores[0]
    for path in store.verification.cache.directory.iterdir():
        path.unlink()
    _count, _seed, chunks = store.verification.query(store.record(study.study_id), contributions)
    pieces = [next(chunks) for _ in range(3)]  # the count, the ids, the first chunk's shares
    assert len(pieces[2]) == 256 * V.verifier_len(study) * 16
    assert len(kept(rnd, 0)) == 1 and kept(rnd, 0)[0].endswith(".tmp")  # being written
    chunks.close()  # the client left
    assert kept(rnd, 0) == []
    recomputed.clear()
    assert decide(rnd, study, answers, 0) == (set(bad), 600)
    assert recomputed["s1"] == 3  # every chunk recomputed
    assert decide(rnd, study, answers, 1) == (set(bad), 600) and "s2" not in recomputed


def test_a_client_that_leaves_mid_answer_over_http_leaves_no_file(rnd, study, recomputed, monkeypatch):
    """Server 1's app under uvicorn on a loopback port: a client reads the start of the query's
    answer and closes the connection while the second chunk is being computed. No complete file
    appears at any time, the temporary one goes, and the decision recomputes and is right."""
    monkeypatch.setattr(verification, "CHUNK_BYTES", 1)  # 256 reports a chunk: 3 chunks
    proved = proved_batch(study, 600, seed=16)
    views, bad = tampered(study, proved)
    rnd.put(proved, views=views)
    contributions, answers = query_all(rnd, study)
    directory = rnd.stores[0].verification.cache.directory
    for path in directory.iterdir():
        path.unlink()
    held, left = threading.Event(), threading.Event()
    real = verification.Rounds.verifiers

    def slow(self, *args, **kw):
        if self.server_id == "s1" and recomputed.get("s1", 0) == 1:  # the second chunk (one done)
            held.set()
            left.wait(30)
        return real(self, *args, **kw)

    monkeypatch.setattr(verification.Rounds, "verifiers", slow)  # counting still (the fixture's)
    recomputed.clear()
    (port,) = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(rnd.apps[0], host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}/v1/studies/{study.study_id}/verify/query"
        with httpx.stream("POST", url, json={"contributions": [c.hex() for c in contributions]},
                          headers={"Authorization": f"Bearer {AN}"}, timeout=30) as answer:
            assert answer.status_code == 200
            first_chunk = 4 + 600 * 16 + 256 * V.verifier_len(study) * 16  # count, ids, 256 reports' shares
            got = 0
            for piece in answer.iter_raw():  # read as far as the first chunk (a client that stops
                got += len(piece)  # reading could stall the server's send instead)
                if got >= first_chunk:
                    break
            assert held.wait(30)  # the server is computing the second chunk
            assert [p.suffix for p in directory.iterdir()] == [".tmp"]  # being written, not complete
        left.set()  # the client has gone
        deadline = time.time() + 20
        while any(directory.iterdir()) and time.time() < deadline:
            assert not any(p.name.endswith(".verifiers") for p in directory.iterdir())
            time.sleep(0.05)
        assert kept(rnd, 0) == []
    finally:
        left.set()
        server.should_exit = True
        thread.join(30)
    recomputed.clear()
    assert decide(rnd, study, answers, 0) == (set(bad), 600) and recomputed["s1"] == 3


def test_a_restart_between_query_and_decision(rnd, study, recomputed):
    """Server 1 keeps its file across the restart and reads it; server 2 lost its file and
    recomputes; both decide exactly; the start removes files of studies not waiting for a
    decision and dead writers' temporary files, and keeps the waiting one."""
    proved = proved_batch(study, 300, seed=14)
    views, bad = tampered(study, proved)
    rnd.put(proved, views=views)
    _, answers = query_all(rnd, study)
    directory = rnd.stores[0].verification.cache.directory
    (mine,) = directory.iterdir()
    strays = [directory / ("ab" * 32 + "-" + "cd" * 16 + "-s1.verifiers"),  # a study not waiting
              directory / f".{mine.name}.x.tmp"]  # a writer that died long ago
    for stray in strays:
        stray.write_bytes(b"x")
    os.utime(strays[1], (time.time() - 3600, time.time() - 3600))
    young = directory / f".{mine.name}.y.tmp"  # a writer at work (another replica)
    young.write_bytes(b"y")
    for path in rnd.stores[1].verification.cache.directory.iterdir():
        path.unlink()
    rnd.restart(0)
    rnd.restart(1)
    assert kept(rnd, 0) == sorted([mine.name, young.name])
    young.unlink()
    recomputed.clear()
    assert decide(rnd, study, answers, 0) == (set(bad), 300) and "s1" not in recomputed
    assert decide(rnd, study, answers, 1) == (set(bad), 300) and recomputed["s2"] >= 1
    assert kept(rnd, 0) == [] and kept(rnd, 1) == []
    # a restart after the decision: nothing comes back, the decision stands
    rnd.restart(2)
    assert decide(rnd, study, answers, 2) == (set(bad), 300) and kept(rnd, 2) == []


def test_a_dropped_study_and_a_repeated_query_after_the_decision_keep_no_file(rnd, study):
    proved = proved_batch(study, 150, seed=15)
    rnd.put(proved)
    contributions, answers = query_all(rnd, study)
    assert len(kept(rnd, 0)) == 1
    assert decide(rnd, study, answers, 0) == (set(), 150)
    again = rnd.coordinator.servers[0].verify_query(study.study_id, contributions, V.plan(study))
    assert (again[1] == answers[0][1]).all() and kept(rnd, 0) == []  # decided: nothing kept
    assert len(kept(rnd, 1)) == 1
    rnd.stores[1].close_study(study.study_id, "dropped", who="test")
    assert kept(rnd, 1) == []


def test_the_setting(tmp_path, monkeypatch):
    from dpsketch.services.settings import Settings

    base = dict(server_id="s1", operator_token="op-" + "o" * 20, analyst_token="an-" + "a" * 20)
    monkeypatch.delenv("DPSKETCH_VERIFY_CACHE_DIR", raising=False)
    assert Settings(db_path=tmp_path / "s1.db", **base).verify_cache_dir == tmp_path / "s1.db.verify-cache"
    one, other = (Settings(db_url=f"postgresql://u:pw@h/{db}", **base).verify_cache_dir for db in ("d", "e"))
    assert one.name.startswith("dpsketch-verify-cache-") and one != other  # one per database
    monkeypatch.setenv("DPSKETCH_VERIFY_CACHE_DIR", "off")
    assert Settings(db_path=tmp_path / "s1.db", **base).verify_cache_dir is None
    monkeypatch.setenv("DPSKETCH_VERIFY_CACHE_DIR", str(tmp_path / "c"))
    assert Settings(db_path=tmp_path / "s1.db", **base).verify_cache_dir == tmp_path / "c"
    from dpsketch.services.__main__ import build_parser, settings_from_args

    monkeypatch.setenv("DPSKETCH_OPERATOR_TOKEN", base["operator_token"])
    monkeypatch.setenv("DPSKETCH_ANALYST_TOKEN", base["analyst_token"])
    args = build_parser().parse_args(["--server-id", "s1", "--db", str(tmp_path / "s1.db"), "--verify-cache-dir", "off"])
    assert settings_from_args(args).verify_cache_dir is None
    args = build_parser().parse_args(["--server-id", "s1", "--db", str(tmp_path / "s1.db")])
    assert settings_from_args(args).verify_cache_dir == tmp_path / "c"  # the environment's
    # a directory others may write to is not used (another user's file is never taken as ours)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert verify_cache.VerifierCache(shared).directory is None
    mine = verify_cache.VerifierCache(tmp_path / "mine")
    assert not (tmp_path / "mine").exists()  # made by the first query that keeps an answer
    assert mine._ready() == tmp_path / "mine" and (tmp_path / "mine").stat().st_mode & 0o777 == 0o700
    # a directory another user made after the start is checked before anything is read from it
    late = verify_cache.VerifierCache(tmp_path / "late")
    (tmp_path / "late").mkdir(mode=0o777)
    (tmp_path / "late").chmod(0o777)
    key = verify_cache.Key("s1", "ab" * 32, b"s" * 32, 1, b"h" * 32, 4, 1)
    assert late.open(key) is None and late.directory is None


def test_a_clean_shutdown_removes_the_directory_it_made_once_empty(rnd, study):
    """Each PostgreSQL database has its own directory under the temporary directory: a server
    that made it removes it at a clean shutdown once its decisions are made; one that still
    holds a waiting answer keeps it (the decision reads it after the restart); a directory the
    operator made stays."""
    proved = proved_batch(study, 120, seed=16)
    rnd.put(proved)
    _, answers = query_all(rnd, study)
    dirs = [s.verification.cache.directory for s in rnd.stores]
    assert all(len(list(d.iterdir())) == 1 for d in dirs)
    assert decide(rnd, study, answers, 0) == (set(), 120)
    rnd.stores[0].close()
    rnd.stores[1].close()
    assert not dirs[0].exists()  # decided: empty, made by this server
    assert len(list(dirs[1].iterdir())) == 1  # waiting for its decision: kept
    made = rnd.stores[2].verification.cache
    made._created = False  # as if the operator had made it before the start
    for path in dirs[2].iterdir():
        path.unlink()
    rnd.stores[2].close()
    assert dirs[2].exists()


@pytest.mark.parametrize("store_kind", ["postgres"], indirect=True)
def test_a_replica_on_another_machine_decides_without_the_file_as_the_others_do(store_location, study, tmp_path,
                                                                               monkeypatch):
    """Replicas of a server share its PostgreSQL database, not its cache directory: the query
    answered by one replica, the decision taken by another (its own temporary directory, as on
    another machine) recomputes its verifier shares and refuses exactly what the servers that
    read their kept answers refuse."""
    monkeypatch.delenv("DPSKETCH_VERIFY_CACHE_DIR", raising=False)
    rnd = Round(store_location, study)
    first = rnd.stores[0].verification.cache.directory
    try:
        proved = proved_batch(study, 200, seed=17)
        views, bad = tampered(study, proved)
        rnd.put(proved, views=views)
        _, answers = query_all(rnd, study)
        assert len(list(first.iterdir())) == 1
        monkeypatch.setenv("DPSKETCH_VERIFY_CACHE_DIR", str(tmp_path / "another-machine"))
        rnd.restart(0)  # server s1 is now served by a replica that never saw the query
        assert rnd.stores[0].verification.cache.directory != first
        assert decide(rnd, study, answers, 0) == (set(bad), 200)
        assert decide(rnd, study, answers, 1) == (set(bad), 200)
        assert rnd.stores[0].verification.decided_from == {"cache": 0, "recomputed": 1}
        assert rnd.stores[1].verification.decided_from == {"cache": 1, "recomputed": 0}
    finally:
        rnd.close()
        # the first replica's file of a study decided elsewhere: its next start would sweep it
        shutil.rmtree(first, ignore_errors=True)
