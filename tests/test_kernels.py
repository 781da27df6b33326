"""The one rule for the compiled loops (dpsketch/protocol/kernels.py): loaded only for a large
batch or a warm-up, no caller waits for another thread's load unless the reference is slow
(ChaCha20), and a loop that cannot be had or disagrees with its reference on the probe is never
used (the reference gives the results)."""

from __future__ import annotations

import sys
import threading
import time
import types

import numpy as np
import pytest

from dpsketch.protocol import _chacha_kernel, chacha, kernels, ring


def _fake_module(monkeypatch, name: str, load) -> kernels.Kernel:
    module = types.ModuleType(name)
    module.load = load
    monkeypatch.setitem(sys.modules, name, module)
    return kernels.Kernel(name, "a test", warm_rows=8)


def _loading(monkeypatch, name: str, wait_for_load: bool = False):
    """A kernel whose load a warm-up thread has begun and is held in until ``release`` is set:
    (kernel, the warm-up thread, release)."""
    started, release = threading.Event(), threading.Event()

    def slow_load():
        started.set()
        release.wait(30)
        return "loop"

    kernel = _fake_module(monkeypatch, name, slow_load)
    kernel.wait_for_load = wait_for_load
    warm = threading.Thread(target=kernel.warm_up)
    warm.start()
    assert started.wait(30)
    return kernel, warm, release


def test_a_loop_loads_only_for_a_large_batch_and_then_serves_from_warm_rows(monkeypatch):
    calls = []
    kernel = _fake_module(monkeypatch, "dpsketch_test_fake_kernel", lambda: calls.append(1) or "loop")
    assert kernel.for_rows(kernels.MIN_ROWS - 1) is None and kernel.state == "untried" and not calls
    assert kernel.for_rows(kernels.MIN_ROWS) == "loop" and kernel.ready and calls == [1]
    assert kernel.for_rows(8) == "loop" and kernel.for_rows(7) is None  # warm_rows
    assert kernel.warm_up() and kernel.for_rows(10**6) == "loop" and calls == [1]  # loaded once


def test_reference_takes_the_reference_inside_the_block_only(monkeypatch):
    """Kernel.reference (the benchmarks' "code it replaces" baseline): inside, every batch
    takes the reference; afterwards the loop serves again, even after an error inside."""
    kernel = _fake_module(monkeypatch, "dpsketch_test_reference_kernel", lambda: "loop")
    assert kernel.warm_up() and kernel.for_rows(10**6) == "loop"
    with pytest.raises(RuntimeError):
        with kernel.reference():
            assert kernel.for_rows(10**6) is None and kernel.loaded() is None
            raise RuntimeError("inside")
    assert kernel.ready and kernel.for_rows(10**6) == "loop"


def test_nobody_waits_for_another_threads_load(monkeypatch):
    """While a warm-up thread is still loading, a large batch takes the reference at once."""
    kernel, warm, release = _loading(monkeypatch, "dpsketch_test_slow_kernel")
    t0 = time.monotonic()
    assert kernel.for_rows(10 * kernels.MIN_ROWS) is None  # the reference, now
    waited = time.monotonic() - t0
    release.set()
    warm.join(30)
    # a batch that waited would wait for release (set below, after this measure): 30 s
    assert waited < 10.0, f"a batch waited {waited:.2f} s for another thread's load"
    assert kernel.ready and kernel.for_rows(kernels.MIN_ROWS) == "loop"


def test_a_kernel_with_a_slow_reference_waits_for_the_load_in_progress(monkeypatch):
    """ChaCha20's reference is a cipher per key: a large batch waits for the warm-up's load and
    gets the loop; a small one still takes the reference at once."""
    assert kernels.CHACHA.wait_for_load and not kernels.SKETCH.wait_for_load and not kernels.SHA256.wait_for_load
    kernel, warm, release = _loading(monkeypatch, "dpsketch_test_waited_kernel", wait_for_load=True)
    assert kernel.for_rows(kernels.MIN_ROWS - 1) is None  # small: the reference, now
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(kernel.for_rows(kernels.MIN_ROWS)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not got  # waiting for the load
    release.set()
    waiter.join(30)
    warm.join(30)
    assert got == ["loop"]


@pytest.mark.parametrize("outcome", ["none", "raises"])
def test_a_loop_that_cannot_be_had_is_never_used(monkeypatch, outcome):
    calls = []

    def load():
        calls.append(1)
        if outcome == "raises":
            raise ImportError("no numba here")
        return None

    kernel = _fake_module(monkeypatch, f"dpsketch_test_{outcome}_kernel", load)
    assert kernel.for_rows(kernels.MIN_ROWS) is None and kernel.state == "unavailable"
    assert kernel.warm_up() is False and kernel.for_rows(10**6) is None and calls == [1]  # tried once
    with pytest.raises(RuntimeError, match="not available"):
        kernel.require()


@pytest.mark.parametrize("missing", ["numba", "scipy"])
def test_no_numba_is_quiet_anything_else_warns(monkeypatch, caplog, missing):
    """A client's install has no numba on purpose (docs/install.md): the reference serves and
    the log says so at INFO, without a traceback. Any other failure to load still warns."""
    def load():
        raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    kernel = _fake_module(monkeypatch, f"dpsketch_test_no_{missing}_kernel", load)
    with caplog.at_level("INFO", logger="dpsketch"):
        assert kernel.warm_up() is False and kernel.state == "unavailable"
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    if missing == "numba":
        assert not warned and any("numba is not installed" in r.getMessage() for r in caplog.records)
    else:
        assert warned and any(r.exc_info for r in warned)


def test_a_chacha_loop_that_disagrees_with_rfc_8439_is_not_used(monkeypatch):
    """The probe catches a wrong loop (here: the expected block altered), and seed expansion then
    gives cryptography's keystream, which is RFC 8439's."""
    monkeypatch.setattr(_chacha_kernel, "_RFC_BLOCK", bytes(64))
    monkeypatch.setattr(kernels, "CHACHA", kernels.Kernel("._chacha_kernel", "seed expansion"))
    assert chacha.warm_up() is False and kernels.CHACHA.state == "unavailable"
    keys = np.random.default_rng(5).integers(0, 256, size=(kernels.MIN_ROWS, 32), dtype=np.uint8)
    got = chacha.keystream(keys, ring.SEED_NONCE, 80)
    assert np.array_equal(got, chacha.keystream(keys, ring.SEED_NONCE, 80, compiled=False))
    with pytest.raises(RuntimeError):
        chacha.keystream(keys[:2], ring.SEED_NONCE, 80, compiled=True)


def test_every_real_loop_passes_its_probe():
    for kernel in (kernels.SKETCH, kernels.SHA256, kernels.CHACHA):
        assert kernel.warm_up(), f"{kernel.module} should load on this machine"


def test_a_sketch_loop_that_disagrees_with_hashlib_is_not_used(monkeypatch):
    """A BLAKE2b loop giving other bits (here: one IV word altered) fails its probe, and the
    sketch hash then comes from hashlib: the same rows and signs as the reference form."""
    from dpsketch.protocol import _sketch_kernel, sketch

    iv = _sketch_kernel.IV.copy()
    iv[0] ^= np.uint64(1)
    monkeypatch.setattr(_sketch_kernel, "IV", iv)
    monkeypatch.setattr(kernels, "SKETCH", kernels.Kernel("._sketch_kernel", "the sketch hash", warm_rows=32))
    assert sketch.warm_up() is False and kernels.SKETCH.state == "unavailable"
    seed = bytes(range(32))
    ids = [bytes([i % 256, i // 256]) * 8 for i in range(kernels.MIN_ROWS)]
    rows, signs = sketch.hash_report_ids(seed, ids, 40, 4)
    for i in (0, 1234, kernels.MIN_ROWS - 1):
        for block in range(4):
            bucket, sign = sketch.bucket_and_sign(seed, ids[i], 40, 4, block)
            assert rows[i, block] == block * 10 + bucket and signs[i, block] == sign


def _pointer_sources(path) -> list[tuple[str, int, str]]:
    """(function, line, name) for every ``X.ctypes.data`` in a compiled loop's module whose X is
    not an argument of the function that takes it (nor an element or slice of one)."""
    import ast

    tree = ast.parse(path.read_text())
    found = []
    for fn in (node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)):
        arguments = {a.arg for a in fn.args.args}
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and node.attr == "data" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "ctypes":
                base = node.value.value
                while isinstance(base, ast.Subscript):
                    base = base.value
                name = base.id if isinstance(base, ast.Name) else ast.unparse(base)
                if name not in arguments:
                    found.append((fn.name, node.lineno, name))
    return found


def test_compiled_loops_take_pointers_only_into_memory_their_caller_owns():
    """numba frees an array after its last use by name, and ``a.ctypes.data`` is such a use: a
    loop that allocates its scratch memory and passes its address to C (OpenSSL's SHA256_Init)
    has C write into freed heap memory, which corrupted a share server's heap under load
    (``free(): corrupted unsorted chunks``). So every pointer a loop takes is into an argument."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    modules = sorted(root.glob("dpsketch/protocol/_*_kernel.py")) + sorted(root.glob("services/_*_kernel.py"))
    assert len(modules) >= 4
    assert {m.name: _pointer_sources(m) for m in modules} == {m.name: [] for m in modules}


def test_numba_frees_an_array_after_the_last_use_of_its_name():
    """The fact the rule above rests on, checked on this numba: an array whose only later use is
    through a pointer is freed before the loop that writes through it, so a second array of
    the same size can take its memory."""
    import numba

    @numba.njit
    def same_memory(n):
        first = np.empty(256, np.uint8)
        pointer = first.ctypes.data
        reused = 0
        for _ in range(n):
            second = np.empty(256, np.uint8)
            reused += second.ctypes.data == pointer
        return reused

    assert same_memory(64) > 0


def test_a_read_only_shipped_cache_is_copied_not_recompiled(tmp_path):
    """The image ships its compiled loops in NUMBA_CACHE_DIR; a pod with a read-only root
    filesystem (deploy/k8s) cannot write there, and numba uses no cache it cannot write to. The
    loops then come from a private copy in the temporary directory (loaded, none compiled), and
    the copy is gone when the process exits. Here the shipped cache is a real read-only bind
    mount, in a mount namespace of the test's own."""
    import os
    import shutil
    import subprocess

    from envguard import unavailable

    if shutil.which("unshare") is None:
        unavailable("a read-only bind mount needs unshare")
    shipped, tmp, home = tmp_path / "shipped", tmp_path / "tmp", tmp_path / "home"
    for d in (shipped, tmp, home):
        d.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(shipped), "HOME": str(home), "TMPDIR": str(tmp)}
    build = subprocess.run([sys.executable, "-c", "from dpsketch.protocol import binding; assert binding.warm_up()"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    files = sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file())
    assert any(str(p).endswith(".nbc") for p in files), files

    code = ("import os\nfrom dpsketch.protocol import binding, kernels\n"
            "assert not kernels._writable(os.environ['NUMBA_CACHE_DIR']), 'the mount is writable'\n"
            "print('ready', binding.warm_up())\n")
    mount = f'mount --bind "{shipped}" "{shipped}" && mount -o remount,ro,bind "{shipped}" "{shipped}" && exec "$@"'
    unshare = ["unshare", "-m", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["-r"])
    run = subprocess.run([*unshare, "sh", "-c", mount, "sh", sys.executable, "-c", code],
                         env={**env, "NUMBA_DEBUG_CACHE": "1"}, capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and "mount" in run.stderr and "ready" not in run.stdout:
        unavailable(f"cannot make a read-only bind mount here: {run.stderr[-500:]}")
    assert run.returncode == 0 and "ready True" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    loaded = [line for line in run.stdout.splitlines() if line.startswith("[cache] data loaded from")]
    assert loaded and all(f"'{tmp}/dpsketch-numba-" in line for line in loaded), run.stdout[-2000:]
    assert "saved to" not in run.stdout, run.stdout[-2000:]
    assert list(tmp.iterdir()) == []  # the copy went with the process
    assert sorted(p.relative_to(shipped) for p in shipped.rglob("*") if p.is_file()) == files


def test_a_shipped_cache_that_cannot_be_copied_leaves_nothing_behind(tmp_path, monkeypatch, caplog):
    """A copy that fails part way (a full temporary directory) is removed, numba keeps the
    shipped directory (its loops are then compiled in memory) and the log says why."""
    import shutil
    import tempfile

    import numba

    shipped, tmp = tmp_path / "shipped", tmp_path / "tmp"
    (shipped / "protocol_x").mkdir(parents=True)
    (shipped / "protocol_x" / "loop.nbi").write_bytes(b"index")
    tmp.mkdir()
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(shipped))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(kernels, "_writable", lambda path: False)  # as on a read-only mount

    def copy_then_fail(src, dst, **kwargs):
        (tmp / dst).joinpath("loop.nbi").write_bytes(b"in")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copytree", copy_then_fail)
    kernels._copy_a_read_only_cache.__wrapped__()
    assert numba.config.CACHE_DIR == str(shipped)
    assert list(tmp.iterdir()) == []
    assert "could not be copied" in caplog.text


def test_a_shipped_cache_built_on_another_cpu_gives_its_generic_loops(tmp_path):
    """numba keys a cached loop on the CPU it was compiled for. The image ships every loop twice
    (for its build machine's CPU and for a generic one) and names the build CPU beside them; a
    process on another CPU loads the generic loops (none compiled), and one on the build CPU
    keeps the faster ones. Here the cache holds the binding's SHA-256 loops for a generic CPU
    and claims to come from a CPU this machine is not."""
    import json
    import os
    import subprocess

    shipped, home = tmp_path / "shipped", tmp_path / "home"
    shipped.mkdir()
    home.mkdir()
    env = {**os.environ, "NUMBA_CACHE_DIR": str(shipped), "HOME": str(home)}
    env.pop("NUMBA_CPU_NAME", None)
    env.pop("NUMBA_CPU_FEATURES", None)
    build = subprocess.run([sys.executable, "-c", "from dpsketch.protocol import binding; assert binding.warm_up()"],
                           env={**env, "NUMBA_CPU_NAME": "generic"}, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    marker = shipped / kernels.BUILD_CPU_FILE
    marker.write_text(json.dumps({"name": "some-other-cpu", "features": "+sse2"}))

    code = ("import logging\nlogging.basicConfig(level=logging.INFO)\nimport numba\n"
            "from dpsketch.protocol import binding\n"
            "print('ready', binding.warm_up(), numba.config.CPU_NAME)\n")
    run = subprocess.run([sys.executable, "-c", code], env={**env, "NUMBA_DEBUG_CACHE": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ready True generic" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert "[cache] data loaded from" in run.stdout and "saved to" not in run.stdout, run.stdout[-2000:]
    assert "built for a some-other-cpu CPU" in run.stderr

    # on the CPU the cache names (the build machine), the loops for that CPU are kept
    marker.write_text(json.dumps(kernels._this_cpu()))
    same = subprocess.run([sys.executable, "-c", "import numba\nfrom dpsketch.protocol import kernels\n"
                           "kernels._prepare_numba()\nprint(numba.config.CPU_NAME)"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert same.returncode == 0 and same.stdout.split() == ["None"], same.stdout + same.stderr[-2000:]
