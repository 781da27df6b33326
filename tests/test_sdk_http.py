"""Client SDK over real HTTP against real share-server processes (the ``servers`` fixture).

Checks the contract of docs/protocol.md from the client's side: studies are provisioned with
each server's operator token, rows are submitted one by one and in bulk, every server ends up
with the same report ids counted once, a mismatched server list is refused before any share
leaves the client, and a retried upload is acknowledged without being counted twice.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from dpsketch.client_sdk import Client, ProblemError, StudyMismatch, cli, prepare_batch
from dpsketch.protocol.report import clip_rows
from dpsketch.protocol import messages, ring
from dpsketch.protocol.study import design

from conftest import Servers

SERVER_IDS = ["s1", "s2", "s3"]
COLUMNS = ["x1", "x2", "y"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three share servers s1, s2, s3 (started in parallel); returns [(spec, process)] in order.

    Shared by the module's tests: each provisions studies of its own (random seeds, so distinct
    ids) and looks only at those, never at a server's global state."""
    servers = Servers(tmp_path_factory.mktemp("sdk-http"))
    try:
        specs = [servers.spec(sid) for sid in SERVER_IDS]
        with ThreadPoolExecutor(len(specs)) as pool:
            procs = list(pool.map(servers.start, specs))
        yield list(zip(specs, procs))
    finally:
        servers.stop_all()


def urls(cluster, order=(0, 1, 2)):
    return [cluster[i][1].url for i in order]


def make_study(name="http", servers=SERVER_IDS, **kw):
    kw.setdefault("expected_reports", 3_000)
    kw.setdefault("k", 8)
    kw.setdefault("s", 2)
    kw.setdefault("min_reports", 1_000)
    study, _ = design(name=name, columns=COLUMNS, label="y", servers=list(servers), **kw)
    return study


def provision(cluster, study, which=(0, 1, 2)):
    for i in which:
        spec, proc = cluster[i]
        r = httpx.put(f"{proc.url}/v1/studies/{study.study_id}", json=study.model_dump(mode="json"),
                      headers={"Authorization": f"Bearer {spec.operator_token}"}, timeout=30)
        assert r.status_code in (200, 201), r.text


def counts(cluster, study):
    out = []
    for _, proc in cluster:
        r = httpx.get(f"{proc.url}/v1/studies/{study.study_id}", timeout=30)
        out.append(r.json()["report_count"] if r.status_code == 200 else None)
    return out


def held_ids(cluster, study):
    out = []
    for spec, proc in cluster:
        r = httpx.get(f"{proc.url}/v1/studies/{study.study_id}/report-ids", timeout=30,
                      headers={"Authorization": f"Bearer {spec.analyst_token}"})
        assert r.status_code == 200, r.text
        out.append(messages.decode_report_ids(r.content))
    return out


def test_single_and_bulk_submissions_are_held_once_by_every_server(cluster):
    study = make_study()
    provision(cluster, study)
    rows = np.random.default_rng(1).normal(size=(2_500, 3))  # test data
    seen = []
    with Client(urls(cluster)) as client:
        assert client.study(study.study_id) == study
        first = client.submit(study.study_id, {"y": 1.0, "x1": 0.5, "x2": -0.5})
        ids = client.submit_many(study.study_id, rows, batch_size=1_000, progress=seen.append)
        assert client.report_counts(study.study_id) == {"s1": 2_501, "s2": 2_501, "s3": 2_501}
    assert counts(cluster, study) == [2_501] * 3
    assert sum(seen) == 2_500 and ids.n_reports == 2_500 and len(ids) == 2_500
    expected = sorted(bytes.fromhex(h) for h in [first, *ids])
    assert held_ids(cluster, study) == [expected] * 3


def test_shares_sum_to_the_noisy_rows_end_to_end(cluster):
    """k = 1: commit, fetch the 3 aggregate shares, add them: the plain sum of the clipped rows
    plus noise of std sqrt(n sigma^2 + N server_sigma^2) (the clients' noise and, the default
    design having a floor, each server's own) - so encoding, sharing and the wire format agree."""
    study = make_study(name="sum", k=1, s=1, expected_reports=600, min_reports=500)
    provision(cluster, study)
    rng = np.random.default_rng(2)  # test data
    rows = rng.normal(loc=[0.5, -0.3, 0.2], scale=0.2, size=(600, 3))
    with Client(urls(cluster)) as client:
        sent = client.submit_many(study.study_id, rows, batch_size=128)
    ids = held_ids(cluster, study)
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 600
    # what the SDK says it stored is what the servers hold
    assert sent.n_reports == 600 and sorted(bytes.fromhex(i) for i in sent) == sorted(ids[0])
    assert set(sent.report_counts.values()) == {600} and not any(sent.duplicates.values())
    body = messages.encode_report_ids(ids[0])
    shares = []
    for spec, proc in cluster:
        auth = {"Authorization": f"Bearer {spec.analyst_token}"}
        r = httpx.post(f"{proc.url}/v1/studies/{study.study_id}/commit", content=body, timeout=60,
                       headers={**auth, "Content-Type": messages.REPORT_IDS_MEDIA_TYPE})
        assert r.status_code == 200, r.text
        r = httpx.get(f"{proc.url}/v1/studies/{study.study_id}/aggregate", headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        shares.append(messages.decode_aggregate(r.content, 1, 3))
    total = ring.decode(ring.reconstruct(shares), study.frac_bits)[0]
    truth = clip_rows(rows, study.row_bound).sum(axis=0)
    assert study.server_sigma > 0  # k = s = 1: the released cell is the sum, no 1/sqrt(s) scale
    std = np.sqrt(600 * study.sigma**2 + study.n_servers * study.server_sigma**2)
    assert np.all(np.abs(total - truth) < 6 * std), (total, truth, std)
    # after the commit the client gets study-closed, not a silent drop
    with Client(urls(cluster)) as client, pytest.raises(ProblemError) as err:
        client.submit(study.study_id, [0, 0, 0])
    assert err.value.slug == "study-closed"


def test_mismatched_servers_are_refused_before_any_share_is_sent(cluster):
    study = make_study(name="A")
    provision(cluster, study)
    other = make_study(name="B", servers=["s2", "s1", "s3"])  # same servers, another order
    provision(cluster, other)
    rows = np.zeros((10, 3))

    def refused(exc, match, order_or_urls, call):
        given = order_or_urls if isinstance(order_or_urls[0], str) else urls(cluster, order_or_urls)
        with pytest.raises(exc, match=match) as err:
            with Client(given) as client:
                call(client)
        return err.value

    refused(StudyMismatch, "URL 1 .* is server 's2'", (1, 0, 2),
            lambda c: c.submit_many(study.study_id, rows))
    refused(StudyMismatch, "URL 1 .* is server 's1'.*'s2'", (0, 1, 2),
            lambda c: c.submit(other.study_id, [0, 0, 0]))
    refused(StudyMismatch, "listed twice", (0, 0, 2), lambda c: None)
    alias = cluster[0][1].url.replace("127.0.0.1", "localhost")  # s1 under a second name
    refused(StudyMismatch, "is server 's1'", [cluster[0][1].url, alias, cluster[2][1].url],
            lambda c: c.submit(study.study_id, [0, 0, 0]))
    refused(StudyMismatch, "3 servers .* 2 URLs", urls(cluster)[:2],
            lambda c: c.submit(study.study_id, [0, 0, 0]))
    # a study that one server does not hold
    partial = make_study(name="C")
    provision(cluster, partial, which=(0, 1))
    err = refused(ProblemError, "unknown-study", (0, 1, 2),
                  lambda c: c.submit_many(partial.study_id, rows))
    assert err.slug == "unknown-study" and err.url == cluster[2][1].url
    assert counts(cluster, study) == [0, 0, 0]
    assert counts(cluster, other) == [0, 0, 0]
    assert counts(cluster, partial) == [0, 0, None]


class LoseFirstBatchAnswer(httpx.HTTPTransport):
    """Delivers the first batch upload to server ``victim`` but drops the answer (a timeout
    after the server stored it): the client must retry, and the server must not count twice."""

    def __init__(self, victim: str):
        super().__init__()
        self.victim, self.dropped, self.batch_posts = victim, 0, 0

    def handle_request(self, request):
        response = super().handle_request(request)
        if request.url.path.endswith("/batches") and f":{request.url.port}" in self.victim:
            self.batch_posts += 1
            if not self.dropped:
                response.read()
                response.close()
                self.dropped += 1
                raise httpx.ReadTimeout("answer lost", request=request)
        return response


def test_a_retried_batch_is_not_counted_twice(cluster):
    study = make_study()
    provision(cluster, study)
    transport = LoseFirstBatchAnswer(cluster[1][1].url)
    with Client(urls(cluster), transport=transport, backoff=0.01) as client:
        ids = client.submit_many(study.study_id, np.ones((300, 3)), batch_size=100)
    assert transport.dropped == 1 and transport.batch_posts == 4  # 3 batches + 1 retry
    assert ids.duplicates == {"s1": 0, "s2": 100, "s3": 0}
    assert counts(cluster, study) == [300, 300, 300]

    # the same batch sent again, explicitly: acknowledged, not recounted
    batch = prepare_batch(study, np.zeros((50, 3)))
    with Client(urls(cluster)) as client:
        for j in range(3):
            first = client._upload_batch(j, study, study.study_id, batch.body(j))
            again = client._upload_batch(j, study, study.study_id, batch.body(j))
            assert (first.accepted, first.duplicates) == (50, 0)
            assert (again.accepted, again.duplicates, again.report_count) == (0, 50, 350)
        # the same ids with other shares (and their own proofs): the ids do not commit to those
        # shares, so the binding refuses the whole batch, its 40 new reports too; nothing stored
        before = held_ids(cluster, study)
        other = prepare_batch(study, np.zeros((50, 3)))
        other.report_ids[:10] = batch.report_ids[:10]
        with pytest.raises(ProblemError) as err:
            client._upload_batch(0, study, study.study_id, other.body(0))
        assert err.value.slug == "binding-refused" and err.value.status == 422
        assert batch.report_ids[0].hex() in str(err.value)
        # ... and with the victims' own proofs: still not the shares the ids commit to
        other.proofs[0][:10] = batch.proofs[0][:10]
        with pytest.raises(ProblemError) as err:
            client._upload_batch(0, study, study.study_id, other.body(0))
        assert err.value.slug == "binding-refused" and err.value.status == 422
        assert held_ids(cluster, study) == before
    assert counts(cluster, study) == [350, 350, 350]


def test_command_line_submit(cluster, tmp_path: Path, capsys):
    study = make_study()
    provision(cluster, study)
    csv = tmp_path / "rows.csv"
    lines = ["y,x2,x1"] + [f"{i % 7},{i % 3},{i % 5}" for i in range(1_234)]
    csv.write_text("\n".join(lines) + "\n")
    code = cli.main(["--study", study.study_id, "--servers", ",".join(urls(cluster)),
                     "--batch-size", "500", str(csv)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "submitted 1234 rows" in out.out
    assert counts(cluster, study) == [1_234] * 3
    # wrong order: one line, non-zero, nothing sent
    code = cli.main(["--study", study.study_id, "--servers", ",".join(urls(cluster, (2, 1, 0))),
                     "--quiet", str(csv)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err and "order" in err
    # a bad cell near the end: refused before anything is sent
    csv.write_text("\n".join(lines + ["1,2,oops"]) + "\n")
    code = cli.main(["--study", study.study_id, "--servers", ",".join(urls(cluster)), "-q", str(csv)])
    err = capsys.readouterr().err
    assert code == 1 and "line 1236, column x1: 'oops' is not a number" in err
    assert counts(cluster, study) == [1_234] * 3


def test_dpsketch_submit_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "dpsketch.tools.cli", "submit", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--servers" in r.stdout
