"""TLS end to end: 3 share servers + the analyzer as real HTTPS processes on loopback.

Certificates come from deploy/make-certs.py, run as an operator would. The analyzer verifies the
servers against the cluster config's ca_file, the SDK and the analyzer client against an SSL
context for ca.pem. A server whose certificate another CA signed is refused before any share
leaves the client, and plain HTTP to an HTTPS port gets no answer.
"""

from __future__ import annotations

import json
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.client_sdk.errors import ServerUnreachable
from dpsketch.tools.cluster import analyzer, share_server, start_all

MAKE_CERTS = Path(__file__).resolve().parents[1] / "deploy" / "make-certs.py"
COLUMNS = ["x0", "x1", "x2", "x3", "y"]
API_TOKEN = "analyst-api-token"


def make_certs(outdir: Path, hosts: str) -> Path:
    subprocess.run([sys.executable, str(MAKE_CERTS), str(outdir), "--hosts", hosts],
                   check=True, capture_output=True, timeout=60)
    return outdir


class TLSCluster:
    def __init__(self, pool, certs: Path):
        from conftest import OPEN_UPLOADS

        from test_e2e import NO_FLOOR_POLICY

        self.certs = certs
        self.ca = certs / "ca.pem"
        self.specs = [pool.spec(f"s{j + 1}") for j in range(3)]
        # uploads without tokens (this is not about upload auth), and studies without server
        # noise accepted (the end-to-end study's accuracy check is calibrated for one)
        env = {**OPEN_UPLOADS, **NO_FLOOR_POLICY}
        self.procs = [
            share_server(s, pool.workdir, env, scheme="https", certfile=certs / f"{s.server_id}.pem",
                         keyfile=certs / f"{s.server_id}-key.pem", ca_file=self.ca)
            for s in self.specs
        ]
        pool.started.extend(self.procs)
        start_all(self.procs)
        config = {  # analyst tokens only, as an operator should configure an analyzer
            "servers": [{"server_id": s.server_id, "url": p.url, "analyst_token": s.analyst_token}
                        for s, p in zip(self.specs, self.procs)],
            "api_token": API_TOKEN,
            "ca_file": str(self.ca),
        }
        path = pool.workdir / "cluster.json"
        path.write_text(json.dumps(config))
        self.analyzer = analyzer(path, pool.workdir / "analyzer.sqlite3", pool.workdir,
                                 scheme="https", certfile=certs / "analyzer.pem",
                                 keyfile=certs / "analyzer-key.pem", ca_file=self.ca).start()
        # stopped first: a share server's graceful TLS shutdown otherwise waits for the
        # close_notify of the analyzer's idle keep-alive connections, up to --graceful-timeout
        # (tests/test_shutdown.py)
        pool.started.insert(0, self.analyzer)

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))

    @property
    def server_urls(self) -> list[str]:
        return [p.url for p in self.procs]


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory) -> Iterator[TLSCluster]:
    from conftest import Servers

    certs = make_certs(tmp_path_factory.mktemp("certs"), "s1,s2,s3,analyzer,localhost,127.0.0.1")
    pool = Servers(tmp_path_factory.mktemp("tls-cluster"))
    try:
        yield TLSCluster(pool, certs)
    finally:
        pool.stop_all()


def test_make_certs_files(tls_cluster):
    certs = tls_cluster.certs
    for name in ("ca", "s1", "s2", "s3", "analyzer", "localhost"):
        assert stat.S_IMODE((certs / f"{name}-key.pem").stat().st_mode) == 0o600
        assert (certs / f"{name}.pem").read_text().startswith("-----BEGIN CERTIFICATE-----")
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((certs / "s2.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"s2", "localhost"} <= set(san.get_values_for_type(x509.DNSName))
    assert "127.0.0.1" in {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}


def test_make_certs_key_group(tmp_path):
    """--key-group: service keys 0640 with that group (what the compose overlay's group_add
    reads them through), the CA key still owner-only, nothing world-readable."""
    import os

    gid = 23456 if os.geteuid() == 0 else os.getgid()  # root: a group nobody else is in
    subprocess.run([sys.executable, str(MAKE_CERTS), str(tmp_path), "--hosts", "s1,analyzer",
                    "--key-group", str(gid)], check=True, capture_output=True, timeout=60)
    for name in ("s1", "analyzer"):
        st = (tmp_path / f"{name}-key.pem").stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, gid)
        assert stat.S_IMODE((tmp_path / f"{name}.pem").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "ca-key.pem").stat().st_mode) == 0o600
    # re-run without the option (reusing the CA): the keys go back to owner-only
    subprocess.run([sys.executable, str(MAKE_CERTS), str(tmp_path), "--hosts", "s1"],
                   check=True, capture_output=True, timeout=60)
    assert stat.S_IMODE((tmp_path / "s1-key.pem").stat().st_mode) == 0o600
    bad = subprocess.run([sys.executable, str(MAKE_CERTS), str(tmp_path), "--hosts", "s1",
                          "--key-group", "no-such-group-here"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no group named" in bad.stderr


def test_study_over_https_end_to_end(tls_cluster):
    c = tls_cluster
    assert all(u.startswith("https://") for u in c.server_urls + [c.analyzer.url])
    rng = np.random.default_rng(5)
    n = 20_000
    X = rng.normal(size=(n, 4))
    y = X @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.1 * rng.normal(size=n)
    A = np.column_stack([X, y])
    A /= np.linalg.norm(A, axis=1).max()
    with AnalyzerClient(c.analyzer.url, API_TOKEN, verify=c.context()) as an:
        # the parameters of tests/test_e2e.py::test_sdk_upload_and_analyses_over_rest, whose
        # simulation puts the cosine at 0.972 at the 1st percentile, 0.951 at worst (3,000 runs
        # with the default secret sign; 0.88 and 0.842 over 500 without it)
        created = an.create_study(name="tls", columns=COLUMNS, label="y", expected_reports=n,
                                  epsilon=8.0, k=40, s=4, min_reports=n, epsilon_floor=None)
        sid = created["study_id"]
        with Client(c.server_urls, verify=c.context()) as client:
            result = client.submit_many(sid, A, batch_size=5000)
        assert result.n_reports == n
        fin = an.finalize(sid)
        assert fin["state"] == "released" and fin["n_reports"] == n
        ls = an.least_squares(sid)
    coef = np.array(ls["coef"])
    truth = np.array([1.0, -2.0, 0.5, 0.0])
    assert coef @ truth / (np.linalg.norm(coef) * np.linalg.norm(truth)) > 0.8


def test_sdk_refuses_a_server_signed_by_another_ca_and_sends_nothing(tls_cluster, servers, tmp_path):
    c = tls_cluster
    rogue_certs = make_certs(tmp_path / "rogue", "s1,127.0.0.1")
    rogue = share_server(servers.spec("s1"), servers.workdir, scheme="https",
                         certfile=rogue_certs / "s1.pem", keyfile=rogue_certs / "s1-key.pem",
                         ca_file=rogue_certs / "ca.pem")
    servers.started.append(rogue)
    rogue.start()

    with AnalyzerClient(c.analyzer.url, API_TOKEN, verify=c.context()) as an:
        sid = an.create_study(name="tls-rogue", columns=COLUMNS, label="y", expected_reports=500,
                              k=4, s=2, min_reports=400)["study_id"]
        urls = [rogue.url, *c.server_urls[1:]]
        started = time.monotonic()
        with Client(urls, verify=c.context()) as client:
            with pytest.raises(ServerUnreachable) as err:
                client.submit_many(sid, np.full((50, 5), 0.1))
        assert time.monotonic() - started < 5  # refused at once, not after the retries
        assert err.value.url == rogue.url
        assert "TLS certificate verification failed" in str(err.value)
        assert [s["report_count"] for s in an.progress(sid)["servers"]] == [0, 0, 0]

    # the SDK with the system trust store refuses the cluster's own servers too
    with Client(c.server_urls, verify=True, max_retries=0) as client:
        with pytest.raises(ServerUnreachable, match="TLS certificate verification failed"):
            client.study(sid)


def test_plain_http_to_an_https_port_fails(tls_cluster):
    for proc in [*tls_cluster.procs, tls_cluster.analyzer]:
        plain = proc.url.replace("https://", "http://", 1)
        with pytest.raises(httpx.TransportError):
            httpx.get(plain + "/healthz", timeout=5)
        # ... and the port still serves HTTPS afterwards
        r = httpx.get(proc.url + "/healthz", timeout=5, verify=tls_cluster.context())
        assert r.status_code == 200



def test_submit_cli_ca_file(tls_cluster, tmp_path, capsys):
    from dpsketch.client_sdk.cli import main as submit

    c = tls_cluster
    csv = tmp_path / "rows.csv"
    csv.write_text(",".join(COLUMNS) + "\n" + "".join("0.1,0.2,-0.1,0.0,0.3\n" for _ in range(20)))
    with AnalyzerClient(c.analyzer.url, API_TOKEN, verify=c.context()) as an:
        sid = an.create_study(name="tls-cli", columns=COLUMNS, label="y", expected_reports=500,
                              k=4, s=2, min_reports=400)["study_id"]
        base = ["--study", sid, "--servers", ",".join(c.server_urls), "--quiet", str(csv)]
        assert submit([*base, "--max-retries", "0"]) == 1  # system trust store: refused
        assert "TLS certificate verification failed" in capsys.readouterr().err
        assert submit([*base, "--ca-file", str(c.ca)]) == 0
        assert [s["report_count"] for s in an.progress(sid)["servers"]] == [20, 20, 20]


def test_relay_client_over_https_verifies_the_certificate(tls_cluster):
    """RelayClient's own request (http.client, not httpx: client_sdk/relayed.py) speaks TLS with
    the CA it is given and refuses a certificate it cannot verify before sending anything. A
    share server's relayed route stands in for an https relay: it stores the entry addressed to
    it and refuses the others (422), which is an answer only a completed TLS exchange brings."""
    from dpsketch.client_sdk.relayed import RelayClient, enrol
    from dpsketch.protocol.problems import ProblemError

    c = tls_cluster
    with AnalyzerClient(c.analyzer.url, API_TOKEN, verify=c.context()) as an:
        sid = an.create_study(name="tls-relayed", columns=COLUMNS, label="y", expected_reports=500,
                              k=4, s=2, min_reports=400)["study_id"]
        with Client(c.server_urls, verify=c.context(), encrypt=True) as client:
            enrolment = enrol(client, sid)
        with RelayClient(c.server_urls[0], enrolment, verify=True, max_retries=0) as rc:
            with pytest.raises(ServerUnreachable, match="TLS certificate verification failed"):
                rc.submit(np.full(5, 0.1))
        assert [s["report_count"] for s in an.progress(sid)["servers"]] == [0, 0, 0]
        with RelayClient(c.server_urls[0], enrolment, verify=c.context(), max_retries=0) as rc:
            with pytest.raises(ProblemError) as refused:
                rc.submit(np.full(5, 0.1))
        assert refused.value.status == 422 and refused.value.server_id == "s2"
        assert [s["report_count"] for s in an.progress(sid)["servers"]] == [1, 0, 0]
