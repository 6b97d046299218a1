#!/usr/bin/env bash
# The user-space instructions usher spends per transaction, counted by
# callgrind (repeatable where CPU time on a shared machine is not): usher
# under valgrind --tool=callgrind in transaction mode, pgbench -S with
# CLIENTS clients on pool_size POOL_SIZE. Only a window of DURATION seconds
# after every client has logged in is counted, and the transactions in it
# are usher's own count (the console's SHOW STATS, read before and after),
# so logins and the warm-up are not in the figure. Prints instructions per
# transaction for each client count; keeps the callgrind files when
# KEEP=dir is given (callgrind_annotate them).
#
#   benches/txn_callgrind.sh
#   CLIENTS="10 1000" MODE=extended KEEP=/tmp/cg benches/txn_callgrind.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed
command -v valgrind >/dev/null || { echo "valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
DURATION=${DURATION:-20}
CLIENTS=${CLIENTS:-"10 1000"}
MODE=${MODE:-simple}
ulimit -n "$(ulimit -Hn)"
. benches/lib.sh
USHER_BIN=${USHER_BIN:-target/release/usher}

export PGPASSWORD=bench-pw
pgbench -i -q -s 10 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
mkdir -p "$work/no-hooks"

# console PORT SQL: a query on usher's admin console, unaligned.
console() { psql -X -At -h 127.0.0.1 -p "$1" -U bench pgbouncer -c "$2"; }
# xacts PORT: transactions usher has counted so far (SHOW STATS).
xacts() {
  console "$1" "SHOW STATS" | awk -F'|' '$1 == "bench" { print $3 }'
}

# measure CLIENTS: prints "transactions instructions" of the window.
measure() {
  local port pid bench x0 x1
  port=$(free_port)
  cat >"$work/u$1.yaml" <<YAML
listen: 127.0.0.1:$port
pool_mode: transaction
pool_size: ${POOL_SIZE:-20}
max_client_conn: 20000
databases:
  bench: { host: 127.0.0.1, port: $PGPORT }
users:
  bench: { password: 'bench-pw' }
admin: { users: [bench] }
hooks: { dir: $work/no-hooks }
log: { level: warn }
${EXTRA_YAML:-}
YAML
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/cg.$1" \
    "$USHER_BIN" --config "$work/u$1.yaml" 2>"$work/u$1.log" &
  pid=$!
  usher_pids="$usher_pids $pid"
  for _ in $(seq 600); do pg_isready -q -h 127.0.0.1 -p "$port" && break; sleep 0.1; done
  # Long enough for every login under valgrind, then the window.
  pgbench -S -n -M "$MODE" -c "$1" -j 2 -T $((DURATION + 30 + $1 / 10)) \
    -h 127.0.0.1 -p "$port" -U bench bench >"$work/pgbench.$1" 2>&1 &
  bench=$!
  # Every client logged in (the console's own connection is one more).
  for _ in $(seq 1200); do
    [ "$(console "$port" "SHOW CLIENTS" | wc -l)" -gt "$1" ] && break
    sleep 0.5
  done
  sleep 3
  # callgrind_control returns once callgrind has acted, so the count is
  # read after instrumentation is on and before the dump: reading it
  # outside that (as this did until stop 37) counted about a tenth more
  # transactions than were instrumented.
  callgrind_control -i on "$pid" >/dev/null 2>&1
  x0=$(xacts "$port")
  sleep "$DURATION"
  x1=$(xacts "$port")
  callgrind_control -d "$pid" >/dev/null 2>&1
  callgrind_control -i off "$pid" >/dev/null 2>&1
  kill "$bench" 2>/dev/null || true
  wait "$bench" 2>/dev/null || true
  kill "$pid"; wait "$pid" 2>/dev/null || true
  [ -n "${KEEP:-}" ] && mkdir -p "$KEEP" && cp "$work"/cg."$1"* "$KEEP/"
  echo "$((x1 - x0)) $(awk '/^totals:/ { print $2 }' "$work/cg.$1.1")"
}

echo "callgrind, pgbench -S -M $MODE, pool_size ${POOL_SIZE:-20}, ${DURATION}s window, $USHER_BIN"
printf '| %7s | %12s | %28s |\n' clients transactions "instructions per transaction"
printf '|---------|--------------|------------------------------|\n'
for c in $CLIENTS; do
  read -r n ir <<<"$(measure "$c")"
  printf '| %7s | %12s | %28s |\n' "$c" "$n" "$(awk -v n="$n" -v i="$ir" 'BEGIN { printf "%.0f", (n > 0 ? i / n : 0) }')"
done
