#!/usr/bin/env bash
# Runs all of usher's tests: unit tests, and integration tests against a
# throwaway PostgreSQL cluster that the test harness starts itself.
# Installs PostgreSQL first when it is missing (as root, with apt-get).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed
# Integration tests start clusters and subprocesses; four tests at a time
# in each test binary suits a 2-core machine.
cargo test --lib --bins --tests -- --test-threads="${USHER_TEST_THREADS:-4}"
# The criterion benchmarks, run once each as tests (they take no libtest flags).
cargo test --benches
# Fuzzing (docs/testing.md, "Fuzzing"): every parser's target for a short time each.
# USHER_FUZZ_SECONDS=0 skips it (e.g. locally); CI runs 20 s per target.
fuzz_seconds="${USHER_FUZZ_SECONDS:-20}"
if [ "$fuzz_seconds" != 0 ]; then
    scripts/fuzz.sh "$fuzz_seconds"
fi
