"""The submission journal (client_sdk/journal.py), fast: against the in-process fake servers of
test_sdk_unit.py. The same over real servers, with real processes killed by SIGKILL, SIGINT and
SIGTERM, is tests/test_resubmission.py."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from dpsketch.client_sdk import (
    IncompleteUpload,
    InputChanged,
    InvalidDataError,
    ProblemError,
    ResumeMismatch,
    SDKError,
    prepare_batch,
)
from dpsketch.client_sdk.journal import Journal, batch_key, fingerprint_rows
from dpsketch.protocol.keystream import Keystream
from test_sdk_unit import COLUMNS, SERVER_IDS, _client, fakes, study  # noqa: F401 (fixtures)


def _held(servers) -> list[set[bytes]]:
    return [set(servers[f"{s}.test"].held) for s in SERVER_IDS]


def _requests(servers) -> int:
    return sum(servers[f"{s}.test"].upload_requests for s in SERVER_IDS)


@pytest.mark.parametrize("compress", [False, True])
def test_a_batch_key_rebuilds_the_batch_byte_for_byte(study, compress):
    rows = np.random.default_rng(1).normal(size=(50, study.d))  # test data
    key = os.urandom(32)

    def build(index: int):
        return prepare_batch(study, rows, compress, full=index % 3, stream=Keystream.from_key(batch_key(key, index)))

    a, b, other = build(4), build(4), build(5)
    assert a.report_ids == b.report_ids
    assert all(a.body(j) == b.body(j) for j in range(3))  # noise, shares, seeds and salts alike
    assert not set(a.report_ids) & set(other.report_ids)  # another batch, other randomness
    fresh = prepare_batch(study, rows, compress)  # no key: os.urandom, as before
    assert not set(fresh.report_ids) & set(a.report_ids)


def test_fingerprint_does_not_depend_on_the_batches(study):
    rows = np.random.default_rng(2).normal(size=(100, study.d))
    assert fingerprint_rows([rows]) == fingerprint_rows([rows[:33], rows[33:]])
    changed = rows.copy()
    changed[99, 3] += 1e-12
    assert fingerprint_rows([rows]) != fingerprint_rows([changed])


def test_rerun_after_an_incomplete_upload_stores_each_row_once(study, fakes, tmp_path):
    servers, transport = fakes
    rows = np.random.default_rng(3).normal(size=(95, study.d))
    servers["s2.test"].fail = [503] * 3  # batch 0 fails for good at s2; the run aborts
    with _client(transport, max_retries=2, journal=tmp_path) as c:
        with pytest.raises(IncompleteUpload, match="run the same submission again") as err:
            c.submit_many(study.study_id, rows, batch_size=10)
        held = _held(servers)
        assert len(held[1]) < len(held[0])  # s1 holds reports s2 lacks
        # the journal (mode 0600) holds the key and the batches every server acknowledged
        (entry,) = Journal(tmp_path).entries()
        assert stat.S_IMODE(os.stat(entry.file).st_mode) == 0o600 and entry.key is not None
        assert entry.batch_size == 10 and 0 not in entry.done and str(entry.file) == err.value.journal
        before = _requests(servers)
        # run again, asking for another batch size: the submission keeps the one it started with
        result = c.submit_many(study.study_id, rows, batch_size=7)
    assert result.n_reports == 95 and result.skipped == sum(entry.done.values())
    held = _held(servers)
    assert held[0] == held[1] == held[2] and len(held[0]) == 95  # each row once, everywhere
    assert set(bytes.fromhex(h) for h in result) <= held[0]
    assert sum(result.duplicates.values()) > 0  # the partly stored batches came back as duplicates
    # batches every server held were not sent again
    assert _requests(servers) - before == 3 * (10 - len(entry.done))
    # complete: the key is gone from the file, and a further run sends nothing
    header = json.loads(entry.file.read_text().splitlines()[0])
    assert header["complete"] and header["key"] is None and header["n_rows"] == 95
    with _client(transport, journal=tmp_path) as c:
        again = c.submit_many(study.study_id, rows, batch_size=10)
        assert again.already_complete and again.n_reports == 95 and len(again) == 0
        assert _held(servers)[0] == held[0]
        fresh = c.submit_many(study.study_id, rows, batch_size=10, new_submission=True)
    assert fresh.n_reports == 95 and len(_held(servers)[0]) == 190  # asked for: new reports


def test_the_key_is_on_disk_before_the_first_share_leaves(study, fakes, tmp_path):
    servers, transport = fakes
    seen = []
    real = servers["s1.test"].handle

    def spy(request):
        if request.url.path.endswith("/batches"):
            seen.append([e.key for e in Journal(tmp_path).entries()])
        return real(request)

    servers["s1.test"].handle = spy
    with _client(transport, journal=tmp_path) as c:
        c.submit_many(study.study_id, np.zeros((30, study.d)), batch_size=10)
    assert len(seen) == 3 and all(len(keys) == 1 and keys[0] is not None for keys in seen)


def test_a_changed_file_is_refused_before_anything_is_sent(study, fakes, tmp_path):
    servers, transport = fakes
    csv = tmp_path / "rows.csv"
    rows = np.random.default_rng(5).normal(size=(40, study.d))
    np.savetxt(csv, rows, delimiter=",", header=",".join(COLUMNS), comments="", fmt="%.17g")
    journal = tmp_path / "journal"
    servers["s3.test"].fail = [422]  # refused at s3: the submission stays unfinished
    with _client(transport, journal=journal) as c:
        with pytest.raises((IncompleteUpload, ProblemError)):
            c.submit_many(study.study_id, csv, batch_size=10)
        np.savetxt(csv, rows[:-1], delimiter=",", header=",".join(COLUMNS), comments="", fmt="%.17g")
        before = _requests(servers)
        with pytest.raises(InputChanged, match="changed since an unfinished submission"):
            c.submit_many(study.study_id, csv, batch_size=10)
        assert _requests(servers) == before  # nothing sent
        result = c.submit_many(study.study_id, csv, batch_size=10, new_submission=True)
    assert result.n_reports == 39
    (entry,) = Journal(journal).entries()  # the unfinished one (and its key) is forgotten
    assert entry.complete and entry.key is None


def test_iterators_get_no_journal(study, fakes, tmp_path):
    servers, transport = fakes
    with _client(transport, journal=tmp_path) as c:
        result = c.submit_many(study.study_id, iter(np.zeros((20, study.d))), batch_size=10)
    assert result.journal is None and result.n_reports == 20 and not Journal(tmp_path).entries()


def test_without_a_journal_every_call_is_a_new_submission(study, fakes, tmp_path):
    servers, transport = fakes
    rows = np.zeros((20, study.d))
    with _client(transport, journal=False) as c:
        c.submit_many(study.study_id, rows)
        c.submit_many(study.study_id, rows)
    assert len(_held(servers)[0]) == 40


def test_non_finite_values_are_refused_naming_row_and_column(study, fakes, tmp_path):
    servers, transport = fakes
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame(np.zeros((30, study.d)), columns=list(reversed(COLUMNS)))
    frame.loc[17, "income"] = float("nan")
    csv = tmp_path / "rows.csv"
    csv.write_text(",".join(COLUMNS) + "\n" + "0,0,0,0\n" * 25 + "0,-inf,0,0\n")
    with _client(transport, journal=tmp_path) as c:
        with pytest.raises(InvalidDataError, match=r"row 17 column 1 \(income\) is nan"):
            c.submit_many(study.study_id, frame, batch_size=10)
        with pytest.raises(InvalidDataError, match=r"rows.csv line 27, column income: '-inf' is not a finite"):
            c.submit_many(study.study_id, csv, batch_size=10)
        with pytest.raises(InvalidDataError, match=r"row 0 column 3 \(y\) is inf"):
            c.submit(study.study_id, [0, 0, 0, float("inf")])
    assert _requests(servers) == 0


def test_a_rerun_that_would_build_other_reports_is_refused(study, fakes, tmp_path):
    """As if the SDK had changed between the runs: the journal's key no longer rebuilds batch 0."""
    servers, transport = fakes
    rows = np.random.default_rng(6).normal(size=(30, study.d))
    servers["s3.test"].fail = [422]
    with _client(transport, journal=tmp_path) as c:
        with pytest.raises((IncompleteUpload, ProblemError)):
            c.submit_many(study.study_id, rows, batch_size=10)
        (entry,) = Journal(tmp_path).entries()
        assert entry.first_ids is not None
        lines = entry.file.read_text().splitlines()
        header = json.loads(lines[0])
        header["key"] = os.urandom(32).hex()
        entry.file.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
        before = _requests(servers)
        with pytest.raises(ResumeMismatch, match="resuming would count rows twice"):
            c.submit_many(study.study_id, rows, batch_size=10)
        assert _requests(servers) == before
        entry.file.write_text("not a journal")
        with pytest.raises(SDKError, match="is unreadable"):
            c.submit_many(study.study_id, rows, batch_size=10)
        assert _requests(servers) == before
