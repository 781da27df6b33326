"""The report index of an open study: 16-byte report id -> rowid, in numpy arrays.

A share server holds up to 10^6 and more reports per open study and must answer, per upload,
"is this id held, and under which rowid?" and, per commit, "which held ids are outside this
inclusion set?". A Python ``dict[bytes, int]`` took about 160 bytes and 0.7 us to build per
report (most of a restart's time); here the ids live as two sorted uint64 arrays (the big-endian
high and low halves, so numeric order is bytewise order) with a parallel int64 rowid array:
24 bytes a report, loaded from a checkpoint with no per-report Python object at all.

Layout: a sorted *main* run, a few sorted *runs* of recent bulk additions, and a small dict of
recent single additions (single uploads add one id at a time; re-sorting 10^6 ids for each would
cost milliseconds). A run at least half as long as the run before it is merged into that one, so
the runs shrink geometrically (a few dozen batches make a handful of runs); they are merged into
the main run once they hold a quarter of it, so each id is merged into the main run a few times
in all and a lookup costs a few binary searches. (Merging every few batches into the main run, as
before, made the index a sixth of a bulk upload's writer time at 10^6 reports.)

In front of them all, a bit per prefix of the high half (:class:`_Filter`): a clear bit means no
held id has that prefix, so most new ids are known to be new from one bit, without a binary
search in each run. Upload batches consist of new ids (a repeated one is a retry), so a batch's
duplicate check searches the runs only for the few ids whose bit is set: at 2-3 x 10^6 held ids
the searches took a fifth of a bulk upload's writer time before. The filter holds 16 to 64 bits
per held id (2-8 bytes a report: it grows in powers of two), so a new id's bit is set with
probability 1/64 to 1/16. Crafted ids whose prefixes are set cost the searches, never a wrong
answer: the bit only ever says "not held".

Exactness: ids are 128-bit and equality is always decided on both halves. Clients choose ids
(SHA-256 commitments, so 64-bit prefix collisions take ~2^32 work to craft): where two held ids
share their high half, the lookups resolve that range exactly on the low half (a slower
Python loop over the colliding ids only), so crafted ids cost time, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpsketch.protocol import kernels
from dpsketch.protocol.messages import strictly_ascending
from dpsketch.protocol.sketch import REPORT_ID_BYTES

#: the compiled merge of two sorted runs (services/_index_kernel.py; the numpy merges below are
#: its reference)
MERGE = kernels.Kernel("dpsketch.services._index_kernel", "the report index's merges")

#: small additions (single uploads) stay in a dict until it holds this many ids
_RECENT_LIMIT = 4096
#: merge the runs into the main run when there are more than this many ...
_MAX_RUNS = 12
#: lookups of at most this many ids take them one at a time (a bit, then searches for the few
#: whose bit is set): a group of 30 single uploads costs about 21 us either way, fewer ids less
_FEW = 64
#: ids from which two runs are merged by insertion rather than by a sort (measured: the sort is
#: faster at 1.6 x 10^5 ids, insertion 1.8x faster at 1.6 x 10^6 and 2.8x at 3.75 x 10^6)
_INSERT_FROM = 1 << 19


def halves(blob: bytes | bytearray | memoryview) -> tuple[np.ndarray, np.ndarray]:
    """High and low 64 bits of each concatenated 16-byte id, big-endian (numeric order is
    bytewise order), as native uint64 arrays."""
    pairs = np.frombuffer(blob, dtype=">u8").reshape(-1, 2)
    return pairs[:, 0].astype(np.uint64), pairs[:, 1].astype(np.uint64)


def join_halves(hi: np.ndarray, lo: np.ndarray) -> bytes:
    """The concatenated 16-byte ids of ``halves`` (its inverse)."""
    out = np.empty((len(hi), 2), dtype=">u8")
    out[:, 0], out[:, 1] = hi, lo
    return out.tobytes()


def _ascending(hi: np.ndarray, lo: np.ndarray, kind: str = "stable") -> np.ndarray:
    """The permutation that sorts ids by (hi, lo): a sort by the high half, by both halves where
    two ids share it (crafted; lexsort is 15x slower at 10^6). ``kind``: numpy's; "stable" merges
    already sorted runs in O(n log runs), "quicksort" is 2.5x faster on ids in no order (a
    batch's: 2.0 -> 0.8 ms at 27,594 ids)."""
    order = np.argsort(hi, kind=kind)
    first = hi[order]
    if len(first) > 1 and bool(np.any(first[1:] == first[:-1])):
        order = np.lexsort((lo, hi))
    return order


class SortedIds:
    """A batch's ids in ascending order and the permutation that sorts them: computed by the
    worker thread that checked the batch, so the writer's repeat check, lookup and addition sort
    nothing (and build no set of the ids)."""

    __slots__ = ("hi", "lo", "order")

    def __init__(self, joined: bytes):
        hi, lo = halves(joined)
        order = _ascending(hi, lo, kind="quicksort")  # a client's random ids: no sorted runs to merge
        self.hi, self.lo, self.order = hi[order], lo[order], order

    def __len__(self) -> int:
        return len(self.hi)

    def repeats(self) -> bool:
        """Whether an id occurs twice in the batch (adjacent once sorted)."""
        hi, lo = self.hi, self.lo
        return len(hi) > 1 and bool(np.any((hi[1:] == hi[:-1]) & (lo[1:] == lo[:-1])))


class _Run:
    """Ids sorted ascending by (hi, lo), repeat-free, with their rowids."""

    __slots__ = ("hi", "lo", "rowid", "ties")

    def __init__(self, hi: np.ndarray, lo: np.ndarray, rowid: np.ndarray, presorted: bool = False,
                 ties: bool | None = None):
        if not presorted and len(hi) > 1:
            order = _ascending(hi, lo)
            hi, lo, rowid = hi[order], lo[order], rowid[order]
        self.hi, self.lo, self.rowid = hi, lo, rowid
        # whether two ids share a high half (crafted): then lookups resolve those ranges exactly
        self.ties = bool(len(hi) > 1 and np.any(hi[1:] == hi[:-1])) if ties is None else ties

    def __len__(self) -> int:
        return len(self.hi)

    def find(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """Position of each queried id in this run, -1 where it is not held."""
        n = len(self.hi)
        if n == 0 or len(hi) == 0:
            return np.full(len(hi), -1, dtype=np.int64)
        if len(hi) > 64 and not self.ties:  # sorted needles: each search starts where the last ended
            if bool(np.all(hi[1:] >= hi[:-1])):  # already (a commit's inclusion set)
                at = np.minimum(np.searchsorted(self.hi, hi, side="left"), n - 1)
            else:
                order = np.argsort(hi)
                at = np.empty(len(hi), dtype=np.int64)
                at[order] = np.minimum(np.searchsorted(self.hi, hi[order], side="left"), n - 1)
            hit = (self.hi[at] == hi) & (self.lo[at] == lo)
            return np.where(hit, at, -1)
        left = np.searchsorted(self.hi, hi, side="left")
        if not self.ties:
            at = np.minimum(left, n - 1)
            hit = (self.hi[at] == hi) & (self.lo[at] == lo)
            return np.where(hit, at, -1).astype(np.int64)
        right = np.searchsorted(self.hi, hi, side="right")
        out = np.full(len(hi), -1, dtype=np.int64)
        single = (right - left) == 1
        at = left[single]
        hit = self.lo[at] == lo[single]
        out[np.flatnonzero(single)[hit]] = at[hit]
        for i in np.flatnonzero((right - left) > 1).tolist():  # a shared high half: exact on lo
            a, b = int(left[i]), int(right[i])
            j = a + int(np.searchsorted(self.lo[a:b], lo[i]))
            if j < b and self.lo[j] == lo[i]:
                out[i] = j
        return out

    def find_one(self, hi: int, lo: int) -> int:
        """:meth:`find` for one id (a single upload: scalar searches, no arrays)."""
        n = len(self.hi)
        if n == 0:
            return -1
        key = np.uint64(hi)
        a = int(self.hi.searchsorted(key, side="left"))
        if a == n or int(self.hi[a]) != hi:
            return -1
        if self.ties:
            b = int(self.hi.searchsorted(key, side="right"))
            a += int(self.lo[a:b].searchsorted(np.uint64(lo)))
            return a if a < b and int(self.lo[a]) == lo else -1
        return a if int(self.lo[a]) == lo else -1


class _Filter:
    """One bit per prefix of the high half, set for every held id's prefix (the module
    docstring). Ids are only ever added to an index, so no bit is ever cleared. Sized as a power
    of two of at least 32 bits per id, and built anew, twice or four times as large, once it
    holds an id per 16 bits: a new id's bit is set with probability at most 1/16, and the filter
    takes 2 to 8 bytes per held id."""

    __slots__ = ("raw", "bits", "shift", "capacity")

    #: the smallest filter: 2^16 bits (8 KiB)
    MIN_BITS_LOG2 = 16

    def __init__(self, n: int = 0) -> None:
        log2 = max(self.MIN_BITS_LOG2, int(32 * max(n, 1) - 1).bit_length())  # >= 32 bits per id
        # one buffer, two views: numpy's for batches, the bytearray's for one id at a time
        # (a bytearray item costs tens of nanoseconds, a numpy scalar about ten times that)
        self.raw = bytearray(1 << (log2 - 3))
        self.bits = np.frombuffer(self.raw, dtype=np.uint8)
        self.shift = np.uint64(64 - log2)
        self.capacity = (1 << log2) // 16  # ids it takes before it is rebuilt larger

    def add(self, hi: np.ndarray, ascending: bool = False) -> None:
        """Set the bits of these high halves (repeats allowed; ``ascending``: they are sorted)."""
        if len(hi) == 0:
            return
        slot = hi >> self.shift if ascending else np.sort(hi >> self.shift)
        byte = (slot >> np.uint64(3)).astype(np.intp)
        mask = np.left_shift(np.uint8(1), (slot & np.uint64(7)).astype(np.uint8))
        starts = np.flatnonzero(np.concatenate(([True], byte[1:] != byte[:-1])))
        self.bits[byte[starts]] |= np.bitwise_or.reduceat(mask, starts)

    def maybe(self, hi: np.ndarray) -> np.ndarray:
        """False where no held id has this high half's prefix (so the id is not held)."""
        slot = hi >> self.shift
        return ((self.bits[(slot >> np.uint64(3)).astype(np.intp)] >> (slot & np.uint64(7)).astype(np.uint8))
                & np.uint8(1)).astype(bool)

    def add_ids(self, ids: Sequence[bytes]) -> None:
        """:meth:`add` for a few ids (16 bytes each), one at a time."""
        raw, shift = self.raw, int(self.shift)
        for rid in ids:
            slot = int.from_bytes(rid[:8], "big") >> shift
            raw[slot >> 3] |= 1 << (slot & 7)

    def maybe_one(self, hi: int) -> bool:
        """:meth:`maybe` for one high half (a Python int)."""
        slot = hi >> int(self.shift)
        return (self.raw[slot >> 3] >> (slot & 7)) & 1 == 1


def _merge(runs: Sequence[_Run]) -> _Run:
    """One run of these runs' ids: merged two at a time, the smallest first, by the compiled
    loop where it is loaded (one sequential pass each); else the smaller ones sorted together,
    then inserted into the largest (:func:`_insert`)."""
    runs = sorted((r for r in runs if len(r)), key=len)
    if not runs:
        return _Run(np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.int64), presorted=True)
    if len(runs) == 1:
        return runs[0]
    loop = MERGE.for_rows(sum(len(r) for r in runs))
    if loop is not None:
        while len(runs) > 1:
            a, b = runs.pop(0), runs.pop(0)
            hi, lo, rowid, ties = loop.merge((a.hi, a.lo, a.rowid), (b.hi, b.lo, b.rowid))
            merged = _Run(hi, lo, rowid, presorted=True, ties=ties)
            at = next((i for i, r in enumerate(runs) if len(r) >= len(merged)), len(runs))
            runs.insert(at, merged)
        return runs[0]
    big = runs.pop()
    return _insert(big, runs[0] if len(runs) == 1 else _concatenated(runs))


def _concatenated(runs: Sequence[_Run]) -> _Run:
    return _Run(np.concatenate([r.hi for r in runs]), np.concatenate([r.lo for r in runs]),
                np.concatenate([r.rowid for r in runs]))


def _insert(big: _Run, small: _Run) -> _Run:
    """The ids of both runs in one, by placing the smaller run's ids at their positions among
    the larger one's: a binary search per small id and one pass of copies (no permutation array;
    faster than a stable sort of both from :data:`_INSERT_FROM` ids). A high half in both runs
    (crafted ids) takes the sort, which orders such ids by their low half."""
    n, m = len(big), len(small)
    if n + m < _INSERT_FROM:  # cache-sized: the stable sort of two sorted runs is faster
        return _concatenated([big, small])
    at = np.searchsorted(big.hi, small.hi)
    if bool(np.any(big.hi[np.minimum(at, n - 1)] == small.hi)):
        return _concatenated([big, small])
    at += np.arange(m)
    theirs = np.ones(n + m, dtype=bool)
    theirs[at] = False
    merged = []
    for mine, other in ((big.hi, small.hi), (big.lo, small.lo), (big.rowid, small.rowid)):
        out = np.empty(n + m, dtype=mine.dtype)
        out[at] = other
        out[theirs] = mine
        merged.append(out)
    return _Run(*merged, presorted=True, ties=big.ties or small.ties)


class ReportIndex:
    """Report id -> rowid of the reports (or blocks) a study holds; see the module docstring.
    Ids are unique (the writer never adds a held id). Not thread-safe: lookups reorganise it
    too (``match``, ``sorted``), so every use holds the study's lock (``StudyState.lock``)."""

    def __init__(self) -> None:
        self._main = _merge(())
        self._runs: list[_Run] = []
        self._recent: dict[bytes, int] = {}
        self._n = 0
        self._filter = _Filter()

    # --- size and equality ----------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReportIndex):
            return NotImplemented
        a, b = self.sorted(), other.sorted()
        return all(np.array_equal(x, y) for x, y in zip(a, b))

    # --- additions ----------------------------------------------------------------------------
    def add(self, joined: bytes, rowids: np.ndarray | Sequence[int], report_ids: Sequence[bytes] | None = None,
            presorted: SortedIds | None = None) -> None:
        """Index new ids (``joined``: concatenated; ``report_ids``: the same as a list, if the
        caller has one; ``presorted``: the same, sorted) with their rowids. None of them may be
        held already, nor repeat."""
        m = len(joined) // REPORT_ID_BYTES
        if m == 0:
            return
        rowids = np.asarray(rowids, dtype=np.int64)
        if presorted is not None and len(presorted) == m and m > 64:
            self._runs.append(_Run(presorted.hi, presorted.lo, rowids[presorted.order], presorted=True))
            hi, ascending = presorted.hi, True
        elif m <= 64:
            ids = report_ids if report_ids is not None else [
                bytes(joined[i:i + REPORT_ID_BYTES]) for i in range(0, len(joined), REPORT_ID_BYTES)]
            self._recent.update(zip(ids, rowids.tolist()))
            hi, ascending = None, False
            if len(self._recent) >= _RECENT_LIMIT:
                self._flush_recent()
        else:
            hi, lo = halves(joined)
            self._runs.append(_Run(hi, lo, rowids.copy()))
            hi, ascending = self._runs[-1].hi, True
        self._n += m
        if self._n > self._filter.capacity:
            self._refilter()
        elif hi is None:
            self._filter.add_ids(ids)
        else:
            self._filter.add(hi, ascending)
        self._maybe_merge()

    def _refilter(self) -> None:
        """A filter sized for the ids held now, built from every one of them."""
        fresh = _Filter(self._n)
        for run in (self._main, *self._runs):
            fresh.add(run.hi, ascending=True)
        if self._recent:
            fresh.add(np.frombuffer(b"".join(self._recent), dtype=">u8")[::2].astype(np.uint64))
        self._filter = fresh

    def restore(self, hi: np.ndarray, lo: np.ndarray, rowids: np.ndarray) -> bool:
        """Replace the index by these ids (a checkpoint's: ascending, else sorted here); False,
        and the index unchanged, if an id repeats."""
        presorted = strictly_ascending(hi, lo)
        run = _Run(hi, lo, rowids, presorted=presorted)
        if not presorted and not strictly_ascending(run.hi, run.lo):
            return False
        self._main = run
        self._runs, self._recent, self._n = [], {}, len(hi)
        self._refilter()
        return True

    def _flush_recent(self) -> None:
        if self._recent:
            joined = b"".join(self._recent)
            hi, lo = halves(joined)
            self._runs.append(_Run(hi, lo, np.fromiter(self._recent.values(), np.int64, len(self._recent))))
            self._recent = {}

    def _maybe_merge(self) -> None:
        runs = self._runs
        while len(runs) >= 2 and 2 * len(runs[-1]) >= len(runs[-2]):
            runs[-2:] = [_merge(runs[-2:])]
        pending = sum(len(r) for r in runs)
        if len(self._runs) > _MAX_RUNS or pending > len(self._main) // 4:
            self._main = _merge([self._main, *self._runs])
            self._runs = []

    def consolidate(self) -> _Run:
        """Everything in the main run (for a commit or a checkpoint); returns it."""
        self._flush_recent()
        if self._runs:
            self._main = _merge([self._main, *self._runs])
            self._runs = []
        return self._main

    def sorted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hi, lo, rowid) of every held id, ascending by id."""
        run = self.consolidate()
        return run.hi, run.lo, run.rowid

    # --- lookups ------------------------------------------------------------------------------
    def lookup(self, joined: bytes, report_ids: Sequence[bytes] | None = None,
               presorted: SortedIds | None = None) -> np.ndarray:
        """The rowid of each of the concatenated ids, -1 where it is not held (``presorted``:
        the same ids sorted, if the caller has them)."""
        if len(joined) <= _FEW * REPORT_ID_BYTES:  # a few ids (single uploads): one at a time
            return np.array([self._one(joined[i:i + REPORT_ID_BYTES])
                             for i in range(0, len(joined), REPORT_ID_BYTES)], dtype=np.int64)
        if presorted is not None and len(presorted) * REPORT_ID_BYTES == len(joined):
            hi, lo, order = presorted.hi, presorted.lo, presorted.order
        else:
            hi, lo = halves(joined)
            order = None
            if len(hi) > 64 and not bool(np.all(hi[1:] >= hi[:-1])):  # sort the needles once for every run
                order = np.argsort(hi)
                hi, lo = hi[order], lo[order]
        found = np.full(len(hi), -1, dtype=np.int64)
        maybe = np.flatnonzero(self._filter.maybe(hi))  # ascending: the needles stay sorted
        if len(maybe) == 0:
            return found  # none held (the recent ones' bits are set too)
        few_hi, few_lo = hi[maybe], lo[maybe]
        for run in (self._main, *self._runs):
            if len(run):
                at = run.find(few_hi, few_lo)
                hit = at >= 0
                found[maybe[hit]] = run.rowid[at[hit]]
        if order is None:
            out = found
        else:
            out = np.empty_like(found)
            out[order] = found
            maybe = order[maybe]
        if self._recent:
            get = self._recent.get
            for i in maybe[out[maybe] < 0].tolist():
                rowid = get(report_ids[i] if report_ids is not None
                            else bytes(joined[i * REPORT_ID_BYTES:(i + 1) * REPORT_ID_BYTES]))
                if rowid is not None:
                    out[i] = rowid
        return out

    def _one(self, rid: bytes) -> int:
        hi = int.from_bytes(rid[:8], "big")
        if not self._filter.maybe_one(hi):
            return -1
        rowid = self._recent.get(rid)
        if rowid is not None:
            return rowid
        lo = int.from_bytes(rid[8:], "big")
        for run in (self._main, *self._runs):
            at = run.find_one(hi, lo)
            if at >= 0:
                return int(run.rowid[at])
        return -1

    def any_held(self, joined: bytes, report_ids: Sequence[bytes] | None = None,
                 presorted: SortedIds | None = None) -> bool:
        """Whether any of the concatenated ids is held."""
        if self._n == 0:
            return False
        if len(joined) <= _FEW * REPORT_ID_BYTES:  # a few ids (single uploads): no arrays at all
            return any(self._one(joined[i:i + REPORT_ID_BYTES]) >= 0
                       for i in range(0, len(joined), REPORT_ID_BYTES))
        return bool(np.any(self.lookup(joined, report_ids, presorted) >= 0))

    def get(self, rid: bytes) -> int | None:
        """The rowid of one id, None if not held."""
        found = self._one(rid) if len(rid) == REPORT_ID_BYTES else -1
        return found if found >= 0 else None

    def __contains__(self, rid: object) -> bool:
        return isinstance(rid, bytes) and self.get(rid) is not None

    def match(self, hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For queried ids (halves): ``rowid`` of each (-1: not held), and ``excluded``: the
        rowids of held ids not among the queried ones, ascending by id. Consolidates first."""
        run = self.consolidate()
        if len(run) == 0:
            return np.full(len(hi), -1, dtype=np.int64), run.rowid
        at = run.find(hi, lo)
        hit = at >= 0
        matched = np.zeros(len(run), dtype=bool)
        matched[at[hit]] = True
        return np.where(hit, run.rowid[np.maximum(at, 0)], -1), run.rowid[~matched]
