#!/usr/bin/env bash
# Build dpsketch's container images, one per role, from deploy/Dockerfile, and say their sizes.
#
#   deploy/build-images.sh [ROLE ...]          # ROLE: server, analyzer, client (default: all three)
#   deploy/build-images.sh --replicated        # also deploy/stack.yml's PostgreSQL and haproxy images
#
# Each role's image is tagged dpsketch-ROLE:local (what docker-compose.yml, deploy/stack.yml and
# deploy/k8s use) and dpsketch-ROLE:VERSION, VERSION being dpsketch.__version__ (the one version
# of docs/install.md, "Versions and releases"). The base image is made present first
# (deploy/base-image.sh: pulled, or a local stand-in where no registry answers); an engine must be
# running (sudo deploy/ensure-docker.sh). Env: PYTHON_IMAGE (default python:3.11-slim).
set -euo pipefail
cd "$(dirname "$0")/.."

roles=()
replicated=0
for arg in "$@"; do
    case "$arg" in
        server|analyzer|client) roles+=("$arg") ;;
        --replicated) replicated=1 ;;
        -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-images: unknown argument $arg (roles: server analyzer client; --replicated)" >&2; exit 2 ;;
    esac
done
[[ ${#roles[@]} -gt 0 ]] || roles=(client analyzer server)

base="${PYTHON_IMAGE:-python:3.11-slim}"
version="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' dpsketch/__init__.py)"
[[ -n "$version" ]] || { echo "build-images: no __version__ in dpsketch/__init__.py" >&2; exit 1; }
# a Docker tag may not hold '+' (a local version label); PEP 440's other characters are allowed
tag_version="${version//+/-}"

bash deploy/base-image.sh "$base"
for role in "${roles[@]}"; do
    echo "build-images: dpsketch-$role:local ($version)" >&2
    docker build -q -f deploy/Dockerfile --target "$role" --build-arg "PYTHON_IMAGE=$base" \
        -t "dpsketch-$role:local" -t "dpsketch-$role:$tag_version" . >/dev/null
done
if [[ $replicated == 1 ]]; then
    docker build -q -t dpsketch-postgres:local -f deploy/replicated/postgres.Dockerfile deploy/replicated >/dev/null
    docker build -q -t dpsketch-lb:local -f deploy/replicated/lb.Dockerfile deploy/replicated >/dev/null
fi

# Sizes as the engine counts them (uncompressed, base image included), in MB of 10^6 bytes.
for role in "${roles[@]}"; do
    bytes="$(docker image inspect -f '{{.Size}}' "dpsketch-$role:local")"
    printf 'dpsketch-%-9s %5d MB\n' "$role" $(( (bytes + 500000) / 1000000 ))
done
printf '%-18s %5d MB (base image)\n' "$base" $(( ($(docker image inspect -f '{{.Size}}' "$base") + 500000) / 1000000 ))
