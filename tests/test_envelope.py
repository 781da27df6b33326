"""Sealed shares (docs/protocol.md section 7a): HPKE seal/open with the study, server and report
bound in, version 4 batches (one HPKE seal and one AEAD per batch; records moved, reordered,
dropped, spliced or replayed under another id are refused), the documented test vectors, and real share servers
that open sealed batches, refuse misrouted or altered ones without changing anything, rotate
keys mid-study and keep them across a restart."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest

import dpsketch.client_sdk.client as sdk_client
from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client, StudyMismatch
from dpsketch.protocol import Study, binding, envelope, messages, ring, sketch
from dpsketch.tools.client_bench import bench_encryption

from studies import bind_at
from test_e2e import COLUMNS, direct_sketch, exact_cluster, no_floor_module_cluster  # noqa: F401 (a fixture)

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
STUDY_A = "ab" * 32
STUDY_B = "cd" * 32


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


def test_versions_1_2_and_3_are_neither_sealed_nor_opened():
    """The per-record layouts (one HPKE seal per record, issue 41; one AEAD per record, version 3,
    issue 46) were dropped: nothing seals them, and a body in any of them is refused as malformed
    by its layout bytes alone, before any key is looked up or any decryption is tried (the key
    lookup below would fail the test)."""
    sk, pk = _keypair()
    d, n = 3, 2
    ids, proofs, shares, _ = _bound(STUDY_A, 4, d, n)
    for version in (1, 2, 3):
        with pytest.raises(ValueError, match="version 4 batches only"):
            envelope.seal_batch(envelope.Recipient("s1", pk, version=version), STUDY_A, ids,
                                envelope.CONTENT_SHARE, _plaintexts(proofs[0], shares[0]))
    assert envelope.VERSIONS == (4,)

    def no_key(kid):
        raise AssertionError("a key was looked up for a body of a dropped layout")

    kid = envelope.key_id(pk)
    plain = 16 * n + 8 * d
    v1_record = ids[0] + kid + bytes([envelope.CONTENT_SHARE]) + os.urandom(32 + plain + 16)
    v2_record = ids[0] + kid + bytes([0x80, 2]) + envelope.CLASSICAL.ids + bytes([1]) + os.urandom(32 + plain + 16)
    # version 3: a batch header (count 4), then 4 records of report id, ciphertext and tag each
    v3_batch = (os.urandom(16) + kid + bytes([0x80, 3]) + envelope.CLASSICAL.ids + bytes([1])
                + (4).to_bytes(4, "big") + os.urandom(80) + os.urandom(4 * (16 + plain + 16)))
    for version, body in ((1, v1_record * 50), (2, v2_record * 50), (3, v3_batch)):
        with pytest.raises(envelope.MalformedSealedBatch, match=f"version {version} "):
            envelope.open_batch(body, d, n, STUDY_A, "s1", no_key)


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
    head = envelope.batch_header_bytes()
    with pytest.raises(envelope.SealError):  # the record moved under another report id
        _open(rec[:head] + bytes(16) + rec[head + 16:], d, STUDY_A, "s1", keys, n)
    with pytest.raises(envelope.SealError, match="unknown key id"):  # a key this server lacks
        _open(rec, d, STUDY_A, "s1", {envelope.key_id(other_pk): other_sk}, n)
    with pytest.raises(envelope.SealError):  # right key id, wrong private key
        _open(rec, d, STUDY_A, "s1", {envelope.key_id(pk): other_sk}, n)
    # any altered byte of enc, the wrapped secret, the ciphertext (proof or share) or tag
    for pos in (37, head - 1, head + 16, head + 16 + 16 * n - 1, head + 16 + 16 * n + 8 * d - 1, len(rec) - 1):
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
    relabel[32] = envelope.CONTENT_SEED
    with pytest.raises(ValueError):
        _open(bytes(relabel), d, STUDY_A, "s1", keys, n)
    # malformed bodies
    for bad in (b"", rec[:-1], rec + rec[:10], rec[:24] + b"\x07" + rec[25:]):
        with pytest.raises(envelope.MalformedSealedBatch):
            _open(bad, d, STUDY_A, "s1", keys, n)


# --- version 4: one batch, one KEM and one AEAD per batch and server ----------------------------

CL, PQ = envelope.CLASSICAL, envelope.POST_QUANTUM


def _suite_keys(suite: envelope.SealingSuite):
    sk = suite.generate_private_key()
    pk = suite.public_key_of(sk)
    return pk, suite.load_private_key(sk)


def _spec_open(body: bytes, key, suite, study_id: str, server_id: str, plaintext_len: int) -> list[bytes]:
    """A version 4 batch opened from the text of section 7a alone (hashlib, HPKE single-shot open,
    HKDF, ChaCha20-Poly1305), not with the envelope module."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    sid = server_id.encode()
    prefix = bytes.fromhex(study_id) + bytes([len(sid)]) + sid
    head = 37 + suite.enc_bytes + 48
    info4 = b"dpsketch/sealed/4" + hashlib.sha256(prefix + body[:37]).digest()
    secret = suite.hpke_suite.decrypt(body[37:head], key, info=info4)
    transcript = hashlib.sha256(prefix + body[:head]).digest()
    aead = ChaCha20Poly1305(HKDF(hashes.SHA256(), 32, None, b"dpsketch/sealed/4/records" + transcript).derive(secret))
    count = int.from_bytes(body[33:37], "big")
    assert len(body) == head + count * (16 + plaintext_len) + 16
    ids = body[head:head + 16 * count]
    plain = aead.decrypt(bytes(12), body[head + 16 * count:], transcript + ids)
    return [plain[i * plaintext_len:(i + 1) * plaintext_len] for i in range(count)]


@pytest.mark.parametrize("suite", [CL, PQ], ids=["classical", "post-quantum"])
def test_v4_batch_layout_sizes_and_round_trip(suite):
    pk, key = _suite_keys(suite)
    d, m, n = 5, 12, 3
    me = envelope.Recipient("s1", pk, suite)  # version 4 unless told otherwise
    head = envelope.batch_header_bytes(suite)
    assert head == 37 + suite.enc_bytes + 48 == (117 if suite is CL else 1205)
    assert envelope.batch_overhead_bytes(suite) == head + 16
    assert envelope.overhead_bytes(suite) == envelope.overhead_bytes(suite, 4) == 0
    for compress in (False, True):
        ids, proofs, payloads, contents = _bound(STUDY_A, m, d, n, compress=compress)
        content = contents[0]
        plaintexts = _plaintexts(proofs[0], payloads[0])
        body = envelope.seal_batch(me, STUDY_A, ids, content, plaintexts)
        record = 16 + len(plaintexts[0])  # as long as the plaintext record; one tag per batch
        assert record == envelope.record_bytes(content, d, n, suite, 4)
        assert len(body) == head + m * record + 16 == envelope.body_bytes(content, d, n, m, suite)
        # the header: batch id, key id, 0x80, version 4, suite ids, content, count; then the
        # report ids in clear, in order; then the one sealed message of the plaintexts
        assert body[16:24] == envelope.key_id(pk)
        assert body[24:33] == bytes([0x80, 4]) + suite.ids + bytes([content])
        assert int.from_bytes(body[33:37], "big") == m
        assert [body[head + 16 * i:head + 16 * (i + 1)] for i in range(m)] == ids
        assert envelope.record_ids(body, envelope.parse_batch(body, d, n), d, n) == b"".join(ids)
        assert envelope.is_batch(body) and envelope.count_records(body, d, n) == m
        # the plaintexts are nowhere in the body (the salt travels encrypted)
        assert all(bytes(p[:16]) not in body for p in plaintexts)
        # opened from the specification's text, and by the server's code, to the same plaintexts
        assert _spec_open(body, key, suite, STUDY_A, "s1", len(plaintexts[0])) == [bytes(p) for p in plaintexts]
        upload = envelope.open_batch(body, d, n, STUDY_A, "s1", lambda kid: key if kid == envelope.key_id(pk) else None)
        upload.verify(STUDY_A, n, 0)
        assert upload.ids == ids
        expected = ring.expand_seeds(payloads[0], d) if compress else payloads[0]
        np.testing.assert_array_equal(upload.shares(d), expected)
        # sealing the plaintext body the SDK sends gives a batch of the same layout and records
        media = messages.SEEDS_MEDIA_TYPE if compress else messages.SHARES_MEDIA_TYPE
        plain_body = b"".join(rid + bytes(pt) for rid, pt in zip(ids, plaintexts))
        from_body = envelope.seal_body(me, STUDY_A, plain_body, media, d, n)
        assert len(from_body) == len(body) and from_body[head:head + 16 * m] == body[head:head + 16 * m]
        assert _spec_open(from_body, key, suite, STUDY_A, "s1", len(plaintexts[0])) == [bytes(p) for p in plaintexts]
        # a batch does not cut at record boundaries (its count and order are sealed)
        with pytest.raises(ValueError, match="cannot be cut"):
            envelope.split_body(body, d, n)
        # a fresh batch id and secret each time: other bytes everywhere, the same plaintexts
        again = envelope.seal_batch(me, STUDY_A, ids, content, plaintexts)
        assert again[:16] != body[:16] and again[head + 16 * m:head + 16 * m + 32] != body[head + 16 * m:head + 16 * m + 32]
        assert envelope.open_batch(again, d, n, STUDY_A, "s1", lambda kid: key).ids == ids
    # the seal of one report is a one-record batch
    one = envelope.seal(me, STUDY_A, ids[0], content, plaintexts[0])
    assert len(one) == head + record + 16 and envelope.count_records(one, d, n) == 1
    # the per-record layouts are not sealed any more (issues 41 and 46)
    for version in (1 if suite is CL else 2, 3):
        with pytest.raises(ValueError, match="version 4 batches only"):
            envelope.seal_batch(me, STUDY_A, ids, content, plaintexts, version=version)


def _v4_pair(suite=CL, d: int = 5, m: int = 6, n: int = 3, content: int = envelope.CONTENT_SHARE):
    """Two version 4 batches of m reports each, sealed by one client to one server (s1) of one study."""
    pk, key = _suite_keys(suite)
    me = envelope.Recipient("s1", pk, suite)
    ids, proofs, payloads, _ = _bound(STUDY_A, 2 * m, d, n, compress=content == envelope.CONTENT_SEED)
    plaintexts = _plaintexts(proofs[0], payloads[0])
    a = envelope.seal_batch(me, STUDY_A, ids[:m], content, plaintexts[:m])
    b = envelope.seal_batch(me, STUDY_A, ids[m:], content, plaintexts[m:])
    return me, key, ids, a, b


def _cut(body: bytes, suite, d: int, n: int, content: int = envelope.CONTENT_SHARE):
    """(header, [records], tag) of a version 4 body, each record (its report id, its piece of the
    ciphertext): what a relay can rearrange."""
    head = envelope.batch_header_bytes(suite)
    size = envelope.plaintext_bytes(content, d, n)
    m = (len(body) - head - 16) // (16 + size)
    ids = [body[head + 16 * i:head + 16 * (i + 1)] for i in range(m)]
    sealed = body[head + 16 * m:]
    return body[:head], [(rid, sealed[i * size:(i + 1) * size]) for i, rid in enumerate(ids)], sealed[-16:]


def _join(header: bytes, records, tag: bytes) -> bytes:
    """A version 4 body from a header, (report id, ciphertext piece) records and a tag."""
    return header + b"".join(r[0] for r in records) + b"".join(r[1] for r in records) + tag


def _with_count(header: bytes, count: int) -> bytes:
    return header[:33] + count.to_bytes(4, "big") + header[37:]


NOT_OPEN = "its records do not open here"


@pytest.mark.parametrize("suite", [CL, PQ], ids=["classical", "post-quantum"])
def test_v4_substitution_reordering_truncation_splicing_and_replays_are_refused(suite):
    """Every way a relay could rearrange what it saw of a client's batches is refused: nothing of
    a refused body opens (open_batch is all or nothing)."""
    d, m, n = 5, 6, 3
    me, key, ids, a, b = _v4_pair(suite, d, m, n)
    ha, ra, ta = _cut(a, suite, d, n)
    hb, rb, tb = _cut(b, suite, d, n)
    assert _join(ha, ra, ta) == a and _join(hb, rb, tb) == b

    def refused(body: bytes, error=envelope.SealError, match: str | None = NOT_OPEN, study=STUDY_A, server="s1"):
        with pytest.raises(error, match=match):
            envelope.open_batch(body, d, n, study, server, lambda kid: key if kid == me.key_id else None)

    assert envelope.open_batch(a, d, n, STUDY_A, "s1", lambda kid: key).ids == ids[:m]
    # substitution: one record (id and ciphertext) replaced by the record at the same place of
    # the other batch, by another record of the same batch, or by a duplicate of its neighbour;
    # or only its ciphertext replaced, its id kept
    refused(_join(ha, ra[:2] + [rb[2]] + ra[3:], ta))
    refused(_join(ha, ra[:2] + [ra[4]] + ra[3:], ta))
    refused(_join(ha, [ra[0], ra[0]] + ra[2:], ta))
    refused(_join(ha, ra[:2] + [(ra[2][0], rb[2][1])] + ra[3:], ta))
    # reordering: two records swapped (ids and ciphertexts together), only two ids swapped, only
    # two ciphertexts swapped, or the whole batch reversed
    refused(_join(ha, [ra[0], ra[2], ra[1]] + ra[3:], ta))
    refused(_join(ha, [ra[0], (ra[2][0], ra[1][1]), (ra[1][0], ra[2][1])] + ra[3:], ta))
    refused(_join(ha, [ra[0], (ra[1][0], ra[2][1]), (ra[2][0], ra[1][1])] + ra[3:], ta))
    refused(_join(ha, list(reversed(ra)), ta))
    # a record relabelled under another report id (in clear in the body): the AAD fails
    refused(_join(ha, ra[:3] + [(ids[m + 3], ra[3][1])] + ra[4:], ta))
    # truncation: the last record (or all but one) dropped, with or without the tag; the count in
    # the header is sealed, so dropping records and rewriting the count fails too
    refused(_join(ha, ra[:-1], ta), envelope.MalformedSealedBatch, "truncated, padded or spliced")
    refused(_join(ha, ra[:1], ta), envelope.MalformedSealedBatch, "truncated, padded or spliced")
    refused(a[:-16], envelope.MalformedSealedBatch, "truncated, padded or spliced")
    refused(_join(_with_count(ha, m - 1), ra[:-1], ta), match="its key does not open here")
    refused(_join(_with_count(ha, 1), ra[:1], ta), match="its key does not open here")
    refused(ha, envelope.MalformedSealedBatch, None)  # the header alone
    # extension: a record of the other batch appended, with or without the count raised
    refused(_join(ha, ra + [rb[0]], ta), envelope.MalformedSealedBatch, "truncated, padded or spliced")
    refused(_join(_with_count(ha, m + 1), ra + [rb[0]], ta), match="its key does not open here")
    # splicing two batches: a's header with b's records and tag (or a's tag), a's first half
    # with b's second half, and the two batches back to back in one body
    refused(_join(ha, rb, tb))
    refused(_join(ha, rb, ta))
    refused(_join(ha, ra[:3] + rb[3:], ta))
    refused(_join(hb, rb[:3] + ra[3:], tb))
    refused(a + b, envelope.MalformedSealedBatch, "truncated, padded or spliced")
    # a relay replaying a's header with records it made itself under a secret of its own (it
    # has the plaintexts, as a colluding client would): the secret is a's, not the relay's
    _, own_proofs, own_shares, _ = _bound(STUDY_A, m, d, n)
    relay = envelope.seal_batch(me, STUDY_A, ids[:m], envelope.CONTENT_SHARE, _plaintexts(own_proofs[0], own_shares[0]))
    _, rr, tr = _cut(relay, suite, d, n)
    refused(_join(ha, [rr[0]] + ra[1:], ta))
    refused(ha + relay[len(ha):])
    # the whole batch at another server or study
    refused(a, match="its key does not open here", server="s2")
    refused(a, match="its key does not open here", study=STUDY_B)
    # bytes after the batch, or a version 1 record (of the dropped layout) before it
    v1 = ids[0] + bytes(8) + bytes([envelope.CONTENT_SHARE]) + bytes(32 + envelope.plaintext_bytes(1, d, n) + 16)
    refused(a + v1, envelope.MalformedSealedBatch, None)
    refused(v1 + a, envelope.MalformedSealedBatch, "version 1")
    # every byte of the header, and bytes all over the records and the tag, altered one bit at a time
    for at in range(len(ha)):
        bad = bytearray(a)
        bad[at] ^= 0x01 << (at % 8)
        with pytest.raises((envelope.SealError, envelope.MalformedSealedBatch)):
            envelope.open_batch(bytes(bad), d, n, STUDY_A, "s1", lambda kid: key if kid == me.key_id else None)
    for at in [*range(len(ha), len(a), 7), len(a) - 1]:
        bad = bytearray(a)
        bad[at] ^= 0x80
        refused(bytes(bad))


def test_v4_header_fields_are_bound():
    """The kind (at a width where a share and a seed are both 32 bytes), the key id, the suite
    and the version of a batch header cannot change without the batch failing."""
    d, m, n = 4, 3, 2  # 8 d = 32: share and seed records have the same length
    pk, key = _suite_keys(CL)
    other_pk, other_key = _suite_keys(CL)
    pq_pk, pq_key = _suite_keys(PQ)
    lookup = {envelope.key_id(pk): key, envelope.key_id(other_pk): other_key, envelope.key_id(pq_pk): pq_key}
    ids, proofs, shares, _ = _bound(STUDY_A, m, d, n)
    a = envelope.seal_batch(envelope.Recipient("s1", pk), STUDY_A, ids, envelope.CONTENT_SHARE,
                            _plaintexts(proofs[0], shares[0]))

    def opened(body):
        return envelope.open_batch(body, d, n, STUDY_A, "s1", lookup.get)

    assert opened(a).ids == ids
    with pytest.raises(envelope.SealError, match="its key does not open here"):  # share relabelled as seed
        opened(a[:32] + bytes([envelope.CONTENT_SEED]) + a[33:])
    with pytest.raises(envelope.SealError, match="its key does not open here"):  # another key of the server
        opened(a[:16] + envelope.key_id(other_pk) + a[24:])
    with pytest.raises(envelope.SealError, match="another suite"):  # the server's post-quantum key
        opened(a[:16] + envelope.key_id(pq_pk) + a[24:])
    with pytest.raises(envelope.SealError, match="unknown key id"):
        opened(a[:16] + bytes(8) + a[24:])
    with pytest.raises(envelope.UnknownSuite, match="is not one this server opens"):
        opened(a[:27] + b"\x21" + a[28:])
    with pytest.raises(envelope.MalformedSealedBatch, match="not a version 4"):
        opened(a[:25] + b"\x05" + a[26:])
    with pytest.raises(envelope.MalformedSealedBatch, match="version 3 .one AEAD per record"):
        opened(a[:25] + b"\x03" + a[26:])
    with pytest.raises(envelope.MalformedSealedBatch, match="count is 0"):
        opened(_with_count(a[:117], 0))
    with pytest.raises(envelope.MalformedSealedBatch, match="unknown content kind"):
        opened(a[:32] + b"\x07" + a[33:])
    # the batch id is bound too (it is in the sealed header and in the records' key and AAD)
    with pytest.raises(envelope.SealError, match="its key does not open here"):
        opened(bytes(16) + a[16:])


# --- real servers ------------------------------------------------------------------------------


@pytest.fixture
def no_floor_cluster(servers):
    """Servers that accept studies without server noise: a release exactly the shares' sum. A
    cluster of the test's own, for the tests that rotate keys or restart servers; the others share
    ``no_floor_module_cluster`` (the same configuration, one per module): each makes its own study
    and counts only what that study holds. Its policy only widens which studies the servers accept
    (no noise floor required), so the tests of default designs run on it unchanged."""
    return exact_cluster(servers)


def _study(c, n, name, **kw) -> Study:
    """A study these tests upload all n reports to. lambda_star is chosen for 3/4 of them: with
    k = 16 and n = 200 (12.5 reports a row), lambda_min falls below the one chosen for all n in
    about 0.4 % of draws and the servers refuse to release (a simulation of 3,000 sketches; the
    suite failed so twice), for 3/4 of them in none."""
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name=name, columns=COLUMNS, label="y", expected_reports=n,
                                  k=16, s=4, min_reports=n * 3 // 4, **kw)
    return Study.model_validate(created["study"])


def _info(url: str) -> dict:
    r = httpx.get(f"{url}/v1/info")
    assert r.status_code == 200
    return r.json()


def _recipient(url: str, server_id: str, version: int = 4) -> envelope.Recipient:
    hpke = _info(url)["hpke"]
    current = next(k for k in hpke["keys"] if k["key_id"] == hpke["current"])
    return envelope.Recipient(server_id, bytes.fromhex(current["public_key"]), version=version)


_recipient_of = _recipient


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
def test_sdk_sealed_upload_releases_exactly_the_plaintext_sketch(no_floor_module_cluster, monkeypatch, compress):
    """Client(encrypt=True) through 3 real servers: every request body is one version 4 sealed
    batch (bodies the server refuses as too large are cut in their plaintext and sealed again),
    and the release equals S(A + G) of the reports the SDK prepared, exactly in the ring (a
    study without server noise)."""
    c = no_floor_module_cluster
    n = 500
    study = _study(c, n, f"sealed-{compress}", epsilon_floor=None)
    assert all(_info(u)["hpke"]["versions"] == [4] for u in c.server_urls)  # versions 1 to 3: dropped
    capture = _Capture(monkeypatch)
    seen: list[tuple[str, int, bytes]] = []
    too_large = []

    class Watch(httpx.HTTPTransport):
        """Records every stored request body; answers 413 (as a server with a 6000-byte limit
        would) to larger batches, so the SDK must cut sealed bodies (and seal them again)."""

        def handle_request(self, request):
            if request.method == "POST":
                if len(request.content) > 6000:
                    too_large.append(len(request.content))
                    return httpx.Response(413, json={"type": "urn:dpsketch:problem:payload-too-large",
                                                      "title": "too large", "status": 413, "detail": "x"})
                seen.append((request.headers["content-type"], request.url.port, request.content))
            return super().handle_request(request)

    rows = np.random.default_rng(3).normal(0, 0.3, size=(n, len(COLUMNS)))
    with Client(c.server_urls, encrypt=True, compress=compress, transport=Watch()) as client:
        client.submit(study.study_id, rows[0])  # a single report: a one-record sealed batch
        result = client.submit_many(study.study_id, rows[1:], batch_size=200)
    assert result.n_reports == n - 1
    assert seen and all(ct == messages.SEALED_MEDIA_TYPE for ct, _, _ in seen)
    d, nn = study.width, study.n_servers
    share = 16 + 16 * nn + 8 * d  # a version 4 record: report id, proof, share (one tag per batch)
    assert [len(body) for _, _, body in seen[:3]] == [117 + share + 16] * 3  # the single report
    ports = [httpx.URL(u).port for u in c.server_urls]
    batch_rows = [200, 200, n - 1 - 400]  # the three prepared batches of submit_many
    for j, port in enumerate(ports):
        bodies = [body for _, p, body in seen if p == port]
        counts = [envelope.count_records(body, d, nn) for body in bodies]
        assert sum(counts) == n  # every report once at every server, none lost or doubled
        full = 0  # records of full shares in the batches (the single report aside)
        for k, (body, m) in enumerate(zip(bodies, counts)):
            content = body[32]
            assert envelope.is_batch(body) and content in (envelope.CONTENT_SHARE, envelope.CONTENT_SEED)
            assert content == envelope.CONTENT_SHARE or (compress and k > 0)  # the single report: a share
            full += m if k > 0 and content == envelope.CONTENT_SHARE else 0
            assert len(body) == envelope.body_bytes(content, d, nn, m) == 133 + m * envelope.record_bytes(
                content, d, nn, version=4)
        # with seeds, batch i's full shares go to server i mod N (client_sdk/prepare.py), seeds elsewhere
        assert full == (batch_rows[j] if compress else n - 1), (j, full)
    assert too_large  # bodies were cut (and each half sealed again: it opened, counts above)
    ids, encoded = capture.ids_and_encoded(3)
    assert len(ids) == n
    released = _released(c, study)
    expected = ring.decode(direct_sketch(study, ids, encoded), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(released, expected)


@pytest.mark.parametrize("version", [4])
def test_misrouted_wrong_study_and_tampered_shares_are_refused_and_change_nothing(no_floor_module_cluster, version):
    c = no_floor_module_cluster
    study = _study(c, 200, f"misroute-{version}")
    other = _study(c, 200, f"other-{version}")
    s1, s2, _ = c.server_urls
    _recipient = functools.partial(_recipient_of, version=version)
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
    cross = envelope.seal_batch(envelope.Recipient("s1", keys_s2.public_key, version=version), study.study_id, ids,
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
    # one tampered record in an otherwise good batch: the whole batch is refused, named by its id
    for at in (len(to_s1) - 17, len(to_s1) - 1):  # the last record's ciphertext, the batch's tag
        bad = bytearray(to_s1)
        bad[at] ^= 0x80
        r = _post_sealed(s1, study.study_id, bytes(bad))
        assert r.status_code == 422 and r.json()["type"].endswith("sealed-share-refused")
        assert f"sealed batch {to_s1[:16].hex()}: its records do not open here" in r.json()["detail"]
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


def test_v4_attacks_at_real_servers_are_refused_and_change_nothing(no_floor_module_cluster):
    """Rearranged version 4 batches posted to a real server: each is refused with a 4xx problem
    and stores nothing (counts stay put); the genuine batches are then accepted, a replay of a
    whole batch is only duplicates, and the release is exactly S(A + G) of the genuine reports
    (no study noise), so no refused body left anything in the running totals."""
    c = no_floor_module_cluster
    m = 200
    study = _study(c, m, "v4-attacks", epsilon_floor=None)
    d, n = study.width, study.n_servers
    encoded = ring.random_ring((m, d))
    shares = ring.share(encoded, n)
    ids, proofs = binding.bind(study.study_id, [envelope.CONTENT_SHARE] * n, shares)
    s1 = c.server_urls[0]
    to = [_recipient(u, f"s{j + 1}") for j, u in enumerate(c.server_urls)]
    half = m // 2
    a = envelope.seal_batch(to[0], study.study_id, ids[:half], envelope.CONTENT_SHARE,
                            _plaintexts(proofs[0][:half], shares[0][:half]))
    b = envelope.seal_batch(to[0], study.study_id, ids[half:], envelope.CONTENT_SHARE,
                            _plaintexts(proofs[0][half:], shares[0][half:]))
    ha, ra, ta = _cut(a, CL, d, n)
    hb, rb, tb = _cut(b, CL, d, n)
    attacks = {
        "one record substituted": (_join(ha, ra[:5] + [rb[5]] + ra[6:], ta), 422, "sealed-share-refused"),
        "two records swapped": (_join(ha, [ra[1], ra[0]] + ra[2:], ta), 422, "sealed-share-refused"),
        "two report ids swapped": (_join(ha, [(ra[1][0], ra[0][1]), (ra[0][0], ra[1][1])] + ra[2:], ta), 422,
                                   "sealed-share-refused"),
        "a record under another report id": (_join(ha, [(ids[half], ra[0][1])] + ra[1:], ta), 422,
                                             "sealed-share-refused"),
        "truncated": (_join(ha, ra[:-1], ta), 400, "malformed-body"),
        "the tag cut off": (a[:-16], 400, "malformed-body"),
        "truncated, count rewritten": (_join(_with_count(ha, half - 1), ra[:-1], ta), 422, "sealed-share-refused"),
        "a's header, b's records": (_join(ha, rb, tb), 422, "sealed-share-refused"),
        "a's first half, b's second": (_join(ha, ra[:half // 2] + rb[half // 2:], ta), 422, "sealed-share-refused"),
        "two batches in one body": (a + b, 400, "malformed-body"),
        "a tag altered": (a[:-1] + bytes([a[-1] ^ 1]), 422, "sealed-share-refused"),
    }
    for name, (body, status, slug) in attacks.items():
        r = _post_sealed(s1, study.study_id, body)
        assert (r.status_code, r.json()["type"]) == (status, f"urn:dpsketch:problem:{slug}"), (name, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
    r = _post_sealed(c.server_urls[1], study.study_id, a)  # s1's batch at s2
    assert r.status_code == 422 and "unknown key id" in r.json()["detail"]
    assert [_count(u, study.study_id) for u in c.server_urls] == [0, 0, 0]
    # the genuine batch; then the same attacks against a server that holds its reports
    assert _post_sealed(s1, study.study_id, a).json() == {"accepted": half, "duplicates": 0, "report_count": half}
    for name, (body, status, slug) in attacks.items():
        r = _post_sealed(s1, study.study_id, body)
        assert (r.status_code, r.json()["type"]) == (status, f"urn:dpsketch:problem:{slug}"), (name, r.text)
    # a replayed batch: nothing new (idempotent by report id)
    assert _post_sealed(s1, study.study_id, a).json() == {"accepted": 0, "duplicates": half, "report_count": half}
    assert _count(s1, study.study_id) == half
    assert _post_sealed(s1, study.study_id, b).json()["accepted"] == m - half
    for j in (1, 2):
        body = envelope.seal_batch(to[j], study.study_id, ids, envelope.CONTENT_SHARE,
                                   _plaintexts(proofs[j], shares[j]))
        assert _post_sealed(c.server_urls[j], study.study_id, body).json()["accepted"] == m
    held = httpx.get(f"{s1}/v1/studies/{study.study_id}/report-ids",
                     headers={"Authorization": f"Bearer {c.specs[0].analyst_token}"})
    assert messages.decode_report_ids(held.content) == sorted(ids)
    released = _released(c, study)
    expected = ring.decode(direct_sketch(study, ids, encoded), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(released, expected)


def test_sdk_refuses_servers_that_share_a_key(no_floor_module_cluster):
    """Two server ids publishing one public key: the SDK refuses before sending anything."""
    c = no_floor_module_cluster
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
    from dpsketch.client_sdk import SDKError

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
    assert "sealed_v1" not in figures  # the per-record layout was dropped (issue 41)
    # version 4: a 117-byte header and a 16-byte tag per batch and server, nothing per record
    assert sealed["bytes_per_row"] - plain["bytes_per_row"] == pytest.approx(3 * 133 / 2000)
    assert sealed["seal_us_per_row"] > 0 and sealed["open_us_per_row"] > 0
    print(f"\nbench_encryption(2000, d=6, N=3): {json.dumps(figures)}")


def test_random_sealed_bodies_get_400_or_422_never_500(tmp_path: Path):
    """In process: bodies shaped like sealed batches (the server's real key ids, both kinds, the
    version 4 layout and the dropped versions 1 to 3, both suites, all sorts of lengths, counts and bytes; some properly sealed to
    the server around random proofs and payloads, a few of those then altered) are refused with
    problem JSON and store nothing."""
    from fastapi.testclient import TestClient

    from dpsketch.protocol.study import design
    from dpsketch.services.app import create_app
    from dpsketch.services.settings import Settings

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
        for i in range(240):
            kind = int(rng.choice([1, 2, 0, 3, 255, 0x80, 0x83, 0x84, 0x84]))
            if i % 10 == 0:  # opens, but the random proofs do not bind the payloads to the ids
                kind = 1 + (i // 10) % 2
                plain = envelope.plaintext_bytes(kind, st.width, st.n_servers)
                m = int(rng.integers(1, 4))
                to = [(me, 4), (me_pq, 4)][(i // 10) % 2]
                rec = bytearray(envelope.seal_batch(to[0], st.study_id, [rng.bytes(16) for _ in range(m)], kind,
                                                    [rng.bytes(plain) for _ in range(m)], version=to[1]))
                if i % 30 == 0:  # ... or one byte of a good batch altered
                    rec[int(rng.integers(0, len(rec)))] ^= 1 << int(rng.integers(0, 8))
                body = bytes(rec)
            elif kind in (0x83, 0x84):  # version 4 (or the dropped 3): a header of either suite (or random ids), random rest
                suite = envelope.POST_QUANTUM if i % 2 else envelope.CLASSICAL
                count = int(rng.choice([0, 1, 2, 3, 2**32 - 1]))
                size = envelope.body_bytes(1, st.width, st.n_servers, min(max(count, 1), 3), suite)
                rec = bytearray(rng.bytes(max(0, size + int(rng.choice([0, 0, -1, 1, -48, 200])))))
                if len(rec) >= 37:
                    rec[16:24] = (bytes.fromhex(pq["current"]) if suite.post_quantum else kid) if i % 3 else rng.bytes(8)
                    rec[24:37] = (bytes([0x80, kind & 0x7F]) + (suite.ids if i % 4 else rng.bytes(6))
                                  + bytes([int(rng.choice([1, 2, 7]))]) + count.to_bytes(4, "big"))
                body = bytes(rec)
            elif kind == 0x80:  # the dropped version 2: the post-quantum suite's ids, or random ones
                size = 33 + 1088 + envelope.plaintext_bytes(1, st.width, st.n_servers) + 16
                rec = bytearray(rng.bytes(size + int(rng.choice([0, 0, -1, 1, -1088]))))
                rec[16:24] = bytes.fromhex(pq["current"]) if i % 3 else rng.bytes(8)
                rec[24:33] = bytes([0x80, 2]) + (envelope.POST_QUANTUM.ids if i % 4 else rng.bytes(6)) + b"\x01"
            else:
                # the dropped version 1 layout (57 bytes of header and tag around the plaintext)
                size = 57 + envelope.plaintext_bytes(kind, st.width, st.n_servers) if kind in (1, 2) else 60
                size += int(rng.choice([0, 0, 0, -1, 1, 40]))
                rec = bytearray(rng.bytes(max(size, 0)))
                if len(rec) > 25:
                    rec[16:24] = kid if i % 3 else rng.bytes(8)
                    rec[24] = kind
                    if i % 5 == 0:
                        rec[25:57] = bytes(32)  # the all-zero (low-order) X25519 point
            if kind not in (0x83, 0x84) and i % 10:  # one or two records of version 1 or 2
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
