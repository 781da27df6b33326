"""No upload reply of an add/remove study tells how many reports a server holds (issue 47).

Under add/remove the exact count is what the neighbouring notion hides: whoever sees it before
and after one upload learns whether that client took part (docs/trust.md). So a reply to an
upload of an add/remove study may carry only what the request itself determines (how many of its
own reports were new or duplicates); ``report_count`` is null. The hand mutation run found a
server echoing ``report_count`` on these replies with every test passing (the membership test
only checked that a reply came back).

Checked the way an observer would: the same kinds of request are sent while the server holds 40
reports and again while it holds 340, on every upload route (single JSON, the fast single path,
share batches, seed batches, sealed batches, party blocks), and the replies - status, body and
every header but the date - must be byte-identical, with report_count null and no other member.
A replace-one study is the control: there the count is published and changes.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from dpsketch.client_sdk import sealing
from dpsketch.client_sdk.prepare import prepare_batch, prepare_blocks
from dpsketch.protocol import envelope, messages, parties
from dpsketch.protocol.study import Study, design
from test_server_unit import Server, make_study

MEMBERS = {"accepted", "duplicates", "report_count"}


def _reply(r: httpx.Response) -> tuple:
    """What an observer compares: status, body, headers other than the date."""
    headers = sorted((k.lower(), v) for k, v in r.headers.items() if k.lower() not in ("date",))
    return r.status_code, r.content, headers


def _rows(study: Study, m: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.1, size=(m, study.width))


def _requests(srv: Server, study: Study, seed: int) -> dict[str, tuple]:
    """One request of every upload route, each with fresh reports (and a repeat of one)."""
    out = {}
    path = f"/v1/studies/{study.study_id}"
    single = prepare_batch(study, _rows(study, 1, seed))
    body = single.report(0).model_dump()
    out["single"] = _reply(srv.client.post(f"{path}/reports", json=body))
    out["single-repeat"] = _reply(srv.client.post(f"{path}/reports", json=body))
    batch = prepare_batch(study, _rows(study, 3, seed + 1))
    out["shares"] = _reply(srv.client.post(f"{path}/batches", content=batch.body(0),
                                           headers={"Content-Type": batch.media_type(0)}))
    out["shares-repeat"] = _reply(srv.client.post(f"{path}/batches", content=batch.body(0),
                                                  headers={"Content-Type": batch.media_type(0)}))
    seeded = prepare_batch(study, _rows(study, 3, seed + 2), compress=True, full=1)
    assert seeded.media_type(0) == messages.SEEDS_MEDIA_TYPE
    out["seeds"] = _reply(srv.client.post(f"{path}/batches", content=seeded.body(0),
                                          headers={"Content-Type": seeded.media_type(0)}))
    info = messages.ServerInfo.model_validate(srv.client.get("/v1/info").json())
    public = sealing._current("s1", info.hpke, envelope.CLASSICAL, "s1", {})
    me = envelope.Recipient("s1", public, envelope.CLASSICAL, envelope.VERSION_4)
    plain = prepare_batch(study, _rows(study, 2, seed + 3))
    sealed = envelope.seal_body(me, study.study_id, plain.body(0), plain.media_type(0), study.width,
                                study.n_servers)
    out["sealed"] = _reply(srv.client.post(f"{path}/batches", content=sealed,
                                           headers={"Content-Type": messages.SEALED_MEDIA_TYPE}))
    return out


def _fill(srv: Server, study: Study, m: int, seed: int) -> None:
    batch = prepare_batch(study, _rows(study, m, seed))
    r = srv.client.post(f"/v1/studies/{study.study_id}/batches", content=batch.body(0),
                        headers={"Content-Type": batch.media_type(0)})
    assert r.status_code == 200, r.text


def _held(srv: Server, study: Study) -> int:
    return srv.app.state.store.record(study.study_id).report_count


@pytest.mark.parametrize("neighbouring", ["add-remove", "replace-one"])
def test_upload_replies_do_not_depend_on_the_held_count(tmp_path, neighbouring):
    study = make_study(neighbouring=neighbouring, columns=[f"c{i}" for i in range(6)])
    srv = Server(tmp_path / f"{neighbouring}.db")
    try:
        assert srv.provision(study).status_code == 201
        _fill(srv, study, 40, 1)
        early = _requests(srv, study, 100)
        _fill(srv, study, 300, 2)
        late = _requests(srv, study, 200)
        assert _held(srv, study) == 40 + 9 + 300 + 9
        for route, (status, body, _) in early.items():
            assert status == 200, (route, body)
            reply = json.loads(body)
            assert set(reply) == MEMBERS, (route, reply)
            new = 0 if route.endswith("repeat") else {"single": 1, "shares": 3, "seeds": 3, "sealed": 2}[route]
            assert (reply["accepted"], reply["duplicates"]) == (new, 0 if new else (1 if route == "single-repeat" else 3))
            if neighbouring == "add-remove":
                assert reply["report_count"] is None, (route, reply)
            else:
                assert isinstance(reply["report_count"], int) and reply["report_count"] >= 41
        if neighbouring == "add-remove":
            assert early == late  # status, body and headers: nothing moves with the count
        else:  # the control: a replace-one study publishes the count, and it moved
            assert all(json.loads(late[r][1])["report_count"] > json.loads(early[r][1])["report_count"] + 250
                       for r in early)
    finally:
        srv.close()


def test_block_upload_replies_of_an_add_remove_study_carry_no_count(tmp_path):
    """A study with parties under add/remove: a party's block batch gets the same reply whether
    the server holds 30 or 330 individuals' blocks."""
    study = design(name="v", columns=[], label=None, servers=["s1", "s2"], expected_reports=600, k=8, s=2,
                   neighbouring="add-remove", epsilon_floor=None,
                   parties=[{"name": "bank", "columns": ["a", "b"]}, {"name": "shop", "columns": ["c"]}])[0]
    srv = Server(tmp_path / "blocks.db")
    key = parties.new_key()
    path = f"/v1/studies/{study.study_id}/batches"

    def blocks(tag: str, m: int, party: str):
        ps = parties.pseudonyms(key, study.study_id, [f"{tag}-{i}" for i in range(m)])
        q = study.party(party)[1]
        batch = prepare_blocks(study, party, ps, np.zeros((m, q.width)))
        return srv.client.post(path, content=batch.body(0),
                               headers={"Content-Type": messages.blocks_media_type(party)})

    try:
        assert srv.provision(study).status_code == 201
        assert blocks("fill-a", 30, "bank").status_code == 200
        early = [_reply(blocks("early", 4, p)) for p in ("bank", "shop")]
        assert blocks("fill-b", 300, "bank").status_code == 200
        late = [_reply(blocks("late", 4, p)) for p in ("bank", "shop")]
        for status, body, _ in early:
            assert status == 200 and json.loads(body) == {"accepted": 4, "duplicates": 0, "report_count": None}
        assert early == late
    finally:
        srv.close()
