"""One party's upload to a study with parties (docs/vertical.md): keys, pseudonyms, blocks.

A party holds some columns of many individuals, each with an *individual key* (a customer
number, a national id) that the other parties hold for the same person. The party key, 32
random bytes the parties share with each other and never with a server or the analyst, turns
each individual key into the pseudonym the servers see (``dpsketch.protocol.parties``). Keep it
as secret as the data: whoever holds it can test whether a known individual key is in a study.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dpsketch.protocol import parties as _parties

from . import data as _data
from .prepare import PreparedBatch, prepare_blocks


def new_key_file(path: str | os.PathLike) -> bytes:
    """Write a fresh party key to ``path`` (mode 0600, hex, refusing to overwrite) and return it."""
    key = _parties.new_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key.hex() + "\n")
    return key


def read_key_file(path: str | os.PathLike) -> bytes:
    """A party key from its file (64 hex characters); ValueError naming the problem otherwise."""
    p = Path(path)
    text = p.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{p}: a party key file holds 64 hex characters") from None
    if len(key) != _parties.PARTY_KEY_BYTES:
        raise ValueError(f"{p}: a party key is {_parties.PARTY_KEY_BYTES} bytes (64 hex characters), "
                         f"got {len(key)}")
    if os.name == "posix" and p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{p}: the party key file is readable by others; chmod 600 it")
    return key


def keyed_chunks(rows: Any, columns: Sequence[str], chunk_size: int, *, keys: Sequence[str | bytes] | None,
                 key_column: str | None) -> Iterator[tuple[list, np.ndarray]]:
    """(individual keys, (m, d_j) values) chunks of a party's data: a CSV path whose
    ``key_column`` holds the keys, or any input ``submit_many`` takes with ``keys`` alongside."""
    if key_column is not None:
        if not isinstance(rows, (str, os.PathLike)):
            raise ValueError("key_column reads the keys from a CSV file; for in-memory rows pass keys")
        key_chunks = _data.read_csv(rows, [key_column], chunk_size, ignore_extra=True, raw=True)
        value_chunks = _data.read_csv(rows, columns, chunk_size, ignore_extra=True)
        for k, v in zip(key_chunks, value_chunks):
            yield [str(x) for x in k[:, 0]], v
        return
    if keys is None:
        raise ValueError("give the individuals' keys (keys=..., one per row) or a key_column of the CSV")
    keys = list(keys)
    if len(set(keys)) != len(keys):
        raise _data.InvalidDataError("the individual keys repeat: one row per individual")
    start = 0
    for chunk in _data.iter_chunks(rows, columns, chunk_size, ignore_extra=True):
        part = keys[start:start + len(chunk)]
        if len(part) != len(chunk):
            raise _data.InvalidDataError(f"{len(keys)} keys for more rows than that")
        yield part, chunk
        start += len(chunk)
    if start != len(keys):
        raise _data.InvalidDataError(f"{len(keys)} keys for {start} rows")


def prepared_blocks(study, party: str, party_key: bytes, chunks) -> Iterator[PreparedBatch]:
    """Pseudonymise and prepare each chunk of (keys, values)."""
    seen: set[bytes] = set()
    for i, (keys, values) in enumerate(chunks):
        pseudonyms = _parties.pseudonyms(party_key, study.study_id, keys)
        if not seen.isdisjoint(pseudonyms) or len(set(pseudonyms)) != len(pseudonyms):
            raise _data.InvalidDataError("an individual key appears twice: one row per individual")
        seen.update(pseudonyms)
        # a signed study: every party signs an individual's block with the same party-key sign
        signs = _parties.signs(party_key, study.study_id, pseudonyms) if study.secret_sign else None
        # a study with validity proofs: the leader (explicit shares) turns over the servers batch
        # by batch, as submit_many's full share does
        yield prepare_blocks(study, party, pseudonyms, values, signs=signs, full=i % study.n_servers)
