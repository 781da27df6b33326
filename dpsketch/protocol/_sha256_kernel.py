"""SHA-256 of many equal-length messages in one compiled loop over OpenSSL's own SHA-256.

Why: the binding check (binding.py) hashes two short messages per record, a few hundred bytes
each. hashlib's SHA-256 is OpenSSL's, and on a CPU with the SHA extensions the hashing itself
takes about 0.2 us for a record's share, but a Python call per message costs more than that and
holds the GIL, so a batch upload's check was a quarter of a server's CPU. Here a numba loop
calls the same OpenSSL functions (``SHA256_Init``/``Update``/``Final`` of the libcrypto that
Python's ``_hashlib`` is linked to) once per row, without Python objects and with the GIL
released, so two batches are checked on two cores at once. The digests are OpenSSL's, so they
are hashlib's; :func:`load` also checks that on a test message before anything uses the loop.

Loaded on first use by kernels.py (its rule: when, and hashlib while it is not loaded). The loop calls the C
functions by names registered with LLVM for this process (``dpsketch_SHA256_*``, each pointing at
this process's libcrypto), so numba can keep its machine code on disk like the other kernels'
(``cache=True``; where no cache directory is writable it compiles in memory, about 0.3-0.7 s, once
per process). Anything that stops it from loading (no libcrypto of OpenSSL 1.1 or 3 with those
symbols, no numba) makes :func:`load` return None and callers keep hashlib.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging

import numba
import numpy as np
from numba import types

from .kernels import RELEASE_FROM, njit_cached

log = logging.getLogger("dpsketch")

#: bytes reserved for OpenSSL's SHA256_CTX (112 in OpenSSL 1.1 and 3)
_CTX_BYTES = 256
#: the loops' scratch memory: the context, then two 32-byte digests
_SCRATCH_BYTES = _CTX_BYTES + 64


def _scratch() -> np.ndarray:
    """Scratch memory for one call of a loop, owned by the caller. Why not ``np.empty`` inside the
    loop: numba frees an array after its last use *by name*, and taking ``.ctypes.data`` is a last
    use, so OpenSSL would write its context into freed heap memory (another thread's, once the GIL
    is released). A pointer in these loops is only ever taken into an argument."""
    return np.empty(_SCRATCH_BYTES, np.uint8)


def _libcrypto_candidates() -> list[str]:
    """The libcrypto hashlib uses (already mapped into this process) first, then the system's."""
    import _hashlib  # noqa: F401  (maps OpenSSL's libcrypto into the process, if it is dynamic)

    out: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if "libcrypto" in path.rsplit("/", 1)[-1] and path not in out:
                    out.append(path)
    except OSError:
        pass
    found = ctypes.util.find_library("crypto")
    if found and found not in out:
        out.append(found)
    return out + [name for name in ("libcrypto.so.3", "libcrypto.so.1.1") if name not in out]


def _functions():
    for name in _libcrypto_candidates():
        try:
            lib = ctypes.CDLL(name)
            init, update, final = lib.SHA256_Init, lib.SHA256_Update, lib.SHA256_Final
        except (OSError, AttributeError):
            continue
        init.argtypes, init.restype = [ctypes.c_void_p], ctypes.c_int
        update.argtypes, update.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
        final.argtypes, final.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        return init, update, final
    return None


_SYMBOLS = ("SHA256_Init", "SHA256_Update", "SHA256_Final")


def _register() -> bool:
    """Point LLVM's ``dpsketch_SHA256_*`` symbols at this process's libcrypto; whether it could."""
    functions = _functions()
    if functions is None:
        return False
    import llvmlite.binding

    for name, function in zip(_SYMBOLS, functions):
        llvmlite.binding.add_symbol("dpsketch_" + name, ctypes.cast(function, ctypes.c_void_p).value)
    return True


_init = types.ExternalFunction("dpsketch_SHA256_Init", types.int32(types.voidptr))
_update = types.ExternalFunction("dpsketch_SHA256_Update", types.int32(types.voidptr, types.voidptr, types.uintp))
_final = types.ExternalFunction("dpsketch_SHA256_Final", types.int32(types.voidptr, types.voidptr))


@numba.njit
def _rows(buf, out, scratch):
    """out[i] = SHA-256(buf[i]) for a C-contiguous (m, w) uint8 buf and (m, 32) uint8 out; the
    number of rows OpenSSL refused (0: all hashed). ``scratch``: see :func:`_scratch`."""
    m, width = buf.shape
    c = scratch.ctypes.data
    failed = 0
    for i in range(m):
        ok = _init(c) + _update(c, buf[i].ctypes.data, width) + _final(out[i].ctypes.data, c)
        failed += ok != 3
    return failed


@numba.njit
def _bound(proofs, payloads, claimed, commit_head, id_head, cut, wrong, scratch):
    """The binding check of m records (binding.unbound) over their parts as they lie, without
    building the two hash inputs: per record, own = SHA-256(commit_head || salt || payload)[:16]
    and id = SHA-256(id_head || proof[16:cut] || own || proof[cut:])[:16]; ``wrong[i]`` = 1
    where that id is not ``claimed[i]``. proofs (m, 16 N), payloads (m, w) and claimed (m, 16)
    are uint8 with contiguous rows; the number of records OpenSSL refused to hash (0: all).
    ``scratch``: see :func:`_scratch`."""
    m, width = proofs.shape
    payload_bytes = payloads.shape[1]
    c = scratch.ctypes.data
    own = c + _CTX_BYTES
    digest = own + 32
    commit = commit_head.ctypes.data
    head = id_head.ctypes.data
    failed = 0
    for i in range(m):
        proof = proofs[i].ctypes.data
        ok = (_init(c) + _update(c, commit, commit_head.size) + _update(c, proof, 16)
              + _update(c, payloads[i].ctypes.data, payload_bytes) + _final(own, c))
        ok += (_init(c) + _update(c, head, id_head.size) + _update(c, proof + 16, cut - 16)
               + _update(c, own, 16) + _update(c, proof + cut, width - cut)
               + _final(digest, c))
        failed += ok != 11  # eleven calls, each 1 on success
        same = True
        for j in range(16):
            if scratch[_CTX_BYTES + 32 + j] != claimed[i, j]:
                same = False
                break
        wrong[i] = 0 if same else 1
    return failed


def _rows_released(buf, out, scratch):
    return _rows(buf, out, scratch)


def _bound_released(proofs, payloads, claimed, commit_head, id_head, cut, wrong, scratch):
    return _bound(proofs, payloads, claimed, commit_head, id_head, cut, wrong, scratch)


def _bound_held(proofs, payloads, claimed, commit_head, id_head, cut, wrong, scratch):
    return _bound(proofs, payloads, claimed, commit_head, id_head, cut, wrong, scratch)


def _rows_held(buf, out, scratch):
    return _rows(buf, out, scratch)


def _compile():
    """The loop, from numba's on-disk cache where it can keep one (the symbols must be registered
    first: the cached code calls them by name): an entry point that releases the GIL and one
    that keeps it, chosen by the number of rows (kernels.RELEASE_FROM)."""
    return tuple(njit_cached(nogil=nogil, boundscheck=False)(fn) for fn, nogil in (
        (_rows_released, True), (_rows_held, False), (_bound_released, True), (_bound_held, False)))


def _bound_probe(loop) -> bool:
    """Whether ``loop`` (a compiled _bound) finds exactly the forged records of a probe bound
    with hashlib (three servers, the middle one's view; the second record's share altered)."""
    rng = np.random.default_rng(7)
    proofs = rng.integers(0, 256, (3, 48), dtype=np.uint8)
    payloads = rng.integers(0, 256, (3, 24), dtype=np.uint8)
    commit_head, id_head, cut = b"commit" + bytes((1, 1)), b"report" + bytes(range(32)), 32
    ids = b""
    for i in range(3):
        own = hashlib.sha256(commit_head + proofs[i, :16].tobytes() + payloads[i].tobytes()).digest()[:16]
        ids += hashlib.sha256(id_head + proofs[i, 16:cut].tobytes() + own + proofs[i, cut:].tobytes()).digest()[:16]
    # the argument types binding.unbound passes (numba compiles one loop per array type): the
    # claimed ids and the heads read-only views of bytes, the rest writable C arrays
    claimed = np.frombuffer(ids, np.uint8).reshape(3, 16)
    payloads[1, 5] ^= 1
    wrong = np.zeros(3, np.uint8)
    heads = (np.frombuffer(commit_head, np.uint8), np.frombuffer(id_head, np.uint8))
    return loop(proofs, payloads, claimed, *heads, cut, wrong, _scratch()) == 0 and wrong.tolist() == [0, 1, 0]


def load():
    """The compiled loop, checked against hashlib, or None if it cannot be had here."""
    try:
        if not _register():
            log.info("no libcrypto with SHA256_Init found: the binding check keeps hashlib")
            return None
        released, held, bound_released, bound_held = _compile()
        probe = np.frombuffer(bytes(range(256)) * 3, np.uint8).reshape(3, 256).copy()
        probe[1, :7] = np.frombuffer(b"dpsketc", np.uint8)
        for loop in (released, held):
            out = np.zeros((3, 32), np.uint8)
            if loop(probe, out, _scratch()) != 0 or any(out[i].tobytes() != hashlib.sha256(probe[i].tobytes()).digest()
                                            for i in range(3)):
                log.warning("libcrypto's SHA256 disagrees with hashlib: the binding check keeps hashlib")
                return None
        for loop in (bound_released, bound_held):
            if not _bound_probe(loop):
                log.warning("the compiled binding check disagrees with hashlib's: the binding check keeps hashlib")
                return None

        def rows(buf, out):
            return (released if len(buf) >= RELEASE_FROM else held)(buf, out, _scratch())

        def bound(proofs, payloads, claimed, commit_head, id_head, cut, wrong):
            loop = bound_released if len(proofs) >= RELEASE_FROM else bound_held
            return loop(proofs, payloads, claimed, commit_head, id_head, cut, wrong, _scratch())

        rows.bound = bound  # the whole check of m records (binding.unbound)
        return rows
    except Exception:  # numba missing or refusing: hashlib stays, only slower
        log.warning("could not compile the SHA-256 row loop: the binding check keeps hashlib", exc_info=True)
        return None
