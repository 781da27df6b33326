#!/usr/bin/env bash
# Create ./.venv and install dpsketch with its test extras (everything the test suite needs: the
# server, analyzer and research roles, the test tools). Needs only python3 >= 3.11 with venv;
# every Python dependency comes from pyproject.toml. DPSKETCH_EXTRAS picks other extras
# (scripts/demo.sh: server,analyzer; docs/install.md lists them and their sizes).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "dpsketch needs Python 3.11 or newer (found: $("$PYTHON" --version 2>&1))" >&2
  exit 1
fi
if ! "$PYTHON" -m venv --help >/dev/null 2>&1; then
  echo "python3 venv module missing; on Debian/Ubuntu: apt-get install python3-venv" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
EXTRAS=${DPSKETCH_EXTRAS:-test}
.venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"
# Compile the repository's own modules to bytecode. pip compiles what it installs, but this is an
# editable install, and a machine with PYTHONDONTWRITEBYTECODE set (this one, CI) otherwise
# compiles about 45 modules from source in every server, analyzer and CLI process it starts:
# about 0.13 s of CPU each (a share server's start went from 1.3-1.45 to 1.2-1.35 s of CPU).
# compileall writes the caches whatever that variable says; a stale one is simply not used.
# (the parts' folders by name: compileall does not follow dpsketch/'s links to them)
.venv/bin/python -m compileall -q -j 0 dpsketch services analyzer client_sdk tools
# Compile numba's loops (sketch hash, running totals, ChaCha20, the binding's SHA-256, the report
# index's merges, and the validity proofs' field arithmetic) once into their on-disk cache, about
# 45 s: the servers, clients and tests started afterwards load them in about a second instead of
# each compiling them at the same time. Not fatal: without numba's cache the processes compile or
# fall back as they would anyway.
.venv/bin/python -c "import sys; from dpsketch.services.store import warm_install; sys.exit(not warm_install())" \
  || echo "install: could not compile numba's loops ahead (each process will compile them)" >&2
# The privacy loss distributions of design()'s default targets into the PLD cache
# ($DPSKETCH_PLD_CACHE, default ~/.cache/dpsketch/pld): a server's first token of such a study then
# builds nothing (5-9 s of CPU otherwise; docs/ledger.md). Not fatal either.
.venv/bin/python -c "import sys; from dpsketch.services.store import warm_charges; sys.exit(not warm_charges())" \
  || echo "install: could not build the default studies' PLDs ahead (a server builds them at their first token)" >&2
# The TypeScript client (clients/typescript): its npm dependencies, pinned by its package-lock.json,
# for tests/test_ts_client.py (node --test and the interop test). Needs Node 20+ and npm; skipped
# with a note when they are missing (that test then fails, saying so). `npm ci` runs only when
# the lock file is newer than what node_modules was installed from.
if command -v npm >/dev/null 2>&1; then
  ts=clients/typescript
  if [ ! -f "$ts/node_modules/.package-lock.json" ] || [ "$ts/package-lock.json" -nt "$ts/node_modules/.package-lock.json" ]; then
    (cd "$ts" && npm ci --no-audit --no-fund --loglevel=error) \
      || echo "install: npm ci in $ts failed (the TypeScript client's tests will fail)" >&2
  fi
else
  echo "install: npm not found; the TypeScript client's tests (tests/test_ts_client.py) need Node 20+" >&2
fi
# The commands are in .venv/bin, which is not on PATH: say how to put it there (README, Quickstart).
cat >&2 <<HINT
install: done. The dpsketch command is $PWD/.venv/bin/dpsketch; to run it as plain \`dpsketch\`,
  source .venv/bin/activate            (this shell; \`deactivate\` undoes it)
or
  export PATH="$PWD/.venv/bin:\$PATH"
HINT
