"""The compiled loops (numba) beside their reference code, and one rule for when they run.

Three hot loops have a compiled form that gives the same bits as a reference that needs no
compiler: the sketch hash and signed sum (``_sketch_kernel.py``; hashlib's BLAKE2b and
scipy), the binding check's SHA-256 rows (``_sha256_kernel.py``; hashlib) and the ChaCha20
keystream of seed-compressed shares (``_chacha_kernel.py``; ``cryptography``). A compiled loop
is several to a hundred times faster on a large batch, but loading it costs about a second of
CPU (numba's import and its on-disk cache; compiling, once per machine, several seconds). So:

* a loop is loaded the first time a batch of at least :data:`MIN_ROWS` rows wants it, in that
  caller's thread, or ahead of time by :meth:`Kernel.warm_up` (a share server, in a background
  thread, when it opens a large study; the SDK's client before its first batch); a process that
  only ever sees small batches never imports numba;
* once loaded it serves every batch of at least ``warm_rows`` rows (below that a Python call of
  the reference is cheaper than the loop's set-up);
* while another thread is loading it, callers take the reference and do not wait for the load,
  except where the reference is slow enough that a large batch loses more than the wait: the
  ChaCha20 reference is a ``cryptography`` cipher per key (about 10 us each, so 10^5 keys take
  about a second, as long as the load), and a batch of ``MIN_ROWS`` keys or more waits for it;
* a loop that cannot be had here (no numba, no writable cache and no compiler, a libcrypto
  without the SHA-256 symbols), or whose probe in its module's ``load`` disagrees with the
  reference, is never used: the reference serves, only slower, and one warning says why.

Each ``_*_kernel`` module imports numba at its top and offers ``load()``: the object callers
use, checked on a probe against the reference, or None. Its loops release the GIL from
:data:`RELEASE_FROM` rows and keep it below (each has two compiled entry points). This module
imports numba only inside :func:`njit_cached`, which those modules call. I/O-free apart from
numba's cache files.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("dpsketch")

#: rows (ids, records, keys) from which a batch loads a compiled loop that is not loaded yet
MIN_ROWS = 4096
#: rows from which a compiled loop releases the GIL while it runs. A bulk upload's batch runs
#: long enough for the server's other threads to use the time; a group of single uploads (tens
#: of rows, microseconds) does not, and giving the GIL up there cost the writer a wait for the
#: event loop to hand it back (up to the switch interval) and both threads a switch each time.
RELEASE_FROM = 1024


def _writable(path: str) -> bool:
    """numba's own test of a cache directory: a temporary file can be made in it (a mode check
    would pass for root on a read-only mount)."""
    try:
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


_CACHE_LOCK = threading.Lock()


def _prepare_numba() -> None:
    """What must be settled before numba compiles or loads a loop: which CPU's loops to use (a
    shipped cache built on another CPU) and where the cache is (a read-only one copied). Each
    runs once per process. :class:`Kernel` calls this before importing a kernel module, whose
    first ``numba.njit`` fixes the CPU; :func:`njit_cached` calls it too, for a kernel module
    imported directly (the tests do)."""
    with _CACHE_LOCK:  # two loops may load at once, in two threads: one copy
        _portable_code_on_another_cpu()
        _copy_a_read_only_cache()


#: Beside a shipped cache (deploy/Dockerfile): the CPU its fastest loops were compiled for, as
#: llvmlite names it. The cache also holds every loop compiled for a generic x86-64 (or other
#: architecture) CPU, which runs anywhere.
BUILD_CPU_FILE = "dpsketch-build-cpu.json"


def _this_cpu() -> dict[str, str]:
    import llvmlite.binding as llvm

    return {"name": llvm.get_host_cpu_name(), "features": llvm.get_host_cpu_features().flatten()}


def record_build_cpu() -> bool:
    """Write :data:`BUILD_CPU_FILE` into numba's cache directory (the image build does, after
    compiling the loops for its own CPU and before compiling them for a generic one)."""
    import numba

    if not numba.config.CACHE_DIR:
        return False
    with open(os.path.join(numba.config.CACHE_DIR, BUILD_CPU_FILE), "w") as out:
        json.dump(_this_cpu(), out)
    return True


@functools.cache
def _portable_code_on_another_cpu() -> None:
    """numba keys each cached loop on the CPU it was compiled for, so an image built on one CPU
    and run on another (a cluster's nodes, a cloud's instance types) would compile every loop
    again at each start where its cache is read-only (about 16 s of CPU). The image ships both:
    loops for the build machine's CPU (the fastest there) and loops for a generic CPU. A process
    on another CPU than the build's takes the generic ones: the sketch hash, the running totals
    and the binding's SHA-256 measured as fast, seed expansion about 1.3x slower
    (docs/operations.md). An operator's own NUMBA_CPU_NAME / NUMBA_CPU_FEATURES win."""
    import numba

    if os.environ.get("NUMBA_CPU_NAME") or os.environ.get("NUMBA_CPU_FEATURES") or not numba.config.CACHE_DIR:
        return
    try:
        with open(os.path.join(numba.config.CACHE_DIR, BUILD_CPU_FILE)) as recorded:
            built_for = json.load(recorded)
    except (OSError, ValueError):  # no shipped cache (a checkout, a pip install): nothing to choose
        return
    try:
        here = _this_cpu()
    except Exception:  # llvmlite cannot name this CPU: numba keeps its own choice
        log.warning("could not tell this CPU from the one numba's cache was built for", exc_info=True)
        return
    if built_for == here:
        return
    numba.config.CPU_NAME, numba.config.CPU_FEATURES = "generic", ""
    log.info("numba's cache was built for a %s CPU and this one is a %s: using its loops compiled "
             "for a generic CPU", built_for.get("name") if isinstance(built_for, dict) else built_for,
             here["name"])


@functools.cache
def _copy_a_read_only_cache() -> None:
    """numba reads its cache only from a directory it can write to. The image ships its loops
    compiled in ``NUMBA_CACHE_DIR`` (deploy/Dockerfile); where that directory is read-only (a
    pod with ``readOnlyRootFilesystem``, deploy/k8s) every loop would be compiled in memory at
    every start, about 16 s of CPU. Copy the shipped cache instead (under 1 MiB) into a new
    private directory in the system's temporary one (an emptyDir there) and point numba at it,
    for this process only: a fresh directory, so no other user's files are ever loaded."""
    import numba

    shipped = numba.config.CACHE_DIR
    if not shipped or not os.path.isdir(shipped) or _writable(shipped):
        return
    copy = None
    try:
        copy = tempfile.mkdtemp(prefix="dpsketch-numba-")
        shutil.copytree(shipped, copy, dirs_exist_ok=True)
    except OSError:
        if copy:  # a part copied (a full temporary directory): not left behind
            shutil.rmtree(copy, ignore_errors=True)
        log.warning("numba's cache %s is read-only and could not be copied: its loops are compiled "
                    "in memory", shipped, exc_info=True)
        return
    atexit.register(shutil.rmtree, copy, ignore_errors=True)
    numba.config.CACHE_DIR = copy


def njit_cached(**options):
    """numba.njit with its on-disk cache (a read-only one copied first, above), or without one
    where no cache directory is writable (a read-only install: numba refuses ``cache=True``
    with a RuntimeError when the function is compiled; the loop is then compiled in memory,
    once per process)."""
    import numba

    _prepare_numba()

    def wrap(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(cache=False, **options)(fn)
    return wrap


class Kernel:
    """One compiled loop: loaded at most once per process, by the module docstring's rule."""

    def __init__(self, module: str, what: str, warm_rows: int = 1, wait_for_load: bool = False):
        self.module = module  # e.g. "._sketch_kernel", relative to this package
        self.what = what  # for the log: what takes the reference when the loop is unavailable
        self.warm_rows = warm_rows
        #: a batch of MIN_ROWS rows or more waits for another thread's load (a slow reference)
        self.wait_for_load = wait_for_load
        self._lock = threading.Lock()
        self._loop: Any = None
        self.state = "untried"  # then "ready" or "unavailable"

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def loaded(self) -> Any:
        """The loop if it is loaded, else None (never loads it)."""
        return self._loop if self.state == "ready" else None

    def for_rows(self, m: int) -> Any:
        """The loop for a batch of ``m`` rows, or None for the reference: loaded and ``m`` at
        least ``warm_rows``; not tried yet and ``m`` at least MIN_ROWS: loaded now, unless
        another thread is loading it (then None, or with ``wait_for_load`` the loop once that
        load is done)."""
        if self.state == "ready":
            return self._loop if m >= self.warm_rows else None
        if self.state == "untried" and m >= MIN_ROWS and self._load(wait=self.wait_for_load):
            return self._loop
        return None

    def warm_up(self) -> bool:
        """Load the loop now (waiting for another thread that is loading it); whether it is
        available."""
        return self._load(wait=True)

    def require(self) -> Any:
        """The loop, loaded now if need be; RuntimeError where it cannot be had (a caller that
        asked for the compiled loop by name)."""
        if not self.warm_up():
            raise RuntimeError(f"the compiled loop {self.module[1:]} is not available here")
        return self._loop

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Take the reference inside the block, then what was there before (benchmarks measure
        the compiled loop against the code it replaces, in one run)."""
        with self._lock:
            saved, self._loop, self.state = (self._loop, self.state), None, "unavailable"
        try:
            yield
        finally:
            with self._lock:
                self._loop, self.state = saved

    def disable(self) -> None:
        """Take the reference from now on (tests compare the two paths with it)."""
        with self._lock:
            self._loop, self.state = None, "unavailable"

    def _load(self, wait: bool) -> bool:
        if self.state == "untried":
            if not self._lock.acquire(blocking=wait):
                return False  # another thread is loading it: the caller takes the reference
            try:
                if self.state == "untried":
                    try:
                        # before the module's first numba.njit: that creates numba's code
                        # generator, which fixes the CPU the loops are compiled or loaded for
                        _prepare_numba()
                        loop = importlib.import_module(self.module, __package__).load()
                    except Exception as exc:  # numba missing or refusing
                        loop = None
                        if isinstance(exc, ModuleNotFoundError) and exc.name in ("numba", "llvmlite"):
                            # a client's install (pip install dpsketch, no extras) has no numba on
                            # purpose: the reference is its code path, not a fault (docs/install.md)
                            log.info("numba is not installed: %s uses its reference code", self.what)
                            self._loop, self.state = None, "unavailable"
                            return False
                        log.warning("could not load the compiled loop %s", self.module[1:], exc_info=True)
                    if loop is None:
                        log.warning("the compiled loop %s is unavailable: %s keeps its reference code "
                                    "(slower, the same results)", self.module[1:], self.what)
                    self._loop = loop
                    self.state = "ready" if loop is not None else "unavailable"
            finally:
                self._lock.release()
        return self.state == "ready"


#: the sketch hash of many ids and the signed sum into a running aggregate (sketch.py): from 32
#: ids once loaded (below, hashlib's BLAKE2b per id is cheaper than the loop's set-up)
SKETCH = Kernel("._sketch_kernel", "the sketch hash", warm_rows=32)
#: the binding check's SHA-256 of many records (binding.py)
SHA256 = Kernel("._sha256_kernel", "the binding check's SHA-256")
#: ChaCha20 keystreams under many keys: seed expansion (chacha.py, ring.py); its reference is a
#: cipher per key, so a large batch waits for a load in progress
CHACHA = Kernel("._chacha_kernel", "seed expansion (ChaCha20)", wait_for_load=True)


def warm_up_all() -> bool:
    """Load every compiled loop now (a share server opening a large study, in a thread);
    whether all of them are available."""
    return all([kernel.warm_up() for kernel in (SKETCH, CHACHA, SHA256)])
