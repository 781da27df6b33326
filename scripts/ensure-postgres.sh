#!/usr/bin/env bash
# Make a throwaway PostgreSQL server available on this machine, for tests and local trials of the
# Postgres store (`dpsketch server --db postgresql://...`).
#
#   scripts/ensure-postgres.sh [DIR]          # install if missing, start a cluster in DIR, print its URL
#   scripts/ensure-postgres.sh --stop [DIR]   # stop the cluster in DIR (only one this script started)
#
# DIR defaults to $DPSKETCH_PG_DIR or /tmp/dpsketch-pg. Idempotent: a cluster already running in
# DIR is left alone and its URL printed again. The URL (with a random superuser password) is also
# written to DIR/url, mode 0600; the server listens on 127.0.0.1 only, on a free port.
#
# What it does when something is missing:
#   * the server binaries: Debian's `postgresql` package through apt-get (needs root);
#   * the cluster: initdb in DIR/data with scram-sha-256 password authentication, run as the
#     `postgres` user when this script runs as root (PostgreSQL refuses to run as root), else as
#     the calling user. fsync stays on: the tests prove durability, so the server must sync.
#   * $DPSKETCH_PG_OPTIONS: more server settings for a new start, appended to ours (e.g.
#     "-c shared_buffers=4GB -c max_wal_size=16GB", docs/operations.md's sizing for large studies).
set -euo pipefail

say() { echo "ensure-postgres: $*" >&2; }
die() { say "$*"; exit 1; }

STOP=0
if [[ "${1:-}" == "--stop" ]]; then STOP=1; shift; fi
DIR="${1:-${DPSKETCH_PG_DIR:-/tmp/dpsketch-pg}}"
DATA="$DIR/data"

find_bin() {  # the newest installed major version's bin directory (Debian keeps them apart)
    local d
    for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        [[ -x "$d/pg_ctl" && -x "$d/initdb" ]] && { echo "$d"; return 0; }
    done
    command -v pg_ctl >/dev/null 2>&1 && command -v initdb >/dev/null 2>&1 && { dirname "$(command -v pg_ctl)"; return 0; }
    return 1
}

as_owner() {  # run a PostgreSQL binary as the cluster's owner
    if [[ "$(id -u)" == 0 ]]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

if [[ $STOP == 1 ]]; then
    if [[ ! -f "$DIR/started-by-ensure-postgres" ]]; then
        say "no cluster started by this script in $DIR; leaving it alone"
        exit 0
    fi
    BIN="$(find_bin)" || die "no PostgreSQL binaries found"
    as_owner "$BIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null 2>&1 || true
    rm -rf "$DIR"
    exit 0
fi

# 1. The binaries.
if ! BIN="$(find_bin)"; then
    [[ "$(id -u)" == 0 ]] || die "PostgreSQL is not installed and we are not root: apt-get install postgresql"
    command -v apt-get >/dev/null 2>&1 || die "no apt-get: install PostgreSQL by hand"
    say "installing Debian's postgresql"
    export DEBIAN_FRONTEND=noninteractive
    "$(dirname "$0")/apt-locked.sh" update -qq >/dev/null
    # (the package may start Debian's own 'main' cluster on 5432; this script ignores it)
    "$(dirname "$0")/apt-locked.sh" install -y -qq --no-install-recommends postgresql >/dev/null
    BIN="$(find_bin)" || die "apt-get installed postgresql but no pg_ctl/initdb found"
fi

running() { [[ -f "$DATA/postmaster.pid" ]] && as_owner "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; }

# 2. Already running here: print its URL.
if [[ -f "$DIR/url" ]] && running; then
    cat "$DIR/url"
    exit 0
fi

# 3. A new cluster.
mkdir -p "$DIR"
chmod 0700 "$DIR"
if [[ "$(id -u)" == 0 ]]; then
    id postgres >/dev/null 2>&1 || die "no 'postgres' user to run the server as (the package creates it)"
    chown postgres: "$DIR"
fi
if [[ ! -f "$DATA/PG_VERSION" ]]; then
    password="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    printf '%s\n' "$password" > "$DIR/pwfile"
    [[ "$(id -u)" == 0 ]] && chown postgres: "$DIR/pwfile"
    chmod 0600 "$DIR/pwfile"
    as_owner "$BIN/initdb" -D "$DATA" -U postgres --auth=scram-sha-256 --pwfile="$DIR/pwfile" \
        --encoding=UTF8 --no-locale >"$DIR/initdb.log" 2>&1 || { cat "$DIR/initdb.log" >&2; die "initdb failed"; }
fi
password="$(cat "$DIR/pwfile")"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
as_owner "$BIN/pg_ctl" -D "$DATA" -l "$DIR/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$DIR -c max_connections=200 -c fsync=on -c synchronous_commit=on ${DPSKETCH_PG_OPTIONS:-}" \
    start >/dev/null || { tail -20 "$DIR/server.log" >&2 || true; die "pg_ctl start failed"; }
touch "$DIR/started-by-ensure-postgres"
url="postgresql://postgres:$password@127.0.0.1:$port/postgres"
(umask 077; printf '%s\n' "$url" > "$DIR/url")
echo "$url"
