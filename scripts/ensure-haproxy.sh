#!/usr/bin/env bash
# Make an haproxy binary available on this machine (for tests/test_replicas.py, and for operators
# trying the replicated layout of docs/operations.md on one host).
#
#   scripts/ensure-haproxy.sh        # install Debian's `haproxy` if no binary is found
#
# Idempotent: a machine with `haproxy` on its PATH (or at $DPSKETCH_HAPROXY) is left alone. Needs
# root and apt-get for the install. It only installs: it starts no service (the test runs its own
# haproxy process with its own config and port, and stops it). Prints the binary's path on stdout.
set -euo pipefail

say() { echo "ensure-haproxy: $*" >&2; }
die() { say "$*"; exit 1; }

found() {
    if [[ -n "${DPSKETCH_HAPROXY:-}" && -x "${DPSKETCH_HAPROXY}" ]]; then
        echo "$DPSKETCH_HAPROXY"
    else
        command -v haproxy || { [[ -x /usr/sbin/haproxy ]] && echo /usr/sbin/haproxy; } || true
    fi
}

bin="$(found)"
if [[ -n "$bin" ]]; then
    echo "$bin"
    exit 0
fi
[[ "$(id -u)" == 0 ]] || die "no haproxy binary, and not root: cannot install Debian's haproxy"
command -v apt-get >/dev/null || die "no haproxy binary and no apt-get to install Debian's haproxy"
say "installing Debian's haproxy (apt-get)"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d 101: the package's postinst must not start a system-wide haproxy on port 80
cleanup_policy=0
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    cleanup_policy=1
fi
trap '[[ $cleanup_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d' EXIT
apt-get update -qq >&2 || say "apt-get update failed; trying the install with the lists at hand"
apt-get install -y -qq --no-install-recommends haproxy >&2
bin="$(found)"
[[ -n "$bin" ]] || die "apt-get installed haproxy but no binary is found"
echo "$bin"
