"""How a client's rows become the reports its servers receive: one linear, I/O-free path, in the
order it happens, that a second client mirrors step for step (docs/protocol.md sections 2e, 5,
5a, 4, 4a and 4b; the TypeScript client's src/batch.ts follows it).

    rows --map (bounds)--> --clip--> --features--> --sign--> --round + noise--> --share--> --bind-->
                                                                         (or, with validity: --prove-->)
                                                       (or, with batch proofs: --prove the batch at once-->)

:func:`prepare` runs the whole path for a batch of one data owner's rows; :func:`prepare_blocks`
for one party's blocks of a study with parties; :func:`prepare_proof_batch` for a batch of a
study with batch proofs (section 4d: one proof for all its rows, one record a server). Each step
is a function of its own below, in that order, so that the evaluation harness, the benchmarks
and the tests build exactly the bytes the SDK uploads. Every random bit comes from one ChaCha20
keystream per batch (``Keystream``), drawn in this order: the secret signs, the noise, then the
shares (or seeds) and binding salts, then the proof's randomness (a batch proof: the helpers'
seeds, the leader's blind, then the proof's randomness). What is not here is transport
(client_sdk/: reading and checking the data owner's rows, batching, sealing, upload, retries,
the journal).

Rows are clipped a hair under B (``Study.clip_bound``) so that the rounded vector keeps the
study's sensitivity; the noise itself is :mod:`.noise` (the exact discrete Gaussian on the
study's grid, shared with the servers' noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import binding, features, messages, proved_shares, ring, validity
from .keystream import Keystream
from .noise import encoded_noise, scaled_noise
from .study import Study


# --- 1. map into the row space (bounds) and 2. clip -------------------------------------------------

def row_norms(rows: np.ndarray) -> np.ndarray:
    """L2 norm of each row, without overflow for huge coordinates."""
    a = np.asarray(rows, dtype=np.float64)
    peak = np.max(np.abs(a), axis=1) if a.shape[1] else np.zeros(len(a))
    safe = np.where(peak > 0, peak, 1.0)
    return np.linalg.norm(a / safe[:, None], axis=1) * safe


def clip_rows(rows: np.ndarray, bound: float) -> np.ndarray:
    """Scale each row to L2 norm at most ``bound``: a * min(1, bound / ||a||).

    Rows already inside the ball are returned unchanged. A scaled row is nudged down by a few
    ulps if rounding left its computed norm above ``bound``, and every coordinate is kept in
    [-bound, bound], so the sensitivity bound holds in floating point too.
    """
    a = np.array(rows, dtype=np.float64, ndmin=2)
    if not np.all(np.isfinite(a)):
        raise ValueError("rows must be finite before clipping")
    norms = row_norms(a)
    over = norms > bound
    if over.any():
        # scale by the largest coordinate first: huge rows (1e200) must not overflow to inf
        peak = np.max(np.abs(a[over]), axis=1, keepdims=True)
        unit = a[over] / peak
        clipped = unit * (bound / np.linalg.norm(unit, axis=1))[:, None]
        for _ in range(8):
            too_big = row_norms(clipped) > bound
            if not too_big.any():
                break
            clipped[too_big] *= 1.0 - 4.0 * np.finfo(np.float64).eps
        a[over] = clipped
    np.clip(a, -bound, bound, out=a)
    return a


def ball_rows(rows: np.ndarray, study: Study) -> np.ndarray:
    """Rows in the study's row space, before clipping: mapped by the study's bounds (clamp each
    value, centre and scale into the cube, append the constant coordinate, scale into the ball:
    :mod:`.bounds`), or as given when the study declares none."""
    if study.bounds is None:
        return np.asarray(rows, dtype=np.float64)
    return study.column_map.to_ball(rows)


def clipped_rows(rows: np.ndarray, study: Study) -> np.ndarray:
    """The rows mapped into the study's row space and clipped to its clip bound: what the
    features are made of (and a gram validity study's proof multiplies, validity.witness_rows)."""
    return clip_rows(ball_rows(rows, study), study.clip_bound)


def limited_counts(rows: np.ndarray, study: Study) -> tuple[np.ndarray, int]:
    """What the map into the ball changed, for the data owner to see: per column, how many values
    were clamped to the study's bounds, and how many rows were clipped to its row bound (with
    bounds none: the box maps inside the ball; without, every row of norm above the bound)."""
    a = np.asarray(rows, dtype=np.float64)
    if study.histogram is not None:
        return np.zeros(study.d, dtype=np.int64), 0
    if study.bounds is not None:  # the cube's corners sit on the sphere: only rounding can pass it
        over = row_norms(ball_rows(a, study)) > study.clip_bound * (1.0 + 1e-9)
        return study.column_map.clamped_counts(a), int(np.count_nonzero(over))
    return np.zeros(study.d, dtype=np.int64), int(np.count_nonzero(row_norms(a) > study.clip_bound))


# --- 3. features, 4. the secret sign ------------------------------------------------------------

def client_vectors(rows: np.ndarray, study: Study) -> np.ndarray:
    """What a client of this study shares before noise: its row mapped by the study's bounds (if
    any) and clipped to the study's clip bound (sketch), the feature vector [a, u(a a^T), 1] of
    that row (gram), or the one-hot vector of the cell its raw values fall in (histogram;
    ``rows`` then holds the values, ``HistogramValueError`` if one has no cell)."""
    if study.histogram is not None:
        return study.histogram.one_hot(study.histogram.cell_index(rows))
    return features.client_vectors(study.kind, clipped_rows(rows, study))


def signed(vectors: np.ndarray, stream: Keystream) -> np.ndarray:
    """Each vector times its own secret sign t = +-1 (one keystream bit per row, drawn before the
    noise; docs/secret_sign.md). The sign never leaves the path: only the noisy signed vector is
    shared, and the study's accounting assumes the adversary does not know t."""
    out = np.array(vectors, dtype=np.float64)
    out[stream.bits(len(out))] *= -1.0
    return out


def signed_vectors(rows: np.ndarray, study: Study, stream: Keystream) -> np.ndarray:
    """The clipped rows of a secret-sign study, each multiplied by its secret sign."""
    return signed(client_vectors(rows, study), stream)


# --- 5. round to the grid and add the noise --------------------------------------------------------

def noisy_encoded(vectors: np.ndarray, study: Study, stream: Keystream | None = None) -> np.ndarray:
    """Vectors rounded to the study's noise grid plus discrete Gaussian noise of parameter sigma on
    every coordinate, encoded on the ring (uint64). Every value stays within
    ``study.value_bound`` (the noise is cut at 20 sigma less one grid step). A gram or moments
    study with validity proofs shares raw products, their noise scaled alike
    (features.proved_scale: the strict upper triangle's drawn after the rest)."""
    grid = study.noise_grid
    if study.proved_features:
        scale = study.feature_scale
        encoded = ring.encode_on_grid(np.asarray(vectors) * scale, study.frac_bits, grid.shift, study.value_bound)
        if study.sigma > 0:  # 0: epsilon at the floor, the servers' noise alone (docs/validity.md 14)
            encoded += scaled_noise(len(encoded), study.sigma, scale, grid, stream)
        return encoded.view(np.uint64)
    encoded = ring.encode_on_grid(vectors, study.frac_bits, grid.shift, study.value_bound)
    if study.sigma > 0:  # 0: the servers' noise carries the whole guarantee (DAP model)
        encoded += encoded_noise(encoded.shape, study.sigma, grid, stream)
    return encoded.view(np.uint64)


def privatize_encoded(rows: np.ndarray, study: Study, stream: Keystream | None = None) -> np.ndarray:
    """Steps 1 to 5 for a study without the secret sign: :func:`noisy_encoded` of the rows' vectors."""
    return noisy_encoded(client_vectors(rows, study), study, stream)


def privatize(rows: np.ndarray, study: Study) -> np.ndarray:
    """The noisy vectors as floats (decoded :func:`privatize_encoded`): for simulations and tests.
    The noise scale is the study's ``sigma``, never recomputed here."""
    return ring.decode(privatize_encoded(rows, study), study.frac_bits)


# --- 6. share, 7. bind (or prove) ----------------------------------------------------------------

@dataclass
class PreparedBatch:
    """Shares of m rows for N servers, bound to their report ids.

    Full shares: ``shares[j]`` is the (m, width) uint64 share for server j. Seed-compressed
    (``seeds`` is set): every server j but one gets ``seeds[j]``, (m, 32) uint8 seeds each
    expanding to a share (``ring.expand_seeds``), and ``shares[j]`` is None for it; the one
    server whose ``seeds[j]`` is None gets its full share ``shares[j]`` (:func:`prepare`'s
    ``full``). ``share(j)`` gives every server's share either way. ``proofs[j]``
    is server j's (m, 16 N) proofs: the report ids commit to every server's payload
    (``binding``), so no server stores a share other than the one its client sent.

    A study with validity proofs (``study``'s ``validity``; ``validity.prepare``) is always
    seed-compressed: the leader's ``shares[full]`` is its (m, n + P) F_p input and proof share,
    each helper's seeds expand to its own by ``field.expand`` (proved_shares.py).
    """

    report_ids: list[bytes]
    proofs: list[np.ndarray]
    shares: list[np.ndarray | None]
    seeds: list[np.ndarray | None] | None = None
    #: one party's blocks (:func:`prepare_blocks`): the party's name and each block's pseudonym
    party: str | None = None
    pseudonyms: list[bytes] | None = None
    #: per column, how many of the batch's values were clamped to the study's bounds; and how
    #: many rows were clipped to its row bound (:func:`limited_counts`): what the data owner sees
    clamped: np.ndarray | None = None
    clipped: int = 0
    #: a study with validity proofs: every share is an F_p share of its proof's input and proof
    study: Study | None = None

    def __len__(self) -> int:
        return len(self.report_ids)

    def _seeded(self, j: int) -> bool:
        return self.seeds is not None and self.seeds[j] is not None

    def share(self, j: int) -> np.ndarray:
        """Server j's (m, width) share (expanded from its seeds if it gets seeds)."""
        if self._seeded(j):
            if self.study is not None:
                party = None if self.party is None else self.study.party(self.party)[0]
                return proved_shares.expand_seeds(self.study, self.seeds[j], party)  # type: ignore[index, arg-type]
            width = next(s for s in self.shares if s is not None).shape[1]
            return ring.expand_seeds(self.seeds[j], width)  # type: ignore[index, arg-type]
        return self.shares[j]  # type: ignore[return-value]

    def media_type(self, j: int) -> str:
        if self.party is not None:
            return messages.blocks_media_type(self.party, self._seeded(j))
        return messages.SEEDS_MEDIA_TYPE if self._seeded(j) else messages.SHARES_MEDIA_TYPE

    def body(self, j: int) -> bytes:
        """Server j's body, of media type ``media_type(j)``."""
        if self.party is not None and self._seeded(j):  # a validity study's helper: block seeds
            return messages.encode_block_seeds(self.report_ids, self.pseudonyms or [], self.proofs[j],
                                               self.seeds[j])  # type: ignore[index, arg-type]
        if self.party is not None:
            return messages.encode_blocks(self.report_ids, self.pseudonyms or [], self.proofs[j], self.shares[j])  # type: ignore[arg-type]  # a party's batch has full shares
        if self._seeded(j):
            return messages.encode_seed_batch(self.report_ids, self.proofs[j], self.seeds[j])  # type: ignore[index, arg-type]
        return messages.encode_batch(self.report_ids, self.proofs[j], self.shares[j])  # type: ignore[arg-type]  # not seeded: a full share

    def report(self, j: int, i: int = 0) -> messages.Report:
        """Row i as server j's single-report JSON body (full shares only; never for a study with
        validity proofs, whose reports travel in batches only: ValueError)."""
        if self.study is not None:
            raise ValueError("a study with validity proofs takes no single-report JSON uploads: each "
                             "report goes as a one-record batch (body(j), media_type(j))")
        return messages.Report.of(self.report_ids[i], self.proofs[j][i], self.share(j)[i])


def _leader(study: Study, full: int | None) -> int:
    n = study.n_servers
    full = n - 1 if full is None else full
    if not 0 <= full < n:
        raise ValueError(f"full={full}: a server position, 0 to {n - 1}")
    return full


@dataclass
class _Noisy:
    """Steps 1 to 5 of a batch: its noisy vectors on the ring, what the map changed, and what a
    proof needs besides (a histogram's one-hot rows, a gram study's clipped rows)."""

    encoded: np.ndarray
    clamped: np.ndarray | None
    clipped: int
    onehot: np.ndarray | None
    witness: np.ndarray | None


def _noisy_rows(study: Study, rows: np.ndarray, stream: Keystream) -> _Noisy:
    """Map, clip, features, sign, round and noise (steps 1 to 5), drawing the signs then the noise
    from ``stream``: the part :func:`prepare` and :func:`prepare_proof_batch` share."""
    clamped, clipped, onehot, witness = None, 0, None, None
    if study.histogram is not None:  # raw values: the bins decide the one-hot cell
        onehot = client_vectors(rows, study)
        vectors = onehot
    else:
        clamped, clipped = limited_counts(rows, study)
        witness = clipped_rows(rows, study)  # 1, 2
        vectors = features.client_vectors(study.kind, witness)  # 3
        if study.secret_sign:
            vectors = signed(vectors, stream)  # 4
    return _Noisy(noisy_encoded(vectors, study, stream), clamped, clipped, onehot, witness)  # 5


def prepare(study: Study, rows: np.ndarray, compress: bool = False, full: int | None = None,
            stream: Keystream | None = None) -> PreparedBatch:
    """The whole path for m rows (already checked: an (m, d) float array, or a histogram study's
    (m, d) raw values): map, clip, features, sign, round and noise, then share and bind (or, in a
    study with validity proofs, prove, share in F_p and bind).

    The noisy plaintext exists only inside this function; what leaves it is N shares, any N-1
    of which are uniform and independent of the row, and N proofs whose commitments are salted
    (hiding). With ``compress`` every server but ``full`` (default the last) gets a 32-byte seed
    per row instead of its share, and ``full`` the share that completes the sum (docs/protocol.md
    section 4); privacy is the same as long as ChaCha20 is a secure PRG. A client rotates
    ``full`` over the servers batch by batch: a full share costs a server about twice a seed to
    take in and 8 x width bytes a report to store instead of 32, so no server should take them all.
    ``stream``: the batch's keystream (default a fresh one from os.urandom); a resumable
    submission passes one keyed from its journal, so that a rerun rebuilds the same bytes.
    """
    stream = stream if stream is not None else Keystream()  # every random bit of this batch
    noisy = _noisy_rows(study, rows, stream)  # 1-5
    encoded, clamped, clipped, onehot, witness = (noisy.encoded, noisy.clamped, noisy.clipped, noisy.onehot,
                                                  noisy.witness)
    n = study.n_servers
    if proved_shares.is_proved(study):  # always seed-compressed: the leader's F_p shares, seeds elsewhere
        lead = _leader(study, full)
        proved = validity.prepare(study, encoded, stream, lead, onehot=onehot,
                                  rows=witness if study.proved_features else None)
        shares: list[np.ndarray | None] = [proved.leader if j == proved.full else None for j in range(n)]
        return PreparedBatch(list(proved.report_ids), list(proved.binding), shares, list(proved.seeds),
                             clamped=clamped, clipped=clipped, study=study)
    if compress:
        lead = _leader(study, full)
        seeds, last = ring.share_with_seeds(encoded, n, stream)
        per_server: list[np.ndarray | None] = [*seeds[:lead], None, *seeds[lead:]]
        contents = [binding.CONTENT_SHARE if s is None else binding.CONTENT_SEED for s in per_server]
        payloads = [last if s is None else s for s in per_server]
        ids, proofs = binding.bind(study.study_id, contents, payloads, stream=stream)
        return PreparedBatch(ids, proofs, [last if s is None else None for s in per_server], per_server,
                             clamped=clamped, clipped=clipped)
    full_shares = ring.share(encoded, n, stream)
    ids, proofs = binding.bind(study.study_id, [binding.CONTENT_SHARE] * n, full_shares, stream=stream)
    return PreparedBatch(ids, proofs, list(full_shares), clamped=clamped, clipped=clipped)


# --- 6. and 7. in a study with batch proofs: prove the batch at once ----------------------------

@dataclass
class ProofBatch:
    """m rows of a study with batch proofs as one proved batch (docs/protocol.md section 4d):
    each server's record (``media_type(j)``, ``body(j)``: the leader's blind, input and proof
    shares, or a helper's seed, after the header and the parts), the batch id every server
    computes from the parts, and the rows' ids (``batch_validity.row_ids``: hashes of the batch id
    and the row's index; what the sketch hashes a row by, as it hashes a report by its
    report id)."""

    records: list[tuple[str, bytes]]
    leader: int
    batch_id: bytes
    report_ids: list[bytes]
    #: as :class:`PreparedBatch`'s: what the map into the ball changed, for the data owner to see
    clamped: np.ndarray | None = None
    clipped: int = 0

    def __len__(self) -> int:
        return len(self.report_ids)

    def media_type(self, j: int) -> str:
        return self.records[j][0]

    def body(self, j: int) -> bytes:
        return self.records[j][1]


def prepare_proof_batch(study: Study, rows: np.ndarray, stream: Keystream | None = None,
                        leader: int | None = None) -> ProofBatch:
    """The path for m rows of a study with batch proofs (rows already checked, (m, d), 1 <= m <=
    ``batch_records.max_rows(study)``): map, clip, features, sign, round and noise exactly as
    :func:`prepare` runs them (the same draws from ``stream``: the signs, then the noise), the
    noisy signed rows in grid units (``validity.grid_units``: section 4b's u, what a per-report
    proof digitises), then the batch proved with the leader at ``leader`` (default the last
    server; ``batch_validity.prove`` draws the helpers' seeds, the leader's blind and the proof's
    randomness next from ``stream``) and each server's record (``batch_records.records``).

    A row outside the norm bound, or a projection outside its range, raises
    ``validity.ValidityError`` (probability <= 2^-96 a row and a batch), as :func:`prepare` does
    for a report. ``stream`` keyed from a submission's journal makes every record byte-identical
    in every run, so a batch sent again is the same batch (the same batch id), counted once."""
    from . import batch_records, batch_validity  # imported by a bulk owner of such a study only

    if not study.batch_proofs:
        raise ValueError("this study does not take batch proofs (its batch_proofs is false)")
    m = len(rows)
    if not 1 <= m <= batch_records.max_rows(study):
        raise ValueError(f"a batch holds 1 to {batch_records.max_rows(study)} rows; got {m}")
    stream = stream if stream is not None else Keystream()  # every random bit of this batch
    noisy = _noisy_rows(study, rows, stream)  # 1-5
    plan = batch_validity.study_plan(study, m)
    units = validity.grid_units(validity.plan(study), noisy.encoded)
    proved = batch_validity.prove(plan, units, stream, _leader(study, leader))  # 6, 7
    bid = batch_validity.batch_id(batch_validity.wrap_seed(plan, proved.parts), proved.digits_part)
    ids = batch_validity.row_ids(bid, m)
    return ProofBatch(batch_records.records(plan, proved), proved.leader, bid, [bytes(r) for r in ids],
                      noisy.clamped, noisy.clipped)


def block_vectors(study: Study, party: str, rows: np.ndarray, signs: np.ndarray | None = None) -> np.ndarray:
    """One party's blocks before noise: each clipped to a hair under the party's bound B_j
    (rounding the block to the grid moves it by at most h sqrt(d_j) / 2, so the rounded block
    stays within B_j), times the individual's party-key sign in a signed study (``signs``:
    parties.signs, True = -1)."""
    _, declared = study.party(party)
    rounding = study.noise_grid.spacing * math.sqrt(declared.width) / 2.0
    blocks = clip_rows(rows, max(0.0, declared.row_bound - rounding))
    if study.secret_sign:
        if signs is None or np.shape(signs) != (len(blocks),):
            raise ValueError("a signed study with parties needs each individual's party-key sign (parties.signs)")
        blocks[np.asarray(signs, dtype=bool)] *= -1.0
    elif signs is not None:
        raise ValueError("signs are for a signed study with parties only")
    return blocks


def prepare_blocks(study: Study, party: str, pseudonyms: list[bytes], rows: np.ndarray,
                   stream: Keystream | None = None, signs: np.ndarray | None = None,
                   full: int | None = None) -> PreparedBatch:
    """The path for one party's blocks of m individuals (rows already checked, (m, d_j)): clip
    each block to the party's bound B_j, multiply it by the individual's party-key sign in a
    signed study (``signs``: parties.signs, True = -1; every party the same, so the joined row is
    signed whole), add the study's discrete Gaussian noise to every value, encode, share and bind
    (each block id commits to its shares, the party and the individual's pseudonym;
    docs/vertical.md).

    The joined row of an individual (every party's block) then has norm at most B and noise
    N(0, sigma^2 I_d): a single owner's report, so the study's calibration holds unchanged.

    A study with validity proofs proves each block valid with the party's own bound
    (validity.party_plan: its noisy signed block within B_j plus the noise allowance of d_j
    columns), shares it as its reports are (the leader ``full``, default the last server, gets
    its input and proof shares, every other server a seed) and binds it as a block."""
    index, _ = study.party(party)
    if len(pseudonyms) != len(rows):
        raise ValueError(f"{len(pseudonyms)} pseudonyms for {len(rows)} rows")
    stream = stream if stream is not None else Keystream()
    encoded = noisy_encoded(block_vectors(study, party, rows, signs), study, stream)
    n = study.n_servers
    if proved_shares.is_proved(study):  # the leader's F_p shares, seeds elsewhere, as a report's
        proved = validity.prepare(study, encoded, stream, _leader(study, full), party=index,
                                  pseudonyms=list(pseudonyms))
        leader: list[np.ndarray | None] = [proved.leader if j == proved.full else None for j in range(n)]
        return PreparedBatch(list(proved.report_ids), list(proved.binding), leader, list(proved.seeds),
                             party=party, pseudonyms=list(pseudonyms), study=study)
    shares = ring.share(encoded, n, stream)
    ids, proofs = binding.bind(study.study_id, [binding.CONTENT_SHARE] * n, shares,
                               binding.block_prefixes(study.study_id, index, pseudonyms), stream)
    return PreparedBatch(ids, proofs, list(shares), party=party, pseudonyms=list(pseudonyms))
