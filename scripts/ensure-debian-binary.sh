#!/usr/bin/env bash
# Make a binary from a Debian package available (shared by ensure-prometheus.sh and
# ensure-haproxy.sh):
#
#   scripts/ensure-debian-binary.sh BINARY PACKAGE [OVERRIDE_VAR]
#
# Idempotent: a machine with BINARY on its PATH (or in /usr/sbin, or at $OVERRIDE_VAR) is left
# alone. Otherwise installs PACKAGE with apt-get (needs root), with a policy-rc.d that keeps the
# package's postinst from starting a system-wide service: it only installs, and the callers run
# their own process with their own config and port. Prints the binary's path on stdout.
set -euo pipefail

binary="$1"; package="$2"; override="${3:-}"
say() { echo "ensure-$binary: $*" >&2; }
die() { say "$*"; exit 1; }

found() {
    if [[ -n "$override" && -n "${!override:-}" && -x "${!override}" ]]; then
        echo "${!override}"
    else
        command -v "$binary" || { [[ -x "/usr/sbin/$binary" ]] && echo "/usr/sbin/$binary"; } || true
    fi
}

bin="$(found)"
if [[ -n "$bin" ]]; then
    echo "$bin"
    exit 0
fi
[[ "$(id -u)" == 0 ]] || die "no $binary binary, and not root: cannot install Debian's $package"
command -v apt-get >/dev/null || die "no $binary binary and no apt-get to install Debian's $package"
say "installing Debian's $package (apt-get)"
export DEBIAN_FRONTEND=noninteractive
cleanup_policy=0
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    cleanup_policy=1
fi
trap '[[ $cleanup_policy == 1 ]] && rm -f /usr/sbin/policy-rc.d' EXIT
"$(dirname "$0")/apt-locked.sh" update -qq >&2 || say "apt-get update failed; trying the install with the lists at hand"
"$(dirname "$0")/apt-locked.sh" install -y -qq --no-install-recommends "$package" >&2
bin="$(found)"
[[ -n "$bin" ]] || die "apt-get installed $package but no $binary binary is found"
echo "$bin"
