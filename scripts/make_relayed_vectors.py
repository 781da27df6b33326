"""Write the relayed upload vector of docs/protocol.md section 9 (``relayed``): one device's entry
for server s1, and the one-entry bundle that carries it, computed from section 7b's definitions.

    .venv/bin/python scripts/make_relayed_vectors.py           # (re)write section 9's relayed
    .venv/bin/python scripts/make_relayed_vectors.py --check   # exit 1 if the block would change

The inputs are fixed: the upload token below and the classical batch of section 9's ``sealed_v4``
(its study id, server id and body, read from the block itself, so run
scripts/make_sealed_batches.py first if that batch ever changes). Everything in the vector is
deterministic: running this twice changes nothing. tests/test_protocol_vectors.py recomputes
every byte from the text, with hashlib and hmac alone, and checks the document is what
:func:`render` writes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpsketch.protocol import envelope, relayed  # noqa: E402

DOC = ROOT / "docs" / "protocol.md"
KEY = "relayed"
#: an upload token as a server issues them ("up-" and 32 random bytes, base64url without padding:
#: here the bytes 0x00 .. 0x1f)
TOKEN = "up-AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8"
#: the keys of the vector, in the order the block lists them
ORDER = ("token", "token_digest", "token_id", "mac_key", "study_id", "server_id", "batch_header", "transcript",
         "mac_input", "mac", "entry", "bundle")


def _section9(text: str) -> tuple[int, int, dict[str, Any]]:
    """The start and end of section 9's JSON object in the document, and the object."""
    at = text.index("\n## 9. Test vectors")
    start = text.index("```json\n", at) + len("```json\n")
    end = text.index("```", start)
    return start, end, json.loads(text[start:end])


def vector(sealed: dict[str, Any]) -> dict[str, Any]:
    """The relayed vector of :data:`TOKEN` over ``sealed``, a classical ``sealed_v4`` vector."""
    study_id, server_id = sealed["study_id"], sealed["server_id"]
    batch = bytes.fromhex(sealed["body"])
    digest = relayed.token_digest(TOKEN)
    assert digest == hashlib.sha256(TOKEN.encode()).digest()
    header = relayed.batch_header(batch)
    transcript = envelope.transcript_v4(study_id, server_id, header)
    assert transcript.hex() == sealed["transcript"]
    entry = relayed.make_entry(TOKEN, study_id, server_id, batch)
    assert relayed.verify_mac(digest, study_id, server_id, entry)
    bundle = relayed.encode([entry])
    assert relayed.decode(bundle) == [entry]
    out = {"token": TOKEN, "token_digest": digest.hex(), "token_id": relayed.token_id(digest).hex(),
           "mac_key": relayed.mac_key(digest).hex(), "study_id": study_id, "server_id": server_id,
           "batch_header": header.hex(), "transcript": transcript.hex(),
           "mac_input": (relayed.ENTRY_LABEL + transcript).hex(), "mac": entry.mac.hex(),
           "entry": entry.encode().hex(), "bundle": bundle.hex()}
    return {k: out[k] for k in ORDER}


def render(text: str) -> str:
    """The document with section 9's relayed vector (re)computed: the block's last member."""
    start, end, vectors = _section9(text)
    sealed = next(v for v in vectors["sealed_v4"] if v["suite"] == "classical")
    new = json.dumps(vector(sealed), indent=1).replace("\n", "\n ")
    block = text[start:end]
    if f'"{KEY}":' in block:
        at = block.rindex(",\n", 0, block.index(f'"{KEY}":'))
    else:
        at = block.rindex("\n}")
    block = block[:at] + f',\n "{KEY}": ' + new + "\n}\n"
    doc = json.loads(block)  # still one JSON object, every other member kept, the vector its last
    assert list(doc)[-1] == KEY and set(doc) == set(vectors) | {KEY} and doc[KEY] == json.loads(new)
    return text[:start] + block + text[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the vector would change")
    args = ap.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if args.check:
        print("relayed vector up to date" if new == text else "relayed vector would change")
        return 0 if new == text else 1
    DOC.write_text(new)
    print(f"{DOC}: section 9 {KEY} {'unchanged' if new == text else 'written'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
