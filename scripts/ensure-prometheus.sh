#!/usr/bin/env bash
# Make a Prometheus server binary available on this machine (for tests/test_metrics.py and for
# operators trying docs/operations.md's scrape config).
#
#   scripts/ensure-prometheus.sh        # install Debian's `prometheus` if no binary is found
#
# Idempotent: a machine with `prometheus` on its PATH (or at $DPSKETCH_PROMETHEUS) is left alone.
# Needs root and apt-get for the install. It only installs: it starts no service (the test runs
# its own prometheus process with its own config, storage directory and port, and stops it).
# Prints the path of the binary on stdout.
set -euo pipefail

say() { echo "ensure-prometheus: $*" >&2; }
die() { say "$*"; exit 1; }

found() {
    if [[ -n "${DPSKETCH_PROMETHEUS:-}" && -x "${DPSKETCH_PROMETHEUS}" ]]; then
        echo "$DPSKETCH_PROMETHEUS"
    else
        command -v prometheus || true
    fi
}

bin="$(found)"
if [[ -n "$bin" ]]; then
    echo "$bin"
    exit 0
fi
[[ "$(id -u)" == 0 ]] || die "no prometheus binary, and not root: cannot install Debian's prometheus"
command -v apt-get >/dev/null || die "no prometheus binary and no apt-get to install Debian's prometheus"
say "installing Debian's prometheus (apt-get)"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d 101: the package's postinst must not start a system-wide service on port 9090
cleanup_policy=0
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    cleanup_policy=1
fi
trap '[[ $cleanup_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d' EXIT
apt-get update -qq >&2 || say "apt-get update failed; trying the install with the lists at hand"
apt-get install -y -qq --no-install-recommends prometheus >&2
bin="$(found)"
[[ -n "$bin" ]] || die "apt-get installed prometheus but no binary is on the PATH"
echo "$bin"
