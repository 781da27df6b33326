"""The vectors of conformance/sealing.json (docs/sealing.md section 2, docs/protocol.md section 7a):
the two sealing suites' KEMs and HPKE key schedule, byte for byte, so that an implementation can
find which step of a sealed batch it gets wrong. Imported by make_conformance.py.

HPKE is randomized, so the inputs are fixed ciphertexts: the two version 4 batches of
docs/protocol.md section 9 (``sealed_v4``, whose ``sealed_secret`` is enc || wrapped), and a
post-quantum ciphertext altered to show ML-KEM's implicit rejection; and a sealed batch of a
party's blocks and a sealed helper's batch proof record (content 0x06), whose HPKE seals are written
out from fixed ephemeral keys. Every intermediate value is
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

import numpy as np
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
    "ciphertext (sealed with aad empty, sequence 0) opens to plaintext. sealed_blocks: a version 4 batch of "
    "one party's blocks (docs/sealing.md section 3a, content 0x03) at one server: from the inputs (party key, "
    "individuals, shares, salts, the suite's private key, the ephemeral X25519 key, batch_id, secret) every "
    "byte: pseudonyms, commitments, block ids, plaintexts (pseudonym || proof || share), context (study id, "
    "server id, party index), info, sealed_secret (enc || wrapped), transcript, record_key, aad, sealed, body. "
    "sealed_batch_record: a helper's batch proof record (docs/sealing.md section 3b, content 0x06; the record of "
    "batch_validity.json's vector batch_vector at its helper) sealed as a batch of one record: its clear id the "
    "batch id, its plaintext the whole record; the same intermediates from the same kinds of inputs.")

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
    out.append(sealed_blocks_vector(_section9(root)["sealed_v4"][0]))
    batches = json.loads((root / "conformance" / "batch_validity.json").read_text())["vectors"]
    out.append(sealed_batch_record_vector(_section9(root)["sealed_v4"][0], batches[0]))
    return out


def sealed_batch_record_vector(classical: dict[str, Any], batch: dict[str, Any]) -> dict[str, Any]:
    """The helper's record of conformance/batch_validity.json's first batch, sealed for its server
    as content 0x06 (docs/sealing.md section 3b): one record, its clear id the batch id, its
    plaintext the whole record; the HPKE seal written out from a fixed ephemeral key, as
    :func:`sealed_blocks_vector`'s."""
    from dpsketch.protocol import batch_records

    suite = envelope.CLASSICAL
    study_id = batch["study_id"]
    helper = next(s for s in batch["servers"] if s["position"] != batch["leader"])
    position, record = helper["position"], bytes.fromhex(helper["record"])
    assert helper["media_type"] == batch_records.HELPER_MEDIA_TYPE
    n_servers = len(batch["servers"])
    server_id = batch["study"]["servers"][position]
    batch_id = batch_records.batch_id_of(record, n_servers)
    assert batch_id.hex() == batch["batch_id"]
    private_key = bytes.fromhex(classical["private_key"])
    public = suite.public_key_of(private_key)
    ephemeral = hashlib.sha256(b"dpsketch/conformance/sealed-batch-record/ephemeral").digest()
    enc = x25519.X25519PrivateKey.from_private_bytes(ephemeral).public_key().public_bytes_raw()
    header_id = bytes(range(0xc0, 0xd0))  # the sealed batch's own random id, not the clear one
    secret = bytes(range(0x20, 0x40))
    content = batch_records.SEALED_HELPER_CONTENT
    fixed = envelope.BatchHeader(header_id, envelope.key_id(public), suite, content, 1, b"").fixed()
    info = envelope.info_v4(study_id, server_id, fixed)
    context = bytes.fromhex(study_id) + bytes([len(server_id)]) + server_id.encode()
    assert info == envelope.INFO_LABEL + hashlib.sha256(context + fixed).digest()
    schedule = key_schedule(suite, dhkem_decapsulate(private_key, enc)["shared_secret"], info)
    sealed_secret = enc + ChaCha20Poly1305(schedule["key"]).encrypt(schedule["base_nonce"], secret, b"")
    head = fixed + sealed_secret
    transcript = envelope.transcript_v4(study_id, server_id, head)
    assert transcript == hashlib.sha256(context + head).digest()
    sealed = envelope.seal_records(secret, transcript, batch_id, record)[len(batch_id):]
    body = head + batch_id + sealed
    assert len(body) == 117 + suite.enc_bytes + len(record) == 117 + suite.enc_bytes + 104 + 32 * n_servers
    opened = envelope.open_record(body, batch_records.helper_length(n_servers), study_id, server_id,
                                  lambda kid: suite.load_private_key(private_key))
    assert opened == (content, batch_id, record)
    return {"id": "sealed-batch-record-classical", "type": "sealed_batch_record", "suite": suite.name,
            "kem_id": suite.kem_id, "kdf_id": suite.kdf_id, "aead_id": suite.aead_id, "version": envelope.VERSION_4,
            "private_key": private_key.hex(), "public_key": public.hex(), "key_id": envelope.key_id(public).hex(),
            "study_id": study_id, "server_id": server_id, "position": position,
            "batch_vector": batch["id"], "media_type": helper["media_type"], "record": record.hex(),
            "content": content, "count": 1, "batch_id": batch_id.hex(), "ephemeral_key": ephemeral.hex(),
            "header_batch_id": header_id.hex(), "secret": secret.hex(), "fixed": fixed.hex(),
            "context": context.hex(), "info": info.hex(), "sealed_secret": sealed_secret.hex(),
            "transcript": transcript.hex(), "record_key": envelope.record_key(secret, transcript).hex(),
            "aad": envelope.records_aad(transcript, batch_id).hex(), "sealed": sealed.hex(), "body": body.hex()}


def sealed_blocks_vector(classical: dict[str, Any]) -> dict[str, Any]:
    """One classical batch of two blocks of party "shop" (index 1, two columns) for server s2
    (position 1) of a three-server study with parties, every byte deterministic: the HPKE seal's
    ephemeral key is an input (DHKEM encapsulation written out: enc = X25519(e, 9), the shared
    secret as the server's decapsulation computes it)."""
    from dpsketch.protocol import binding, parties
    from dpsketch.protocol.keystream import Keystream

    suite = envelope.CLASSICAL
    study_id = hashlib.sha256(b"dpsketch/conformance/sealed-blocks/study").hexdigest()
    servers, position, server_id = ["s1", "s2", "s3"], 1, "s2"
    party, index, width = "shop", 1, 2
    party_key = hashlib.sha256(b"dpsketch/conformance/sealed-blocks/party-key").digest()
    individuals = ["customer-00017", "customer-00042"]
    pseudonyms = parties.pseudonyms(party_key, study_id, individuals)
    shares = [np.array([[1 + 3 * j + 7 * i, (1 << 64) - 1 - j - i] for i in range(2)], dtype=np.uint64)
              for j in range(3)]
    salt_key = hashlib.sha256(b"dpsketch/conformance/sealed-blocks/salts").digest()
    ids, proofs = binding.bind(study_id, [binding.CONTENT_SHARE] * 3, shares,
                               binding.block_prefixes(study_id, index, pseudonyms), Keystream.from_key(salt_key))
    records = []
    for i in range(2):
        share = shares[position][i].astype("<u8").tobytes()
        records.append({"individual": individuals[i], "pseudonym": pseudonyms[i].hex(), "block_id": ids[i].hex(),
                        "proof": proofs[position][i].tobytes().hex(), "share": share.hex(),
                        "plaintext": (pseudonyms[i] + proofs[position][i].tobytes() + share).hex()})
    private_key = bytes.fromhex(classical["private_key"])
    public = suite.public_key_of(private_key)
    ephemeral = hashlib.sha256(b"dpsketch/conformance/sealed-blocks/ephemeral").digest()
    enc = x25519.X25519PrivateKey.from_private_bytes(ephemeral).public_key().public_bytes_raw()
    batch_id = bytes(range(0xa0, 0xb0))
    secret = bytes(range(0xe0, 0x100))
    header = envelope.BatchHeader(batch_id, envelope.key_id(public), suite, envelope.CONTENT_BLOCK, 2, b"")
    fixed = header.fixed()
    info = envelope.info_v4(study_id, server_id, fixed, index)
    context = bytes.fromhex(study_id) + bytes([len(server_id)]) + server_id.encode() + bytes([index])
    assert info == envelope.INFO_LABEL + hashlib.sha256(context + fixed).digest()
    kem = dhkem_decapsulate(private_key, enc)
    schedule = key_schedule(suite, kem["shared_secret"], info)
    wrapped = ChaCha20Poly1305(schedule["key"]).encrypt(schedule["base_nonce"], secret, b"")
    sealed_secret = enc + wrapped
    assert suite.hpke_suite.decrypt(sealed_secret, suite.load_private_key(private_key), info=info) == secret
    head = fixed + sealed_secret
    transcript = envelope.transcript_v4(study_id, server_id, head, index)
    assert transcript == hashlib.sha256(context + head).digest()
    joined_ids = b"".join(ids)
    plain = b"".join(bytes.fromhex(r["plaintext"]) for r in records)
    sealed = envelope.seal_records(secret, transcript, joined_ids, plain)[len(joined_ids):]
    body = head + joined_ids + sealed
    opened = envelope.open_batch(body, width, 3, study_id, server_id,
                                 lambda kid: suite.load_private_key(private_key), index)
    opened.verify(study_id, 3, position)  # the blocks' binding holds after opening
    assert opened.pseudonyms == pseudonyms and opened.party == index
    return {"id": "sealed-blocks-classical", "type": "sealed_blocks", "suite": suite.name,
            "kem_id": suite.kem_id, "kdf_id": suite.kdf_id, "aead_id": suite.aead_id, "version": envelope.VERSION_4,
            "private_key": private_key.hex(), "public_key": public.hex(), "key_id": envelope.key_id(public).hex(),
            "study_id": study_id, "servers": servers, "server_id": server_id, "position": position,
            "party": party, "party_index": index, "width": width, "party_key": party_key.hex(),
            "content": envelope.CONTENT_BLOCK, "count": 2, "records": records,
            "shares": [[[str(int(x)) for x in row] for row in shares[j]] for j in range(3)],
            "salt_key": salt_key.hex(), "ephemeral_key": ephemeral.hex(), "batch_id": batch_id.hex(),
            "secret": secret.hex(), "fixed": fixed.hex(), "context": context.hex(), "info": info.hex(),
            "sealed_secret": sealed_secret.hex(), "transcript": transcript.hex(),
            "record_key": envelope.record_key(secret, transcript).hex(), "report_ids": joined_ids.hex(),
            "aad": envelope.records_aad(transcript, joined_ids).hex(), "sealed": sealed.hex(), "body": body.hex()}


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
