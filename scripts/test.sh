#!/usr/bin/env bash
# Install, then run the test suite (real servers on loopback ports, real SQLite files).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Heavy checks run in a bounded form unless asked for more (e.g. DPSKETCH_SOAK_SECONDS=600).
export DPSKETCH_SOAK_SECONDS=${DPSKETCH_SOAK_SECONDS:-10}
export DPSKETCH_LOAD_SECONDS=${DPSKETCH_LOAD_SECONDS:-10}
exec .venv/bin/python -m pytest "$@"
