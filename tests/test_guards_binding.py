"""The report binding, checked against its specification (docs/protocol.md 4a; issue 47).

A server accepts a payload under a report id only if the id commits to it:

    c_j       = SHA-256("dpsketch/commit/2" || j || content_j || salt_j || payload_j)[:16]
    report_id = SHA-256("dpsketch/report/2" || study_id || c_1 || ... || c_N)[:16]

(a block: "dpsketch/block/2" || study_id || party || pseudonym in place of the report prefix).
Every id here is recomputed with hashlib from that text, and every forgery an adversary could
send (one byte of the share, the salt, another server's commitment or the id changed; the right
record for another server, content kind or study) must be found exactly, record by record, by
every engine the server may use: the single-record path, the compiled batch loop and hashlib.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from dpsketch.protocol import binding

STUDY = "ab" * 32
OTHER_STUDY = "cd" * 32
N = 3


def _ref_commitment(j: int, content: int, salt: bytes, payload: bytes) -> bytes:
    return hashlib.sha256(b"dpsketch/commit/2" + bytes((j, content)) + salt + payload).digest()[:16]


def _ref_id(prefix: bytes, commitments: list[bytes]) -> bytes:
    return hashlib.sha256(prefix + b"".join(commitments)).digest()[:16]


def _shares(m: int, width: int = 3, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2 ** 63, size=(m, width), dtype=np.uint64) for _ in range(N)]


@pytest.mark.parametrize("blocks", [False, True])
def test_bind_makes_the_ids_the_specification_says(blocks):
    m = 12
    shares = _shares(m)
    pseudonyms = [bytes([i]) * 16 for i in range(m)]
    prefixes = binding.block_prefixes(STUDY, 2, pseudonyms) if blocks else None
    ids, proofs = binding.bind(STUDY, [binding.CONTENT_SHARE] * N, shares, prefixes)
    for i in range(m):
        salts = [proofs[j][i, :16].tobytes() for j in range(N)]
        cs = [_ref_commitment(j, binding.CONTENT_SHARE, salts[j], shares[j][i].astype("<u8").tobytes())
              for j in range(N)]
        prefix = (b"dpsketch/block/2" + bytes.fromhex(STUDY) + bytes((2,)) + pseudonyms[i] if blocks
                  else b"dpsketch/report/2" + bytes.fromhex(STUDY))
        assert ids[i] == _ref_id(prefix, cs)
        for j in range(N):  # server j's proof: its salt, then the others' commitments in order
            assert proofs[j][i].tobytes() == salts[j] + b"".join(c for o, c in enumerate(cs) if o != j)
    for j in range(N):
        binding.verify(STUDY, N, j, binding.CONTENT_SHARE, ids, proofs[j], shares[j], prefixes)
        assert binding.unbound(STUDY, N, j, binding.CONTENT_SHARE, ids, proofs[j], shares[j], prefixes).size == 0
    assert binding.report_id(STUDY, [bytes(16)] * N) == _ref_id(b"dpsketch/report/2" + bytes.fromhex(STUDY),
                                                               [bytes(16)] * N)
    for position in (0, 1, 255):
        assert binding.commitment(position, 2, b"s" * 16, b"p") == _ref_commitment(position, 2, b"s" * 16, b"p")


def test_bind_for_server_makes_ids_a_server_accepts_and_nothing_else():
    m = 9
    payload = _shares(m)[0]
    for position in range(N):
        ids, proofs = binding.bind_for_server(STUDY, N, position, binding.CONTENT_SHARE, payload)
        binding.verify(STUDY, N, position, binding.CONTENT_SHARE, ids, proofs, payload)
        for i in range(m):
            salt, others = proofs[i, :16].tobytes(), proofs[i, 16:].tobytes()
            own = _ref_commitment(position, binding.CONTENT_SHARE, salt, payload[i].astype("<u8").tobytes())
            cs = [others[k * 16:(k + 1) * 16] for k in range(N - 1)]
            cs.insert(position, own)
            assert ids[i] == _ref_id(b"dpsketch/report/2" + bytes.fromhex(STUDY), cs)
        wrong = (position + 1) % N
        assert binding.unbound(STUDY, N, wrong, binding.CONTENT_SHARE, ids, proofs, payload).tolist() == list(range(m))


def _forge(what: str, ids, proofs, payload, i: int):
    ids, proofs, payload = list(ids), proofs.copy(), payload.copy()
    if what == "share":
        payload.view(np.uint8)[i, 5] ^= 0x10
    elif what == "salt":
        proofs[i, 3] ^= 1
    elif what == "other-commitment":
        proofs[i, -1] ^= 0x80
    elif what == "id":
        rid = bytearray(ids[i])
        rid[15] ^= 1
        ids[i] = bytes(rid)
    return ids, proofs, payload


@pytest.mark.parametrize("engine", ["default", "hashlib"])
@pytest.mark.parametrize("m", [1, 2, 40])
@pytest.mark.parametrize("what", ["share", "salt", "other-commitment", "id"])
def test_every_forged_record_is_found_exactly(monkeypatch, engine, m, what):
    """One server (position 1) of three; forged records at a few positions: unbound() names
    exactly those, verify() refuses, the rest of the batch is bound."""
    if engine == "hashlib":
        monkeypatch.setattr(binding, "_compiled_rows", lambda m: None)
    shares = _shares(m, seed=m)
    ids, proofs = binding.bind(STUDY, [binding.CONTENT_SHARE] * N, shares)
    position = 1
    forged = sorted({0, m // 2, m - 1})
    f_ids, f_proofs, f_payload = ids, proofs[position], shares[position]
    for i in forged:
        f_ids, f_proofs, f_payload = _forge(what, f_ids, f_proofs, f_payload, i)
    got = binding.unbound(STUDY, N, position, binding.CONTENT_SHARE, f_ids, f_proofs, f_payload)
    assert got.tolist() == forged
    with pytest.raises(binding.BindingError) as refused:
        binding.verify(STUDY, N, position, binding.CONTENT_SHARE, f_ids, f_proofs, f_payload)
    assert f_ids[forged[0]].hex() in str(refused.value)  # the first forged record is named
    # the genuine records for this server, sent as another server, kind or study: all refused
    for args in ((STUDY, N, 0, binding.CONTENT_SHARE), (STUDY, N, position, binding.CONTENT_SEED),
                 (OTHER_STUDY, N, position, binding.CONTENT_SHARE)):
        assert binding.unbound(*args, ids, proofs[position], shares[position]).tolist() == list(range(m))
        with pytest.raises(binding.BindingError):
            binding.verify(*args, ids, proofs[position], shares[position])
    binding.verify(STUDY, N, position, binding.CONTENT_SHARE, ids, proofs[position], shares[position])


@pytest.mark.parametrize("m", [1, 30, 300])
def test_a_block_is_bound_to_its_party_and_pseudonym(m):
    shares = _shares(m, seed=7)
    pseudonyms = [(i + 1).to_bytes(16, "little") for i in range(m)]
    prefixes = binding.block_prefixes(STUDY, 1, pseudonyms)
    ids, proofs = binding.bind(STUDY, [binding.CONTENT_SHARE] * N, shares, prefixes)
    binding.verify(STUDY, N, 2, binding.CONTENT_SHARE, ids, proofs[2], shares[2], prefixes)
    moved = binding.block_prefixes(STUDY, 1, pseudonyms[1:] + pseudonyms[:1]) if m > 1 else \
        binding.block_prefixes(STUDY, 1, [bytes(16)])
    other_party = binding.block_prefixes(STUDY, 0, pseudonyms)
    for wrong in (moved, other_party, None):
        assert binding.unbound(STUDY, N, 2, binding.CONTENT_SHARE, ids, proofs[2], shares[2], wrong).size == m
    with pytest.raises(ValueError):
        binding.block_prefixes(STUDY, 256, pseudonyms)
    with pytest.raises(ValueError):
        binding.block_prefixes(STUDY, 0, [b"short"])
    with pytest.raises(ValueError):  # a study id that is not 32 bytes, with a valid party
        binding.block_prefixes("ab" * 31, 1, pseudonyms)
    with pytest.raises(ValueError):
        binding.report_id("ab" * 31, [bytes(16)] * N)
    with pytest.raises(ValueError):
        binding.commitment(256, 1, bytes(16), b"")


def test_seed_payloads_are_bound_as_bytes():
    m = 5
    seeds = np.random.default_rng(1).integers(0, 256, size=(m, 32), dtype=np.uint8)
    shares = _shares(m)
    ids, proofs = binding.bind(STUDY, [binding.CONTENT_SEED, binding.CONTENT_SHARE, binding.CONTENT_SHARE],
                               [seeds, shares[1], shares[2]])
    for i in range(m):
        own = _ref_commitment(0, binding.CONTENT_SEED, proofs[0][i, :16].tobytes(), seeds[i].tobytes())
        cs = [own] + [proofs[0][i, 16 + 16 * k:32 + 16 * k].tobytes() for k in range(N - 1)]
        assert ids[i] == _ref_id(b"dpsketch/report/2" + bytes.fromhex(STUDY), cs)
    binding.verify(STUDY, N, 0, binding.CONTENT_SEED, ids, proofs[0], seeds)
    assert binding.unbound(STUDY, N, 0, binding.CONTENT_SHARE, ids, proofs[0], seeds).size == m


def test_a_single_seed_record_and_a_load_generators_seeds_are_bound_as_bytes():
    """The single-record path and bind_for_server hash a seed payload as its 32 bytes."""
    seeds = np.random.default_rng(2).integers(0, 256, size=(1, 32), dtype=np.uint8)
    shares = _shares(1)
    ids, proofs = binding.bind(STUDY, [binding.CONTENT_SEED, binding.CONTENT_SHARE, binding.CONTENT_SHARE],
                               [seeds, shares[1], shares[2]])
    binding.verify(STUDY, N, 0, binding.CONTENT_SEED, ids, proofs[0], seeds)
    own = _ref_commitment(0, binding.CONTENT_SEED, proofs[0][0, :16].tobytes(), seeds[0].tobytes())
    assert ids[0] == _ref_id(b"dpsketch/report/2" + bytes.fromhex(STUDY), [own] + [
        proofs[0][0, 16 + 16 * k:32 + 16 * k].tobytes() for k in range(N - 1)])
    more = np.random.default_rng(3).integers(0, 256, size=(4, 32), dtype=np.uint8)
    ids, proofs = binding.bind_for_server(STUDY, N, 1, binding.CONTENT_SEED, more)
    for i in range(4):
        own = _ref_commitment(1, binding.CONTENT_SEED, proofs[i, :16].tobytes(), more[i].tobytes())
        assert ids[i] == _ref_id(b"dpsketch/report/2" + bytes.fromhex(STUDY),
                                 [proofs[i, 16:32].tobytes(), own, proofs[i, 32:48].tobytes()])


def test_no_records_bind_to_nothing_and_an_id_of_another_length_is_unbound():
    empty = np.zeros((0, 3), dtype=np.uint64)
    ids, proofs = binding.bind(STUDY, [binding.CONTENT_SHARE] * N, [empty] * N)
    assert ids == [] and all(p.shape == (0, binding.proof_bytes(N)) for p in proofs)
    shares = _shares(3)
    ids, proofs = binding.bind(STUDY, [binding.CONTENT_SHARE] * N, shares)
    odd = [ids[0], ids[1][:15], ids[2]]
    assert binding.unbound(STUDY, N, 0, binding.CONTENT_SHARE, odd, proofs[0], shares[0]).tolist() == [1]
    forged = [ids[0], ids[1][:15], bytes(16)]  # and a 16-byte id bound to nothing
    assert binding.unbound(STUDY, N, 0, binding.CONTENT_SHARE, forged, proofs[0], shares[0]).tolist() == [1, 2]
