"""The shares of a study whose reports are proved valid (``Study.validity``), as the SDK, the
servers and the analyzer handle them: widths, payloads, running totals and release.

Why one module: a validity study's shares live in F_p (``field``), not Z_(2^64), and one server
per batch (the *leader*) holds explicit shares of the proof's input and of the proof, n + P
elements a report, while the others (the *helpers*) hold a 32-byte seed that expands to theirs
by ``field.expand``, never by ``ring.expand_seeds`` (docs/protocol.md section 4c). Every place
that decodes, seals, stores, re-reads, folds or releases a share asks this module what a share
of the study is. For a study without ``validity``, :func:`upload_width`, :func:`state_width`,
:func:`expand_seeds`, :func:`released` and :func:`reconstruct` answer what the code did before
(``study.width``, ring seeds, ``ring.reconstruct``), so those callers need no branch of their
own; :func:`payload_rows` and :func:`addends` are a validity study's only.

What a validity study's server keeps of a record is what it received: the leader's n + P
values, or the helper's seed (32 bytes: the seed is the share). Only its sums expand a seed, to
the n input elements they need (``validity.input_shares``), never the P of the proof share.

The running totals of a validity study are the low and high 32-bit halves of the servers' F_p
coordinate shares (``validity.aggregand``: 2 w columns), summed as exact integers by the ring's
sketch kernel (``sketch.accumulate``: a signed sum of at most 2^31 halves never wraps 2^64),
so that adding a report and taking it out again (a commit's exclusions) is exact; the release
turns them into F_p once (``validity.release_share``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import field, ring, validity
from .study import Study

#: bytes of a helper's seed
SEED_BYTES = ring.SEED_BYTES


def is_proved(study: Study) -> bool:
    """Whether every report of the study carries a validity proof (``Study.validity`` is set)."""
    return study.validity is not None


def plan_of(study: Study, party: int | None = None) -> validity.Plan:
    """The validity plan of a study's reports, or of one party's blocks (``party``, its index)."""
    return validity.plan(study) if party is None else validity.party_plan(study, party)


def upload_width(study: Study, party: int | None = None) -> int:
    """uint64 values of an explicit share record: the leader's n + P (input share, then proof
    share) for a validity study, else the study's width; of one party's blocks (``party``, its
    index): its leader's n_j + P_j, or its d_j columns."""
    if is_proved(study):
        return plan_of(study, party).leader_width
    return study.width if party is None else (study.parties or [])[party].width


def state_width(study: Study) -> int:
    """Columns of a server's running aggregate: 2 w (the halves of the F_p coordinate shares)
    for a validity study, else the study's width."""
    # 2 w (Plan.state_width), known without building a circuit: a study with parties has one per
    # party, none of its whole width
    return 2 * study.width if is_proved(study) else study.width


def bound_part(study: Study, payloads: np.ndarray, seeded: bool, party: int | None = None) -> np.ndarray:
    """What a record's binding commitment covers: a seed whole; an explicit share whole, except
    a validity leader's, whose commitment covers only its input share (the first n columns:
    its proof share is made after the report id, which fixes the joint randomness)."""
    if seeded or not is_proved(study):
        return payloads
    return np.ascontiguousarray(payloads[:, :plan_of(study, party).input_len])


def expand_seeds(study: Study, seeds: np.ndarray, party: int | None = None) -> np.ndarray:
    """The (m, upload_width) explicit shares m seeds ((m, 32) uint8) expand to: a helper's input
    then proof shares by field expansion (validity.server_shares), or a ring share."""
    if not is_proved(study):
        return ring.expand_seeds(seeds, study.width)
    inputs, proofs = validity.server_shares(plan_of(study, party), seeds, True)
    return np.concatenate([inputs, proofs], axis=1)


def payload_rows(study: Study, payloads: np.ndarray, seeded: bool) -> np.ndarray:
    """What a validity study's server keeps of an upload's records, as uint64 rows: the
    leader's (m, n + P) F_p values, checked canonical (FieldError, a ValueError, for a value
    >= p: it has no meaning in the field, and the server's sums would depend on it), or each
    helper seed's 32 bytes as (m, 4) words. Why not expanded: the seed is the share, expanding
    it costs n + P elements a report, and a stored record's length tells which it is (n + P > 4);
    the sums expand only the n input elements (:func:`addends`)."""
    if seeded:
        return np.ascontiguousarray(payloads, dtype=np.uint8).reshape(len(payloads), SEED_BYTES).view("<u8")
    return field.elements(payloads, "a leader's share value")


def server_shares(study: Study, rows: np.ndarray, seeded: bool,
                  party: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A server's input shares (m, n) and proof shares (m, P) of kept records (:func:`payload_rows`;
    what the verification round queries): ``validity.server_shares`` of them."""
    return validity.server_shares(plan_of(study, party), rows, seeded)  # seeds as words: reinterpreted


def addends(study: Study, rows: np.ndarray, seeded: bool, party: int | None = None) -> np.ndarray:
    """What a validity study's server adds to its running aggregate for these records
    (:func:`payload_rows`): the low and high 32-bit halves of its F_p coordinate shares,
    (m, 2 w) uint64 (``validity.aggregand`` of the input shares; a seed expands to its n input
    elements only, validity.input_shares; a leader's rows are already canonical, checked when
    they came: payload_rows). One party's blocks (``party``): (m, 2 d_j), the halves of its
    columns' shares, which the server folds into its party's columns of each half."""
    plan = plan_of(study, party)
    inputs = validity.input_shares(plan, rows, True) if seeded else rows[:, :plan.input_len]
    return validity.aggregand(plan, inputs)


def released(study: Study, running: np.ndarray) -> np.ndarray:
    """A server's released aggregate share from its running aggregate over an inclusion set, its
    floor noise added: ring + ``study.server_noise()``, or for a validity study the F_p
    coordinate share (``validity.release_share``) + ``validity.field_noise`` in F_p."""
    if not is_proved(study):
        return running + study.server_noise()
    share = validity.join_words(running)  # validity.release_share, which needs no plan
    return field.add(share, validity.field_noise(study))


def reconstruct(study: Study, aggregate_shares: Sequence[np.ndarray]) -> np.ndarray:
    """The ring sum the release decode reads (k, w) uint64 from the N servers' aggregate shares:
    their ring sum, or for a validity study their F_p sum mapped to its centred ring equivalent
    (``validity.to_ring``). FieldError for a validity share value >= p (no server sends one)."""
    if not is_proved(study):
        return ring.reconstruct(list(aggregate_shares))
    total = field.elements(aggregate_shares[0], "an aggregate share value")
    for share in aggregate_shares[1:]:
        total = field.add(total, field.elements(share, "an aggregate share value"))
    return validity.to_ring(total)
