"""The opt-in post-quantum sealing suite (docs/sealing.md): MLKEM768-X25519 HPKE, version 4
sealed batches that name their suite, servers holding and publishing keys of both suites, and
the SDK's sealing policy, against real share servers."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import numpy as np
import pytest

from dpsketch.client_sdk import Client, SDKError, sealing
from dpsketch.client_sdk.cli import main as cli_main
from dpsketch.protocol import envelope, messages, ring, sketch

from studies import bind_at
from test_e2e import COLUMNS, direct_sketch, no_floor_module_cluster  # noqa: F401 (a fixture)
from test_envelope import (
    STUDY_A,
    STUDY_B,
    _bound,
    _Capture,
    _count,
    _info,
    _plaintexts,
    _post_sealed,
    _released,
    _study,
    no_floor_cluster,  # noqa: F401 (a fixture)
)

PQ = envelope.POST_QUANTUM
CL = envelope.CLASSICAL


def _pair(suite: envelope.SealingSuite):
    sk = suite.generate_private_key()
    return sk, suite.public_key_of(sk)


def _ring(*raw: tuple[envelope.SealingSuite, bytes]):
    """A server's key lookup over raw private keys of either suite."""
    keys = {envelope.key_id(s.public_key_of(sk)): s.load_private_key(sk) for s, sk in raw}
    return lambda kid: keys.get(bytes(kid))


def _pq_recipient(url: str, server_id: str) -> envelope.Recipient:
    pq = _info(url)["hpke"]["post_quantum"]
    current = next(k for k in pq["keys"] if k["key_id"] == pq["current"])
    return envelope.Recipient(server_id, bytes.fromhex(current["public_key"]), PQ)


# --- the envelope ------------------------------------------------------------------------------


def test_a_pq_batch_tampered_or_misbound_is_refused_with_the_right_error():
    """A post-quantum version 4 batch (the one sealed layout; sizes and round trips of both
    suites: tests/test_envelope.py, vectors: docs/protocol.md section 9) with a header byte,
    its key id, enc, the wrapped secret or a record altered, or opened in another context."""
    sk, pk = _pair(PQ)
    other_sk, other_pk = _pair(PQ)
    csk, cpk = _pair(CL)
    assert (len(sk), len(pk)) == (96, 1216)
    lookup = _ring((PQ, sk), (PQ, other_sk), (CL, csk))
    d, n = 5, 3
    ids, proofs, shares, _ = _bound(STUDY_A, 1, d, n)
    me = envelope.Recipient("s1", pk, PQ)
    rec = envelope.seal(me, STUDY_A, ids[0], envelope.CONTENT_SHARE, _plaintexts(proofs[0], shares[0])[0])
    head = envelope.batch_header_bytes(PQ)
    assert head == 37 + 1120 + 48 and rec[24:33] == bytes([0x80, 4, 0x64, 0x7A, 0, 1, 0, 3, 1])
    assert envelope.open_batch(rec, d, n, STUDY_A, "s1", lookup).ids == ids

    def opened(body: bytes, study=STUDY_A, server="s1"):
        return envelope.open_batch(body, d, n, study, server, lookup)

    def flip(at: int, value: int | None = None, xor: int = 0) -> bytes:
        bad = bytearray(rec)
        bad[at] = value if value is not None else bad[at] ^ xor
        return bytes(bad)

    # the suite: an unknown KEM, KDF or AEAD id names no suite here
    for at in (26, 27, 29, 31):
        with pytest.raises(envelope.UnknownSuite, match="is not one this server opens"):
            opened(flip(at, xor=0x01))
    # the classical KEM id on a post-quantum batch: the lengths no longer add up
    with pytest.raises(envelope.MalformedSealedBatch):
        opened(rec[:26] + b"\x00\x20" + rec[28:])
    # the format version and the marker byte
    with pytest.raises(envelope.MalformedSealedBatch, match="not a version 4"):
        opened(flip(25, 5))
    with pytest.raises(envelope.MalformedSealedBatch, match="not a version 4"):
        opened(flip(24, 0x81))
    for dropped in (2, 3):  # the dropped layouts
        with pytest.raises(envelope.MalformedSealedBatch, match=f"version {dropped} "):
            opened(flip(25, dropped))
    # the content kind (a share relabelled as a seed): lengths differ at d = 5
    with pytest.raises(envelope.MalformedSealedBatch):
        opened(flip(32, envelope.CONTENT_SEED))
    # the key id: another post-quantum key of this server (it does not open: the key id is bound
    # and the key is wrong), the server's classical key (another suite, never tried), unknown
    for kid, match in ((envelope.key_id(other_pk), "does not open here"),
                       (envelope.key_id(cpk), "another suite"),
                       (b"\x00" * 8, "unknown key id")):
        with pytest.raises(envelope.SealError, match=match):
            opened(rec[:16] + kid + rec[24:])
    # a bit of enc (the ML-KEM ciphertext, the X25519 share), of the wrapped secret, or of the
    # record's report id, ciphertext or the batch's tag
    for at in (37, 37 + 1088, 37 + 1119, 37 + 1120, head - 1, head, head + 16, len(rec) - 1):
        with pytest.raises(envelope.SealError, match="(does|do) not open here"):
            opened(flip(at, xor=0x04))
    # the context: study, server and batch id are bound
    with pytest.raises(envelope.SealError, match="does not open here"):
        opened(rec, study=STUDY_B)
    with pytest.raises(envelope.SealError, match="does not open here"):
        opened(rec, server="s2")
    with pytest.raises(envelope.SealError, match="does not open here"):
        opened(flip(0, xor=0x01))


# --- the SDK's policy, without servers ------------------------------------------------------------


def test_policy_is_checked_and_needs_encrypt():
    with pytest.raises(ValueError, match="one of classical, post-quantum, prefer-post-quantum"):
        Client(["http://a.test", "http://b.test"], encrypt=True, sealing="quantum")
    with pytest.raises(ValueError, match="encrypt=True"):
        Client(["http://a.test", "http://b.test"], sealing="post-quantum")
    with Client(["http://a.test", "http://b.test"], encrypt=True) as c:
        assert c.sealing == "classical"
    assert sealing.POLICIES == ("classical", "post-quantum", "prefer-post-quantum")


# --- real servers -----------------------------------------------------------------------------------


def _without_pq(port: int, posts: list, pq: bool = False, batches: bool = True, versions: list | None = None):
    """A transport that hides the post-quantum keys (unless ``pq``) and the sealed layouts it
    opens (unless ``batches``: a server from before sealed batches; ``versions``: says it opens
    those, [3] a server from before version 4) of the server on ``port``, and
    records every POST's port and bytes 24..32 (the layout: version 1 content, or 0x80, version,
    suite and content)."""

    class Hide(httpx.HTTPTransport):
        def handle_request(self, request):
            if request.method == "POST":
                posts.append((request.url.port, request.content[24:33]))
            resp = super().handle_request(request)
            if request.url.path == "/v1/info" and request.url.port == port:
                resp.read()
                body = resp.json()
                if not pq:
                    body["hpke"].pop("post_quantum")
                if not batches:
                    body["hpke"].pop("versions")
                if versions is not None:
                    body["hpke"]["versions"] = versions
                return httpx.Response(200, json=body)
            return resp

    return Hide()


def test_sdk_seals_post_quantum_and_the_release_equals_the_plaintext_sketch(
        no_floor_module_cluster, monkeypatch, tmp_path, capsys):  # noqa: F811
    """Client(encrypt=True, sealing="post-quantum") through 3 real servers: every body is
    one version 4 MLKEM768-X25519 batch, and the release equals S(A + G) of the prepared reports
    exactly. The policy refuses a server without a post-quantum key before sending anything;
    prefer-post-quantum falls back to classical there; a server that does not open version 4 is
    refused before anything is sent; the
    CLI's --sealing flag seals post-quantum."""
    c = no_floor_module_cluster
    n = 300
    study = _study(c, n, "pq-sealed", epsilon_floor=None)
    capture = _Capture(monkeypatch)
    seen: list[tuple[str, bytes]] = []

    class Watch(httpx.HTTPTransport):
        def handle_request(self, request):
            if request.method == "POST":
                seen.append((request.headers["content-type"], request.content))
            return super().handle_request(request)

    rows = np.random.default_rng(5).normal(0, 0.3, size=(n, len(COLUMNS)))
    # full shares (compress=False): every record sealed here carries a share, none a seed
    with Client(c.server_urls, encrypt=True, sealing="post-quantum", compress=False, transport=Watch()) as client:
        assert client.sealing_suites(study.study_id) == ["post-quantum"] * 3
        client.submit(study.study_id, rows[0])
        client.submit_many(study.study_id, rows[1:150], batch_size=64)
    pq_head = bytes([0x80, 4, 0x64, 0x7A, 0, 1, 0, 3, envelope.CONTENT_SHARE])  # version 4 batches
    assert seen and all(ct == messages.SEALED_MEDIA_TYPE and body[24:33] == pq_head for ct, body in seen)
    counts = [envelope.count_records(body, study.width, 3) for _, body in seen]
    assert sum(counts) == 150 * 3
    assert [len(body) for _, body in seen] == [
        envelope.body_bytes(envelope.CONTENT_SHARE, study.width, 3, m, PQ) for m in counts]

    # a server that publishes no post-quantum key: "post-quantum" refuses before any upload,
    # "prefer-post-quantum" seals classically (version 1) to it and post-quantum to the others
    posts: list = []
    port2 = httpx.URL(c.server_urls[1]).port
    with Client(c.server_urls, encrypt=True, sealing="post-quantum", transport=_without_pq(port2, posts)) as client:
        with pytest.raises(SDKError, match="publishes no post-quantum HPKE key"):
            client.submit_many(study.study_id, rows[150:160])
    assert posts == []
    with Client(c.server_urls, encrypt=True, sealing="prefer-post-quantum", compress=False,
                transport=_without_pq(port2, posts)) as client:
        assert client.sealing_suites(study.study_id) == ["post-quantum", "classical", "post-quantum"]
        client.submit_many(study.study_id, rows[150:225])
    heads2 = [head for port, head in posts if port == port2]
    assert heads2 and all(head == bytes([0x80, 4]) + CL.ids + b"\x01" for head in heads2)  # classical
    assert all(head == pq_head for port, head in posts if port != port2)
    # a server from before sealed batches (it lists no sealed layouts) or from before version 4
    # (it lists [3]): refused before anything is sent, whatever the policy (the per-record
    # layouts were dropped, versions 1 and 2 in issue 41, 3 in issue 46)
    for policy in ("classical", "post-quantum"):
        for hide in ({"batches": False}, {"versions": [3]}):
            posts.clear()
            with Client(c.server_urls, encrypt=True, sealing=policy, compress=False,
                        transport=_without_pq(port2, posts, pq=True, **hide)) as client:
                with pytest.raises(SDKError, match="does not open version 4 sealed batches"):
                    client.submit_many(study.study_id, rows[225:230], batch_size=2)
            assert posts == []
    # ... classical clients keep working
    with Client(c.server_urls, encrypt=True) as client:
        assert client.sealing_suites(study.study_id) == ["classical"] * 3
        client.submit_many(study.study_id, rows[225:260])
    # ... and so does dpsketch submit --sealing post-quantum (which implies --encrypt)
    csv = tmp_path / "rows.csv"
    csv.write_text(",".join(COLUMNS) + "\n" + "\n".join(",".join(f"{v:.6f}" for v in r) for r in rows[260:]))
    code = cli_main(["--study", study.study_id, "--servers", ",".join(c.server_urls),
                     "--sealing", "post-quantum", "--quiet", str(csv)])
    assert code == 0, capsys.readouterr()
    assert [_count(u, study.study_id) for u in c.server_urls] == [n] * 3
    ids, encoded = capture.ids_and_encoded(3)
    assert len(ids) == n
    released = _released(c, study)
    expected = ring.decode(direct_sketch(study, ids, encoded), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(released, expected)


def test_servers_hold_both_suites_rotate_refuse_unknown_and_keep_keys_across_a_restart(no_floor_cluster):  # noqa: F811
    c = no_floor_cluster
    study = _study(c, 200, "pq-keys", epsilon_floor=None)
    url1, spec1 = c.server_urls[0], c.specs[0]
    op1 = {"Authorization": f"Bearer {spec1.operator_token}"}
    before = _info(url1)["hpke"]
    pq = before["post_quantum"]
    assert (before["name"], before["kem_id"], pq["name"], pq["kem_id"], pq["kdf_id"], pq["aead_id"]) == (
        "classical", 0x0020, "post-quantum", 0x647A, 1, 3)
    assert [len(k["public_key"]) for k in pq["keys"]] == [2432]
    # every server's post-quantum key is its own, and the study info carries the same keys
    assert len({_info(u)["hpke"]["post_quantum"]["current"] for u in c.server_urls}) == 3
    assert httpx.get(f"{url1}/v1/studies/{study.study_id}").json()["hpke"] == before

    d, m = study.d, 3
    share = ring.random_ring((m, d))
    ids, proofs = bind_at(study, 0, share)
    plain = _plaintexts(proofs, share)
    to_pq = envelope.seal_batch(_pq_recipient(url1, "s1"), study.study_id, ids, envelope.CONTENT_SHARE, plain)
    # unknown suite, unknown key id, sealed for another server's key: 422, nothing stored
    unknown_suite = bytearray(to_pq)
    unknown_suite[27] ^= 0x01  # the first record's KEM id: 0x647b
    r = _post_sealed(url1, study.study_id, bytes(unknown_suite))
    assert r.status_code == 422 and r.json()["type"] == "urn:dpsketch:problem:sealed-share-refused", r.text
    assert "is not one this server opens" in r.json()["detail"]
    r = _post_sealed(url1, study.study_id, envelope.seal_batch(
        _pq_recipient(c.server_urls[1], "s1"), study.study_id, ids, envelope.CONTENT_SHARE, plain))
    assert r.status_code == 422 and "unknown key id" in r.json()["detail"]
    r = _post_sealed(url1, study.study_id, to_pq[:-1])
    assert r.status_code == 400 and r.json()["type"].endswith("malformed-body")
    assert _count(url1, study.study_id) == 0

    # rotation makes a new key of each suite current; sealed to the old keys still opens
    r = httpx.post(f"{url1}/v1/keys", headers=op1)
    assert r.status_code == 201, r.text
    after = r.json()
    assert after == _info(url1)["hpke"]
    assert after["current"] != before["current"] and after["post_quantum"]["current"] != pq["current"]
    assert len(after["keys"]) == 2 and len(after["post_quantum"]["keys"]) == 2
    old_pq = next(k for k in after["post_quantum"]["keys"] if k["key_id"] == pq["current"])
    assert old_pq["superseded_at"] is not None
    r = httpx.delete(f"{url1}/v1/keys/{pq['current']}", headers=op1)  # the open study may need it
    assert r.status_code == 409 and r.json()["type"].endswith("key-in-use")
    r = httpx.delete(f"{url1}/v1/keys/{after['post_quantum']['current']}", headers=op1)
    assert r.status_code == 409 and "current post-quantum key" in r.json()["detail"]

    # a batch sealed to the old (superseded) classical key before a SIGKILL restart
    old_cl = envelope.Recipient("s1", bytes.fromhex(before["keys"][0]["public_key"]))
    more = ring.random_ring((2, d))
    more_ids, more_proofs = bind_at(study, 0, more)
    v1_body = envelope.seal_batch(old_cl, study.study_id, more_ids, envelope.CONTENT_SHARE,
                                  _plaintexts(more_proofs, more))
    c.procs[0].kill()  # SIGKILL, then a start on the same database
    c.procs[0].start()
    assert _info(url1)["hpke"] == after  # both suites' keys, current and superseded, kept
    assert oct(Path(spec1.db_path).stat().st_mode & 0o777) == "0o600"
    assert _post_sealed(url1, study.study_id, to_pq).json() == {"accepted": 3, "duplicates": 0, "report_count": 3}
    assert _post_sealed(url1, study.study_id, v1_body).json()["accepted"] == 2
    # the same reports resealed to the new post-quantum key are duplicates
    again = envelope.seal_batch(_pq_recipient(url1, "s1"), study.study_id, ids, envelope.CONTENT_SHARE, plain)
    assert _post_sealed(url1, study.study_id, again).json() == {"accepted": 0, "duplicates": 3, "report_count": 5}
    stored = messages.decode_report_ids(httpx.get(
        f"{url1}/v1/studies/{study.study_id}/report-ids",
        headers={"Authorization": f"Bearer {spec1.analyst_token}"}).content)
    assert stored == sorted(ids + more_ids)


def test_a_database_from_before_the_suite_gains_a_pq_key_and_keeps_its_classical_one(tmp_path: Path):
    """In process: a server file without the post-quantum table (as made by an earlier release)
    keeps its classical key and gets a post-quantum one at the next start; that one persists."""
    from fastapi.testclient import TestClient

    from dpsketch.services.app import create_app
    from dpsketch.services.settings import Settings

    settings = Settings(server_id="s1", db_path=tmp_path / "s1.sqlite3", operator_token="op-" + "1" * 16,
                        analyst_token="an-" + "2" * 16, upload_auth="open")
    with TestClient(create_app(settings)) as client:
        first = client.get("/v1/info").json()["hpke"]
    conn = sqlite3.connect(settings.db_path)
    conn.execute("DROP TABLE hpke_pq_keys")  # the file as an earlier release left it
    conn.commit()
    conn.close()
    with TestClient(create_app(settings)) as client:
        second = client.get("/v1/info").json()["hpke"]
    assert second["keys"] == first["keys"] and second["current"] == first["current"]
    assert second["post_quantum"]["current"] != first["post_quantum"]["current"]
    with TestClient(create_app(settings)) as client:
        assert client.get("/v1/info").json()["hpke"] == second
    rows = sqlite3.connect(settings.db_path).execute(
        "SELECT length(private_key), length(public_key) FROM hpke_pq_keys").fetchall()
    assert rows == [(96, 1216)]
