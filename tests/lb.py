"""A real haproxy in front of replicas of one share server (tests/test_replicas.py), from
tools/loadbalancer.py. Debian's ``haproxy``, installed when missing by
scripts/ensure-haproxy.sh (root and apt-get); skipped with the reason otherwise, failed under CI.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dpsketch.tools import loadbalancer
from envguard import unavailable


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or os.path.exists("/usr/sbin/haproxy")
    if not found and os.geteuid() != 0:
        unavailable("no haproxy binary, and not root: cannot install Debian's haproxy")
    if not found and shutil.which("apt-get") is None:
        unavailable("no haproxy binary and no apt-get to install it")
    return loadbalancer.ensure_haproxy()


@contextmanager
def running_haproxy(port: int, backends: list[tuple[str, int]], workdir: Path) -> Iterator[str]:
    with loadbalancer.running_haproxy(haproxy_binary(), port, backends, workdir) as url:
        yield url
