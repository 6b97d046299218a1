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
#   ROUTING=1 benches/connect.sh  # a hook that routes vs the same hook without the route
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

# ROUTING=1: instead, the cost of a route (issue 30): one client_connection
# hook that builds a route table and calls ctx:route with it (to the same
# server, so the client lands in a routed pool) against the same hook that
# builds it and does not call it; both ushers have the same routing section.
if [ "${ROUTING:-0}" = 1 ]; then
  for variant in plain routed; do
    mkdir -p "$work/$variant"
    call='local _ = target'
    [ $variant = routed ] && call='ctx:route(target)'
    cat >"$work/$variant/10-route.lua" <<LUA
function client_connection(ctx)
  local target = { database = "bench", host = "127.0.0.1", port = $PGPORT, dbname = "bench", user = ctx.user }
  $call
end
function session_start(ctx) ctx:set("application_name", "bench") end
LUA
  done
  routing="routing: { allow: { hosts: [127.0.0.1], ports: [$PGPORT], databases: [bench] } }"
  secret=$(scram_verifier bench)
  USHER_BIN=${USHER_BIN:-target/release/usher}
  PLAIN_PORT=$(free_port); ROUTED_PORT=$(free_port)
  USHER_SECRET=$secret start_usher plain "$PLAIN_PORT" "hooks: { dir: $work/plain }
$routing" "$USHER_BIN"
  PLAIN_PID=$USHER_PID
  USHER_SECRET=$secret start_usher routed "$ROUTED_PORT" "hooks: { dir: $work/routed }
$routing" "$USHER_BIN"
  ROUTED_PID=$USHER_PID
  echo
  echo "pgbench -C -S, $CLIENTS clients, ${DURATION}s x $ROUNDS interleaved rounds per variant, medians; machine: $(nproc) cores"
  : >"$work/plain.r"; : >"$work/routed.r"
  for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then order="plain routed"; else order="routed plain"; fi
    for who in $order; do
      case $who in
        plain) run "$PLAIN_PORT" "$PLAIN_PID" simple "$CLIENTS" -C >>"$work/plain.r" ;;
        routed) run "$ROUTED_PORT" "$ROUTED_PID" simple "$CLIENTS" -C >>"$work/routed.r" ;;
      esac
    done
  done
  printf '| %-26s | %13s | %14s |\n' variant "connections/s" "CPU per login"
  printf '|----------------------------|---------------|----------------|\n'
  for who in plain routed; do
    case $who in plain) name="hook, no ctx:route" ;; routed) name="same hook, ctx:route" ;; esac
    t=$(cut -d' ' -f1 "$work/$who.r" | median); c=$(cut -d' ' -f2 "$work/$who.r" | median)
    printf '| %-26s | %13s | %11s µs |\n' "$name" "$t" "$c"
    eval "${who}_c=$c"
  done
  awk -v a="$plain_c" -v b="$routed_c" 'BEGIN { printf "routed / plain CPU per login: %.3f\n", b / a }'
  exit 0
fi
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
