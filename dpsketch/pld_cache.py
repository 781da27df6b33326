"""Built mixture PLDs kept on disk between processes (docs/ledger.md): the ledger's PLD store.

A signed study's privacy loss distribution takes 2-9 s of CPU to build (``ledger.RADIUS_STEP``
rounds every study of the same targets to the same radius, so there are few of them). The ledger
(dpsketch/protocol/ledger.py) does no I/O: it asks the store installed with
``ledger.keep_plds_in`` for a PLD before building it and hands it the ones it built. This module
is that store on disk, installed (:func:`install`) where the processes that charge studies start:
the share server (services/app.create_app, and services/store.warm_charges, which builds the
default targets' PLDs ahead for scripts/install.sh and deploy/Dockerfile), the analyzer
(analyzer/__main__.py) and the data owner's privacy limit (client_sdk/budget.py).

* The cache: $DPSKETCH_PLD_CACHE, else $XDG_CACHE_HOME/dpsketch/pld or ~/.cache/dpsketch/pld
  ("none": no disk cache). Read first, and written (atomically: a temporary file renamed).
* The shipped directory: $DPSKETCH_PLD_SHIPPED (the server image's, deploy/Dockerfile), read,
  never written, when the cache has no file of a radius.

Both are read from the environment at each use, so a process (or a test) that changes them is
followed. Any failure to read or write a file only costs a rebuild.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dpsketch.protocol import ledger


def cache_dir() -> Path | None:
    """Where built mixture PLDs are kept between processes: $DPSKETCH_PLD_CACHE, else
    $XDG_CACHE_HOME/dpsketch/pld or ~/.cache/dpsketch/pld ("none": no disk cache)."""
    given = os.environ.get("DPSKETCH_PLD_CACHE", "").strip()
    if given.lower() == "none":
        return None
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dpsketch" / "pld"


def shipped_dir() -> Path | None:
    """A directory of mixture PLDs built ahead, read (never written) when the cache has no file of
    a radius: $DPSKETCH_PLD_SHIPPED (the server image's, deploy/Dockerfile: those of design()'s
    default targets, services/store.warm_charges); None when unset."""
    given = os.environ.get("DPSKETCH_PLD_SHIPPED", "").strip()
    return Path(given) if given else None


class DiskPldStore:
    """``ledger.PldStore`` on disk: a .npz file per name in :func:`cache_dir`, else in
    :func:`shipped_dir`."""

    def load(self, name: str) -> tuple[np.ndarray, int, float] | None:
        where, shipped = cache_dir(), shipped_dir()
        for known in (where / name if where is not None else None, shipped / name if shipped is not None else None):
            if known is None:
                continue
            try:
                with np.load(known) as saved:
                    return saved["probs"], int(saved["lower"]), float(saved["infinity"])
            except (OSError, KeyError, ValueError):
                pass
        return None

    def save(self, name: str, probs: np.ndarray, lower: int, infinity: float) -> None:
        where = cache_dir()
        if where is None:
            return
        path = where / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as out:
                np.savez(out, probs=probs, lower=np.int64(lower), infinity=np.float64(infinity))
            os.replace(tmp, path)
        except OSError:
            pass


def install() -> None:
    """Keep this process's ledger PLDs on disk from now on, unless a store is installed already
    (an embedder's own, or this one: calling it again does nothing)."""
    if ledger.pld_store() is None:
        ledger.keep_plds_in(DiskPldStore())
