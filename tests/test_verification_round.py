"""A validity study's verification round (docs/protocol.md section 6d) at the unit level: three
share servers' apps in process (TestClient over the real routes, real SQLite files), their
reports stored through each store's own writer, the round driven by the analyzer's own code
(Coordinator.verify, its HTTP client pointed at the apps). The attacks over real processes, the
SDK's uploads and the release are in tests/test_validity_round_attacks.py."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from dpsketch.analyzer.config import ClusterConfig, ServerEndpoint
from dpsketch.analyzer.coordinator import Coordinator, UpstreamError
from dpsketch.analyzer.store import AnalyzerStore
from dpsketch.client_sdk import prepare
from dpsketch.protocol import report as report_path
from conftest import BOTH_STORES
from dpsketch.protocol import field, messages, study as S, validity as V
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.problems import ProblemError
from dpsketch.services import batches
from dpsketch.services.app import create_app
from dpsketch.services.settings import Settings
from dpsketch.services.state import new_state
from dpsketch.services.writer import CallJob

SERVERS = ["s1", "s2", "s3"]
AN, OP = "an-" + "a" * 20, "op-" + "o" * 20


def make_study(**kw):
    args = dict(name="round", columns=[f"c{i}" for i in range(5)], label="c0", servers=SERVERS,
                expected_reports=2000, min_reports=100, validity=True, epsilon_floor=None)
    args.update(kw)
    return S.design(**args)[0]


def proved_batch(study, m: int, seed: int = 1, full: int = 2):
    rows = np.random.default_rng(seed).normal(size=(m, study.d)) * 0.3
    stream = Keystream.from_key(bytes([seed]) * 32)
    encoded = report_path.noisy_encoded(prepare.signed_vectors(rows, study, stream), study, stream)
    return V.prepare(study, encoded, stream, full=full)


def payloads(proved) -> list[bytes]:
    """What each server stores of the batch: the leader's input and proof shares, or a seed."""
    return [proved.leader.astype("<u8").tobytes() if s is None else np.ascontiguousarray(s).tobytes()
            for s in proved.seeds]


def store_reports(store, record, ids: list[bytes], payload: bytes) -> None:
    """Store a batch through the store's writer and index it (the running totals of a validity
    study are the upload path's; the round reads only the stored payloads and the index)."""
    joined = b"".join(ids)

    def fn(conn):
        first = batches.next_rowid(conn)
        batches.insert(conn, store.backend, first, record.seq, joined, payload)
        conn.execute("UPDATE studies SET report_count = report_count + ? WHERE seq = ?", (len(ids), record.seq))

        def apply():
            state = record.state if record.state is not None else new_state(record.study)
            state.ids.add(joined, np.arange(first, first + len(ids)), ids)
            record.state = state
            record.report_count = len(state.ids)
            store.writer.next_rowid = first + len(ids)

        return None, apply

    store.writer.submit(CallJob(fn)).result()


class Round:
    """Three servers' apps and an analyzer's coordinator speaking to them through TestClient."""

    def __init__(self, new_store, study):
        """``new_store(name)``: a server's store (a SQLite path, or a PostgreSQL database's URL)."""
        self.study = study
        self.locations = {sid: new_store(sid) for sid in SERVERS}
        self.apps = [self._app(sid) for sid in SERVERS]
        config = ClusterConfig(servers=[ServerEndpoint(server_id=sid, url=f"http://{sid}", analyst_token=AN)
                                        for sid in SERVERS])
        self.coordinator = Coordinator(config, AnalyzerStore(":memory:"))
        self.coordinator.store.add_study(study, [])
        self._connect()

    def _app(self, sid):
        where = self.locations[sid]
        at = {"db_url": where} if isinstance(where, str) else {"db_path": where}
        settings = Settings(server_id=sid, operator_token=OP, analyst_token=AN, upload_auth="open",
                            max_floor_epsilon=None, population_epsilon=None, population_floor_epsilon=None,
                            warm_start=False, **at)
        app = create_app(settings)
        app.state.store.provision(self.study)
        return app

    def _connect(self):
        for client, app in zip(self.coordinator.servers, self.apps):
            client.http.close()
            client.http = TestClient(app, base_url=client.endpoint.url)
            client.retries = 0

    @property
    def stores(self):
        return [app.state.store for app in self.apps]

    def put(self, proved, ids=None, views=None):
        ids = proved.report_ids if ids is None else ids
        for j, store in enumerate(self.stores):
            record = store.record(self.study.study_id)
            store_reports(store, record, ids, (views or payloads(proved))[j])

    def restart(self, j: int):
        """Server j's process ends and a new one opens its file."""
        self.stores[j].close()
        self.apps[j] = self._app(SERVERS[j])
        store = self.stores[j]
        record = store.record(self.study.study_id)
        # the index comes back from the stored ids (the totals are the upload path's)
        with store._reading() as conn:
            ids, rowids = [], []
            for got in batches.scan(conn, record.seq):
                ids += got.id_list()
                rowids += got.rowids.tolist()
        state = new_state(record.study)
        state.ids.add(b"".join(ids), np.asarray(rowids), ids)
        record.state = state
        self._connect()

    def close(self):
        for store in self.stores:
            store.close()
        self.coordinator.close()

    def call(self, j, path, **kw):
        client = TestClient(self.apps[j], base_url="http://testserver")
        headers = {"Authorization": f"Bearer {AN}", **kw.pop("headers", {})}
        return client.post(f"/v1/studies/{self.study.study_id}/{path}", headers=headers, **kw)


@pytest.fixture(scope="module")
def study():
    return make_study()


@pytest.fixture
def rnd(store_location, study):
    r = Round(store_location, study)
    yield r
    r.close()


def tampered(study, proved, seed=9):
    """Three invalid reports of one batch: the leader's input share changed after proving (the
    shares no longer sum to what was proved), a helper's seed replaced (its shares are another
    vector's), and the leader's proof share altered at one element (a proof valid at N - 1
    servers' shares only)."""
    views = payloads(proved)
    leader = proved.leader.copy()
    leader[0, 3] = int(field.add(np.uint64(leader[0, 3]), np.uint64(1)))
    leader[2, -1] = int(field.add(np.uint64(leader[2, -1]), np.uint64(12345)))
    views[proved.full] = leader.astype("<u8").tobytes()
    helper = next(j for j, s in enumerate(proved.seeds) if s is not None)
    seeds = np.ascontiguousarray(proved.seeds[helper]).copy()
    seeds[1] = np.random.default_rng(seed).integers(0, 256, 32, dtype=np.uint8)
    views[helper] = seeds.tobytes()
    return views, [proved.report_ids[i] for i in (0, 1, 2)]


@BOTH_STORES
def test_the_round_refuses_exactly_the_tampered_reports_at_every_server(rnd, study):
    proved = proved_batch(study, 200)
    views, bad = tampered(study, proved)
    rnd.put(proved, views=views)
    common, masks, held = rnd.coordinator.verify(study.study_id)
    assert held == [200, 200, 200]
    accepted = set(messages.split_ids(common))
    assert accepted == set(proved.report_ids) - set(bad)
    assert all(int(m.sum()) == 197 for m in masks)
    summary = rnd.coordinator.record(study.study_id).verification
    assert summary["decided"] == 200 and summary["refused"] == 3
    # what `dpsketch study show / finalize / progress` print of it (table output)
    from dpsketch.analyzer import cli_tables

    line = cli_tables.verification(summary)
    assert "200 reports checked by every server, 3 refused (by server: s1 3, s2 3, s3 3)" in line
    # every server decided for itself, on the same sums: each refused all three
    assert summary["refused_by_server"] == {sid: 3 for sid in SERVERS}
    for store in rnd.stores:
        got = store.verification.round(store.record(study.study_id))
        assert set(messages.split_ids(got.refused)) == set(bad)


def test_every_step_is_idempotent_and_the_seed_fixed_once(rnd, study):
    proved = proved_batch(study, 120, seed=2)
    rnd.put(proved)
    first = rnd.coordinator.verify(study.study_id)
    seed = rnd.coordinator.record(study.study_id).verification["query_seed"]
    again = rnd.coordinator.verify(study.study_id)
    assert first[0] == again[0] and rnd.coordinator.record(study.study_id).verification["query_seed"] == seed
    c1 = rnd.call(0, "verify/commit").json()
    c2 = rnd.call(0, "verify/commit").json()
    assert c1 == c2
    # a reveal for another list of commitments is refused forever
    other = [c1["commitment"], "00" * 32, "11" * 32]
    answer = rnd.call(0, "verify/reveal", json={"commitments": other})
    assert answer.status_code == 409 and answer.json()["type"].endswith("verification-conflict")
    # a reveal that does not carry this server's own commitment at its position
    answer = rnd.call(1, "verify/reveal", json={"commitments": other})
    assert answer.status_code == 422 and answer.json()["type"].endswith("verification-refused")
    # a query with a contribution that does not open its commitment
    answer = rnd.call(2, "verify/query", json={"contributions": ["22" * 32] * 3})
    assert answer.status_code == 422 and answer.json()["positions"] == [0, 1, 2]


def test_steps_out_of_order_and_other_studies_are_refused(rnd, study):
    rnd.put(proved_batch(study, 110, seed=3))
    ask = rnd.call(0, "verify/reveal", json={"commitments": ["00" * 32] * 3})
    assert ask.status_code == 409 and ask.json()["type"].endswith("verification-pending")
    rnd.call(0, "verify/commit")
    ask = rnd.call(0, "verify/query", json={"contributions": ["00" * 32] * 3})
    assert ask.status_code == 409 and ask.json()["type"].endswith("verification-pending")
    ask = rnd.call(0, "verify/decide", content=b"\0" * 4,
                   headers={"Content-Type": V.VERIFIERS_MEDIA_TYPE})
    assert ask.status_code == 409 and ask.json()["type"].endswith("verification-pending")
    # no token, the operator's token
    anonymous = TestClient(rnd.apps[0]).post(f"/v1/studies/{study.study_id}/verify/commit")
    assert anonymous.status_code == 401
    # a study without validity has no round
    plain = make_study(validity=False)
    rnd.stores[0].provision(plain)
    ask = TestClient(rnd.apps[0]).post(f"/v1/studies/{plain.study_id}/verify/commit",
                                       headers={"Authorization": f"Bearer {AN}"})
    assert ask.status_code == 422 and "no validity" in ask.json()["detail"]


def test_uploads_close_at_the_commit_and_a_commit_needs_the_decision(rnd, study):
    proved = proved_batch(study, 150, seed=4)
    views, bad = tampered(study, proved)
    rnd.put(proved, views=views)
    store = rnd.stores[0]
    record = store.record(study.study_id)
    everything = messages.encode_report_ids(proved.report_ids)
    with pytest.raises(ProblemError) as refused:
        store.commit(study.study_id, everything)
    assert refused.value.slug == "verification-pending"
    rnd.call(0, "verify/commit")
    with pytest.raises(ProblemError) as closed:
        store.submit_upload(record, [b"\x01" * 16], np.zeros((1, 4), dtype=np.uint64))
    assert closed.value.slug == "uploads-closed" and closed.value.status == 409
    rnd.coordinator.verify(study.study_id)
    # an inclusion set with a refused report: 422 report-refused, nothing committed
    with pytest.raises(ProblemError) as refused:
        store.commit(study.study_id, everything)
    assert refused.value.slug == "report-refused" and refused.value.extra["refused"] == 3
    assert record.commit is None


def test_what_a_lying_analyzer_can_and_cannot_do(rnd, study):
    """The analyzer carries every verifier share, so it can tell a server any total. It can make
    a server refuse honest reports (a wrong sum): they drop, and past the batch rule that
    server refuses the commit. It can make a server accept the tampered reports (here: minus its
    own share, a total of zeros, which verifies), but only into the release it receives itself:
    the other servers, told the truth, refuse them, and each refuses a commit holding a report it
    refused, so an inclusion set is the intersection of what every server accepted. What it
    learns is tested over real servers (tests/test_validity_round_attacks.py: same law)."""
    proved = proved_batch(study, 130, seed=5)
    views, bad = tampered(study, proved)
    rnd.put(proved, views=views)
    co = rnd.coordinator
    plan = V.plan(study)
    commitments = [bytes.fromhex(s.verify_commit(study.study_id).commitment) for s in co.servers]
    contributions = [bytes.fromhex(s.verify_reveal(study.study_id, commitments).contribution) for s in co.servers]
    answers = [s.verify_query(study.study_id, contributions, plan) for s in co.servers]
    ids = answers[0][0]
    assert all((a[0] == ids).all() for a in answers)

    def others(j):
        out = None
        for i in range(3):
            if i != j:
                out = answers[i][1] if out is None else V.add_verifiers(out, answers[i][1])
        return out.copy()

    bodies = [others(j) for j in range(3)]
    position = {bytes(r): i for i, r in enumerate(ids)}
    forged = np.array([position[r] for r in bad])  # the tampered: server 2 is told minus its own share
    victims = np.array([i for i in range(len(ids)) if i not in forged][:20])  # 20 honest of 130: > 10 %
    bodies[1][victims, 0, 0] = field.add(bodies[1][victims, 0, 0], np.uint64(1))
    bodies[2][forged] = field.sub(np.zeros_like(answers[2][1][forged]), answers[2][1][forged])
    refused = [set(messages.split_ids(s.verify_decide(study.study_id, V.encode_verifiers(ids, bodies[j]))[0]))
               for j, s in enumerate(co.servers)]
    assert refused[0] == set(bad)
    assert refused[1] == set(bad) | {bytes(ids[i]) for i in victims}
    assert refused[2] == set()  # it accepted the three invalid reports: it is told what to decide
    # server 2 would commit them, but every other server refuses a set that holds them
    everything = messages.encode_report_ids(proved.report_ids)
    with pytest.raises(ProblemError) as no:
        rnd.stores[0].commit(study.study_id, everything)
    assert no.value.slug == "report-refused"
    # the victims: server 1 refuses any set with them, and the set without them leaves out
    # more than its batch rule allows (20 + 3 of 130 > 10 %)
    without = messages.encode_report_ids([r for r in proved.report_ids if r not in refused[1]])
    with pytest.raises(ProblemError) as no:
        rnd.stores[1].commit(study.study_id, without)
    assert no.value.slug == "inclusion-refused"


@BOTH_STORES
def test_a_restarted_server_keeps_its_contribution_seed_and_decisions(rnd, study):
    proved = proved_batch(study, 120, seed=6)
    views, bad = tampered(study, proved)
    rnd.put(proved, views=views)
    co = rnd.coordinator
    plan = V.plan(study)
    commitments = [bytes.fromhex(s.verify_commit(study.study_id).commitment) for s in co.servers]
    rnd.restart(0)
    again = [bytes.fromhex(s.verify_commit(study.study_id).commitment) for s in co.servers]
    assert again == commitments  # stored before it was answered
    contributions = [bytes.fromhex(s.verify_reveal(study.study_id, commitments).contribution) for s in co.servers]
    rnd.restart(1)
    before = co.servers[2].verify_query(study.study_id, contributions, plan)
    rnd.restart(2)
    after = co.servers[2].verify_query(study.study_id, contributions, plan)
    assert (before[0] == after[0]).all() and (before[1] == after[1]).all()  # the same query point
    common, _masks, _held = co.verify(study.study_id)
    first = rnd.stores[1].verification.round(rnd.stores[1].record(study.study_id))
    rnd.restart(1)
    assert co.verify(study.study_id)[0] == common
    second = rnd.stores[1].verification.round(rnd.stores[1].record(study.study_id))
    assert (first.query_seed, first.refused, first.decided) == (second.query_seed, second.refused, second.decided)
    assert set(messages.split_ids(second.refused)) == set(bad)
    assert first.query_seed == V.query_seed(study.study_id, contributions)


def test_a_server_that_lies_in_its_reveal_stops_the_round(rnd, study):
    """The analyzer checks every revealed contribution against its commitment: a server that
    answers another contribution (to steer the query point) stops the round before any query."""
    rnd.put(proved_batch(study, 110, seed=7))
    client = rnd.coordinator.servers[1]
    real = client.verify_reveal

    def lying(study_id, commitments):
        answer = real(study_id, commitments)
        return answer.model_copy(update={"contribution": "ab" * 32})

    client.verify_reveal = lying
    with pytest.raises(UpstreamError, match="does not open its commitment"):
        rnd.coordinator.verify(study.study_id)
    assert all(store.verification.round(store.record(study.study_id)).query_seed is None for store in rnd.stores)


def test_a_decision_body_made_a_chunk_at_a_time_is_the_whole_message(monkeypatch):
    """The analyzer sends each server the other servers' sum as total - own, made a chunk of
    reports at a time as httpx sends it (OthersBody): the bytes are exactly the verifier message
    of the others' sum, across chunk boundaries, again on a retry, with the length it declares."""
    from dpsketch.analyzer.coordinator import OthersBody

    rng = np.random.default_rng(5)
    m, v_len = 23, 4
    ids = np.sort(rng.integers(0, 256, size=(m, 16), dtype=np.uint8).view("V16").ravel()).view(np.uint8).reshape(m, 16)
    shares = [rng.integers(0, field.P, size=(m, v_len, 2), dtype=np.uint64) for _ in range(3)]
    total = field.add(field.add(shares[0], shares[1]), shares[2])
    monkeypatch.setattr(OthersBody, "CHUNK_REPORTS", 5)
    for j in range(3):
        others = [s for i, s in enumerate(shares) if i != j]
        expected = V.encode_verifiers(ids, field.add(others[0], others[1]))
        body = OthersBody(ids, total, shares[j])
        first, again = b"".join(body), b"".join(body)
        assert first == expected and again == expected and len(body) == len(expected)
        assert np.array_equal(V.decode_verifiers(first, v_len)[1], field.add(others[0], others[1]))
