"""Reading some records of a stored batch (services/backend.py ``read_slices``): a record at a
time (SQLite's incremental blob I/O, PostgreSQL's ``substring``) when the records wanted are few
for the column's size, the whole column in one read and a numpy pick when they are many
(services/batches.py ``SLICE_READ_BYTES``; issue 46: a 10^6-report commit spent 0.09 s of its
0.2 s of CPU reading back 3 % excluded records one by one on SQLite, and on PostgreSQL most of a
commit's 0.75-0.92 s in two substrings a record). PostgreSQL decides column by column, so a batch
can have its ids read whole and its shares by slices. Every way gives exactly the records asked
for, in order."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dpsketch.services import backend as backends
from dpsketch.services import batches, db


def _stored_batch(conn, backend, m: int, width: int, pseudonyms: bool) -> tuple[bytes, bytes, bytes | None]:
    ids, shares = os.urandom(16 * m), os.urandom(width * m)
    names = os.urandom(16 * m) if pseudonyms else None
    conn.execute("INSERT INTO studies (seq, study_id, canonical, created_at) VALUES (?, ?, ?, ?)",
                 (1, "x", b"{}", 0.0))
    batches.insert(conn, backend, 100, 1, ids, shares, names, 0 if pseudonyms else None)
    return ids, shares, names


def _records(blob: bytes, offsets: list[int], width: int) -> bytes:
    return b"".join(blob[width * o:width * o + width] for o in offsets)


@pytest.mark.parametrize("wanted", [3, 40, 1999])  # 3 x 4 KiB is below the 64 KB share column; 40 and 1999 above
def test_few_or_many_records_read_back_exactly(tmp_path, wanted):
    m, width = 2000, 32
    path = tmp_path / "slices.sqlite3"
    conn = db.initialise(path, 5.0)
    backend = backends.SqliteBackend(path, 5.0)
    ids, shares, _ = _stored_batch(conn, backend, m, width, False)
    offsets = sorted(np.random.default_rng(wanted).choice(m, size=wanted, replace=False).tolist())
    dense = wanted * batches.SLICE_READ_BYTES >= width * m
    assert dense == (wanted > 3)
    got_ids, got_shares, pseudonyms, party = backend.read_slices(conn, 100, m, offsets)
    assert got_ids == _records(ids, offsets, 16)
    assert got_shares == _records(shares, offsets, width)
    assert (pseudonyms, party) == (None, None)
    conn.close()


# m = 2000: the ids (32 KB) and pseudonyms are read whole from 8 records wanted on, a column of
# 800-byte shares (1.6 MB) from 391 on; 3 wants every column by slices, 40 the ids whole and the
# shares by slices, 1999 every column whole
@pytest.mark.parametrize("wanted", [3, 40, 1999])
@pytest.mark.parametrize("pseudonyms", [False, True])
def test_postgres_reads_each_column_whole_or_by_slices_exactly(postgres, wanted, pseudonyms):
    m, width = 2000, 800
    url = postgres.new_database(f"slices_{wanted}_{int(pseudonyms)}")
    backend = backends.PostgresBackend(url, 5.0)
    conn = backend.initialise()
    try:
        ids, shares, names = _stored_batch(conn, backend, m, width, pseudonyms)
        offsets = sorted(np.random.default_rng(wanted).choice(m, size=wanted, replace=False).tolist())
        whole = [wanted * batches.SLICE_READ_BYTES >= size for size in (16 * m, width * m)]
        assert whole == {3: [False, False], 40: [True, False], 1999: [True, True]}[wanted]
        got_ids, got_shares, got_names, party = backend.read_slices(conn, 100, m, offsets)
        assert got_ids == _records(ids, offsets, 16)
        assert got_shares == _records(shares, offsets, width)
        assert got_names == (None if names is None else _records(names, offsets, 16))
        assert party == (0 if pseudonyms else None)
    finally:
        backend.close(conn)
        postgres.drop_databases()
