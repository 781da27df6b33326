"""Reading some records of a stored batch (services/backend.py ``SqliteBackend.read_slices``): a
record at a time by incremental blob I/O when the records wanted are few for the column's size,
the whole column in one read and a numpy pick when they are many (services/batches.py
``SLICE_READ_BYTES``; issue 46: a 10^6-report commit spent 0.09 s of its 0.2 s of CPU reading
back 3 % excluded records one by one). Both ways give exactly the records asked for, in order."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dpsketch.services import backend as backends
from dpsketch.services import batches, db


@pytest.mark.parametrize("wanted", [3, 40, 1999])  # 3 x 4 KiB is below the 64 KB share column; 40 and 1999 above
def test_few_or_many_records_read_back_exactly(tmp_path, wanted):
    m, width = 2000, 32
    path = tmp_path / "slices.sqlite3"
    conn = db.initialise(path, 5.0)
    backend = backends.SqliteBackend(path, 5.0)
    ids = os.urandom(16 * m)
    shares = os.urandom(width * m)
    conn.execute("INSERT INTO studies (seq, study_id, canonical, created_at) VALUES (1, 'x', x'7b7d', 0)")
    batches.insert(conn, backend, 100, 1, ids, shares)
    offsets = sorted(np.random.default_rng(wanted).choice(m, size=wanted, replace=False).tolist())
    dense = wanted * batches.SLICE_READ_BYTES >= width * m
    assert dense == (wanted > 3)
    got_ids, got_shares, pseudonyms, party = backend.read_slices(conn, 100, m, offsets)
    assert got_ids == b"".join(ids[16 * o:16 * o + 16] for o in offsets)
    assert got_shares == b"".join(shares[width * o:width * o + width] for o in offsets)
    assert (pseudonyms, party) == (None, None)
    conn.close()
