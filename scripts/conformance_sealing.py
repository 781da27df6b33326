"""The vectors of conformance/sealing.json (docs/sealing.md section 2, docs/protocol.md section 7a):
the two sealing suites' KEMs and HPKE key schedule, byte for byte, so that an implementation can
find which step of a sealed batch it gets wrong. Imported by make_conformance.py.

HPKE is randomized, so the inputs are fixed ciphertexts: the two version 4 batches of
docs/protocol.md section 9 (``sealed_v4``, whose ``sealed_secret`` is enc || wrapped), and a
post-quantum ciphertext altered to show ML-KEM's implicit rejection. Every intermediate value is
computed here from RFC 9180, FIPS 203's rejection rule and X-Wing's combiner, and checked against
the ``cryptography`` package (the product's HPKE): the key and nonce must open the wrapped secret,
and ``cryptography`` must open the same bytes to the same secret. tests/test_conformance.py
recomputes them again from the documents.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import mlkem, x25519
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from dpsketch.protocol import envelope

DESCRIPTION = (
    "The sealing suites byte for byte (docs/sealing.md section 2; docs/protocol.md section 7a). "
    "kem_keygen: a private key in the stored layout (post-quantum: ML-KEM-768 seed d || z, then the "
    "X25519 private key; xwing_seed, when given, is an X-Wing 32-byte seed whose SHAKE256 expansion to "
    "96 bytes is that key) -> public_key and key_id. kem_decapsulation: private_key and enc -> the KEM's "
    "shared_secret, with the X-Wing intermediates (ct_m, ct_x, ss_m, ss_x, pk_x) or the DHKEM ones (dh, "
    "kem_context). hpke_open: RFC 9180 base mode, single shot, HKDF-SHA256 and ChaCha20-Poly1305: "
    "shared_secret and info -> psk_id_hash, info_hash, key_schedule_context, secret, key, base_nonce; "
    "ciphertext (sealed with aad empty, sequence 0) opens to plaintext.")

XWING_LABEL = bytes.fromhex("5c2e2f2f5e5c")  # "\\.//^\\"


def _extract(salt: bytes, ikm: bytes) -> bytes:
    return hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()


def _expand(prk: bytes, info: bytes, length: int) -> bytes:
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


def _suite_id(suite: envelope.SealingSuite) -> bytes:
    return b"HPKE" + suite.ids


def key_schedule(suite: envelope.SealingSuite, shared_secret: bytes, info: bytes) -> dict[str, bytes]:
    """RFC 9180 section 5.1, base mode (no PSK), HKDF-SHA256, Nk = 32, Nn = 12."""
    sid = _suite_id(suite)

    def extract(salt: bytes, label: bytes, ikm: bytes) -> bytes:
        return _extract(salt, b"HPKE-v1" + sid + label + ikm)

    def expand(prk: bytes, label: bytes, info_: bytes, length: int) -> bytes:
        return _expand(prk, length.to_bytes(2, "big") + b"HPKE-v1" + sid + label + info_, length)

    psk_id_hash = extract(b"", b"psk_id_hash", b"")
    info_hash = extract(b"", b"info_hash", info)
    context = b"\x00" + psk_id_hash + info_hash
    secret = extract(shared_secret, b"secret", b"")
    return {"psk_id_hash": psk_id_hash, "info_hash": info_hash, "key_schedule_context": context,
            "secret": secret, "key": expand(secret, b"key", context, 32),
            "base_nonce": expand(secret, b"base_nonce", context, 12)}


def xwing_decapsulate(private_key: bytes, enc: bytes) -> dict[str, bytes]:
    """X-Wing's Decapsulate with the key in dpsketch's stored layout (d || z || sk_X)."""
    dk = mlkem.MLKEM768PrivateKey.from_seed_bytes(private_key[:64])
    sk_x = x25519.X25519PrivateKey.from_private_bytes(private_key[64:])
    ct_m, ct_x = enc[:1088], enc[1088:]
    ss_m = dk.decapsulate(ct_m)
    ss_x = sk_x.exchange(x25519.X25519PublicKey.from_public_bytes(ct_x))
    pk_x = sk_x.public_key().public_bytes_raw()
    shared = hashlib.sha3_256(ss_m + ss_x + ct_x + pk_x + XWING_LABEL).digest()
    return {"ct_m": ct_m, "ct_x": ct_x, "ss_m": ss_m, "ss_x": ss_x, "pk_x": pk_x, "shared_secret": shared}


def dhkem_decapsulate(private_key: bytes, enc: bytes) -> dict[str, bytes]:
    """RFC 9180 section 4.1, DHKEM(X25519, HKDF-SHA256)."""
    sk = x25519.X25519PrivateKey.from_private_bytes(private_key)
    dh = sk.exchange(x25519.X25519PublicKey.from_public_bytes(enc))
    kem_context = enc + sk.public_key().public_bytes_raw()
    sid = b"KEM" + envelope.KEM_ID.to_bytes(2, "big")
    eae_prk = _extract(b"", b"HPKE-v1" + sid + b"eae_prk" + dh)
    shared = _expand(eae_prk, (32).to_bytes(2, "big") + b"HPKE-v1" + sid + b"shared_secret" + kem_context, 32)
    return {"dh": dh, "kem_context": kem_context, "shared_secret": shared}


def _section9(root: Path) -> dict[str, Any]:
    text = (root / "docs" / "protocol.md").read_text()
    block = text[text.index("\n## 9. Test vectors"):]
    block = block[block.index("```json") + len("```json"):]
    return json.loads(block[:block.index("```")])


def _hex(d: dict[str, bytes]) -> dict[str, str]:
    return {k: v.hex() for k, v in d.items()}


def sealing_vectors(root: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    seed = hashlib.sha256(b"dpsketch/conformance/sealing/xwing-seed").digest()
    expanded = hashlib.shake_256(seed).digest(96)
    suite = envelope.POST_QUANTUM
    public = suite.public_key_of(expanded)
    out.append({"id": "keygen-post-quantum-from-xwing-seed", "type": "kem_keygen", "suite": suite.name,
                "xwing_seed": seed.hex(), "private_key": expanded.hex(), "public_key": public.hex(),
                "key_id": envelope.key_id(public).hex()})
    for vec in _section9(root)["sealed_v4"]:
        suite = envelope.suite_by_ids(vec["kem_id"], vec["kdf_id"], vec["aead_id"])
        assert suite is not None
        private_key = bytes.fromhex(vec["private_key"])
        public = suite.public_key_of(private_key)
        assert public.hex() == vec["public_key"]
        out.append({"id": f"keygen-{suite.name}", "type": "kem_keygen", "suite": suite.name, "xwing_seed": None,
                    "private_key": vec["private_key"], "public_key": public.hex(),
                    "key_id": envelope.key_id(public).hex()})
        sealed = bytes.fromhex(vec["sealed_secret"])
        enc, wrapped = sealed[:-envelope.WRAPPED_BYTES], sealed[-envelope.WRAPPED_BYTES:]
        info = bytes.fromhex(vec["info"])
        kem = xwing_decapsulate(private_key, enc) if suite.post_quantum else dhkem_decapsulate(private_key, enc)
        out.append({"id": f"decapsulation-{suite.name}", "type": "kem_decapsulation", "suite": suite.name,
                    "kem_id": vec["kem_id"], "private_key": vec["private_key"], "enc": enc.hex(), **_hex(kem)})
        schedule = key_schedule(suite, kem["shared_secret"], info)
        plaintext = ChaCha20Poly1305(schedule["key"]).decrypt(schedule["base_nonce"], wrapped, b"")
        assert plaintext.hex() == vec["secret"]
        # the product's HPKE (the cryptography package) opens the same bytes to the same secret
        assert suite.hpke_suite.decrypt(sealed, suite.load_private_key(private_key), info=info) == plaintext
        out.append({"id": f"open-{suite.name}", "type": "hpke_open", "suite": suite.name, "kem_id": vec["kem_id"],
                    "kdf_id": vec["kdf_id"], "aead_id": vec["aead_id"], "shared_secret": kem["shared_secret"].hex(),
                    "info": vec["info"], **_hex(schedule), "aad": "", "ciphertext": wrapped.hex(),
                    "plaintext": plaintext.hex()})
        if suite.post_quantum:
            # ML-KEM's implicit rejection: an altered ct_M decapsulates to J(z || ct_M) =
            # SHAKE256(z || ct_M, 32), so the hybrid secret differs and the AEAD fails
            bad = bytearray(enc)
            bad[0] ^= 0x01
            rejected = xwing_decapsulate(private_key, bytes(bad))
            assert rejected["ss_m"] == hashlib.shake_256(private_key[32:64] + bytes(bad[:1088])).digest(32)
            try:
                suite.hpke_suite.decrypt(bytes(bad) + wrapped, suite.load_private_key(private_key), info=info)
            except Exception:  # noqa: BLE001 - whatever the library raises, it must not open
                opened = False
            else:  # pragma: no cover
                opened = True
            assert not opened
            out.append({"id": "decapsulation-post-quantum-implicit-rejection", "type": "kem_decapsulation",
                        "suite": suite.name, "kem_id": vec["kem_id"], "private_key": vec["private_key"],
                        "enc": bytes(bad).hex(), **_hex(rejected)})
    return out


def doc_block(vectors: list[dict[str, Any]]) -> dict[str, Any]:
    """The compact form docs/sealing.md shows (section 2): the post-quantum intermediates of the
    section 9 batch, without the long byte strings a reader finds in the conformance file."""
    byid = {v["id"]: v for v in vectors}
    dec, opened, rej = (byid["decapsulation-post-quantum"], byid["open-post-quantum"],
                        byid["decapsulation-post-quantum-implicit-rejection"])
    seedkey = byid["keygen-post-quantum-from-xwing-seed"]
    return {"xwing_decapsulation": {
        "private_key": dec["private_key"], "enc": "sealed_v4[1].sealed_secret[0:1120] (docs/protocol.md section 9)",
        "ct_x": dec["ct_x"], "ss_m": dec["ss_m"], "ss_x": dec["ss_x"], "pk_x": dec["pk_x"],
        "shared_secret": dec["shared_secret"], "key": opened["key"], "base_nonce": opened["base_nonce"],
        "implicit_rejection": {"enc": "the same with bit 0 of byte 0 flipped", "ss_m": rej["ss_m"],
                               "shared_secret": rej["shared_secret"]},
        "xwing_seed": seedkey["xwing_seed"], "expanded_private_key": seedkey["private_key"],
        "expanded_key_id": seedkey["key_id"]}}
