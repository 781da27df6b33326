"""Sealed shares (docs/protocol.md section 7a): HPKE seal/open with the study, server and report
bound in, the documented test vectors, and real share servers that open sealed batches, refuse
misrouted or altered ones, rotate keys mid-study and keep them across a restart."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

import client_sdk.client as sdk_client
from analyzer.client import AnalyzerClient
from client_sdk import Client, StudyMismatch, bench_encryption
from dpsketch.protocol import Study, binding, envelope, messages, ring, sketch

from studies import bind_at
from test_e2e import COLUMNS, direct_sketch, exact_cluster

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


def _open(body: bytes, width: int, study_id: str, server_id: str, keys: dict[bytes, bytes],
          n_servers: int = 3) -> tuple[list[bytes], np.ndarray]:
    """Open a sealed body as server ``server_id`` (position int(server_id[1:]) - 1 of a study of
    ``n_servers`` servers): (report ids, shares, seeds expanded), every record's binding checked."""
    upload = envelope.open_batch(body, width, n_servers, study_id, server_id,
                                 lambda kid: _private(keys[kid]) if kid in keys else None)
    upload.verify(study_id, n_servers, int(server_id[1:]) - 1)
    return upload.ids, upload.shares(width)


def _plaintexts(proofs: np.ndarray, payloads: np.ndarray) -> list[bytes]:
    """Per report the sealed plaintext: its proof for this server, then its payload."""
    raw, step = binding.payload_bytes(payloads)
    return [bytes(p.tobytes()) + raw[i * step:(i + 1) * step] for i, p in enumerate(proofs)]


# --- the envelope itself -------------------------------------------------------------------------


def test_documented_vectors_open_to_their_plaintext():
    v = _vectors()
    sk = bytes.fromhex(v["private_key"])
    pk = envelope.public_key_of(sk)
    assert pk.hex() == v["public_key"] and envelope.key_id(pk).hex() == v["key_id"]
    width, n, position = v["width"], v["n_servers"], v["position"]
    assert v["servers"][position] == v["server_id"] and len(v["servers"]) == n
    study = bytes.fromhex(v["study_id"])
    for rec in v["records"]:
        rid = bytes.fromhex(rec["report_id"])
        content, salt, payload = rec["content"], bytes.fromhex(rec["salt"]), bytes.fromhex(rec["payload"])
        # the binding (section 4a), recomputed from its definition with hashlib alone: c_j commits
        # to this server's payload, the report id to all N commitments, and the proof is the salt
        # followed by the other servers' commitments
        commits = [bytes.fromhex(c) for c in rec["commitments"]]
        own = hashlib.sha256(b"dpsketch/commit/2" + bytes([position, content]) + salt + payload).digest()[:16]
        assert own == commits[position]
        assert hashlib.sha256(b"dpsketch/report/2" + study + b"".join(commits)).digest()[:16] == rid
        proof = salt + b"".join(c for j, c in enumerate(commits) if j != position)
        assert proof.hex() == rec["proof"] and len(proof) == 16 * n
        assert rec["plaintext"] == (proof + payload).hex()
        # the context: "dpsketch/sealed/1" || SHA-256(study || report id || content || len || server id)
        sid = v["server_id"].encode()
        context = study + rid + bytes([content, len(sid)]) + sid
        assert rec["info"] == (b"dpsketch/sealed/1" + hashlib.sha256(context).digest()).hex()
        assert envelope.info(v["study_id"], v["server_id"], rid, content).hex() == rec["info"]
        raw = bytes.fromhex(rec["record"])
        (parsed,) = envelope.parse(raw, width, n)
        assert (parsed.report_id, parsed.key_id.hex(), parsed.content) == (rid, v["key_id"], content)
        assert len(raw) == envelope.record_bytes(content, width, n) == 57 + len(proof) + len(payload) + 16
        pt = envelope.open_record(_private(sk), v["study_id"], v["server_id"], parsed)
        assert pt.hex() == rec["plaintext"]
        # the reference implementation opens it to the same proof and payload and accepts the binding
        upload = envelope.open_batch(raw, width, n, v["study_id"], v["server_id"], lambda kid: _private(sk))
        assert upload.ids == [rid] and upload.proofs.tobytes() == proof and upload.content == content
        assert binding.payload_bytes(upload.payloads)[0] == payload
        upload.verify(v["study_id"], n, position)
        with pytest.raises(binding.BindingError):  # the same record is not bound for the other server
            upload.verify(v["study_id"], n, 1 - position)
    # the vectors fix the layout: flipping the server id makes the first record unopenable
    (parsed,) = envelope.parse(bytes.fromhex(v["records"][0]["record"]), width, n)
    with pytest.raises(envelope.SealError):
        envelope.open_record(_private(sk), v["study_id"], "s2", parsed)


def _bound(study_id: str, m: int, d: int, n: int = 3, compress: bool = False):
    """m reports of n shares (or n - 1 seeds and a last share), bound to their ids as the SDK
    binds them: (ids, proofs per server, payloads per server, contents per server)."""
    encoded = ring.random_ring((m, d))
    if compress:
        seeds, last = ring.share_with_seeds(encoded, n)
        payloads = [*seeds, last]
        contents = [envelope.CONTENT_SEED] * (n - 1) + [envelope.CONTENT_SHARE]
    else:
        payloads = ring.share(encoded, n)
        contents = [envelope.CONTENT_SHARE] * n
    ids, proofs = binding.bind(study_id, contents, payloads)
    return ids, proofs, payloads, contents


def test_seal_open_round_trip_sizes_and_seeds():
    sk, pk = _keypair()
    d, m, n = 5, 40, 3
    keys = {envelope.key_id(pk): sk}
    s1 = envelope.Recipient("s1", pk)
    ids, proofs, shares, _ = _bound(STUDY_A, m, d, n)
    body = envelope.seal_batch(s1, STUDY_A, ids, envelope.CONTENT_SHARE, _plaintexts(proofs[0], shares[0]))
    # a sealed record: 16-byte id, 8-byte key id, kind, 32-byte enc, then the proof (16 N bytes)
    # and the share sealed with a 16-byte tag: the plaintext record (id, proof, share) + 57
    share_record = 73 + 16 * n + 8 * d
    assert envelope.record_bytes(envelope.CONTENT_SHARE, d, n) == share_record
    assert len(body) == m * share_record == m * (len(messages.encode_batch(ids, proofs[0], shares[0])) // m + 57)
    got_ids, got = _open(body, d, STUDY_A, "s1", keys, n)
    assert got_ids == ids and np.array_equal(got, shares[0])
    # the same from a plaintext body, for seeds
    sids, sproofs, payloads, _ = _bound(STUDY_A, m, d, n, compress=True)
    plain_seeds = messages.encode_seed_batch(sids, sproofs[0], payloads[0])
    sealed_seeds = envelope.seal_body(s1, STUDY_A, plain_seeds, messages.SEEDS_MEDIA_TYPE, d, n)
    seed_record = 105 + 16 * n
    assert envelope.record_bytes(envelope.CONTENT_SEED, d, n) == seed_record
    assert len(sealed_seeds) == m * seed_record == len(plain_seeds) + m * 57
    got_ids, got = _open(sealed_seeds, d, STUDY_A, "s1", keys, n)
    assert got_ids == sids
    np.testing.assert_array_equal(got, ring.expand_seeds(payloads[0], d))
    # a sealed body holds records of one kind: shares and seeds mixed are malformed
    mixed = sealed_seeds[:seed_record * 3] + body[share_record * 3:]
    with pytest.raises(envelope.MalformedSealedBatch, match="one kind"):
        _open(mixed, d, STUDY_A, "s1", keys, n)
    for sealed, record in ((body, share_record), (sealed_seeds, seed_record)):
        assert envelope.count_records(sealed, d, n) == m
        a, b = envelope.split_body(sealed, d, n)
        assert a + b == sealed and len(a) == record * (m // 2) and envelope.count_records(a, d, n) == m // 2
    # seal_body of a share body is seal_batch of its records
    from_body = envelope.seal_body(s1, STUDY_A, messages.encode_batch(ids, proofs[0], shares[0]),
                                   messages.SHARES_MEDIA_TYPE, d, n)
    assert len(from_body) == len(body)
    assert np.array_equal(_open(from_body, d, STUDY_A, "s1", keys, n)[1], shares[0])
    # randomized: sealing the same share twice gives different bytes that open to the same share
    again = envelope.seal_batch(s1, STUDY_A, ids[:1], envelope.CONTENT_SHARE, _plaintexts(proofs[0][:1], shares[0][:1]))
    assert again != body[:share_record]
    assert np.array_equal(_open(again, d, STUDY_A, "s1", keys, n)[1], shares[0][:1])


def test_wrong_context_wrong_key_and_tampering_are_refused():
    sk, pk = _keypair()
    other_sk, other_pk = _keypair()
    d, n = 3, 2
    ids, proofs, shares, _ = _bound(STUDY_A, 1, d, n)
    rid = ids[0]
    rec = envelope.seal_batch(envelope.Recipient("s1", pk), STUDY_A, [rid], envelope.CONTENT_SHARE,
                              _plaintexts(proofs[0], shares[0]))
    keys = {envelope.key_id(pk): sk}
    assert _open(rec, d, STUDY_A, "s1", keys, n)[0] == [rid]
    with pytest.raises(envelope.SealError):  # another server
        _open(rec, d, STUDY_A, "s2", keys, n)
    with pytest.raises(envelope.SealError):  # another study
        _open(rec, d, STUDY_B, "s1", keys, n)
    with pytest.raises(envelope.SealError):  # the record moved under another report id
        _open(bytes(16) + rec[16:], d, STUDY_A, "s1", keys, n)
    with pytest.raises(envelope.SealError, match="unknown key id"):  # a key this server lacks
        _open(rec, d, STUDY_A, "s1", {envelope.key_id(other_pk): other_sk}, n)
    with pytest.raises(envelope.SealError):  # right key id, wrong private key
        _open(rec, d, STUDY_A, "s1", {envelope.key_id(pk): other_sk}, n)
    # any altered byte of enc, ciphertext (proof or share) or tag
    for pos in (envelope.HEADER_BYTES - 32, envelope.HEADER_BYTES - 1, envelope.HEADER_BYTES,
                envelope.HEADER_BYTES + 16 * n - 1, envelope.HEADER_BYTES + 16 * n + 8 * d - 1, len(rec) - 1):
        bad = bytearray(rec)
        bad[pos] ^= 0x01
        with pytest.raises(envelope.SealError):
            _open(bytes(bad), d, STUDY_A, "s1", keys, n)
    # sealed correctly under the report id, but a share other than the one the id commits to
    # (with the genuine proof, or another salt): it opens, and the binding refuses it
    for proof in (proofs[0], np.zeros_like(proofs[0])):
        subst = envelope.seal_batch(envelope.Recipient("s1", pk), STUDY_A, [rid], envelope.CONTENT_SHARE,
                                    _plaintexts(proof, shares[0] + np.uint64(1)))
        upload = envelope.open_batch(subst, d, n, STUDY_A, "s1", lambda kid: _private(sk))
        assert upload.ids == [rid]
        with pytest.raises(binding.BindingError, match=rid.hex()):
            upload.verify(STUDY_A, n, 0)
    # a share record relabelled as a seed is malformed at this width (lengths differ)
    relabel = bytearray(rec)
    relabel[24] = envelope.CONTENT_SEED
    with pytest.raises(ValueError):
        _open(bytes(relabel), d, STUDY_A, "s1", keys, n)
    # malformed bodies
    for bad in (b"", rec[:-1], rec + rec[:10], rec[:24] + b"\x07" + rec[25:]):
        with pytest.raises(envelope.MalformedSealedBatch):
            _open(bad, d, STUDY_A, "s1", keys, n)


# --- real servers ------------------------------------------------------------------------------


@pytest.fixture
def no_floor_cluster(servers):
    """Servers that accept studies without server noise: a release exactly the shares' sum."""
    return exact_cluster(servers)


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
def test_sdk_sealed_upload_releases_exactly_the_plaintext_sketch(no_floor_cluster, monkeypatch, compress):
    """Client(encrypt=True) through 3 real servers: every request body is sealed, and the
    release equals S(A + G) of the reports the SDK prepared, exactly in the ring (a study
    without server noise)."""
    c = no_floor_cluster
    n = 500
    study = _study(c, n, f"sealed-{compress}", epsilon_floor=None)
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
    d, proof = study.d, 16 * study.n_servers  # every sealed plaintext starts with its 16 N-byte proof
    bulk = [size for _, size in seen[3:]]
    assert [size for _, size in seen[:3]] == [73 + proof + 8 * d] * 3  # the single report
    per_report = (2 * (105 + proof) if compress else 2 * (73 + proof + 8 * d)) + (73 + proof + 8 * d)
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
    d, n = study.d, study.n_servers
    ids, proofs, shares, _ = _bound(study.study_id, 4, d, n)
    to_s1 = envelope.seal_batch(_recipient(s1, "s1"), study.study_id, ids, envelope.CONTENT_SHARE,
                                _plaintexts(proofs[0], shares[0]))
    keys_s2 = _recipient(s2, "s2")
    # sealed for s1, delivered to s2 (s2 does not have s1's key)
    r = _post_sealed(s2, study.study_id, to_s1)
    assert r.status_code == 422 and r.json()["type"] == "urn:dpsketch:problem:sealed-share-refused", r.text
    assert "unknown key id" in r.json()["detail"]
    # s2's key but s1's server id in the context: refused by the context binding alone
    cross = envelope.seal_batch(envelope.Recipient("s1", keys_s2.public_key), study.study_id, ids,
                                envelope.CONTENT_SHARE, _plaintexts(proofs[0], shares[0]))
    r = _post_sealed(s2, study.study_id, cross)
    assert r.status_code == 422 and r.json()["type"].endswith("sealed-share-refused")
    assert "does not open" in r.json()["detail"]
    # s1's share and proof re-sealed properly to s2 (a relay that saw them in clear): it opens
    # at s2, but the id commits to it as server 1's share, so the binding refuses it
    resealed_to_s2 = envelope.seal_batch(keys_s2, study.study_id, ids, envelope.CONTENT_SHARE,
                                         _plaintexts(proofs[0], shares[0]))
    r = _post_sealed(s2, study.study_id, resealed_to_s2)
    assert r.status_code == 422 and r.json()["type"].endswith("binding-refused"), r.text
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
    # the intact batch is accepted; the same reports again (sealed afresh) are duplicates
    assert _post_sealed(s1, study.study_id, to_s1).json() == {"accepted": 4, "duplicates": 0, "report_count": 4}
    resealed = envelope.seal_batch(_recipient(s1, "s1"), study.study_id, ids, envelope.CONTENT_SHARE,
                                   _plaintexts(proofs[0], shares[0]))
    assert resealed != to_s1
    assert _post_sealed(s1, study.study_id, resealed).json() == {"accepted": 0, "duplicates": 4, "report_count": 4}
    # a share sealed correctly to s1 under a victim's report id, with the victim's proof or a
    # proof of the sender's own, but another payload: it opens (the envelope is sound), and the
    # binding refuses it, judged on the opened share; nothing is stored or replaced
    victim = ids[0]
    for proof in (proofs[0][:1], bind_at(study, 0, shares[0][:1] + np.uint64(1))[1]):
        substituted = envelope.seal_batch(_recipient(s1, "s1"), study.study_id, [victim], envelope.CONTENT_SHARE,
                                          _plaintexts(proof, shares[0][:1] + np.uint64(1)))
        r = _post_sealed(s1, study.study_id, substituted)
        assert r.status_code == 422 and r.json()["type"] == "urn:dpsketch:problem:binding-refused", r.text
        assert victim.hex() in r.json()["detail"]
    # ... and so is a new report id with a substituted payload (nothing held under it)
    fresh_ids, fresh_proofs = bind_at(study, 0, shares[0][:1])
    r = _post_sealed(s1, study.study_id, envelope.seal_batch(
        _recipient(s1, "s1"), study.study_id, fresh_ids, envelope.CONTENT_SHARE,
        _plaintexts(fresh_proofs, shares[0][:1] + np.uint64(1))))
    assert r.status_code == 422 and r.json()["type"].endswith("binding-refused")
    assert _count(s1, study.study_id) == 4
    held = httpx.get(f"{s1}/v1/studies/{study.study_id}/report-ids",
                     headers={"Authorization": f"Bearer {c.specs[0].analyst_token}"})
    assert messages.decode_report_ids(held.content) == sorted(ids)
    # the victim's genuine share is still what s1 holds: resending it is a duplicate
    assert _post_sealed(s1, study.study_id, to_s1).json() == {"accepted": 0, "duplicates": 4, "report_count": 4}


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


def test_key_rotation_mid_study_and_keys_survive_a_restart(no_floor_cluster, monkeypatch):
    c = no_floor_cluster
    n = 300
    study = _study(c, n, "rotation", epsilon_floor=None)  # no server noise: an exact release
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
    extra = ring.random_ring((1, study.d))
    extra_ids, extra_proofs = bind_at(study, 0, extra)
    a_share = envelope.seal_batch(_recipient(url1, "s1"), study.study_id, extra_ids,
                                  envelope.CONTENT_SHARE, _plaintexts(extra_proofs, extra))
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
        fresh = _study(c, 200, "after-retire", epsilon_floor=None)
        one = ring.random_ring((1, fresh.d))
        one_ids, one_proofs = bind_at(fresh, 0, one)
        stale = envelope.seal_batch(envelope.Recipient("s1", bytes.fromhex(before[0]["keys"][0]["public_key"])),
                                    fresh.study_id, one_ids, envelope.CONTENT_SHARE, _plaintexts(one_proofs, one))
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
            return httpx.Response(200, json={"server_id": sid, "protocol": study.protocol, "version": "x"})
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
    figures = bench_encryption(2000, d=6, n_servers=3)
    plain, sealed = figures["plaintext"], figures["sealed"]
    assert sealed["bytes_per_row"] - plain["bytes_per_row"] == 3 * 57
    assert sealed["seal_us_per_row"] > 0 and sealed["open_us_per_row"] > 0
    print(f"\nbench_encryption(2000, d=6, N=3): {json.dumps(figures)}")


def test_random_sealed_bodies_get_400_or_422_never_500(tmp_path: Path):
    """In process: bodies shaped like sealed batches (the server's real key ids, both kinds, both
    record versions and suites, all sorts of lengths and bytes; some properly sealed to the
    server around random proofs and payloads) are refused with problem JSON and store nothing."""
    from fastapi.testclient import TestClient

    from dpsketch.protocol.study import design
    from services.app import create_app
    from services.settings import Settings

    op = "op-" + "1" * 16
    settings = Settings(server_id="s1", db_path=tmp_path / "s1.sqlite3", operator_token=op,
                        analyst_token="an-" + "2" * 16, upload_auth="open")  # not about tokens
    st = design(name="fuzz", columns=["a", "b", "c"], label=None, servers=["s1", "s2"],
                expected_reports=200, k=4, s=2, min_reports=100)[0]
    with TestClient(create_app(settings), raise_server_exceptions=True) as client:
        r = client.put(f"/v1/studies/{st.study_id}", content=st.canonical(),
                       headers={"Authorization": f"Bearer {op}", "Content-Type": "application/json"})
        assert r.status_code == 201, r.text
        hpke = client.get("/v1/info").json()["hpke"]
        kid = bytes.fromhex(hpke["current"])
        me = envelope.Recipient("s1", bytes.fromhex(next(k["public_key"] for k in hpke["keys"]
                                                         if k["key_id"] == hpke["current"])))
        pq = hpke["post_quantum"]
        me_pq = envelope.Recipient("s1", bytes.fromhex(pq["keys"][0]["public_key"]), envelope.POST_QUANTUM)
        rng = np.random.default_rng(12)
        statuses, slugs = set(), set()
        for i in range(150):
            kind = int(rng.choice([1, 2, 0, 3, 255, 0x80]))
            if i % 10 == 0:  # opens, but the random proof does not bind the payload to the id
                kind = 1 + (i // 10) % 2
                plain = envelope.plaintext_bytes(kind, st.width, st.n_servers)
                rec = bytearray(envelope.seal(me_pq if i % 20 else me, st.study_id, rng.bytes(16), kind,
                                              rng.bytes(plain)))
            elif kind == 0x80:  # version 2: the post-quantum suite's ids, or random ones
                size = envelope.record_bytes(1, st.width, st.n_servers, envelope.POST_QUANTUM, 2)
                rec = bytearray(rng.bytes(size + int(rng.choice([0, 0, -1, 1, -1088]))))
                rec[16:24] = bytes.fromhex(pq["current"]) if i % 3 else rng.bytes(8)
                rec[24:33] = bytes([0x80, 2]) + (envelope.POST_QUANTUM.ids if i % 4 else rng.bytes(6)) + b"\x01"
            else:
                size = envelope.record_bytes(kind, st.width, st.n_servers) if kind in (1, 2) else 60
                size += int(rng.choice([0, 0, 0, -1, 1, 40]))
                rec = bytearray(rng.bytes(max(size, 0)))
                if len(rec) > 25:
                    rec[16:24] = kid if i % 3 else rng.bytes(8)
                    rec[24] = kind
                    if i % 5 == 0:
                        rec[25:57] = bytes(32)  # the all-zero (low-order) X25519 point
            body = bytes(rec) * int(rng.integers(1, 3))
            r = client.post(f"/v1/studies/{st.study_id}/batches", content=body,
                            headers={"Content-Type": messages.SEALED_MEDIA_TYPE})
            assert r.status_code in (400, 422), (i, r.status_code, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["type"] in ("urn:dpsketch:problem:malformed-body",
                                        "urn:dpsketch:problem:sealed-share-refused",
                                        "urn:dpsketch:problem:binding-refused")
            statuses.add(r.status_code)
            slugs.add(r.json()["type"].rsplit(":", 1)[1])
        assert statuses == {400, 422}
        assert slugs == {"malformed-body", "sealed-share-refused", "binding-refused"}
        assert client.get(f"/v1/studies/{st.study_id}").json()["report_count"] == 0
