#!/usr/bin/env bash
# Write the files deploy/stack.yml turns into Docker Swarm secrets, so that no token or password
# is in a service's environment or command line (both are readable by anyone who can
# `docker service inspect` or `docker inspect` a task): the servers read their tokens with
# --operator-token-file/--analyst-token-file, the analyzer its cluster JSON with --config, the
# s1 replicas the database password through libpq's PGPASSFILE and PostgreSQL through
# POSTGRES_PASSWORD_FILE.
#
#   set -a; . ./.env; set +a           # the tokens (deploy/make-tokens.sh)
#   deploy/make-secrets.sh [--force] [DIR]   # DIR defaults to deploy/secrets (git-ignored)
#
# The tokens come from S1_OPERATOR_TOKEN ... S3_ANALYST_TOKEN and ANALYZER_API_TOKEN in the
# environment; the database password from S1_DB_PASSWORD, or a fresh random one. Files are
# mode 0600 in a 0700 directory. Refuses to overwrite an existing DIR unless --force is given
# (a new database password does not change the one an existing s1-db volume was made with).
set -euo pipefail
force=0
if [[ "${1:-}" == "--force" ]]; then force=1; shift; fi
out="${1:-$(cd "$(dirname "$0")" && pwd)/secrets}"
if [[ -e "$out" && $force == 0 ]]; then
    echo "make-secrets: $out exists; use --force to replace its files" >&2
    exit 1
fi
missing=()
for name in S1_OPERATOR_TOKEN S1_ANALYST_TOKEN S2_OPERATOR_TOKEN S2_ANALYST_TOKEN \
            S3_OPERATOR_TOKEN S3_ANALYST_TOKEN ANALYZER_API_TOKEN; do
    [[ -n "${!name:-}" ]] || missing+=("$name")
done
if (( ${#missing[@]} )); then
    echo "make-secrets: not set: ${missing[*]} (run deploy/make-tokens.sh, then set -a; . ./.env; set +a)" >&2
    exit 1
fi
# tokens are put into JSON and a pgpass line as they are: refuse anything that would need quoting
for name in S1_OPERATOR_TOKEN S1_ANALYST_TOKEN S2_OPERATOR_TOKEN S2_ANALYST_TOKEN \
            S3_OPERATOR_TOKEN S3_ANALYST_TOKEN ANALYZER_API_TOKEN S1_DB_PASSWORD; do
    value="${!name:-}"
    if [[ -n "$value" && ! "$value" =~ ^[A-Za-z0-9._~+/=-]+$ ]]; then
        echo "make-secrets: $name holds characters other than letters, digits and ._~+/=-" >&2
        exit 1
    fi
done
password="${S1_DB_PASSWORD:-$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')}"
umask 077
mkdir -p "$out"
chmod 700 "$out"
write() { printf '%s' "$2" >"$out/$1"; }
for s in 1 2 3; do
    operator="S${s}_OPERATOR_TOKEN"; analyst="S${s}_ANALYST_TOKEN"
    write "s${s}_operator_token" "${!operator}"
    write "s${s}_analyst_token" "${!analyst}"
done
write analyzer_cluster.json "{\"servers\": [
  {\"server_id\": \"s1\", \"url\": \"https://s1:8101\", \"analyst_token\": \"$S1_ANALYST_TOKEN\"},
  {\"server_id\": \"s2\", \"url\": \"https://s2:8101\", \"analyst_token\": \"$S2_ANALYST_TOKEN\"},
  {\"server_id\": \"s3\", \"url\": \"https://s3:8101\", \"analyst_token\": \"$S3_ANALYST_TOKEN\"}],
 \"api_token\": \"$ANALYZER_API_TOKEN\", \"ca_file\": \"/run/secrets/ca_pem\"}
"
write s1_db_password "$password"
# libpq's password file: host:port:database:user:password (deploy/stack.yml's --db URL)
write s1_pgpass "s1-db:5432:dpsketch:postgres:$password
"
echo "make-secrets: wrote $out" >&2
