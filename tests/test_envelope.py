"""Sealed shares (docs/protocol.md section 7a): HPKE seal/open with the study, server and report
bound in, the documented test vectors, and real share servers that open sealed batches, refuse
misrouted or altered ones, rotate keys mid-study and keep them across a restart."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

import client_sdk.client as sdk_client
from analyzer.client import AnalyzerClient
from client_sdk import Client, StudyMismatch
from dpsketch.protocol import Study, envelope, messages, ring, sketch

from test_e2e import COLUMNS, direct_sketch

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
STUDY_A = "ab" * 32
STUDY_B = "cd" * 32


def _vectors() -> dict:
    section = DOC.read_text().split("## 7a. Sealed shares (HPKE)", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```json\n(.*?)\n```", section, re.S)
    assert block, "docs/protocol.md section 7a has no json block"
    return json.loads(block.group(1))


def _keypair() -> tuple[bytes, bytes]:
    sk = envelope.generate_private_key()
    return sk, envelope.public_key_of(sk)


def _private(sk: bytes):
    from cryptography.hazmat.primitives.asymmetric import x25519

    return x25519.X25519PrivateKey.from_private_bytes(sk)


def _open(body: bytes, width: int, study_id: str, server_id: str, keys: dict[bytes, bytes]):
    return envelope.open_batch(body, width, study_id, server_id,
                               lambda kid: _private(keys[kid]) if kid in keys else None, ring.expand_seeds)


# --- the envelope itself -------------------------------------------------------------------------


def test_documented_vectors_open_to_their_plaintext():
    v = _vectors()
    sk = bytes.fromhex(v["private_key"])
    pk = envelope.public_key_of(sk)
    assert pk.hex() == v["public_key"] and envelope.key_id(pk).hex() == v["key_id"]
    for rec in v["records"]:
        rid = bytes.fromhex(rec["report_id"])
        assert envelope.info(v["study_id"], v["server_id"], rid, rec["content"]).hex() == rec["info"]
        raw = bytes.fromhex(rec["record"])
        (parsed,) = envelope.parse(raw, v["width"])
        assert (parsed.report_id, parsed.key_id.hex(), parsed.content) == (rid, v["key_id"], rec["content"])
        assert len(raw) == envelope.record_bytes(rec["content"], v["width"])
        pt = envelope.open_record(_private(sk), v["study_id"], v["server_id"], parsed)
        assert pt.hex() == rec["plaintext"]
    # the vectors fix the layout: flipping the server id makes the first record unopenable
    (parsed,) = envelope.parse(bytes.fromhex(v["records"][0]["record"]), v["width"])
    with pytest.raises(envelope.SealError):
        envelope.open_record(_private(sk), v["study_id"], "s2", parsed)


def test_seal_open_round_trip_sizes_and_seeds():
    sk, pk = _keypair()
    d, m = 5, 40
    ids = [messages.new_report_id() for _ in range(m)]
    shares = ring.random_ring((m, d))
    body = envelope.seal_batch(envelope.Recipient("s1", pk), STUDY_A, ids, envelope.CONTENT_SHARE, shares)
    assert len(body) == m * (73 + 8 * d) == m * (len(messages.encode_batch(ids, shares)) // m + 57)
    got_ids, got = _open(body, d, STUDY_A, "s1", {envelope.key_id(pk): sk})
    assert got_ids == ids and np.array_equal(got, shares)
    # the same from a plaintext body; records of both kinds may share a body
    seeds = np.frombuffer(np.random.default_rng(1).bytes(32 * m), np.uint8).reshape(m, 32)
    plain_seeds = messages.encode_seed_batch(ids, seeds)
    sealed_seeds = envelope.seal_body(envelope.Recipient("s1", pk), STUDY_A, plain_seeds,
                                      messages.SEEDS_MEDIA_TYPE, d)
    assert len(sealed_seeds) == m * 105
    mixed = sealed_seeds[:105 * 3] + body[(73 + 8 * d) * 3:]
    got_ids, got = _open(mixed, d, STUDY_A, "s1", {envelope.key_id(pk): sk})
    assert got_ids == ids
    np.testing.assert_array_equal(got[:3], ring.expand_seeds(seeds[:3], d))
    np.testing.assert_array_equal(got[3:], shares[3:])
    assert envelope.count_records(mixed, d) == m
    a, b = envelope.split_body(mixed, d)
    assert a + b == mixed and envelope.count_records(a, d) == m // 2
    # randomized: sealing the same share twice gives different bytes that open to the same share
    again = envelope.seal_batch(envelope.Recipient("s1", pk), STUDY_A, ids[:1], envelope.CONTENT_SHARE, shares[:1])
    assert again != body[:73 + 8 * d]
    assert np.array_equal(_open(again, d, STUDY_A, "s1", {envelope.key_id(pk): sk})[1], shares[:1])


def test_wrong_context_wrong_key_and_tampering_are_refused():
    sk, pk = _keypair()
    other_sk, other_pk = _keypair()
    d = 3
    rid = messages.new_report_id()
    share = ring.random_ring((1, d))
    rec = envelope.seal_batch(envelope.Recipient("s1", pk), STUDY_A, [rid], envelope.CONTENT_SHARE, share)
    keys = {envelope.key_id(pk): sk}
    assert _open(rec, d, STUDY_A, "s1", keys)[0] == [rid]
    with pytest.raises(envelope.SealError):  # another server
        _open(rec, d, STUDY_A, "s2", keys)
    with pytest.raises(envelope.SealError):  # another study
        _open(rec, d, STUDY_B, "s1", keys)
    with pytest.raises(envelope.SealError):  # the record moved under another report id
        _open(messages.new_report_id() + rec[16:], d, STUDY_A, "s1", keys)
    with pytest.raises(envelope.SealError, match="unknown key id"):  # a key this server lacks
        _open(rec, d, STUDY_A, "s1", {envelope.key_id(other_pk): other_sk})
    with pytest.raises(envelope.SealError):  # right key id, wrong private key
        _open(rec, d, STUDY_A, "s1", {envelope.key_id(pk): other_sk})
    # any altered byte of enc, ciphertext or tag
    for pos in (envelope.HEADER_BYTES - 32, envelope.HEADER_BYTES - 1, envelope.HEADER_BYTES,
                envelope.HEADER_BYTES + 8 * d - 1, len(rec) - 1):
        bad = bytearray(rec)
        bad[pos] ^= 0x01
        with pytest.raises(envelope.SealError):
            _open(bytes(bad), d, STUDY_A, "s1", keys)
    # a share record relabelled as a seed is malformed at this width (lengths differ)
    relabel = bytearray(rec)
    relabel[24] = envelope.CONTENT_SEED
    with pytest.raises(ValueError):
        _open(bytes(relabel), d, STUDY_A, "s1", keys)
    # malformed bodies
    for bad in (b"", rec[:-1], rec + rec[:10], rec[:24] + b"\x07" + rec[25:]):
        with pytest.raises(envelope.MalformedSealedBatch):
            _open(bad, d, STUDY_A, "s1", keys)


# --- real servers ------------------------------------------------------------------------------


def _study(c, n, name, **kw) -> Study:
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name=name, columns=COLUMNS, label="y", expected_reports=n,
                                  k=16, s=4, min_reports=n, **kw)
    return Study.model_validate(created["study"])


def _info(url: str) -> dict:
    r = httpx.get(f"{url}/v1/info")
    assert r.status_code == 200
    return r.json()


def _recipient(url: str, server_id: str) -> envelope.Recipient:
    hpke = _info(url)["hpke"]
    current = next(k for k in hpke["keys"] if k["key_id"] == hpke["current"])
    return envelope.Recipient(server_id, bytes.fromhex(current["public_key"]))


def _post_sealed(url: str, study_id: str, body: bytes, token: str | None = None) -> httpx.Response:
    headers = {"Content-Type": messages.SEALED_MEDIA_TYPE}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{url}/v1/studies/{study_id}/batches", content=body, headers=headers, timeout=60)


def _count(url: str, study_id: str) -> int:
    return httpx.get(f"{url}/v1/studies/{study_id}").json()["report_count"]


def _released(c, study: Study) -> np.ndarray:
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        fin = an.finalize(study.study_id)
        assert fin["state"] == "released"
        return np.array(an.sketch(study.study_id)["sketch"])


class _Capture:
    """Wraps the SDK's prepare_batch to keep every batch it makes (the test recomputes A + G)."""

    def __init__(self, monkeypatch):
        self.batches = []
        real = sdk_client.prepare_batch

        def wrapped(*args, **kwargs):
            batch = real(*args, **kwargs)
            self.batches.append(batch)
            return batch

        monkeypatch.setattr(sdk_client, "prepare_batch", wrapped)

    def ids_and_encoded(self, n_servers: int) -> tuple[list[bytes], np.ndarray]:
        ids = [rid for b in self.batches for rid in b.report_ids]
        encoded = np.vstack([ring.reconstruct([b.share(j) for j in range(n_servers)]) for b in self.batches])
        return ids, encoded


@pytest.mark.parametrize("compress", [False, True])
def test_sdk_sealed_upload_releases_exactly_the_plaintext_sketch(live_cluster, monkeypatch, compress):
    """Client(encrypt=True) through 3 real servers: every request body is sealed, and the
    release equals S(A + G) of the reports the SDK prepared, exactly in the ring."""
    c = live_cluster
    n = 500
    study = _study(c, n, f"sealed-{compress}")
    capture = _Capture(monkeypatch)
    seen: list[tuple[str, int]] = []
    too_large = []

    class Watch(httpx.HTTPTransport):
        """Records every stored request body; answers 413 (as a server with a 6000-byte limit
        would) to larger batches, so the SDK must cut sealed bodies at record boundaries."""

        def handle_request(self, request):
            if request.method == "POST":
                if len(request.content) > 6000:
                    too_large.append(len(request.content))
                    return httpx.Response(413, json={"type": "urn:dpsketch:problem:payload-too-large",
                                                      "title": "too large", "status": 413, "detail": "x"})
                seen.append((request.headers["content-type"], len(request.content)))
            return super().handle_request(request)

    rows = np.random.default_rng(3).normal(0, 0.3, size=(n, len(COLUMNS)))
    with Client(c.server_urls, encrypt=True, compress=compress, transport=Watch()) as client:
        client.submit(study.study_id, rows[0])  # a single report: a one-record sealed batch
        result = client.submit_many(study.study_id, rows[1:], batch_size=200)
    assert result.n_reports == n - 1
    assert seen and all(ct == messages.SEALED_MEDIA_TYPE for ct, _ in seen)
    d = study.d
    bulk = [size for _, size in seen[3:]]
    per_report = (2 * 105 if compress else 2 * (73 + 8 * d)) + (73 + 8 * d)
    assert sum(bulk) == (n - 1) * per_report
    assert too_large  # bodies were split (the counts above prove nothing was lost or doubled)
    ids, encoded = capture.ids_and_encoded(3)
    assert len(ids) == n
    released = _released(c, study)
    expected = ring.decode(direct_sketch(study, ids, encoded), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(released, expected)


def test_misrouted_wrong_study_and_tampered_shares_are_refused_and_change_nothing(live_cluster):
    c = live_cluster
    study = _study(c, 200, "misroute")
    other = _study(c, 200, "other")
    s1, s2, _ = c.server_urls
    # the study info carries the same keys as /v1/info, and each server's are its own
    study_hpke = httpx.get(f"{s1}/v1/studies/{study.study_id}").json()["hpke"]
    assert study_hpke == _info(s1)["hpke"] and study_hpke["current"] != _info(s2)["hpke"]["current"]
    d = study.d
    ids = [messages.new_report_id() for _ in range(4)]
    shares = ring.random_ring((4, d))
    to_s1 = envelope.seal_batch(_recipient(s1, "s1"), study.study_id, ids, envelope.CONTENT_SHARE, shares)
    keys_s2 = _recipient(s2, "s2")
    # sealed for s1, delivered to s2 (s2 does not have s1's key)
    r = _post_sealed(s2, study.study_id, to_s1)
    assert r.status_code == 422 and r.json()["type"] == "urn:dpsketch:problem:sealed-share-refused", r.text
    assert "unknown key id" in r.json()["detail"]
    # s2's key but s1's server id in the context: refused by the context binding alone
    cross = envelope.seal_batch(envelope.Recipient("s1", keys_s2.public_key), study.study_id, ids,
                                envelope.CONTENT_SHARE, shares)
    r = _post_sealed(s2, study.study_id, cross)
    assert r.status_code == 422 and r.json()["type"].endswith("sealed-share-refused")
    assert "does not open" in r.json()["detail"]
    # right server, wrong study
    r = _post_sealed(s1, other.study_id, to_s1)
    assert r.status_code == 422 and r.json()["type"].endswith("sealed-share-refused")
    # one tampered record in an otherwise good batch: the whole batch is refused
    bad = bytearray(to_s1)
    bad[-1] ^= 0x80
    r = _post_sealed(s1, study.study_id, bytes(bad))
    assert r.status_code == 422 and ids[-1].hex() in r.json()["detail"]
    # malformed bodies: 400, problem JSON
    for body in (b"", to_s1[:-3], b"\x00" * 24 + b"\x09" + b"\x00" * 200):
        r = _post_sealed(s1, study.study_id, body)
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["type"] == "urn:dpsketch:problem:malformed-body"
    assert [_count(u, study.study_id) for u in c.server_urls] == [0, 0, 0]
    assert [_count(u, other.study_id) for u in c.server_urls] == [0, 0, 0]
    # the intact batch is accepted; the same reports again (sealed afresh) are duplicates, and
    # another share under a held id is a conflict, judged on the opened share
    assert _post_sealed(s1, study.study_id, to_s1).json() == {"accepted": 4, "duplicates": 0, "report_count": 4}
    resealed = envelope.seal_batch(_recipient(s1, "s1"), study.study_id, ids, envelope.CONTENT_SHARE, shares)
    assert resealed != to_s1
    assert _post_sealed(s1, study.study_id, resealed).json() == {"accepted": 0, "duplicates": 4, "report_count": 4}
    conflict = envelope.seal_batch(_recipient(s1, "s1"), study.study_id, ids[:1], envelope.CONTENT_SHARE,
                                   shares[:1] + np.uint64(1))
    r = _post_sealed(s1, study.study_id, conflict)
    assert r.status_code == 409 and r.json()["type"].endswith("report-conflict")
    assert _count(s1, study.study_id) == 4


def test_sdk_refuses_servers_that_share_a_key(live_cluster):
    """Two server ids publishing one public key: the SDK refuses before sending anything."""
    c = live_cluster
    study = _study(c, 200, "same-key")
    s1_hpke = _info(c.server_urls[0])["hpke"]
    posts = []

    class SameKey(httpx.HTTPTransport):
        def handle_request(self, request):
            if request.method == "POST":
                posts.append(request.url)
            resp = super().handle_request(request)
            if request.url.path == "/v1/info" and request.url.port == httpx.URL(c.server_urls[1]).port:
                resp.read()
                body = resp.json()
                body["hpke"] = s1_hpke
                return httpx.Response(200, json=body)
            return resp

    with Client(c.server_urls, encrypt=True, transport=SameKey()) as client:
        with pytest.raises(StudyMismatch, match="same HPKE public key"):
            client.submit_many(study.study_id, np.zeros((3, len(COLUMNS))))
    assert posts == []
    # without the rewrite the three keys are distinct and sealing works
    keys = {_info(u)["hpke"]["current"] for u in c.server_urls}
    assert len(keys) == 3


def test_key_rotation_mid_study_and_keys_survive_a_restart(live_cluster, monkeypatch):
    c = live_cluster
    n = 300
    study = _study(c, n, "rotation")
    capture = _Capture(monkeypatch)
    rows = np.random.default_rng(9).normal(0, 0.3, size=(n, len(COLUMNS)))
    before = [_info(u)["hpke"] for u in c.server_urls]
    with Client(c.server_urls, encrypt=True) as old_client:
        old_client.study(study.study_id)  # fetches (and caches) the current keys
        old_client.submit_many(study.study_id, rows[:100])
        # every server rotates; the old client keeps sealing to the old keys
        for spec, url in zip(c.specs, c.server_urls):
            r = httpx.post(f"{url}/v1/keys", headers={"Authorization": f"Bearer {spec.operator_token}"})
            assert r.status_code == 201, r.text
        old_client.submit_many(study.study_id, rows[100:200])
    after = [_info(u)["hpke"] for u in c.server_urls]
    for b, a in zip(before, after):
        assert a["current"] != b["current"] and len(a["keys"]) == 2
        old = next(k for k in a["keys"] if k["key_id"] == b["current"])
        assert old["superseded_at"] is not None
    with Client(c.server_urls, encrypt=True) as new_client:  # seals to the new keys
        new_client.submit_many(study.study_id, rows[200:])
    assert [_count(u, study.study_id) for u in c.server_urls] == [n] * 3

    # the old key is still needed while the study is open: retiring it is refused
    spec1, url1 = c.specs[0], c.server_urls[0]
    op1 = {"Authorization": f"Bearer {spec1.operator_token}"}
    r = httpx.delete(f"{url1}/v1/keys/{before[0]['current']}", headers=op1)
    assert r.status_code == 409 and r.json()["type"].endswith("key-in-use") and r.json()["open_studies"] >= 1
    r = httpx.delete(f"{url1}/v1/keys/{after[0]['current']}", headers=op1)  # the current key
    assert r.status_code == 409 and r.json()["type"].endswith("key-in-use")
    assert httpx.delete(f"{url1}/v1/keys/{before[0]['current']}").status_code == 401
    assert httpx.delete(f"{url1}/v1/keys/{'0' * 16}", headers=op1).status_code == 404

    # kill every server (SIGKILL) and start it again on the same database: same keys
    a_share = envelope.seal_batch(_recipient(url1, "s1"), study.study_id, [messages.new_report_id()],
                                  envelope.CONTENT_SHARE, ring.random_ring((1, study.d)))
    for proc in c.procs:
        proc.kill()
        proc.start()
    assert [_info(u)["hpke"] for u in c.server_urls] == after
    assert oct(Path(spec1.db_path).stat().st_mode & 0o777) == "0o600"
    # a share sealed before the restart opens after it
    assert _post_sealed(url1, study.study_id, a_share).json()["accepted"] == 1
    # (that extra report is held by s1 only, so the analyzer's intersection excludes it)

    ids, encoded = capture.ids_and_encoded(3)
    released = _released(c, study)
    expected = ring.decode(direct_sketch(study, ids, encoded), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(released, expected)

    # committed now (and the other studies of this cluster were created later): the old key retires
    r = httpx.delete(f"{url1}/v1/keys/{before[0]['current']}", headers=op1)
    assert r.status_code == 200, r.text
    assert [k["key_id"] for k in r.json()["keys"]] == [after[0]["current"]]
    assert _info(url1)["hpke"]["keys"] == r.json()["keys"]
    # a share sealed to the retired key no longer opens
    with Client(c.server_urls, encrypt=True) as client:
        fresh = _study(c, 200, "after-retire")
        stale = envelope.seal_batch(envelope.Recipient("s1", bytes.fromhex(before[0]["keys"][0]["public_key"])),
                                    fresh.study_id, [messages.new_report_id()], envelope.CONTENT_SHARE,
                                    ring.random_ring((1, fresh.d)))
        r = _post_sealed(url1, fresh.study_id, stale)
        assert r.status_code == 422 and "unknown key id" in r.json()["detail"]
        client.submit_many(fresh.study_id, rows[:5])  # the current keys work
    assert _count(url1, fresh.study_id) == 5


def test_client_without_published_keys_refuses_to_encrypt():
    """A server that publishes no hpke member: encrypt=True refuses before any upload."""
    from client_sdk import SDKError

    study_servers = ["s1", "s2"]
    from dpsketch.protocol.study import design

    study = design(name="nokeys", columns=["a", "b"], label=None, servers=study_servers,
                   expected_reports=200, k=4, s=2, min_reports=100)[0]
    posts = []

    def handler(request: httpx.Request) -> httpx.Response:
        sid = "s1" if request.url.host == "a.test" else "s2"
        if request.url.path == "/v1/info":
            return httpx.Response(200, json={"server_id": sid, "protocol": "dpsketch/1", "version": "x"})
        if request.url.path == f"/v1/studies/{study.study_id}":
            return httpx.Response(200, json={"study_id": study.study_id, "server_id": sid, "status": "open",
                                             "report_count": 0, "study": study.model_dump(mode="json")})
        posts.append(request.url)
        return httpx.Response(500)

    with Client(["http://a.test", "http://b.test"], encrypt=True, max_retries=0,
                transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(SDKError, match="publishes no HPKE key"):
            client.submit(study.study_id, [0.1, 0.2])
    assert posts == []
    with Client(["http://a.test", "http://b.test"], max_retries=0,
                transport=httpx.MockTransport(handler)) as client:
        assert client.study(study.study_id) == study  # plaintext mode does not need keys


def test_bench_encryption_figures():
    figures = sdk_client.bench_encryption(2000, d=6, n_servers=3)
    plain, sealed = figures["plaintext"], figures["sealed"]
    assert sealed["bytes_per_row"] - plain["bytes_per_row"] == 3 * 57
    assert sealed["seal_us_per_row"] > 0 and sealed["open_us_per_row"] > 0
    print(f"\nbench_encryption(2000, d=6, N=3): {json.dumps(figures)}")


def test_random_sealed_bodies_get_400_or_422_never_500(tmp_path: Path):
    """In process: bodies shaped like sealed batches (the server's real key id, both kinds, all
    sorts of lengths and bytes) are refused with problem JSON and store nothing."""
    from test_server_unit import Server, make_study

    srv = Server(tmp_path / "s1.sqlite3")
    try:
        st = make_study()
        assert srv.provision(st).status_code == 201
        kid = bytes.fromhex(srv.client.get("/v1/info").json()["hpke"]["current"])
        rng = np.random.default_rng(12)
        statuses = set()
        for i in range(150):
            kind = int(rng.choice([1, 2, 0, 3, 255]))
            size = envelope.record_bytes(kind, st.d) if kind in (1, 2) else 60
            size += int(rng.choice([0, 0, 0, -1, 1, 40]))
            rec = bytearray(rng.bytes(max(size, 0)))
            if len(rec) > 25:
                rec[16:24] = kid if i % 3 else rng.bytes(8)
                rec[24] = kind
                if i % 5 == 0:
                    rec[25:57] = bytes(32)  # the all-zero (low-order) X25519 point
            body = bytes(rec) * int(rng.integers(1, 3))
            r = srv.client.post(f"/v1/studies/{st.study_id}/batches", content=body,
                                headers={"Content-Type": messages.SEALED_MEDIA_TYPE})
            assert r.status_code in (400, 422), (i, r.status_code, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["type"] in ("urn:dpsketch:problem:malformed-body",
                                        "urn:dpsketch:problem:sealed-share-refused")
            statuses.add(r.status_code)
        assert statuses == {400, 422}
        assert srv.count(st) == 0
    finally:
        srv.close()
