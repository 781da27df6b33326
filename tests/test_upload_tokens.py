"""Per-study upload tokens: quotas, listing and revocation (docs/protocol.md section 6,
docs/trust.md), in process and end to end through the SDK and the `dpsketch submit` command
against real share servers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.client_sdk import cli as submit_cli
from dpsketch.protocol import ProblemError

from test_e2e import COLUMNS
from test_server_unit import AN, OP, Server, assert_problem, bearer, make_study


def _token_id(token: str) -> str:
    return hashlib.sha256(token.encode()).digest()[:8].hex()


def test_list_and_revoke_upload_tokens(tmp_path: Path):
    db = tmp_path / "s1.sqlite3"
    srv = Server(db)  # upload_auth="open": tokens are required from a study's first one on
    st = make_study()
    base = f"/v1/studies/{st.study_id}/upload-tokens"
    try:
        assert srv.provision(st).status_code == 201
        # access: operator only; unknown study 404
        assert_problem(srv.client.get(base), 401, "unauthorized")
        assert_problem(srv.client.get(base, headers=bearer(AN)), 403, "forbidden")
        assert_problem(srv.client.post(base, headers=bearer(AN)), 403, "forbidden")  # cannot mint
        assert_problem(srv.client.delete(f"{base}/{'0' * 16}", headers=bearer(AN)), 403, "forbidden")
        assert_problem(srv.client.get("/v1/studies/" + "0" * 64 + "/upload-tokens", headers=bearer(OP)),
                       404, "unknown-study")
        listing = srv.client.get(base, headers=bearer(OP)).json()
        assert listing == {"study_id": st.study_id, "required": False, "active": 0, "tokens": []}

        issued = [srv.client.post(base, headers=bearer(OP)).json() for _ in range(2)]
        t1, t2 = (i["token"] for i in issued)
        assert [i["token_id"] for i in issued] == [_token_id(t1), _token_id(t2)]
        r = srv.client.get(base, headers=bearer(OP))
        assert r.status_code == 200, r.text
        listing = r.json()
        assert listing["required"] is True and listing["active"] == 2
        assert [t["token_id"] for t in listing["tokens"]] == [_token_id(t1), _token_id(t2)]
        assert all(t["revoked_at"] is None and t["created_at"] > 0 for t in listing["tokens"])
        assert [(t["quota"], t["used"]) for t in listing["tokens"]] == [(1, 0), (1, 0)]  # one report each
        assert t1 not in r.text and t2 not in r.text  # never the secret
        assert hashlib.sha256(t1.encode()).hexdigest() not in r.text  # nor a whole digest

        rs = srv.reports(st, 4)
        assert srv.upload(st, rs[0], token=t1).status_code == 200
        used = {t["token_id"]: t["used"] for t in srv.client.get(base, headers=bearer(OP)).json()["tokens"]}
        assert used == {_token_id(t1): 1, _token_id(t2): 0}
        r = srv.client.delete(f"{base}/{_token_id(t1)}", headers=bearer(OP))
        assert r.status_code == 200, r.text
        after = r.json()
        assert after["active"] == 1 and after["required"] is True
        revoked = {t["token_id"]: t["revoked_at"] for t in after["tokens"]}
        assert revoked[_token_id(t1)] is not None and revoked[_token_id(t2)] is None
        # refused at once; the other token still works
        assert_problem(srv.upload(st, rs[1], token=t1), 401, "unauthorized")
        assert srv.upload(st, rs[1], token=t2).status_code == 200
        # idempotent; an id the study never had is 404 and changes nothing
        again = srv.client.delete(f"{base}/{_token_id(t1)}", headers=bearer(OP)).json()
        # the same answer, but for the report t2 added since
        assert again == after | {"tokens": [t | {"used": 1} if t["token_id"] == _token_id(t2) else t
                                            for t in after["tokens"]]}
        assert_problem(srv.client.delete(f"{base}/{'f' * 16}", headers=bearer(OP)), 404, "not-found")
        assert_problem(srv.client.delete(f"{base}/not-hex", headers=bearer(OP)), 404, "not-found")
        # revoking the last token does not reopen the study
        srv.client.delete(f"{base}/{_token_id(t2)}", headers=bearer(OP))
        assert_problem(srv.upload(st, rs[2]), 401, "unauthorized")
        assert_problem(srv.upload(st, rs[2], token=t2), 401, "unauthorized")
        assert srv.client.get(f"/v1/studies/{st.study_id}").json()["report_count"] == 2
    finally:
        srv.close()
    srv = Server(db)  # revocations, and what each token used, are durable
    try:
        listing = srv.client.get(base, headers=bearer(OP)).json()
        assert listing["required"] is True and listing["active"] == 0 and len(listing["tokens"]) == 2
        assert [(t["quota"], t["used"]) for t in listing["tokens"]] == [(1, 1), (1, 1)]
        assert_problem(srv.upload(st, rs[2], token=t1), 401, "unauthorized")
        assert_problem(srv.upload(st, rs[2]), 401, "unauthorized")
        t3 = srv.client.post(base, headers=bearer(OP)).json()["token"]
        assert srv.upload(st, rs[2], token=t3).status_code == 200
    finally:
        srv.close()


def test_quota_holds_across_requests_and_restarts(tmp_path: Path):
    """A token good for m reports adds m new reports, in as many requests as its holder likes,
    and not one more, before or after a restart; retries of stored reports cost nothing."""
    db = tmp_path / "s1.sqlite3"
    srv = Server(db, upload_auth="tokens")
    st = make_study()
    base = f"/v1/studies/{st.study_id}/upload-tokens"
    try:
        assert srv.provision(st).status_code == 201
        r = srv.client.post(base, json={"quota": 5}, headers=bearer(OP))
        assert r.status_code == 201 and r.json()["quota"] == 5, r.text
        token, tid = r.json()["token"], r.json()["token_id"]
        rs = srv.reports(st, 8)
        assert srv.batch(st, rs[:2], token=token).json()["accepted"] == 2
        assert srv.upload(st, rs[2], token=token).json()["accepted"] == 1
        assert srv.batch(st, rs[:3], token=token).json() == {"accepted": 0, "duplicates": 3, "report_count": 3}
        # 2 left: a request with 3 new reports is refused whole, then 2 go through
        assert_problem(srv.batch(st, rs[3:6], token=token), 403, "upload-quota-exceeded")
        assert srv.count(st) == 3
        assert srv.batch(st, rs[2:5], token=token).json() == {"accepted": 2, "duplicates": 1, "report_count": 5}
        assert_problem(srv.upload(st, rs[5], token=token), 403, "upload-quota-exceeded")
        listing = srv.client.get(base, headers=bearer(OP))
        assert listing.status_code == 200, listing.text
        assert [(t["token_id"], t["quota"], t["used"]) for t in listing.json()["tokens"]] == [(tid, 5, 5)]
    finally:
        srv.close()
    srv = Server(db, upload_auth="tokens")
    try:
        assert_problem(srv.upload(st, rs[5], token=token), 403, "upload-quota-exceeded")
        assert srv.batch(st, rs[:5], token=token).json()["duplicates"] == 5
        listing = srv.client.get(base, headers=bearer(OP))
        assert listing.status_code == 200, listing.text
        assert [(t["quota"], t["used"]) for t in listing.json()["tokens"]] == [(5, 5)]
        assert srv.count(st) == 5
    finally:
        srv.close()


def test_sdk_and_cli_with_upload_tokens_then_revoked(live_cluster, tmp_path: Path):
    """A study that requires upload tokens, through the SDK over real servers: refused without
    a token, accepted with each server's token up to its quota, refused beyond it, and refused
    again once the tokens are revoked."""
    c = live_cluster
    n = 200
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        sid = an.create_study(name="tokens", columns=COLUMNS, label="y", expected_reports=n,
                              k=8, s=2, min_reports=n)["study_id"]
    quota = 161  # the rows this data owner will send: 151 through the SDK, 10 through the CLI
    tokens, token_ids = [], []
    for spec, url in zip(c.specs, c.server_urls):
        r = httpx.post(f"{url}/v1/studies/{sid}/upload-tokens", json={"quota": quota},
                       headers={"Authorization": f"Bearer {spec.operator_token}"})
        assert r.status_code == 201, r.text
        assert r.json()["quota"] == quota
        tokens.append(r.json()["token"])
        token_ids.append(r.json()["token_id"])
    # the analyzer's (analyst) token cannot issue upload tokens on any server
    for spec, url in zip(c.specs, c.server_urls):
        r = httpx.post(f"{url}/v1/studies/{sid}/upload-tokens",
                       headers={"Authorization": f"Bearer {spec.analyst_token}"})
        assert r.status_code == 403 and r.json()["type"] == "urn:dpsketch:problem:forbidden", r.text
    rows = np.random.default_rng(2).normal(0, 0.3, size=(n, len(COLUMNS)))

    def counts() -> list[int]:
        return [httpx.get(f"{u}/v1/studies/{sid}").json()["report_count"] for u in c.server_urls]

    with Client(c.server_urls, max_retries=0) as client:
        with pytest.raises(ProblemError) as err:
            client.submit_many(sid, rows[:10])
        assert err.value.slug == "unauthorized" and err.value.status == 401
        with pytest.raises(ProblemError) as err:
            client.submit(sid, rows[0])
        assert err.value.slug == "unauthorized"
    assert counts() == [0, 0, 0]

    with Client(c.server_urls, token=tokens) as client:
        result = client.submit_many(sid, rows[:150], batch_size=50)
        client.submit(sid, rows[150])
    assert result.n_reports == 150 and counts() == [151] * 3
    # the command line: one token per server, comma-separated, sealed shares for good measure
    csv = tmp_path / "rows.csv"
    csv.write_text(",".join(COLUMNS) + "\n" + "\n".join(",".join(f"{v:.6f}" for v in r) for r in rows[151:161]))
    argv = ["--study", sid, "--servers", ",".join(c.server_urls), "--quiet", str(csv)]
    assert submit_cli.main(argv) != 0  # no token
    assert submit_cli.main(argv + ["--token", ",".join(tokens[:2])]) != 0  # one per server, or one
    assert counts() == [151] * 3
    assert submit_cli.main(argv + ["--token", ",".join(tokens), "--encrypt"]) == 0
    assert counts() == [161] * 3
    # the quota is used up on every server: one more row is refused everywhere, nothing stored
    with Client(c.server_urls, token=tokens, max_retries=0) as client:
        with pytest.raises(ProblemError) as err:
            client.submit_many(sid, rows[161:162])
        assert err.value.slug == "upload-quota-exceeded" and err.value.status == 403
    assert counts() == [161] * 3

    for spec, url, tid in zip(c.specs, c.server_urls, token_ids):
        r = httpx.delete(f"{url}/v1/studies/{sid}/upload-tokens/{tid}",
                         headers={"Authorization": f"Bearer {spec.operator_token}"})
        assert r.status_code == 200 and r.json()["active"] == 0, r.text
        assert [(t["quota"], t["used"]) for t in r.json()["tokens"]] == [(quota, quota)]
    with Client(c.server_urls, token=tokens, max_retries=0) as client:
        with pytest.raises(ProblemError) as err:
            client.submit_many(sid, rows[161:])
        assert err.value.slug == "unauthorized" and err.value.status == 401
    assert counts() == [161] * 3
