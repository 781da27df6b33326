"""Sealed blocks of a study with parties (docs/sealing.md section 3a), attacked the way a relay
would: records swapped, relabelled (another block id, another party, another kind), spliced
across batches or parties, replayed to another server or study; and at real servers, where
every such body is refused with a 4xx and stores nothing, the genuine ones (sealed by the SDK)
are accepted once, and the release is exactly the sketch of the joined noisy rows."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.client_sdk import sealing as sdk_sealing
from dpsketch.client_sdk.prepare import prepare_blocks
from dpsketch.protocol import binding, envelope, messages, parties, ring, sketch

from studies import record_blocks
from test_e2e import direct_sketch
from test_parties import PARTIES, _create, shared_party_cluster  # noqa: F401 (a fixture)

STUDY_A = "ab" * 32
STUDY_B = "cd" * 32
N, WIDTH = 3, 2
NOT_OPEN = "its records do not open here"
KEY_NOT = "its key does not open here"


def _blocks(party: int, m: int, key: bytes = b"k" * 32, first: int = 0, study: str = STUDY_A):
    """m bound blocks of party ``party`` (WIDTH columns) for N servers: (block ids, pseudonyms,
    proofs per server, shares per server)."""
    ps = parties.pseudonyms(key, study, [f"person-{first + i}" for i in range(m)])
    shares = ring.share(ring.random_ring((m, WIDTH)), N)
    ids, proofs = binding.bind(study, [binding.CONTENT_SHARE] * N, shares, binding.block_prefixes(study, party, ps))
    return ids, ps, proofs, shares


def _body(ids, ps, proofs, shares, j: int = 0) -> bytes:
    """A plaintext block batch for server j."""
    return messages.encode_blocks(ids, ps, proofs[j], shares[j])


def _seal(recipient, body: bytes, party: int, study: str = STUDY_A) -> bytes:
    return envelope.seal_body(recipient, study, body, messages.blocks_media_type("x"), WIDTH, N, party=party)


def _cut(body: bytes):
    """(header, [(block id, ciphertext piece)], tag) of a sealed block batch."""
    head = envelope.batch_header_bytes(envelope.CLASSICAL)
    size = envelope.plaintext_bytes(envelope.CONTENT_BLOCK, WIDTH, N)
    m = (len(body) - head - 16) // (16 + size)
    sealed = body[head + 16 * m:]
    return body[:head], [(body[head + 16 * i:head + 16 * (i + 1)], sealed[i * size:(i + 1) * size])
                         for i in range(m)], sealed[-16:]


def _join(header: bytes, records, tag: bytes) -> bytes:
    return header + b"".join(r[0] for r in records) + b"".join(r[1] for r in records) + tag


def test_sealed_block_batches_open_only_whole_at_their_place_party_server_and_study():
    sk = envelope.generate_private_key()
    key = envelope.CLASSICAL.load_private_key(sk)
    me = envelope.Recipient("s1", envelope.public_key_of(sk))
    a_ids, a_ps, a_proofs, a_shares = _blocks(1, 6)
    b_ids, b_ps, b_proofs, b_shares = _blocks(1, 6, first=6)
    c_ids, c_ps, c_proofs, c_shares = _blocks(0, 6)  # party 0's blocks of the same people as a
    plain_a = _body(a_ids, a_ps, a_proofs, a_shares)
    a, b = _seal(me, plain_a, 1), _seal(me, _body(b_ids, b_ps, b_proofs, b_shares), 1)
    c = _seal(me, _body(c_ids, c_ps, c_proofs, c_shares), 0)

    def opened(body, party=1, study=STUDY_A, server="s1"):
        return envelope.open_batch(body, WIDTH, N, study, server, lambda kid: key if kid == me.key_id else None, party)

    def refused(body, error=envelope.SealError, match=NOT_OPEN, **kw):
        with pytest.raises(error, match=match):
            opened(body, **kw)

    # what opens is the plaintext batch's records: block ids, pseudonyms, party, bound shares
    up = opened(a)
    plain = messages.decode_blocks(plain_a, 1, WIDTH, N)
    assert up.ids == list(plain.ids) and up.pseudonyms == plain.pseudonyms == a_ps and up.party == 1
    np.testing.assert_array_equal(up.proofs, plain.proofs)
    np.testing.assert_array_equal(up.payloads, plain.payloads)
    up.verify(STUDY_A, N, 0)
    assert len(a) == envelope.batch_overhead_bytes() + len(plain_a)  # a record as long as a plaintext one
    # the pseudonyms travel sealed: none of them is in the body, the block ids are
    assert not any(p in a for p in a_ps) and all(i in a for i in a_ids)

    ha, ra, ta = _cut(a)
    hb, rb, tb = _cut(b)
    assert _join(ha, ra, ta) == a
    # swap: two records, only two block ids, only two ciphertexts (a pseudonym and share moved
    # to another block id); a record of b substituted
    refused(_join(ha, [ra[1], ra[0]] + ra[2:], ta))
    refused(_join(ha, [(ra[1][0], ra[0][1]), (ra[0][0], ra[1][1])] + ra[2:], ta))
    refused(_join(ha, [(ra[0][0], ra[1][1]), (ra[1][0], ra[0][1])] + ra[2:], ta))
    refused(_join(ha, ra[:2] + [rb[2]] + ra[3:], ta))
    # relabel: a record under another block id (the clear id, as a relay could rewrite it);
    # the batch as another party's (same width) or as shares; its content byte rewritten
    refused(_join(ha, [(b_ids[0], ra[0][1])] + ra[1:], ta))
    refused(a, match=KEY_NOT, party=0)
    refused(a, envelope.MalformedSealedBatch, "for a study with parties", party=None)
    as_shares = bytearray(a)
    as_shares[32] = envelope.CONTENT_SHARE
    refused(bytes(as_shares), envelope.MalformedSealedBatch, "takes sealed blocks")
    # splice: a's header with b's records, halves of two batches, the other party's records
    # under a's header, two batches in one body
    refused(_join(ha, rb, tb))
    refused(_join(ha, ra[:3] + rb[3:], ta))
    hc, rc, tc = _cut(c)
    refused(_join(ha, rc, tc))
    refused(_join(hc, ra, ta), match=NOT_OPEN, party=0)
    refused(a + b, envelope.MalformedSealedBatch, "truncated, padded or spliced")
    # replay: to another server, another study
    refused(a, match=KEY_NOT, server="s2")
    refused(a, match=KEY_NOT, study=STUDY_B)
    # a party (or a colluding relay with the plaintexts) sealing a block under another pseudonym:
    # it opens, but the block id commits to the pseudonym
    moved = _seal(me, messages.encode_blocks(a_ids[:1], b_ps[:1], a_proofs[0][:1], a_shares[0][:1]), 1)
    with pytest.raises(binding.BindingError):
        opened(moved).verify(STUDY_A, N, 0)
    # every header bit is bound
    for at in range(len(ha)):
        bad = bytearray(a)
        bad[at] ^= 1 << (at % 8)
        with pytest.raises((envelope.SealError, envelope.MalformedSealedBatch)):
            opened(bytes(bad))


def _post(url: str, study_id: str, body: bytes, ctype: str, token: str | None) -> httpx.Response:
    headers = {"Content-Type": ctype}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{url}/v1/studies/{study_id}/batches", content=body, headers=headers, timeout=60)


def _counts(url: str, study_id: str) -> dict:
    return httpx.get(f"{url}/v1/studies/{study_id}").json()["party_counts"]


def test_sealed_blocks_at_real_servers(shared_party_cluster, monkeypatch):
    """Three parties seal their blocks (the bank and the shop through the SDK, the clinic by hand
    so that its bodies can be attacked); every attack at a real server is a 4xx that stores
    nothing; a token's quota is judged before decryption; the genuine bodies are accepted once (a replay is duplicates); the release is the
    sketch of the joined noisy rows of every individual, bit for bit (no server noise)."""
    c = shared_party_cluster
    n = 120
    # min_reports below n: the analyzer draws the sketch seed and the party key is fresh, so
    # lambda_min of these 120 individuals' sketch (k = 16, 7.5 a row) is drawn fresh every run.
    # At min_reports = n the certificate refused 11 of 1000 simulated draws (lambda_min /
    # lambda_star 0.73 at worst); at min_reports = 100, 0 of 8000 (1.11 at worst, 1.72 +- 0.16).
    study = _create(c, n, min_reports=100)
    assert study.server_sigma == 0
    sid = study.study_id
    key = parties.new_key()
    rng = np.random.default_rng(8)
    people = [f"person-{i:04d}" for i in range(n)]
    data = rng.normal(0, 0.3, size=(n, 5))
    cols = {"bank": slice(0, 2), "shop": slice(2, 3), "clinic": slice(3, 5)}
    tokens = {p["name"]: c.upload_tokens(sid, quota=None, party=p["name"]) for p in PARTIES}
    prepared = record_blocks(monkeypatch)
    for name in ("bank", "shop"):
        with Client(c.server_urls, token=tokens[name], encrypt=True) as client:
            assert client.sealing_suites(sid) == ["classical"] * 3
            result = client.submit_blocks(sid, name, data[:, cols[name]], party_key=key, keys=people, batch_size=50)
        assert result.n_reports == n
    # the clinic's blocks, sealed to each server as the SDK seals them, in two batches
    ps = parties.pseudonyms(key, sid, people)
    clinic = prepare_blocks(study, "clinic", ps, data[:, cols["clinic"]])
    prepared["clinic"] = [clinic]
    infos = [messages.ServerInfo.model_validate(httpx.get(f"{u}/v1/info").json()) for u in c.server_urls]
    to = sdk_sealing.recipients(c.server_urls, study, infos)
    half = n // 2

    def sealed(j: int, lo: int, hi: int) -> tuple[bytes, str]:
        plain = messages.encode_blocks(clinic.report_ids[lo:hi], clinic.pseudonyms[lo:hi],
                                       clinic.proofs[j][lo:hi], clinic.shares[j][lo:hi])
        body, ctype = sdk_sealing.wire(to[j], study, sid, plain, messages.blocks_media_type("clinic"))
        return bytes(body), ctype

    a, ctype = sealed(0, 0, half)
    b, _ = sealed(0, half, n)
    assert ctype == "application/x-dpsketch-sealed; party=clinic"
    d = study.parties[2].width
    head = envelope.batch_header_bytes(envelope.CLASSICAL)
    size = envelope.plaintext_bytes(envelope.CONTENT_BLOCK, d, 3)

    def cut(body):
        m = (len(body) - head - 16) // (16 + size)
        s = body[head + 16 * m:]
        return body[:head], [(body[head + 16 * i:head + 16 * (i + 1)], s[i * size:(i + 1) * size]) for i in range(m)], s[-16:]

    ha, ra, ta = cut(a)
    hb, rb, tb = cut(b)
    bank_body = bytes(sdk_sealing.wire(to[0], study, sid, prepared["bank"][0].body(0),
                                       messages.blocks_media_type("bank"))[0])
    s1, clinic_t, bank_t = c.server_urls[0], tokens["clinic"][0], tokens["bank"][0]
    attacks = {
        "two records swapped": (_join(ha, [ra[1], ra[0]] + ra[2:], ta), ctype, clinic_t, 422, "sealed-share-refused"),
        "two block ids swapped": (_join(ha, [(ra[1][0], ra[0][1]), (ra[0][0], ra[1][1])] + ra[2:], ta), ctype,
                                  clinic_t, 422, "sealed-share-refused"),
        "a record under another block id": (_join(ha, [(rb[0][0], ra[0][1])] + ra[1:], ta), ctype, clinic_t, 422,
                                            "sealed-share-refused"),
        "relabelled as the bank's (same width)": (a, "application/x-dpsketch-sealed; party=bank", bank_t, 422,
                                                  "sealed-share-refused"),
        "relabelled as the bank's, clinic's token": (a, "application/x-dpsketch-sealed; party=bank", clinic_t, 403,
                                                     "wrong-party"),
        "relabelled as the shop's (other width)": (a, "application/x-dpsketch-sealed; party=shop",
                                                   tokens["shop"][0], 400, "malformed-body"),
        "the bank's batch as the clinic's": (bank_body, ctype, clinic_t, 422, "sealed-share-refused"),
        "spliced: a's header, b's records": (_join(ha, rb, tb), ctype, clinic_t, 422, "sealed-share-refused"),
        "spliced: halves of a and b": (_join(ha, ra[:half // 2] + rb[half // 2:], ta), ctype, clinic_t, 422,
                                       "sealed-share-refused"),
        "two batches in one body": (a + b, ctype, clinic_t, 400, "malformed-body"),
        "no party named": (a, messages.SEALED_MEDIA_TYPE, clinic_t, 415, "unsupported-media-type"),
        "a party the study lacks": (a, "application/x-dpsketch-sealed; party=insurer", clinic_t, 422,
                                    "invalid-request"),
        "the tag altered": (a[:-1] + bytes([a[-1] ^ 1]), ctype, clinic_t, 422, "sealed-share-refused"),
    }
    before = _counts(s1, sid)
    assert before == {"bank": n, "shop": n, "clinic": 0}
    for name, (body, ct, token, status, slug) in attacks.items():
        r = _post(s1, sid, body, ct, token)
        assert (r.status_code, r.json()["type"]) == (status, f"urn:dpsketch:problem:{slug}"), (name, r.text)
    r = _post(c.server_urls[1], sid, a, ctype, tokens["clinic"][1])  # s1's batch replayed to s2
    assert r.status_code == 422 and "unknown key id" in r.json()["detail"]
    # the quota is judged on the clear block ids before any decryption: a body that would not
    # even open gets 403 from a token with room for one block, as the genuine one does
    small = c.upload_tokens(sid, quota=1, party="clinic")[0]
    for body in (a, a[:-1] + bytes([a[-1] ^ 1])):
        r = _post(s1, sid, body, ctype, small)
        assert (r.status_code, r.json()["type"]) == (403, "urn:dpsketch:problem:upload-quota-exceeded"), r.text
    assert [_counts(u, sid) for u in c.server_urls] == [before] * 3
    # the genuine batches; a replay is only duplicates, and the attacks still store nothing
    assert _post(s1, sid, a, ctype, clinic_t).json()["accepted"] == half
    replay = _post(s1, sid, a, ctype, clinic_t).json()
    assert (replay["accepted"], replay["duplicates"]) == (0, half)
    for name, (body, ct, token, status, _slug) in attacks.items():
        assert _post(s1, sid, body, ct, token).status_code == status, name
    assert _post(s1, sid, b, ctype, clinic_t).json()["accepted"] == n - half
    for j in (1, 2):
        body, _ = sealed(j, 0, n)
        assert _post(c.server_urls[j], sid, body, ctype, tokens["clinic"][j]).json()["accepted"] == n
    assert [_counts(u, sid) for u in c.server_urls] == [{"bank": n, "shop": n, "clinic": n}] * 3

    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        done = an.finalize(sid)
        assert done["state"] == "released" and done["n_reports"] == n
        view = np.array(an.sketch(sid)["sketch"])
    encoded: dict[bytes, np.ndarray] = {}
    for name, batches in prepared.items():
        for batch in batches:
            for p, row in zip(batch.pseudonyms, ring.reconstruct(batch.shares)):
                encoded.setdefault(p, np.zeros(study.d, dtype=np.uint64))[cols[name]] = row
    expected = ring.decode(direct_sketch(study, ps, np.array([encoded[p] for p in ps])), study.frac_bits)
    np.testing.assert_array_equal(view, expected * sketch.scale(study.s))
