#!/usr/bin/env bash
# Make an haproxy binary available on this machine (tests/test_replicas.py, the replica benchmark
# in benchmarks/pg_store.py, and operators trying the replicated layout of docs/operations.md on
# one host): Debian's `haproxy`, installed if missing (root and apt-get), never started as a
# service. $DPSKETCH_HAPROXY names a binary to use instead. Prints the binary's path.
exec bash "$(dirname "$0")/ensure-debian-binary.sh" haproxy haproxy DPSKETCH_HAPROXY
