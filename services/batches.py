"""Stored reports: one row of ``batches`` per upload batch, for both databases.

Why a row per batch, and not per report: see services/db.py. Everything that reads or writes
stored reports goes through this module, so the rest of the store thinks in report rowids
(report ``first + i`` is the i-th of the batch stored under ``first``) and never in rows.

Reads come in two shapes. A rebuild walks a study's batches in rowid order, a page of whole
batches at a time (:func:`scan`). A commit needs the shares of a few reports spread over every
batch (the excluded 1 %): :func:`read` takes only their slices (SQLite's incremental blob I/O,
PostgreSQL's ``substring`` of an uncompressed value), so it reads about what it returns.

What a batch row's ``shares`` hold: each report's share (8 x width bytes), or, for a batch that
came as seeds (docs/protocol.md section 4: every server but one receives a 32-byte seed by
default), each report's seed, whenever that is smaller (:func:`stores_seeds`: width > 4). The
seed is the share: it expands to it (``ring.expand_seeds``) whenever a share is read back, so a
server stores 32 bytes a report instead of 8 x width (a 25th at d = 100) and writes that
much less through the WAL. A record's length then says which it is (32 bytes is never a share's
length where seeds are stored), and :meth:`Stored.share_matrix` is the one reader of either.
A study with validity proofs (docs/protocol.md section 4c) stores the same way at its share
width: the leader's n + P F_p values, or a helper's seed, which only its sums expand (to its n
input elements, by field expansion: :func:`study_addends`).

A batch proof (docs/protocol.md section 4d, a study with ``batch_proofs``) is one row too: its m
row ids in ``ids`` (rowids ``first`` .. ``first + m - 1``, ordinary reports for everything that
counts reports), its record as received in ``shares`` (the leader's, or a helper's 168-odd
bytes), and ``proof_position``, the position this server received it at (NULL for every other
row). Why the batch as the unit and in ``batches`` rather than a companion table: the proof is
the batch's, never a row's, so no per-row payload exists to store, and one row keeps the record
and its rows in the one durable insert every upload makes, under the rowids the report index,
the checkpoints and a replica's catch-up already follow. Why the position in the row: what a
row adds to the running totals is re-derived from the record (:func:`proof_addends`: the
server re-receives it, ``batch_records.receive``, which needs the position to know the record's
role), and the readers here know the study but not the server's id. A proof batch is read whole,
never by slices and never joined with its neighbours in a scan; every reader of shares asks
:attr:`Stored.proof_position` first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpsketch.protocol import batch_records, batch_validity, proved_shares, ring, validity
from dpsketch.protocol.messages import split_ids
from dpsketch.protocol.sketch import REPORT_ID_BYTES
from dpsketch.protocol.study import Study

#: A rebuild pages through batches holding about this many reports at a time (at least one batch).
SCAN_REPORTS = 65536
#: :func:`read` takes a whole batch instead of slices when it wants at least this share of it.
WHOLE_FRACTION = 0.25
#: A SQLite store reads a batch's column in one piece instead of record by record when it wants
#: at least one record per this many bytes of the column: a blob seek + read from Python costs
#: about what copying a few kilobytes does.
SLICE_READ_BYTES = 4096


@dataclass
class Stored:
    """Consecutive stored reports of one batch (or whole batches of one party, in a scan):
    rowids ascending, ids and shares (and pseudonyms) concatenated in the same order."""

    rowids: np.ndarray  # int64
    ids: bytes
    shares: bytes  # empty once retention deleted them
    pseudonyms: bytes | None = None
    party: int | None = None
    #: a batch proof's rows (module docstring): the position its record was received at, and the
    #: rowid of the batch's first row (``shares`` is then the whole record)
    proof_position: int | None = None
    first: int | None = None

    def __len__(self) -> int:
        return len(self.rowids)

    def id_list(self) -> list[bytes]:
        return split_ids(self.ids)

    def pseudonym_list(self) -> list[bytes]:
        return split_ids(self.pseudonyms or b"")

    def record_bytes(self) -> int:
        """Bytes stored per report: 8 x width (shares), SEED_BYTES (seeds), 0 (deleted)."""
        return len(self.shares) // len(self) if len(self) else 0

    def holds_shares_of(self, width: int) -> bool:
        """Whether every report's share (or seed) of this width is here, whole (never for a batch
        proof's rows: their record is the batch's, :func:`proof_addends` reads it)."""
        if self.proof_position is not None:
            return False
        return len(self.shares) == len(self) * 8 * width or holds_seeds(len(self.shares), len(self), width)

    def share_matrix(self, width: int) -> np.ndarray:
        """The (m, width) uint64 shares, seeds expanded (ValueError if they are not here)."""
        return share_matrix(self.shares, len(self), width)


def study_payloads(stored: Stored, study: Study) -> tuple[np.ndarray, bool]:
    """A study with validity proofs: its stored records as uint64 rows, the leader's (m, n + P)
    F_p values or each helper's seed as 4 words, and whether they are seeds (one kind per
    Stored: a scan never joins records of two lengths). What proved_shares.payload_rows made;
    proved_shares.server_shares turns them into input and proof shares."""
    width = proved_shares.upload_width(study, stored.party)  # a party's blocks: that party's
    if not stored.holds_shares_of(width):
        raise ValueError(f"{len(stored.shares)} stored bytes are not {len(stored)} records of study {study.study_id}")
    seeded = holds_seeds(len(stored.shares), len(stored), width)
    return np.frombuffer(stored.shares, dtype="<u8").reshape(len(stored), -1), seeded


def study_addends(stored: Stored, study: Study) -> np.ndarray:
    """What stored reports of ``study`` add to its running aggregate: their (m, width) shares,
    seeds expanded; for a study with validity proofs the halves of their F_p coordinate shares
    (proved_shares.addends: (m, 2 w); one party's blocks: (m, 2 d_j))."""
    if stored.proof_position is not None:
        return proof_addends(stored, study)
    if not proved_shares.is_proved(study):
        return stored.share_matrix(study.width)
    rows, seeded = study_payloads(stored, study)
    return proved_shares.addends(study, rows, seeded, stored.party)


def proof_batch(stored: Stored, study: Study) -> tuple[batch_validity.BatchPlan, batch_validity.ServerBatch]:
    """A stored batch proof's plan and this server's view of it, re-received from its record at
    the position it came to (``batch_records.receive``: every check again, none of which can fail
    on what the writer stored; ValueError if one does, or if the record was deleted)."""
    if stored.proof_position is None or not stored.shares:
        raise ValueError(f"no batch proof record stored for rowid {int(stored.rowids[0]) if len(stored) else -1}")
    body = stored.shares
    leader = int.from_bytes(body[36:40], "little") if len(body) >= batch_records.HEADER_BYTES else -1
    media_type = batch_records.LEADER_MEDIA_TYPE if leader == stored.proof_position else batch_records.HELPER_MEDIA_TYPE
    try:
        _rec, plan, batch = batch_records.receive(study, stored.proof_position, media_type, body)
    except batch_records.BatchRecordError as exc:  # never: the writer stored only what passed
        raise ValueError(f"a stored batch proof does not re-receive: {exc.detail}") from None
    return plan, batch


def proof_batch_id(stored: Stored, study: Study) -> tuple[batch_validity.BatchPlan, bytes]:
    """A stored batch proof's plan and batch id, from its record's header and parts alone
    (``batch_records.batch_id_of``: no seed expanded, no share read; the writer checked them when
    it stored the record)."""
    body = stored.shares
    if stored.proof_position is None or len(body) < batch_records.HEADER_BYTES:
        raise ValueError(f"no batch proof record stored for rowid {int(stored.rowids[0]) if len(stored) else -1}")
    plan = batch_validity.study_plan(study, int.from_bytes(body[0:4], "little"))
    return plan, batch_records.batch_id_of(body, study.n_servers)


def proof_addends(stored: Stored, study: Study) -> np.ndarray:
    """What the batch proof's rows in ``stored`` add to the running totals: the halves of their
    coordinate shares (``batch_validity.coordinate_shares``, split as a validity report's:
    ``validity.split_words``), (len(stored), 2 w), in ``stored``'s row order."""
    plan, batch = proof_batch(stored, study)
    assert stored.first is not None
    offsets = np.asarray(stored.rowids, dtype=np.int64) - stored.first
    return validity.split_words(batch_validity.coordinate_shares(plan, batch)[offsets])


def stores_seeds(width: int) -> bool:
    """Whether a seed upload of this share width is stored as its seeds (module docstring)."""
    return ring.seed_is_smaller(width)


def holds_seeds(n_bytes: int, m: int, width: int) -> bool:
    """Whether m stored records of a study of this share width, n_bytes in all, are seeds."""
    return stores_seeds(width) and n_bytes == m * ring.SEED_BYTES


def share_matrix(blob: bytes, m: int, width: int) -> np.ndarray:
    """The (m, width) uint64 shares of m stored records (shares, or seeds: expanded)."""
    if holds_seeds(len(blob), m, width):
        return ring.expand_seeds(np.frombuffer(blob, dtype=np.uint8).reshape(m, ring.SEED_BYTES), width)
    if len(blob) != m * 8 * width:
        raise ValueError(f"{len(blob)} stored bytes are not {m} shares of width {width}")
    return np.frombuffer(blob, dtype="<u8").reshape(m, width)


def insert(conn: Any, backend: Any, first: int, seq: int, ids: bytes, shares: Any,
           pseudonyms: bytes | None = None, party: int | None = None, proof_position: int | None = None) -> None:
    """Store reports ``first`` .. ``first + m - 1`` of study ``seq`` as one batch; ``shares``:
    their shares, or their seeds (module docstring): one buffer, or a list of buffers stored
    one after the other (each backend's ``insert_batch`` writes them in turn or joins them);
    with ``proof_position``, a batch proof's record received at that position, ``ids`` its rows."""
    parts = [memoryview(part).cast("B") for part in (shares if isinstance(shares, list) else [shares])]
    backend.insert_batch(conn, {"first": first, "study": seq, "m": len(ids) // REPORT_ID_BYTES, "ids": ids,
                                "shares": parts, "pseudonyms": pseudonyms, "party": party,
                                "proof_position": proof_position})


def one_buffer(parts: list[memoryview]) -> bytes | memoryview:
    """The buffers of ``insert``'s ``shares`` as one (without a copy if there is one)."""
    return parts[0] if len(parts) == 1 else b"".join(parts)


def next_rowid(conn: Any) -> int:
    """The rowid after the last stored report (1 on an empty store)."""
    row = conn.execute("SELECT first + m FROM batches ORDER BY first DESC LIMIT 1").fetchone()
    return 1 if row is None else int(row[0])


def _query(conn: Any, sql: str, params: tuple) -> list[tuple]:
    """All rows of a query; on PostgreSQL in binary format (bytea as bytes, not hex text)."""
    if getattr(conn, "dialect", None) == "postgres":
        return conn.execute(sql, params, binary=True).fetchall()
    return conn.execute(sql, params).fetchall()


def _headers(conn: Any, seq: int, after: int, limit: int | None = None) -> list[tuple[int, int, int]]:
    """(first, m, 1 for a batch proof else 0) of the study's batches above rowid ``after``."""
    sql = "SELECT first, m, proof_position FROM batches WHERE study = ? AND first > ? ORDER BY first"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    return [(int(f), int(m), int(p is not None)) for f, m, p in _query(conn, sql, (seq, after))]


#: the columns :func:`_stored` reads
_COLUMNS = "first, m, ids, shares, pseudonyms, party, proof_position"


def _stored(row: tuple) -> Stored:
    first, m, ids, shares, pseudonyms, party, proof_position = row
    return Stored(np.arange(int(first), int(first) + int(m), dtype=np.int64), bytes(ids), bytes(shares),
                  None if pseudonyms is None else bytes(pseudonyms), None if party is None else int(party),
                  None if proof_position is None else int(proof_position), int(first))


def scan(conn: Any, seq: int, after: int = 0, page_reports: int = SCAN_REPORTS) -> Iterator[Stored]:
    """Every stored report of study ``seq`` above rowid ``after``, in rowid order, a page of
    whole batches (about ``page_reports`` reports, at least one batch) at a time, consecutive
    batches of one party joined (keyset paging, plain queries: it runs inside the writer's open
    transaction as well as on a reader)."""
    while True:
        heads = _headers(conn, seq, after, page_reports)
        if not heads:
            return
        while heads:
            take, reports = 0, 0
            while take < len(heads) and (take == 0 or reports + heads[take][1] <= page_reports):
                reports += heads[take][1]
                take += 1
            lo, hi = heads[0][0], heads[take - 1][0]
            rows = _query(conn, f"SELECT {_COLUMNS} FROM batches "
                                "WHERE study = ? AND first >= ? AND first <= ? ORDER BY first", (seq, lo, hi))
            yield from _joined([_stored(row) for row in rows])
            after = hi
            heads = heads[take:]


def _joined(parts: list[Stored]) -> Iterator[Stored]:
    """Runs of consecutive batches of one party (with or without pseudonyms, and of one record
    length: seeds and shares are never joined) as one each; a batch proof always alone."""
    def kind(p: Stored) -> tuple:
        return (p.party, p.pseudonyms is None, p.record_bytes(), p.proof_position, p.first if p.proof_position is not None
                else None)

    start = 0
    for end in range(1, len(parts) + 1):
        if end == len(parts) or kind(parts[end]) != kind(parts[start]):
            run = parts[start:end]
            yield run[0] if len(run) == 1 else Stored(
                np.concatenate([p.rowids for p in run]), b"".join(p.ids for p in run),
                b"".join(p.shares for p in run),
                None if run[0].pseudonyms is None else b"".join(p.pseudonyms or b"" for p in run), run[0].party)
            start = end


def headers(conn: Any, seq: int) -> np.ndarray:
    """(first, m, whether a batch proof) of every batch of study ``seq``, ascending: what
    :func:`read` locates rowids in (a batch's header never changes, so a caller reading in
    chunks fetches them once)."""
    return np.array(_headers(conn, seq, 0) or np.zeros((0, 3)), dtype=np.int64).reshape(-1, 3)


def holding(conn: Any, seq: int, rowids: np.ndarray) -> np.ndarray:
    """(first, m) of the batches of study ``seq`` that hold these rowids (ascending), found
    through the batches' primary key: one indexed lookup per batch touched, whatever the
    study's size. Why: a re-sent report (every client retry after a lost answer) is found held
    through the report index and its stored bytes compared; reading every header of the study
    to find its one batch made that cost grow with the study (48 ms at 3 x 10^5 stored single
    uploads against 0.1 ms for a fresh upload, issue 46)."""
    found: list[tuple[int, int, int]] = []
    end = None
    for rowid in rowids.tolist():
        if end is not None and rowid < end:
            continue  # in the batch just found
        # rowids are the store's, not the study's: the batch holding one is the last to start
        # at or below it (the primary key's index, on either database), whichever study's it is
        row = conn.execute("SELECT first, m, study, proof_position FROM batches WHERE first <= ? "
                           "ORDER BY first DESC LIMIT 1", (rowid,)).fetchone()
        if row is None or int(row[2]) != seq:
            continue  # read() refuses it below
        first, m = int(row[0]), int(row[1])
        found.append((first, m, int(row[3] is not None)))
        end = first + m
    return np.array(found, dtype=np.int64).reshape(-1, 3)


#: :func:`read` without the caller's headers looks up the batches of at most this many rowids
#: one by one (:func:`holding`), and reads the study's headers for more
HOLDING_MAX = 256


def read(conn: Any, backend: Any, seq: int, rowids: np.ndarray | list[int],
         heads: np.ndarray | None = None) -> Iterator[Stored]:
    """The stored reports of study ``seq`` with these rowids (ascending), batch by batch
    (``heads``: the study's :func:`headers`, if the caller has them; else the batches of a few
    rowids are looked up by key, :func:`holding`). LookupError if one is not stored (never:
    rowids come from the writer's own inserts)."""
    rowids = np.asarray(rowids, dtype=np.int64)
    if len(rowids) == 0:
        return
    if heads is None:
        heads = holding(conn, seq, rowids) if len(rowids) <= HOLDING_MAX else headers(conn, seq)
    at = np.searchsorted(heads[:, 0], rowids, side="right") - 1
    if len(heads) == 0 or at.min() < 0 or np.any(rowids - heads[np.maximum(at, 0), 0] >= heads[np.maximum(at, 0), 1]):
        raise LookupError(f"store inconsistent: held reports of study {seq} are not stored")
    bounds = np.flatnonzero(np.diff(at)) + 1
    for part in np.split(np.arange(len(rowids)), bounds):
        b = int(at[part[0]])
        first, m = int(heads[b, 0]), int(heads[b, 1])
        offsets = rowids[part] - first
        if heads[b, 2]:  # a batch proof: its whole record, whatever rows are wanted
            whole = _stored(_query(conn, f"SELECT {_COLUMNS} FROM batches WHERE first = ?", (first,))[0])
            yield Stored(rowids[part], pick(whole.ids, offsets, REPORT_ID_BYTES), whole.shares,
                         proof_position=whole.proof_position, first=first)
        elif len(offsets) >= WHOLE_FRACTION * m:
            row = _query(conn, f"SELECT {_COLUMNS} FROM batches WHERE first = ?", (first,))[0]
            whole = _stored(row)
            width = len(whole.shares) // m if m else 0
            yield Stored(rowids[part], pick(whole.ids, offsets, REPORT_ID_BYTES),
                         pick(whole.shares, offsets, width),
                         None if whole.pseudonyms is None else pick(whole.pseudonyms, offsets, REPORT_ID_BYTES),
                         whole.party)
        else:
            ids, shares, pseudonyms, party = backend.read_slices(conn, first, m, offsets.tolist())
            yield Stored(rowids[part], ids, shares, pseudonyms, party)


def pick(blob: bytes, offsets: np.ndarray, width: int) -> bytes:
    """The ``width``-byte records at ``offsets`` of a blob of such records, concatenated."""
    if width == 0:
        return b""
    records = np.frombuffer(blob, dtype=np.uint8).reshape(-1, width)
    return records[offsets].tobytes()


def joined_ids(conn: Any, seq: int) -> bytes:
    """The ids of every report of study ``seq`` (any order), concatenated: no Python object per
    id (a report-id list of 10^6 is built from it on arrays, messages.encode_report_ids)."""
    return b"".join(bytes(joined) for (joined,) in _query(conn, "SELECT ids FROM batches WHERE study = ?", (seq,)))


def proof_batches(conn: Any, seq: int) -> list[Stored]:
    """Every batch proof of study ``seq``, whole (its rows and record), by rowid."""
    return [_stored(row) for row in _query(
        conn, f"SELECT {_COLUMNS} FROM batches WHERE study = ? AND proof_position IS NOT NULL ORDER BY first",
        (seq,))]


def proof_rows(conn: Any, seq: int) -> np.ndarray:
    """(first, m) of every batch proof of study ``seq``, by rowid: where its rows are among the
    study's rowids (the round leaves them out of its report section)."""
    rows = _query(conn, "SELECT first, m FROM batches WHERE study = ? AND proof_position IS NOT NULL ORDER BY first",
                  (seq,))
    return np.array([(int(f), int(m)) for f, m in rows], dtype=np.int64).reshape(-1, 2)


def blocks(conn: Any, seq: int) -> tuple[list[bytes], list[bytes], list[int]]:
    """(block ids, pseudonyms, parties) of every block of study ``seq`` (a study with parties)."""
    bids: list[bytes] = []
    pseudonyms: list[bytes] = []
    parties: list[int] = []
    for joined, joined_p, party, m in _query(conn, "SELECT ids, pseudonyms, party, m FROM batches WHERE study = ?",
                                             (seq,)):
        bids.extend(split_ids(bytes(joined)))
        pseudonyms.extend(split_ids(bytes(joined_p or b"")))
        parties.extend([int(party)] * int(m))
    return bids, pseudonyms, parties


def delete_shares(conn: Any, seq: int) -> int:
    """Empty the shares of every batch of study ``seq``; how many reports lost theirs."""
    n = conn.execute("SELECT coalesce(sum(m), 0) FROM batches WHERE study = ? AND length(shares) > 0",
                     (seq,)).fetchone()[0]
    conn.execute("UPDATE batches SET shares = ? WHERE study = ? AND length(shares) > 0", (b"", seq))
    return int(n)
