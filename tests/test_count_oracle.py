"""No count oracle (issue 41, docs/trust.md section 5): nothing a client or an outsider can call
tells how many reports an add/remove study holds.

The issue's probe: an enrolled client holding one quota-1 upload token posts an oversized batch.
The server answered 409 capacity-exceeded naming the count held ("holds 60 reports") before it
checked the quota, so the probe cost nothing and read membership with certainty: 60 before the
victim's upload, 61 after. Now the quota is checked first and no refusal names a count. The
attack, over a real server process:

* the same probe before and after the victim's upload: identical status and body bytes;
* the same probe against two studies holding 60 and 61 reports, interleaved, 150 times each:
  identical bodies (up to the study id) and response times whose medians differ by less than
  the spread of either (measured, printed; the bound is loose so that it never fails on a loaded
  machine, yet a count-dependent path such as a database read would break it);
* an outsider's GET of the study and of the list: identical bytes before and after.
"""

from __future__ import annotations

import statistics
import time

import httpx
import numpy as np

from dpsketch.protocol import design, messages
from dpsketch.protocol.study import Study
from dpsketch.services.admin import ServerAdmin

from studies import bound_body


def _batch(study: Study, m: int) -> bytes:
    shares = np.frombuffer(np.random.default_rng().bytes(8 * m * study.width), dtype="<u8").reshape(m, -1)
    return bound_body(study, 0, shares)[1]


def _post(client: httpx.Client, study: Study, body: bytes, token: str) -> httpx.Response:
    return client.post(f"/v1/studies/{study.study_id}/batches", content=body,
                       headers={"Content-Type": messages.SHARES_MEDIA_TYPE, "Authorization": f"Bearer {token}"})


def test_an_oversized_batch_from_a_quota_one_token_tells_nothing_about_the_count(servers):
    spec = servers.spec("s1")
    proc = servers.start(spec, open_uploads=False)  # defaults: tokens, budgets
    studies = [design(name=f"members{i}", columns=["a", "b"], label=None, servers=["s1", "s2"],
                      expected_reports=60, min_reports=50, neighbouring="add-remove", secret_sign=False,
                      seed=f"{i + 7:064x}")[0] for i in range(2)]
    admin = ServerAdmin(proc.url, spec.operator_token)
    with httpx.Client(base_url=proc.url, timeout=60) as client:
        probes, victims = [], []
        for study in studies:
            r = client.put(f"/v1/studies/{study.study_id}", content=study.canonical(),
                           headers={"Authorization": f"Bearer {spec.analyst_token}",
                                    "Content-Type": "application/json"})
            assert r.status_code == 201, r.text
            others = admin.issue_upload_tokens(study.study_id, 1, 60).token
            assert _post(client, study, _batch(study, 60), others).status_code == 200
            probes.append(admin.issue_upload_tokens(study.study_id, 1, 1).token)  # the prober's
            victims.append(admin.issue_upload_tokens(study.study_id, 1, 1).token)
        assert studies[0].max_reports <= 1000  # an oversized batch is a few dozen KiB
        oversized = [_batch(s, s.max_reports + 1) for s in studies]  # past capacity whatever is held

        def probe(i: int) -> httpx.Response:
            return _post(client, studies[i], oversized[i], probes[i])

        def outsider(i: int) -> tuple[bytes, bytes]:
            return (client.get(f"/v1/studies/{studies[i].study_id}").content, client.get("/v1/studies").content)

        before, seen_before = probe(0), outsider(0)
        assert _post(client, studies[0], _batch(studies[0], 1), victims[0]).status_code == 200  # 61 now
        after, seen_after = probe(0), outsider(0)
        print(f"\nprobe before the victim: {before.status_code} {before.content[:160]!r}...")
        assert before.status_code == after.status_code == 403
        assert before.json()["type"].endswith("upload-quota-exceeded")
        assert before.content == after.content  # byte for byte
        assert seen_before == seen_after
        detail = before.json()["detail"].replace(studies[0].study_id, "")
        assert "60" not in detail and "61" not in detail  # the client's own numbers only (1 and 1001)

        # timing: study 0 holds 61, study 1 holds 60; probes interleaved
        times: dict[int, list[float]] = {0: [], 1: []}
        bodies = {0: set(), 1: set()}
        for _ in range(150):
            for i in (0, 1):
                start = time.perf_counter()
                r = probe(i)
                times[i].append(time.perf_counter() - start)
                bodies[i].add(r.content.replace(studies[i].study_id.encode(), b"<study>"))
        assert bodies[0] == bodies[1] and len(bodies[0]) == 1  # one answer, whatever the count
        med = {i: statistics.median(times[i]) for i in (0, 1)}
        spread = {i: statistics.quantiles(times[i], n=4)[2] - statistics.quantiles(times[i], n=4)[0]
                  for i in (0, 1)}
        print(f"probe time at 61 vs 60 held: median {med[0] * 1e3:.2f} vs {med[1] * 1e3:.2f} ms "
              f"(IQR {spread[0] * 1e3:.2f} / {spread[1] * 1e3:.2f} ms), "
              f"difference {abs(med[0] - med[1]) * 1e3:.3f} ms")
        assert abs(med[0] - med[1]) < max(spread[0], spread[1], 0.5e-3) + 0.25 * min(med.values())
        # the quota still holds both probers to nothing stored
        counts = [client.get(f"/v1/studies/{s.study_id}",
                             headers={"Authorization": f"Bearer {spec.analyst_token}"}).json()["report_count"]
                  for s in studies]
        assert counts == [61, 60]
    admin.close()
