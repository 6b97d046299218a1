#!/usr/bin/env bash
# The instructions usher spends per login, counted by callgrind (repeatable
# where CPU time on a shared machine is not): usher with hooks off and with
# the trivial client_connection + session_start hook of connect.sh, each
# under valgrind --tool=callgrind, pgbench -C -S (a login per transaction).
# Only the measured run is counted (instrumentation is switched on after a
# warm-up), less what usher does idle in as long (its timers and
# background tasks, counted for IDLE seconds after the run), so that the
# count does not depend on how many logins the machine let pgbench make.
# Prints instructions per login and the hook's share; keeps the callgrind
# files when KEEP=dir is given.
#
#   benches/connect_callgrind.sh
#   VARIANTS="plain routed" benches/connect_callgrind.sh   # what a ctx:route costs
#   USHER_BIN=/tmp/usher-old DURATION=20 KEEP=/tmp/cg benches/connect_callgrind.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed
command -v valgrind >/dev/null || { echo "valgrind is missing (apt-get install valgrind)" >&2; exit 1; }
DURATION=${DURATION:-10}
CLIENTS=${CLIENTS:-4}
IDLE=${IDLE:-5}
VARIANTS=${VARIANTS:-off on}
. benches/lib.sh
USHER_BIN=${USHER_BIN:-target/release/usher}

write_trivial_hook "$work/trivial"
export PGPASSWORD=bench-pw
pgbench -i -q -s 1 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
secret=$(scram_verifier bench)

# measure NAME HOOKS_YAML: prints "logins instructions" (the run's, less
# the idle rate over the run's length).
measure() {
  local port pid out logins
  port=$(free_port)
  cat >"$work/$1.yaml" <<YAML
listen: 127.0.0.1:$port
pool_mode: transaction
pool_size: ${POOL_SIZE:-20}
databases:
  bench: { host: 127.0.0.1, port: $PGPORT }
users:
  bench: { password: '$secret' }
log: { level: warn }
$2
YAML
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/cg.$1" \
    "$USHER_BIN" --config "$work/$1.yaml" 2>"$work/$1.log" &
  pid=$!
  usher_pids="$usher_pids $pid"
  for _ in $(seq 600); do pg_isready -q -h 127.0.0.1 -p "$port" && break; sleep 0.1; done
  pgbench -S -n -C -c "$CLIENTS" -j 2 -T 3 -h 127.0.0.1 -p "$port" -U bench bench >/dev/null 2>&1 || true
  callgrind_control -i on "$pid" >/dev/null 2>&1
  local started ended
  started=$(date +%s.%N)
  out=$(pgbench -S -n -C -c "$CLIENTS" -j 2 -T "$DURATION" -h 127.0.0.1 -p "$port" -U bench bench 2>/dev/null) || true
  ended=$(date +%s.%N)
  callgrind_control -d "$pid" >/dev/null 2>&1 # the run (and zero)
  sleep "$IDLE"
  callgrind_control -i off "$pid" >/dev/null 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null || true
  logins=$(awk '/actually processed/ { print $NF }' <<<"$out")
  [ -n "${KEEP:-}" ] && mkdir -p "$KEEP" && cp "$work"/cg."$1"* "$work/$1.log" "$KEEP/"
  local run idle
  run=$(awk '/^totals:/ { print $2 }' "$work/cg.$1.1")
  idle=$(awk '/^totals:/ { print $2 }' "$work/cg.$1")
  awk -v n="$logins" -v r="$run" -v i="$idle" -v a="$started" -v b="$ended" -v w="$IDLE" \
    'BEGIN { printf "idle: %.0f instructions/s\n", i / w > "/dev/stderr"; printf "%s %.0f\n", n, r - i / w * (b - a) }'
}

echo "callgrind, pgbench -C -S, $CLIENTS clients, ${DURATION}s per variant, $USHER_BIN"
printf '| %-22s | %7s | %22s |\n' variant logins "instructions per login"
printf '|------------------------|---------|------------------------|\n'
for v in $VARIANTS; do
  case $v in
    off) r=$(measure off "hooks: { enabled: false, dir: $work/trivial }"); name="usher, hooks off" ;;
    on) r=$(measure on "hooks: { dir: $work/trivial }"); name="usher, trivial hook" ;;
    plain | routed)
      write_route_hook "$work/$v" "$v"
      r=$(measure "$v" "hooks: { dir: $work/$v }
$ROUTING_YAML")
      name="hook, $([ "$v" = routed ] && echo ctx:route || echo no ctx:route)" ;;
  esac
  read -r n ir <<<"$r"
  per=$(awk -v n="$n" -v i="$ir" 'BEGIN { printf "%.0f", (n > 0 ? i / n : 0) }')
  printf '| %-22s | %7s | %22s |\n' "$name" "$n" "$per"
  eval "${v}_per=$per"
done
if [ -n "${plain_per:-}" ] && [ -n "${routed_per:-}" ]; then
  awk -v a="$plain_per" -v b="$routed_per" 'BEGIN { printf "ctx:route / same hook without it, instructions per login: %.3f (%+.0f per login)\n", b / a, b - a }'
fi
if [ -n "${off_per:-}" ] && [ -n "${on_per:-}" ]; then
  awk -v a="$off_per" -v b="$on_per" 'BEGIN { printf "trivial hook / hooks off instructions per login: %.3f (+%.0f per login)\n", b / a, b - a }'
fi
