#!/usr/bin/env bash
# Make Debian's headless-capable Chromium and its WebDriver available, for the console's browser
# tests (tests/test_console.py) and for taking the screenshots in docs/console/:
#
#   scripts/ensure-chromium.sh      # prints two lines: the chromium path, then the chromedriver path
#
# Idempotent: binaries already on the PATH (or at $DPSKETCH_CHROMIUM / $DPSKETCH_CHROMEDRIVER) are
# left alone. Otherwise installs Debian's `chromium` and `chromium-driver` with apt-get (needs
# root; scripts/ensure-debian-binary.sh). The driver is always the distribution's, built for the
# same Chromium version: nothing is downloaded from anywhere else.
set -euo pipefail
here="$(dirname "$0")"
chromium="$(bash "$here/ensure-debian-binary.sh" chromium chromium DPSKETCH_CHROMIUM)"
driver="$(bash "$here/ensure-debian-binary.sh" chromedriver chromium-driver DPSKETCH_CHROMEDRIVER)"
echo "$chromium"
echo "$driver"
