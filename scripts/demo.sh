#!/usr/bin/env bash
# Install, then run the end-to-end demo on a local cluster of real processes.
# Extra arguments go to `dpsketch demo` (see `dpsketch demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/dpsketch demo "$@"
