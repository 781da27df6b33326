"""A commit's body limit (docs/protocol.md section 6): an inclusion set may be as long as the
study's capacity, whatever the server's general body limit, so a study is not capped at what
--max-body-bytes carries (64 MiB: about 4 x 10^6 ids). Real share servers and the analyzer."""

from __future__ import annotations

import httpx
import numpy as np

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from conftest import Cluster
from dpsketch.protocol.messages import SHARES_MEDIA_TYPE


def test_a_commit_larger_than_the_servers_body_limit_goes_through(servers):
    """Real servers with DPSKETCH_MAX_BODY_BYTES = 16 KiB: uploads over it get 413, while the
    analyzer's finalize commits an inclusion set of 2,000 ids (32,000 bytes) to each server, as
    a study's capacity allows (docs/protocol.md section 6)."""
    limit = {"DPSKETCH_MAX_BODY_BYTES": "16384"}
    cluster = Cluster(servers, 2, api_token="api-token", server_env={"s1": limit, "s2": limit})
    rows = np.random.default_rng(3).uniform(-0.5, 0.5, size=(2000, 3)) / 2
    with AnalyzerClient(cluster.analyzer.url, cluster.api_token) as an:
        study_id = an.create_study(name="big-commit", columns=["a", "b", "y"], label="y",
                                   expected_reports=2000, min_reports=2000, k=8, s=2)["study_id"]
        for url in cluster.server_urls:  # any other body over the limit: 413 before it is read
            r = httpx.post(f"{url}/v1/studies/{study_id}/batches", content=bytes(16385), timeout=30,
                           headers={"Content-Type": SHARES_MEDIA_TYPE})
            assert r.status_code == 413 and r.json()["type"].endswith("payload-too-large"), r.text
        with Client(cluster.server_urls) as client:
            client.submit_many(study_id, rows, batch_size=100)
        view = an.finalize(study_id)
        assert view["state"] == "released" and view["n_reports"] == 2000
    for url in cluster.server_urls:
        assert httpx.get(f"{url}/v1/studies/{study_id}", timeout=30).json()["status"] == "committed"
