"""Reproducible studies for the analysis tests: a fixed sketch seed, two servers, design()'s defaults."""

from __future__ import annotations

import hashlib

from dpsketch.protocol import Study, design


def make_study(columns, n, label=None, *, seed: str = "s", **design_kwargs) -> Study:
    study, _ = design(
        name="t",
        columns=columns,
        label=label,
        servers=["a", "b"],
        expected_reports=n,
        seed=hashlib.sha256(seed.encode()).hexdigest(),
        **design_kwargs,
    )
    return study


def bind_at(study: Study, position: int, payloads, content: int = 1):
    """Report ids and (m, 16 N) proofs for these payloads as one server receives them (the other
    servers' commitments random: ``binding.bind_for_server``)."""
    import numpy as np

    from dpsketch.protocol import binding

    return binding.bind_for_server(study.study_id, study.n_servers, position, content, np.asarray(payloads))


def bound_body(study: Study, position: int, shares):
    """An application/x-dpsketch-shares body of these shares for server ``position``; (ids, body)."""
    from dpsketch.protocol import messages

    ids, proofs = bind_at(study, position, shares)
    return ids, messages.encode_batch(ids, proofs, shares)


def record_batches(monkeypatch) -> list:
    """Every PreparedBatch the SDK sends from now on (shares, seeds, report ids), in order: what
    an exact-reconstruction test sums itself."""
    import dpsketch.client_sdk.client as sdk

    sent: list = []
    real = sdk.prepare_batch

    def recording(study, rows, *args, **kwargs):
        batch = real(study, rows, *args, **kwargs)
        sent.append(batch)
        return batch

    monkeypatch.setattr(sdk, "prepare_batch", recording)
    return sent


def record_blocks(monkeypatch) -> dict:
    """Every party's PreparedBatch of blocks the SDK sends from now on, by party name, in order."""
    import dpsketch.client_sdk.parties as sdk_parties

    prepared: dict = {}
    real = sdk_parties.prepare_blocks

    def recording(study, party, pseudonyms, rows, *args, **kwargs):
        batch = real(study, party, pseudonyms, rows, *args, **kwargs)
        prepared.setdefault(party, []).append(batch)
        return batch

    monkeypatch.setattr(sdk_parties, "prepare_blocks", recording)
    return prepared


def provision_with_token(url: str, operator_token: str, study: Study) -> str:
    """PUT the study on one server as its operator, then issue one upload token without a quota:
    the token (what a data owner would be handed)."""
    import httpx

    auth = {"Authorization": f"Bearer {operator_token}"}
    r = httpx.put(f"{url}/v1/studies/{study.study_id}", content=study.canonical(), timeout=60,
                  headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    r = httpx.post(f"{url}/v1/studies/{study.study_id}/upload-tokens", json={"quota": None}, headers=auth,
                   timeout=120)  # the first token of a population may wait for the study's PLDs
    assert r.status_code == 201, r.text
    return r.json()["token"]
