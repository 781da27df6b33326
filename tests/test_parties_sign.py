"""The party-key sign of a signed study with parties (docs/vertical.md, "Parties and the secret
sign"; docs/protocol.md section 2d), over real processes.

Two parties (a bank with two features, a clinic with a feature and the label) upload the blocks
of the same individuals through the SDK to three real share servers. Checked: every party signs
an individual's block with the same sign, derived from the party key (HMAC, recomputed here), so
the joined row is signed whole; about half the individuals are flipped; the release is exactly
the sketch of the joined signed noisy rows; the analyst's ridge recovers a label that depends on
the other party's columns (with independent signs per party the cross-party Gram would vanish);
and the study's guarantees say what is left if a party colludes.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator

import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from conftest import NO_BUDGET, Cluster, cluster_for_module
from dpsketch.protocol import Study, parties, ring, sketch
from dpsketch.protocol.study import design
from studies import record_blocks
from test_e2e import direct_sketch

PARTIES = [{"name": "bank", "columns": ["x1", "x2"]}, {"name": "clinic", "columns": ["x3", "y"]}]
NO_FLOOR = {"DPSKETCH_MAX_FLOOR_EPSILON": "none", **NO_BUDGET}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    with cluster_for_module(tmp_path_factory, "party-sign", server_env={f"s{j}": NO_FLOOR for j in (1, 2, 3)},
                            open_uploads=False) as c:
        yield c


def test_signs_are_the_party_keys_hmac_and_not_guessable_without_it():
    key, other = b"\x01" * 32, b"\x02" * 32
    study_id = "ab" * 32
    ps = parties.pseudonyms(key, study_id, [f"p{i}" for i in range(4000)])
    t = parties.signs(key, study_id, ps)
    want = [hmac.new(key, b"dpsketch/sign/1" + bytes.fromhex(study_id) + p, hashlib.sha256).digest()[0] & 1 == 1
            for p in ps]
    assert t.tolist() == want
    assert 0.45 < t.mean() < 0.55
    # another key (a server or analyst guessing) agrees with the signs only by chance
    assert 0.45 < (parties.signs(other, study_id, ps) == t).mean() < 0.55
    with pytest.raises(ValueError, match="party key"):
        parties.signs(b"short", study_id, ps)


def test_a_study_with_parties_signs_only_when_asked_and_states_the_collusion_floor():
    args = dict(name="v", columns=[], label="y", servers=["a", "b", "c"], expected_reports=100_000, parties=PARTIES)
    plain = design(**args)[0]
    assert not plain.secret_sign and "floor_epsilon_if_a_party_colludes" not in plain.guarantees()
    signed = design(**args, secret_sign=True)[0]
    g = signed.guarantees()
    assert signed.secret_sign and signed.sigma < 0.8 * plain.sigma
    assert g["epsilon"] <= 1.0 + 1e-9 and g["floor_epsilon"] <= 4.0 + 1e-9
    # known signs: the unsigned accounting of the same (smaller) noise
    assert 3.0 < g["epsilon_if_a_party_colludes"] < 4.0 and 9.0 < g["floor_epsilon_if_a_party_colludes"] < 11.0


def test_signed_parties_release_the_sketch_of_the_joined_signed_rows(cluster, monkeypatch):
    c = cluster
    n = 4000
    # min_reports 0.9 n, not n: the sketch seed and the party key are fresh each run; with all
    # 4000 individuals at exactly min_reports, lambda_min / lambda_star was 1.12 +- 0.018 over
    # 1000 simulated draws, 1.042 at worst (a long left tail); against 3600: 1.19 at worst
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        view = an.create_study(name="signed-parties", label="y", expected_reports=n, k=64, s=4, parties=PARTIES,
                               epsilon=4.0, epsilon_floor=None, min_reports=n * 9 // 10, secret_sign=True)
    study = Study.model_validate(view["study"])
    assert study.secret_sign and study.server_sigma == 0

    key = parties.new_key()
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, size=(n, 3))
    y = x @ np.array([0.8, -0.5, 0.3]) + 0.05 * rng.normal(size=n)  # y (clinic) depends on the bank's x1, x2
    data = np.column_stack([x, y])
    data *= 0.9 / np.linalg.norm(data, axis=1, keepdims=True)  # every row at 0.9 B: y / x is unchanged
    people = [f"person-{i:05d}" for i in range(n)]
    cols = {"bank": slice(0, 2), "clinic": slice(2, 4)}

    prepared = record_blocks(monkeypatch)
    for name in ("bank", "clinic"):
        tokens = c.upload_tokens(study.study_id, quota=None, party=name)
        with Client(c.server_urls, token=tokens) as client:
            client.submit_blocks(study.study_id, name, data[:, cols[name]], party_key=key, keys=people,
                                 batch_size=1000)
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        assert an.finalize(study.study_id)["n_reports"] == n
        released = np.array(an.sketch(study.study_id)["sketch"])
        coef = np.array(an.ridge(study.study_id)["coef"])

    ps = parties.pseudonyms(key, study.study_id, people)
    t = parties.signs(key, study.study_id, ps)
    joined: dict[bytes, np.ndarray] = {}
    for name, batches in prepared.items():
        for batch in batches:
            for p, row in zip(batch.pseudonyms, ring.reconstruct(batch.shares), strict=True):
                joined.setdefault(p, np.zeros(study.d, dtype=np.uint64))[cols[name]] = row
    encoded = np.array([joined[p] for p in ps])
    expected = ring.decode(direct_sketch(study, ps, encoded), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(released, expected)  # exactly S(T A + G) of the joined rows
    # each party's block of individual i went out times t_i: the sign of <sent block, data block>
    sent = ring.decode(encoded, study.frac_bits)
    for name, sl in cols.items():
        flipped = np.sum(sent[:, sl] * data[:, sl], axis=1) < 0
        strong = np.linalg.norm(data[:, sl], axis=1) > 4 * study.sigma  # the noise flips these rarely (3e-5)
        assert strong.sum() > n // 10 and (flipped[strong] == t[strong]).mean() > 0.99, (name, study.sigma)
    assert 0.45 < t.mean() < 0.55
    # the label depends on the other party's columns: one sign per individual keeps the joined
    # rows' cross-party second moments (bank x clinic) those of the data, and so the release's
    # (exactly their sketch, above); had the clinic signed with signs of its own, they would be lost
    cross = (slice(0, 2), slice(2, 4))
    truth = (data.T @ data)[cross]
    own = np.where(parties.signs(parties.new_key(), study.study_id, ps), -1.0, 1.0)
    wrong = sent.copy()
    wrong[:, 2:4] *= (own * np.where(t, -1.0, 1.0))[:, None]  # the clinic's blocks re-signed
    err = np.linalg.norm((sent.T @ sent)[cross] - truth) / np.linalg.norm(truth)
    err_wrong = np.linalg.norm((wrong.T @ wrong)[cross] - truth) / np.linalg.norm(truth)
    assert err < 0.15 and err_wrong > 0.8, (err, err_wrong)  # measured 0.03-0.05 and 1.0
    assert coef[0] > 0.3 and coef[1] < -0.1, coef  # the bank's features carry the clinic's label
