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
