#!/usr/bin/env bash
# Write an .env file with fresh random tokens for s1..s3 (operator and analyst) and the
# analyzer's API token, which docker compose reads from the project directory (compose refuses
# to start without them). Refuses to overwrite an existing file unless --force is given.
#
#   deploy/make-tokens.sh [--force] [FILE]     # FILE defaults to .env at the repository root
set -euo pipefail
force=0
if [[ "${1:-}" == "--force" ]]; then force=1; shift; fi
out="${1:-$(cd "$(dirname "$0")/.." && pwd)/.env}"
if [[ -e "$out" && $force == 0 ]]; then
    echo "make-tokens: $out exists; use --force to replace it" >&2
    exit 1
fi
token() { od -An -N24 -tx1 /dev/urandom | tr -d ' \n'; }
umask 077
{
    echo "# dpsketch compose tokens, generated $(date -u +%Y-%m-%dT%H:%M:%SZ). Keep this file secret."
    for s in S1 S2 S3; do
        echo "${s}_OPERATOR_TOKEN=$(token)"
        echo "${s}_ANALYST_TOKEN=$(token)"
    done
    echo "ANALYZER_API_TOKEN=$(token)"
} >"$out"
echo "make-tokens: wrote $out" >&2
