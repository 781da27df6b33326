"""A sealed body's clear header is parsed once per direct upload (unit level, TestClient): the
server judges it before any decryption (services/uploads.py ``sealed_precheck``, or
services/proof_uploads.py's for a batch proof's record) and then opens the body with that same
header (``envelope.open_batch(header=)``, ``envelope.open_record(header=)``) instead of reading
it a second time; so does the relayed route for an entry of several rows. Each test counts the
calls of the header's parser on one accepted upload (a share batch, a party's block batch, a
batch proof's record, a relayed entry of five rows); before the header was passed on, each
counted two.

Flakes: the report ids, shares and sealing draw from the CSPRNG; an honest upload is refused
only if a binding or an AEAD tag collides (below 2^-96); nothing is timed."""

from __future__ import annotations

import numpy as np
import pytest

from dpsketch.client_sdk.prepare import prepare_blocks
from dpsketch.protocol import batch_records, envelope, messages, parties, relayed, report

from test_server_unit import Server, bound, make_study
from test_validity_e2e import data


def _recipient(srv: Server, server_id: str = "s1") -> envelope.Recipient:
    hpke = srv.client.get("/v1/info").json()["hpke"]
    public = bytes.fromhex(next(k["public_key"] for k in hpke["keys"] if k["key_id"] == hpke["current"]))
    return envelope.Recipient(server_id, public)


def _counted(monkeypatch, name: str) -> list[int]:
    """Count the calls of ``envelope.<name>`` (the header's parser) from now on."""
    calls: list[int] = []
    real = getattr(envelope, name)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(envelope, name, counting)
    return calls


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path / "s1.sqlite3")
    try:
        yield srv
    finally:
        srv.close()


def _five_rows_sealed(server):
    """A plain study provisioned at ``server``, and 5 bound rows sealed to it as one batch."""
    study = make_study()
    assert server.provision(study).status_code == 201
    return study, envelope.seal_body(_recipient(server), study.study_id, bound(study, 5).body(),
                                     messages.SHARES_MEDIA_TYPE, study.width, study.n_servers)


def test_a_direct_sealed_batch_has_its_header_parsed_once(server, monkeypatch):
    study, body = _five_rows_sealed(server)
    calls = _counted(monkeypatch, "parse_batch")
    r = server.batch(study, body, messages.SEALED_MEDIA_TYPE)
    assert r.status_code == 200 and r.json()["accepted"] == 5, r.text
    assert len(calls) == 1


def test_a_direct_sealed_block_batch_has_its_header_parsed_once(server, monkeypatch):
    study = make_study(columns=["income", "debt", "y"], label="y", parties=[
        {"name": "bank", "columns": ["income", "debt"]}, {"name": "clinic", "columns": ["y"]}])
    assert server.provision(study).status_code == 201
    ps = parties.pseudonyms(parties.new_key(), study.study_id, [f"person-{i}" for i in range(4)])
    blocks = prepare_blocks(study, "bank", ps, np.full((4, 2), 0.1))
    plain = messages.encode_blocks(blocks.report_ids, blocks.pseudonyms, blocks.proofs[0], blocks.shares[0])
    index, party = study.party("bank")
    body = envelope.seal_body(_recipient(server), study.study_id, plain, messages.blocks_media_type("bank"),
                              party.width, study.n_servers, party=index)
    calls = _counted(monkeypatch, "parse_batch")
    r = server.batch(study, body, f"{messages.SEALED_MEDIA_TYPE}; party=bank")
    assert r.status_code == 200 and r.json()["accepted"] == 4, r.text
    assert len(calls) == 1


def test_a_direct_sealed_batch_proof_record_has_its_header_parsed_once(server, monkeypatch):
    study = make_study(columns=["x0", "x1", "x2", "y"], label="y", servers=["s1", "s2", "s3"],
                       expected_reports=1000, min_reports=None, validity=True, batch_proofs=True)
    assert server.provision(study).status_code == 201
    batch = report.prepare_proof_batch(study, data(12, seed=1), leader=1)  # s1 a helper
    media_type, record = batch.records[0]
    body = batch_records.seal(_recipient(server), study.study_id, media_type, record, study.n_servers)
    calls = _counted(monkeypatch, "parse_record")
    r = server.client.post(f"/v1/studies/{study.study_id}/batches", content=body,
                           headers={"Content-Type": messages.SEALED_MEDIA_TYPE})
    assert r.status_code == 200 and r.json()["accepted"] == 12, r.text
    assert len(calls) == 1


def test_a_relayed_entry_of_several_rows_has_its_header_parsed_once(server, monkeypatch):
    study, batch = _five_rows_sealed(server)
    bundle = relayed.encode([relayed.make_entry(None, study.study_id, "s1", batch)])
    calls = _counted(monkeypatch, "parse_batch")
    r = server.client.post(f"/v1/studies/{study.study_id}/relayed", content=bundle,
                           headers={"Content-Type": relayed.MEDIA_TYPE})
    assert r.status_code == 200, r.text
    assert [o["status"] for o in r.json()["results"]] == [200] and r.json()["results"][0]["result"]["accepted"] == 5
    assert len(calls) == 1
