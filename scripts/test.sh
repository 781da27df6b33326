#!/usr/bin/env bash
# Install, then run the test suite (real servers on loopback ports, real SQLite files).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
