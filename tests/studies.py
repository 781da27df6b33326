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
    """Report ids and proofs for these payloads as one server receives them: each report's id
    commits to this payload at ``position`` and to random commitments for the other servers
    (what a client sends that server; the server cannot tell the others apart from random).
    Returns (ids, proofs) with proofs an (m, 16 N) uint8 array."""
    import os

    import numpy as np

    from dpsketch.protocol import binding

    rows = binding.payload_bytes(np.asarray(payloads))
    raw, step = rows
    m = len(payloads)
    n = study.n_servers
    ids, proofs = [], np.empty((m, binding.proof_bytes(n)), dtype=np.uint8)
    for i in range(m):
        salt = os.urandom(binding.SALT_BYTES)
        commits = [os.urandom(binding.COMMITMENT_BYTES) for _ in range(n)]
        commits[position] = binding.commitment(position, content, salt, raw[i * step:(i + 1) * step])
        ids.append(binding.report_id(study.study_id, commits))
        others = b"".join(c for j, c in enumerate(commits) if j != position)
        proofs[i] = np.frombuffer(salt + others, dtype=np.uint8)
    return ids, proofs


def bound_body(study: Study, position: int, shares):
    """An application/x-dpsketch-shares body of these shares for server ``position``; (ids, body)."""
    from dpsketch.protocol import messages

    ids, proofs = bind_at(study, position, shares)
    return ids, messages.encode_batch(ids, proofs, shares)
