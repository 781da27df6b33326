#!/usr/bin/env bash
# Make a Prometheus server binary available on this machine (tests/test_metrics.py, and operators
# trying docs/operations.md's scrape config): Debian's `prometheus`, installed if missing (root
# and apt-get), never started as a service (the test runs its own prometheus process with its own
# config, storage directory and port). $DPSKETCH_PROMETHEUS names a binary to use instead. Prints
# the binary's path.
exec bash "$(dirname "$0")/ensure-debian-binary.sh" prometheus prometheus DPSKETCH_PROMETHEUS
