"""The test vectors of docs/protocol.md section 9, checked against the protocol module and an
independent big-integer recomputation, so the document and the code cannot drift apart."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from dpsketch.protocol import canonical, ring, sketch
from dpsketch.protocol.bounds import ColumnMap

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


def _vectors() -> dict:
    text = DOC.read_text()
    section = text.split("## 9. Test vectors", 1)[1]
    block = re.search(r"```json\n(.*?)\n```", section, re.S)
    assert block, "docs/protocol.md section 9 has no json block"
    return json.loads(block.group(1))


VECTORS = _vectors()


@pytest.mark.parametrize("vec", VECTORS["sketch"], ids=lambda v: f"k{v['k']}s{v['s']}-{v['report_id'][:4]}")
def test_sketch_hash_vectors(vec):
    seed = bytes.fromhex(VECTORS["seed"])
    rid = bytes.fromhex(vec["report_id"])
    k, s = vec["k"], vec["s"]
    b = k // s
    digest = hashlib.blake2b(b"dpsketch/osnap/1" + rid, digest_size=8 * s, key=seed).digest()
    assert digest.hex() == vec["digest"]
    # independent recomputation with Python integers, straight from the specification
    for l in range(s):
        u = int.from_bytes(digest[8 * l : 8 * l + 8], "little")
        assert (u * b) >> 64 == vec["buckets"][l]
        assert (1 if u % 2 == 0 else -1) == vec["signs"][l]
    # the vectorized implementation every component uses
    rows, signs = sketch.hash_report_ids(seed, [rid], k, s)
    assert [int(r - l * b) for l, r in enumerate(rows[0])] == vec["buckets"]
    assert signs[0].tolist() == vec["signs"]


def test_vectorized_hash_matches_reference_on_many_ids():
    rng = np.random.default_rng(7)
    seed = rng.bytes(32)
    ids = [rng.bytes(16) for _ in range(500)]
    for k, s in [(400, 4), (7, 1), (64, 8), (2**20, 2)]:
        rows, signs = sketch.hash_report_ids(seed, ids, k, s)
        for i in range(0, 500, 37):
            for l in range(s):
                bucket, sign = sketch.bucket_and_sign(seed, ids[i], k, s, l)
                assert rows[i, l] == l * (k // s) + bucket and signs[i, l] == sign
        assert rows.min() >= 0 and rows.max() < k


def test_sketch_columns_have_unit_norm():
    seed = bytes(32)
    ids = [i.to_bytes(16, "little") for i in range(200)]
    S = sketch.dense_matrix(seed, ids, 40, 4)
    np.testing.assert_allclose(np.linalg.norm(S, axis=0), 1.0)
    assert ((S != 0).sum(axis=0) == 4).all()


@pytest.mark.parametrize("vec", VECTORS["ring"], ids=lambda v: str(v["x"]))
def test_ring_vectors(vec):
    expected = round(vec["x"] * 2 ** vec["frac_bits"]) % 2**64
    assert expected == vec["encoded"]
    enc = ring.encode(np.array([vec["x"]]), vec["frac_bits"], 10.0)
    assert int(enc[0]) == vec["encoded"]
    assert abs(ring.decode(enc, vec["frac_bits"])[0] - vec["x"]) <= 2.0 ** -vec["frac_bits"]


def test_canonical_json_vectors():
    for vec in VECTORS["canonical_json"]:
        got = canonical.canonical_json(vec["value"])
        assert got.decode() == vec["canonical"]
        assert hashlib.sha256(got).hexdigest() == vec["sha256"] == canonical.content_hash(vec["value"])


def test_ring_refuses_out_of_range_instead_of_wrapping():
    with pytest.raises(ring.EncodingRangeError):
        ring.encode(np.array([10.5]), 20, 10.0)
    with pytest.raises(ring.EncodingRangeError):
        ring.encode(np.array([np.nan]), 20, 10.0)


def test_overflow_bound_picks_largest_safe_frac_bits():
    f = ring.max_frac_bits(10**6, 3.0)
    assert 10**6 * 3.0 * 2.0**f < 2.0**63 <= 10**6 * 3.0 * 2.0 ** (f + 1)
    # the worst case sum of max_reports values at the bound decodes without wrapping
    values = np.full(1000, 3.0)
    enc = ring.encode(values, f, 3.0)
    total = np.array([np.sum(enc, dtype=np.uint64)]) * np.uint64(1000)  # 10^6 values, wrapping adds
    assert ring.decode(total, f)[0] == pytest.approx(3.0e6)


def test_k_equal_one_is_the_plain_sum():
    ids = [i.to_bytes(16, "little") for i in range(50)]
    rows, signs = sketch.hash_report_ids(bytes(32), ids, 1, 1)
    assert (rows == 0).all() and (signs == 1).all()
    assert sketch.bucket_and_sign(bytes(32), ids[3], 1, 1, 0) == (0, 1)


@pytest.mark.parametrize("vec", VECTORS["seed_expansion"], ids=lambda v: v["seed"][:8])
def test_seed_expansion_vectors(vec):
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    seed = bytes.fromhex(vec["seed"])
    want = [int(v) for v in vec["share"]]
    assert ring.expand_seed(seed, len(want)).tolist() == want
    # independently, straight from the specification (RFC 8439 ChaCha20, counter 0)
    nonce = hashlib.sha256(b"dpsketch/seed-share/1").digest()[:12]
    stream = Cipher(algorithms.ChaCha20(seed, bytes(4) + nonce), mode=None).encryptor().update(bytes(8 * len(want)))
    assert [int.from_bytes(stream[8 * i : 8 * i + 8], "little") for i in range(len(want))] == want


def test_binding_vectors():
    """Report binding (section 4a), straight from the specification with hashlib, then through
    the protocol module: each commitment, the report id, and each server's proof verifying."""
    from dpsketch.protocol import binding

    vec = VECTORS["binding"]
    study = bytes.fromhex(vec["study_id"])
    commitments = []
    for srv in vec["servers"]:
        salt, payload = bytes.fromhex(srv["salt"]), bytes.fromhex(srv["payload"])
        c = hashlib.sha256(b"dpsketch/commit/2" + bytes([srv["position"], srv["content"]]) + salt
                           + payload).digest()[:16]
        assert c.hex() == srv["commitment"]
        assert binding.commitment(srv["position"], srv["content"], salt, payload) == c
        commitments.append(c)
    rid = hashlib.sha256(b"dpsketch/report/2" + study + b"".join(commitments)).digest()[:16]
    assert rid.hex() == vec["report_id"] == binding.report_id(vec["study_id"], commitments).hex()
    n = len(vec["servers"])
    for srv in vec["servers"]:
        j = srv["position"]
        proof = bytes.fromhex(srv["proof"])
        assert proof == bytes.fromhex(srv["salt"]) + b"".join(c for i, c in enumerate(commitments) if i != j)
        payload = np.frombuffer(bytes.fromhex(srv["payload"]), dtype=np.uint8 if srv["content"] == 2 else "<u8")
        binding.verify(vec["study_id"], n, j, srv["content"], [rid], np.frombuffer(proof, np.uint8)[None, :],
                       payload[None, :])
        with pytest.raises(binding.BindingError):  # the same proof at another server's position
            binding.verify(vec["study_id"], n, (j + 1) % n, srv["content"], [rid],
                           np.frombuffer(proof, np.uint8)[None, :], payload[None, :])


# --- sealed batches (section 7a, version 4) -------------------------------------------------------


def _hkdf_sha256(ikm: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 with no salt (HashLen zero bytes), from hmac alone."""
    import hmac

    prk = hmac.new(bytes(32), ikm, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


@pytest.mark.parametrize("vec", VECTORS["sealed_v4"], ids=lambda v: v["suite"])
def test_sealed_v4_vectors(vec):
    """Every deterministic byte of a version 4 batch recomputed from section 7a's definitions
    (hashlib, hmac and the RFC 8439 AEAD of the cryptography package), the randomized HPKE part
    opened, and the reference implementation checked against both."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    from dpsketch.protocol import envelope

    suite = envelope.SUITES[vec["suite"]]
    assert (suite.kem_id, suite.kdf_id, suite.aead_id) == (vec["kem_id"], vec["kdf_id"], vec["aead_id"])
    assert vec["version"] == 4
    sk = bytes.fromhex(vec["private_key"])
    pk = bytes.fromhex(vec["public_key"])
    assert suite.public_key_of(sk) == pk and hashlib.sha256(pk).digest()[:8].hex() == vec["key_id"]
    study, sid = bytes.fromhex(vec["study_id"]), vec["server_id"].encode()
    prefix = study + bytes([len(sid)]) + sid
    records = vec["records"]
    n, width, content = vec["n_servers"], vec["width"], vec["content"]
    # the records' plaintexts are real reports for this server (section 4a)
    for rec in records:
        salt, payload = bytes.fromhex(rec["salt"]), bytes.fromhex(rec["payload"])
        commits = [bytes.fromhex(c) for c in rec["commitments"]]
        assert hashlib.sha256(b"dpsketch/commit/2" + bytes([vec["position"], content]) + salt
                              + payload).digest()[:16] == commits[vec["position"]]
        assert hashlib.sha256(b"dpsketch/report/2" + study + b"".join(commits)).digest()[:16].hex() == rec["report_id"]
        proof = salt + b"".join(c for j, c in enumerate(commits) if j != vec["position"])
        assert rec["plaintext"] == (proof + payload).hex()
    # the header, info and transcript
    fixed = (bytes.fromhex(vec["batch_id"]) + bytes.fromhex(vec["key_id"]) + bytes([0x80, 4])
             + vec["kem_id"].to_bytes(2, "big") + vec["kdf_id"].to_bytes(2, "big") + vec["aead_id"].to_bytes(2, "big")
             + bytes([content]) + vec["count"].to_bytes(4, "big"))
    assert fixed.hex() == vec["fixed"] and vec["count"] == len(records)
    info4 = b"dpsketch/sealed/4" + hashlib.sha256(prefix + fixed).digest()
    assert info4.hex() == vec["info"] and len(info4) == 49
    sealed_secret = bytes.fromhex(vec["sealed_secret"])
    assert len(sealed_secret) == suite.enc_bytes + 48
    assert suite.hpke_suite.decrypt(sealed_secret, suite.load_private_key(sk), info=info4).hex() == vec["secret"]
    header = fixed + sealed_secret
    transcript = hashlib.sha256(prefix + header).digest()
    assert transcript.hex() == vec["transcript"]
    key = _hkdf_sha256(bytes.fromhex(vec["secret"]), b"dpsketch/sealed/4/records" + transcript)
    assert key.hex() == vec["record_key"]
    # the report ids in clear, then every plaintext sealed as one message, nonce zero, the
    # associated data the transcript and the ids
    ids = b"".join(bytes.fromhex(r["report_id"]) for r in records)
    nonce, aad = bytes(12), transcript + ids
    assert (ids.hex(), nonce.hex(), aad.hex()) == (vec["report_ids"], vec["nonce"], vec["aad"])
    sealed = ChaCha20Poly1305(key).encrypt(nonce, b"".join(bytes.fromhex(r["plaintext"]) for r in records), aad)
    assert sealed.hex() == vec["sealed"]
    body = header + ids + sealed
    assert body.hex() == vec["body"]
    assert len(body) == 37 + suite.enc_bytes + 48 + len(records) * (16 + 16 * n + 8 * width) + 16
    # the reference implementation: the same derivations, the same records, and it opens the body
    secret = bytes.fromhex(vec["secret"])
    assert envelope.info_v4(vec["study_id"], vec["server_id"], fixed) == info4
    assert envelope.transcript_v4(vec["study_id"], vec["server_id"], header) == transcript
    assert envelope.record_key(secret, transcript) == key
    id_list = [bytes.fromhex(r["report_id"]) for r in records]
    assert envelope.seal_records(secret, transcript, id_list, [bytes.fromhex(r["plaintext"]) for r in records]) \
        == body[len(header):]
    upload = envelope.open_batch(body, width, n, vec["study_id"], vec["server_id"],
                                 lambda kid: suite.load_private_key(sk) if kid.hex() == vec["key_id"] else None)
    assert upload.ids == id_list
    upload.verify(vec["study_id"], n, vec["position"])


def test_sealed_batch_vectors_are_what_the_script_writes():
    """Section 9's sealed_v4 block is what scripts/make_sealed_batches.py computes from its own
    inputs (its randomized sealed_secret kept while it opens): the document and the script agree."""
    import importlib.util

    path = DOC.parent.parent / "scripts" / "make_sealed_batches.py"
    spec = importlib.util.spec_from_file_location("make_sealed_batches", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = DOC.read_text()
    assert module.render(text) == text


# --- relayed uploads (section 7b) -------------------------------------------------------------------


def test_relayed_vector_from_the_text():
    """The relayed vector recomputed from section 7b's definitions with hashlib and hmac alone
    (so the document, not only the code, is checked), over section 9's classical sealed batch,
    then the reference implementation checked against it, and against a moved MAC."""
    import hmac

    from dpsketch.protocol import relayed

    vec = VECTORS["relayed"]
    sealed = next(v for v in VECTORS["sealed_v4"] if v["suite"] == "classical")
    assert (vec["study_id"], vec["server_id"]) == (sealed["study_id"], sealed["server_id"])
    batch = bytes.fromhex(sealed["body"])
    # the token's digest (what its server keeps), its public id and the MAC key
    digest = hashlib.sha256(vec["token"].encode("utf-8")).digest()
    assert digest.hex() == vec["token_digest"] and digest[:8].hex() == vec["token_id"]
    key = hashlib.sha256(b"dpsketch/relayed/1/key" + digest).digest()
    assert key.hex() == vec["mac_key"]
    # the batch's header is its first 37 + Nenc + 48 bytes (classical Nenc 32); the transcript
    # section 7a's: SHA-256(study_id || len(server_id) || server_id || header)
    header = batch[:37 + 32 + 48]
    assert header.hex() == vec["batch_header"] == sealed["fixed"] + sealed["sealed_secret"]
    sid = vec["server_id"].encode("ascii")
    transcript = hashlib.sha256(bytes.fromhex(vec["study_id"]) + bytes([len(sid)]) + sid + header).digest()
    assert transcript.hex() == vec["transcript"] == sealed["transcript"]
    message = b"dpsketch/relayed/1" + transcript
    assert message.hex() == vec["mac_input"]
    mac = hmac.new(key, message, hashlib.sha256).digest()
    assert mac.hex() == vec["mac"]
    # entry = len(server_id) (1) || server_id || token_id (8) || mac (32) || length (4, big-endian)
    # || batch; bundle = count (4, big-endian) || entries
    entry = bytes([len(sid)]) + sid + digest[:8] + mac + len(batch).to_bytes(4, "big") + batch
    assert entry.hex() == vec["entry"]
    bundle = (1).to_bytes(4, "big") + entry
    assert bundle.hex() == vec["bundle"]
    # the reference implementation: the same bytes, and it decodes and verifies them
    assert relayed.token_digest(vec["token"]) == digest and relayed.token_id(digest) == digest[:8]
    assert relayed.mac_key(digest) == key and relayed.batch_header(batch) == header
    made = relayed.make_entry(vec["token"], vec["study_id"], vec["server_id"], batch)
    assert made.encode() == entry and relayed.encode([made]) == bundle
    (decoded,) = relayed.decode(bundle)
    assert decoded == made and relayed.verify_mac(digest, vec["study_id"], vec["server_id"], decoded)
    # the MAC is bound to the server and the study, and to the token
    assert not relayed.verify_mac(digest, vec["study_id"], "s2", decoded)
    assert not relayed.verify_mac(digest, "0" * 64, vec["server_id"], decoded)
    assert not relayed.verify_mac(hashlib.sha256(b"another token").digest(), vec["study_id"], vec["server_id"],
                                  decoded)
    # a study without tokens: zero id and MAC, the same layout
    bare = relayed.make_entry(None, vec["study_id"], vec["server_id"], batch)
    assert bare.encode() == bytes([len(sid)]) + sid + bytes(8 + 32) + len(batch).to_bytes(4, "big") + batch


def test_relayed_vector_is_what_the_script_writes():
    """Section 9's relayed vector is what scripts/make_relayed_vectors.py computes from its token
    and the classical sealed batch of the block: the document and the script agree."""
    import importlib.util

    path = DOC.parent.parent / "scripts" / "make_relayed_vectors.py"
    spec = importlib.util.spec_from_file_location("make_relayed_vectors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = DOC.read_text()
    assert module.render(text) == text


def test_bounds_vectors_bit_for_bit():
    """Section 2e's map of raw rows into the ball, operation for operation: every mapped double
    equal to the vector's (a client computing mid or half another way, or scaling before the
    clamp, differs in the last bits), and the clamped counts."""
    vec = VECTORS["bounds"]
    cmap = ColumnMap.of(vec["bounds"], vec["constant"], vec["clip_bound"])
    rows = np.array(vec["rows"], dtype=np.float64)
    mapped = cmap.to_ball(rows)
    assert mapped.tolist() == vec["mapped"]
    assert cmap.clamped_counts(rows).tolist() == vec["clamped"]
    # and the inverse the analyzer uses gives the clamped raw values back
    clamped = np.minimum(np.maximum(rows, cmap.lo), cmap.hi)
    assert np.allclose(cmap.from_ball(mapped), clamped, rtol=1e-12)
