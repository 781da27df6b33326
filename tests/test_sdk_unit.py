"""Client SDK, pure and fast: noise, clipping, sharing, data parsing, and the client's HTTP logic
(verification, retries, partial failures) against in-process fake servers (httpx.MockTransport).
The same behaviour over real HTTP against real share servers is in test_sdk_http.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
from scipy import stats

from dpsketch.client_sdk import (
    Client,
    IncompleteUpload,
    InvalidDataError,
    ProblemError,
    ServerUnreachable,
    StudyMismatch,
    prepare_batch,
)
from dpsketch.client_sdk import cli, data
from dpsketch.protocol import report as report_path
from dpsketch.client_sdk.upload import batch_rows, default_batch_rows
from dpsketch.protocol import binding, messages, report, ring
from dpsketch.protocol import noise as sampler
from dpsketch.protocol.study import NOISE_TAIL_SIGMAS, PROTOCOL, design

COLUMNS = ["age", "income", "score", "y"]
SERVER_IDS = ["s1", "s2", "s3"]


@pytest.fixture(scope="module")
def study():
    s, _ = design(name="unit", columns=COLUMNS, label="y", servers=SERVER_IDS,
                  expected_reports=10_000, k=8, s=2, min_reports=5_000, row_bound=10.0,
                  epsilon=1.0, delta=1e-6)
    return s


# --- noise ------------------------------------------------------------------------------------


def test_tail_delta_is_negligible_and_checked(monkeypatch):
    from dpsketch.protocol import privacy

    # T = 20: p = 5.5e-89 per coordinate; even epsilon = 100 over 2^40 reports x 33153 values
    # (the largest study the schema allows) stays far below 1e-6 delta for delta = 1e-12
    assert privacy.tail_delta(1.0, 10**7 * 78, NOISE_TAIL_SIGMAS) < 1e-70
    assert privacy.tail_delta(100.0, (1 << 40) * 33153, NOISE_TAIL_SIGMAS) < 1e-24
    # a cut at 8 sigma (what a 53-bit grid alone gives) would cost a third of delta = 1e-6
    assert privacy.tail_delta(1.0, 10**7 * 78, 8.0) > 3e-7
    # and a study whose truncation could matter is refused
    monkeypatch.setattr(sampler, "NOISE_TAIL_SIGMAS", 8.0)
    with pytest.raises(ValueError, match="redrawing noise"):
        design(name="x", columns=["a", "b"], label=None, servers=["s1", "s2"], expected_reports=10**6,
               epsilon=1.0, delta=1e-6)


def test_clip_rows():
    a = np.array([[3.0, 4.0, 0.0], [0.1, -0.2, 0.3], [1e200, -1e200, 0.0], [0.0, 0.0, 0.0],
                  [-7.0, 0.0, 0.0]])
    c = report_path.clip_rows(a, 1.0)
    norms = report_path.row_norms(c)
    assert np.all(norms <= 1.0)
    assert np.allclose(c[0], [0.6, 0.8, 0.0])
    assert np.array_equal(c[1], a[1])  # inside the ball: untouched
    assert np.allclose(c[2], [np.sqrt(0.5), -np.sqrt(0.5), 0.0])  # no overflow to inf
    assert np.array_equal(c[3], a[3])
    assert np.allclose(c[4], [-1.0, 0.0, 0.0])
    rng = np.random.default_rng(0)  # test data only
    big = rng.normal(size=(10_000, 7)) * rng.uniform(0.1, 1e6, size=(10_000, 1))
    c = report_path.clip_rows(big, 3.0)
    assert np.all(report_path.row_norms(c) <= 3.0)
    # direction is kept
    cos = np.sum(c * big, axis=1) / (report_path.row_norms(c) * report_path.row_norms(big))
    assert np.allclose(cos, 1.0)


def test_privatized_rows_always_encode(study, monkeypatch):
    """Worst case: a row on the boundary plus noise at the cut (20 sigma less a grid step) still
    encodes within the study's value bound."""
    B, d = study.row_bound, study.d
    rows = np.zeros((4, d))
    rows[0, 0] = B
    rows[1, 0] = -1e9
    rows[2] = 1e9
    rows[3, 1] = B * (1 + 1e-15)
    grid = study.noise_grid

    def extreme(shape, std, grid_, stream=None):
        signs = np.where(np.arange(shape[1]) % 2, -1, 1)
        return np.broadcast_to(signs * (grid_.limit(std) << grid_.shift), shape).astype(np.int64)

    monkeypatch.setattr(report, "encoded_noise", extreme)
    noisy = report_path.privatize(rows, study)
    assert np.abs(noisy).max() <= study.value_bound
    assert np.abs(noisy).max() > study.value_bound - 2 * grid.spacing - B  # the cut was reached


# --- sharing ----------------------------------------------------------------------------------


def test_shares_reconstruct_exactly_to_the_encoded_noisy_rows(study, monkeypatch):
    rng = np.random.default_rng(2)  # test data and a known stand-in noise, not the SDK's
    rows = rng.normal(scale=8.0, size=(500, study.d))
    grid = study.noise_grid
    known = rng.integers(-3 * grid.scale(study.sigma), 3 * grid.scale(study.sigma), size=rows.shape) << grid.shift
    monkeypatch.setattr(report, "encoded_noise", lambda shape, std, grid_, stream=None: known)
    batch = prepare_batch(study, rows)
    encoded = ring.encode_on_grid(report_path.clip_rows(rows, study.clip_bound), study.frac_bits, grid.shift,
                                  study.row_bound)
    assert len(batch.shares) == study.n_servers == 3
    # design()'s sketch study signs each row whole with a secret +-1 before the noise: the shares
    # reconstruct to +-(the encoded clipped row) + the noise, exactly (negation is exact on the grid)
    assert study.secret_sign
    got = ring.reconstruct(batch.shares).view(np.int64) - known
    kept = np.all(got == encoded, axis=1)
    flipped = np.all(got == -encoded, axis=1)
    assert np.all(kept | flipped) and 150 < flipped.sum() < 350
    assert len(set(batch.report_ids)) == 500 and all(len(r) == 16 for r in batch.report_ids)
    for j in range(3):
        upload = messages.decode_batch(batch.body(j), study.d, study.n_servers)
        assert upload.ids == batch.report_ids
        assert np.array_equal(upload.payloads, batch.shares[j])
        upload.verify(study.study_id, study.n_servers, j)  # bound to its ids at server j ...
        with pytest.raises(binding.BindingError):  # ... and only there
            upload.verify(study.study_id, study.n_servers, (j + 1) % 3)


def test_real_noise_is_added_and_bounded(study):
    rows = np.zeros((20_000, study.d))
    batch = prepare_batch(study, rows)
    noisy = ring.decode(ring.reconstruct(batch.shares), study.frac_bits)
    assert abs(noisy.std() / study.sigma - 1) < 0.02
    assert np.abs(noisy).max() <= study.value_bound


def _top_bits(x: np.ndarray, bits: int) -> np.ndarray:
    return (x >> np.uint64(64 - bits)).astype(np.int64).ravel()


def test_any_n_minus_1_shares_look_uniform_and_independent_of_the_row(study):
    """The shares come from the SDK's CSPRNG, so every p-value below is a fresh draw: 14
    chi-square tests at p > 1e-7 fail correct shares in 1.4e-6 of runs (at 1e-5: 1.4e-4), and the
    384 bit frequencies at 6 standard errors in 8e-7; non-uniform or row-dependent shares give
    p-values near 0 over 80,000 values."""
    m = 20_000
    same = np.tile([[9.0, -3.0, 0.5, 1.0]], (m, 1))
    different = np.random.default_rng(3).normal(scale=5, size=(m, study.d))
    b_same, b_diff = prepare_batch(study, same), prepare_batch(study, different)
    for batch in (b_same, b_diff):
        for j in range(3):
            s = batch.shares[j]
            # chi-square on the top 4 bits
            counts = np.bincount(_top_bits(s, 4), minlength=16)
            assert stats.chisquare(counts).pvalue > 1e-7
            # every bit position is 1 about half of the time
            bits = np.unpackbits(s.view(np.uint8)).reshape(-1, 64).mean(axis=0)
            assert np.all(np.abs(bits - 0.5) < 6 * 0.5 / np.sqrt(s.size))
        for i, j in ((0, 1), (0, 2), (1, 2)):  # any two of three shares jointly uniform
            joint = _top_bits(batch.shares[i], 2) * 4 + _top_bits(batch.shares[j], 2)
            assert stats.chisquare(np.bincount(joint, minlength=16)).pvalue > 1e-7
    # the same row repeated vs different rows: N-1 shares indistinguishable (incl. the last one)
    for j in (0, 2):
        table = np.vstack([np.bincount(_top_bits(b.shares[j], 5), minlength=32)
                           for b in (b_same, b_diff)])
        assert stats.chi2_contingency(table).pvalue > 1e-7


# --- data -------------------------------------------------------------------------------------


def _write(tmp_path: Path, text: str, name: str = "rows.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_csv_reorders_columns_and_chunks(tmp_path):
    lines = ["y,score,income,age"] + [f"{i},{i * 10},{i * 100},{i * 1000}" for i in range(10)]
    p = _write(tmp_path, "\ufeff" + "\n".join(lines) + "\n\n")
    chunks = list(data.read_csv(p, COLUMNS, chunk_size=3))
    assert [len(c) for c in chunks] == [3, 3, 3, 1]
    a = np.vstack(chunks)
    assert np.array_equal(a[:, 0], np.arange(10) * 1000.0)  # age
    assert np.array_equal(a[:, 3], np.arange(10) * 1.0)  # y
    assert data.scan_csv(p, COLUMNS) == 10


@pytest.mark.parametrize("text, message", [
    ("age,income,score\n1,2,3\n", "missing column(s) y"),
    ("age,income,score,y,zip\n1,2,3,4,5\n", "unknown column(s) zip"),
    ("age,income,score,y,age\n1,2,3,4,5\n", "duplicate columns: age"),
    ("age,income,score,y\n1,2,3,4\n1,2,x,4\n", "line 3, column score: 'x' is not a number"),
    ("age,income,score,y\n1,2,3,nan\n", "line 2, column y: 'nan' is not a finite number"),
    ("age,income,score,y\n1,2,3,inf\n", "not a finite number"),
    ("age,income,score,y\n1,2,3\n", "line 2: 3 fields, the header has 4"),
    ("age,income,score,y\n1,2,,4\n", "'' is not a number"),
    ("", "empty file"),
])
def test_csv_errors_name_the_problem(tmp_path, text, message):
    p = _write(tmp_path, text)
    with pytest.raises(InvalidDataError) as err:
        data.scan_csv(p, COLUMNS)
    assert message in str(err.value)


def test_csv_extra_columns_can_be_ignored(tmp_path):
    p = _write(tmp_path, "id,y,age,income,score\n77,4,1,2,3\n")
    (a,) = data.read_csv(p, COLUMNS, ignore_extra=True)
    assert a.tolist() == [[1.0, 2.0, 3.0, 4.0]]


class FakeFrame:
    """Duck-typed DataFrame: what the SDK relies on, without importing pandas."""

    def __init__(self, columns, matrix):
        self.columns, self._m = columns, np.asarray(matrix)

    def to_numpy(self):
        return self._m


def test_inputs_of_every_kind():
    m = np.arange(8.0).reshape(2, 4)
    want = m.tolist()
    assert np.vstack(list(data.iter_chunks(m, COLUMNS, 1))).tolist() == want
    frame = FakeFrame(["y", "age", "score", "income"], m[:, [3, 0, 2, 1]])
    assert np.vstack(list(data.iter_chunks(frame, COLUMNS, 10))).tolist() == want
    rec = np.zeros(2, dtype=[("income", "f8"), ("age", "f8"), ("y", "f4"), ("score", "i8")])
    for c, j in zip(COLUMNS, range(4)):
        rec[c] = m[:, j]
    assert np.vstack(list(data.iter_chunks(rec, COLUMNS, 10))).tolist() == want
    dicts = [dict(zip(COLUMNS, r)) for r in want]
    assert np.vstack(list(data.iter_chunks(iter(dicts), COLUMNS, 1))).tolist() == want
    assert np.vstack(list(data.iter_chunks((r for r in want), COLUMNS, 5))).tolist() == want
    assert data.row_vector({"y": 3, "score": 2, "income": 1, "age": 0}, COLUMNS).tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("bad, message", [
    (np.zeros((3, 5)), "must have 4 values"),
    (np.zeros(4), "2-D"),
    (np.array([[1.0, 2, 3, np.nan]]), "row 0 column 3 (y) is nan"),
    ([[1, 2, 3, 4], [1, 2, 3]], "row 1 has 3 values"),
    (FakeFrame(["age", "income", "score"], np.zeros((1, 3))), "missing column(s) y"),
    ([[1, 2, 3, "x"]], "must be numbers"),
])
def test_bad_inputs_are_refused(bad, message):
    with pytest.raises(InvalidDataError) as err:
        list(data.iter_chunks(bad, COLUMNS, 10))
    assert message in str(err.value)


# --- the client against in-process fake servers ------------------------------------------------


class FakeServer:
    """Just enough of docs/protocol.md section 6 to exercise the client logic."""

    def __init__(self, server_id, study):
        self.server_id, self.study = server_id, study
        self.held: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self.upload_requests = 0
        self.media_types: list[str] = []  # of each batch request, in order
        self.fail: list = []  # queued failures: a status int, an exception, or ("lose", exc)
        self.max_records: int | None = None
        self.status = "open"
        self.tamper = None

    def study_info(self):
        body = self.study.model_dump(mode="json")
        if self.tamper:
            body.update(self.tamper)
        return {"study_id": self.study.study_id, "server_id": self.server_id, "status": self.status,
                "report_count": len(self.held), "study": body, "commit": None}

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/info":
            return httpx.Response(200, json={"server_id": self.server_id, "protocol": PROTOCOL,
                                             "version": "fake"})
        sid = self.study.study_id
        if path == f"/v1/studies/{sid}" and request.method == "GET":
            return httpx.Response(200, json=self.study_info())
        if path.startswith("/v1/studies/") and path.count("/") == 3:
            return _problem(404, "unknown-study", "no such study")
        if request.method == "POST" and path in (f"/v1/studies/{sid}/batches",
                                                 f"/v1/studies/{sid}/reports"):
            self.upload_requests += 1
            lose = None
            if self.fail:
                f = self.fail.pop(0)
                if isinstance(f, int):
                    return _problem(f, {503: "unavailable", 500: "internal-error", 429: "unavailable",
                                        422: "invalid-request"}[f], "injected",
                                    headers={"Retry-After": "0"})
                if isinstance(f, tuple):
                    lose = f[1]
                else:
                    raise f
            if path.endswith("/batches"):
                media_type = request.headers["content-type"]
                self.media_types.append(media_type)
                assert media_type in (messages.SHARES_MEDIA_TYPE, messages.SEEDS_MEDIA_TYPE)
                upload = messages.decode_upload(request.content, media_type, self.study.d, self.study.n_servers)
                if self.max_records and len(upload) > self.max_records:
                    return _problem(413, "payload-too-large", "too many")
            else:
                r = messages.Report.model_validate(json.loads(request.content))
                upload = r.upload(self.study.d, self.study.n_servers)
            upload.verify(self.study.study_id, self.study.n_servers, self.study.servers.index(self.server_id))
            ids, shares = upload.ids, upload.shares(self.study.d)
            with self.lock:
                new = dup = 0
                for rid, s in zip(ids, shares):
                    b = np.asarray(s, "<u8").tobytes()
                    if rid in self.held:
                        if self.held[rid] != b:
                            return _problem(409, "report-conflict", rid.hex())
                        dup += 1
                    else:
                        new += 1
                for rid, s in zip(ids, shares):
                    self.held[rid] = np.asarray(s, "<u8").tobytes()
            if lose is not None:
                raise lose  # stored, but the answer never arrives
            return httpx.Response(200, json={"accepted": new, "duplicates": dup,
                                             "report_count": len(self.held)})
        return _problem(404, "not-found", path)


def _problem(status, slug, detail, headers=None):
    return httpx.Response(status, headers=headers, json={
        "type": f"urn:dpsketch:problem:{slug}", "title": slug, "status": status, "detail": detail})


@pytest.fixture
def fakes(study):
    servers = {f"{sid}.test": FakeServer(sid, study) for sid in SERVER_IDS}
    servers["alias.test"] = servers["s1.test"]  # a second name for server s1

    def handler(request):
        return servers[request.url.host].handle(request)

    return servers, httpx.MockTransport(handler)


def _client(transport, hosts=("s1", "s2", "s3"), **kw):
    kw.setdefault("backoff", 0.001)
    return Client([f"http://{h}.test" for h in hosts], transport=transport, **kw)


def test_submit_and_submit_many_store_every_report_everywhere(study, fakes):
    servers, transport = fakes
    rows = np.random.default_rng(4).normal(size=(2_345, study.d))
    seen = []
    with _client(transport) as c:
        rid = c.submit(study.study_id, rows[0])
        ids = c.submit_many(study.study_id, rows, batch_size=500, progress=seen.append)
        assert c.report_counts(study.study_id) == {"s1": 2346, "s2": 2346, "s3": 2346}
    assert len(rid) == 32 and len(ids) == 2345 and len(set(ids) | {rid}) == 2346
    assert sum(seen) == 2345 and ids.n_reports == 2345
    assert ids.report_counts == {"s1": 2346, "s2": 2346, "s3": 2346}
    # every server holds the same ids; the shares add up to the (noisy) rows
    held = [servers[f"{s}.test"].held for s in SERVER_IDS]
    assert set(held[0]) == set(held[1]) == set(held[2])
    for rid_hex in ids[:50]:
        r = bytes.fromhex(rid_hex)
        x = ring.decode(ring.reconstruct([np.frombuffer(h[r], "<u8") for h in held]), study.frac_bits)
        assert np.all(np.abs(x) <= study.value_bound)
    # 5 batches per server, not one request per row
    assert [servers[f"{s}.test"].upload_requests for s in SERVER_IDS] == [6, 6, 6]


def test_invalid_rows_are_refused_before_anything_is_sent(study, fakes):
    servers, transport = fakes
    rows = np.zeros((100, study.d))
    rows[77, 2] = np.inf
    with _client(transport) as c:
        with pytest.raises(ValueError, match="row 77 column 2"):
            c.submit_many(study.study_id, rows, batch_size=10)
        with pytest.raises(ValueError, match="must have 4 values"):
            c.submit_many(study.study_id, np.zeros((5, 3)))
        with pytest.raises(ValueError, match="4 values"):
            c.submit(study.study_id, [1.0, 2.0])
        with pytest.raises(ValueError, match="nan"):
            c.submit(study.study_id, [1.0, 2.0, float("nan"), 0])
    assert all(s.upload_requests == 0 for s in servers.values())


def test_streamed_bad_row_reports_what_was_already_sent(study, fakes):
    servers, transport = fakes
    rows = [[0.0] * 4] * 25 + [[0.0, 0.0, float("nan"), 0.0]]
    with _client(transport) as c:
        with pytest.raises(InvalidDataError, match=r"row 25 column 2 \(score\) is nan.*20 earlier rows were already submitted") as err:
            c.submit_many(study.study_id, iter(rows), batch_size=10)
    assert len(err.value.report_ids) == 20  # two whole batches went out before the bad chunk


def test_study_verification(study, fakes):
    servers, transport = fakes
    with _client(transport) as c:
        assert c.study(study.study_id) == study
    with pytest.raises(StudyMismatch, match="URL 1 .* is server 's2'.*order: s1, s2, s3"):
        _client(transport, ("s2", "s1", "s3")).study(study.study_id)
    with pytest.raises(StudyMismatch, match="2 URLs were given"):
        _client(transport, ("s1", "s2")).study(study.study_id)
    with pytest.raises(StudyMismatch, match="listed twice"):
        _client(transport, ("s1", "s1", "s3"))
    with pytest.raises(StudyMismatch, match="is server 's1'"):  # two names for one server
        _client(transport, ("s1", "alias", "s3")).study(study.study_id)
    servers["s3.test"].tamper = {"name": "not the study you asked for"}
    with pytest.raises(StudyMismatch, match="holds different parameters"):
        _client(transport).study(study.study_id)
    servers["s3.test"].tamper = {"sigma": study.sigma / 10}  # fails calibration check
    with pytest.raises(StudyMismatch, match="fail the protocol's checks"):
        _client(transport).study(study.study_id)
    servers["s3.test"].tamper = None
    with pytest.raises(ProblemError) as err:
        _client(transport).study("0" * 64)
    assert err.value.slug == "unknown-study"
    with pytest.raises(ValueError):
        _client(transport).study("not-an-id")
    assert all(s.upload_requests == 0 for s in servers.values())


def test_committed_study_is_refused_before_sending(study, fakes):
    servers, transport = fakes
    servers["s2.test"].status = "committed"
    with _client(transport) as c, pytest.raises(ProblemError) as err:
        c.submit(study.study_id, [0, 0, 0, 0])
    assert err.value.slug == "study-closed"
    assert all(s.upload_requests == 0 for s in servers.values())


def test_retries_on_5xx_429_and_transport_errors(study, fakes):
    servers, transport = fakes
    servers["s1.test"].fail = [503, 429, 500]
    servers["s2.test"].fail = [httpx.ConnectError("refused"), httpx.ReadTimeout("slow")]
    servers["s3.test"].fail = [("lose", httpx.ReadTimeout("answer lost"))]  # stored, then lost
    with _client(transport, max_retries=3) as c:
        ids = c.submit_many(study.study_id, np.zeros((10, study.d)), batch_size=10)
        assert c.report_counts(study.study_id) == {"s1": 10, "s2": 10, "s3": 10}
    assert len(ids) == 10
    assert ids.duplicates == {"s1": 0, "s2": 0, "s3": 10}  # the retry was acknowledged, not recounted
    assert [servers[f"{s}.test"].upload_requests for s in SERVER_IDS] == [4, 3, 2]


def test_client_errors_are_not_retried(study, fakes):
    servers, transport = fakes
    for s in SERVER_IDS:
        servers[f"{s}.test"].fail = [422]
    with _client(transport) as c, pytest.raises(ProblemError) as err:
        c.submit_many(study.study_id, np.zeros((3, study.d)))
    assert err.value.slug == "invalid-request" and err.value.detail == "injected"
    assert err.value.url in {"http://s1.test", "http://s2.test", "http://s3.test"}
    # one attempt at most (after the first refusal the run aborts; others may not have sent yet)
    assert all(servers[f"{s}.test"].upload_requests <= 1 for s in SERVER_IDS)


def test_retry_after_is_honoured():
    c = Client(["http://a.test", "http://b.test"], backoff=0.01, max_retry_after=60)
    assert 7 <= c._delay(0, "7") <= 7.01
    assert c._delay(0, "3600") == 60
    assert c._delay(0, "Wed, 21 Oct 2015 07:28:00 GMT") <= 0.01  # in the past
    assert c._delay(0, "garbage") <= 0.01
    assert 0.005 <= c._delay(0, None) <= 0.01
    assert c._delay(30, None) <= c.max_backoff
    c.close()


def test_permanent_failure_at_one_server_is_surfaced_and_resendable(study, fakes):
    servers, transport = fakes
    servers["s2.test"].fail = [503, 503, 503]  # batch 0 fails for good at s2 (3 attempts)
    rows = np.zeros((40, study.d))
    with _client(transport, max_retries=2, backoff=0.05) as c:
        with pytest.raises(IncompleteUpload) as err:
            c.submit_many(study.study_id, rows, batch_size=10)
        exc = err.value
        assert exc.problem is not None and exc.problem.slug == "unavailable"
        assert exc.failures[0].server_id == "s2" and exc.failures[0].batch_index == 0
        assert "missing at server(s)" in str(exc)
        missing_at_s2 = {p.batch_index for p in exc.pending if p.server_id == "s2"}
        assert 0 in missing_at_s2
        assert len(exc.report_ids) == exc.rows_prepared
        # the other servers hold reports s2 lacks: a report counts only if all hold it
        assert len(servers["s2.test"].held) < len(servers["s1.test"].held)
        c.resend(study.study_id, exc.pending)  # s2 is healthy again
        counts = c.report_counts(study.study_id)
    assert counts["s1"] == counts["s2"] == counts["s3"] == exc.rows_prepared
    assert set(servers["s1.test"].held) == set(servers["s2.test"].held) == set(servers["s3.test"].held)


def test_unreachable_everywhere_is_a_plain_error(study):
    def down(request):
        raise httpx.ConnectError("connection refused")

    c = _client(httpx.MockTransport(down), max_retries=1)
    with pytest.raises(ServerUnreachable, match="s1.test.*after 2 attempts"):
        c.study(study.study_id)
    c.close()


def test_single_submit_partial_failure(study, fakes):
    servers, transport = fakes
    servers["s3.test"].fail = [422]
    with _client(transport) as c, pytest.raises(IncompleteUpload) as err:
        c.submit(study.study_id, [1, 2, 3, 4])
    assert [p.server_id for p in err.value.pending] == ["s3"]
    assert len(servers["s1.test"].held) == 1 and len(servers["s3.test"].held) == 0


def test_default_batches_fill_8_mib_of_the_largest_body_and_limits_hold():
    full = messages.record_bytes(messages.SHARES_MEDIA_TYPE, 32, 3)
    assert batch_rows(None, full, 16 << 20) == (8 << 20) // full  # about 26,000 rows at d = 32
    assert default_batch_rows(32, 3) == batch_rows(None, full, 16 << 20)  # what the benches send
    assert batch_rows(None, full, 16 << 20) * full <= 8 << 20 < (batch_rows(None, full, 16 << 20) + 1) * full
    assert batch_rows(None, 40, 16 << 20) == 100_000  # narrow rows: capped in rows
    assert batch_rows(None, 20_000, 16 << 20) == 419  # wide rows: fewer than the 10^4 of before
    assert batch_rows(None, full, 1 << 20) == (1 << 20) // full  # the client's own limit wins
    assert batch_rows(50, full, 16 << 20) == 50 and batch_rows(10**6, full, 1 << 20) == (1 << 20) // full
    assert batch_rows(None, 1 << 30, 16 << 20) == 1  # never no rows
    with pytest.raises(ValueError, match="at least 1"):
        batch_rows(0, full, 16 << 20)


def test_submit_many_sends_default_sized_batches(study, fakes):
    servers, transport = fakes
    n = 60_000
    per_batch = batch_rows(None, messages.record_bytes(messages.SHARES_MEDIA_TYPE, study.width, study.n_servers),
                           16 << 20)
    assert per_batch > 10_000  # narrow rows: more than the fixed 10^4 of before
    with _client(transport) as c:
        ids = c.submit_many(study.study_id, np.zeros((n, study.d)), keep_ids=False)
        assert c.report_counts(study.study_id) == {"s1": n, "s2": n, "s3": n}
    assert ids.n_reports == n
    assert [servers[f"{s}.test"].upload_requests for s in SERVER_IDS] == [-(-n // per_batch)] * 3


@pytest.mark.parametrize("extra_columns, seeded", [([], False), (["z"], True)])
def test_seeds_are_sent_only_where_they_are_smaller_than_the_share(extra_columns, seeded):
    wide, _ = design(name="unit", columns=COLUMNS + extra_columns, label="y", servers=SERVER_IDS,
                     expected_reports=10_000, k=8, s=2, min_reports=5_000, row_bound=10.0,
                     epsilon=1.0, delta=1e-6)
    assert ring.seed_is_smaller(wide.width) == seeded == (wide.width > 4)
    servers = {f"{sid}.test": FakeServer(sid, wide) for sid in SERVER_IDS}
    transport = httpx.MockTransport(lambda request: servers[request.url.host].handle(request))
    with _client(transport) as c:
        c.submit_many(wide.study_id, np.zeros((30, wide.d)), batch_size=10)
        assert c.report_counts(wide.study_id) == {"s1": 30, "s2": 30, "s3": 30}
    got = [servers[f"{sid}.test"].media_types for sid in SERVER_IDS]
    if seeded:  # batch i's full shares at server i mod 3, seeds elsewhere
        assert got == [[messages.SHARES_MEDIA_TYPE if i == j else messages.SEEDS_MEDIA_TYPE for i in range(3)]
                       for j in range(3)]
    else:  # a share of width 4 is 32 bytes, as long as its seed: every server gets its share
        assert got == [[messages.SHARES_MEDIA_TYPE] * 3] * 3


def test_payload_too_large_splits_the_batch(study, fakes):
    servers, transport = fakes
    for s in servers.values():
        s.max_records = 3
    with _client(transport) as c:
        ids = c.submit_many(study.study_id, np.zeros((20, study.d)), batch_size=20)
        assert c.report_counts(study.study_id) == {"s1": 20, "s2": 20, "s3": 20}
    assert len(ids) == 20


def test_keep_ids_false_and_csv_input(study, fakes, tmp_path):
    servers, transport = fakes
    p = _write(tmp_path, "y,age,income,score\n" + "1,2,3,4\n" * 95)
    seen = []
    with _client(transport) as c:
        r = c.submit_many(study.study_id, p, batch_size=10, progress=seen.append, keep_ids=False)
    assert list(r) == [] and r.n_reports == 95 and sum(seen) == 95
    assert all(len(s.held) == 95 for s in servers.values())


# --- command line -------------------------------------------------------------------------------


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--servers" in out and "--batch-size" in out and "exit codes" in out


def test_cli_errors_are_one_line(tmp_path, capsys):
    p = _write(tmp_path, "age,income,score,y\n1,2,3,4\n")
    assert cli.main(["--study", "a" * 64, "--servers", "http://127.0.0.1:9", str(p)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at least two share servers" in err
    code = cli.main(["--study", "a" * 64, "--servers", "http://127.0.0.1:9,http://127.0.0.1:9/",
                     str(p)])
    assert code == 1 and "listed twice" in capsys.readouterr().err
    assert cli.main(["--study", "a" * 64, "--servers", "http://x,http://y", str(tmp_path / "no.csv")]) == 1
    assert "no such file" in capsys.readouterr().err
    code = cli.main(["--study", "a" * 64, "--servers", "http://127.0.0.1:9,http://127.0.0.2:9",
                     "--max-retries", "0", "--timeout", "2", str(p)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err and "127.0.0.1:9" in err


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
def test_a_proxy_in_the_environment_is_still_used(monkeypatch, variable):
    """The SDK makes its pools with trust_env=False only when no proxy variable is set (httpx's
    scan of the environment costs about 1 ms a pool); with one set, every pool routes through it,
    as before. A loopback HTTP server answers the pools made without a proxy; with the variable
    pointing at a closed port, the same request goes to the proxy and fails to connect."""
    import http.server

    from dpsketch.client_sdk import Client

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
                     "all_proxy", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        with Client([url, url + "/b"], journal=False) as plain:
            assert all(not http._mounts and not http.trust_env for http in plain._http)
            assert plain._http[0].get("/v1/info").status_code == 204
        monkeypatch.setenv(variable, "http://127.0.0.1:9")
        with Client([url, url + "/b"], journal=False) as proxied:
            assert all(http.trust_env and http._mounts for http in proxied._http)
            with pytest.raises(httpx.ConnectError):
                proxied._http[0].get("/v1/info")
    finally:
        server.shutdown()
