"""conformance/sealing.json and the vectors of docs/sealing.md section 2, recomputed from the
documents: X-Wing's combiner (label last), its key layout (the ML-KEM seed d || z, then the X25519
key; SHAKE256 of an X-Wing seed), ML-KEM's implicit rejection, DHKEM(X25519) and RFC 9180's key
schedule, written here from those texts with only ML-KEM-768, X25519 and SHA-3 taken from
libraries; and opened with the product's HPKE (the ``cryptography`` package)."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import mlkem, x25519
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from dpsketch.protocol import envelope

ROOT = Path(__file__).resolve().parents[1]
DOC = json.loads((ROOT / "conformance" / "sealing.json").read_text())
VECTORS = DOC["vectors"]
LABEL = b"\\.//^\\"


def of_type(kind: str) -> list[dict]:
    return [v for v in VECTORS if v["type"] == kind]


def hkdf_extract(salt: bytes, ikm: bytes) -> bytes:
    return hmac.new(salt if salt else bytes(32), ikm, hashlib.sha256).digest()


def hkdf_expand(prk: bytes, info: bytes, length: int) -> bytes:
    okm, t, i = b"", b"", 0
    while len(okm) < length:
        i += 1
        t = hmac.new(prk, t + info + bytes([i]), hashlib.sha256).digest()
        okm += t
    return okm[:length]


def labeled_extract(suite_id: bytes, salt: bytes, label: bytes, ikm: bytes) -> bytes:
    return hkdf_extract(salt, b"HPKE-v1" + suite_id + label + ikm)


def labeled_expand(suite_id: bytes, prk: bytes, label: bytes, info: bytes, length: int) -> bytes:
    return hkdf_expand(prk, length.to_bytes(2, "big") + b"HPKE-v1" + suite_id + label + info, length)


def xwing_public(sk: bytes) -> bytes:
    pk_m = mlkem.MLKEM768PrivateKey.from_seed_bytes(sk[:64]).public_key().public_bytes_raw()
    return pk_m + x25519.X25519PrivateKey.from_private_bytes(sk[64:96]).public_key().public_bytes_raw()


@pytest.mark.parametrize("vec", of_type("kem_keygen"), ids=lambda v: v["id"])
def test_keygen(vec):
    sk = bytes.fromhex(vec["private_key"])
    if vec["suite"] == "post-quantum":
        assert len(sk) == 96
        if vec["xwing_seed"] is not None:  # X-Wing's 32-byte seed expands to the stored layout
            assert hashlib.shake_256(bytes.fromhex(vec["xwing_seed"])).digest(96) == sk
        public = xwing_public(sk)
        assert len(public) == 1216
    else:
        public = x25519.X25519PrivateKey.from_private_bytes(sk).public_key().public_bytes_raw()
    assert public.hex() == vec["public_key"]
    assert hashlib.sha256(public).digest()[:8].hex() == vec["key_id"]
    suite = envelope.POST_QUANTUM if vec["suite"] == "post-quantum" else envelope.CLASSICAL
    assert suite.public_key_of(sk) == public  # the server's own derivation


@pytest.mark.parametrize("vec", of_type("kem_decapsulation"), ids=lambda v: v["id"])
def test_decapsulation(vec):
    sk, enc = bytes.fromhex(vec["private_key"]), bytes.fromhex(vec["enc"])
    if vec["suite"] == "classical":
        skx = x25519.X25519PrivateKey.from_private_bytes(sk)
        dh = skx.exchange(x25519.X25519PublicKey.from_public_bytes(enc))
        kem_context = enc + skx.public_key().public_bytes_raw()
        kem_suite = b"KEM" + (0x0020).to_bytes(2, "big")
        eae_prk = labeled_extract(kem_suite, b"", b"eae_prk", dh)
        shared = labeled_expand(kem_suite, eae_prk, b"shared_secret", kem_context, 32)
        assert (dh.hex(), kem_context.hex(), shared.hex()) == (vec["dh"], vec["kem_context"], vec["shared_secret"])
        return
    assert len(enc) == 1120
    ct_m, ct_x = enc[:1088], enc[1088:]
    d_z, sk_x = sk[:64], sk[64:]
    ss_m = mlkem.MLKEM768PrivateKey.from_seed_bytes(d_z).decapsulate(ct_m)
    skx = x25519.X25519PrivateKey.from_private_bytes(sk_x)
    ss_x = skx.exchange(x25519.X25519PublicKey.from_public_bytes(ct_x))
    pk_x = skx.public_key().public_bytes_raw()
    shared = hashlib.sha3_256(ss_m + ss_x + ct_x + pk_x + LABEL).digest()
    got = {"ct_m": ct_m, "ct_x": ct_x, "ss_m": ss_m, "ss_x": ss_x, "pk_x": pk_x, "shared_secret": shared}
    assert {k: v.hex() for k, v in got.items()} == {k: vec[k] for k in got}
    # the label goes last: first, it gives another secret
    assert hashlib.sha3_256(LABEL + ss_m + ss_x + ct_x + pk_x).digest() != shared
    if "implicit-rejection" in vec["id"]:  # FIPS 203: a bad ciphertext decapsulates to J(z || c)
        assert ss_m == hashlib.shake_256(sk[32:64] + ct_m).digest(32)


@pytest.mark.parametrize("vec", of_type("hpke_open"), ids=lambda v: v["id"])
def test_key_schedule_opens_the_wrapped_secret(vec):
    suite_id = b"HPKE" + b"".join(vec[k].to_bytes(2, "big") for k in ("kem_id", "kdf_id", "aead_id"))
    shared, info = bytes.fromhex(vec["shared_secret"]), bytes.fromhex(vec["info"])
    psk_id_hash = labeled_extract(suite_id, b"", b"psk_id_hash", b"")
    info_hash = labeled_extract(suite_id, b"", b"info_hash", info)
    context = b"\x00" + psk_id_hash + info_hash
    secret = labeled_extract(suite_id, shared, b"secret", b"")
    key = labeled_expand(suite_id, secret, b"key", context, 32)
    nonce = labeled_expand(suite_id, secret, b"base_nonce", context, 12)
    got = {"psk_id_hash": psk_id_hash, "info_hash": info_hash, "key_schedule_context": context,
           "secret": secret, "key": key, "base_nonce": nonce}
    assert {k: v.hex() for k, v in got.items()} == {k: vec[k] for k in got}
    opened = ChaCha20Poly1305(key).decrypt(nonce, bytes.fromhex(vec["ciphertext"]), bytes.fromhex(vec["aad"]))
    assert opened.hex() == vec["plaintext"]


def test_the_product_opens_what_the_vectors_decapsulate():
    """The product's HPKE opens enc || ciphertext under each vector's key to the same plaintext,
    and refuses the implicitly rejected ciphertext."""
    byid = {v["id"]: v for v in VECTORS}
    for name, suite in (("classical", envelope.CLASSICAL), ("post-quantum", envelope.POST_QUANTUM)):
        dec, opened = byid[f"decapsulation-{name}"], byid[f"open-{name}"]
        key = suite.load_private_key(bytes.fromhex(dec["private_key"]))
        body = bytes.fromhex(dec["enc"] + opened["ciphertext"])
        assert suite.hpke_suite.decrypt(body, key, info=bytes.fromhex(opened["info"])).hex() == opened["plaintext"]
    rejected = byid["decapsulation-post-quantum-implicit-rejection"]
    key = envelope.POST_QUANTUM.load_private_key(bytes.fromhex(rejected["private_key"]))
    with pytest.raises(Exception):  # noqa: B017 - the library's own error type; it must not open
        envelope.POST_QUANTUM.hpke_suite.decrypt(bytes.fromhex(rejected["enc"] + byid["open-post-quantum"]["ciphertext"]),
                                                 key, info=bytes.fromhex(byid["open-post-quantum"]["info"]))


def test_sealing_md_shows_the_same_vectors():
    """docs/sealing.md section 2's JSON block says what conformance/sealing.json says, and its
    enc is the section 9 batch's (docs/protocol.md)."""
    text = (ROOT / "docs" / "sealing.md").read_text()
    start = text.index('{\n "xwing_decapsulation"')
    shown = json.loads(text[start:text.index("```", start)])["xwing_decapsulation"]
    byid = {v["id"]: v for v in VECTORS}
    dec, opened = byid["decapsulation-post-quantum"], byid["open-post-quantum"]
    rej, seeded = byid["decapsulation-post-quantum-implicit-rejection"], byid["keygen-post-quantum-from-xwing-seed"]
    for k in ("private_key", "ct_x", "ss_m", "ss_x", "pk_x", "shared_secret"):
        assert shown[k] == dec[k], k
    assert (shown["key"], shown["base_nonce"]) == (opened["key"], opened["base_nonce"])
    assert shown["implicit_rejection"]["ss_m"] == rej["ss_m"]
    assert shown["implicit_rejection"]["shared_secret"] == rej["shared_secret"]
    assert bytes.fromhex(rej["enc"])[0] == bytes.fromhex(dec["enc"])[0] ^ 1 and rej["enc"][2:] == dec["enc"][2:]
    assert (shown["xwing_seed"], shown["expanded_private_key"], shown["expanded_key_id"]) == (
        seeded["xwing_seed"], seeded["private_key"], seeded["key_id"])
    protocol = (ROOT / "docs" / "protocol.md").read_text()
    section9 = protocol[protocol.index("\n## 9. Test vectors"):]
    section9 = json.loads(section9[section9.index("```json") + 7:section9.index("```", section9.index("```json") + 7)])
    batch = next(v for v in section9["sealed_v4"] if v["suite"] == "post-quantum")
    assert batch["sealed_secret"][:2240] == dec["enc"] and batch["private_key"] == dec["private_key"]
    assert batch["info"] == opened["info"] and batch["secret"] == opened["plaintext"]


def _hpke_seal_classical(pk: bytes, ephemeral: bytes, info: bytes, plaintext: bytes) -> bytes:
    """RFC 9180 base mode single-shot seal with DHKEM(X25519) from a given ephemeral key, written
    from the text (enc || ciphertext)."""
    e = x25519.X25519PrivateKey.from_private_bytes(ephemeral)
    enc = e.public_key().public_bytes_raw()
    dh = e.exchange(x25519.X25519PublicKey.from_public_bytes(pk))
    kem_suite = b"KEM" + (0x0020).to_bytes(2, "big")
    shared = labeled_expand(kem_suite, labeled_extract(kem_suite, b"", b"eae_prk", dh), b"shared_secret",
                            enc + pk, 32)
    suite_id = b"HPKE" + bytes.fromhex("002000010003")
    context = (b"\x00" + labeled_extract(suite_id, b"", b"psk_id_hash", b"")
               + labeled_extract(suite_id, b"", b"info_hash", info))
    secret = labeled_extract(suite_id, shared, b"secret", b"")
    key = labeled_expand(suite_id, secret, b"key", context, 32)
    nonce = labeled_expand(suite_id, secret, b"base_nonce", context, 12)
    return enc + ChaCha20Poly1305(key).encrypt(nonce, plaintext, b"")


@pytest.mark.parametrize("vec", of_type("sealed_blocks"), ids=lambda v: v["id"])
def test_sealed_blocks_every_byte_from_the_text(vec):
    """docs/sealing.md section 3a, written here from the text: pseudonyms (protocol.md 2d),
    commitments and block ids (4a), the plaintexts (pseudonym, proof, share), the context with
    the party's index, the HPKE seal of the secret, the records' key and their one message; and
    the product's opener gives back the pseudonyms, the party and bound blocks."""
    sid, server, j, pos = bytes.fromhex(vec["study_id"]), vec["server_id"], vec["party_index"], vec["position"]
    n = len(vec["servers"])
    key = bytes.fromhex(vec["party_key"])
    from dpsketch.protocol.keystream import Keystream

    salts = Keystream.from_key(bytes.fromhex(vec["salt_key"])).array(16 * n * vec["count"]).tobytes()
    plains, ids = [], []
    for i, rec in enumerate(vec["records"]):
        x = rec["individual"].encode()
        pseudonym = hmac.new(key, b"dpsketch/individual/1" + sid + len(x).to_bytes(4, "big") + x,
                             hashlib.sha256).digest()[:16]
        assert pseudonym.hex() == rec["pseudonym"]
        shares = [b"".join(int(v).to_bytes(8, "little") for v in vec["shares"][s][i]) for s in range(n)]
        salt = [salts[16 * (s * vec["count"] + i):16 * (s * vec["count"] + i + 1)] for s in range(n)]
        commits = [hashlib.sha256(b"dpsketch/commit/2" + bytes([s, 0x01]) + salt[s] + shares[s]).digest()[:16]
                   for s in range(n)]
        block_id = hashlib.sha256(b"dpsketch/block/2" + sid + bytes([j]) + pseudonym + b"".join(commits)).digest()[:16]
        proof = salt[pos] + b"".join(c for s, c in enumerate(commits) if s != pos)
        assert (block_id.hex(), proof.hex(), shares[pos].hex()) == (rec["block_id"], rec["proof"], rec["share"])
        assert rec["plaintext"] == (pseudonym + proof + shares[pos]).hex()
        plains.append(pseudonym + proof + shares[pos])
        ids.append(block_id)
    public = bytes.fromhex(vec["public_key"])
    assert x25519.X25519PrivateKey.from_private_bytes(bytes.fromhex(vec["private_key"])).public_key() \
        .public_bytes_raw() == public
    context = sid + bytes([len(server)]) + server.encode() + bytes([j])
    got = _sealed_v4_from_the_text(vec, public, bytes.fromhex(vec["batch_id"]), 0x03, vec["count"], context,
                                   b"".join(ids), b"".join(plains))
    got["report_ids"] = b"".join(ids)
    assert {k: v.hex() for k, v in got.items()} == {k: vec[k] for k in got}
    # the product opens it to the same blocks, bound, for this party only
    sk = envelope.CLASSICAL.load_private_key(bytes.fromhex(vec["private_key"]))
    body = bytes.fromhex(vec["body"])
    up = envelope.open_batch(body, vec["width"], n, vec["study_id"], server, lambda kid: sk, j)
    assert up.ids == ids and up.party == j and [p.hex() for p in up.pseudonyms] == [r["pseudonym"] for r in vec["records"]]
    up.verify(vec["study_id"], n, pos)
    for other in (None, j ^ 1):  # as a share batch, or as another party's: it does not open
        with pytest.raises((envelope.SealError, envelope.MalformedSealedBatch)):
            envelope.open_batch(body, vec["width"], n, vec["study_id"], server, lambda kid: sk, other)


def _sealed_v4_from_the_text(vec: dict, public: bytes, header_id: bytes, content: int, count: int,
                             context: bytes, clear_ids: bytes, plaintext: bytes) -> dict[str, bytes]:
    """docs/sealing.md section 3, written here from the text: a classical version 4 header (its
    id, key id, suite, content, count), the info and the HPKE seal of the vector's secret, the
    transcript, the records' key and their one ChaCha20-Poly1305 message under the clear ids."""
    fixed = (header_id + hashlib.sha256(public).digest()[:8] + bytes([0x80, 4])
             + bytes.fromhex("002000010003") + bytes([content]) + count.to_bytes(4, "big"))
    info = b"dpsketch/sealed/4" + hashlib.sha256(context + fixed).digest()
    sealed_secret = _hpke_seal_classical(public, bytes.fromhex(vec["ephemeral_key"]), info,
                                         bytes.fromhex(vec["secret"]))
    header = fixed + sealed_secret
    transcript = hashlib.sha256(context + header).digest()
    record_key = hkdf_expand(hkdf_extract(b"", bytes.fromhex(vec["secret"])),
                             b"dpsketch/sealed/4/records" + transcript, 32)
    aad = transcript + clear_ids
    sealed = ChaCha20Poly1305(record_key).encrypt(bytes(12), plaintext, aad)
    return {"fixed": fixed, "context": context, "info": info, "sealed_secret": sealed_secret,
            "transcript": transcript, "record_key": record_key, "aad": aad, "sealed": sealed,
            "body": header + clear_ids + sealed}


@pytest.mark.parametrize("vec", of_type("sealed_batch_record"), ids=lambda v: v["id"])
def test_sealed_batch_record_every_byte_from_the_text(vec):
    """docs/sealing.md section 3b, written here from the text: the helper's record of a
    batch_validity.json vector, its batch id from its header and parts (docs/protocol.md 4d: the
    wrap seed, then the batch id), the header of a batch of one record of content 0x06, the
    context without a party byte, the HPKE seal, the records' key and their one message with the
    batch id as the clear id; the product's opener gives back the record, and the body relabelled
    0x05 does not open."""
    batches = json.loads((ROOT / "conformance" / "batch_validity.json").read_text())["vectors"]
    batch = next(b for b in batches if b["id"] == vec["batch_vector"])
    helper = next(s for s in batch["servers"] if s["position"] == vec["position"])
    record = bytes.fromhex(vec["record"])
    assert helper["record"] == vec["record"] and helper["media_type"] == vec["media_type"]
    n = len(batch["servers"])
    assert len(record) == 104 + 32 * n
    parts, digits = record[40:40 + 32 * n], record[40 + 32 * n:72 + 32 * n]
    seed = hashlib.sha256(b"dpsketch/wrap-seed/1" + record[:36] + parts).digest()
    batch_id = hashlib.sha256(b"dpsketch/batch-id/1" + seed + digits).digest()[:16]
    assert batch_id.hex() == vec["batch_id"] == batch["batch_id"]
    sid, server = bytes.fromhex(vec["study_id"]), vec["server_id"]
    public = bytes.fromhex(vec["public_key"])
    context = sid + bytes([len(server)]) + server.encode()
    got = _sealed_v4_from_the_text(vec, public, bytes.fromhex(vec["header_batch_id"]), 0x06, 1, context,
                                   batch_id, record)
    assert {k: v.hex() for k, v in got.items()} == {k: vec[k] for k in got}
    assert len(got["body"]) == 117 + 32 + len(record)  # 117 + Nenc + P
    sk = envelope.CLASSICAL.load_private_key(bytes.fromhex(vec["private_key"]))
    body = bytes.fromhex(vec["body"])
    assert envelope.open_record(body, 104 + 32 * n, vec["study_id"], server, lambda kid: sk) == (0x06, batch_id, record)
    relabelled = body[:32] + bytes([0x05]) + body[33:]
    with pytest.raises(envelope.SealError):
        envelope.open_record(relabelled, 104 + 32 * n, vec["study_id"], server, lambda kid: sk)
