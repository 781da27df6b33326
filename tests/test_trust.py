"""The privacy promise tried as an attacker would, over real server processes (docs/trust.md).

* **Sybil isolation.** A malicious analyst uploads noiseless reports of its own, commits
  {victim} + its own reports and subtracts what it knows; two of the three servers collude and
  reveal their noise. The victim's row then sits under its own noise and one honest server's.
  Measured: the error of the reconstruction and the epsilon it implies, without the floor (huge)
  and with it (the floor's), and the batch rule refusing the crafted set, and upload tokens
  refusing the Sybil reports in the first place.
* **Membership by count.** Under add/remove a report count that moves by one tells membership;
  an observer without a server token sees the same answers whether the victim reported or not.
* **Relay substitution.** A relay that delivers a junk share under a victim's report id first is
  refused (the id commits to every share), so the genuine report is stored and the release is
  exact; before, the junk share was included and blew the Gram diagonal up.
* **Memory.** One report to the largest study a server accepts pins no more than its declared
  running totals; the server-wide budget refuses more studies than it holds.

The slow-header flood is tests/test_slow_clients.py.
"""

from __future__ import annotations

import math
import os

import httpx
import numpy as np
import pytest

from dpsketch.client_sdk import Client, prepare_batch
from dpsketch.protocol import accounting, binding, design, envelope, messages, ring
from dpsketch.protocol.study import Study
from dpsketch.services.admin import ServerAdmin

from conftest import Servers

B = 1.0
D = 100  # columns: each is one sample of the reconstruction error
HONEST = 60
SYBILS = 1800


def _start(servers: Servers, n: int = 3, **policy: str):
    """n real servers with this policy (environment variables, e.g. DPSKETCH_MAX_FLOOR_EPSILON).
    A server that takes studies without a floor bounds no population's floors either (each such
    study's floor alone is far past the default floor budget: docs/ledger.md)."""
    if policy.get("DPSKETCH_MAX_FLOOR_EPSILON") == "none":
        policy = {"DPSKETCH_POPULATION_FLOOR_EPSILON": "none", **policy}
    specs = [servers.spec(f"s{j + 1}") for j in range(n)]
    procs = [servers.start(spec, policy, open_uploads=False) for spec in specs]
    return specs, procs


def _provision(study: Study, specs, procs) -> None:
    for spec, proc in zip(specs, procs):
        # a server's first study pays its privacy calibration (seconds of CPU): more than httpx's
        # default 5 s timeout on a loaded machine
        r = httpx.put(f"{proc.url}/v1/studies/{study.study_id}", json=study.model_dump(mode="json"),
                      headers={"Authorization": f"Bearer {spec.analyst_token}"}, timeout=60)
        assert r.status_code == 201, r.text


def _crafted_batches(study: Study, rows: np.ndarray) -> tuple[list[bytes], list[bytes]]:
    """What an adversary uploads as Sybil reports: its own rows, encoded WITHOUT noise, shared and
    bound like any report (the protocol cannot tell). Returns the ids and each server's body."""
    encoded = ring.encode(rows, study.frac_bits, study.value_bound)
    shares = ring.share(encoded, study.n_servers)
    ids, proofs = binding.bind(study.study_id, [binding.CONTENT_SHARE] * study.n_servers, shares)
    return ids, [messages.encode_batch(ids, proofs[j], shares[j]) for j in range(study.n_servers)]


def _upload(procs, study: Study, bodies, tokens=None) -> list[httpx.Response]:
    out = []
    for j, proc in enumerate(procs):
        headers = {"Content-Type": messages.SHARES_MEDIA_TYPE}
        if tokens:
            headers["Authorization"] = f"Bearer {tokens[j]}"
        out.append(httpx.post(f"{proc.url}/v1/studies/{study.study_id}/batches", content=bodies[j],
                              headers=headers, timeout=60))
    return out


def _commit(study: Study, specs, procs, ids: list[bytes]) -> list[httpx.Response]:
    body = b"".join(sorted(ids))
    return [httpx.post(f"{p.url}/v1/studies/{study.study_id}/commit", content=body, timeout=60,
                       headers={"Authorization": f"Bearer {s.analyst_token}",
                                "Content-Type": messages.REPORT_IDS_MEDIA_TYPE})
            for s, p in zip(specs, procs)]


def _aggregates(study: Study, specs, procs) -> list[np.ndarray]:
    out = []
    for s, p in zip(specs, procs):
        r = httpx.get(f"{p.url}/v1/studies/{study.study_id}/aggregate",
                      headers={"Authorization": f"Bearer {s.analyst_token}"})
        assert r.status_code == 200, r.text
        out.append(messages.decode_aggregate(r.content, study.k, study.width))
    return out


#: The default policy but for open uploads, every variable spelled out (the defaults: floor
#: epsilon 4, max_excluded_fraction 0.1). The servers of ``default_open_servers`` run it.
DEFAULT_OPEN = {"DPSKETCH_MAX_FLOOR_EPSILON": "4.0", "DPSKETCH_MAX_EXCLUDED_FRACTION": "0.1",
                "DPSKETCH_UPLOAD_AUTH": "open"}


@pytest.fixture(scope="module")
def default_open_servers(tmp_path_factory):
    """Three servers of policy DEFAULT_OPEN, shared by the module's tests that run that policy:
    each provisions a study of its own (random seed, distinct id) and reads only that study (or a
    listing it compares before and after within the test)."""
    pool = Servers(tmp_path_factory.mktemp("trust-default-open"))
    try:
        yield _start(pool, **DEFAULT_OPEN)
    finally:
        pool.stop_all()


def _sybil_attack(servers: Servers | None, floor: float | None, batch_rule: str, honest: int = HONEST,
                  shared=None):
    """The attack of the trust issue on a k = 1 study: returns the study, the servers, the commit
    responses and, if the servers released, the victim's reconstruction error with servers s2
    and s3 colluding (their noise removed, as they can) and with none colluding. ``shared``:
    the (specs, procs) of ``default_open_servers``, whose policy must be this attack's."""
    policy = {"DPSKETCH_MAX_FLOOR_EPSILON": "none" if floor is None else str(floor),
              "DPSKETCH_MAX_EXCLUDED_FRACTION": batch_rule, "DPSKETCH_UPLOAD_AUTH": "open"}
    if shared is not None:
        assert policy == DEFAULT_OPEN
        specs, procs = shared
    else:
        specs, procs = _start(servers, **policy)
    columns = [f"c{i}" for i in range(D)]
    study, _ = design(name="victim", columns=columns, label=None, servers=[s.server_id for s in specs],
                      expected_reports=SYBILS, min_reports=SYBILS, k=1, epsilon_floor=floor)
    _provision(study, specs, procs)
    rng = np.random.default_rng(7)
    honest_rows = rng.normal(size=(honest, D))
    honest_rows *= (0.8 * B / np.linalg.norm(honest_rows, axis=1))[:, None]
    victim = honest_rows[0]
    with Client([p.url for p in procs]) as client:
        honest_ids = [bytes.fromhex(h) for h in client.submit_many(study.study_id, honest_rows)]
    # the analyst's Sybils: zero rows, no noise, and it keeps their shares (it made them)
    sybil_ids, bodies = _crafted_batches(study, np.zeros((SYBILS, D)))
    assert all(r.status_code == 200 for r in _upload(procs, study, bodies))
    commits = _commit(study, specs, procs, [honest_ids[0], *sybil_ids])
    if any(r.status_code != 200 for r in commits):
        return study, (specs, procs), commits, None
    shares = _aggregates(study, specs, procs)
    total = ring.decode(ring.reconstruct(shares), study.frac_bits).reshape(-1)
    error_all = total - victim  # the Sybils are zeros: all that is left is noise
    # s2 and s3 collude: each knows the shares it received, hence its own noise exactly
    colluding = []
    for j in (1, 2):
        sybils = messages.decode_batch(bodies[j], study.width, study.n_servers).payloads
        known = sybils.sum(axis=0, dtype=np.uint64) + _SENT[honest_ids[0]][j]
        colluding.append(ring.decode(shares[j].reshape(-1) - known, study.frac_bits))
    error = error_all - sum(colluding)
    return study, (specs, procs), commits, (error, error_all)


_SENT: dict[bytes, list[np.ndarray]] = {}  # report id -> the shares the SDK sent to each server


@pytest.fixture(autouse=True)
def _record_victim_shares(monkeypatch):
    """Keep every share the SDK sends (colluding servers know the shares they received)."""
    import dpsketch.client_sdk.client as sdk

    real = sdk.prepare_batch

    def recording(study, rows, *args, **kwargs):
        batch = real(study, rows, *args, **kwargs)
        for i, rid in enumerate(batch.report_ids):
            _SENT[rid] = [batch.share(j)[i] for j in range(study.n_servers)]
        return batch

    monkeypatch.setattr(sdk, "prepare_batch", recording)
    yield
    _SENT.clear()


def _sd_bounds(samples: int, p: float = 1e-6) -> tuple[float, float]:
    """(lo, hi): the sample sd (np.std) of ``samples`` i.i.d. normal values lies within lo .. hi
    times the true sd except with probability p on each side (D s^2 / sd^2 is chi-square with
    D - 1 degrees of freedom). For D = 100: 0.677 .. 1.345. The victim's error is fresh CSPRNG
    noise in every run, so a fixed relative tolerance is a test at some level: rel = 0.25 was
    3.8e-4 per assertion (the floor test's epsilon range 0.65 .. 1.35 x 4 another 4.7e-4)."""
    from scipy import stats

    return (math.sqrt(stats.chi2.ppf(p, samples - 1) / samples),
            math.sqrt(stats.chi2.isf(p, samples - 1) / samples))


def _measured_epsilon(error: np.ndarray, study: Study) -> float:
    """The epsilon an adversary's reconstruction implies: replacing the row moves it by up to
    2B, and the error is Gaussian with the measured spread, so mu = 2B / sd."""
    sd = float(np.std(error))
    return accounting.gaussian_epsilon(2 * study.row_bound / sd, study.delta)


def test_sybil_isolation_without_a_floor_exposes_the_victim(servers):
    study, _, commits, (error, error_all) = _sybil_attack(servers, floor=None, batch_rule="1.0")
    assert [r.status_code for r in commits] == [200, 200, 200]  # every certificate passed
    eps = _measured_epsilon(error, study)
    print(f"\nno floor: victim error sd {np.std(error):.4g} (client sigma {study.sigma:.4g}), "
          f"implied epsilon {eps:.1f} for a study of epsilon {study.epsilon}")
    lo, hi = _sd_bounds(error.size)
    assert lo * study.sigma < np.std(error) < hi * study.sigma  # only its own noise is left
    assert eps > 20 * study.epsilon  # ~97 at the true sd, ~60 at the bound hi


def test_sybil_isolation_with_the_floor_keeps_the_floor(servers):
    study, _, commits, (error, error_all) = _sybil_attack(servers, floor=4.0, batch_rule="1.0")
    assert [r.status_code for r in commits] == [200, 200, 200]
    floor_sd = math.sqrt(study.sigma ** 2 + study.server_sigma ** 2)  # own noise + one server's
    eps = _measured_epsilon(error, study)
    eps_all = _measured_epsilon(error_all, study)
    print(f"\nfloor 4: victim error sd {np.std(error):.4g} with s2, s3 colluding (floor noise "
          f"{floor_sd:.4g}), implied epsilon {eps:.2f}; no server colluding: {eps_all:.2f}")
    # D = 100 samples: the sample sd is within 0.677 .. 1.345 of the true one except in 2e-6 of
    # runs, so the implied epsilon is 4 at the true sd and within 2.9 .. 6.2 (the epsilons of
    # those bounds). Without the servers' noise (the report's own only) the sd would be 12x
    # smaller and epsilon ~97; if the colluders could not take theirs out it would be 1.73x
    # larger, epsilon ~2.2 (sd above the bound hi in all but 8e-4 of runs).
    lo, hi = _sd_bounds(error.size)
    assert lo * floor_sd < np.std(error) < hi * floor_sd
    eps_lo = accounting.gaussian_epsilon(2 * study.row_bound / (hi * floor_sd), study.delta)
    eps_hi = accounting.gaussian_epsilon(2 * study.row_bound / (lo * floor_sd), study.delta)
    assert eps_lo < eps < eps_hi and eps_hi < 4.0 * 1.6 and eps_lo > 4.0 * 0.65, (eps_lo, eps, eps_hi)
    assert eps_all < eps  # without collusion all three servers' noise protects


def test_the_batch_rule_refuses_the_crafted_inclusion_set(default_open_servers):
    # default policy except open uploads: max_excluded_fraction 0.1. 1800 Sybils, 60 honest:
    # with 60 honest reports the crafted set would leave out 59 of 1860 held (3.2 %) and pass:
    # the rule makes Sybils outnumber the honest reports ten to one, it does not stop them (the
    # floor does). With 400 honest reports the set leaves out 399 of 2200 (18 %): refused.
    study, (specs, procs), commits, released = _sybil_attack(None, floor=4.0, batch_rule="0.1",
                                                             honest=400, shared=default_open_servers)
    assert released is None
    assert [r.status_code for r in commits] == [422, 422, 422]
    assert {r.json()["type"] for r in commits} == {"urn:dpsketch:problem:inclusion-refused"}
    assert commits[0].json()["excluded"] == 399
    # nothing was released anywhere
    for spec, proc in zip(specs, procs):
        r = httpx.get(f"{proc.url}/v1/studies/{study.study_id}/aggregate",
                      headers={"Authorization": f"Bearer {spec.analyst_token}"})
        assert r.status_code == 409


def test_upload_tokens_stop_sybils_and_the_analyst_cannot_mint_them(servers):
    specs, procs = _start(servers)  # the default policy: upload tokens required
    study, _ = design(name="tokens", columns=["a", "b"], label=None, servers=[s.server_id for s in specs],
                      expected_reports=200, min_reports=100)
    _provision(study, specs, procs)
    ids, bodies = _crafted_batches(study, np.zeros((100, 2)))
    assert [r.status_code for r in _upload(procs, study, bodies)] == [401, 401, 401]
    # the analyst's token does not issue upload tokens
    r = httpx.post(f"{procs[0].url}/v1/studies/{study.study_id}/upload-tokens",
                   headers={"Authorization": f"Bearer {specs[0].analyst_token}"})
    assert r.status_code == 403
    # each organisation's operator enrols one client: one report per token
    tokens = []
    for spec, proc in zip(specs, procs):
        with ServerAdmin(proc.url, spec.operator_token) as admin:
            tokens.append(admin.issue_upload_tokens(study.study_id).token)
    one_id, one = _crafted_batches(study, np.zeros((1, 2)))
    assert [r.status_code for r in _upload(procs, study, one, tokens)] == [200, 200, 200]
    again = _upload(procs, study, one, tokens)  # a retry of the same report costs nothing
    assert [r.json()["duplicates"] for r in again] == [1, 1, 1]
    _, more = _crafted_batches(study, np.zeros((1, 2)))
    refused = _upload(procs, study, more, tokens)
    assert [r.status_code for r in refused] == [403, 403, 403]
    assert refused[0].json()["type"] == "urn:dpsketch:problem:upload-quota-exceeded"
    counts = [httpx.get(f"{p.url}/v1/studies/{study.study_id}").json()["report_count"] for p in procs]
    assert counts == [1, 1, 1]  # of 102 Sybil attempts, the one report a token allowed


def test_membership_by_count_is_not_public_for_add_remove(default_open_servers):
    specs, procs = default_open_servers  # open uploads, the default policy otherwise
    study, _ = design(name="members", columns=["a", "b"], label=None, servers=[s.server_id for s in specs],
                      expected_reports=1000, min_reports=60, neighbouring="add-remove")
    _provision(study, specs, procs)
    url = f"{procs[0].url}/v1/studies/{study.study_id}"
    rng = np.random.default_rng(3)
    with Client([p.url for p in procs]) as client:
        client.submit_many(study.study_id, rng.normal(scale=0.3, size=(60, 2)))
        without = (httpx.get(url).json(), httpx.get(f"{procs[0].url}/v1/studies").json())
        result = client.submit(study.study_id, [0.1, 0.2])  # the victim reports (or not)
        with_victim = (httpx.get(url).json(), httpx.get(f"{procs[0].url}/v1/studies").json())
    # what anyone without a server token sees is the same in both worlds: advantage 0
    assert without == with_victim
    assert without[0]["report_count"] is None and without[0]["commit"] is None
    assert result  # the victim's upload itself answered without a count
    # the servers' own roles still see exact counts
    auth = {"Authorization": f"Bearer {specs[0].analyst_token}"}
    assert httpx.get(url, headers=auth).json()["report_count"] == 61
    # and the release itself is calibrated for add/remove, the report's own noise included
    assert study.guarantees()["epsilon"] <= study.epsilon * (1 + 1e-6)


def test_a_relay_cannot_substitute_a_share(servers):
    specs, procs = _start(servers, DPSKETCH_UPLOAD_AUTH="open", DPSKETCH_MAX_FLOOR_EPSILON="none")
    # no server noise, so the release can be compared with the honest sum bit for bit
    study, _ = design(name="relay", columns=["a", "b", "y"], label="y", servers=[s.server_id for s in specs],
                      expected_reports=100, min_reports=50, kind="gram", epsilon_floor=None)
    _provision(study, specs, procs)
    rng = np.random.default_rng(5)
    rows = rng.normal(scale=0.3, size=(60, 3))
    batch = prepare_batch(study, rows)
    victim = 0
    rid = batch.report_ids[victim]
    # the relay: copies the victim's id and proof, replaces the share at s1 with junk
    junk = np.full((1, study.width), np.uint64(1 << 62), dtype=np.uint64)
    forged = messages.encode_batch([rid], batch.proofs[0][victim:victim + 1], junk)
    r = httpx.post(f"{procs[0].url}/v1/studies/{study.study_id}/batches", content=forged,
                   headers={"Content-Type": messages.SHARES_MEDIA_TYPE})
    assert r.status_code == 422 and r.json()["type"] == "urn:dpsketch:problem:binding-refused"
    # ... and sealed to s1's public key (anyone can seal): refused the same way, after opening
    info = httpx.get(f"{procs[0].url}/v1/info").json()["hpke"]
    key = bytes.fromhex(next(k["public_key"] for k in info["keys"] if k["key_id"] == info["current"]))
    sealed = envelope.seal_body(envelope.Recipient("s1", key), study.study_id, forged,
                                messages.SHARES_MEDIA_TYPE, study.width, study.n_servers)
    r = httpx.post(f"{procs[0].url}/v1/studies/{study.study_id}/batches", content=sealed,
                   headers={"Content-Type": messages.SEALED_MEDIA_TYPE})
    assert r.status_code == 422 and r.json()["type"] == "urn:dpsketch:problem:binding-refused"
    # the genuine shares arrive afterwards and are stored everywhere (no conflict)
    for j, proc in enumerate(procs):
        r = httpx.post(f"{proc.url}/v1/studies/{study.study_id}/batches", content=batch.body(j),
                       headers={"Content-Type": messages.SHARES_MEDIA_TYPE})
        assert r.status_code == 200 and r.json()["accepted"] == 60
    commits = _commit(study, specs, procs, batch.report_ids)
    assert [c.status_code for c in commits] == [200, 200, 200]
    released = ring.reconstruct(_aggregates(study, specs, procs)).reshape(-1)
    honest = ring.reconstruct([ring.reconstruct(batch.shares)]).sum(axis=0, dtype=np.uint64)
    assert np.array_equal(released, honest)  # exact: the junk share was never included
    gram = ring.decode(released, study.frac_bits)[3:6]  # the Gram diagonal
    print(f"\nrelay: released Gram diagonal {np.round(gram, 2).tolist()} (junk would add "
          f"{ring.decode(junk[0, :1], study.frac_bits)[0]:.3g} per cell)")
    assert np.all(np.abs(gram) < 100)


def test_one_report_to_the_largest_study_pins_only_its_declared_totals(servers):
    """One report to a study whose k x width aggregate is large must not touch (and so pin) that
    aggregate: the old code built and added a dense k x width matrix on every upload."""
    limit = 64 << 20
    specs, procs = _start(servers, 2, DPSKETCH_UPLOAD_AUTH="open", DPSKETCH_MAX_STUDY_MEMORY=str(limit),
                          DPSKETCH_MEMORY_BUDGET=str(80 << 20))
    columns = [f"c{i}" for i in range(4000)]
    servers_ = [s.server_id for s in specs]
    # 8 k (width + k) just under the limit: k = 1200 -> aggregate 38.4 MB + S S^T 11.5 MB
    study, _ = design(name="big", columns=columns, label=None, servers=servers_, expected_reports=10 ** 4,
                      k=1200, s=4)
    warm, _ = design(name="warm", columns=columns[:3], label=None, servers=servers_, expected_reports=1000)
    declared = 8 * study.k * (study.width + study.k)
    assert declared <= limit
    _provision(study, specs, procs)
    _provision(warm, specs, procs)
    pid = procs[0].proc.pid

    def rss() -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024

    with Client([p.url for p in procs]) as client:
        client.submit(warm.study_id, np.zeros(3))  # the upload path's own first-use allocations
        before = rss()
        client.submit(study.study_id, np.zeros(4000))
        grown = rss() - before
    aggregate = 8 * study.k * study.width
    print(f"\nmemory: one report to a k = {study.k}, width = {study.width} study: RSS +{grown / 2**20:.1f} "
          f"MiB (its aggregate {aggregate / 2**20:.1f} MiB, declared totals {declared / 2**20:.1f} MiB)")
    assert grown < aggregate / 4  # the aggregate is allocated, not touched, by one report
    # the budget counts what reports touched (issue 41), not what studies declare: a second study
    # of that size is taken, and the server counts s rows of each study a report went to
    other, _ = design(name="big2", columns=columns, label=None, servers=servers_, expected_reports=10 ** 4,
                      k=1200, s=4)
    _provision(other, specs, procs)
    with Client([p.url for p in procs]) as client:
        client.submit(other.study_id, np.zeros(4000))
    scrape = httpx.get(f"{procs[0].url}/metrics", headers={"Authorization": f"Bearer {specs[0].operator_token}"})
    counted = float(next(line.split()[-1] for line in scrape.text.splitlines()
                         if line.startswith("dpsketch_store_memory_bytes ")))
    expected = sum(8 * min(st.k, st.s) * (st.width + st.k) + 95 for st in (study, warm, other))
    print(f"memory budget counts {counted / 2**20:.2f} MiB for three studies of one report each "
          f"(declared {(declared * 2 + 8 * warm.k * (warm.width + warm.k)) / 2**20:.1f} MiB)")
    assert counted == expected < 2 * declared / 100
    # and a study above the per-study limit is refused outright
    huge, _ = design(name="huge", columns=columns, label=None, servers=servers_, expected_reports=10 ** 4,
                     k=1600, s=4)
    r = httpx.put(f"{procs[1].url}/v1/studies/{huge.study_id}", json=huge.model_dump(mode="json"),
                  headers={"Authorization": f"Bearer {specs[1].analyst_token}"}, timeout=60)
    assert r.status_code == 422 and r.json()["policy_rule"] == "max_study_memory"
    assert os.path.exists(specs[0].db_path)
