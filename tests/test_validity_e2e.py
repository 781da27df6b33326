"""A validity study's data path over real processes (docs/protocol.md section 4c): the SDK over
HTTP, real share servers on SQLite, a real analyzer process creating and finalizing the study
(its finalize runs the verification round, section 6d: every honest report here passes it).

* N = 2 and N = 3, plaintext and sealed: every batch is seed-compressed with the leader rotating
  over the servers, and the release is exactly the ring sketch of the reports' encoded vectors,
  reconstructed in this process from the very shares the SDK sent (their F_p coordinate shares
  added and centred), so the analyzer's ridge answer equals this process's to float precision.
  A histogram study with proofs likewise releases exactly its noisy counts.
* A server SIGKILLed mid-study and restarted (its totals rebuilt from the stored payloads)
  releases the same aggregate, and reports one server lacks are excluded exactly.
* A rerun after an incomplete upload rebuilds the same proved batches (the journal).
* Malformed uploads of a validity study (wrong width, a value >= p, a tampered input share,
  blocks, a single JSON report, a truncated seed batch, a sealed batch of the wrong width, random
  bodies) get 4xx problems and change nothing; the SDK refuses blocks and single JSON itself and
  sends a single row as one-record batches.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.analyzer.estimators import RidgeRegression
from dpsketch.analyzer.release import release_from_ring_sum
from dpsketch.client_sdk import Client, SDKError
from conftest import OPEN_UPLOADS, Servers
from dpsketch.protocol import envelope, features, field, messages, proved_shares, ring, sketch, validity
from dpsketch.protocol.messages import BLOCKS_MEDIA_TYPE, SEALED_MEDIA_TYPE, SEEDS_MEDIA_TYPE, SHARES_MEDIA_TYPE
from dpsketch.protocol.study import Study
from studies import bind_at, record_batches
from test_e2e import NO_FLOOR_POLICY
from dpsketch.tools.cluster import analyzer, share_server, start_all

COLUMNS = ["x0", "x1", "x2", "y"]
API_TOKEN = "analyst-api-token"


class Pool:
    """Three real share servers (no floor required: a study without server noise releases exact
    sums) and two real analyzer processes, over the first two of them and over all three."""

    def __init__(self, workdir: Path):
        self.servers = Servers(workdir)
        self.workdir = workdir
        self.specs = [self.servers.spec(f"s{j + 1}") for j in range(3)]
        self.procs = [share_server(spec, workdir, {**OPEN_UPLOADS, **NO_FLOOR_POLICY}) for spec in self.specs]
        self.servers.started.extend(self.procs)
        start_all(self.procs)
        self.analyzers = {}
        for n in (2, 3):
            config = {"servers": [{"server_id": s.server_id, "url": p.url, "analyst_token": s.analyst_token}
                                  for s, p in zip(self.specs[:n], self.procs[:n])], "api_token": API_TOKEN}
            path = workdir / f"cluster-{n}.json"
            path.write_text(json.dumps(config))
            (workdir / f"a{n}").mkdir()
            self.analyzers[n] = analyzer(path, workdir / f"analyzer-{n}.sqlite3", workdir / f"a{n}")
            self.servers.started.append(self.analyzers[n])
        start_all(list(self.analyzers.values()))

    def urls(self, n: int) -> list[str]:
        return [p.url for p in self.procs[:n]]

    def analyst(self, n: int) -> AnalyzerClient:
        return AnalyzerClient(self.analyzers[n].url, API_TOKEN)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("validity"))
    try:
        yield p
    finally:
        p.servers.stop_all()


def create(pool: Pool, n_servers: int, n_rows: int, name: str, **extra) -> Study:
    floor = extra.pop("floor", False)
    args = dict(name=name, columns=COLUMNS, label="y", expected_reports=n_rows, k=16, s=4,
                min_reports=n_rows - 300, epsilon_floor=None, validity=True) | extra
    args = {key: value for key, value in args.items() if value is not None or key in ("label", "epsilon_floor")}
    with pool.analyst(n_servers) as an:
        study = Study.model_validate(an.create_study(**args)["study"])
    assert study.validity == validity.PREDICATE and (floor or study.server_sigma == 0)
    return study


def finalize(pool: Pool, n_servers: int, study: Study) -> dict:
    with pool.analyst(n_servers) as an:
        fin = an.finalize(study.study_id)
        assert fin["state"] == "released", fin
        return fin | {"sketch": an.sketch(study.study_id)}


def decoded(study: Study, ring_sum: np.ndarray) -> np.ndarray:
    """What the analyzer serves of a ring sum (GET .../sketch): decoded and scaled."""
    return np.asarray(release_from_ring_sum(study, ring_sum, 1).values if study.kind == "histogram"
                      else ring.decode(ring_sum, study.frac_bits) * sketch.scale(study.s))


def data(n: int, seed: int) -> np.ndarray:
    """Rows [x, y], y = x . theta + noise, scaled into the unit ball (test data; the privacy noise
    comes from the SDK's CSPRNG)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, 3))
    rows = np.column_stack([x, x @ np.array([0.8, -0.5, 0.3]) + 0.1 * rng.normal(size=n)])
    return 0.95 * rows / np.linalg.norm(rows, axis=1).max()


def encoded_vectors(study: Study, batch) -> np.ndarray:
    """The (m, w) ring encodings of a sent batch's noisy vectors, from the shares the SDK sent:
    every server's F_p coordinate shares added, centred (validity.to_ring)."""
    plan = validity.plan(study)
    total = None
    for j in range(study.n_servers):
        coords = validity.coordinate_shares(plan, batch.share(j)[:, :plan.input_len])
        total = coords if total is None else field.add(total, coords)
    return validity.to_ring(total)


def ring_sketch(study: Study, sent, include: set[bytes] | None = None) -> np.ndarray:
    """S(A + G) in the ring over the sent reports (or those in ``include``), in this process."""
    total = np.zeros((study.k, study.width), dtype=np.uint64)
    for batch in sent:
        keep = [i for i, rid in enumerate(batch.report_ids) if include is None or rid in include]
        rows, signs = study.hash_report_ids([batch.report_ids[i] for i in keep])
        sketch.accumulate(total, rows, signs, encoded_vectors(study, batch)[keep])
    return total


def held(url: str, token: str, study: Study) -> bytes:
    r = httpx.get(f"{url}/v1/studies/{study.study_id}/report-ids", headers={"Authorization": f"Bearer {token}"},
                  timeout=30)
    assert r.status_code == 200, r.text
    return r.content


@pytest.mark.parametrize("n_servers,sealed", [(2, False), (3, False), (2, True), (3, True)],
                         ids=["N2-plain", "N3-plain", "N2-sealed", "N3-sealed"])
def test_release_is_the_sketch_of_the_sent_shares_and_ridge_agrees(pool, monkeypatch, n_servers, sealed):
    n = 2000
    study = create(pool, n_servers, n, f"v-{n_servers}-{sealed}")
    rows = data(n, seed=n_servers + 10 * sealed)
    sent = record_batches(monkeypatch)
    with Client(pool.urls(n_servers), encrypt=sealed) as client:
        result = client.submit_many(study.study_id, rows, batch_size=500)
    assert result.n_reports == n and len(sent) == 4
    plan = validity.plan(study)
    # every batch seed-compressed, the leader rotating: each server took explicit shares of some batch
    leaders = [[j for j in range(n_servers) if b.seeds[j] is None] for b in sent]
    assert leaders == [[i % n_servers] for i in range(4)]
    assert all(b.shares[lead[0]].shape == (500, plan.leader_width) for b, lead in zip(sent, leaders))

    fin = finalize(pool, n_servers, study)
    assert fin["n_reports"] == n
    expected = ring_sketch(study, sent)
    np.testing.assert_array_equal(np.array(fin["sketch"]["sketch"]), decoded(study, expected))  # exact

    # the decode is the ring's: the noisy vectors carry the rows (times a secret sign) plus noise of
    # the calibrated size, so the release describes the data
    vectors = ring.decode(np.concatenate([encoded_vectors(study, b) for b in sent]), study.frac_bits)
    noise_var = (np.sum(vectors ** 2) - np.sum(rows ** 2)) / rows.size
    assert np.sqrt(noise_var) == pytest.approx(study.sigma, rel=0.1)

    with pool.analyst(n_servers) as an:
        served = np.array(an.ridge(study.study_id, label="y")["coef"])
    local = RidgeRegression(label="y").fit(release_from_ring_sum(study, expected, n)).coef_
    np.testing.assert_allclose(served, local, rtol=1e-9, atol=1e-12)
    assert np.all(np.isfinite(served))


def test_histogram_study_with_proofs_releases_its_noisy_counts_exactly(pool, monkeypatch):
    """A histogram study with proofs (circuit OneHotNorm: the SDK proves the one-hot cell apart
    from the noise), sealed: the analyzer's counts are the sums of the sent shares plus the two
    servers' floor noise (F_p noise of the study's server_sigma), and within the noise of the true
    counts. (With epsilon_floor=None, design() makes a histogram study with proofs whose sigma
    misses its epsilon by 1%: validity.py's tail charge; so this one has a floor.)"""
    n = 1500
    spec = {"axes": [{"column": "age", "edges": [0, 20, 40, 60, 80]}]}
    study = create(pool, 2, n, "v-hist", kind="histogram", histogram=spec, columns=["age"], label=None,
                   k=None, s=None, epsilon_floor=4.0, floor=True)
    assert study.kind == "histogram" and study.server_sigma > 0
    ages = np.random.default_rng(51).uniform(0, 80, (n, 1))
    sent = record_batches(monkeypatch)
    with Client(pool.urls(2), encrypt=True) as client:
        assert client.submit_many(study.study_id, ages, batch_size=500).n_reports == n
    with pool.analyst(2) as an:
        assert an.finalize(study.study_id)["state"] == "released"
        served = an.histogram(study.study_id)
    expected = release_from_ring_sum(study, ring_sketch(study, sent), n).values
    counts = np.array(served["counts"], dtype=float).reshape(-1)
    floor_noise = counts - expected  # the servers' noise alone: on the grid, of the floor's size
    assert np.all(np.abs(floor_noise) < 6 * np.sqrt(2) * study.server_sigma) and np.any(floor_noise != 0)
    truth = np.bincount(study.histogram.cell_index(ages), minlength=study.width)
    assert np.all(np.abs(counts - truth) < 6 * np.sqrt(served["noise_variance"])), (counts, truth)


@pytest.mark.parametrize("kind,sealed", [("gram", False), ("moments", True)])
def test_gram_and_moments_studies_with_proofs_release_the_sent_features_exactly(pool, monkeypatch, kind, sealed):
    """Circuit GramNorm (docs/validity.md section 12): the SDK shares the raw products with their
    noise scaled alike and proves them products of a row of bounded norm; every report passes the
    round, and the release is exactly the sum of the sent shares, divided per column by the
    proved scale (the strict upper triangle times sqrt(2)), so that the analyzer's ridge equals
    this process's and lies within the noise of the data's."""
    n = 1500
    # a gram study by the analyzer's auto kind (the most accurate kind at d = 4 takes proofs now)
    study = create(pool, 2, n, f"v-{kind}", kind=None if kind == "gram" else kind, k=None, s=None)
    assert study.kind == kind and study.k == 1 and study.proved_features
    rows = data(n, seed=61)
    sent = record_batches(monkeypatch)
    with Client(pool.urls(2), encrypt=sealed) as client:
        assert client.submit_many(study.study_id, rows, batch_size=500).n_reports == n
    fin = finalize(pool, 2, study)
    assert fin["n_reports"] == n
    expected = ring_sketch(study, sent)
    release = release_from_ring_sum(study, expected, n)
    np.testing.assert_array_equal(np.array(fin["sketch"]["sketch"]).reshape(-1), release.values)  # exact
    # the release is the features of a study without proofs: the products' sum, scaled back,
    # within the noise of n reports (sigma per coordinate in the release's units)
    want = features.client_vectors(kind, rows).sum(axis=0)
    z = (release.values - want) / (study.sigma * np.sqrt(n))
    assert np.abs(z).max() < 5.5
    with pool.analyst(2) as an:
        served = np.array(an.ridge(study.study_id, label="y")["coef"])
    local = RidgeRegression(label="y").fit(release).coef_
    np.testing.assert_allclose(served, local, rtol=1e-9, atol=1e-12)


def test_l1_study_with_proofs_releases_the_l1_sketch_of_the_sent_shares(pool, monkeypatch):
    """An l1 study (docs/lad.md) with proofs: its clients prove the sketch predicate (NormBound:
    the row within the bound plus the noise allowance), the servers sum the proved F_p shares
    through the l1 sketch (s + 1 entries a report), and the release is that sketch of the sent
    shares plus the two servers' floor noise (the l1 kind needs server noise for the discrete
    argument)."""
    n = 8500  # an l1 study needs 256 reports in each of its 32 level-0 buckets
    study = create(pool, 2, n, "v-l1", kind="l1", k=None, s=None, epsilon_floor=4.0, floor=True)
    assert study.kind == "l1" and study.server_sigma > 0 and validity.plan(study).circuit.name == "NormBound"
    rows = data(n, seed=71)
    sent = record_batches(monkeypatch)
    with Client(pool.urls(2)) as client:
        assert client.submit_many(study.study_id, rows, batch_size=2125).n_reports == n
    fin = finalize(pool, 2, study)
    assert fin["n_reports"] == n and fin["verification"]["refused"] == 0
    served = np.array(fin["sketch"]["sketch"])
    expected = ring.decode(ring_sketch(study, sent), study.frac_bits) * study.entry_scale
    floor_noise = served - expected  # the servers' noise alone
    assert np.all(np.abs(floor_noise) < 6 * np.sqrt(2) * study.server_noise_std) and np.any(floor_noise != 0)


def test_sigkilled_server_restarts_and_releases_the_same_aggregate(pool, monkeypatch):
    n1, n2, partial = 1200, 800, 60
    study = create(pool, 3, n1 + n2 + partial, "v-kill")
    sent = record_batches(monkeypatch)
    urls = pool.urls(3)
    with Client(urls) as client:
        client.submit_many(study.study_id, data(n1, seed=21), batch_size=400)
    victim = pool.procs[1]
    victim.kill()
    assert victim.proc.returncode == -9
    victim.start()  # same port, same SQLite file: its totals are rebuilt from the stored payloads
    with Client(urls) as client:
        client.submit_many(study.study_id, data(n2, seed=22), batch_size=400)
    # reports that reach s1 and s3 only: excluded everywhere at the commit (taken out of the totals)
    from dpsketch.client_sdk.prepare import prepare_batch

    extra = prepare_batch(study, data(partial, seed=23), full=0)
    for j in (0, 2):
        r = httpx.post(f"{urls[j]}/v1/studies/{study.study_id}/batches", content=extra.body(j),
                       headers={"Content-Type": extra.media_type(j)}, timeout=30)
        assert r.status_code == 200, r.text
    fin = finalize(pool, 3, study)
    assert fin["n_reports"] == n1 + n2
    np.testing.assert_array_equal(np.array(fin["sketch"]["sketch"]), decoded(study, ring_sketch(study, sent)))


class FailingAt(httpx.HTTPTransport):
    """Answers 503 to every batch upload to one port after ``ok`` of them went through."""

    def __init__(self, port: int, ok: int):
        super().__init__()
        self.port, self.ok = port, ok

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.port == self.port and request.url.path.endswith("/batches"):
            if self.ok <= 0:
                return httpx.Response(503, json={"type": "urn:dpsketch:problem:unavailable", "title": "x",
                                                 "status": 503, "detail": "injected"})
            self.ok -= 1
        return super().handle_request(request)


def test_a_rerun_after_an_incomplete_upload_rebuilds_the_same_reports(pool, monkeypatch, tmp_path):
    """Exactly once (client_sdk/journal.py) for a validity study: the rerun rebuilds the same
    proved batches byte for byte (the journal keys noise, shares, salts and proofs), so every
    server holds each row once and the release is the sketch of one copy of each."""
    from dpsketch.client_sdk import IncompleteUpload

    n = 1200
    study = create(pool, 3, n, "v-resume")
    rows = data(n, seed=41)
    sent = record_batches(monkeypatch)
    urls = pool.urls(3)
    with Client(urls, transport=FailingAt(pool.procs[2].port, 1), max_retries=0, journal=tmp_path) as client:
        with pytest.raises(IncompleteUpload):
            client.submit_many(study.study_id, rows, batch_size=300)
    first_run = len(sent)
    first = {b.report_ids[0]: b for b in sent}
    with Client(urls, journal=tmp_path) as client:
        result = client.submit_many(study.study_id, rows, batch_size=300)
    assert result.n_reports == n and result.skipped >= 300  # batch 0 reached every server
    rebuilt = [b for b in sent[first_run:] if b.report_ids[0] in first]
    assert rebuilt  # batch 0 at least (a rerun rebuilds it to check the journal)
    for batch in rebuilt:  # the first run's batch, byte for byte: ids, seeds, leader shares, proofs
        assert all(first[batch.report_ids[0]].body(j) == batch.body(j) for j in range(3))
    for url, spec in zip(urls, pool.specs):
        assert len(held(url, spec.analyst_token, study)) == 16 * n
    once = list({b.report_ids[0]: b for b in sent}.values())
    fin = finalize(pool, 3, study)
    np.testing.assert_array_equal(np.array(fin["sketch"]["sketch"]), decoded(study, ring_sketch(study, once)))


def test_malformed_validity_uploads_get_4xx_and_change_nothing(pool, monkeypatch):
    n = 600
    study = create(pool, 3, n, "v-bad")
    plan = validity.plan(study)
    urls = pool.urls(3)
    sent = record_batches(monkeypatch)
    with Client(urls) as client:
        client.submit_many(study.study_id, data(n - 1, seed=31), batch_size=300)
        # a single row: one-record batches (a validity study takes no single-report JSON)
        client.submit(study.study_id, data(1, seed=32)[0])
        with pytest.raises(SDKError, match="has no part"):
            client.submit_blocks(study.study_id, "p", data(2, seed=33)[:, :2], party_key=bytes(32), keys=["a", "b"])
    with pytest.raises(ValueError, match="no single-report JSON"):
        sent[0].report(0)
    before = [held(u, s.analyst_token, study) for u, s in zip(urls, pool.specs)]
    assert all(len(h) == 16 * n for h in before)

    from dpsketch.client_sdk.prepare import prepare_batch

    fresh = prepare_batch(study, data(4, seed=34), full=0)  # server 0 leads it
    leader = fresh.shares[0]
    sid = study.study_id

    def post(j: int, body: bytes, media_type: str) -> httpx.Response:
        return httpx.post(f"{urls[j]}/v1/studies/{sid}/batches", content=body, headers={"Content-Type": media_type},
                          timeout=30)

    attempts = []
    # a share batch of the study's width (a ring share, bound), not the leader's n + P
    ring_shares = np.frombuffer(np.random.default_rng(0).bytes(8 * 4 * study.width), dtype="<u8").reshape(4, -1)
    ids, proofs = bind_at(study, 0, ring_shares)
    attempts.append((0, messages.encode_batch(ids, proofs, ring_shares), SHARES_MEDIA_TYPE, 400, "malformed-body"))
    # a proof-share value >= p (the id binds only the input share: the field check refuses it)
    bad = leader.copy()
    bad[1, plan.input_len + 2] = np.uint64(field.P + 5)
    attempts.append((0, messages.encode_batch(fresh.report_ids, fresh.proofs[0], bad), SHARES_MEDIA_TYPE, 400,
                     "malformed-body"))
    # an input share changed after binding
    bad = leader.copy()
    bad[2, 0] = (int(bad[2, 0]) + 1) % field.P
    attempts.append((0, messages.encode_batch(fresh.report_ids, fresh.proofs[0], bad), SHARES_MEDIA_TYPE, 422,
                     "binding-refused"))
    # the leader's explicit shares sent to a helper's position
    attempts.append((1, fresh.body(0), SHARES_MEDIA_TYPE, 422, "binding-refused"))
    # a seed batch cut short
    attempts.append((1, fresh.body(1)[:-7], SEEDS_MEDIA_TYPE, 400, "malformed-body"))
    # blocks: a validity study has no parties
    attempts.append((0, fresh.body(0), f"{BLOCKS_MEDIA_TYPE}; party=p", 415, "unsupported-media-type"))
    # a sealed batch of ring shares of the study's width
    with Client(urls, encrypt=True) as sealer:
        sealer.study(sid)
        recipient = sealer._recipients[sid][0]
    plain = messages.encode_batch(ids, proofs, ring_shares)
    sealed = envelope.seal_body(recipient, sid, plain, SHARES_MEDIA_TYPE, study.width, study.n_servers)
    attempts.append((0, sealed, SEALED_MEDIA_TYPE, 400, "malformed-body"))
    for j, body, media_type, status, slug in attempts:
        r = post(j, body, media_type)
        assert (r.status_code, r.json()["type"]) == (status, f"urn:dpsketch:problem:{slug}"), (media_type, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")

    # single-report JSON: refused at any width (the fast path hands it to the route, which says why)
    for width in (study.width, plan.leader_width):
        share = leader[0, :width] if width <= plan.leader_width else leader[0]
        body = {"report_id": fresh.report_ids[0].hex(), "proof": base64.b64encode(fresh.proofs[0][0].tobytes()).decode(),
                "share": base64.b64encode(np.ascontiguousarray(share, dtype="<u8").tobytes()).decode()}
        r = httpx.post(f"{urls[0]}/v1/studies/{sid}/reports", json=body, timeout=30)
        assert r.status_code == 415 and "binary batches" in r.json()["detail"], r.text

    # random bodies, of random lengths and of whole records of either kind: 4xx, never 5xx
    rng = np.random.default_rng(35)
    sizes = {SHARES_MEDIA_TYPE: messages.record_bytes(SHARES_MEDIA_TYPE, plan.leader_width, 3),
             SEEDS_MEDIA_TYPE: messages.record_bytes(SEEDS_MEDIA_TYPE, plan.leader_width, 3),
             SEALED_MEDIA_TYPE: 1 + len(sealed) // 4}
    statuses = []
    for media_type, record in sizes.items():
        for _ in range(12):
            length = int(rng.integers(1, 3)) * record if rng.random() < 0.5 else int(rng.integers(0, 3 * record))
            statuses.append(post(int(rng.integers(0, 3)), rng.bytes(length), media_type).status_code)
    assert all(400 <= code < 500 for code in statuses), statuses

    assert [held(u, s.analyst_token, study) for u, s in zip(urls, pool.specs)] == before  # nothing changed
    fin = finalize(pool, 3, study)
    assert fin["n_reports"] == n
    np.testing.assert_array_equal(np.array(fin["sketch"]["sketch"]), decoded(study, ring_sketch(study, sent)))
    assert proved_shares.upload_width(study) == plan.leader_width
