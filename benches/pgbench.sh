#!/usr/bin/env bash
# Side-by-side benchmark: pgbench -S against PostgreSQL directly and through
# usher in transaction mode, in one run, for the simple, extended and
# prepared query modes and 1, 10, 50 and 100 clients. Prints a table with
# usher's throughput as a ratio of direct.
#
#   benches/pgbench.sh            # 5 s per run (24 runs)
#   DURATION=10 benches/pgbench.sh
#
# Starts its own throwaway PostgreSQL and usher (release build) on free
# ports and stops them at the end. pgbench prepares statements synchronously
# in prepared mode, so that mode runs one pgbench thread per client (see
# tests/prepared.rs); the other modes use up to JOBS threads.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed

DURATION=${DURATION:-5}
JOBS=${JOBS:-2}
POOL_SIZE=${POOL_SIZE:-20}
CLIENTS=${CLIENTS:-"1 10 50 100"}
MODES=${MODES:-"simple extended prepared"}
. benches/lib.sh
USHER_PORT=$(free_port)
mkdir -p "$work/no-hooks"
start_usher usher "$USHER_PORT" "hooks: { dir: $work/no-hooks }"

export PGPASSWORD=bench-pw
pgbench -i -q -s 10 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1

tps() { # port mode clients
  local jobs=$JOBS
  [ "$2" = prepared ] && jobs=$3
  [ "$jobs" -gt "$3" ] && jobs=$3
  pgbench -S -n -M "$2" -c "$3" -j "$jobs" -T "$DURATION" -h 127.0.0.1 -p "$1" -U bench bench 2>/dev/null |
    awk '/^tps = / { printf "%.0f", $3 }'
}

echo
echo "pgbench -S, ${DURATION}s per run, scale 10, usher pool_size $POOL_SIZE (transaction mode)"
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr), PostgreSQL $("$BIN/postgres" --version | awk '{print $3}')"
echo
printf "| %-8s | %7s | %12s | %12s | %6s |\n" mode clients "direct tps" "usher tps" ratio
printf "|----------|---------|--------------|--------------|--------|\n"
for mode in $MODES; do
  for c in $CLIENTS; do
    d=$(tps "$PGPORT" "$mode" "$c")
    u=$(tps "$USHER_PORT" "$mode" "$c")
    ratio=$(awk -v u="${u:-0}" -v d="${d:-0}" 'BEGIN { if (d > 0) printf "%.2f", u / d; else print "n/a" }')
    printf "| %-8s | %7s | %12s | %12s | %6s |\n" "$mode" "$c" "${d:-fail}" "${u:-fail}" "$ratio"
  done
done
