"""Write the sealed batch vectors of docs/protocol.md section 9 (``sealed_v4``): one version 4
batch per suite, every deterministic byte of it computed from section 7a's definitions.

    .venv/bin/python scripts/make_sealed_batches.py           # (re)write section 9's sealed_v4
    .venv/bin/python scripts/make_sealed_batches.py --check   # exit 1 if the block would change

The inputs are fixed: each suite's private key, the study, the server, the batch id, the batch
secret and two share reports for server s1 (their salts, payloads and commitments), read from the
block itself (or, the first time, from the ``sealed_v3`` block it replaced). HPKE's seal of the
secret is randomized, so ``sealed_secret`` (enc || wrapped) is kept as long as it opens to the
secret under the batch's ``info``, and sealed afresh only when it does not (a new vector): running
this twice changes nothing. tests/test_protocol_vectors.py recomputes every byte from the text;
scripts/conformance_sealing.py reads the post-quantum batch's enc.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cryptography.exceptions import InvalidTag  # noqa: E402

from dpsketch.protocol import envelope  # noqa: E402

DOC = ROOT / "docs" / "protocol.md"
KEY = "sealed_v4"
#: the keys of a batch vector, in the order the block lists them
ORDER = ("suite", "kem_id", "kdf_id", "aead_id", "version", "private_key", "public_key", "key_id", "study_id",
         "server_id", "servers", "n_servers", "position", "width", "content", "count", "batch_id", "secret",
         "fixed", "info", "sealed_secret", "transcript", "record_key", "records", "report_ids", "nonce",
         "aad", "sealed", "body")
RECORD_ORDER = ("salt", "payload", "commitments", "report_id", "plaintext")


def _section9(text: str) -> tuple[int, int, dict[str, Any]]:
    """The start and end of section 9's JSON object in the document, and the object."""
    at = text.index("\n## 9. Test vectors")
    start = text.index("```json\n", at) + len("```json\n")
    end = text.index("```", start)
    return start, end, json.loads(text[start:end])


def batch(old: dict[str, Any]) -> dict[str, Any]:
    """One version 4 batch vector from ``old``'s inputs (a sealed_v3 or sealed_v4 vector)."""
    suite = envelope.SUITES[old["suite"]]
    sk = bytes.fromhex(old["private_key"])
    pk = suite.public_key_of(sk)
    study_id, server_id = old["study_id"], old["server_id"]
    records = [{k: rec[k] for k in RECORD_ORDER} for rec in old["records"]]
    for rec in records:  # the plaintext is the proof for this server, then the payload
        proof = bytes.fromhex(rec["salt"]) + b"".join(
            bytes.fromhex(c) for j, c in enumerate(rec["commitments"]) if j != old["position"])
        assert rec["plaintext"] == (proof + bytes.fromhex(rec["payload"])).hex()
    ids = b"".join(bytes.fromhex(r["report_id"]) for r in records)
    plain = b"".join(bytes.fromhex(r["plaintext"]) for r in records)
    secret = bytes.fromhex(old["secret"])
    header = envelope.BatchHeader(bytes.fromhex(old["batch_id"]), envelope.key_id(pk), suite, old["content"],
                                  len(records), b"")
    fixed = header.fixed()
    info = envelope.info_v4(study_id, server_id, fixed)
    key = suite.load_private_key(sk)
    sealed_secret = bytes.fromhex(old["sealed_secret"])
    try:
        if suite.hpke_suite.decrypt(sealed_secret, key, info=info) != secret:
            raise InvalidTag
    except InvalidTag:  # the old vector's info: seal the secret afresh
        sealed_secret = suite.hpke_suite.encrypt(secret, suite.load_public_key(pk), info=info)
    head = fixed + sealed_secret
    transcript = envelope.transcript_v4(study_id, server_id, head)
    sealed = envelope.seal_records(secret, transcript, ids, plain)
    out = {**{k: old[k] for k in ("suite", "private_key", "study_id", "server_id", "servers", "n_servers",
                                  "position", "width", "content", "batch_id", "secret")},
           "kem_id": suite.kem_id, "kdf_id": suite.kdf_id, "aead_id": suite.aead_id, "version": envelope.VERSION_4,
           "public_key": pk.hex(), "key_id": envelope.key_id(pk).hex(), "count": len(records),
           "fixed": fixed.hex(), "info": info.hex(), "sealed_secret": sealed_secret.hex(),
           "transcript": transcript.hex(), "record_key": envelope.record_key(secret, transcript).hex(),
           "records": records, "report_ids": ids.hex(), "nonce": envelope.RECORDS_NONCE.hex(),
           "aad": envelope.records_aad(transcript, ids).hex(), "sealed": sealed[len(ids):].hex(),
           "body": (head + sealed).hex()}
    body = head + sealed
    opened = envelope.open_batch(body, old["width"], old["n_servers"], study_id, server_id, lambda _kid: key)
    assert b"".join(opened.ids) == ids
    return {k: out[k] for k in ORDER}


def render(text: str) -> str:
    """The document with section 9's sealed batch vectors (re)computed."""
    start, end, vectors = _section9(text)
    old = vectors.get(KEY) or vectors["sealed_v3"]
    new = json.dumps([batch(v) for v in old], indent=1).replace("\n", "\n ")
    block = text[start:end]
    name = KEY if f'"{KEY}":' in block else "sealed_v3"
    at = block.index(f'"{name}":')
    stop = block.index("\n ]", at) + len("\n ]")
    block = block[:at] + f'"{KEY}": ' + new + block[stop:]
    json.loads(block)  # still one JSON object
    return text[:start] + block + text[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the vectors would change")
    args = ap.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if args.check:
        print("sealed batch vectors up to date" if new == text else "sealed batch vectors would change")
        return 0 if new == text else 1
    DOC.write_text(new)
    print(f"{DOC}: section 9 {KEY} {'unchanged' if new == text else 'written'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
