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
