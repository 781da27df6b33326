"""Seed-compressed shares (docs/protocol.md sections 4 and 7): exact reconstruction, body sizes,
server-side expansion with duplicate semantics, and an exact release through a real cluster
(studies without server noise, on servers whose policy accepts them, so the release is exactly
the sketch of the clients' shares)."""

from __future__ import annotations

import time

import httpx
import numpy as np

from dpsketch.analyzer.client import AnalyzerClient
from dpsketch.client_sdk import Client
from dpsketch.client_sdk.prepare import prepare_batch
from dpsketch.protocol import Study, binding, messages, ring, sketch
from dpsketch.tools.client_bench import bench_compression

from conftest import BOTH_STORES
from dpsketch.services import batches
from test_e2e import COLUMNS, direct_sketch, exact_cluster, no_floor_module_cluster  # noqa: F401 (a fixture)


def test_expanded_seed_shares_plus_last_reconstruct_exactly():
    x = ring.random_ring((500, 7))
    for n in (2, 3, 5):
        seeds, last = ring.share_with_seeds(x, n)
        assert len(seeds) == n - 1 and all(s.shape == (500, 32) and s.dtype == np.uint8 for s in seeds)
        np.testing.assert_array_equal(ring.reconstruct([ring.expand_seeds(s, 7) for s in seeds] + [last]), x)
        # row-wise expansion agrees with the batch expansion
        assert ring.expand_seed(seeds[0][3].tobytes(), 7).tolist() == ring.expand_seeds(seeds[0], 7)[3].tolist()


def test_seed_batch_codec_and_body_sizes():
    d, n = 6, 3
    seeds, last = ring.share_with_seeds(ring.random_ring((10, d)), n)
    contents = [binding.CONTENT_SEED] * (n - 1) + [binding.CONTENT_SHARE]
    ids, proofs = binding.bind("ab" * 32, contents, [*seeds, last])
    body = messages.encode_seed_batch(ids, proofs[0], seeds[0])
    # a seed record: 16-byte id, 16 N-byte proof, 32-byte seed
    assert len(body) == 10 * (48 + 16 * n) == 10 * messages.record_bytes(messages.SEEDS_MEDIA_TYPE, d, n)
    got = messages.decode_seed_batch(body, n)
    assert got.ids == ids and got.content == binding.CONTENT_SEED
    assert np.array_equal(got.payloads, seeds[0]) and np.array_equal(got.proofs, proofs[0])
    got.verify("ab" * 32, n, 0)
    np.testing.assert_array_equal(got.shares(d), ring.expand_seeds(seeds[0], d))
    assert messages.decode_upload(body, messages.SEEDS_MEDIA_TYPE, d, n).ids == ids
    full = messages.encode_batch(ids, proofs[n - 1], last)
    assert len(full) == 10 * (16 + 16 * n + 8 * d) == 10 * messages.record_bytes(messages.SHARES_MEDIA_TYPE, d, n)
    messages.decode_batch(full, d, n).verify("ab" * 32, n, n - 1)
    for bad in (b"", body[:-1]):
        try:
            messages.decode_seed_batch(bad, n)
        except ValueError:
            continue
        raise AssertionError("malformed seed batch accepted")


def _study(c, n, name):
    # min_reports 0.9 n (design()'s default ratio), not n: the sketch seed and the report ids are
    # fresh each run, and with all 600 reports at exactly min_reports = 600 (k = 16) the
    # certificate refused 1 of 3000 simulated draws (lambda_min / lambda_star 0.98 at worst); at
    # min_reports 540, 0 of 2000 (1.14 at worst, 1.33 +- 0.05)
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name=name, columns=COLUMNS, label="y", expected_reports=n,
                                  k=16, s=4, min_reports=n * 9 // 10, epsilon_floor=None)
    return Study.model_validate(created["study"])


def _post(url, study, body, media_type):
    return httpx.post(f"{url}/v1/studies/{study.study_id}/batches", content=body, timeout=60,
                      headers={"Content-Type": media_type})


def test_mixed_cluster_release_is_exact_and_seeds_are_judged_on_expanded_shares(no_floor_module_cluster):
    c = no_floor_module_cluster
    n = 600
    study = _study(c, n, "seeds")
    rows = np.random.default_rng(4).normal(0, 0.3, size=(n, len(COLUMNS)))
    batch = prepare_batch(study, rows, compress=True)
    assert batch.media_type(0) == batch.media_type(1) == messages.SEEDS_MEDIA_TYPE
    assert batch.media_type(2) == messages.SHARES_MEDIA_TYPE
    proof = 16 * study.n_servers
    assert len(batch.body(0)) == (48 + proof) * n and len(batch.body(2)) == (16 + proof + 8 * study.d) * n
    encoded = ring.reconstruct([batch.share(j) for j in range(3)])
    # s1 gets seeds, s3 the last full share; the report ids commit to s2's seed, so s2's share
    # may travel only as that seed: expanded and sent in the full format it is not the payload
    # the id commits to (a seed and its share are different commitments) and is refused whole
    full_s2 = messages.encode_batch(batch.report_ids, batch.proofs[1], batch.share(1))
    r = _post(c.server_urls[1], study, full_s2, messages.SHARES_MEDIA_TYPE)
    assert r.status_code == 422 and r.json()["type"].endswith("binding-refused"), r.text
    assert _post(c.server_urls[1], study, batch.body(1), messages.SHARES_MEDIA_TYPE).status_code == 400
    for url, j in zip(c.server_urls, range(3)):
        r = _post(url, study, batch.body(j), batch.media_type(j))
        assert r.status_code == 200 and r.json()["accepted"] == n, r.text
    # the same seeds again: duplicates (judged on the expanded shares)
    r = _post(c.server_urls[0], study, batch.body(0), messages.SEEDS_MEDIA_TYPE)
    assert r.json() == {"accepted": 0, "duplicates": n, "report_count": n}
    r = _post(c.server_urls[1], study, batch.body(1), messages.SEEDS_MEDIA_TYPE)
    assert r.json()["duplicates"] == n
    # a different seed under a held id (with its genuine proof) is refused by the binding, and
    # changes nothing; a malformed seed body is refused
    other = messages.encode_seed_batch(batch.report_ids[:1], batch.proofs[0][:1], np.zeros((1, 32), np.uint8))
    r = _post(c.server_urls[0], study, other, messages.SEEDS_MEDIA_TYPE)
    assert r.status_code == 422 and r.json()["type"].endswith("binding-refused")
    assert batch.report_ids[0].hex() in r.json()["detail"]
    assert _post(c.server_urls[0], study, b"x" * 47, messages.SEEDS_MEDIA_TYPE).status_code == 400
    assert [httpx.get(f"{u}/v1/studies/{study.study_id}").json()["report_count"] for u in c.server_urls] == [n] * 3

    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        fin = an.finalize(study.study_id)
        assert fin["state"] == "released" and fin["n_reports"] == n
        released = np.array(an.sketch(study.study_id)["sketch"])
    expected = ring.decode(direct_sketch(study, batch.report_ids, encoded), study.frac_bits) * sketch.scale(study.s)
    np.testing.assert_array_equal(released, expected)


def _stored_bytes(spec) -> tuple[int, int]:
    """(reports, bytes of their stored shares or seeds) in a server's store, read directly."""
    sql = "SELECT sum(m), sum(length(shares)) FROM batches"
    if str(spec.db_path).startswith("postgresql://"):
        import psycopg

        with psycopg.connect(str(spec.db_path)) as conn:
            m, size = conn.execute(sql).fetchone()
    else:
        import sqlite3

        with sqlite3.connect(f"file:{spec.db_path}?mode=ro", uri=True) as conn:
            m, size = conn.execute(sql).fetchone()
    return int(m), int(size)


@BOTH_STORES
def test_a_seed_server_stores_the_seeds_and_expands_them_when_it_reads_them_back(servers):
    """A server that receives seeds stores 32 bytes a report, not the 8 x width of the share
    (services/batches.py), and every reader gets the share back: the rebuild after a SIGKILL, the
    duplicate check, and the commit that subtracts the reports another server lacks. The release
    is then exactly the sketch of the included reports' shares."""
    c = exact_cluster(servers)
    n, lost = 600, 40
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        created = an.create_study(name="seed-store", columns=COLUMNS, label="y", expected_reports=n,
                                  k=16, s=4, min_reports=n - 2 * lost, epsilon_floor=None)
    study = Study.model_validate(created["study"])
    assert batches.stores_seeds(study.width) and 8 * study.width > 32
    rows = np.random.default_rng(8).normal(0, 0.3, size=(n, len(COLUMNS)))
    batch = prepare_batch(study, rows, compress=True)
    encoded = ring.reconstruct([batch.share(j) for j in range(3)])
    # s1 misses the last 40 reports: the analyzer excludes them everywhere, so s2 (seeds) and s3
    # (full shares) read those 40 back from their stores and subtract them at commit
    keep = messages.encode_seed_batch(batch.report_ids[:n - lost], batch.proofs[0][:n - lost], batch.seeds[0][:n - lost])
    assert _post(c.server_urls[0], study, keep, messages.SEEDS_MEDIA_TYPE).status_code == 200
    for j in (1, 2):
        r = _post(c.server_urls[j], study, batch.body(j), batch.media_type(j))
        assert r.status_code == 200 and r.json()["accepted"] == n, r.text
    assert _stored_bytes(c.specs[1]) == (n, 32 * n)  # the seeds, not the shares (8 x width bytes each)
    assert _stored_bytes(c.specs[2]) == (n, 8 * study.width * n)
    assert _stored_bytes(c.specs[0]) == (n - lost, 32 * (n - lost))
    # s2 killed and restarted: its totals are rebuilt from the stored seeds
    c.procs[1].kill()
    c.procs[1].start()
    r = _post(c.server_urls[1], study, batch.body(1), messages.SEEDS_MEDIA_TYPE)  # judged on the shares
    assert r.json() == {"accepted": 0, "duplicates": n, "report_count": n}, r.text
    with AnalyzerClient(c.analyzer.url, c.api_token) as an:
        fin = an.finalize(study.study_id)
        assert fin["state"] == "released" and fin["n_reports"] == n - lost, fin
        released = np.array(an.sketch(study.study_id)["sketch"])
    included = slice(0, n - lost)
    expected = direct_sketch(study, batch.report_ids[included], encoded[included])
    np.testing.assert_array_equal(released, ring.decode(expected, study.frac_bits) * sketch.scale(study.s))
    # and the released aggregate is not what it would be had the 40 not been subtracted
    whole = ring.decode(direct_sketch(study, batch.report_ids, encoded), study.frac_bits) * sketch.scale(study.s)
    assert not np.array_equal(released, whole)


def test_sdk_compressed_and_full_uploads_give_the_same_aggregate(no_floor_module_cluster):
    """The same reports uploaded through the SDK both ways: servers' aggregates sum to the same
    sketch. Seed-compressed is the default (every server but one gets seeds, and which one gets
    the full shares rotates batch by batch); ``compress=False`` sends full shares. Also prints
    bytes/row and the prepare+upload times."""
    c = no_floor_module_cluster
    n = 20_000
    rows = np.random.default_rng(8).normal(0, 0.3, size=(n, len(COLUMNS)))
    figures = {}
    releases = {}
    for compress in (False, None):  # None: the default
        study = _study(c, n, f"sdk-compress-{compress}")
        sizes: list[int] = []
        media: dict[int, list[str]] = {}

        class Count(httpx.HTTPTransport):
            def handle_request(self, request, sizes=sizes, media=media):
                if request.url.path.endswith("/batches"):
                    sizes.append(len(request.content))
                    server = c.server_urls.index(f"{request.url.scheme}://{request.url.netloc.decode()}")
                    media.setdefault(server, []).append(request.headers["content-type"])
                return super().handle_request(request)

        kw = {} if compress is None else {"compress": compress}
        with Client(c.server_urls, transport=Count(), **kw) as client:
            assert client.compress is (compress is None)
            client.study(study.study_id)
            t0 = time.perf_counter()
            result = client.submit_many(study.study_id, rows, batch_size=5000)
            elapsed = time.perf_counter() - t0
        assert result.n_reports == n
        seeded = compress is None
        # 4 batches: the full shares of batch i go to server i mod 3, seeds to the other two
        full_batches = {j: media[j].count(messages.SHARES_MEDIA_TYPE) for j in range(3)}
        assert all(len(media[j]) == 4 for j in range(3)), media
        assert full_batches == ({0: 2, 1: 1, 2: 1} if seeded else {0: 4, 1: 4, 2: 4}), media
        assert all(set(media[j]) <= {messages.SHARES_MEDIA_TYPE, messages.SEEDS_MEDIA_TYPE} for j in range(3))
        per_row = sum(sizes) / n
        proof = 16 * study.n_servers  # every record carries its 16 N-byte binding proof
        full = 16 + proof + 8 * study.d
        assert per_row == full + (2 * (48 + proof) if seeded else 2 * full)
        # the share data: 8d + 32(N-1) bytes with seeds, 8dN without; ids and proofs besides
        assert per_row - 3 * (16 + proof) == (8 * study.d + 32 * 2 if seeded else 8 * study.d * 3)
        figures["compressed" if seeded else "full"] = (per_row, elapsed)
        with AnalyzerClient(c.analyzer.url, c.api_token) as an:
            assert an.finalize(study.study_id)["n_reports"] == n
            releases[seeded] = np.array(an.sketch(study.study_id)["sketch"])
    # different noise draws, so compare shapes and scale only; exactness is the mixed test's job
    assert releases[True].shape == releases[False].shape
    print(f"\nupload of {n} rows, d={len(COLUMNS)}, N=3 over loopback: " + "; ".join(
        f"{k}: {b:.0f} bytes/row, {t:.2f} s" for k, (b, t) in figures.items()))


def test_bench_compression_figures():
    """The client bench (``dpsketch bench seeds``) at a small size: both modes prepare real
    batches of the bytes per row the protocol says (times are printed, never asserted)."""
    bench = bench_compression(2_000, d=10, n_servers=3, repeats=1)
    assert bench["full"]["bytes_per_row"] == 3 * (16 + 48 + 80)
    assert bench["compressed"]["bytes_per_row"] == (16 + 48 + 80) + 2 * (48 + 48)
    assert bench["prepare_ratio"] > 0 and bench["share_ratio"] > 0
    print(f"\nbench_compression(2000, d=10): {bench}")


def test_cli_sends_seeds_by_default_and_full_shares_with_no_compress():
    from dpsketch.client_sdk.cli import _parser

    base = ["--study", "ab" * 32, "--servers", "http://a,http://b", "x.csv"]
    assert _parser().parse_args(base).compress is True
    assert _parser().parse_args(base + ["--compress"]).compress is True
    assert _parser().parse_args(base + ["--no-compress"]).compress is False
