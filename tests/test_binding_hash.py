"""The binding check's SHA-256 rows (binding.hash_rows): the compiled loop over OpenSSL's
SHA-256 (dpsketch/protocol/_sha256_kernel.py) gives hashlib's digests, a binding check through it
refuses exactly what it refused before, and a process without it keeps hashlib."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from dpsketch.protocol import _sha256_kernel, binding, kernels


@pytest.fixture(scope="module")
def rows_loop():
    loop = _sha256_kernel.load()
    assert loop is not None, "libcrypto's SHA256_Init/Update/Final should load on this machine"
    return loop


@pytest.mark.parametrize("width", [0, 1, 55, 56, 63, 64, 65, 119, 291, 1000])
def test_the_loop_gives_hashlibs_digest_at_every_block_boundary(rows_loop, width):
    rng = np.random.default_rng(width)
    buf = rng.integers(0, 256, size=(37, width), dtype=np.uint8)
    out = np.zeros((37, 32), np.uint8)
    assert rows_loop(buf, out) == 0
    for i in range(37):
        assert out[i].tobytes() == hashlib.sha256(buf[i].tobytes()).digest()


def _bound(m: int, d: int = 8, n: int = 3):
    rng = np.random.default_rng(m)
    study_id = rng.bytes(32).hex()
    shares = [rng.integers(0, 2**64, size=(m, d), dtype=np.uint64) for _ in range(n)]
    ids, proofs = binding.bind(study_id, [binding.CONTENT_SHARE] * n, shares)
    return study_id, shares, ids, proofs


@pytest.mark.parametrize("engine", ["compiled", "hashlib"])
def test_a_large_batch_is_checked_alike_by_both_engines(monkeypatch, engine):
    """Every server accepts the genuine batch, and a share changed in one bit in any record is
    refused with that record's id, by either engine."""
    fresh = kernels.Kernel("._sha256_kernel", "the binding check")
    if engine == "hashlib":
        fresh.disable()
    monkeypatch.setattr(kernels, "SHA256", fresh)
    m = kernels.MIN_ROWS + 3
    study_id, shares, ids, proofs = _bound(m)
    for j in range(3):
        binding.verify(study_id, 3, j, binding.CONTENT_SHARE, ids, proofs[j], shares[j])
    assert fresh.ready == (engine == "compiled")
    for victim in (0, 1234, m - 1):
        forged = shares[1].copy()
        forged[victim, 5] ^= np.uint64(1 << 17)
        with pytest.raises(binding.BindingError, match=ids[victim].hex()):
            binding.verify(study_id, 3, 1, binding.CONTENT_SHARE, ids, proofs[1], forged)
    # the ids the compiled loop makes are the ones hashlib makes: a client on either verifies
    fresh.disable()
    for j in range(3):
        binding.verify(study_id, 3, j, binding.CONTENT_SHARE, ids, proofs[j], shares[j])


def test_without_libcrypto_the_check_keeps_hashlib(monkeypatch):
    """No libcrypto with the SHA-256 functions: the loop does not load, and the check works."""
    monkeypatch.setattr(_sha256_kernel, "_functions", lambda: None)
    monkeypatch.setattr(kernels, "SHA256", kernels.Kernel("._sha256_kernel", "the binding check"))
    assert binding.warm_up() is False and kernels.SHA256.state == "unavailable"
    study_id, shares, ids, proofs = _bound(kernels.MIN_ROWS)
    binding.verify(study_id, 3, 2, binding.CONTENT_SHARE, ids, proofs[2], shares[2])
    with pytest.raises(binding.BindingError):
        binding.verify(study_id, 3, 2, binding.CONTENT_SHARE, ids, proofs[1], shares[2])


def test_small_batches_do_not_load_numba():
    """A fresh process that checks only batches under kernels.MIN_ROWS records (a server taking
    single uploads) never imports numba; the first large batch loads the loop."""
    code = """
import sys, numpy as np
from dpsketch.protocol import binding, kernels
rng = np.random.default_rng(3)
sid = rng.bytes(32).hex()
for m in (1, 50, kernels.MIN_ROWS - 1):
    shares = [rng.integers(0, 2**64, size=(m, 4), dtype=np.uint64) for _ in range(2)]
    ids, proofs = binding.bind(sid, [1, 1], shares)
    binding.verify(sid, 2, 0, 1, ids, proofs[0], shares[0])
assert "numba" not in sys.modules and kernels.SHA256.state == "untried"
m = kernels.MIN_ROWS
shares = [rng.integers(0, 2**64, size=(m, 4), dtype=np.uint64) for _ in range(2)]
ids, proofs = binding.bind(sid, [1, 1], shares)
assert "numba" in sys.modules and kernels.SHA256.ready
binding.verify(sid, 2, 1, 1, ids, proofs[1], shares[1])
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


@pytest.mark.parametrize("m", [40, kernels.MIN_ROWS + 7])  # both of the loop's entry points
def test_the_compiled_check_finds_exactly_the_forged_records(monkeypatch, m):
    """binding.unbound through the compiled check over the records' parts (no hash inputs
    built) names exactly the records hashlib's check names, at every server position (the
    first and last leave one side of the cut empty), for forgeries in the share, the salt, the
    other servers' commitments and the id, and for a proof that is a strided view of a body."""
    loaded = kernels.Kernel("._sha256_kernel", "the binding check")
    assert loaded.warm_up()
    reference = kernels.Kernel("._sha256_kernel", "the binding check")
    reference.disable()
    n = 4
    study_id, shares, ids, proofs = _bound(m, d=5, n=n)
    rng = np.random.default_rng(m)
    for j in range(n):
        forged_shares, forged_proofs, forged_ids = shares[j].copy(), proofs[j].copy(), list(ids)
        victims = sorted(rng.choice(m, size=8, replace=False).tolist())
        for k, v in enumerate(victims):
            kind = k % 4
            if kind == 0:
                forged_shares[v, k % 5] ^= np.uint64(1 << (k * 7 % 64))
            elif kind == 1:
                forged_proofs[v, k % 16] ^= 1  # the salt
            elif kind == 2:
                forged_proofs[v, 16 + k % (16 * (n - 1))] ^= 0x80  # another server's commitment
            else:
                forged_ids[v] = bytes([forged_ids[v][0] ^ 1]) + forged_ids[v][1:]
        # the proofs as a decoded body hands them over: a strided view of the records
        body = np.zeros((m, 7 + forged_proofs.shape[1]), np.uint8)
        body[:, 7:] = forged_proofs
        found = {}
        for name, kernel in (("compiled", loaded), ("hashlib", reference)):
            monkeypatch.setattr(kernels, "SHA256", kernel)
            found[name] = binding.unbound(study_id, n, j, binding.CONTENT_SHARE, forged_ids, body[:, 7:],
                                          forged_shares).tolist()
        assert found["compiled"] == found["hashlib"] == victims, (j, found)
        monkeypatch.setattr(kernels, "SHA256", loaded)
        assert binding.unbound(study_id, n, j, binding.CONTENT_SHARE, ids, proofs[j], shares[j]).size == 0
