#!/bin/sh
# First start: initdb into $PGDATA with a password (scram-sha-256 for every network client), then
# create $POSTGRES_DB. Every start: run postgres in the foreground with fsync on.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
password="${POSTGRES_PASSWORD:-}"
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then password=$(cat "$POSTGRES_PASSWORD_FILE"); fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    [ -n "$password" ] || { echo "set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE" >&2; exit 1; }
    pwfile=$(mktemp)
    printf '%s\n' "$password" > "$pwfile"
    "$bin/initdb" -D "$PGDATA" -U postgres --pwfile="$pwfile" --auth-local=trust \
        --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all 0.0.0.0/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
    "$bin/pg_ctl" -D "$PGDATA" -w -o "-c listen_addresses=''" start >/dev/null
    "$bin/psql" -q -U postgres -c "CREATE DATABASE \"$POSTGRES_DB\""
    "$bin/pg_ctl" -D "$PGDATA" -w -m fast stop >/dev/null
fi
exec "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' -c fsync=on -c synchronous_commit=on
