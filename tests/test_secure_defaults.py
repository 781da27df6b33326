"""Secure by default (issue 41, docs/trust.md "Secure defaults"):

* the SDK refuses to send an upload token over plain http to a host other than this machine's
  loopback unless told to (``allow_insecure_http``, ``dpsketch submit --allow-insecure-http``);
* a share server's and the analyzer's database files are created owner-only (0600, their WAL
  and SHM files too), real processes;
* the secret sign of a signed study (docs/secret_sign.md) is fresh and independent of the report
  ids and of the report's place: its floor rests on it (the issue: epsilon 9.90 instead of 4 if
  the sign were known). Thousands of reports the SDK sent to real servers are reconstructed from
  the shares it prepared, and their signs tested: balanced, uncorrelated with every bit of the
  report id, with the place in the batch, the batch, the neighbour, and with the sign the same
  row got when it was submitted again. Each bound is 5 standard deviations of the statistic
  under independence (a false alarm about once in 10^5 runs of the test).
"""

from __future__ import annotations

import math
import os
import stat

import numpy as np
import pytest

from dpsketch.client_sdk import Client, SDKError
from dpsketch.client_sdk import cli as submit_cli
from dpsketch.protocol import design, ring

from conftest import Cluster
from studies import record_batches


@pytest.mark.parametrize("url,refused", [
    ("http://10.1.2.3:8101", True), ("http://s1.example.org", True), ("http://s1:8101", True),
    ("http://127.0.0.1:8101", False), ("http://127.9.9.9:8101", False), ("http://localhost:8101", False),
    ("http://[::1]:8101", False), ("https://s1.example.org", False)])
def test_the_sdk_refuses_a_token_over_plain_http_to_another_host(url, refused):
    urls = [url, "https://s2.example.org"]
    if refused:
        with pytest.raises(SDKError, match="plain http") as err:
            Client(urls, token="up-secret")
        assert "up-secret" not in str(err.value) and "allow_insecure_http=True" in str(err.value)
        Client(urls, token="up-secret", allow_insecure_http=True).close()  # told to: it does
    else:
        Client(urls, token="up-secret").close()
    Client(urls).close()  # no token, nothing to leak


def test_dpsketch_submit_refuses_a_token_over_plain_http(tmp_path, capsys):
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n0.1,0.2\n")
    code = submit_cli.main(["--study", "0" * 64, "--servers", "http://10.1.2.3:8101,http://10.1.2.4:8101",
                            "--token", "up-secret", "--quiet", str(csv)])
    err = capsys.readouterr().err
    assert code != 0 and "plain http" in err and "--allow-insecure-http" in err and "up-secret" not in err


def test_database_files_are_created_owner_only(servers):
    old = os.umask(0o022)  # the usual umask: files would be 0644
    try:
        c = Cluster(servers, 2, api_token="analyst-api-token")
    finally:
        os.umask(old)
    paths = [s.db_path for s in c.specs] + [servers.workdir / "analyzer.sqlite3"]
    modes = {}
    for path in paths:
        for suffix in ("", "-wal", "-shm"):
            p = type(path)(str(path) + suffix)
            if p.exists():
                modes[p.name] = stat.S_IMODE(p.stat().st_mode)
    print(f"\ndatabase file modes: { {k: oct(v) for k, v in modes.items()} }")
    assert {"s1.sqlite3", "s2.sqlite3", "analyzer.sqlite3"} <= set(modes)
    assert all(mode == 0o600 for mode in modes.values()), modes


def _z(total: float, n: int) -> float:
    """A sum of n independent +-1 as a number of standard deviations."""
    return abs(total) / math.sqrt(n)


def test_the_secret_sign_is_fresh_and_independent_of_ids_and_position(servers, monkeypatch):
    c = Cluster(servers, 2, api_token="analyst-api-token")
    study = design(name="signs", columns=["a", "b", "c", "d"], label=None, servers=["s1", "s2"],
                   expected_reports=100_000, seed=f"{5:064x}", k=20)[0]  # small client noise: sigma 0.04
    # (k = 20: the signed default k at this n is 100, whose client noise, 0.086, would blur the
    # two clusters this test reads every sign from; the sign's law does not depend on k)
    assert study.secret_sign
    import httpx

    for p, spec in zip(c.procs, c.specs):
        r = httpx.put(f"{p.url}/v1/studies/{study.study_id}", content=study.canonical(), timeout=60,
                      headers={"Authorization": f"Bearer {spec.analyst_token}", "Content-Type": "application/json"})
        assert r.status_code == 201, r.text
    row = np.array([0.3, -0.2, 0.25, 0.1])  # the same row for every report: only the sign differs
    m, batch = 4000, 500
    sent = record_batches(monkeypatch)
    with Client(c.server_urls, journal=False) as client:  # no journal: the same rows twice are new reports
        client.submit_many(study.study_id, np.tile(row, (m, 1)), batch_size=batch)
        first = len(sent)
        client.submit_many(study.study_id, np.tile(row, (m, 1)), batch_size=batch)  # the same rows again

    def reconstruct(batches):
        ids = [rid for b in batches for rid in b.report_ids]
        encoded = np.vstack([ring.reconstruct([b.share(j) for j in range(2)]) for b in batches])
        place = np.concatenate([np.arange(len(b)) for b in batches])
        which = np.concatenate([np.full(len(b), k) for k, b in enumerate(batches)])
        return ids, ring.decode(encoded, study.frac_bits), place, which

    ids, values, place, which = reconstruct(sent[:first])
    ids2, values2, _, _ = reconstruct(sent[first:])
    assert len(ids) == len(ids2) == m and len(set(ids) | set(ids2)) == 2 * m
    # every report is t * mapped(row) + noise, the same mapped row for all: the leading
    # eigenvector of the reports' second moments is +-mapped(row) (read without knowing the
    # mapping), and each report's sign along it is its t (up to one global flip)
    direction = np.linalg.eigh(values.T @ values)[1][:, -1]
    dots, dots2 = values @ direction, values2 @ direction
    separation = float(np.mean(np.abs(dots)) / np.std(np.abs(dots)))
    assert separation > 6, separation  # two clusters far apart: every sign is read right
    s, s2 = np.sign(dots), np.sign(dots2)
    bits = np.unpackbits(np.frombuffer(b"".join(ids), dtype=np.uint8).reshape(m, 16), axis=1).astype(float) * 2 - 1
    stats = {
        "balance": _z(s.sum(), m),
        "worst id bit": max(_z(float(bits[:, b] @ s), m) for b in range(128)),
        "place parity": _z(float(((place % 2) * 2 - 1) @ s), m),
        "first half of a batch": _z(float(((place < batch // 2) * 2 - 1) @ s), m),
        "batch parity": _z(float(((which % 2) * 2 - 1) @ s), m),
        "neighbour": _z(float(s[1:] @ s[:-1]), m - 1),
        "resubmitted row": _z(float(s @ s2), m),
    }
    print(f"\nsecret sign, clusters {separation:.1f} sd apart; |z| of each statistic (5 = the bound): "
          + ", ".join(f"{k} {v:.2f}" for k, v in stats.items()))
    assert all(v < 5 for v in stats.values()), stats
