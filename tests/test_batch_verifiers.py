"""The batch section of a verifier message (dpsketch/protocol/batch_verifiers.py) and what the
analyzer makes of it (analyzer/coordinator.py: the others' sums of the batches every server
holds, and each server's held ids with its batches' rows)."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import numpy as np
import pytest

from dpsketch.analyzer.coordinator import Coordinator, UpstreamError, _with_rows
from dpsketch.protocol import batch_validity, batch_verifiers, field, messages, validity
from dpsketch.protocol.batch_verifiers import BatchVerifier

RNG = np.random.default_rng(7)


def _share(v: int) -> np.ndarray:
    return RNG.integers(0, field.P, size=(v, 2), dtype=np.uint64)


def _entries(n: int, v: int = 5) -> list[BatchVerifier]:
    return [BatchVerifier(RNG.bytes(16), int(RNG.integers(1, 1000)), _share(v)) for _ in range(n)]


def test_a_section_round_trips_sorted_by_batch_id():
    entries = _entries(4) + [BatchVerifier(RNG.bytes(16), 7, _share(9))]
    body = batch_verifiers.encode(entries)
    assert len(body) == 4 + sum(24 + 16 * e.verifier_len for e in entries)
    got = batch_verifiers.decode(body)
    assert [e.batch_id for e in got] == sorted(e.batch_id for e in entries)
    by_id = {e.batch_id: e for e in entries}
    for e in got:
        assert e.m == by_id[e.batch_id].m
        assert np.array_equal(e.share, by_id[e.batch_id].share)
    assert batch_verifiers.decode(batch_verifiers.encode([])) == []


def test_the_report_section_splits_off_unchanged():
    ids = np.sort(RNG.integers(0, 256, size=(3, 16), dtype=np.uint8).view("V16").ravel()).view(np.uint8).reshape(3, 16)
    shares = RNG.integers(0, field.P, size=(3, 4, 2), dtype=np.uint64)
    reports = validity.encode_verifiers(ids, shares)
    section = batch_verifiers.encode(_entries(2))
    head, tail = batch_verifiers.split(reports + section, 4)
    assert (head, tail) == (reports, section)
    got_ids, got_shares = validity.decode_verifiers(head, 4)
    assert np.array_equal(got_ids, ids) and np.array_equal(got_shares, shares)
    with pytest.raises(validity.ValidityError):
        batch_verifiers.split(reports[:-1], 4)


@pytest.mark.parametrize("case", ["short-count", "cut-entry", "cut-share", "trailing", "v-zero", "v-huge",
                                  "m-zero", "not-ascending", "repeat", "element-p"])
def test_a_malformed_section_is_refused(case):
    a, b = sorted(_entries(2), key=lambda e: e.batch_id)
    body = bytearray(batch_verifiers.encode([a, b]))
    first = 4  # where the first entry starts
    second = first + 24 + 16 * a.verifier_len
    if case == "short-count":
        body = body[:3]
    elif case == "cut-entry":
        body = body[:second + 10]
    elif case == "cut-share":
        body = body[:-8]
    elif case == "trailing":
        body += b"\0"
    elif case == "v-zero":
        struct.pack_into("<I", body, first + 20, 0)
    elif case == "v-huge":
        struct.pack_into("<I", body, first + 20, batch_verifiers.MAX_VERIFIER_LEN + 1)
    elif case == "m-zero":
        struct.pack_into("<I", body, first + 16, 0)
    elif case == "not-ascending":
        body = bytearray(struct.pack("<I", 2)) + body[second:] + body[first:second]
    elif case == "repeat":
        body = bytearray(struct.pack("<I", 2)) + body[first:second] + body[first:second]
    elif case == "element-p":
        struct.pack_into("<Q", body, first + 24, field.P)
    with pytest.raises(validity.ValidityError):
        batch_verifiers.decode(bytes(body))


def test_encode_refuses_one_batch_twice():
    e = _entries(1)[0]
    with pytest.raises(ValueError):
        batch_verifiers.encode([e, BatchVerifier(e.batch_id, e.m, _share(5))])


def test_a_servers_held_ids_take_its_batches_rows_in_order():
    reports = np.sort(RNG.integers(0, 256, size=(50, 16), dtype=np.uint8).view("V16").ravel())
    ids = messages.report_id_halves(reports.tobytes())
    rows = [batch_validity.row_ids(RNG.bytes(16), m) for m in (3, 40)]
    held = _with_rows(ids, rows)
    assert len(held) == 93
    want = messages.encode_report_ids(reports.tobytes() + b"".join(r.tobytes() for r in rows))
    assert held.tobytes() == want
    assert _with_rows(ids, []) is ids


def _coordinator(n: int) -> Coordinator:
    c = Coordinator.__new__(Coordinator)
    c.servers = [SimpleNamespace(endpoint=SimpleNamespace(server_id=f"s{j}")) for j in range(n)]
    return c


def test_each_server_is_sent_the_others_sum_of_the_batches_held_everywhere():
    n = 3
    everywhere = _entries(3, v=6)
    only_two = _entries(1, v=6)[0]
    held = [[BatchVerifier(e.batch_id, e.m, _share(6)) for e in everywhere] for _ in range(n)]
    held[0].append(only_two)
    held[1].append(BatchVerifier(only_two.batch_id, only_two.m, _share(6)))
    sections, n_rows, rows = _coordinator(n)._batch_sums(held)
    assert n_rows == sum(e.m for e in everywhere)
    assert [sum(len(r) for r in rs) for rs in rows] == [n_rows + only_two.m] * 2 + [n_rows]
    for j in range(n):
        got = {e.batch_id: e for e in batch_verifiers.decode(sections[j])}
        assert set(got) == {e.batch_id for e in everywhere}  # the batch some server lacks is not decided
        for bid, e in got.items():
            mine = {x.batch_id: x for x in held[j]}[bid]
            total = field.add(e.share, mine.share)
            want = held[0][[x.batch_id for x in held[0]].index(bid)].share
            for k in (1, 2):
                want = field.add(want, {x.batch_id: x for x in held[k]}[bid].share)
            assert np.array_equal(total, want)


def test_servers_that_disagree_on_a_batchs_rows_are_faulty():
    e = _entries(1, v=4)[0]
    held = [[e], [BatchVerifier(e.batch_id, e.m + 1, _share(4))]]
    with pytest.raises(UpstreamError):
        _coordinator(2)._batch_sums(held)
