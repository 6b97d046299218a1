#!/usr/bin/env bash
# The scale table of issue 28: usher with one worker thread and with two,
# beside PgBouncer (one thread by design), in one run: pgbench -S in
# transaction mode on pool_size POOL_SIZE, interleaved rounds, medians of
# tps and of each pooler's CPU per transaction (user + system from
# /proc/PID/stat over the transactions pgbench reports).
#
#   benches/workers.sh                         # 3 rounds of 8 s per point
#   ROUNDS=5 CLIENTS="10 1000" benches/workers.sh
#   W1_BIN=/tmp/usher-before W1_WORKERS=2 W2_WORKERS=2 benches/workers.sh
#                                   # two builds with 2 workers each (w1, w2)
#
# On a machine of N cores, pgbench and PostgreSQL share them with the
# pooler; what this measures is how much of a core each pooler needs per
# transaction (which bounds its throughput once it has cores of its own)
# and whether a second worker thread adds throughput or only cost.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed

DURATION=${DURATION:-8}
ROUNDS=${ROUNDS:-3}
POOL_SIZE=${POOL_SIZE:-20}
CLIENTS=${CLIENTS:-"10 100 1000"}
MODE=${MODE:-simple}
ulimit -n "$(ulimit -Hn)"
PG_MAX_CONNECTIONS=250
. benches/lib.sh

export PGPASSWORD=bench-pw
pgbench -i -q -s 10 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
# Two ushers: by default one build with workers 1 and 2; W1_BIN, W2_BIN,
# W1_WORKERS and W2_WORKERS compare two builds instead.
W1_BIN=${W1_BIN:-target/release/usher}; W2_BIN=${W2_BIN:-target/release/usher}
start_usher_and_pgbouncer "max_client_conn: 20000
workers: ${W1_WORKERS:-1}"
if [ "$W1_BIN" != target/release/usher ]; then
  kill "$U_PID"; wait "$U_PID" 2>/dev/null || true
  USHER_SECRET=$(scram_verifier bench) start_usher usher "$USHER_PORT" "hooks: { dir: $work/no-hooks }
max_client_conn: 20000
workers: ${W1_WORKERS:-1}" "$W1_BIN"
  U_PID=$USHER_PID
fi
W1_PORT=$USHER_PORT; W1_PID=$U_PID
W2_PORT=$(free_port)
USHER_SECRET=$(scram_verifier bench) start_usher usher2 "$W2_PORT" "hooks: { dir: $work/no-hooks }
max_client_conn: 20000
workers: ${W2_WORKERS:-2}" "$W2_BIN"
W2_PID=$USHER_PID
echo "w1: $W1_BIN, workers ${W1_WORKERS:-1}; w2: $W2_BIN, workers ${W2_WORKERS:-2}"

echo
echo "pgbench -S -M $MODE, ${DURATION}s x $ROUNDS interleaved rounds per point, medians; pool_size $POOL_SIZE, transaction mode"
echo "machine: $(nproc) cores, $(uname -sr), PostgreSQL $("$BIN/postgres" --version | awk '{print $3}'), $("$(pgbouncer_bin)" --version 2>/dev/null | head -1)"
echo
printf '| %7s | %9s | %9s | %9s | %7s | %7s | %7s | %9s | %9s |\n' \
  clients "tps w1" "tps w2" "tps pgb" "µs w1" "µs w2" "µs pgb" "w1/pgb tps" "w2/pgb tps"
printf '|---------|-----------|-----------|-----------|---------|---------|---------|------------|------------|\n'
for c in $CLIENTS; do
  : >"$work/1"; : >"$work/2"; : >"$work/p"
  for r in $(seq "$ROUNDS"); do
    case $((r % 3)) in
      1) order="1 2 p" ;; 2) order="2 p 1" ;; *) order="p 1 2" ;;
    esac
    for who in $order; do
      case $who in
        1) run "$W1_PORT" "$W1_PID" "$MODE" "$c" >>"$work/1" ;;
        2) run "$W2_PORT" "$W2_PID" "$MODE" "$c" >>"$work/2" ;;
        p) run "$PGB_PORT" "$PGB_PID" "$MODE" "$c" >>"$work/p" ;;
      esac
    done
  done
  t1=$(cut -d' ' -f1 "$work/1" | median); c1=$(cut -d' ' -f2 "$work/1" | median)
  t2=$(cut -d' ' -f1 "$work/2" | median); c2=$(cut -d' ' -f2 "$work/2" | median)
  tp=$(cut -d' ' -f1 "$work/p" | median); cp=$(cut -d' ' -f2 "$work/p" | median)
  awk -v c="$c" -v t1="$t1" -v t2="$t2" -v tp="$tp" -v c1="$c1" -v c2="$c2" -v cp="$cp" 'BEGIN {
    printf "| %7s | %9s | %9s | %9s | %7s | %7s | %7s | %10.2f | %10.2f |\n", c, t1, t2, tp, c1, c2, cp, t1 / tp, t2 / tp
  }'
done
