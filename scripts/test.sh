#!/usr/bin/env bash
# Install, then run the test suite (real servers on loopback ports, real SQLite files, and a real
# PostgreSQL server that tests/pg.py starts through scripts/ensure-postgres.sh, installing
# Debian's postgresql first when it is missing and we are root).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Heavy checks run in a bounded form unless asked for more (e.g. DPSKETCH_SOAK_SECONDS=600).
export DPSKETCH_SOAK_SECONDS=${DPSKETCH_SOAK_SECONDS:-6}
export DPSKETCH_LOAD_SECONDS=${DPSKETCH_LOAD_SECONDS:-6}
export DPSKETCH_FUZZ_EXAMPLES=${DPSKETCH_FUZZ_EXAMPLES:-15}
# Two workers (DPSKETCH_TEST_WORKERS; 0 runs in one process): most tests wait on server processes,
# so two files at a time take about 0.6 of the time on 2 cores; a file stays in one worker.
workers=${DPSKETCH_TEST_WORKERS:-2}
# the 25 slowest tests close every run's report: where the suite's 20-minute budget goes
if [ "$workers" -gt 0 ]; then
  exec .venv/bin/python -m pytest -n "$workers" --dist loadfile --durations=25 "$@"
fi
exec .venv/bin/python -m pytest --durations=25 "$@"
