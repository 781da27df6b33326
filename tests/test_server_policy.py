"""The share server's own policy: privacy, storage and memory policy at provisioning, hashed and
rotatable role tokens, per-study upload tokens with quotas and retention of individual shares
(docs/protocol.md section 6, docs/trust.md)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from dpsketch.services.app import create_app
from dpsketch.services.auth import digest_text, parse_tokens
from dpsketch.services.settings import Settings
from conftest import BOTH_STORES
from test_server_unit import (
    AN,
    OP,
    Server,
    assert_problem,
    bearer,
    make_study,
)

MIB, GIB = 1 << 20, 1 << 30


# --- 1. privacy policy -------------------------------------------------------------------------


#: What GET /v1/info publishes as ``policy`` (dpsketch/2: the floor, the batch rule, upload
#: authentication and the memory policy were added).
POLICY_KEYS = {"max_epsilon", "max_delta", "min_reports_floor", "min_lambda_star", "max_floor_epsilon",
               "max_excluded_fraction", "upload_auth", "max_study_bytes", "max_study_memory",
               "memory_budget", "max_k", "max_aggregate_cells", "retention_after_commit_seconds",
               # issue 41: every population's budget (both bounds), expiry and the open-study cap
               "population_epsilon", "population_floor_epsilon", "population_delta",
               "population_neighbouring", "default_population", "study_expiry_seconds",
               "max_open_studies",
               # issue 44: the web pages allowed to call the server from a browser
               "cors_origins",
               # issue 46: whether it takes relayed uploads (docs/relay.md)
               "relayed_uploads"}


def test_info_publishes_the_policy(tmp_path: Path):
    srv = Server(tmp_path / "s1.sqlite3", max_epsilon=4.0, max_delta=1e-6, min_reports_floor=120,
                 min_lambda_star=2.0, max_floor_epsilon=3.0, max_excluded_fraction=0.25, upload_auth="open",
                 max_study_bytes=None, max_study_memory=MIB, memory_budget=8 * MIB, relayed_uploads=False)
    try:
        info = srv.client.get("/v1/info").json()
        assert info["server_id"] == "s1"
        pol = info["policy"]
        assert set(pol) == POLICY_KEYS
        assert pol["max_epsilon"] == 4.0 and pol["max_delta"] == 1e-6
        assert pol["min_reports_floor"] == 120 and pol["min_lambda_star"] == 2.0
        assert pol["max_floor_epsilon"] == 3.0 and pol["max_excluded_fraction"] == 0.25
        assert pol["upload_auth"] == "open" and pol["max_study_bytes"] is None
        assert pol["relayed_uploads"] is False
        assert pol["max_study_memory"] == MIB and pol["memory_budget"] == 8 * MIB
        assert pol["retention_after_commit_seconds"] is None
    finally:
        srv.close()
    srv = Server(tmp_path / "s2.sqlite3", max_floor_epsilon=None)
    try:  # no floor required: published as null
        assert srv.client.get("/v1/info").json()["policy"]["max_floor_epsilon"] is None
    finally:
        srv.close()


def test_default_policy(tmp_path: Path):
    """The reference server's defaults (docs/protocol.md section 6, docs/trust.md)."""
    srv = Server(tmp_path / "s1.sqlite3", policy_defaults=True)
    try:
        pol = srv.client.get("/v1/info").json()["policy"]
        assert set(pol) == POLICY_KEYS
        assert (pol["max_epsilon"], pol["max_delta"], pol["min_reports_floor"], pol["min_lambda_star"]) == (
            10.0, 1e-5, 50, 1.0)
        # dpsketch/2: a floor of epsilon 4, the batch rule 0.1, upload tokens required, 32 GiB of
        # shares per study (formerly unlimited), 256 MiB of running totals per study, 4 GiB in all
        assert (pol["max_floor_epsilon"], pol["max_excluded_fraction"], pol["upload_auth"]) == (4.0, 0.1, "tokens")
        assert pol["relayed_uploads"] is True  # issue 46: relayed uploads taken unless turned off
        assert (pol["max_study_bytes"], pol["max_study_memory"], pol["memory_budget"]) == (
            32 * GIB, 256 * MIB, 4 * GIB)
        assert (pol["max_k"], pol["max_aggregate_cells"], pol["retention_after_commit_seconds"]) == (
            4096, 1 << 24, None)
        # issue 41: a finite budget for every population, on by default, for both guarantees
        assert (pol["population_epsilon"], pol["population_floor_epsilon"], pol["population_delta"],
                pol["population_neighbouring"], pol["default_population"]) == (
            4.0, 12.0, 1e-6, "replace-one", "default")
        assert (pol["study_expiry_seconds"], pol["max_open_studies"]) == (7 * 24 * 3600.0, 1000)
        assert pol["cors_origins"] == []  # no browser page on another origin unless the operator says so
        # a study designed with design()'s default floor is inside the default policy
        st = make_study(epsilon_floor="default")
        assert st.epsilon_floor == 4.0
        assert srv.provision(st).status_code == 201
    finally:
        srv.close()


@pytest.mark.parametrize("overrides, settings, rule", [
    ({"epsilon": 12.0}, {}, "max_epsilon"),
    ({"delta": 1e-4}, {}, "max_delta"),
    ({"min_reports": 20, "expected_reports": 40, "k": 1, "s": 1}, {}, "min_reports_floor"),
    ({}, {"min_lambda_star": 1e6}, "min_lambda_star"),
    ({}, {"min_reports_floor": 150}, "min_reports_floor"),
    ({}, {"max_study_bytes": 10_000}, "max_study_bytes"),
    ({}, {"max_floor_epsilon": 2.0}, "max_floor_epsilon"),  # own noise alone: floor epsilon ~2.6
    ({"epsilon": 5.0}, {"max_floor_epsilon": 4.0}, "max_floor_epsilon"),  # ~14, no server noise
    ({}, {"max_study_memory": 700, "memory_budget": 700}, "max_study_memory"),  # needs 8*8*(3+8) = 704
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


def test_memory_budget_counts_what_reports_touch(tmp_path: Path):
    """The running totals are charged as reports arrive, not as declared (issue 41): a report
    adds into s rows of the k x width aggregate and of k x k S S^T (8 (width + k) bytes a row),
    so n reports count 8 min(k, s n) (width + k) bytes, plus 95 a report of index
    (services/state.py INDEX_BYTES_PER_REPORT). An empty study counts nothing, so studies the
    analyst opens and never fills lock no memory; reports past the budget are refused."""
    from dpsketch.services.state import INDEX_BYTES_PER_REPORT

    assert INDEX_BYTES_PER_REPORT == 95
    srv = Server(tmp_path / "s1.sqlite3", max_study_memory=704, memory_budget=900)
    try:
        first, second = make_study(name="first"), make_study(name="second")
        assert srv.provision(first).status_code == 201
        assert srv.provision(second).status_code == 201  # empty: counts nothing (declared 704)
        rs = srv.reports(first, 4)
        # k = 8, s = 2, width 3: 8 * min(8, 6) * 11 + 3 * 95 = 813
        assert srv.batch(first, rs[:3]).json()["report_count"] == 3
        assert_problem(srv.batch(first, rs[3:]), 409, "capacity-exceeded")  # 704 + 380 = 1084 > 900
        assert srv.batch(first, rs[:3]).json()["duplicates"] == 3  # retries cost nothing
        # the second study's first report would add 8 * 2 * 11 + 95 = 271: refused
        assert_problem(srv.batch(second, srv.reports(second, 1)), 409, "capacity-exceeded")
        assert srv.count(first) == 3 and srv.count(second) == 0
        assert srv.app.state.store.memory_in_use() == 813
    finally:
        srv.close()


def test_memory_budget_help_names_the_bytes_counted_per_report():
    """``dpsketch server --help`` says what the budget counts per held report: the figure the
    store charges (it said 160, the former dict index's cost, while the store charged 80)."""
    from dpsketch.services.__main__ import build_parser
    from dpsketch.services.state import INDEX_BYTES_PER_REPORT

    action = next(a for a in build_parser()._actions if "--memory-budget" in a.option_strings)
    assert f"about {INDEX_BYTES_PER_REPORT} bytes per held report" in action.help


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
    from dpsketch.services.options import byte_size

    assert byte_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "lots", "-5M", "0", "1e30"])
def test_max_study_bytes_flag_refuses_what_is_not_a_size(text):
    from dpsketch.services.options import byte_size

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
        # an operator-only endpoint: tells the roles apart (the analyst may provision since dpsketch/2)
        tokens = lambda tok: client.get(f"{url}/upload-tokens", headers=bearer(tok))  # noqa: E731
        assert put("op-one-0123456789").status_code == 201
        assert put("op-two-0123456789").status_code == 200
        assert put("an-one-0123456789").status_code == 200  # formerly 403: analysts may provision
        assert tokens("op-one-0123456789").status_code == 200
        assert_problem(tokens("an-one-0123456789"), 403, "forbidden")
        assert client.get(f"{url}/report-ids", headers=bearer("an-one-0123456789")).status_code == 200
        assert_problem(client.get(f"{url}/report-ids", headers=bearer("op-one-0123456789")), 403, "forbidden")

        write_tokens(path, ["op-three-0123456789"], [digest_text("an-two-0123456789")])
        assert_problem(put("op-one-0123456789"), 401, "unauthorized")
        assert_problem(tokens("op-one-0123456789"), 401, "unauthorized")
        assert put("op-three-0123456789").status_code == 200
        assert tokens("op-three-0123456789").status_code == 200
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
        # the file's analyst token is an analyst's: it may provision (formerly 403), not list tokens
        assert client.put(f"/v1/studies/{st.study_id}", content=st.canonical(),
                          headers=bearer("an-file-0123456789")).status_code == 200
        for tok in (AN, "an-file-0123456789"):
            assert_problem(client.get(f"/v1/studies/{st.study_id}/upload-tokens", headers=bearer(tok)),
                           403, "forbidden")
        for tok in (OP, "op-file-0123456789"):
            assert client.get(f"/v1/studies/{st.study_id}/upload-tokens", headers=bearer(tok)).status_code == 200
    finally:
        client.__exit__(None, None, None)


def test_reload_request_rereads_an_unchanged_looking_file(tmp_path: Path):
    """What SIGHUP does: re-read even when the file's stat did not change."""
    from dpsketch.services.auth import TokenRegistry, digest_of

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
                         headers={"Authorization": f"Bearer {token}"}, timeout=60).status_code

    assert httpx.get(f"{proc.url}/v1/info").json()["policy"]["max_epsilon"] == 5.0
    def tokens(token: str) -> int:  # operator only
        return httpx.get(f"{proc.url}/v1/studies/{st.study_id}/upload-tokens",
                         headers={"Authorization": f"Bearer {token}"}).status_code

    assert put("op-file-one-0123456789") == 201
    assert put(spec.operator_token) == 200  # the environment's token still works
    assert put("an-file-one-0123456789") == 200  # formerly 403: an analyst may provision
    assert tokens("an-file-one-0123456789") == 403 and tokens("op-file-one-0123456789") == 200
    write_tokens(path, ["op-file-two-0123456789"], ["an-file-two-0123456789"])
    assert put("op-file-one-0123456789") == 401
    assert put("op-file-two-0123456789") == 200
    # SIGHUP re-reads the file (and does not stop the server, as SIGHUP's default would)
    write_tokens(path, ["op-file-3-0123456789"], ["an-file-two-0123456789"])
    os.kill(proc.proc.pid, signal.SIGHUP)
    time.sleep(0.2)
    assert put("op-file-3-0123456789") == 200
    assert put("op-file-two-0123456789") == 401
    assert tokens("op-file-3-0123456789") == 200 and tokens("op-file-two-0123456789") == 401
    assert httpx.get(f"{proc.url}/healthz").status_code == 200


# --- 3. per-study upload tokens ----------------------------------------------------------------


def test_upload_tokens(tmp_path: Path):
    """Issued by the operator only (the analyst gets 403), stored as digests, each good for its
    quota of new reports (one by default) across requests and restarts; retries cost nothing."""
    db = tmp_path / "s1.sqlite3"
    srv = Server(db)  # upload_auth="open": a study takes uploads without a token until its first
    st = make_study()
    try:
        assert srv.provision(st).status_code == 201
        rs = srv.reports(st, 6)
        assert srv.upload(st, rs[0]).status_code == 200  # no tokens yet: open
        url = f"/v1/studies/{st.study_id}/upload-tokens"
        post = srv.client.post
        assert_problem(post(url), 401, "unauthorized")
        assert_problem(post(url, headers=bearer(AN)), 403, "forbidden")  # the analyst cannot mint them
        assert_problem(post(url, json={"quota": None}, headers=bearer(AN)), 403, "forbidden")
        assert_problem(post("/v1/studies/" + "0" * 64 + "/upload-tokens", headers=bearer(OP)),
                       404, "unknown-study")
        for bad in ({"count": 0}, {"quota": 0}, {"count": 1, "x": 1}, {"quota": -1}):
            assert_problem(post(url, json=bad, headers=bearer(OP)), 422, "invalid-request")
        r = post(url, headers=bearer(OP))
        assert r.status_code == 201 and r.json()["upload_tokens"] == 1
        assert r.json()["quota"] == 1 and r.json()["tokens"] == [r.json()["token"]]  # one report by default
        assert r.headers["cache-control"] == "no-store"
        token = r.json()["token"]
        r2 = post(url, headers=bearer(OP))
        token2 = r2.json()["token"]
        assert r2.json()["upload_tokens"] == 2 and token2 != token

        r = srv.upload(st, rs[1])
        assert_problem(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
        assert_problem(srv.upload(st, rs[1], token=OP), 401, "unauthorized")
        assert srv.upload(st, rs[1], token=token).json() == {"accepted": 1, "duplicates": 0, "report_count": 2}
        assert srv.upload(st, rs[1], token=token).json()["duplicates"] == 1  # a retry costs nothing
        # the quota holds across requests: a second new report with the same token is refused
        body = assert_problem(srv.upload(st, rs[2], token=token), 403, "upload-quota-exceeded")
        assert "0 more" in body["detail"]
        assert_problem(srv.batch(st, rs[2:]), 401, "unauthorized")
        # a batch with more new reports than the token's quota is refused whole
        assert_problem(srv.batch(st, rs[2:4], token=token2), 403, "upload-quota-exceeded")
        assert srv.count(st) == 2
        r = srv.batch(st, rs[2:3], token=token2)
        assert r.status_code == 200 and r.json()["report_count"] == 3
        assert_problem(srv.batch(st, rs[3:4], token=token2), 403, "upload-quota-exceeded")
        # a data owner with m rows gets quota m; quota null: no limit
        r = post(url, json={"count": 2, "quota": 2}, headers=bearer(OP))
        assert r.status_code == 201, r.text
        assert r.json()["quota"] == 2 and len(r.json()["tokens"]) == 2 and r.json()["upload_tokens"] == 4
        t3, t4 = r.json()["tokens"]
        assert r.json()["token_ids"] == [hashlib.sha256(t.encode()).digest()[:8].hex() for t in (t3, t4)]
        assert srv.batch(st, rs[3:5], token=t3).json()["accepted"] == 2
        assert_problem(srv.upload(st, rs[5], token=t3), 403, "upload-quota-exceeded")
        assert srv.upload(st, rs[5], token=t4).status_code == 200  # t4: 1 of 2 used
        r = post(url, json={"quota": None}, headers=bearer(OP))
        assert r.status_code == 201 and r.json()["quota"] is None
        unlimited = r.json()["token"]
        assert srv.batch(st, srv.reports(st, 30), token=unlimited).json()["accepted"] == 30
        assert srv.count(st) == 36
        with sqlite3.connect(db) as conn:  # only digests are stored, with their quotas and use
            stored = {bytes(d): (q, u) for d, q, u in conn.execute("SELECT digest, quota, used FROM upload_tokens")}
        assert len(stored) == 5 and all(t.encode() not in d for d in stored for t in (token, t3, unlimited))
        assert sorted(stored.values(), key=str) == sorted([(1, 1), (1, 1), (2, 2), (2, 1), (None, 30)], key=str)
    finally:
        srv.close()
    srv = Server(db)  # the tokens and what they used survive a restart
    try:
        new = srv.reports(st, 4)
        assert_problem(srv.upload(st, new[0]), 401, "unauthorized")
        for used_up in (token, token2, t3):
            assert_problem(srv.upload(st, new[0], token=used_up), 403, "upload-quota-exceeded")
        assert srv.upload(st, rs[5], token=t3).json()["duplicates"] == 1  # retries still cost nothing
        assert_problem(srv.batch(st, new[:2], token=t4), 403, "upload-quota-exceeded")  # 1 left
        assert srv.upload(st, new[0], token=t4).json()["accepted"] == 1
        assert_problem(srv.upload(st, new[1], token=t4), 403, "upload-quota-exceeded")
        assert srv.batch(st, new[1:], token=unlimited).json()["accepted"] == 3
        assert srv.count(st) == 40
        other = make_study(name="open")  # other studies stay open
        assert srv.provision(other).status_code == 201
        assert srv.upload(other, srv.reports(other, 1)).status_code == 200
    finally:
        srv.close()


def test_upload_auth_tokens_needs_a_token_from_the_start(tmp_path: Path):
    """The default policy (upload_auth="tokens"): a new study takes no upload without a token."""
    srv = Server(tmp_path / "s1.sqlite3", upload_auth="tokens")
    try:
        st = make_study()
        assert srv.provision(st).status_code == 201
        rs = srv.reports(st, 2)
        assert_problem(srv.upload(st, rs[0]), 401, "unauthorized")
        assert_problem(srv.batch(st, rs), 401, "unauthorized")
        token = srv.client.post(f"/v1/studies/{st.study_id}/upload-tokens", headers=bearer(OP)).json()["token"]
        assert srv.upload(st, rs[0], token=token).status_code == 200
        assert_problem(srv.upload(st, rs[1], token=token), 403, "upload-quota-exceeded")
        assert srv.count(st) == 1
    finally:
        srv.close()


# --- 4. retention ------------------------------------------------------------------------------


def fill_and_commit(srv: Server, n: int = 200):
    st = make_study()
    assert srv.provision(st).status_code == 201
    rs = srv.reports(st, n)
    ids = rs.ids
    assert srv.batch(st, rs).status_code == 200
    r = srv.commit(st, ids[:-10])  # leaves out 10 of 200: within the batch rule
    assert r.status_code == 200, r.text
    return st, ids


def share_lengths(db: Path | str) -> list[int]:
    """The stored length of every share, read from the database itself (SQLite or PostgreSQL)."""
    if isinstance(db, str):
        import psycopg

        with psycopg.connect(db) as conn:
            rows = conn.execute("SELECT m, length(shares) FROM batches").fetchall()
    else:
        with sqlite3.connect(db) as conn:
            rows = conn.execute("SELECT m, length(shares) FROM batches").fetchall()
    return [n // m for m, n in rows for _ in range(m)]  # a batch's shares are of one width


@BOTH_STORES
def test_delete_shares_keeps_aggregate_commit_and_ids(store_location):
    db = store_location("s1")
    srv = Server(db)
    try:
        st = make_study()
        assert srv.provision(st).status_code == 201
        url = f"/v1/studies/{st.study_id}/shares"
        assert_problem(srv.client.delete(url, headers=bearer(OP)), 409, "study-open")
        srv.close()
        db = store_location("s2")
        srv = Server(db)
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


@BOTH_STORES
def test_retention_setting_deletes_shares_after_commit(store_location):
    db = store_location("s1")
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
