"""Tests that need a part of the machine (a PostgreSQL or Prometheus to install, a tmpfs to mount)
skip on a developer's machine that cannot provide it, but never in CI: with ``$CI`` set
(``.ci/run`` sets it) a missing part fails the test instead, so a green CI run has run them all."""

from __future__ import annotations

import os

import pytest


def unavailable(reason: str) -> None:
    """Skip for ``reason``, or fail under CI."""
    if os.environ.get("CI"):
        pytest.fail(f"CI must run this test, but: {reason}")
    pytest.skip(reason)
