"""Sealed batch proof records (docs/sealing.md section 3b, docs/protocol.md section 4d "Sealed";
issue 40): a batch record sealed as a version 4 batch of one record, content 0x05 (the leader's)
or 0x06 (a helper's), its clear id the batch id.

* The core (no servers): a record seals and opens back to its bytes, clear id and media type;
  what is refused before any key is used (count 2, a helper's wrong length, another content)
  and what does not open (another server's body, a flipped bit).
* Three real share servers (SQLite) and a real analyzer: ``Client(encrypt=True).submit_many``
  seals every record (each server's request is ``application/x-dpsketch-sealed`` of content
  0x05 or 0x06: the bodies are watched in the client's transport), every server holds every
  row, and the analyzer's round decides and releases them all (classical, and post-quantum
  when this installation has ML-KEM).
* Refusals, each at a real server with nothing stored (its report ids unchanged): a clear id
  that is not the batch id (422 binding-refused), content 0x05 at a helper (400), 0x05 or 0x06
  to a study without batch_proofs (400), count 2 (400), a token with less room than m (403,
  after opening), a token with no room left (403 before opening: a body that would not open
  gets the 403, not the 422), a tampered ciphertext (422 sealed-share-refused). A record sealed
  again with fresh randomness is the same batch: acknowledged as a duplicate, also with a token
  that has no room left; a sealed submission interrupted (one server's first request fails) and
  run again from its journal stores every row once at every server.

Flakes: the rows are fixed (seeded); noise, shares, proofs and sealing use the CSPRNG. An honest
batch is refused with probability <= 2^-96 a row and a batch (tests/test_batch_e2e.py); a random
clear id equals the batch id with probability 2^-128. Nothing is timed.
"""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest

from dpsketch.client_sdk import Client, IncompleteUpload, ProblemError
from dpsketch.protocol import batch_records, envelope, messages, report
from dpsketch.protocol.study import Study
from dpsketch.services.admin import ServerAdmin
from test_validity_e2e import Pool, create, data, finalize, held

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("sealed-batch"))
    try:
        yield p
    finally:
        p.servers.stop_all()


def _recipient(url: str, server_id: str, suite: envelope.SealingSuite = envelope.CLASSICAL) -> envelope.Recipient:
    hpke = httpx.get(f"{url}/v1/info", timeout=30).json()["hpke"]
    keys = hpke if suite is envelope.CLASSICAL else hpke["post_quantum"]
    public = bytes.fromhex(next(k["public_key"] for k in keys["keys"] if k["key_id"] == keys["current"]))
    return envelope.Recipient(server_id, public, suite)


def _post(url: str, study: Study, body: bytes, token: str | None = None) -> httpx.Response:
    headers = {"Content-Type": messages.SEALED_MEDIA_TYPE}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body, headers=headers, timeout=120)


def _sealed(pool: Pool, study: Study, batch: report.ProofBatch, j: int) -> bytes:
    media_type, body = batch.records[j]
    return batch_records.seal(_recipient(pool.urls(3)[j], study.servers[j]), study.study_id, media_type, body,
                              study.n_servers)


def _held(pool: Pool, study: Study, j: int) -> bytes:
    return held(pool.urls(3)[j], pool.specs[j].analyst_token, study)


def _problem(r: httpx.Response, status: int, slug: str) -> str:
    assert r.status_code == status and r.json()["type"].endswith(slug), r.text
    return r.json()["detail"]


# --- the core ------------------------------------------------------------------------------------


def _keys(server_id: str = "s1"):
    private = envelope.generate_private_key()
    recipient = envelope.Recipient(server_id, envelope.public_key_of(private))
    loaded = envelope.CLASSICAL.load_private_key(private)
    return recipient, (lambda kid: loaded if kid == recipient.key_id else None)


def test_a_record_seals_and_opens_back(pool_free_study):
    study = pool_free_study
    batch = report.prepare_proof_batch(study, data(12, seed=1), leader=1)
    helper_bytes = batch_records.helper_length(study.n_servers)
    for j in range(3):
        recipient, key_for = _keys(study.servers[j])
        media_type, record = batch.records[j]
        body = batch_records.seal(recipient, study.study_id, media_type, record, study.n_servers)
        content = 0x05 if j == 1 else 0x06
        assert envelope.content_of(body) == content
        assert len(body) == envelope.batch_header_bytes() + 16 + len(record) + 16  # 117 + Nenc + P
        assert batch_records.open_sealed(study, study.servers[j], body, key_for) == (media_type, batch.batch_id,
                                                                                     record)
        # another server's (or study's) context does not open it
        with pytest.raises(batch_records.BatchRecordError) as err:
            batch_records.open_sealed(study, "elsewhere", body, key_for)
        assert err.value.slug == "sealed-share-refused"
        flipped = body[:-1] + bytes([body[-1] ^ 1])
        with pytest.raises(envelope.SealError, match="records do not open"):
            envelope.open_record(flipped, helper_bytes, study.study_id, study.servers[j], key_for)
    # a helper's body one byte short, and a batch of two records, are malformed before any key
    recipient, _ = _keys()
    short = envelope.seal_record(recipient, study.study_id, batch.batch_id, 0x06, batch.records[0][1][:-1])
    with pytest.raises(envelope.MalformedSealedBatch, match="helper's batch record"):
        envelope.parse_record(short, helper_bytes)
    two = envelope._seal_v4(recipient, study.study_id, batch.batch_id * 2, 0x06, batch.records[0][1] * 2,
                            helper_bytes)
    with pytest.raises(envelope.MalformedSealedBatch, match="count is 2"):
        envelope.parse_record(two, helper_bytes)
    # and the share path refuses the content by name (a study without batch_proofs)
    with pytest.raises(envelope.MalformedSealedBatch, match="batch proof's record"):
        envelope.parse_batch(short, study.width, study.n_servers)


@pytest.fixture(scope="module")
def pool_free_study() -> Study:
    from dpsketch.protocol.study import design

    return design(name="sealed-core", columns=["x0", "x1", "x2", "y"], label="y", servers=["s1", "s2", "s3"],
                  expected_reports=1000, seed="ab" * 32, validity=True, batch_proofs=True)[0]


# --- real servers --------------------------------------------------------------------------------


class _Watch(httpx.HTTPTransport):
    """The client's transport, recording every batch request's media type and content byte."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int | None]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path.endswith("/batches"):
            body = request.read()
            self.seen.append((request.headers["content-type"], envelope.content_of(body)))
        return super().handle_request(request)


SUITES = ["classical"] + (["post-quantum"] if envelope.POST_QUANTUM.name in envelope.SUITES else [])


@pytest.mark.parametrize("sealing", SUITES)
def test_sdk_sealed_batches_are_held_everywhere_and_released(pool, sealing):
    study = create(pool, 3, 1_200, f"sealed-batch-sdk-{sealing}", batch_proofs=True, min_reports=1_000)
    watch = _Watch()
    with Client(pool.urls(3), journal=False, encrypt=True, sealing=sealing, transport=watch) as client:
        assert client.sealing_suites(study.study_id) == [sealing] * 3
        result = client.submit_many(study.study_id, data(1_200, seed=2), batch_size=400)
    assert result.n_reports == 1_200
    # every batch request was sealed: 3 batches x 3 servers, one leader record each (rotating)
    assert sorted(watch.seen) == sorted([(messages.SEALED_MEDIA_TYPE, 0x05)] * 3
                                        + [(messages.SEALED_MEDIA_TYPE, 0x06)] * 6)
    ids = sorted(bytes.fromhex(r) for r in result)
    for j in range(3):  # every server holds every row
        got = _held(pool, study, j)
        assert sorted(got[i:i + 16] for i in range(0, len(got), 16)) == ids
    fin = finalize(pool, 3, study)
    assert fin["n_reports"] == 1_200
    assert fin["verification"]["decided"] == 1_200 and fin["verification"]["refused"] == 0


class _FailOnce(httpx.HTTPTransport):
    """Answers the first batch request to one server 503 (without sending it); the rest pass."""

    def __init__(self, port: int):
        super().__init__()
        self.port, self.failed = port, False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.port == self.port and not self.failed:
            self.failed = True
            return httpx.Response(503, json={"type": "about:blank", "title": "injected", "status": 503,
                                             "detail": "injected by the test"})
        return super().handle_request(request)


def test_a_resumed_sealed_submission_stores_each_row_once(pool, tmp_path):
    """The journal rebuilds the same records; sealed again (fresh randomness) they are the same
    batches, duplicates where held: every server ends with each row once."""
    study = create(pool, 3, 1_000, "sealed-batch-resume", batch_proofs=True, min_reports=700)
    rows = data(600, seed=8)
    port = httpx.URL(pool.urls(3)[2]).port
    with Client(pool.urls(3), journal=tmp_path, encrypt=True, max_retries=0, transport=_FailOnce(port)) as client, \
            pytest.raises((IncompleteUpload, ProblemError)):  # ProblemError: the abort came before any store
        client.submit_many(study.study_id, rows, batch_size=200)
    with Client(pool.urls(3), journal=tmp_path, encrypt=True) as client:
        result = client.submit_many(study.study_id, rows, batch_size=200)
    assert result.n_reports == 600
    for j in range(3):
        got = _held(pool, study, j)
        assert len(got) == 16 * 600 and len({got[i:i + 16] for i in range(0, len(got), 16)}) == 600


@pytest.fixture(scope="module")
def batch_study(pool) -> Study:
    return create(pool, 3, 1_000, "sealed-batch-refusals", batch_proofs=True, min_reports=700)


def test_a_batch_sealed_again_is_a_duplicate(pool, batch_study):
    study = batch_study
    batch = report.prepare_proof_batch(study, data(30, seed=3), leader=0)
    first = [_sealed(pool, study, batch, j) for j in range(3)]
    again = [_sealed(pool, study, batch, j) for j in range(3)]
    assert all(a != b for a, b in zip(first, again))  # fresh randomness
    for url, body in zip(pool.urls(3), first):
        r = _post(url, study, body)
        assert r.status_code == 200 and (r.json()["accepted"], r.json()["duplicates"]) == (30, 0), r.text
    for url, body in zip(pool.urls(3), again):
        r = _post(url, study, body)
        assert r.status_code == 200 and (r.json()["accepted"], r.json()["duplicates"]) == (0, 30), r.text


def test_refusals_store_nothing(pool, batch_study):
    study = batch_study
    urls = pool.urls(3)
    before = [_held(pool, study, j) for j in range(3)]
    batch = report.prepare_proof_batch(study, data(20, seed=4), leader=0)
    leader_type, leader_record = batch.records[0]
    _, helper_record = batch.records[1]

    # a clear id that is not the batch id: 422 binding-refused, at the leader and at a helper
    for j in (0, 1):
        body = envelope.seal_record(_recipient(urls[j], study.servers[j]), study.study_id, os.urandom(16),
                                    batch_records.sealed_content(batch.records[j][0]), batch.records[j][1])
        assert "batch id" in _problem(_post(urls[j], study, body), 422, "binding-refused")
    # the leader's record (content 0x05) at a helper: 400, as the plaintext media type mismatch
    body = batch_records.seal(_recipient(urls[1], "s2"), study.study_id, leader_type, leader_record, 3)
    assert "names leader 0" in _problem(_post(urls[1], study, body), 400, "malformed-body")
    # a batch of two records: 400 before opening
    two = envelope._seal_v4(_recipient(urls[1], "s2"), study.study_id, batch.batch_id * 2, 0x06,
                            helper_record * 2, len(helper_record))
    assert "count is 2" in _problem(_post(urls[1], study, two), 400, "malformed-body")
    # a tampered ciphertext: 422 sealed-share-refused, as any sealed batch whose records do not open
    body = _sealed(pool, study, batch, 2)
    tampered = body[:-20] + bytes([body[-20] ^ 1]) + body[-19:]
    assert "do not open" in _problem(_post(urls[2], study, tampered), 422, "sealed-share-refused")
    assert [_held(pool, study, j) for j in range(3)] == before


def test_content_0x05_0x06_to_a_study_without_batch_proofs(pool, batch_study):
    plain = create(pool, 3, 1_000, "sealed-batch-none", min_reports=700)
    assert not plain.batch_proofs
    batch = report.prepare_proof_batch(batch_study, data(10, seed=5), leader=0)
    for j in (0, 1):
        media_type, record = batch.records[j]
        body = batch_records.seal(_recipient(pool.urls(3)[j], plain.servers[j]), plain.study_id, media_type,
                                  record, 3)
        assert "batch_proofs" in _problem(_post(pool.urls(3)[j], plain, body), 400, "malformed-body")
    assert all(_held(pool, plain, j) == b"" for j in range(2))


def test_the_quota_is_judged_on_m_after_opening(pool):
    study = create(pool, 3, 1_000, "sealed-batch-quota", batch_proofs=True, min_reports=700)
    url, spec = pool.urls(3)[1], pool.specs[1]
    with ServerAdmin(url, spec.operator_token) as admin:
        five = admin.issue_upload_tokens(study.study_id, 1, 5).token
        one = admin.issue_upload_tokens(study.study_id, 1, 1).token
    big = report.prepare_proof_batch(study, data(20, seed=6), leader=0)
    body = _sealed(pool, study, big, 1)
    detail = _problem(_post(url, study, body, five), 403, "upload-quota-exceeded")
    assert "has 20 new" in detail  # m, read from the opened record
    assert _held(pool, study, 1) == b""
    # a one-row batch uses the quota-1 token up; then a record that would not even open is
    # refused for the quota (403, before opening), and the first one sealed again is a duplicate
    small = report.prepare_proof_batch(study, data(1, seed=7), leader=0)
    r = _post(url, study, _sealed(pool, study, small, 1), one)
    assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
    unopenable = body[:-1] + bytes([body[-1] ^ 1])
    _problem(_post(url, study, unopenable, one), 403, "upload-quota-exceeded")
    r = _post(url, study, _sealed(pool, study, small, 1), one)
    assert r.status_code == 200 and (r.json()["accepted"], r.json()["duplicates"]) == (0, 1), r.text
    assert _held(pool, study, 1) == b"".join(small.report_ids)


def test_mutated_sealed_records_get_a_problem_never_a_500(pool, batch_study):
    """Sealed records with header bytes changed, cut short or padded (a fixed generator: the same
    bodies every run): each answer a documented 4xx, nothing stored."""
    study = batch_study
    urls = pool.urls(3)
    before = [_held(pool, study, j) for j in range(2)]
    batch = report.prepare_proof_batch(study, data(8, seed=9), leader=0)
    rng = np.random.default_rng(10)
    statuses = set()
    for j in (0, 1):
        body = _sealed(pool, study, batch, j)
        head = envelope.batch_header_bytes() + 16
        for _ in range(15):
            mutated = bytearray(body)
            at = int(rng.integers(0, head))
            mutated[at] ^= int(rng.integers(1, 256))
            cut = body[:int(rng.integers(0, len(body)))]
            for bad in (bytes(mutated), cut, body + bytes(int(rng.integers(1, 64)))):
                r = _post(urls[j], study, bad)
                assert r.status_code in (400, 403, 409, 415, 422), (r.status_code, r.text)
                assert r.headers["content-type"].startswith("application/problem+json"), r.text
                statuses.add(r.status_code)
    assert statuses >= {400, 422}
    assert [_held(pool, study, j) for j in range(2)] == before
