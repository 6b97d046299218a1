#!/usr/bin/env bash
# The system calls each pooler makes per transaction, counted by
# `strace -c -f` (kernel time is most of a pooler's CPU per transaction,
# and callgrind does not see it): usher and PgBouncer in front of the same
# cluster, pgbench -S in transaction mode, CLIENTS clients, TXNS
# transactions each, strace attached only around the counted run (logins
# and the warm-up are not in it). Prints, for each pooler, the calls per
# transaction by name, and their sum. CONNECT=1: a login per transaction
# (pgbench -C, SCRAM), so the figures are per login.
#
#   benches/syscalls.sh
#   CLIENTS=100 TXNS=300 EXTRA_YAML="workers: 1" benches/syscalls.sh
#   CONNECT=1 CLIENTS=4 TXNS=500 benches/syscalls.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed
command -v strace >/dev/null || { echo "strace is missing (apt-get install strace)" >&2; exit 1; }
CLIENTS=${CLIENTS:-10}
TXNS=${TXNS:-2000}
MODE=${MODE:-simple}
CONNECT_FLAG=""
[ "${CONNECT:-0}" = 1 ] && CONNECT_FLAG=-C
ulimit -n "$(ulimit -Hn)"
. benches/lib.sh

export PGPASSWORD=bench-pw
pgbench -i -q -s 1 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
start_usher_and_pgbouncer "max_client_conn: 20000
${EXTRA_YAML:-}"

# count NAME PORT PID: pgbench's transactions under strace -c of PID.
count() {
  local out="$work/strace.$1" tracer
  pgbench -S -n -M "$MODE" -c "$CLIENTS" -j 2 -t 50 -h 127.0.0.1 -p "$2" -U bench bench >/dev/null 2>&1
  strace -c -f -q -o "$out" -p "$3" &
  tracer=$!
  sleep 1
  pgbench -S -n -M "$MODE" $CONNECT_FLAG -c "$CLIENTS" -j 2 -t "$TXNS" -h 127.0.0.1 -p "$2" -U bench bench >/dev/null 2>&1
  kill -INT "$tracer"; wait "$tracer" 2>/dev/null || true
  local txns=$((CLIENTS * TXNS))
  echo "## $1: calls per transaction ($txns transactions, $CLIENTS clients, $MODE${CONNECT_FLAG:+, a login each})"
  awk -v n="$txns" '
    $1 ~ /^[0-9.]+$/ && NF >= 5 && $NF != "total" { calls = $4; name = $NF; if (calls / n >= 0.01) printf "%-16s %6.2f\n", name, calls / n; total += calls }
    END { printf "%-16s %6.2f\n", "total", total / n }' "$out"
}

count usher "$USHER_PORT" "$U_PID"
count pgbouncer "$PGB_PORT" "$PGB_PID"
