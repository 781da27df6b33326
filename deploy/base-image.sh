#!/usr/bin/env bash
# Make sure the base image that deploy/Dockerfile builds FROM is present in the local engine.
#
#   deploy/base-image.sh [IMAGE]        # IMAGE defaults to python:3.11-slim
#
# 1. Already in the engine: nothing to do (so a stand-in built once is cached).
# 2. Pullable (a normal machine with internet): `docker pull` it.
# 3. Otherwise (no registry reachable, as on the project's machines): build a stand-in under the
#    same tag from Debian bookworm with debootstrap, which only needs the Debian apt mirror:
#    Python 3.11 with venv/pip, `python` on PATH, the host's CA bundle (so pip inside a build
#    trusts whatever TLS the host trusts). The Dockerfile then builds unchanged.
#
# Env: DEBIAN_MIRROR (default: the first http mirror in the host's apt sources, else
# http://deb.debian.org/debian), BASE_PULL_TIMEOUT (seconds, default 60).
set -euo pipefail

IMAGE="${1:-python:3.11-slim}"
SUITE="${DEBIAN_SUITE:-bookworm}"
say() { echo "base-image: $*" >&2; }
die() { say "$*"; exit 1; }

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    say "$IMAGE present"
    exit 0
fi

if timeout "${BASE_PULL_TIMEOUT:-60}" docker pull -q "$IMAGE" >/dev/null 2>&1; then
    say "pulled $IMAGE"
    exit 0
fi
say "cannot pull $IMAGE; building a local stand-in from Debian $SUITE"

[[ "$(id -u)" == 0 ]] || die "need root for debootstrap"
if ! command -v debootstrap >/dev/null 2>&1; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >/dev/null
fi

mirror="${DEBIAN_MIRROR:-}"
if [[ -z "$mirror" ]]; then
    mirror="$(grep -hE '^[[:space:]]*(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
        /etc/apt/sources.list.d/*.list 2>/dev/null | grep -oE 'https?://[^ ]+/debian/?( |$)' \
        | grep -v security | head -1 | tr -d ' ' || true)"
    mirror="${mirror:-http://deb.debian.org/debian}"
fi

root="$(mktemp -d /var/tmp/dpsketch-base.XXXXXX)"
cleanup() { rm -rf "$root"; }
trap cleanup EXIT

say "debootstrap $SUITE from $mirror"
debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates \
    "$SUITE" "$root" "$mirror" >"$root.log" 2>&1 || { tail -30 "$root.log" >&2; die "debootstrap failed"; }
rm -f "$root.log"

# The host's trust store (it may hold a site CA that its egress needs), and a real sources.list.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
echo "deb $mirror $SUITE main" >"$root/etc/apt/sources.list"
# Slim it down: apt lists, caches, docs, man pages, locales other than C.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
       "$root"/usr/share/locale/* "$root"/var/log/*.log
find "$root/usr/lib/python3.11" -name '__pycache__' -prune -exec rm -rf {} + 2>/dev/null || true

# Debian marks its Python "externally managed"; the official image does not, so neither does this.
rm -f "$root"/usr/lib/python3.11/EXTERNALLY-MANAGED

tar -C "$root" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' \
    --message "dpsketch stand-in for $IMAGE (debootstrap $SUITE)" \
    - "$IMAGE" >/dev/null
docker run --rm "$IMAGE" python -c 'import sys, venv, ssl; print("base-image:", sys.version.split()[0])' >&2
say "built stand-in $IMAGE"
