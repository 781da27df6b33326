"""The share server's own policy: privacy policy at provisioning, hashed and rotatable role
tokens, per-study upload tokens and retention of individual shares (docs/protocol.md section 6)."""

from __future__ import annotations

import base64
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from dpsketch.protocol.messages import SHARES_MEDIA_TYPE, encode_batch
from services.app import create_app
from services.auth import digest_text, parse_tokens
from services.settings import Settings
from test_server_unit import (
    AN,
    OP,
    Server,
    assert_problem,
    bearer,
    make_study,
    new_ids,
    random_shares,
)


# --- 1. privacy policy -------------------------------------------------------------------------


def test_info_publishes_the_policy(tmp_path: Path):
    srv = Server(tmp_path / "s1.sqlite3", max_epsilon=4.0, max_delta=1e-6, min_reports_floor=120,
                 min_lambda_star=2.0)
    try:
        info = srv.client.get("/v1/info").json()
        assert info["server_id"] == "s1"
        pol = info["policy"]
        assert pol["max_epsilon"] == 4.0 and pol["max_delta"] == 1e-6
        assert pol["min_reports_floor"] == 120 and pol["min_lambda_star"] == 2.0
        assert pol["retention_after_commit_seconds"] is None
    finally:
        srv.close()


def test_default_policy(tmp_path: Path):
    srv = Server(tmp_path / "s1.sqlite3")
    try:
        pol = srv.client.get("/v1/info").json()["policy"]
        assert (pol["max_epsilon"], pol["max_delta"], pol["min_reports_floor"], pol["min_lambda_star"]) == (
            10.0, 1e-5, 50, 1.0)
    finally:
        srv.close()


@pytest.mark.parametrize("overrides, settings, rule", [
    ({"epsilon": 12.0}, {}, "max_epsilon"),
    ({"delta": 1e-4}, {}, "max_delta"),
    ({"min_reports": 20, "expected_reports": 40, "k": 1, "s": 1}, {}, "min_reports_floor"),
    ({}, {"min_lambda_star": 1e6}, "min_lambda_star"),
    ({}, {"min_reports_floor": 150}, "min_reports_floor"),
    ({}, {"max_study_bytes": 10_000}, "max_study_bytes"),
])
def test_provisioning_refuses_studies_outside_the_policy(tmp_path: Path, overrides, settings, rule):
    srv = Server(tmp_path / "s1.sqlite3", **settings)
    try:
        st = make_study(**overrides)
        body = assert_problem(srv.provision(st), 422, "invalid-study")
        assert rule in body["detail"] and body["policy_rule"] == rule
        assert srv.client.get("/v1/studies").json() == []
        if not settings:  # the default study is inside the default policy
            assert srv.provision(make_study()).status_code == 201
    finally:
        srv.close()


def test_storage_policy_counts_max_reports_shares_and_ids(tmp_path: Path):
    st = make_study()
    need = st.max_reports * (16 + 8 * st.width)
    assert st.max_storage_bytes == need
    for limit, ok in ((need, True), (need - 1, False)):
        srv = Server(tmp_path / f"s{limit}.sqlite3", max_study_bytes=limit)
        try:
            assert srv.client.get("/v1/info").json()["policy"]["max_study_bytes"] == limit
            r = srv.provision(st)
            if ok:
                assert r.status_code == 201, r.text
            else:
                body = assert_problem(r, 422, "invalid-study")
                assert body["detail"].startswith("storage policy max_study_bytes:"), body
        finally:
            srv.close()


@pytest.mark.parametrize("text, size", [("4096", 4096), ("512M", 512 << 20), ("50G", 50 << 30),
                                        ("2TiB", 2 << 40), ("1.5k", 1536), (" 3 MB ", 3 << 20)])
def test_max_study_bytes_flag_takes_binary_units(text, size):
    from services.options import byte_size

    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "lots", "-5M", "0", "1e30"])
def test_max_study_bytes_flag_refuses_what_is_not_a_size(text):
    from services.options import byte_size

    with pytest.raises(ValueError):
        byte_size(text)


def test_study_inside_the_policy_is_provisioned(tmp_path: Path):
    srv = Server(tmp_path / "s1.sqlite3", max_epsilon=1.0, max_delta=1e-6, min_reports_floor=100)
    try:
        assert srv.provision(make_study(epsilon=1.0, delta=1e-6)).status_code == 201
    finally:
        srv.close()


# --- 2. hashed role tokens, several per role, rotation -----------------------------------------


def test_settings_keep_only_digests(tmp_path: Path):
    s = Settings(server_id="s1", db_path=tmp_path / "x.sqlite3", operator_token=OP, analyst_token=AN)
    assert s.operator_token == "" and s.analyst_token == ""
    assert OP not in repr(s) and AN not in repr(s)
    assert len(s.operator_digests) == 1 and len(s.operator_digests[0]) == 32
    with pytest.raises(ValueError):
        Settings(server_id="s1", db_path=tmp_path / "x.sqlite3", operator_token=OP, analyst_token=OP)
    with pytest.raises(ValueError):
        Settings(server_id="s1", db_path=tmp_path / "x.sqlite3", operator_token=OP)


def test_parse_tokens_accepts_digests_and_plain_tokens():
    got = parse_tokens(json.dumps({"operator": [digest_text("op-a"), "op-b"], "analyst": "an-a"}))
    assert len(got["operator"]) == 2 and len(got["analyst"]) == 1
    for bad in ("{", "[]", '{"admin": []}', '{"operator": ["sha256:12"]}', '{"operator": [""]}'):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def write_tokens(path: Path, operator: list[str], analyst: list[str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"operator": operator, "analyst": analyst}))
    os.replace(tmp, path)  # atomic: the server never reads half a file


def tokens_server(tmp_path: Path, path: Path, **kw) -> TestClient:
    settings = Settings(server_id="s1", db_path=tmp_path / "s1.sqlite3", tokens_file=path, **kw)
    client = TestClient(create_app(settings))
    client.__enter__()
    return client


def test_tokens_file_rotates_without_restart(tmp_path: Path):
    st = make_study()
    path = tmp_path / "tokens.json"
    write_tokens(path, [digest_text("op-one-0123456789"), "op-two-0123456789"], ["an-one-0123456789"])
    client = tokens_server(tmp_path, path)
    try:
        url = f"/v1/studies/{st.study_id}"
        put = lambda tok: client.put(url, content=st.canonical(), headers=bearer(tok))  # noqa: E731
        assert put("op-one-0123456789").status_code == 201
        assert put("op-two-0123456789").status_code == 200
        assert_problem(put("an-one-0123456789"), 403, "forbidden")
        assert client.get(f"{url}/report-ids", headers=bearer("an-one-0123456789")).status_code == 200

        write_tokens(path, ["op-three-0123456789"], [digest_text("an-two-0123456789")])
        assert_problem(put("op-one-0123456789"), 401, "unauthorized")
        assert put("op-three-0123456789").status_code == 200
        assert_problem(client.get(f"{url}/report-ids", headers=bearer("an-one-0123456789")), 401, "unauthorized")
        assert client.get(f"{url}/report-ids", headers=bearer("an-two-0123456789")).status_code == 200

        # a broken file (or one leaving a role without tokens) is not loaded: the tokens stay
        path.write_text("{broken")
        assert put("op-three-0123456789").status_code == 200
        write_tokens(path, ["op-four-0123456789"], [])
        assert put("op-three-0123456789").status_code == 200
        assert_problem(put("op-four-0123456789"), 401, "unauthorized")
        write_tokens(path, ["same-token-0123456789"], ["same-token-0123456789"])
        assert put("op-three-0123456789").status_code == 200
    finally:
        client.__exit__(None, None, None)


def test_env_tokens_and_tokens_file_are_both_valid(tmp_path: Path):
    path = tmp_path / "tokens.json"
    write_tokens(path, ["op-file-0123456789"], ["an-file-0123456789"])
    client = tokens_server(tmp_path, path, operator_token=OP, analyst_token=AN)
    try:
        st = make_study()
        for tok in (OP, "op-file-0123456789"):
            r = client.put(f"/v1/studies/{st.study_id}", content=st.canonical(), headers=bearer(tok))
            assert r.status_code in (200, 201)
        assert_problem(client.put(f"/v1/studies/{st.study_id}", content=st.canonical(),
                                  headers=bearer("an-file-0123456789")), 403, "forbidden")
    finally:
        client.__exit__(None, None, None)


def test_reload_request_rereads_an_unchanged_looking_file(tmp_path: Path):
    """What SIGHUP does: re-read even when the file's stat did not change."""
    from services.auth import TokenRegistry, digest_of

    path = tmp_path / "tokens.json"
    write_tokens(path, ["op-a-0123456789abc"], ["an-a-0123456789abc"])
    reg = TokenRegistry({}, path)
    assert reg.digests("operator") == (digest_of("op-a-0123456789abc"),)
    write_tokens(path, ["op-b-0123456789abc"], ["an-a-0123456789abc"])
    reg._stamp = reg._stat()  # pretend the change went unnoticed (same mtime, size, inode)
    assert reg.digests("operator") == (digest_of("op-a-0123456789abc"),)
    reg.request_reload()
    assert reg.digests("operator") == (digest_of("op-b-0123456789abc"),)


def test_bad_tokens_file_refuses_to_start(tmp_path: Path):
    path = tmp_path / "tokens.json"
    write_tokens(path, ["same-0123456789abc"], ["same-0123456789abc"])
    with pytest.raises(ValueError):
        create_app(Settings(server_id="s1", db_path=tmp_path / "s1.sqlite3", tokens_file=path))
    write_tokens(path, ["op-0123456789abcdef"], [])
    with pytest.raises(ValueError):
        create_app(Settings(server_id="s1", db_path=tmp_path / "s2.sqlite3", tokens_file=path))


def test_process_rotates_tokens_from_file_and_on_sighup(servers, tmp_path: Path):
    """A real server: rewriting the tokens file (and SIGHUP) rotates tokens; env tokens keep working."""
    path = tmp_path / "tokens.json"
    write_tokens(path, ["op-file-one-0123456789"], [digest_text("an-file-one-0123456789")])
    spec = servers.spec("s1")
    proc = servers.start(spec, extra_env={"DPSKETCH_TOKENS_FILE": str(path), "DPSKETCH_MAX_EPSILON": "5"})
    st = make_study()

    def put(token: str) -> int:
        return httpx.put(f"{proc.url}/v1/studies/{st.study_id}", content=st.canonical(),
                         headers={"Authorization": f"Bearer {token}"}).status_code

    assert httpx.get(f"{proc.url}/v1/info").json()["policy"]["max_epsilon"] == 5.0
    assert put("op-file-one-0123456789") == 201
    assert put(spec.operator_token) == 200  # the environment's token still works
    assert put("an-file-one-0123456789") == 403
    write_tokens(path, ["op-file-two-0123456789"], ["an-file-two-0123456789"])
    assert put("op-file-one-0123456789") == 401
    assert put("op-file-two-0123456789") == 200
    # SIGHUP re-reads the file (and does not stop the server, as SIGHUP's default would)
    write_tokens(path, ["op-file-3-0123456789"], ["an-file-two-0123456789"])
    os.kill(proc.proc.pid, signal.SIGHUP)
    time.sleep(0.2)
    assert put("op-file-3-0123456789") == 200
    assert put("op-file-two-0123456789") == 401
    assert httpx.get(f"{proc.url}/healthz").status_code == 200


# --- 3. per-study upload tokens ----------------------------------------------------------------


def test_upload_tokens(tmp_path: Path):
    db = tmp_path / "s1.sqlite3"
    srv = Server(db)
    st = make_study()
    try:
        assert srv.provision(st).status_code == 201
        ids, shares = new_ids(3), random_shares(3)
        assert srv.upload(st, ids[0], shares[0]).status_code == 200  # no tokens yet: open
        url = f"/v1/studies/{st.study_id}/upload-tokens"
        assert_problem(srv.client.post(url), 401, "unauthorized")
        assert_problem(srv.client.post(url, headers=bearer(AN)), 403, "forbidden")
        assert_problem(srv.client.post("/v1/studies/" + "0" * 64 + "/upload-tokens", headers=bearer(OP)),
                       404, "unknown-study")
        r = srv.client.post(url, headers=bearer(OP))
        assert r.status_code == 201 and r.json()["upload_tokens"] == 1
        token = r.json()["token"]
        r2 = srv.client.post(url, headers=bearer(OP))
        token2 = r2.json()["token"]
        assert r2.json()["upload_tokens"] == 2 and token2 != token

        r = srv.upload(st, ids[1], shares[1])
        assert_problem(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
        body = {"report_id": ids[1].hex(), "share": base64.b64encode(shares[1].tobytes()).decode()}
        post = srv.client.post
        assert_problem(post(f"/v1/studies/{st.study_id}/reports", json=body, headers=bearer(OP)), 401, "unauthorized")
        assert post(f"/v1/studies/{st.study_id}/reports", json=body, headers=bearer(token)).status_code == 200
        assert_problem(srv.batch(st, ids[2:], shares[2:]), 401, "unauthorized")
        r = post(f"/v1/studies/{st.study_id}/batches", content=encode_batch(ids[2:], shares[2:]),
                 headers={"Content-Type": SHARES_MEDIA_TYPE, **bearer(token2)})
        assert r.status_code == 200 and r.json()["report_count"] == 3
        with sqlite3.connect(db) as conn:  # only digests are stored
            stored = [bytes(d) for (d,) in conn.execute("SELECT digest FROM upload_tokens")]
        assert len(stored) == 2 and all(token.encode() not in d for d in stored)
    finally:
        srv.close()
    srv = Server(db)  # the tokens survive a restart
    try:
        assert_problem(srv.upload(st, new_ids(1)[0], random_shares(1)[0]), 401, "unauthorized")
        other = make_study(name="open")  # other studies stay open
        assert srv.provision(other).status_code == 201
        assert srv.upload(other, new_ids(1)[0], random_shares(1)[0]).status_code == 200
    finally:
        srv.close()


# --- 4. retention ------------------------------------------------------------------------------


def fill_and_commit(srv: Server, n: int = 200):
    st = make_study()
    assert srv.provision(st).status_code == 201
    ids, shares = new_ids(n), random_shares(n)
    assert srv.batch(st, ids, shares).status_code == 200
    r = srv.commit(st, ids[:-10])
    assert r.status_code == 200, r.text
    return st, ids


def share_lengths(db: Path) -> list[int]:
    with sqlite3.connect(db) as conn:
        return [n for (n,) in conn.execute("SELECT length(share) FROM reports")]


def test_delete_shares_keeps_aggregate_commit_and_ids(tmp_path: Path):
    db = tmp_path / "s1.sqlite3"
    srv = Server(db)
    try:
        st = make_study()
        assert srv.provision(st).status_code == 201
        url = f"/v1/studies/{st.study_id}/shares"
        assert_problem(srv.client.delete(url, headers=bearer(OP)), 409, "study-open")
        srv.close()
        srv = Server(tmp_path / "s2.sqlite3")
        db = tmp_path / "s2.sqlite3"
        st, ids = fill_and_commit(srv)
        url = f"/v1/studies/{st.study_id}/shares"
        before = srv.aggregate(st)
        held = srv.held_ids(st)
        commit = srv.client.get(f"/v1/studies/{st.study_id}").json()["commit"]
        assert_problem(srv.client.delete(url), 401, "unauthorized")
        assert_problem(srv.client.delete(url, headers=bearer(AN)), 403, "forbidden")
        r = srv.client.delete(url, headers=bearer(OP))
        assert r.status_code == 200 and r.json()["shares_deleted"] is True
        assert set(share_lengths(db)) == {0}
        assert srv.client.delete(url, headers=bearer(OP)).json() == r.json()  # idempotent
        after = srv.aggregate(st)
        assert after.content == before.content and after.headers == before.headers
        assert srv.held_ids(st) == held
        info = srv.client.get(f"/v1/studies/{st.study_id}").json()
        assert info["commit"] == commit and info["report_count"] == len(ids)
        assert srv.commit(st, ids[:-10]).json() == commit  # the same set: same result
        assert_problem(srv.commit(st, ids[:-11]), 409, "inclusion-conflict")
    finally:
        srv.close()
    srv = Server(db)  # after a restart: still deleted, same aggregate
    try:
        assert srv.aggregate(st).content == before.content
        assert srv.client.delete(url, headers=bearer(OP)).json() == r.json()
    finally:
        srv.close()


def test_retention_setting_deletes_shares_after_commit(tmp_path: Path):
    db = tmp_path / "s1.sqlite3"
    srv = Server(db, retention_after_commit_s=0, retention_sweep_s=0.05)
    try:
        assert srv.client.get("/v1/info").json()["policy"]["retention_after_commit_seconds"] == 0
        st, ids = fill_and_commit(srv)
        before = srv.aggregate(st).content
        deadline = time.monotonic() + 10
        while set(share_lengths(db)) != {0} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(share_lengths(db)) == {0}
        assert srv.aggregate(st).content == before
    finally:
        srv.close()


def test_retention_waits_for_its_delay(tmp_path: Path):
    db = tmp_path / "s1.sqlite3"
    srv = Server(db, retention_after_commit_s=3600)
    try:
        st, _ = fill_and_commit(srv)
        store = srv.app.state.store
        assert store.sweep_retention() == []
        assert store.due_for_retention(now=time.time() + 3601) == [st.study_id]
        assert 0 not in share_lengths(db)
    finally:
        srv.close()
