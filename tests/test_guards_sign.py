"""The secret sign (docs/secret_sign.md) at the client, as an adversary would test it (issue 47).

A secret-sign study is accounted as the symmetric mixture of +a and -a: its epsilon holds only if
each row is multiplied by a fresh, uniform, secret t = +-1. A sign fixed at +1, a biased sign or
one shared by a batch would each leave the accounting claiming a privacy the release lacks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpsketch.protocol import report as report_path
from dpsketch.client_sdk.prepare import prepare_batch, signed_vectors
from dpsketch.protocol.keystream import Keystream
from studies import make_study


@pytest.fixture(scope="module")
def study():
    st = make_study(["a", "b", "c"], 20_000, secret_sign=True)
    assert st.secret_sign and st.kind == "sketch"
    return st


def test_each_row_gets_its_own_keystream_sign(study):
    """signed = t * clipped row, with t = -1 exactly where the batch's keystream bit is set (the
    first bits drawn, one per row), and |signed| = |clipped| everywhere."""
    n = 4000
    rows = np.random.default_rng(0).normal(0, 1, size=(n, 3))
    key = bytes(range(32))
    signed = signed_vectors(rows, study, Keystream.from_key(key))
    clipped = report_path.client_vectors(rows, study)
    bits = Keystream.from_key(key).bits(n)
    assert np.array_equal(signed[bits], -clipped[bits])
    assert np.array_equal(signed[~bits], clipped[~bits])


def test_signs_are_fair_and_independent_of_the_row(study):
    """Over 200 000 identical rows the share of flipped signs is 1/2 within 5 sd (sd = 0.0011;
    false alarm 5.7e-7): a sign fixed at +1 gives 0, a 1 % bias would be 4.5 sd away. Two batches
    of the same rows get different signs (fresh keystream per batch)."""
    n = 200_000
    rows = np.tile([[0.3, -0.2, 0.1]], (n, 1))
    clipped = report_path.client_vectors(rows[:1], study)[0]
    signed = signed_vectors(rows, study, Keystream())
    flipped = np.all(signed == -clipped, axis=1)
    kept = np.all(signed == clipped, axis=1)
    assert np.all(flipped | kept)
    assert abs(flipped.mean() - 0.5) < 5 * math.sqrt(0.25 / n)
    again = np.all(signed_vectors(rows, study, Keystream()) == -clipped, axis=1)
    assert 0.45 < np.mean(again != flipped) < 0.55


def test_a_prepared_batch_of_a_signed_study_shares_the_signed_rows(study):
    """End to end in the SDK: the shares of a batch sum to t * row + noise, so the reconstructed
    values of one large row sit near +row or -row, about half of them each."""
    n = 2000
    rows = np.tile([[0.9, 0.0, 0.0]], (n, 1))
    batch = prepare_batch(study, rows)
    total = sum(batch.share(j).astype(np.uint64) for j in range(study.n_servers))
    values = total.view(np.int64)[:, 0].astype(np.float64) * 2.0 ** -study.frac_bits
    clip = report_path.client_vectors(rows[:1], study)[0, 0]
    near_plus = np.abs(values - clip) < np.abs(values + clip)
    assert abs(near_plus.mean() - 0.5) < 5 * math.sqrt(0.25 / n) + 2 * math.erfc(clip / study.sigma / math.sqrt(2))
