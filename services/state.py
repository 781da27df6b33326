"""What a server keeps in memory per study, and how it is rebuilt from the database.

For an open study the server holds the running aggregate Z = S X (k x d uint64) and the integer
matrix s * S S^T (k x k int64) over every report it stores, plus the map report id -> rowid
(``idsets.ReportIndex``: sorted numpy arrays, no Python object per report).
Then a commit over an inclusion set only subtracts the (usually few) held reports outside the
set instead of re-reading every share, and duplicate/conflict checks need no index lookups.

The totals are changed only after the database transaction that stored the reports committed,
under ``StudyState.lock``; a commit computation snapshots them under the same lock. After a
crash nothing in memory matters: :func:`load_state` rebuilds it by streaming the stored batches (services/batches.py).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpsketch.protocol import proved_shares, sketch
from dpsketch.protocol.messages import CommitResult
from dpsketch.protocol.study import Study

from dpsketch.protocol.sketch import REPORT_ID_BYTES
from dpsketch.protocol.sketch import accumulate as add_into

from . import batches
from .idsets import ReportIndex, SortedIds
from .lifecycle import Closure

log = logging.getLogger("dpsketch.server")

#: Memory the report index of an open study takes per held report (services/idsets.py): the
#: sorted id halves and rowids hold 24 bytes and its prefix filter 2-8; while a merge of recent
#: additions builds the new arrays it peaks at 89 (tracemalloc over 6 x 10^5 reports added in
#: batches of 1 to 10^4). The ids stored since the last checkpoint are kept for the next one
#: (``StudyState.since_checkpoint``: 24 bytes each, at most a fifth of the reports, so up to 5
#: bytes a report). The memory budget counts the peak.
INDEX_BYTES_PER_REPORT = 95
#: A study with parties also keeps, per block, its (pseudonym, party) slot and per-individual
#: block count in Python dicts (about 240 bytes a block).
SLOT_BYTES_PER_BLOCK = 240


@dataclass
class StudyState:
    """Running totals of an open study over all reports held (see module docstring)."""

    k: int
    d: int
    ids: ReportIndex = field(default_factory=ReportIndex)  # report id (a block's id) -> rowid
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: a study with parties: how many parties; 0 for any other study
    n_parties: int = 0

    def __post_init__(self) -> None:
        self.aggregate = np.zeros((self.k, self.d), dtype=np.uint64)
        self.gram = np.zeros((self.k, self.k), dtype=np.int64)  # s * S S^T
        # A study with parties keeps no running totals (a commit sums its blocks from the store)
        # but knows which block holds each (pseudonym, party) slot, for conflicts, and how many
        # blocks each individual has here, for completeness.
        self.slots: dict[bytes, bytes] = {}  # pseudonym + party byte -> block id
        self.blocks_of: dict[bytes, int] = {}  # pseudonym -> blocks held
        self.complete = 0  # individuals with every party's block here
        self.party_counts = [0] * self.n_parties
        #: the largest rowid folded in: a replica sharing its store catches up on rows above it
        #: (services/store.py, ``Store._catch_up``)
        self.last_rowid = 0
        #: reports held at the last checkpoint of this state (services/checkpoint.py) ...
        self.checkpointed = 0
        #: ... its last_rowid (0: none known), the reports in its base, and in each of its segments
        self.checkpoint_rowid = 0
        self.checkpoint_base = 0
        self.checkpoint_segments: list[int] = []
        #: the ids (concatenated) and rowids folded in since the last checkpoint, in that order:
        #: the next checkpoint's segment, without searching the index for them
        #: (services/checkpoint.py; at most the last CHECKPOINT_GROWTH of the reports)
        self.since_checkpoint: list[tuple[bytes, np.ndarray]] = []

    @property
    def report_count(self) -> int:
        """Reports held; for a study with parties, individuals whose every block is here."""
        return self.complete if self.n_parties else len(self.ids)

    def add(self, study: Study, report_ids: Sequence[bytes], rowids: range | list[int],
            shares: np.ndarray | list[np.ndarray], rows: np.ndarray | None = None, signs: np.ndarray | None = None,
            joined: bytes | None = None, sorted_parts: list[SortedIds] | None = None) -> None:
        """Fold newly stored reports into the totals (caller holds ``lock``); ``shares``: what each
        adds (its share; a study with validity proofs: proved_shares.addends of it), or
        consecutive parts of them (as the writer gets them, one per request); ``sorted_parts``:
        the ids as consecutive requests, each sorted (idsets.SortedIds), if the caller has them."""
        if rows is None or signs is None:
            rows, signs = study.hash_report_ids(report_ids, joined)
        as_array = self._index(report_ids, rowids, joined, sorted_parts)
        if self.checkpoint_rowid:  # a checkpoint to add a segment to (else the next one is whole)
            self.since_checkpoint.append((joined if joined is not None else b"".join(report_ids), as_array))
        at = 0
        for part in shares if isinstance(shares, list) else [shares]:
            add_into(self.aggregate, rows[at:at + len(part)], signs[at:at + len(part)], part)
            at += len(part)
        sketch.accumulate_gram(self.gram, rows, signs, +1)

    def add_blocks(self, party: int, block_ids: list[bytes], rowids: range | list[int],
                   pseudonyms: list[bytes], joined: bytes | None = None) -> None:
        """Index newly stored blocks of one party (caller holds ``lock``; the writer has checked
        that no slot is taken)."""
        self._index(block_ids, rowids, joined)
        tag = bytes((party,))
        for bid, p in zip(block_ids, pseudonyms):
            self.slots[p + tag] = bid
            held = self.blocks_of.get(p, 0) + 1
            self.blocks_of[p] = held
            if held == self.n_parties:
                self.complete += 1
        self.party_counts[party] += len(block_ids)

    def _index(self, report_ids: Sequence[bytes], rowids: range | list[int], joined: bytes | None,
               sorted_parts: list[SortedIds] | None = None) -> np.ndarray:
        """Add the ids to the report index; returns their rowids as an array."""
        # a range as numpy's arange: np.asarray walks it value by value (1.8 ms for a 27,594-row batch)
        as_array = (np.arange(rowids.start, rowids.stop, rowids.step, dtype=np.int64) if isinstance(rowids, range)
                    else np.asarray(rowids, dtype=np.int64))
        joined = joined if joined is not None else b"".join(report_ids)
        if sorted_parts and sum(len(p) for p in sorted_parts) == len(as_array):
            at = 0
            for part in sorted_parts:
                n = len(part)
                self.ids.add(joined[at * REPORT_ID_BYTES:(at + n) * REPORT_ID_BYTES], as_array[at:at + n],
                             report_ids[at:at + n], part)
                at += n
        else:
            self.ids.add(joined, as_array, report_ids)
        if len(as_array):
            self.last_rowid = max(self.last_rowid, int(as_array.max()))
        return as_array


@dataclass
class StudyRecord:
    """One provisioned study: parameters, progress, and (if committed) what was released."""

    seq: int
    study: Study
    report_count: int
    commit: CommitResult | None = None
    aggregate: bytes | None = None  # cached released bytes, loaded on first GET
    state: StudyState | None = None  # None until loaded; dropped after commit
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    committed_at: float | None = None
    upload_tokens: dict[bytes, "UploadToken"] = field(default_factory=dict)  # digest -> token, not revoked
    upload_required: bool = False  # the policy demands tokens, or one was issued: uploads need one
    shares_deleted_at: float | None = None  # retention ran: individual shares are gone
    created_at: float = 0.0  # when it was provisioned (expiry counts from here)
    #: it ended without a release: expired or dropped (services/lifecycle.py)
    closure: Closure | None = None
    _rows_per_report: int = 0
    #: (the upload_tokens dict it was made from, token id -> digest): the store replaces that dict
    #: whenever a token is issued or revoked, never changes it in place
    _token_ids: tuple[dict, dict[bytes, bytes]] | None = field(default=None, repr=False)

    def digest_by_token_id(self, token_id: bytes) -> bytes | None:
        """The digest of the active upload token whose public id (its digest's first 8 bytes) is
        ``token_id``, or None (a relayed entry names its token by id: services/relayed_uploads.py).
        The index is rebuilt once after each issue or revocation (the store replaces
        ``upload_tokens`` then), never per lookup, so unknown ids cost a dict lookup each."""
        tokens = self.upload_tokens
        if self._token_ids is None or self._token_ids[0] is not tokens:
            self._token_ids = (tokens, {d[:8]: d for d in tokens})
        return self._token_ids[1].get(token_id)

    @property
    def study_id(self) -> str:
        return self.study.study_id

    @property
    def upload_digests(self) -> tuple[bytes, ...]:
        return tuple(self.upload_tokens)

    @property
    def is_open(self) -> bool:
        return self.commit is None and self.closure is None

    def rows_per_report(self) -> int:
        """How many rows of the running totals one report adds into (s for OSNAP; the l1
        sketch's levels), from the study's own hash of one id."""
        if not self._rows_per_report:
            rows, _ = self.study.hash_report_ids([bytes(REPORT_ID_BYTES)])
            self._rows_per_report = max(1, int(np.asarray(rows).reshape(1, -1).shape[1]))
        return self._rows_per_report

    def memory_for(self, reports: int, blocks: int = 0) -> int:
        """What the memory budget counts for this study holding ``reports`` reports (a study with
        parties: complete individuals, and ``blocks`` blocks).

        The running totals are charged as reports arrive, not as declared: the k x width
        aggregate and k x k S S^T are allocated zero (pages the kernel maps only when written),
        and a report writes into ``rows_per_report`` rows of each, so ``reports`` reports can
        have touched at most min(k, rows_per_report * reports) rows of 8 (width + k) bytes. An
        empty study costs nothing here (issue 41: fifteen empty studies declaring 256 MiB each
        used to fill a 4 GiB budget while the process held 393 MB). Plus the report index (and
        a study with parties' slots and counts, about 2.5 x per block)."""
        touched = min(self.study.k, self.rows_per_report() * (blocks or reports))
        totals = 8 * touched * (proved_shares.state_width(self.study) + self.study.k)
        extra = blocks * (INDEX_BYTES_PER_REPORT + SLOT_BYTES_PER_BLOCK) if self.study.parties is not None else 0
        return totals + reports * INDEX_BYTES_PER_REPORT + extra

    def memory_growth(self, held: int, new: int) -> int:
        """What ``new`` more reports (blocks, for a study with parties) add to :meth:`memory_for`
        when it holds ``held`` (an upper bound for blocks: every one may complete an individual)."""
        if self.study.parties is not None:
            return self.memory_for(0, held + new) - self.memory_for(0, held) + new * INDEX_BYTES_PER_REPORT
        return self.memory_for(held + new) - self.memory_for(held)

    def memory_bytes(self) -> int:
        """What the budget counts for this study now: nothing once committed or closed."""
        if not self.is_open:
            return 0
        blocks = 0
        if self.study.parties is not None and self.state is not None:
            blocks = len(self.state.ids)
        return self.memory_for(self.report_count, blocks)


@dataclass
class UploadToken:
    """An active upload token of a study: how many reports it may add, and how many it did."""

    quota: int | None  # None: no limit
    used: int = 0
    party: str | None = None  # a study with parties: the party whose blocks it may upload
    population: str | None = None  # the population its reports are charged to (None: from before them)

    def room(self) -> int | None:
        return None if self.quota is None else max(0, self.quota - self.used)


def load_state(conn: Any, record: StudyRecord, chunk_rows: int, backend: Any = None,
               into: StudyState | None = None) -> StudyState:
    """Rebuild a study's running totals by streaming its stored reports in rowid order
    (services/batches.py). ``conn`` is a read connection of ``backend`` (services/backend.py).
    With ``into``: fold only the rows above ``into.last_rowid`` into it (a replica catching up on
    what the others stored, in the writer's transaction) and return it."""
    study = record.study
    if study.parties is not None:
        return _load_blocks(conn, record, chunk_rows, backend, into)
    state = into if into is not None else new_state(study)
    share_width = proved_shares.upload_width(study)  # a validity study's leader: n + P values
    skipped = 0
    for chunk in batches.scan(conn, record.seq, into.last_rowid if into is not None else 0, chunk_rows):
        rowids = chunk.rowids.tolist()
        ids = chunk.id_list()
        joined = chunk.ids
        if chunk.proof_position is not None:  # a batch proof's rows: re-derived from its record
            if not chunk.shares or len(set(ids)) != len(ids) or state.ids.any_held(joined, ids):
                skipped += len(ids)  # cannot happen with a single writer; never count a row twice
                continue
            state.add(study, ids, rowids, batches.study_addends(chunk, study), joined=joined)
            continue
        whole = chunk.holds_shares_of(share_width)
        sound = (len(joined) == REPORT_ID_BYTES * len(ids) and whole
                 and len(set(ids)) == len(ids) and not state.ids.any_held(joined, ids))
        if not sound:  # cannot happen with a single writer; never count a row twice
            width = chunk.record_bytes() if whole else 8 * share_width  # a share's or a seed's bytes
            blobs = [chunk.shares[i * width:(i + 1) * width] for i in range(len(ids))]
            keep = {}
            for i, (rid, blob) in enumerate(zip(ids, blobs)):
                if (len(blob) == width and len(rid) == REPORT_ID_BYTES and rid not in state.ids
                        and rid not in keep):
                    keep[rid] = i
            skipped += len(ids) - len(keep)
            rowids = [rowids[i] for i in keep.values()]
            ids = list(keep)
            blobs = [blobs[i] for i in keep.values()]
            joined = b"".join(ids)
        if ids:
            stored = chunk if sound else batches.Stored(np.asarray(rowids, dtype=np.int64), joined, b"".join(blobs))
            state.add(study, ids, rowids, batches.study_addends(stored, study), joined=joined)
    if skipped:
        log.error("study %s: skipped %d malformed or repeated stored rows", record.study_id, skipped)
    if into is None:
        log.info("study %s: rebuilt totals over %d reports", record.study_id, len(state.ids))
    return state


def new_state(study: Study) -> StudyState:
    """The empty in-memory state of a study (a study with validity proofs: 2 w columns, the
    halves of its F_p coordinate shares; dpsketch/protocol/proved_shares.py)."""
    return StudyState(k=study.k, d=proved_shares.state_width(study), n_parties=len(study.parties or ()))


def _load_blocks(conn: Any, record: StudyRecord, chunk_rows: int, backend: Any = None,
                 into: StudyState | None = None) -> StudyState:
    """Rebuild the block index of a study with parties (it has no running totals); ``into`` as
    in :func:`load_state`."""
    study = record.study
    state = into if into is not None else new_state(study)
    # a record's bytes per party: its share (a validity study: the leader's n_j + P_j values, or a
    # helper's 32-byte seed; proved_shares.upload_width)
    widths = [8 * proved_shares.upload_width(study, j) for j in range(len(study.parties or ()))]
    seeded = proved_shares.is_proved(study)
    skipped = 0
    for chunk in batches.scan(conn, record.seq, into.last_rowid if into is not None else 0, chunk_rows):
        by_party: dict[int, tuple[list, list, list]] = {}
        bids = chunk.id_list()
        if len(chunk.ids) == REPORT_ID_BYTES * len(chunk):
            held = (state.ids.lookup(chunk.ids, bids) >= 0).tolist()
        else:
            held = [b in state.ids for b in bids]
        party = chunk.party
        width = widths[party] if party is not None and 0 <= party < len(widths) else -1
        pseudonyms_of = chunk.pseudonym_list()
        seen: set[bytes] = set()
        for i, (rowid, bid, is_held) in enumerate(zip(chunk.rowids.tolist(), bids, held)):
            pseudonym = pseudonyms_of[i] if i < len(pseudonyms_of) else b""
            sound = (width >= 0 and (len(chunk.shares) == width * len(chunk)
                                     or (seeded and len(chunk.shares) == proved_shares.SEED_BYTES * len(chunk)))
                     and len(pseudonym) == 16 and len(bid) == REPORT_ID_BYTES and not is_held
                     and bid not in seen and pseudonym + bytes((party,)) not in state.slots)
            if not sound:  # cannot happen with a single writer; never count a block twice
                skipped += 1
                continue
            seen.add(bid)
            rows, ids, pseudonyms = by_party.setdefault(party, ([], [], []))
            rows.append(rowid)
            ids.append(bid)
            pseudonyms.append(pseudonym)
            state.slots[pseudonym + bytes((party,))] = bid  # seen within this chunk too
        for party, (rows, ids, pseudonyms) in by_party.items():
            for p in pseudonyms:
                del state.slots[p + bytes((party,))]
            state.add_blocks(party, ids, rows, pseudonyms)
    if skipped:
        log.error("study %s: skipped %d malformed or repeated stored blocks", record.study_id, skipped)
    if into is None:
        log.info("study %s: rebuilt the index of %d blocks (%d complete individuals)", record.study_id,
                 len(state.ids), state.complete)
    return state
