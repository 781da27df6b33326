"""Parties that hold different columns of the same individuals (docs/vertical.md, protocol 2d).

A study with parties splits its columns into blocks, each owned by one party (a bank, a
retailer, a hospital). Every party shares its own block of each individual's row, under a
**pseudonym** of the individual that all parties derive alike and no server can invert:

    pseudonym = HMAC-SHA256(party key, "dpsketch/individual/1" || study id (32 bytes) ||
                            len(individual key) (4 bytes, big-endian) || individual key)[:16]

The party key is 32 random bytes the parties share with each other and never with a server or
the analyst; the study id in the input makes an individual's pseudonyms unlinkable across
studies. The servers apply the study's sketch with the pseudonym as the hashed id, so every
block of an individual lands in the same sketch rows with the same signs, and the release is
the sketch of the joined rows.

Privacy: party j clips its block to row bound B_j, with B_1^2 + ... + B_P^2 <= B^2, and adds
the study's own N(0, sigma^2) to every value. The joined row then has norm at most B and carries
N(0, sigma^2 I_d): the law of a single owner's report, so the study's calibration and release
certificate hold unchanged with the individual (all of its blocks) as the neighbouring unit.

Binding: a block's record id commits to its N shares *and* to its party and pseudonym
(``binding.block_prefixes``), so a relay can neither substitute a share nor move a block to
another individual or party; servers refuse a second, different block for the same
(pseudonym, party) with ``report-conflict``.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .sketch import REPORT_ID_BYTES

PSEUDONYM_DOMAIN = b"dpsketch/individual/1"
#: the domain of the party-key sign of a signed study with parties (:func:`signs`)
SIGN_DOMAIN = b"dpsketch/sign/1"
PARTY_KEY_BYTES = 32
MAX_PARTIES = 16

#: a party's, and a column's, name (study.py uses this one): the whole string, matched with
#: ``fullmatch``, so that ``$`` does not also pass a name ending in a newline, as ``re.match``
#: did (JSON Schema, pydantic and the TypeScript client read ``$`` as the end of the text)
NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$"
_NAME = re.compile(NAME_PATTERN)


class Party(BaseModel):
    """One party of a study: the columns it contributes (a contiguous run of the study's
    columns, in order) and the L2 bound its block is clipped to."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    name: str
    columns: list[str] = Field(min_length=1, max_length=4096)
    row_bound: float = Field(gt=0, le=1e6)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(f"party name {name!r} must match {NAME_PATTERN}")
        return name

    @property
    def width(self) -> int:
        return len(self.columns)


def check(parties: Sequence[Party], columns: Sequence[str], row_bound: float) -> None:
    """ValueError unless the parties split the study's columns into consecutive blocks, in
    order, and their bounds' squares add up to at most the study's B^2."""
    if not 2 <= len(parties) <= MAX_PARTIES:
        raise ValueError(f"a study with parties has 2 to {MAX_PARTIES} of them, not {len(parties)}")
    names = [p.name for p in parties]
    if len(set(names)) != len(names):
        raise ValueError(f"party names must be unique: {names}")
    joined = [c for p in parties for c in p.columns]
    if joined != list(columns):
        raise ValueError(f"the parties' columns, block after block, must be the study's columns "
                         f"{list(columns)}; they give {joined}")
    total = math.fsum(p.row_bound ** 2 for p in parties)
    if total > row_bound ** 2:
        raise ValueError(
            f"the parties' bounds give a joined row of norm up to sqrt({total:.9g}) = "
            f"{math.sqrt(total):.9g}, more than the study's row bound B = {row_bound}: "
            f"B_1^2 + ... + B_P^2 must be at most B^2")


def default_bounds(row_bound: float, widths: Sequence[int]) -> list[float]:
    """B_j = B sqrt(d_j / d): each column gets the same share of B^2 (shrunk by ulps if
    rounding would take the sum of squares past B^2)."""
    d = sum(widths)
    bounds = [row_bound * math.sqrt(w / d) for w in widths]
    while math.fsum(b * b for b in bounds) > row_bound ** 2:
        bounds = [b * (1 - 4 * 2.0 ** -52) for b in bounds]
    return bounds


def slices(parties: Sequence[Party]) -> list[slice]:
    """Each party's columns as a slice of the study's columns."""
    out, start = [], 0
    for p in parties:
        out.append(slice(start, start + p.width))
        start += p.width
    return out


def new_key() -> bytes:
    """A fresh party key (32 bytes from the OS CSPRNG), to share among the parties only."""
    return os.urandom(PARTY_KEY_BYTES)


def _keyed(key: bytes, domain: bytes, study_id: str):
    """HMAC-SHA256 under the party key, fed the domain and the study id (32 bytes): what every
    value the parties derive per individual starts from."""
    if len(key) != PARTY_KEY_BYTES:
        raise ValueError(f"a party key is {PARTY_KEY_BYTES} bytes, got {len(key)}")
    study = bytes.fromhex(study_id)
    if len(study) != 32:
        raise ValueError("a study id is 64 hex characters")
    return hmac.new(key, domain + study, hashlib.sha256)


def pseudonyms(key: bytes, study_id: str, individual_keys: Sequence[str | bytes]) -> list[bytes]:
    """The 16-byte pseudonym of each individual key (str keys are UTF-8 encoded) in this study."""
    base = _keyed(key, PSEUDONYM_DOMAIN, study_id)
    out = []
    for individual in individual_keys:
        raw = individual.encode("utf-8") if isinstance(individual, str) else bytes(individual)
        if not raw:
            raise ValueError("an individual key must not be empty")
        h = base.copy()
        h.update(len(raw).to_bytes(4, "big") + raw)
        out.append(h.digest()[:REPORT_ID_BYTES])
    return out


def signs(key: bytes, study_id: str, pseudonyms_: Sequence[bytes]) -> np.ndarray:
    """The party-key sign of each individual in a signed study with parties (docs/vertical.md,
    "Parties and the secret sign"): t = -1 where the low bit of the first byte of

        HMAC-SHA256(party key, "dpsketch/sign/1" || study id (32 bytes) || pseudonym (16 bytes))

    is set (a bool array, True = -1). Every party holds the key, so every party's block of an
    individual gets the same sign and the joined row is one signed report; the servers and the
    analyst, who do not hold the key, cannot tell the sign, as they cannot tell a one-owner
    client's. A party that colludes with them can: the study's guarantees say what is left then
    (``Study.guarantees``: ``floor_epsilon_if_a_party_colludes``)."""
    base = _keyed(key, SIGN_DOMAIN, study_id)
    out = np.empty(len(pseudonyms_), dtype=bool)
    for i, p in enumerate(pseudonyms_):
        if len(p) != REPORT_ID_BYTES:
            raise ValueError(f"a pseudonym is {REPORT_ID_BYTES} bytes")
        h = base.copy()
        h.update(bytes(p))
        out[i] = bool(h.digest()[0] & 1)
    return out

