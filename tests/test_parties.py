"""Parties holding different columns of the same individuals, over real processes (issue 12).

Three parties (a bank, a shop, a clinic with the label) upload their blocks for overlapping sets
of individuals through the SDK to three real share servers, with per-party upload tokens; the
analyzer finalizes over the individuals complete at every server. Checked: the release is the
sketch of the joined noisy rows of exactly those individuals, bit for bit; the missing counts
per party; a block under another party's token is refused; a re-prepared block is a conflict;
the joined row's calibration gives the study's epsilon; a relay cannot move a block to another
individual; a restart keeps the block index; an analyst cannot commit an incomplete individual.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.client_sdk.prepare import prepare_blocks
from conftest import NO_BUDGET, Cluster, cluster_for_module
from studies import record_blocks
from test_e2e import direct_sketch  # S(A + G) with Python ints, hashed by the ids given (here: pseudonyms)
from dpsketch.protocol import Study, messages, parties, ring, sketch
from dpsketch.protocol.study import design

PARTIES = [{"name": "bank", "columns": ["income", "debt"]},
           {"name": "shop", "columns": ["spend"]},
           {"name": "clinic", "columns": ["bmi", "y"]}]
#: no floor required, hence no population floor bound either (docs/ledger.md), nor a budget:
#: the module puts more studies on its servers than a population's default budget takes
NO_FLOOR = {"DPSKETCH_MAX_FLOOR_EPSILON": "none", **NO_BUDGET}


def post_blocks(url: str, study: Study, party: str, body: bytes, token: str | None = None) -> httpx.Response:
    headers = {"Content-Type": messages.blocks_media_type(party)}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body, headers=headers, timeout=60)


@pytest.fixture
def party_cluster(servers) -> Cluster:
    """A cluster of the test's own: for the test that SIGKILLs and restarts a server."""
    return Cluster(servers, 3, api_token="analyst-api-token", server_env={f"s{j}": NO_FLOOR for j in (1, 2, 3)},
                   open_uploads=False)


@pytest.fixture(scope="module")
def shared_party_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """The same configuration as ``party_cluster``, shared by the module's tests that neither stop a
    process nor look beyond studies of their own (each creates its own: random seeds, distinct ids)."""
    with cluster_for_module(tmp_path_factory, "party", server_env={f"s{j}": NO_FLOOR for j in (1, 2, 3)},
                            open_uploads=False) as c:
        yield c


def _create(c: Cluster, n: int, **kw) -> Study:
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(**{"name": "vertical", "label": "y", "expected_reports": n, "k": 16, "s": 4,
                                     "parties": PARTIES, "epsilon_floor": None, **kw})
    return Study.model_validate(created["study"])


def test_three_parties_release_the_sketch_of_the_joined_rows_of_complete_individuals(shared_party_cluster, monkeypatch):
    c = shared_party_cluster
    n = 900
    study = _create(c, n, min_reports=800)
    assert [p.name for p in study.parties] == ["bank", "shop", "clinic"]
    assert study.columns == ["income", "debt", "spend", "bmi", "y"]
    assert math.fsum(p.row_bound ** 2 for p in study.parties) <= study.row_bound ** 2

    key = parties.new_key()  # shared by the parties, never by the servers
    rng = np.random.default_rng(3)
    people = [f"person-{i:05d}" for i in range(n)]
    data = rng.normal(0, 0.3, size=(n, 5))
    cols = {"bank": slice(0, 2), "shop": slice(2, 3), "clinic": slice(3, 5)}
    # overlapping sets: the shop lacks 20 people, the clinic 9 (and 12 of its blocks never reach s3)
    held = {"bank": list(range(n)), "shop": list(range(20, n)), "clinic": [i for i in range(n) if i % 111 != 7]}

    prepared = record_blocks(monkeypatch)
    tokens = {name: c.upload_tokens(study.study_id, quota=None, party=name) for name in held}
    for name in ("bank", "shop"):  # through the SDK
        who = held[name]
        with Client(c.server_urls, token=tokens[name]) as client:
            result = client.submit_blocks(study.study_id, name, data[who][:, cols[name]], party_key=key,
                                          keys=[people[i] for i in who], batch_size=300)
        assert result.n_reports == len(who) and len(result) == len(who)
    # the clinic's blocks by hand, so that its last 12 never reach s3
    who = held["clinic"]
    clinic = prepare_blocks(study, "clinic", parties.pseudonyms(key, study.study_id, [people[i] for i in who]),
                            data[who][:, cols["clinic"]])
    prepared["clinic"] = [clinic]
    for j, url in enumerate(c.server_urls):
        keep = slice(None) if j < 2 else slice(0, len(who) - 12)
        body = messages.encode_blocks(clinic.report_ids[keep], clinic.pseudonyms[keep], clinic.proofs[j][keep],
                                      clinic.shares[j][keep])
        r = post_blocks(url, study, "clinic", body, tokens["clinic"][j])
        assert r.status_code == 200, r.text

    lost = set(who[-12:])
    complete = [i for i in range(n) if i in set(held["shop"]) and i in set(held["clinic"]) and i not in lost]
    missing_clinic = sum(1 for i in range(n) if i not in set(held["clinic"])) + 12
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        progress = an.progress(study.study_id)
        assert progress["parties"]["missing_by_party"] == {"bank": 0, "shop": 20, "clinic": missing_clinic}
        assert progress["parties"]["complete"] == len(complete)
        counts = [s["party_counts"] for s in progress["servers"]]
        assert counts[:2] == [{"bank": n, "shop": n - 20, "clinic": len(who)}] * 2
        assert counts[2] == {"bank": n, "shop": n - 20, "clinic": len(who) - 12}
        done = an.finalize(study.study_id)
        assert done["state"] == "released" and done["n_reports"] == len(complete)
        view = an.sketch(study.study_id)
        fit = an.ridge(study.study_id)

    # the joined noisy rows as the parties encoded them, for exactly the complete individuals
    encoded: dict[bytes, np.ndarray] = {}
    for name, batches in prepared.items():
        for batch in batches:
            for p, row in zip(batch.pseudonyms, ring.reconstruct(batch.shares)):
                encoded.setdefault(p, np.zeros(study.d, dtype=np.uint64))[cols[name]] = row
    ps = parties.pseudonyms(key, study.study_id, [people[i] for i in complete])
    expected = ring.decode(direct_sketch(study, ps, np.array([encoded[p] for p in ps])), study.frac_bits)
    np.testing.assert_array_equal(np.array(view["sketch"]), expected * sketch.scale(study.s))
    assert len(fit["coef"]) == 4  # the analyst's ridge is unchanged: four features, label y

    # every server committed the same blocks: three per complete individual
    for url in c.server_urls:
        info = httpx.get(f"{url}/v1/studies/{study.study_id}").json()
        assert info["status"] == "committed"
    # the noise of the joined rows is the study's sigma in every column
    joined = ring.decode(np.array([encoded[p] for p in ps]), study.frac_bits)
    clipped = np.concatenate([_clip(data[complete][:, cols[q.name]], q.row_bound) for q in study.parties], axis=1)
    assert (joined - clipped).std(axis=0) == pytest.approx([study.sigma] * study.d, rel=0.15)


def _clip(rows: np.ndarray, bound: float) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows * np.minimum(1.0, bound / np.maximum(norms, 1e-300))


def test_wrong_party_conflict_duplicate_and_relay_are_refused(shared_party_cluster):
    c = shared_party_cluster
    study = _create(c, 900, min_reports=800)
    key = parties.new_key()
    url = c.server_urls[0]
    bank = c.upload_tokens(study.study_id, quota=None, party="bank")
    shop = c.upload_tokens(study.study_id, quota=None, party="shop")
    people = [f"p{i}" for i in range(5)]
    ps = parties.pseudonyms(key, study.study_id, people)
    rows = np.full((5, 2), 0.1)
    batch = prepare_blocks(study, "bank", ps, rows)
    body = batch.body(0)

    # the shop's token cannot upload the bank's blocks (nor claim to be the bank)
    r = post_blocks(url, study, "bank", body, shop[0])
    assert r.status_code == 403 and r.json()["type"].endswith(":wrong-party")
    # a block batch without a party, or plain (or seed, or sealed) shares: the wrong media type for
    # a study with parties, 415 (docs/protocol.md section 6); a party the study does not have: 422
    for ctype, status in ((messages.BLOCKS_MEDIA_TYPE, 415), (messages.SHARES_MEDIA_TYPE, 415),
                          (messages.SEEDS_MEDIA_TYPE, 415), (messages.SEALED_MEDIA_TYPE, 415),
                          (messages.blocks_media_type("insurer"), 422)):
        r = httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body, timeout=30,
                       headers={"Content-Type": ctype, "Authorization": f"Bearer {bank[0]}"})
        assert r.status_code == status, (ctype, r.text)
        slug = "unsupported-media-type" if status == 415 else "invalid-request"
        assert r.json()["type"] == f"urn:dpsketch:problem:{slug}", (ctype, r.text)
    assert httpx.get(f"{url}/v1/studies/{study.study_id}").json()["party_counts"] == {"bank": 0, "shop": 0, "clinic": 0}

    r = post_blocks(url, study, "bank", body, bank[0])
    assert r.status_code == 200 and r.json()["accepted"] == 5
    r = post_blocks(url, study, "bank", body, bank[0])  # the same bytes again: duplicates, harmless
    assert r.status_code == 200 and r.json() == {"accepted": 0, "duplicates": 5, "report_count": 5}
    # the same individuals' blocks prepared anew (fresh noise and salts): a conflict, nothing stored
    again = prepare_blocks(study, "bank", ps, rows)
    r = post_blocks(url, study, "bank", again.body(0), bank[0])
    assert r.status_code == 409 and r.json()["type"].endswith(":report-conflict")
    # a relay moves a block to another individual: its id commits to the pseudonym, so refused
    other = parties.pseudonyms(key, study.study_id, ["q0"])
    moved = messages.encode_blocks(batch.report_ids[:1], other, batch.proofs[1][:1], batch.shares[1][:1])
    r = post_blocks(c.server_urls[1], study, "bank", moved, bank[1])
    assert r.status_code == 422 and r.json()["type"].endswith(":binding-refused")
    # ... or to another party of the same width (bank -> clinic): its id commits to the party too
    clinic = c.upload_tokens(study.study_id, quota=None, party="clinic")
    r = post_blocks(c.server_urls[1], study, "clinic", batch.body(1), clinic[1])
    assert r.status_code == 422 and r.json()["type"].endswith(":binding-refused")
    info = httpx.get(f"{c.server_urls[1]}/v1/studies/{study.study_id}").json()
    assert info["party_counts"] == {"bank": 0, "shop": 0, "clinic": 0}
    counts = httpx.get(f"{url}/v1/studies/{study.study_id}").json()
    assert counts["party_counts"] == {"bank": 5, "shop": 0, "clinic": 0} and counts["report_count"] == 0


def test_a_server_refuses_an_inclusion_set_with_an_incomplete_individual_and_keeps_its_index(party_cluster):
    """An analyst who commits a block of an individual without that individual's other blocks
    would release columns without the certificate over them: every server refuses. The block
    index survives a SIGKILL and restart."""
    c = party_cluster
    n = 300
    # min_reports 240, not 290: the sketch seed and the party key are fresh each run, and the
    # certificate of all 300 individuals (k = 8) against min_reports 290 refused 2 of 3000
    # simulated draws (lambda_min / lambda_star 0.99 at worst); against 240, 0 of 4000 (1.28)
    study = _create(c, n, min_reports=240, k=8)
    key = parties.new_key()
    people = [f"p{i}" for i in range(n)]
    ps = parties.pseudonyms(key, study.study_id, people)
    rng = np.random.default_rng(5)
    blocks = {q.name: prepare_blocks(study, q.name, ps, rng.normal(0, 0.2, size=(n, q.width))) for q in study.parties}
    tokens = {q.name: c.upload_tokens(study.study_id, quota=None, party=q.name) for q in study.parties}
    for name, batch in blocks.items():
        for j, url in enumerate(c.server_urls):
            assert post_blocks(url, study, name, batch.body(j), tokens[name][j]).status_code == 200

    victim = c.procs[2]
    victim.kill()  # SIGKILL
    victim.start()
    info = httpx.get(f"{victim.url}/v1/studies/{study.study_id}",
                     headers={"Authorization": f"Bearer {c.specs[2].analyst_token}"}).json()
    assert info["report_count"] == n and info["party_counts"] == {"bank": n, "shop": n, "clinic": n}

    everything = sorted(b for batch in blocks.values() for b in batch.report_ids)
    partial = sorted(set(everything) - {blocks["shop"].report_ids[0]})  # individual 0 without its shop block
    for spec, proc in zip(c.specs, c.procs):
        r = httpx.post(f"{proc.url}/v1/studies/{study.study_id}/commit", content=b"".join(partial),
                       headers={"Content-Type": messages.REPORT_IDS_MEDIA_TYPE,
                                "Authorization": f"Bearer {spec.analyst_token}"}, timeout=60)
        assert r.status_code == 422 and r.json()["type"].endswith(":incomplete-individuals"), r.text
        assert r.json()["incomplete"] == 1
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        done = an.finalize(study.study_id)
    assert done["n_reports"] == n and done["inclusion_hash"] == messages.inclusion_hash(everything)


def test_the_joined_row_meets_the_study_epsilon():
    """The parties' bounds and noises, joined: the sensitivity of an individual (all its blocks)
    is 2 sqrt(sum B_j^2) <= 2B, and the noise per value is sigma at every party, so the released
    Gaussian mechanism has the study's epsilon (computed here with dp-accounting's PLD, not the
    product's accountant)."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    study, _ = design(name="v", columns=[], label="y", servers=["s1", "s2", "s3"], expected_reports=10**5,
                      parties=PARTIES, epsilon=1.0, delta=1e-6)
    bounds = [p.row_bound for p in study.parties]
    assert bounds == pytest.approx([math.sqrt(2 / 5), math.sqrt(1 / 5), math.sqrt(2 / 5)])
    # the worst pair of neighbours: every block at its bound, replaced by its opposite
    a = np.concatenate([b * np.eye(w)[0] for b, w in zip(bounds, (2, 1, 2))])
    sensitivity = np.linalg.norm(a - (-a))
    assert sensitivity <= 2 * study.row_bound * (1 + 1e-15)
    # each party's noise is N(0, sigma^2) per value: the joined row's noise is sigma^2 I_d, and
    # through the certified sketch the release has variance sigma^2 lambda_star + server_sigma^2
    std = math.sqrt(study.sigma ** 2 * study.lambda_star + study.server_sigma ** 2)
    eps = pld.from_gaussian_mechanism(std, sensitivity=sensitivity, value_discretization_interval=1e-4
                                      ).get_epsilon_for_delta(study.delta)
    assert eps == pytest.approx(study.epsilon, rel=2e-3)
    assert eps <= study.epsilon * (1 + 2e-3)
    # a party that took more than its share of B^2 is refused at design time
    with pytest.raises(ValueError, match="at most B"):
        design(name="v", columns=[], label="y", servers=["s1", "s2"], expected_reports=10**4,
               parties=[{"name": "a", "columns": ["x"], "row_bound": 0.9},
                        {"name": "b", "columns": ["y"], "row_bound": 0.5}])
    with pytest.raises(ValueError, match="only a sketch study"):
        design(name="v", columns=[], label="y", servers=["s1", "s2"], expected_reports=10**4, kind="gram",
               parties=PARTIES)
    # studies without parties keep their ids: no "parties" member in their JSON
    plain, _ = design(name="v", columns=["x", "y"], label="y", servers=["s1", "s2"], expected_reports=10**4)
    assert "parties" not in plain.model_dump(mode="json")


def test_dpsketch_submit_party_uploads_each_party_from_its_own_csv(shared_party_cluster, tmp_path, capsys):
    from dpsketch.client_sdk.cli import main

    import json

    from dpsketch.analyzer.cli import main as study_cli

    c = shared_party_cluster
    n = 400
    assert study_cli(["--analyzer", c.analyzer.url, "--token", c.api_token, "create", "--name", "v",
                      "--label", "y", "--expected-reports", str(n), "--min-reports", "380", "--k", "8",
                      "--no-floor", "--party", "bank=income,debt", "--party", "shop=spend:0.3",
                      "--party", "clinic=bmi,y"]) == 0
    study = Study.model_validate(json.loads(capsys.readouterr().out)["study"])
    assert [(q.name, q.columns) for q in study.parties] == [
        ("bank", ["income", "debt"]), ("shop", ["spend"]), ("clinic", ["bmi", "y"])]
    assert study.parties[1].row_bound == 0.3 and study.parties[0].row_bound < 1
    key_file = tmp_path / "party.key"
    assert main(["--new-party-key", str(key_file), "-q"]) == 0
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert main(["--new-party-key", str(key_file), "-q"]) == 1  # never overwrites a key
    assert "File exists" in capsys.readouterr().err
    rng = np.random.default_rng(8)
    data = rng.normal(0, 0.3, size=(n, 5))
    order = {"bank": range(n), "shop": reversed(range(n)), "clinic": range(n)}  # any row order
    for q, cols in zip(study.parties, (slice(0, 2), slice(2, 3), slice(3, 5))):
        path = tmp_path / f"{q.name}.csv"
        lines = [",".join(["customer", "note", *q.columns])]
        lines += [",".join([f"c{i}", "x", *(repr(float(v)) for v in data[i, cols])]) for i in order[q.name]]
        path.write_text("\n".join(lines) + "\n")
        tokens = ",".join(c.upload_tokens(study.study_id, quota=n, party=q.name))
        args = ["--study", study.study_id, "--servers", ",".join(c.server_urls), "--token", tokens,
                "--party", q.name, "--party-key", str(key_file), "--id-column", "customer", "-q", str(path)]
        if q.name == "shop":  # one party seals its blocks, post-quantum (docs/sealing.md section 3a)
            args = ["--sealing", "post-quantum", *args]
        assert main(args) == 0, capsys.readouterr().err
    # a second run of the same file is a conflict (fresh noise), refused with a clear message
    assert main(args) == 1
    assert "report-conflict" in capsys.readouterr().err
    # a party the study does not have, and a repeated key, are refused before anything is sent
    bad = tmp_path / "bad.csv"
    bad.write_text("customer,income,debt\nc1,0.1,0.2\nc1,0.3,0.1\n")
    base = ["--study", study.study_id, "--servers", ",".join(c.server_urls), "--party-key", str(key_file),
            "--id-column", "customer", "-q", str(bad)]
    assert main([*base, "--party", "insurer"]) == 1 and "no party 'insurer'" in capsys.readouterr().err
    assert main([*base, "--party", "bank"]) == 1 and "repeats" in capsys.readouterr().err
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        assert an.progress(study.study_id)["parties"]["missing_by_party"] == {"bank": 0, "shop": 0, "clinic": 0}
        assert an.finalize(study.study_id)["n_reports"] == n
