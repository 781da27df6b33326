"""The finalization's fast path (issue 46): the servers are asked at once, their id lists are
intersected as arrays with each server's commit bitmap from the same pass, and the analyzer's
store keeps the inclusion set out of the row the release updates.

Unit checks with stand-in servers (the real ones are exercised by tests/test_faults.py,
tests/test_e2e.py and ``dpsketch bench finalize``): each stand-in checks what it is sent
against sets of ``bytes`` computed here, never against the analyzer's own code path.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpsketch.analyzer.coordinator import Coordinator, UpstreamError
from dpsketch.analyzer.store import AnalyzerStore
from dpsketch.protocol import inclusion, messages
from dpsketch.protocol.messages import CommitResult, ServerInfo
from dpsketch.protocol.problems import ProblemError
from dpsketch.protocol.study import design

ids16 = st.binary(min_size=16, max_size=16)
# ids sharing their high half (crafted): the exact path of the search
near_ids = st.builds(lambda hi, lo: hi.to_bytes(8, "big") + lo.to_bytes(8, "big"),
                     st.integers(0, 3) | st.integers(0, 2**64 - 1), st.integers(0, 3) | st.integers(0, 2**64 - 1))


@settings(max_examples=150, deadline=None)
@given(lists=st.lists(st.lists(ids16 | near_ids, max_size=40), min_size=1, max_size=4))
def test_intersect_held_gives_the_set_intersection_and_each_lists_mask(lists):
    bodies = [messages.encode_report_ids(ids) for ids in lists]
    common, masks = messages.intersect_held([messages.report_id_halves(b) for b in bodies])
    on_all = set.intersection(*(set(ids) for ids in lists))
    assert common == b"".join(sorted(on_all))
    for body, mask in zip(bodies, masks):
        held = messages.decode_report_ids(body)
        assert mask.dtype == bool and mask.tolist() == [rid in on_all for rid in held]
        # the bitmap made from the mask is the one made from the list and the set
        digest = hashlib.sha256(common).digest()
        assert inclusion.encode(mask, digest) == inclusion.encode_for(body, common)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(ids16 | near_ids, max_size=50))
def test_encode_report_ids_takes_bytes_lists_joined_bytes_and_arrays_alike(ids):
    expected = b"".join(sorted(set(ids)))
    joined = b"".join(ids)
    assert messages.encode_report_ids(ids) == expected
    assert messages.encode_report_ids(joined) == expected
    assert messages.encode_report_ids(np.frombuffer(joined, dtype=">u8").reshape(-1, 2)) == expected


def test_encode_report_ids_refuses_a_partial_id():
    with pytest.raises(ValueError):
        messages.encode_report_ids(b"\x01" * 17)


class StandIn:
    """A share server for the coordinator: holds ``ids``; its GET of them waits at ``barrier``
    (so finalize passes only if every server is asked at once); checks a commit against sets."""

    def __init__(self, server_id: str, ids: list[bytes], barrier: threading.Barrier, refuse: str | None = None):
        self.endpoint = SimpleNamespace(server_id=server_id, url=f"http://{server_id}")
        self.ids, self.barrier, self.refuse = sorted(ids), barrier, refuse
        self.fetches = 0
        self.committed: bytes | None = None

    def held_ids(self, study_id):
        self.fetches += 1
        self.barrier.wait(10)  # BrokenBarrierError unless the other servers are asked meanwhile
        return messages.report_id_halves(b"".join(self.ids))

    def report_ids(self, study_id):
        return self.held_ids(study_id).tobytes()

    def server_info(self):
        return ServerInfo(server_id=self.endpoint.server_id, protocol="dpsketch/2", version="test",
                          policy={"max_excluded_fraction": 0.5})

    def commit(self, study_id, sorted_ids, held_mask=None, digest=None):
        self.barrier.wait(10)
        if self.refuse:
            raise UpstreamError(self.endpoint.server_id, self.refuse, ProblemError(self.refuse, "refused"))
        assert held_mask is not None and digest == hashlib.sha256(sorted_ids).digest()
        included = set(messages.decode_report_ids(sorted_ids))
        assert held_mask.tolist() == [rid in included for rid in self.ids]
        self.committed = sorted_ids
        return CommitResult(inclusion_hash=digest.hex(), n_reports=len(included), lambda_min=10.0,
                            lambda_star=1.0, t=0, margin=9.0)

    def aggregate(self, study):
        self.barrier.wait(10)
        return np.full((study.k, study.width), 1, dtype=np.uint64), hashlib.sha256(self.committed).hexdigest()


def _coordinator(tmp_path, servers) -> tuple[Coordinator, object]:
    study = design(name="fin", columns=["a", "b", "c"], label=None, servers=[s.endpoint.server_id for s in servers],
                   expected_reports=100, k=1, s=1, min_reports=10, epsilon_floor=None)[0]
    coordinator = object.__new__(Coordinator)
    coordinator.store = AnalyzerStore(tmp_path / "analyzer.sqlite3")
    coordinator.store.add_study(study, [])
    coordinator.servers = servers
    coordinator.log = lambda _msg: None
    return coordinator, study


def test_finalize_asks_every_server_at_once_and_fetches_each_list_once(tmp_path):
    everyone = [os.urandom(16) for _ in range(60)]
    barrier = threading.Barrier(3)
    servers = [StandIn(f"s{j}", [rid for i, rid in enumerate(everyone) if i % 7 != j], barrier) for j in range(3)]
    coordinator, study = _coordinator(tmp_path, servers)
    record = coordinator.finalize(study.study_id)
    on_all = sorted(rid for i, rid in enumerate(everyone) if i % 7 not in (0, 1, 2))
    assert record.state == "released" and record.n_reports == len(on_all)
    assert [s.committed for s in servers] == [b"".join(on_all)] * 3
    assert [s.fetches for s in servers] == [1, 1, 1]  # the bitmaps came from the intersection
    assert np.array_equal(record.ring_sum, np.full((study.k, study.width), 3, dtype=np.uint64))
    assert coordinator.store.inclusion(study.study_id) == b"".join(on_all)
    coordinator.store.close()


@pytest.mark.parametrize("refusing", [3, 2])
def test_a_refused_set_is_forgotten_only_when_every_server_refused_it(tmp_path, refusing):
    """Committed concurrently, a set some server accepted must stay on record (a later finalize
    with another set would be refused there forever); a set all refused is forgotten."""
    everyone = [os.urandom(16) for _ in range(30)]
    barrier = threading.Barrier(3)
    servers = [StandIn(f"s{j}", everyone, barrier, refuse="certificate-refused" if j < refusing else None)
               for j in range(3)]
    coordinator, study = _coordinator(tmp_path, servers)
    with pytest.raises((ProblemError, UpstreamError)):
        coordinator.finalize(study.study_id)
    on_record = coordinator.store.inclusion(study.study_id)
    assert on_record == (None if refusing == 3 else b"".join(sorted(everyone)))
    coordinator.store.close()


def test_the_release_does_not_write_the_inclusion_set_again(tmp_path):
    """The set has a table of its own: the release's update of the study's row writes a few
    pages, not the set's (SQLite rewrites a whole row on UPDATE)."""
    path = tmp_path / "analyzer.sqlite3"
    store = AnalyzerStore(path)
    study = design(name="rel", columns=["a", "b", "c"], label=None, servers=["s1", "s2"], expected_reports=100,
                   k=1, s=1, min_reports=10, epsilon_floor=None)[0]
    store.add_study(study, [])
    ids = messages.encode_report_ids(os.urandom(16 * 100_000))  # 1.6 MB: about 400 pages
    assert store.fix_inclusion(study.study_id, ids) == ids
    assert store.fix_inclusion(study.study_id, ids[16:]) == ids  # the first set wins
    probe = sqlite3.connect(path, isolation_level=None)
    for _ in range(200):  # an empty log, so what follows is the release's (the store's own
        # background checkpoint of the set may hold the log for a moment: then again)
        busy, frames, _done = probe.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if not busy and frames == 0:
            break
        threading.Event().wait(0.05)
    else:
        raise AssertionError("the log could not be emptied")
    store.release(study.study_id, np.zeros((study.k, study.width), dtype=np.uint64), 100_000)
    for _ in range(200):  # the release's background checkpoint may hold the log: then again
        busy, frames, _done = probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if not busy:
            break
        threading.Event().wait(0.05)
    assert 0 < frames < 20, frames
    probe.close()
    store.close()
    reopened = AnalyzerStore(path)
    assert reopened.inclusion(study.study_id) == ids and reopened.get(study.study_id).state == "released"
    reopened.close()


def test_the_chunked_search_of_ascending_queries_finds_what_one_search_finds(monkeypatch):
    """messages.locate_ascending (the intersection's search) locates a sorted list's ids chunk
    by chunk, each in the stretch its first and last query bound (cache-sized at 10^7): the
    same positions as one search (messages.locate), at every chunk boundary, with queries
    before, between and past the list's ids and high halves shared by several ids (which only
    crafted ids have)."""
    from dpsketch.protocol import messages as m

    rng = np.random.default_rng(46)

    def sorted_ids(hi, lo):
        order = np.lexsort((lo, hi))
        hi, lo = hi[order], lo[order]
        keep = np.ones(len(hi), dtype=bool)
        keep[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
        return hi[keep], lo[keep]

    hi, lo = sorted_ids(rng.integers(0, 1000, size=600, dtype=np.uint64),  # many shared high halves
                        rng.integers(0, 2**63, size=600, dtype=np.uint64))
    picks = np.sort(rng.choice(len(hi), size=300, replace=False))
    q_hi, q_lo = sorted_ids(np.concatenate([[0], hi[picks], rng.integers(0, 1100, size=200, dtype=np.uint64)]),
                            np.concatenate([[1], lo[picks], rng.integers(0, 2**63, size=200, dtype=np.uint64)]))
    for list_hi, list_lo in ((hi, lo), np.unique(hi, return_index=True)):
        if list_lo.dtype != np.uint64:  # (np.unique gave the first index of each high half)
            list_lo = lo[list_lo]
        ids = np.empty((len(list_hi), 2), dtype=">u8")
        ids[:, 0], ids[:, 1] = list_hi, list_lo
        whole = m.locate(list_hi, list_lo, q_hi, q_lo)
        assert int(np.count_nonzero(whole >= 0)) >= 100
        for chunk in (1, 7, 64, 10**6):
            monkeypatch.setattr(m, "SEARCH_CHUNK", chunk)
            assert np.array_equal(m.locate_ascending(ids, q_hi, q_lo), whole), chunk
    assert len(m.locate_ascending(np.empty((0, 2), dtype=">u8"), q_hi, q_lo)) == len(q_hi)


def test_encode_report_ids_orders_ids_whose_high_halves_differ_only_in_their_low_bits():
    """encode_report_ids sorts the high halves with each one's position in its low bits
    (messages._order_by_high_bits); ids that differ only there (or not at all in the high half,
    or are repeated) are put in order by all 128 bits afterwards: 5,000 such ids, shuffled."""
    rng = np.random.default_rng(46)
    base = int(rng.integers(0, 2**50)) << 13
    ids = [(base + int(rng.integers(0, 2**13))).to_bytes(8, "big") + int(rng.integers(0, 2**64 - 1, dtype=np.uint64)).to_bytes(8, "big")
           for _ in range(4_000)]
    ids += ids[:500] + [ids[0][:8] + bytes(8)] * 3  # repeats, and a low half of zeros
    ids += [rng.bytes(16) for _ in range(497)]
    rng.shuffle(ids)
    assert messages.encode_report_ids(ids) == b"".join(sorted(set(ids)))


def test_the_set_is_copied_from_the_log_after_the_release_not_before(tmp_path, monkeypatch):
    """The inclusion set reaches the database file only after the release, in the background:
    not while the servers commit (a 16 MB copy and sync at 10^6 reports on their disk), and not
    in the release's own write (SQLite's automatic checkpoint, the analyst waiting)."""
    path = tmp_path / "analyzer.sqlite3"
    store = AnalyzerStore(path)
    started: list[int] = []
    monkeypatch.setattr(store, "_checkpoint_soon", lambda: started.append(os.path.getsize(path)))
    study = design(name="ckpt", columns=["a", "b", "c"], label=None, servers=["s1", "s2"], expected_reports=100,
                   k=1, s=1, min_reports=10, epsilon_floor=None)[0]
    store.add_study(study, [])
    ids = messages.encode_report_ids(os.urandom(16 * 300_000))  # 4.8 MB: past the automatic 1000 pages
    before = os.path.getsize(path)
    assert store.fix_inclusion(study.study_id, ids) == ids
    assert started == [] and os.path.getsize(path) == before  # the set only in the log
    store.release(study.study_id, np.zeros((study.k, study.width), dtype=np.uint64), 300_000)
    assert started == [before] and os.path.getsize(path) == before  # no checkpoint in the release
    # SQLite's automatic checkpoint is on again for every other write
    assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == store._autocheckpoint > 0
    store.close()
    reopened = AnalyzerStore(path)
    assert reopened.inclusion(study.study_id) == ids and reopened.get(study.study_id).state == "released"
    reopened.close()
