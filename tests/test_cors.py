"""Browser pages on other origins (CORS, services/settings.py ``cors_origins``), over a real
server process: a data owner's page served from its own origin calls the share servers directly
once their operator lists that origin (the TypeScript client's browser test submits through it:
tests/test_ts_client.py). Without the setting a server answers no page on another origin; a
preflight from an origin it does not list is refused in the problem format and changes nothing."""

from __future__ import annotations

import httpx

PAGE = "https://survey.example.org"


def _preflight(url: str, origin: str, method: str = "POST", headers: str = "authorization,content-type"):
    return httpx.options(f"{url}/v1/info", headers={"Origin": origin, "Access-Control-Request-Method": method,
                                                      "Access-Control-Request-Headers": headers})


def test_listed_origin_is_answered_and_others_refused(servers):
    proc = servers.start(servers.spec("s1"), {"DPSKETCH_CORS_ORIGINS": f"{PAGE}, http://127.0.0.1:9"})
    info = httpx.get(f"{proc.url}/v1/info", headers={"Origin": PAGE})
    assert info.status_code == 200 and info.headers["access-control-allow-origin"] == PAGE
    assert info.json()["policy"]["cors_origins"] == [PAGE, "http://127.0.0.1:9"]
    ok = _preflight(proc.url, PAGE)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == PAGE
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in ok.headers["access-control-allow-methods"].split(",")} | {
        h.strip().lower() for h in ok.headers["access-control-allow-headers"].split(",")}
    assert "access-control-allow-credentials" not in ok.headers  # bearer tokens only, no cookies
    for origin, method, hdrs in (("https://evil.example", "POST", "content-type"),
                                 (PAGE, "PATCH", "content-type"), (PAGE, "POST", "x-forwarded-for")):
        refused = _preflight(proc.url, origin, method, hdrs)
        assert refused.status_code == 403, (origin, method, hdrs)
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["type"] == "urn:dpsketch:problem:origin-not-allowed"
    other = httpx.get(f"{proc.url}/v1/info", headers={"Origin": "https://evil.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    # errors carry the header too, so a page can read why it was refused
    missing = httpx.get(f"{proc.url}/v1/studies/{'0' * 64}", headers={"Origin": PAGE})
    assert missing.status_code == 404 and missing.headers["access-control-allow-origin"] == PAGE


def test_no_origin_is_allowed_by_default(servers):
    proc = servers.start(servers.spec("s2"))
    info = httpx.get(f"{proc.url}/v1/info", headers={"Origin": PAGE})
    assert info.status_code == 200 and "access-control-allow-origin" not in info.headers
    assert info.json()["policy"]["cors_origins"] == []
    refused = _preflight(proc.url, PAGE)
    assert refused.status_code == 405 and "access-control-allow-origin" not in refused.headers
    assert refused.headers["content-type"] == "application/problem+json"


def test_a_malformed_origin_setting_stops_the_server_with_a_clear_error(servers, tmp_path):
    import subprocess
    import sys

    spec = servers.spec("s3")
    r = subprocess.run([sys.executable, "-m", "dpsketch.services", "--server-id", "s3", "--db", str(spec.db_path),
                        "--port", "0", "--cors-origins", "survey.example.org/form"],
                       env={"PATH": "/usr/bin:/bin", "DPSKETCH_OPERATOR_TOKEN": spec.operator_token,
                            "DPSKETCH_ANALYST_TOKEN": spec.analyst_token},
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0
    assert "CORS origin 'survey.example.org/form' is not an origin" in (r.stderr + r.stdout)


def test_a_client_ignores_policy_members_of_any_type():
    """A newer server's policy member of a type an older client did not expect (the list of
    cors_origins was one) must not make the client refuse the server."""
    from dpsketch.protocol.messages import ServerInfo

    info = ServerInfo.model_validate({"server_id": "s1", "protocol": "dpsketch/2", "version": "9.9",
                                      "policy": {"cors_origins": ["*"], "future": {"a": [1, None, "x"]}}})
    assert info.policy["cors_origins"] == ["*"]
