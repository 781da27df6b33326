"""Wire formats shared by the SDK, the share servers and the analyzer (docs/protocol.md).

JSON bodies are pydantic models; bulk data travels as little-endian binary:

* a share batch (``application/x-dpsketch-shares``): m records of 16-byte report id, the
  16 N-byte proof that binds the share to the id (``binding``) and width little-endian uint64
  share values, nothing else;
* a seed batch (``application/x-dpsketch-seeds``): m records of 16-byte report id, proof and a
  32-byte seed that expands to the share (``ring.expand_seed``), nothing else;
* a report-id list (``application/x-dpsketch-report-ids``): m 16-byte ids in ascending bytewise
  order, no repeats;
* an aggregate share (``application/x-dpsketch-aggregate``): k * d little-endian uint64, row-major;
* a sealed batch (``application/x-dpsketch-sealed``): m records, each a proof and a share or seed
  sealed to one server with HPKE (``envelope``: layout, context binding, seal and open);
* a block batch (``application/x-dpsketch-blocks; party=NAME``): one party's blocks of a study with
  parties (``parties``): m records of 16-byte block id, 16-byte pseudonym, proof and the share of
  the party's columns;
* a block seed batch (``application/x-dpsketch-block-seeds; party=NAME``): a validity study's
  blocks at a helper (docs/protocol.md section 4c): m records of block id, pseudonym, proof and
  a 32-byte seed that expands to the helper's input and proof shares;
* a block index (``application/x-dpsketch-block-index``): m records of block id, pseudonym and
  party index (one byte), in ascending block-id order.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from . import binding, ring
from .sketch import REPORT_ID_BYTES
from .study import POPULATION_PATTERN, Study

SHARES_MEDIA_TYPE = "application/x-dpsketch-shares"
SEEDS_MEDIA_TYPE = "application/x-dpsketch-seeds"
REPORT_IDS_MEDIA_TYPE = "application/x-dpsketch-report-ids"
AGGREGATE_MEDIA_TYPE = "application/x-dpsketch-aggregate"
#: A batch of HPKE-sealed shares or seeds (dpsketch.protocol.envelope, docs/protocol.md 7a).
SEALED_MEDIA_TYPE = "application/x-dpsketch-sealed"
PROBLEM_MEDIA_TYPE = "application/problem+json"
#: One party's blocks (``parties``); the party's name is the media type's ``party`` parameter.
BLOCKS_MEDIA_TYPE = "application/x-dpsketch-blocks"
BLOCK_INDEX_MEDIA_TYPE = "application/x-dpsketch-block-index"
#: One party's blocks of a study with validity proofs at a helper: a seed where a block has its share.
BLOCK_SEEDS_MEDIA_TYPE = "application/x-dpsketch-block-seeds"

#: Response header carrying the inclusion hash next to an aggregate share.
INCLUSION_HASH_HEADER = "X-Dpsketch-Inclusion-Hash"


# --- binary formats --------------------------------------------------------------------------


@dataclass
class Upload:
    """The records of one upload to one server, before anything is stored: their report ids,
    proofs (``binding``: the salt and the other servers' commitments, (m, 16 N) uint8) and
    payloads of one kind (``content``: an (m, width) uint64 share matrix, or (m, 32) uint8 seeds
    that expand to the shares)."""

    ids: Sequence[bytes]  # a list, or an IdList over the body's ids
    proofs: np.ndarray
    payloads: np.ndarray
    content: int

    def __len__(self) -> int:
        return len(self.ids)

    #: blocks of a study with parties: each record's pseudonym, and the party's index
    pseudonyms: list[bytes] | None = None
    party: int | None = None
    @functools.cached_property
    def joined(self) -> bytes:
        """The ids concatenated (as a batch body holds them; made once otherwise)."""
        return joined_ids(self.ids)

    def verify(self, study_id: str, n_servers: int, position: int) -> None:
        """BindingError unless every payload is the one its report id commits to (binding.py)."""
        prefixes = (None if self.pseudonyms is None
                    else binding.block_prefixes(study_id, self.party or 0, self.pseudonyms))
        binding.verify(study_id, n_servers, position, self.content, self.ids, self.proofs, self.payloads,
                       prefixes, self.joined)

    def shares(self, width: int) -> np.ndarray:
        """The (m, width) uint64 shares (seeds expanded, section 4)."""
        if self.content == binding.CONTENT_SEED:
            return ring.expand_seeds(self.payloads, width)
        return self.payloads


def split_ids(raw: bytes) -> list[bytes]:
    """Concatenated 16-byte ids (or pseudonyms) as a list."""
    return [raw[i : i + REPORT_ID_BYTES] for i in range(0, len(raw), REPORT_ID_BYTES)]


class IdList(Sequence):
    """Concatenated 16-byte ids as a sequence of ``bytes``, each cut from ``joined`` only when
    asked for: a batch of 10^4 reports then carries no Python object per report through a
    server's checks (what needs them one by one, a repeat or a conflict, takes them)."""

    __slots__ = ("joined",)

    def __init__(self, joined: bytes):
        self.joined = joined

    def __len__(self) -> int:
        return len(self.joined) // REPORT_ID_BYTES

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1:
                return IdList(self.joined[start * REPORT_ID_BYTES:max(start, stop) * REPORT_ID_BYTES])
            return [self[j] for j in range(start, stop, step)]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.joined[i * REPORT_ID_BYTES:(i + 1) * REPORT_ID_BYTES]

    def __iter__(self):
        joined = self.joined
        return (joined[i:i + REPORT_ID_BYTES] for i in range(0, len(joined), REPORT_ID_BYTES))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IdList):
            return self.joined == other.joined
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented


def joined_ids(ids: Sequence[bytes]) -> bytes:
    """The ids concatenated, as a batch body holds them (an IdList's own bytes, not a copy)."""
    return ids.joined if isinstance(ids, IdList) else b"".join(ids)


def batch_dtype(width: int, n_servers: int) -> np.dtype:
    """One record of ``application/x-dpsketch-shares``: id, proof, share."""
    return np.dtype([("id", f"V{REPORT_ID_BYTES}"), ("proof", np.uint8, (binding.proof_bytes(n_servers),)),
                     ("share", "<u8", (width,))])


def seed_dtype(n_servers: int) -> np.dtype:
    """One record of ``application/x-dpsketch-seeds``: id, proof, seed."""
    return np.dtype([("id", f"V{REPORT_ID_BYTES}"), ("proof", np.uint8, (binding.proof_bytes(n_servers),)),
                     ("seed", np.uint8, (ring.SEED_BYTES,))])


def block_dtype(width: int, n_servers: int) -> np.dtype:
    """One record of ``application/x-dpsketch-blocks``: block id, pseudonym, proof, share of the
    party's ``width`` columns."""
    return np.dtype([("id", f"V{REPORT_ID_BYTES}"), ("pseudonym", f"V{REPORT_ID_BYTES}"),
                     ("proof", np.uint8, (binding.proof_bytes(n_servers),)), ("share", "<u8", (width,))])


def block_seed_dtype(n_servers: int) -> np.dtype:
    """One record of ``application/x-dpsketch-block-seeds``: block id, pseudonym, proof, seed."""
    return np.dtype([("id", f"V{REPORT_ID_BYTES}"), ("pseudonym", f"V{REPORT_ID_BYTES}"),
                     ("proof", np.uint8, (binding.proof_bytes(n_servers),)), ("seed", np.uint8, (ring.SEED_BYTES,))])


BLOCK_INDEX_DTYPE = np.dtype([("id", f"V{REPORT_ID_BYTES}"), ("pseudonym", f"V{REPORT_ID_BYTES}"),
                              ("party", np.uint8)])


def blocks_media_type(party: str, seeds: bool = False) -> str:
    """The Content-Type of a block batch of this party (``seeds``: a block seed batch)."""
    return f"{BLOCK_SEEDS_MEDIA_TYPE if seeds else BLOCKS_MEDIA_TYPE}; party={party}"


def party_of_media_type(content_type: str) -> str | None:
    """The ``party`` parameter of a block batch's Content-Type (None if absent)."""
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "party":
            return value.strip().strip('"') or None
    return None


def encode_blocks(block_ids: list[bytes], pseudonyms: list[bytes], proofs: np.ndarray,
                  shares: np.ndarray) -> bytes:
    """An ``application/x-dpsketch-blocks`` body."""
    shares = np.asarray(shares, dtype=np.uint64)
    proofs = np.asarray(proofs, dtype=np.uint8)
    n_servers = (proofs.shape[1] - binding.SALT_BYTES) // binding.COMMITMENT_BYTES + 1
    records = np.empty(len(shares), dtype=block_dtype(shares.shape[1], n_servers))
    records["id"] = _ids_field(block_ids)
    records["pseudonym"] = _ids_field(pseudonyms)
    records["proof"] = proofs
    records["share"] = shares
    return records.tobytes()


def encode_block_seeds(block_ids: list[bytes], pseudonyms: list[bytes], proofs: np.ndarray,
                       seeds: np.ndarray) -> bytes:
    """An ``application/x-dpsketch-block-seeds`` body."""
    proofs = np.asarray(proofs, dtype=np.uint8)
    n_servers = (proofs.shape[1] - binding.SALT_BYTES) // binding.COMMITMENT_BYTES + 1
    records = np.empty(len(seeds), dtype=block_seed_dtype(n_servers))
    records["id"] = _ids_field(block_ids)
    records["pseudonym"] = _ids_field(pseudonyms)
    records["proof"] = proofs
    records["seed"] = np.asarray(seeds, dtype=np.uint8).reshape(len(seeds), ring.SEED_BYTES)
    return records.tobytes()


def decode_blocks(body: bytes, party: int, width: int, n_servers: int, seeds: bool = False) -> Upload:
    """Split a block batch of party ``party`` (``width`` values a share) into its records; with
    ``seeds``, a block seed batch (a 32-byte seed where a block has its share)."""
    dtype = block_seed_dtype(n_servers) if seeds else block_dtype(width, n_servers)
    if len(body) == 0 or len(body) % dtype.itemsize:
        raise ValueError(
            f"a block batch of this party is a whole number of {dtype.itemsize}-byte records "
            f"(16-byte block id, 16-byte pseudonym, {binding.proof_bytes(n_servers)}-byte proof, "
            f"{'a 32-byte seed' if seeds else f'{width} x 8-byte share'}); got {len(body)} bytes")
    records = np.frombuffer(body, dtype=dtype)
    return Upload(split_ids(records["id"].tobytes()), np.ascontiguousarray(records["proof"]),
                  np.ascontiguousarray(records["seed" if seeds else "share"]),
                  binding.CONTENT_SEED if seeds else binding.CONTENT_SHARE,
                  split_ids(records["pseudonym"].tobytes()), party)


def encode_block_index(block_ids: list[bytes], pseudonyms: list[bytes], parties: list[int]) -> bytes:
    """An ``application/x-dpsketch-block-index`` body, sorted by block id."""
    records = np.empty(len(block_ids), dtype=BLOCK_INDEX_DTYPE)
    records["id"] = _ids_field(list(block_ids))
    records["pseudonym"] = _ids_field(list(pseudonyms))
    records["party"] = parties
    order = sorted(range(len(block_ids)), key=block_ids.__getitem__)
    return records[order].tobytes()


#: the same records as BLOCK_INDEX_DTYPE, each id read as its big-endian 64-bit halves
BLOCK_INDEX_HALVES_DTYPE = np.dtype([("id_hi", ">u8"), ("id_lo", ">u8"), ("pseudonym_hi", ">u8"),
                                     ("pseudonym_lo", ">u8"), ("party", np.uint8)])


def decode_block_index(body: bytes) -> np.ndarray:
    """The records of a block index (BLOCK_INDEX_HALVES_DTYPE: the block id's and the
    pseudonym's halves and the party index; no copy of the body); ValueError if malformed: not
    a whole number of records, or the block ids not strictly ascending."""
    if len(body) % BLOCK_INDEX_HALVES_DTYPE.itemsize:
        raise ValueError(f"a block index is a whole number of {BLOCK_INDEX_HALVES_DTYPE.itemsize}-byte records")
    records = np.frombuffer(body, dtype=BLOCK_INDEX_HALVES_DTYPE)
    if not strictly_ascending(records["id_hi"], records["id_lo"]):
        raise ValueError("a block index lists its block ids in strictly ascending order")
    return records


def record_bytes(media_type: str, width: int, n_servers: int) -> int:
    """Bytes of one record of a plaintext batch of this media type (for a block batch, ``width``
    is the party's)."""
    if media_type.split(";", 1)[0].strip() == BLOCKS_MEDIA_TYPE:
        return block_dtype(width, n_servers).itemsize
    if media_type.split(";", 1)[0].strip() == BLOCK_SEEDS_MEDIA_TYPE:
        return block_seed_dtype(n_servers).itemsize
    if media_type == SEEDS_MEDIA_TYPE:
        return seed_dtype(n_servers).itemsize
    if media_type == SHARES_MEDIA_TYPE:
        return batch_dtype(width, n_servers).itemsize
    raise ValueError(f"not a plaintext batch media type: {media_type!r}")


def _ids_field(report_ids: np.ndarray | list[bytes]) -> np.ndarray:
    if isinstance(report_ids, list):
        return np.frombuffer(b"".join(report_ids), dtype=f"V{REPORT_ID_BYTES}")
    return report_ids


def _encode(dtype_of, field: str, report_ids: np.ndarray | list[bytes], proofs: np.ndarray,
            payloads: np.ndarray) -> bytes:
    proofs = np.asarray(proofs, dtype=np.uint8)
    n_servers = (proofs.shape[1] - binding.SALT_BYTES) // binding.COMMITMENT_BYTES + 1
    records = np.empty(len(payloads), dtype=dtype_of(n_servers))
    records["id"] = _ids_field(report_ids)
    records["proof"] = proofs
    records[field] = payloads
    return records.tobytes()


def encode_batch(report_ids: np.ndarray | list[bytes], proofs: np.ndarray, shares: np.ndarray) -> bytes:
    """An ``application/x-dpsketch-shares`` body: per report its id, proof and share."""
    shares = np.asarray(shares, dtype=np.uint64)
    return _encode(lambda n: batch_dtype(shares.shape[1], n), "share", report_ids, proofs, shares)


def decode_batch(body: bytes, width: int, n_servers: int) -> Upload:
    """Split a share batch into its records; ValueError if malformed."""
    dtype = batch_dtype(width, n_servers)
    if len(body) == 0 or len(body) % dtype.itemsize:
        raise ValueError(
            f"a share batch is a whole number of {dtype.itemsize}-byte records (16-byte id, "
            f"{binding.proof_bytes(n_servers)}-byte proof, {width} x 8-byte share); got {len(body)} bytes")
    records = np.frombuffer(body, dtype=dtype)
    return Upload(IdList(records["id"].tobytes()), np.ascontiguousarray(records["proof"]),
                  np.ascontiguousarray(records["share"]), binding.CONTENT_SHARE)


def encode_seed_batch(report_ids: np.ndarray | list[bytes], proofs: np.ndarray, seeds: np.ndarray) -> bytes:
    """An ``application/x-dpsketch-seeds`` body: per report its id, proof and 32-byte seed."""
    seeds = np.asarray(seeds, dtype=np.uint8).reshape(-1, ring.SEED_BYTES)
    return _encode(seed_dtype, "seed", report_ids, proofs, seeds)


def decode_seed_batch(body: bytes, n_servers: int) -> Upload:
    """Split a seed batch into its records (seeds not yet expanded); ValueError if malformed."""
    dtype = seed_dtype(n_servers)
    if len(body) == 0 or len(body) % dtype.itemsize:
        raise ValueError(
            f"a seed batch is a whole number of {dtype.itemsize}-byte records (16-byte id, "
            f"{binding.proof_bytes(n_servers)}-byte proof, 32-byte seed); got {len(body)} bytes")
    records = np.frombuffer(body, dtype=dtype)
    return Upload(IdList(records["id"].tobytes()), np.ascontiguousarray(records["proof"]),
                  np.ascontiguousarray(records["seed"]), binding.CONTENT_SEED)


def decode_upload(body: bytes, media_type: str, width: int, n_servers: int) -> Upload:
    """The records of a plaintext batch body of either media type; ValueError if malformed or of
    another type. Nothing is verified or expanded yet."""
    if media_type == SEEDS_MEDIA_TYPE:
        return decode_seed_batch(body, n_servers)
    if media_type == SHARES_MEDIA_TYPE:
        return decode_batch(body, width, n_servers)
    raise ValueError(f"not a batch media type: {media_type!r}")


def encode_report_ids(report_ids: Sequence[bytes] | bytes | np.ndarray) -> bytes:
    """A report-id list (sorted, repeat-free, concatenated 16-byte ids) of ids in any order,
    repeats allowed: a sequence of 16-byte ids, their concatenation, or an (n, 2) array of
    halves. On arrays (issue 46): a sort of the native high halves (by both halves only where
    two share one, which only crafted ids do), never a sort of 10^6 Python ``bytes``."""
    if isinstance(report_ids, np.ndarray):
        pairs = np.ascontiguousarray(report_ids, dtype=">u8").reshape(-1, 2)
    else:
        joined = report_ids if isinstance(report_ids, (bytes, bytearray, memoryview)) else b"".join(report_ids)
        if len(joined) % REPORT_ID_BYTES:
            raise ValueError(f"report ids are {REPORT_ID_BYTES} bytes each")
        pairs = np.frombuffer(joined, dtype=">u8").reshape(-1, 2)
    hi, lo = pairs[:, 0].astype(np.uint64), pairs[:, 1].astype(np.uint64)
    order = _order_by_high_bits(hi)
    hi, lo = hi[order], lo[order]
    # in order by all 128 bits where neighbours share the high bits the sort saw (about 45 pairs
    # of 10^7 random ids; a repeated id; crafted ids): those few, sorted among themselves, go
    # back to the same places (a shared prefix keeps them together and apart from the others)
    tied = np.flatnonzero((hi[1:] >> _shift(len(hi))) == (hi[:-1] >> _shift(len(hi))))
    if len(tied):
        at = np.union1d(tied, tied + 1)
        sub = np.lexsort((lo[at], hi[at]))
        hi[at], lo[at] = hi[at][sub], lo[at][sub]
    keep = np.ones(len(hi), dtype=bool)
    keep[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
    out = np.empty((int(np.count_nonzero(keep)), 2), dtype=">u8")
    out[:, 0], out[:, 1] = hi[keep], lo[keep]
    return out.tobytes()


def _shift(n: int) -> np.uint64:
    """The low bits of a high half that :func:`_order_by_high_bits` gives over to positions."""
    return np.uint64(max(1, (n - 1).bit_length()))


def _order_by_high_bits(hi: np.ndarray) -> np.ndarray:
    """An order of ``hi`` ascending by all but its low ``_shift(n)`` bits (ties: by position).
    Why not ``np.argsort``: numpy's sort of the values alone is 4-10x faster than its argsort of
    them (2.4 s stable, 1.1 s not, at 10^7 against 0.24 s), so each value's low bits carry its
    position through one ``np.sort``; the caller orders the few neighbours whose remaining high
    bits tie."""
    n = len(hi)
    shift = _shift(n)
    key = (hi >> shift) << shift
    key |= np.arange(n, dtype=np.uint64)
    key.sort()
    key &= (np.uint64(1) << shift) - np.uint64(1)
    return key.astype(np.intp, copy=False)


def strictly_ascending(hi: np.ndarray, lo: np.ndarray) -> bool:
    """Whether ids given by their high and low 64-bit halves are in strictly ascending bytewise
    order (hence also repeat-free): the order rule of a report-id list."""
    if len(hi) < 2:
        return True
    return bool(np.all((hi[1:] > hi[:-1]) | ((hi[1:] == hi[:-1]) & (lo[1:] > lo[:-1]))))


def report_id_halves(body: bytes) -> np.ndarray:
    """A sorted, repeat-free id list as an (n, 2) array of its ids' big-endian 64-bit halves
    (bytewise order of 16-byte ids = lexicographic order of the halves; no copy of the body);
    ValueError if malformed."""
    if len(body) % REPORT_ID_BYTES:
        raise ValueError(f"a report-id list is a whole number of {REPORT_ID_BYTES}-byte ids")
    halves = np.frombuffer(body, dtype=">u8").reshape(-1, 2)
    if not strictly_ascending(halves[:, 0], halves[:, 1]):
        raise ValueError("report ids must be in strictly ascending bytewise order")
    return halves


def decode_report_ids(body: bytes) -> list[bytes]:
    """Parse a sorted, repeat-free id list; ValueError if malformed."""
    report_id_halves(body)
    return split_ids(body)


def common_report_ids(bodies: Sequence[bytes]) -> bytes:
    """The ids on every one of several sorted id lists, as a sorted id list: the reports every
    server holds (:func:`intersect_held` on the lists' arrays). ValueError if a list is
    malformed."""
    return intersect_held([report_id_halves(b) for b in bodies])[0]


def native_halves(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The high and low halves of an (n, 2) array of ids (as :func:`report_id_halves` gives
    it, big-endian) as native, contiguous uint64 arrays: numpy searches and compares those
    several times faster than a big-endian view (which it converts on every call)."""
    return np.ascontiguousarray(ids[:, 0], dtype=np.uint64), np.ascontiguousarray(ids[:, 1], dtype=np.uint64)


def intersect_held(lists: Sequence[np.ndarray]) -> tuple[bytes, list[np.ndarray]]:
    """The ids on every one of k sorted, repeat-free id lists (each an (n, 2) array of halves,
    as :func:`report_id_halves` gives it), as a report-id list, and for each list a bool mask
    of its ids that are on all of them: the inclusion set and each server's compact commit
    (dpsketch/protocol/inclusion.py) from one pass, with no second fetch of any list.

    On arrays, never a Python object per id (issue 46): the shortest list's ids are located in
    each other list by binary searches of their native high halves, a cache-sized stretch at a
    time (:func:`locate_ascending`, :func:`locate`; ids
    sharing a high half, which only crafted ones do, are resolved exactly on the low half), so
    k - 1 searches of n sorted ids, about 35 ms each at 10^6. Equality is always decided on all
    128 bits. Working memory: the shortest list as native halves (16 bytes an id), each other
    list's high halves (8 bytes an id), one position per id of the shortest list and other list
    (8 bytes)."""
    k = len(lists)
    masks = [np.zeros(len(ids), dtype=bool) for ids in lists]
    if k == 0:
        return b"", masks
    shortest = min(range(k), key=lambda i: len(lists[i]))
    base_hi, base_lo = native_halves(lists[shortest])
    on_all = np.ones(len(base_hi), dtype=bool)
    positions: dict[int, np.ndarray] = {}
    for j, ids in enumerate(lists):
        if j == shortest:
            continue
        at = locate_ascending(ids, base_hi, base_lo)
        on_all &= at >= 0
        positions[j] = at
    masks[shortest] = on_all
    for j, at in positions.items():
        masks[j][at[on_all]] = True
    # the common ids as whole 16-byte records of the shortest list (its bytes are the ids' own):
    # one gather, 2x faster at 10^7 than writing both byte-swapped halves back (0.19-0.24 s
    # against 0.31-0.43 s)
    rows = np.ascontiguousarray(lists[shortest]).view("V16").reshape(-1)
    return rows[on_all].tobytes(), masks


#: Queries located at once by :func:`locate_ascending`: their stretch of a list of 10^7 ids is
#: a few hundred KiB, which stays in the CPU's cache for the whole search.
SEARCH_CHUNK = 1 << 15


def locate_ascending(ids: np.ndarray, query_hi: np.ndarray, query_lo: np.ndarray) -> np.ndarray:
    """:func:`locate` of ascending queries (a sorted id list's native halves) in the sorted id
    list ``ids`` (an (n, 2) big-endian array, as :func:`report_id_halves` gives it), chunk by
    chunk: each chunk of SEARCH_CHUNK queries is searched only in the stretch of ``ids`` its
    first and last query bound, whose low halves are made native there. Why: one search of
    10^7 queries over 10^7 ids probes the whole 80 MB list from every query, past the CPU's
    cache, and every step made a fresh 80 MB array (positions, gathered halves, comparisons)
    whose pages the kernel hands out one fault at a time; the intersection grew 12-14x from
    10^6 to 10^7 ids. Chunk by chunk the search stays in cache and the temporaries are small;
    only the high halves are made native whole (one array)."""
    m, n = len(query_hi), len(ids)
    out = np.full(m, -1, dtype=np.int64)
    if n == 0 or m == 0:
        return out
    hi = np.ascontiguousarray(ids[:, 0], dtype=np.uint64)
    firsts = np.searchsorted(hi, query_hi[::SEARCH_CHUNK], side="left")
    lasts = np.append(np.searchsorted(hi, query_hi[SEARCH_CHUNK - 1::SEARCH_CHUNK], side="right"), n)
    for c, start in enumerate(range(0, m, SEARCH_CHUNK)):
        a, b = int(firsts[c]), int(lasts[c])
        if a == b:
            continue
        stop = start + SEARCH_CHUNK
        at = locate(hi[a:b], ids[a:b, 1].astype(np.uint64), query_hi[start:stop], query_lo[start:stop])
        found = at >= 0
        out[start:stop][found] = at[found] + a
    return out


def locate(hi: np.ndarray, lo: np.ndarray, query_hi: np.ndarray, query_lo: np.ndarray) -> np.ndarray:
    """The position of each queried id in a strictly ascending id list (both given by their
    halves; native uint64 arrays are the fast case, :func:`native_halves`), -1 where it is not
    on it: a binary search of the high half, then a comparison of the low half (ids sharing a
    high half, which only crafted ones do, are scanned exactly)."""
    n = len(hi)
    if n == 0:
        return np.full(len(query_hi), -1, dtype=np.int64)
    left = np.searchsorted(hi, query_hi, side="left")
    if n < 2 or not bool(np.any(hi[1:] == hi[:-1])):  # every high half once: one search decides
        at = np.minimum(left, n - 1)
        hit = (hi[at] == query_hi) & (lo[at] == query_lo)
        return np.where(hit, left, -1).astype(np.int64, copy=False)
    right = np.searchsorted(hi, query_hi, side="right")
    at = np.full(len(query_hi), -1, dtype=np.int64)
    single = np.flatnonzero(right - left == 1)
    hit = lo[left[single]] == query_lo[single]
    at[single[hit]] = left[single[hit]]
    for i in np.flatnonzero(right - left > 1).tolist():  # a shared high half (rare): scan its run
        run = np.flatnonzero(lo[left[i]:right[i]] == query_lo[i])
        if len(run):
            at[i] = left[i] + int(run[0])
    return at


def inclusion_hash(sorted_ids: bytes | Sequence[bytes]) -> str:
    """SHA-256 over the concatenated sorted ids (or their concatenation, a report-id list):
    names an inclusion set in one line."""
    if isinstance(sorted_ids, (bytes, bytearray, memoryview)):
        return hashlib.sha256(sorted_ids).hexdigest()
    h = hashlib.sha256()
    for rid in sorted_ids:
        h.update(rid)
    return h.hexdigest()


def encode_aggregate(aggregate: np.ndarray) -> bytes:
    return np.ascontiguousarray(aggregate, dtype="<u8").tobytes()


def decode_aggregate(body: bytes, k: int, d: int) -> np.ndarray:
    if len(body) != 8 * k * d:
        raise ValueError(f"an aggregate share is {8 * k * d} bytes, got {len(body)}")
    return np.frombuffer(body, dtype="<u8").reshape(k, d).copy()


# --- JSON messages ---------------------------------------------------------------------------

HEX_ID = re.compile(r"^[0-9a-f]{32}$")


class Report(BaseModel):
    """One report's share for one server (the single-upload body)."""

    model_config = ConfigDict(extra="forbid")
    report_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="16 bytes, lower-case hex: the "
                           "commitment to all N shares (section 4a)")
    proof: str = Field(description="this server's proof, standard base64: its 16-byte salt and the "
                       "other servers' 16-byte commitments in server order (16 N bytes)")
    share: str = Field(description="width little-endian uint64 values, standard base64")

    @field_validator("share", "proof")
    @classmethod
    def _b64(cls, v: str) -> str:
        try:
            base64.b64decode(v, validate=True)
        except ValueError as exc:
            raise ValueError("must be standard base64") from exc
        return v

    def fields(self) -> tuple[bytes, bytes, bytes]:
        """The decoded (report id, proof, share), as :func:`report_fields` gives them."""
        return bytes.fromhex(self.report_id), base64.b64decode(self.proof), base64.b64decode(self.share)

    def upload(self, width: int, n_servers: int) -> Upload:
        """The report as a one-record upload; ValueError if a length is wrong."""
        return report_upload(*self.fields(), width, n_servers)

    @classmethod
    def of(cls, report_id: bytes, proof: np.ndarray | bytes, share: np.ndarray) -> "Report":
        return cls(
            report_id=report_id.hex(),
            proof=base64.b64encode(bytes(np.asarray(proof, dtype=np.uint8).tobytes()
                                         if isinstance(proof, np.ndarray) else proof)).decode(),
            share=base64.b64encode(np.asarray(share, dtype="<u8").tobytes()).decode(),
        )


def report_upload(report_id: bytes, proof: bytes, share: bytes, width: int, n_servers: int) -> Upload:
    """A single report's decoded fields as a one-record upload (what :meth:`Report.upload`
    returns); ValueError if a length is wrong."""
    if len(share) != 8 * width:
        raise ValueError(f"share must be {8 * width} bytes ({width} uint64 values), got {len(share)}")
    if len(proof) != binding.proof_bytes(n_servers):
        raise ValueError(f"proof must be {binding.proof_bytes(n_servers)} bytes for a study of "
                         f"{n_servers} servers, got {len(proof)}")
    return Upload([report_id], np.frombuffer(proof, dtype=np.uint8).reshape(1, -1).copy(),
                  np.frombuffer(share, dtype="<u8").reshape(1, width).copy(), binding.CONTENT_SHARE)


_WS = rb"[ \t\n\r]*"  # JSON's whitespace (RFC 8259), nothing else
#: A Report body in the field order the SDK writes it (Report.model_dump_json), with any JSON
#: whitespace between the tokens; every string only of characters that JSON takes literally.
_REPORT_JSON = re.compile(
    _WS + rb"\{" + _WS + rb'"report_id"' + _WS + rb":" + _WS + rb'"([0-9a-f]{32})"' + _WS + rb"," + _WS
    + rb'"proof"' + _WS + rb":" + _WS + rb'"([A-Za-z0-9+/=]*)"' + _WS + rb"," + _WS
    + rb'"share"' + _WS + rb":" + _WS + rb'"([A-Za-z0-9+/=]*)"' + _WS + rb"\}" + _WS)


def report_fields(body: bytes) -> tuple[bytes, bytes, bytes] | None:
    """The decoded (report id, proof, share) of a single-report JSON body, parsed without
    pydantic, or None when the body is not in the plain form the SDK sends.

    Whatever this accepts, :class:`Report` accepts with the same values (JSON with exactly the
    three fields, in that order, a 32-character lower-case hex report id and two strings of
    standard base64: base64.b64decode(validate=True) is binascii's strict mode), so a server
    may take it instead of ``Report.model_validate_json(body)`` and decode each field once; for
    None it asks the model, which answers every other body, accepted or refused, as always."""
    m = _REPORT_JSON.fullmatch(body)
    if m is None:
        return None
    try:
        proof = binascii.a2b_base64(m[2], strict_mode=True)
        share = binascii.a2b_base64(m[3], strict_mode=True)
    except binascii.Error:
        return None
    return bytes.fromhex(m[1].decode()), proof, share


class UploadResult(BaseModel):
    accepted: int = Field(description="reports newly stored by this request")
    duplicates: int = Field(description="reports already held with identical bytes (not recounted)")
    report_count: int | None = Field(
        default=None, description="reports this server now holds for the study; null for an "
        "add/remove study, whose exact count would tell membership (docs/trust.md)")


class RelayedOutcome(BaseModel):
    """What became of one entry of a relayed bundle (docs/protocol.md section 7b): ``status``
    200 and ``result``, or the status and problem JSON the entry would have got alone."""

    status: int = Field(description="200, or the HTTP status of the entry's problem")
    result: UploadResult | None = Field(default=None, description="the entry's upload result (status 200)")
    problem: dict[str, Any] | None = Field(default=None, description="the entry's problem (RFC 9457 members)")


class RelayedResults(BaseModel):
    """A relayed bundle's answer: one outcome per entry, in the bundle's order."""

    results: list[RelayedOutcome]


class CommitResult(BaseModel):
    """The certificate a server checked and the inclusion set it committed to."""

    inclusion_hash: str
    n_reports: int
    lambda_min: float
    lambda_star: float
    t: int
    margin: float = Field(description="lambda_min - t - lambda_star; >= 0 for a release")
    server_sigma: float = Field(default=0.0, description="the noise this server added to every "
                                "cell of its aggregate share (release units; the study's server_sigma)")


StudyStatus = Literal["open", "committed", "expired", "dropped"]


class StudyInfo(BaseModel):
    """What a server says about a study it holds: the parameters and its progress."""

    study_id: str
    server_id: str
    status: StudyStatus
    report_count: int | None = Field(description="reports held; null for an add/remove study asked "
                                     "without an operator or analyst token (docs/trust.md)")
    study: Study
    commit: CommitResult | None = None
    hpke: "HpkeKeys | None" = Field(default=None, description="the server's HPKE keys for sealing "
                                    "shares of this study (the same as in /v1/info)")
    party_counts: dict[str, int] | None = Field(
        default=None, description="a study with parties: blocks held per party (report_count counts "
        "individuals with every party's block here); null otherwise or when counts are hidden")
    populations: list[str] = Field(
        default_factory=list, description="the populations (the operator's, docs/ledger.md) whose "
        "ledger at this server charges the study: where its first upload token of each was issued "
        "(open uploads: the server's default population, at provisioning); the study's own "
        "population member is advisory")


class HpkeKey(BaseModel):
    """One of a server's HPKE public keys (raw bytes as hex: 32 bytes X25519, or 1216 bytes
    ML-KEM-768 || X25519 for the post-quantum suite, docs/sealing.md)."""

    key_id: str = Field(pattern=r"^[0-9a-f]{16}$", description="hex SHA-256(public_key)[:8]")
    public_key: str = Field(pattern=r"^([0-9a-f]{64}|[0-9a-f]{2432})$",
                            description="raw public key, hex: X25519 (32 bytes) or MLKEM768-X25519 "
                            "(1216 bytes: the ML-KEM-768 encapsulation key, then the X25519 key)")
    created_at: float
    superseded_at: float | None = Field(default=None, description="when a newer key became "
                                        "current; null for the current key")


class HpkeKeys(BaseModel):
    """A server's HPKE configuration: the suite (RFC 9180 ids), its current key (seal to this
    one) and every key it still opens shares with. The top level is the classical suite (what
    every client seals with); ``post_quantum`` the opt-in hybrid suite (docs/sealing.md)."""

    kem_id: int
    kdf_id: int
    aead_id: int
    suite: str
    current: str = Field(pattern=r"^[0-9a-f]{16}$", description="key_id of the key to seal to")
    keys: list[HpkeKey]
    name: str = Field(default="classical", description="the suite's name in the SDK's sealing "
                      "policy: classical or post-quantum")
    post_quantum: "HpkeKeys | None" = Field(
        default=None, description="the server's keys of the post-quantum suite (MLKEM768-X25519, "
        "sealed batches, version 4), the same shape; null: the server offers none")
    versions: list[int] | None = Field(
        default=None, description="the sealed layouts this server opens (docs/protocol.md section "
        "7a), on the top level only; [4] since issue 46; absent: a server from before sealed batches, "
        "whose layouts 1 and 2 are not sealed any more")


class ServerInfo(BaseModel):
    server_id: str
    protocol: str
    version: str
    #: The server's privacy, storage and retention policy (services/policy.py); optional, servers
    #: that do not publish one leave it out. Any JSON value per member: a client ignores members
    #: it does not know, whatever their type (a narrower type refused a newer server's list)
    policy: dict[str, JsonValue] | None = None
    #: The server's HPKE public keys for sealed shares (section 7a); optional.
    hpke: HpkeKeys | None = None


class UploadTokenInfo(BaseModel):
    """An upload token as listed: never the token, only its id (hex SHA-256(token)[:8])."""

    token_id: str
    created_at: float
    revoked_at: float | None = None
    quota: int | None = Field(default=None, description="new reports the token may add; null: no limit")
    used: int = Field(default=0, description="new reports it added so far")
    party: str | None = Field(default=None, description="the party whose blocks it uploads (studies "
                              "with parties)")
    population: str | None = Field(default=None, description="the population its reports are charged "
                                   "to (docs/ledger.md)")


class IssueUploadTokens(BaseModel):
    """Body of POST /v1/studies/{id}/upload-tokens (all optional)."""

    model_config = ConfigDict(extra="forbid")
    party: str | None = Field(default=None, max_length=64, description="a study with parties: the "
                              "party whose blocks the tokens may upload (required there, refused "
                              "elsewhere)")
    count: int = Field(default=1, ge=1, le=10_000, description="how many tokens to issue")
    quota: int | None = Field(default=1, ge=1, description="new reports each token may add (one "
                              "report per token by default; a data owner with m rows gets quota m); "
                              "null: no limit")
    population: str | None = Field(default=None, pattern=POPULATION_PATTERN,
                                   description="the population (of this server's operator) the "
                                   "tokens' reports are charged to, whatever the study says; the "
                                   "first token of a population for a study charges the study to it "
                                   "(409 budget-exceeded past its budget). Default: the server's "
                                   "default_population (docs/ledger.md)")


class IssuedUploadTokens(BaseModel):
    """Answer of POST /v1/studies/{id}/upload-tokens: the tokens, shown this once."""

    study_id: str
    tokens: list[str]
    token_ids: list[str]
    quota: int | None
    upload_tokens: int = Field(description="active upload tokens of the study now")
    #: the first token again, for callers that issued one
    token: str
    token_id: str
    population: str | None = Field(default=None, description="the population the tokens' reports are "
                                   "charged to")


class UploadTokenList(BaseModel):
    study_id: str
    #: True once the study was given any upload token: uploads need a valid (unrevoked) one,
    #: even after every token was revoked.
    required: bool
    active: int
    tokens: list[UploadTokenInfo]


class Problem(BaseModel):
    """RFC 9457 problem details: every 4xx/5xx body of every dpsketch service."""

    type: str = Field(description="urn:dpsketch:problem:<slug>, stable, documented")
    title: str
    status: int
    detail: str
    instance: str | None = None


HpkeKeys.model_rebuild()
StudyInfo.model_rebuild()


# --- the privacy ledger of a population (docs/ledger.md) ---------------------------------------

from .ledger import Charge  # noqa: E402  (kept apart from the upload messages above)


class LedgerEntry(BaseModel):
    """One study charged to a population's ledger."""

    charge: Charge = Field(description="the noise the study's privacy loss distribution is built "
                           "from, and its own (epsilon, delta) under its own neighbouring notion")
    charged_epsilon: float | None = Field(description="the study's epsilon at its own delta in the "
                                          "ledger's notion; null: unbounded there")
    charged_at: float
    charged_floor_epsilon: float | None = Field(default=None, description="the study's floor (no "
                                                "other honest report) at its own delta in the ledger's notion")


class PopulationLedger(BaseModel):
    """GET /v1/populations/{population}/ledger: what a population's studies have spent at this
    server, composed with dp-accounting, against this server's budget (public)."""

    population: str
    server_id: str
    neighbouring: str = Field(description="the notion the ledger is kept in (the budget's)")
    delta: float = Field(description="the delta the composed epsilon is read at (the budget's)")
    epsilon: float | None = Field(description="composed epsilon of every study charged (PLD "
                                  "composition); null: unbounded")
    naive_epsilon: float | None = Field(description="the sum of the studies' epsilons, for comparison")
    naive_delta: float = Field(description="... which holds at the sum of their deltas")
    budget_epsilon: float | None = Field(description="this server's budget per population; null: "
                                         "no budget (nothing refused, the ledger is still kept)")
    budget_delta: float
    remaining_epsilon: float | None = Field(description="budget_epsilon - epsilon (null without a budget)")
    studies: list[LedgerEntry]
    floor_epsilon: float | None = Field(default=None, description="composed floor epsilon of every "
                                        "study charged: what a report keeps if every study is filled "
                                        "with Sybils; null: unbounded")
    budget_floor_epsilon: float | None = Field(default=None, description="this server's bound on the "
                                               "composed floors; null: none")
    remaining_floor_epsilon: float | None = Field(default=None, description="budget_floor_epsilon - "
                                                  "floor_epsilon (null without that bound)")
