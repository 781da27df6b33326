"""Relayed uploads: one request per device, carrying its sealed batch for every server, through a
relay that forwards many devices' entries in one request per server (docs/protocol.md section 7b).

Why: a one-row device that talks to each of N servers itself sends N requests at least, and
(without keys held from enrolment) N more to learn each server's identity. Through a relay it
sends one, and each server takes the entries of many devices in one request (issue 46). The
relay is not trusted with anything:

* every entry is a version 4 sealed batch (docs/protocol.md section 7a) sealed to its server's
  HPKE key, which the device holds from its enrolment (read from that server itself, never from
  the relay): the relay sees report ids, lengths and server ids, never a share or a salt, and an
  entry delivered to the wrong server or study does not open;
* the device's upload token never leaves it. Its entry carries the token's public id and a MAC,
  HMAC-SHA256 keyed from the token's SHA-256 digest (which the server keeps, and nobody else
  can compute without the token) over the batch's transcript, which binds the study, the server,
  the batch id, the key id, the record count and the HPKE encapsulation. The relay can therefore
  neither spend the token on a batch of its own, nor move a MAC to another batch; it can repeat
  an entry (reports are idempotent by id), or drop one (the analyzer's intersection leaves it
  out, as for any lost upload).

Layout (integers big-endian)::

    bundle  = count (4, >= 1) || entry_0 || ... || entry_{count-1}
    entry   = len(server_id) (1) || server_id (ASCII) || token_id (8) || mac (32)
              || length (4) || batch (length bytes: one version 4 sealed batch)

    mac_key = SHA-256("dpsketch/relayed/1/key" || SHA-256(token))
    mac     = HMAC-SHA256(mac_key, "dpsketch/relayed/1" || transcript_v4(study_id, server_id, header))

``token_id`` is the token's public id, the first 8 bytes of SHA-256(token) (the id a server's
operator lists); a study that takes uploads without tokens gets 8 and 32 zero bytes. The same
bundle layout goes from the device to the relay (one entry per server) and from the relay to each
server (that server's entries of many devices); a server refuses an entry addressed to another.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import envelope

if TYPE_CHECKING:
    from .study import Study

MEDIA_TYPE = "application/x-dpsketch-relayed"
ENTRY_LABEL = b"dpsketch/relayed/1"
KEY_LABEL = b"dpsketch/relayed/1/key"
TOKEN_ID_BYTES = 8
MAC_BYTES = 32
COUNT_BYTES = 4
LENGTH_BYTES = 4
NO_TOKEN_ID = bytes(TOKEN_ID_BYTES)
NO_MAC = bytes(MAC_BYTES)
#: entries in one bundle: a device sends one per server; a relay at most this many to a server
MAX_ENTRIES = 65_536


@dataclass(frozen=True)
class Entry:
    """One device's sealed batch for one server, with its token's id and MAC."""

    server_id: str
    token_id: bytes
    mac: bytes
    batch: bytes

    def encode(self) -> bytes:
        sid = self.server_id.encode("ascii")
        return (bytes([len(sid)]) + sid + self.token_id + self.mac
                + len(self.batch).to_bytes(LENGTH_BYTES, "big") + self.batch)


def unrelayable(study: "Study") -> str | None:
    """What keeps a study's reports off a relay (section 7b): ``"parties"`` (a party uploads its
    blocks under its party's token, section 2d) or ``"batch proofs"`` (each batch comes with its
    proof record, section 4d), neither of them a device's one sealed batch per server; None: the
    study can be relayed. The device (before it enrols or sends) and the server (415 before it
    reads a bundle) both ask this, each wording the answer for its reader."""
    if study.parties is not None:
        return "parties"
    if study.batch_proofs:
        return "batch proofs"
    return None


def token_digest(token: str) -> bytes:
    """SHA-256 of an upload token's UTF-8 bytes: what a server keeps of it."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def token_id(digest: bytes) -> bytes:
    """A token's public id (8 bytes): the first bytes of its digest, the id its server lists."""
    return bytes(digest[:TOKEN_ID_BYTES])


def mac_key(digest: bytes) -> bytes:
    """The MAC key of a token: SHA-256 of a label and its digest (so the id, which is the
    digest's first 8 bytes, says nothing about the key)."""
    if len(digest) != 32:
        raise ValueError("a token's digest is 32 bytes")
    return hashlib.sha256(KEY_LABEL + digest).digest()


def batch_header(batch: bytes) -> bytes:
    """The header of a version 4 sealed batch (what its transcript hashes), read from its layout
    and suite only; MalformedSealedBatch or UnknownSuite if it is not one."""
    envelope.check_layout(batch)
    if len(batch) < envelope.FIXED_BYTES:
        raise envelope.MalformedSealedBatch(f"{len(batch)} bytes: a sealed batch has a header of at least "
                                            f"{envelope.FIXED_BYTES} bytes")
    at = envelope.BATCH_ID_BYTES + envelope.KEY_ID_BYTES + 2
    suite = envelope.suite_of(batch[at:at + 6], "sealed batch")
    size = envelope.batch_header_bytes(suite)
    if len(batch) < size:
        raise envelope.MalformedSealedBatch(f"{len(batch)} bytes: a {suite.name} sealed batch's header is "
                                            f"{size} bytes")
    return bytes(batch[:size])


def entry_transcript(study_id: str, server_id: str, batch: bytes) -> bytes:
    """What an entry's MAC covers after its label: the transcript of its sealed batch's header
    for this study and server (envelope.transcript_v4), the same 32 bytes the batch's records
    are bound to, so a server that checked the MAC opens the batch with it."""
    return envelope.transcript_v4(study_id, server_id, batch_header(batch))


def entry_mac(digest: bytes, study_id: str, server_id: str, batch: bytes, transcript: bytes | None = None) -> bytes:
    """The MAC of a sealed batch under the token of SHA-256 digest ``digest`` (``transcript``:
    its :func:`entry_transcript`, if already computed)."""
    if transcript is None:
        transcript = entry_transcript(study_id, server_id, batch)
    return hmac.digest(mac_key(digest), ENTRY_LABEL + transcript, "sha256")


def make_entry(token: str | None, study_id: str, server_id: str, batch: bytes) -> Entry:
    """A device's entry for one server: its sealed batch with its token's id and MAC (``token``
    None: a study that takes uploads without tokens, zero id and MAC)."""
    if token is None:
        batch_header(batch)
        return Entry(server_id, NO_TOKEN_ID, NO_MAC, bytes(batch))
    digest = token_digest(token)
    return Entry(server_id, token_id(digest), entry_mac(digest, study_id, server_id, batch), bytes(batch))


def verify_mac(digest: bytes, study_id: str, server_id: str, entry: Entry, transcript: bytes | None = None) -> bool:
    """Whether ``entry``'s MAC is the token's (constant time; ``transcript``: its
    :func:`entry_transcript`, if already computed)."""
    return hmac.compare_digest(entry_mac(digest, study_id, server_id, entry.batch, transcript), entry.mac)


def encode(entries: Iterable[Entry | bytes]) -> bytes:
    """A bundle of entries (each an Entry, or an entry already encoded)."""
    parts = [e.encode() if isinstance(e, Entry) else bytes(e) for e in entries]
    if not 1 <= len(parts) <= MAX_ENTRIES:
        raise ValueError(f"a bundle holds 1 to {MAX_ENTRIES} entries, not {len(parts)}")
    return len(parts).to_bytes(COUNT_BYTES, "big") + b"".join(parts)


def decode(body: bytes | memoryview) -> list[Entry]:
    """The entries of a bundle; ValueError naming what is wrong if it is not exactly ``count``
    whole entries (a sealed batch inside is only checked when it is opened)."""
    view = memoryview(body)
    if len(view) < COUNT_BYTES:
        raise ValueError(f"a relayed bundle starts with a {COUNT_BYTES}-byte entry count; the body has "
                         f"{len(view)} bytes")
    count = int.from_bytes(view[:COUNT_BYTES], "big")
    if not 1 <= count <= MAX_ENTRIES:
        raise ValueError(f"a relayed bundle holds 1 to {MAX_ENTRIES} entries, not {count}")
    at, out = COUNT_BYTES, []
    for i in range(count):
        if at >= len(view):
            raise ValueError(f"relayed bundle: entry {i} of {count} is missing (the body ends at byte {at})")
        n = view[at]
        fixed = 1 + n + TOKEN_ID_BYTES + MAC_BYTES + LENGTH_BYTES
        if n == 0 or at + fixed > len(view):
            raise ValueError(f"relayed bundle: entry {i} is cut short or names an empty server id")
        try:
            server_id = bytes(view[at + 1:at + 1 + n]).decode("ascii")
        except UnicodeDecodeError:
            raise ValueError(f"relayed bundle: entry {i}'s server id is not ASCII") from None
        p = at + 1 + n
        tid, mac = bytes(view[p:p + TOKEN_ID_BYTES]), bytes(view[p + TOKEN_ID_BYTES:p + TOKEN_ID_BYTES + MAC_BYTES])
        p += TOKEN_ID_BYTES + MAC_BYTES
        length = int.from_bytes(view[p:p + LENGTH_BYTES], "big")
        p += LENGTH_BYTES
        if length == 0 or p + length > len(view):
            raise ValueError(f"relayed bundle: entry {i}'s batch of {length} bytes is empty or runs past "
                             f"the body ({len(view)} bytes)")
        out.append(Entry(server_id, tid, mac, bytes(view[p:p + length])))
        at = p + length
    if at != len(view):
        raise ValueError(f"relayed bundle: {len(view) - at} bytes follow its {count} entries")
    return out


def by_server(entries: Sequence[Entry]) -> dict[str, list[int]]:
    """The positions of each server's entries, in order (how a relay splits a device's bundle)."""
    out: dict[str, list[int]] = {}
    for i, e in enumerate(entries):
        out.setdefault(e.server_id, []).append(i)
    return out
