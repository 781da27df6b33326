#!/usr/bin/env bash
# Install what the demo runs (the share server and analyzer roles, not the test tools), then run
# the end-to-end demo on a local cluster of real processes.
# Extra arguments go to `dpsketch demo` (see `dpsketch demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
DPSKETCH_EXTRAS=server,analyzer bash scripts/install.sh
status=0
.venv/bin/dpsketch demo "$@" || status=$?
# the install's hint has scrolled away by now: repeat how to get `dpsketch` on PATH
echo "dpsketch is in $PWD/.venv/bin: \`source .venv/bin/activate\` (or export PATH=\"$PWD/.venv/bin:\$PATH\") to run it as plain \`dpsketch\`" >&2
exit "$status"
