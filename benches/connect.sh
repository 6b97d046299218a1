#!/usr/bin/env bash
# The cost of a login: pgbench -C -S (a new connection per transaction)
# through usher with hooks switched off, usher with one trivial
# client_connection + session_start hook, and PgBouncer (Debian's package,
# installed when missing), in one run: interleaved rounds, medians of
# connections per second and of each pooler's CPU per login (user + system
# from /proc/PID/stat over the connections pgbench made; each login also
# runs one SELECT). Every pooler checks the same SCRAM verifier and runs
# in transaction mode with the same pool size.
#
#   benches/connect.sh            # 3 rounds of 10 s each per variant
#   ROUNDS=5 DURATION=20 benches/connect.sh
#   USHER_BIN=/tmp/usher-old benches/connect.sh   # another usher build
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed
DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
CLIENTS=${CLIENTS:-8}
. benches/lib.sh

write_trivial_hook "$work/trivial"
export PGPASSWORD=bench-pw
pgbench -i -q -s 1 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
OFF_PORT=$(free_port)
ON_PORT=$(free_port)
PGB_PORT=$(free_port)
secret=$(scram_verifier bench)
USHER_BIN=${USHER_BIN:-target/release/usher}
USHER_SECRET=$secret start_usher off "$OFF_PORT" "hooks: { enabled: false, dir: $work/trivial }" "$USHER_BIN"
OFF_PID=$USHER_PID
USHER_SECRET=$secret start_usher on "$ON_PORT" "hooks: { dir: $work/trivial }" "$USHER_BIN"
ON_PID=$USHER_PID
start_pgbouncer "$PGB_PORT"

echo
echo "pgbench -C -S, $CLIENTS clients, ${DURATION}s x $ROUNDS interleaved rounds per variant, medians; machine: $(nproc) cores"
: >"$work/off"; : >"$work/on"; : >"$work/pgb"
for r in $(seq "$ROUNDS"); do
  case $((r % 3)) in
    1) order="off on pgb" ;; 2) order="on pgb off" ;; *) order="pgb off on" ;;
  esac
  for who in $order; do
    case $who in
      off) run "$OFF_PORT" "$OFF_PID" simple "$CLIENTS" -C >>"$work/off" ;;
      on) run "$ON_PORT" "$ON_PID" simple "$CLIENTS" -C >>"$work/on" ;;
      pgb) run "$PGB_PORT" "$PGB_PID" simple "$CLIENTS" -C >>"$work/pgb" ;;
    esac
  done
done
printf '| %-22s | %13s | %14s |\n' variant "connections/s" "CPU per login"
printf '|------------------------|---------------|----------------|\n'
for who in off on pgb; do
  case $who in off) name="usher, hooks off" ;; on) name="usher, trivial hook" ;; pgb) name="PgBouncer" ;; esac
  t=$(cut -d' ' -f1 "$work/$who" | median); c=$(cut -d' ' -f2 "$work/$who" | median)
  printf '| %-22s | %13s | %11s µs |\n' "$name" "$t" "$c"
  eval "${who}_t=$t; ${who}_c=$c"
done
awk -v a="$off_c" -v b="$on_c" -v p="$pgb_c" 'BEGIN {
  printf "trivial hook / hooks off CPU per login: %.3f; usher (hooks off) / PgBouncer: %.2f\n", b / a, a / p
}'
