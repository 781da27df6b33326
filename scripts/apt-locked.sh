#!/usr/bin/env bash
# apt-get, one at a time: every ensure-*.sh script installs its Debian package through this.
# Why: the test suite runs on two pytest workers, and two of them can start installing at once
# (PostgreSQL for one test, Docker for another): the second apt-get then stopped at once with
# "Could not get lock /var/lib/dpkg/lock-frontend" (exit 100), failing every test that needed it.
# Our own installs queue on one file lock (flock, util-linux); anyone else's apt (an unattended
# upgrade) is waited for by apt itself, up to 10 minutes (DPkg::Lock::Timeout, apt >= 1.9.11).
set -euo pipefail
if command -v flock >/dev/null 2>&1; then
  exec flock /var/lock/dpsketch-apt.lock apt-get -o DPkg::Lock::Timeout=600 "$@"
fi
exec apt-get -o DPkg::Lock::Timeout=600 "$@"
