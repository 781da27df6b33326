"""Sealing for ``Client(encrypt=True)``: which of a server's HPKE keys each share is sealed to,
and the sealed request body (docs/protocol.md section 7a, docs/sealing.md).

The policy (``Client(sealing=...)``, ``dpsketch submit --sealing``) picks the suite per server:

* ``classical`` (the default): X25519 at every server;
* ``post-quantum``: MLKEM768-X25519 at every server; refused before anything is sent
  (:class:`~client_sdk.SDKError`) unless every server publishes a post-quantum key;
* ``prefer-post-quantum``: post-quantum at each server that publishes a key of that suite,
  classical at the others. A report's shares are information-theoretically secret as long as
  one of them is, so one post-quantum share already keeps a recording of the upload closed to a
  later quantum computer, unless every other server (holding its share anyway) helps; use
  ``post-quantum`` when that is not enough.

Every check the client made before the suites existed still holds for every key it seals to:
the key id matches the key, the suite is the one this client seals with, and no public key (of
either suite) is published by two servers, which would be one organisation holding two shares.

Layout: each request body is one version 4 batch (one KEM and one AEAD per batch and server),
the only sealed layout; a server that does not list version 4 in ``hpke.versions`` (a release
before it) is refused before anything is sent (versions 1 and 2, one HPKE seal per record, were
dropped in issue 41; version 3, an AEAD per record, in issue 46). A batch cannot be cut at a
record boundary (its count and order are sealed), so a body the server refuses as too large
(413) is cut in its plaintext and each half sealed again (:class:`SealedBody`).

A party's blocks (a study with parties) are sealed the same way, as content 0x03 with the
party's index bound and the pseudonym inside the ciphertext (docs/sealing.md section 3a), and
sent as ``application/x-dpsketch-sealed; party=NAME``.

A batch proof's record (a study with ``batch_proofs``) is sealed as a batch of one record,
content 0x05 (the leader's) or 0x06 (a helper's), its clear id the batch id (docs/sealing.md
section 3b). Sent again, it is sealed again with fresh randomness; the server stores the opened
record, so it is still the same batch (a duplicate). It is never cut: one proof covers its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from dpsketch.protocol import envelope, messages, proved_shares
from dpsketch.protocol.study import Study

from . import prepare
from .errors import SDKError, ServerProtocolError, StudyMismatch

CLASSICAL = "classical"
POST_QUANTUM = "post-quantum"
PREFER_POST_QUANTUM = "prefer-post-quantum"
POLICIES = (CLASSICAL, POST_QUANTUM, PREFER_POST_QUANTUM)


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"sealing must be one of {', '.join(POLICIES)}; got {policy!r}")
    return policy


def _current(url: str, keys: messages.HpkeKeys, suite: envelope.SealingSuite, server_id: str,
             owner: dict[bytes, str]) -> bytes:
    """The current public key of one suite of one server, every listed key checked."""
    if (keys.kem_id, keys.kdf_id, keys.aead_id) != (suite.kem_id, suite.kdf_id, suite.aead_id):
        raise ServerProtocolError(f"{url} offers HPKE suite ({keys.kem_id}, {keys.kdf_id}, "
                                  f"{keys.aead_id}); this client seals with {suite.description}")
    current = None
    for key in keys.keys:
        raw = bytes.fromhex(key.public_key)
        if len(raw) != suite.public_key_bytes:
            raise ServerProtocolError(f"{url} publishes a {len(raw)}-byte {suite.name} public key "
                                      f"(a {suite.name} key is {suite.public_key_bytes} bytes)")
        if envelope.key_id(raw).hex() != key.key_id:
            raise ServerProtocolError(f"{url} publishes key id {key.key_id} for a public "
                                      f"key that hashes to another id")
        if raw in owner and owner[raw] != server_id:
            raise StudyMismatch(
                f"servers {owner[raw]!r} and {server_id!r} publish the same HPKE public key: "
                f"one party could open both shares of every report; refusing to submit")
        owner[raw] = server_id
        if key.key_id == keys.current:
            current = raw
    if current is None:
        raise ServerProtocolError(f"{url} names current key {keys.current}, which it does not list")
    return current


def recipients(urls: Sequence[str], study: Study, infos: Sequence[messages.ServerInfo],
               policy: str = CLASSICAL) -> list[envelope.Recipient]:
    """Server j's id, current public key and suite, for every j, chosen by ``policy``."""
    check_policy(policy)
    if envelope.POST_QUANTUM.name not in envelope.SUITES:  # this machine's backend has no ML-KEM
        if policy == POST_QUANTUM:
            raise SDKError("sealing='post-quantum' needs ML-KEM, which this installation of the "
                           "cryptography package lacks (install its official wheels, >= 47)")
        policy = CLASSICAL
    out: list[envelope.Recipient] = []
    owner: dict[bytes, str] = {}
    for j, info in enumerate(infos):
        sid = study.servers[j]
        keys = info.hpke
        if keys is None:
            raise SDKError(f"{urls[j]} publishes no HPKE key in /v1/info: cannot seal shares to "
                           f"it (use encrypt=False, or upgrade the server)")
        pq = keys.post_quantum
        pq_known = pq is not None and (pq.kem_id, pq.kdf_id, pq.aead_id) == (
            envelope.POST_QUANTUM.kem_id, envelope.POST_QUANTUM.kdf_id, envelope.POST_QUANTUM.aead_id)
        if policy == POST_QUANTUM and pq is None:
            raise SDKError(f"{urls[j]} publishes no post-quantum HPKE key in /v1/info: cannot seal "
                           f"with sealing='post-quantum' (upgrade the server, or use "
                           f"'prefer-post-quantum' to seal classically where no such key is published)")
        # every published key is checked (ids, no key shared between servers), the used ones or not
        classical = _current(urls[j], keys, envelope.CLASSICAL, sid, owner)
        if envelope.VERSION_4 not in (keys.versions or ()):
            raise SDKError(f"{urls[j]} does not open version 4 sealed batches (hpke.versions "
                           f"{keys.versions}): the only sealed layout this SDK sends; upgrade the "
                           f"server, or use encrypt=False")
        if policy == POST_QUANTUM or (policy == PREFER_POST_QUANTUM and pq_known):
            suite, public = envelope.POST_QUANTUM, _current(urls[j], pq, envelope.POST_QUANTUM, sid, owner)  # type: ignore[arg-type]  # pq is not None here (pq_known or checked above)
        else:
            if pq_known:
                _current(urls[j], pq, envelope.POST_QUANTUM, sid, owner)  # type: ignore[arg-type]  # pq is not None here (pq_known)
            suite, public = envelope.CLASSICAL, classical
        out.append(envelope.Recipient(sid, public, suite, envelope.VERSION_4))
    return out


class SealedBody(bytes):
    """A sealed request body that keeps the plaintext body it seals, so that it can be cut in
    two and each half sealed again (a batch does not cut at record boundaries)."""

    recipient: envelope.Recipient
    study: Study
    study_id: str
    plain: bytes
    plain_media_type: str

    def split(self) -> tuple["SealedBody", "SealedBody"]:  # type: ignore[override]  # a sealed body's two halves, not bytes.split
        first, second = prepare.split_body(self.plain, self.plain_media_type, self.study)
        return (wire(self.recipient, self.study, self.study_id, first, self.plain_media_type)[0],
                wire(self.recipient, self.study, self.study_id, second, self.plain_media_type)[0])


def wire(recipient: envelope.Recipient, study: Study, study_id: str, body: bytes,
         media_type: str) -> tuple[SealedBody, str]:
    """A prepared plaintext body sealed to ``recipient`` in its layout (``recipient.version``):
    a share or seed batch as ``application/x-dpsketch-sealed``, a party's block batch as
    ``application/x-dpsketch-sealed; party=NAME``, a batch proof's record as
    ``application/x-dpsketch-sealed`` of content 0x05 (the leader's) or 0x06 (a helper's), its
    batch id in the clear (docs/sealing.md section 3b)."""
    name = messages.party_of_media_type(media_type)
    if prepare.is_batch_record(media_type, study):  # a batch proof's record (docs/sealing.md 3b)
        from dpsketch.protocol import batch_records

        sealed = SealedBody(batch_records.seal(recipient, study_id, media_type, body, study.n_servers))
        wire_type = messages.SEALED_MEDIA_TYPE
    elif name is not None:
        index, declared = study.party(name)
        sealed = SealedBody(envelope.seal_body(recipient, study_id, body, media_type,
                                               proved_shares.upload_width(study, index), study.n_servers,
                                               party=index))
        wire_type = f"{messages.SEALED_MEDIA_TYPE}; party={name}"
    else:
        sealed = SealedBody(envelope.seal_body(recipient, study_id, body, media_type,
                                               proved_shares.upload_width(study), study.n_servers))
        wire_type = messages.SEALED_MEDIA_TYPE
    sealed.recipient, sealed.study, sealed.study_id = recipient, study, study_id
    sealed.plain, sealed.plain_media_type = body, media_type
    return sealed, wire_type


def count_records(body: bytes, media_type: str, study: Study) -> int:
    """Reports (or blocks) in an upload body: a sealed body the SDK made counts its plaintext's."""
    if isinstance(body, SealedBody):
        return prepare.count_records(body.plain, body.plain_media_type, study)
    name = messages.party_of_media_type(media_type)
    if media_type.split(";", 1)[0].strip() == messages.SEALED_MEDIA_TYPE and name is not None:
        index, _ = study.party(name)  # a sealed block batch read back (a journal's pending one)
        return envelope.count_records(body, proved_shares.upload_width(study, index), study.n_servers, index)
    return prepare.count_records(body, media_type, study)


def split_body(body: bytes, media_type: str, study: Study) -> tuple[bytes, bytes]:
    """Cut an upload body in two (on 413): a sealed body the SDK made is cut in its plaintext and
    each half sealed again; any other body at the record boundary nearest its middle."""
    if isinstance(body, SealedBody):
        return body.split()
    return prepare.split_body(body, media_type, study)


def overhead_bytes(chosen: Sequence[envelope.Recipient]) -> int:
    """The most bytes sealing adds to one report's record at any server (for batch sizing): none,
    a batch adds its header and one tag once (``envelope.batch_overhead_bytes``)."""
    return max(envelope.overhead_bytes(r.suite, r.version) for r in chosen)
