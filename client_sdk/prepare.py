"""What a client sends, built without any I/O: clip, noise, encode, share, bind.

Kept apart from the transport (``client.py``) so that the evaluation harness, the benchmarks and
the tests build exactly the bytes the SDK uploads, and so that a reader finds the privacy-
relevant steps in one short file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpsketch.protocol import binding, envelope, features, messages, proved_shares, ring, validity
from dpsketch.protocol.histogram import HistogramValueError
from dpsketch.protocol.keystream import Keystream
from dpsketch.protocol.study import Study

from . import data as _data
from . import noise


@dataclass
class PreparedBatch:
    """Shares of m rows for N servers, bound to their report ids.

    Full shares: ``shares[j]`` is the (m, width) uint64 share for server j. Seed-compressed
    (``seeds`` is set): every server j but one gets ``seeds[j]``, (m, 32) uint8 seeds each
    expanding to a share (``ring.expand_seeds``), and ``shares[j]`` is None for it; the one
    server whose ``seeds[j]`` is None gets its full share ``shares[j]`` (``prepare_batch``'s
    ``full``). ``share(j)`` gives every server's share either way. ``proofs[j]``
    is server j's (m, 16 N) proofs: the report ids commit to every server's payload
    (``binding``), so no server stores a share other than the one its client sent.

    A study with validity proofs (``study``'s ``validity``; ``validity.prepare``) is always
    seed-compressed: the leader's ``shares[full]`` is its (m, n + P) F_p input and proof share,
    each helper's seeds expand to its own by ``field.expand`` (dpsketch/protocol/proved_shares.py).
    """

    report_ids: list[bytes]
    proofs: list[np.ndarray]
    shares: list[np.ndarray | None]
    seeds: list[np.ndarray | None] | None = None
    #: one party's blocks (``prepare_blocks``): the party's name and each block's pseudonym
    party: str | None = None
    pseudonyms: list[bytes] | None = None
    #: per column, how many of the batch's values were clamped to the study's bounds; and how
    #: many rows were clipped to its row bound (``noise.limited_counts``): what the data owner sees
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
                return proved_shares.expand_seeds(self.study, self.seeds[j])  # type: ignore[index, arg-type]
            width = next(s for s in self.shares if s is not None).shape[1]
            return ring.expand_seeds(self.seeds[j], width)  # type: ignore[index, arg-type]
        return self.shares[j]  # type: ignore[return-value]

    def media_type(self, j: int) -> str:
        if self.party is not None:
            return messages.blocks_media_type(self.party)
        return messages.SEEDS_MEDIA_TYPE if self._seeded(j) else messages.SHARES_MEDIA_TYPE

    def body(self, j: int) -> bytes:
        """Server j's body, of media type ``media_type(j)``."""
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


def prepare_batch(study: Study, rows: np.ndarray, compress: bool = False, full: int | None = None,
                  stream: Keystream | None = None) -> PreparedBatch:
    """Clip, noise, encode, share and bind rows: each row's report id commits to its N shares.

    The noisy plaintext exists only inside this function; what leaves it is N shares, any N-1
    of which are uniform and independent of the row, and N proofs whose commitments are salted
    (hiding). With ``compress`` every server but ``full`` (default the last) gets a 32-byte seed
    per row instead of its share, and ``full`` the share that completes the sum (docs/protocol.md
    section 4); privacy is the same as long as ChaCha20 is a secure PRG. The client rotates
    ``full`` over the servers batch by batch: a full share costs a server about twice a seed to
    take in and 8 x width bytes a report to store instead of 32, so no server should take them all.
    ``stream``: the batch's keystream (default a fresh one from os.urandom); a resumable
    submission passes one keyed from its journal, so that a rerun rebuilds the same bytes
    (client_sdk/journal.py).
    """
    stream = stream if stream is not None else Keystream()  # every random bit of this batch: noise, shares, salts
    clamped, clipped = None, 0
    onehot = None  # a histogram's cells: a validity study's proof separates them from the noise
    witness = None  # a gram validity study's clipped rows
    if study.histogram is not None:  # raw values: the bins decide what they mean
        rows = _data.check_values(rows, study.d)
        try:
            onehot = noise.client_vectors(rows, study)  # what privatize_encoded noises, kept
        except HistogramValueError as exc:
            raise _data.InvalidDataError(str(exc)) from None
        encoded = noise.noisy_encoded(onehot, study, stream)
    else:
        rows = _data.check_rows(rows, study.d)
        clamped, clipped = noise.limited_counts(rows, study)
        if study.secret_sign:
            encoded = noise.noisy_encoded(signed_vectors(rows, study, stream), study, stream)
        elif study.proved_features:  # a gram validity study: its proof multiplies the clipped rows
            witness = noise.clipped_rows(rows, study)
            encoded = noise.noisy_encoded(features.client_vectors(study.kind, witness), study, stream)
        else:
            encoded = noise.privatize_encoded(rows, study, stream)
    n = study.n_servers
    if proved_shares.is_proved(study):  # always seed-compressed: the leader's F_p shares, seeds elsewhere
        return _proved_batch(study, encoded, n - 1 if full is None else full, stream, clamped, clipped, onehot,
                             witness)
    if compress:
        full = n - 1 if full is None else full
        if not 0 <= full < n:
            raise ValueError(f"full={full}: a server position, 0 to {n - 1}")
        seeds, last = ring.share_with_seeds(encoded, n, stream)
        per_server: list[np.ndarray | None] = [*seeds[:full], None, *seeds[full:]]
        contents = [binding.CONTENT_SHARE if s is None else binding.CONTENT_SEED for s in per_server]
        payloads = [last if s is None else s for s in per_server]
        ids, proofs = binding.bind(study.study_id, contents, payloads, stream=stream)
        return PreparedBatch(ids, proofs, [last if s is None else None for s in per_server], per_server,
                             clamped=clamped, clipped=clipped)
    shares = ring.share(encoded, n, stream)
    ids, proofs = binding.bind(study.study_id, [binding.CONTENT_SHARE] * n, shares, stream=stream)
    return PreparedBatch(ids, proofs, shares, clamped=clamped, clipped=clipped)  # type: ignore[arg-type]  # list of arrays as list of optional arrays


def _proved_batch(study: Study, encoded: np.ndarray, full: int, stream: Keystream,
                  clamped: np.ndarray | None, clipped: int, onehot: np.ndarray | None = None,
                  rows: np.ndarray | None = None) -> PreparedBatch:
    """A batch of a study with validity proofs: ``validity.prepare`` shares the encoded noisy
    vectors in F_p and proves each valid (a histogram's with its one-hot rows); ``full`` is the
    leader (explicit input and proof shares), every other server a helper (a seed per report)."""
    n = study.n_servers
    if not 0 <= full < n:
        raise ValueError(f"full={full}: a server position, 0 to {n - 1}")
    proved = validity.prepare(study, encoded, stream, full, onehot=onehot, rows=rows)
    seeds = list(proved.seeds)
    shares: list[np.ndarray | None] = [proved.leader if j == proved.full else None for j in range(n)]
    return PreparedBatch(list(proved.report_ids), list(proved.binding), shares, seeds,
                         clamped=clamped, clipped=clipped, study=study)


def signed_vectors(rows: np.ndarray, study: Study, stream: Keystream) -> np.ndarray:
    """The clipped rows of a secret-sign study, each multiplied by its own secret sign t = +-1
    (one keystream bit per row, drawn before the noise; docs/secret_sign.md). The sign never
    leaves this function: only the noisy signed vector is shared, and the study's accounting
    assumes the adversary does not know t."""
    vectors = noise.client_vectors(rows, study)
    flip = stream.bits(len(vectors))
    vectors[flip] *= -1.0
    return vectors


def prepare_blocks(study: Study, party: str, pseudonyms: list[bytes], rows: np.ndarray) -> PreparedBatch:
    """One party's blocks of m individuals: clip each block to the party's bound B_j, add the
    study's discrete Gaussian noise to every value, encode, share and bind (each block id commits to its
    shares, the party and the individual's pseudonym; docs/vertical.md).

    The joined row of an individual (every party's block) then has norm at most B and noise
    N(0, sigma^2 I_d): a single owner's report, so the study's calibration holds unchanged."""
    index, declared = study.party(party)
    rows = _data.check_rows(rows, declared.width)
    if len(pseudonyms) != len(rows):
        raise ValueError(f"{len(pseudonyms)} pseudonyms for {len(rows)} rows")
    stream = Keystream()
    # a hair under B_j: rounding the block to the grid moves it by at most h sqrt(d_j) / 2
    rounding = study.noise_grid.spacing * math.sqrt(declared.width) / 2.0
    encoded = noise.noisy_encoded(noise.clip_rows(rows, max(0.0, declared.row_bound - rounding)), study, stream)
    n = study.n_servers
    shares = ring.share(encoded, n, stream)
    ids, proofs = binding.bind(study.study_id, [binding.CONTENT_SHARE] * n, shares,
                               binding.block_prefixes(study.study_id, index, pseudonyms), stream)
    return PreparedBatch(ids, proofs, shares, party=party, pseudonyms=list(pseudonyms))  # type: ignore[arg-type]  # list of arrays as list of optional arrays


def record_bytes(media_type: str, study: Study) -> int:
    """Bytes of one record of a plaintext batch body for this study (a block batch: of the
    party its media type names)."""
    party = messages.party_of_media_type(media_type)
    width = study.party(party)[1].width if party is not None else proved_shares.upload_width(study)
    return messages.record_bytes(media_type, width, study.n_servers)


def count_records(body: bytes, media_type: str, study: Study) -> int:
    """Reports in a batch body of any of the three upload media types."""
    if media_type == messages.SEALED_MEDIA_TYPE:
        return envelope.count_records(body, proved_shares.upload_width(study), study.n_servers)
    return len(body) // record_bytes(media_type, study)


def split_body(body: bytes, media_type: str, study: Study) -> tuple[bytes, bytes]:
    """Cut a batch body in two at the record boundary nearest its middle."""
    if media_type == messages.SEALED_MEDIA_TYPE:
        return envelope.split_body(body, proved_shares.upload_width(study), study.n_servers)
    record = record_bytes(media_type, study)
    half = (len(body) // record // 2) * record
    return body[:half], body[half:]
