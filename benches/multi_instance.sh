#!/usr/bin/env bash
# Three usher instances behind HAProxy (Debian's package, installed when
# missing) in front of one PostgreSQL, as in production behind a TCP load
# balancer. The instances are peered (peer_id 1-3, the same `peers` list)
# and listen with so_reuseport, so any one can be restarted in place.
#
# 1. pgbench -S through HAProxy while instance B is restarted on its port
#    with scripts/rolling_restart.sh, twice: with a new connection per
#    transaction (-C: every login after the SIGTERM must land on the new
#    process) and with long-lived connections (the old process keeps its
#    clients until pgbench ends). Passes when pgbench reports no failed
#    transaction and no client aborted.
# 2. A cancel through HAProxy: psql runs pg_sleep through HAProxy, gets
#    SIGINT and sends its cancel through HAProxy, which (round robin, no
#    other traffic) gives it to the next instance; that instance forwards
#    it to the query's. Passes when the query ends with "canceling
#    statement due to user request" and another instance's log says it
#    forwarded the cancel.
#
#   benches/multi_instance.sh            # DURATION=20 s per pgbench run
#   CLIENTS=20 DURATION=30 benches/multi_instance.sh
#
# 3. A lockout shared through PostgreSQL (auth_monitor.store, in the bench
#    database): wrong passwords for one user through HAProxy, so spread over
#    the three instances, until a login is refused with 28000; then the
#    right password is refused by every instance, and SHOW AUTH_MON's row
#    of that user is the same on all three. Passes when the lock came
#    within MAX_FAILURES + 2 failures (an instance may not have read the
#    others' last failures yet), every instance refused, and the rows agree.
#
# Run by hand, not in CI (HAProxy, root for apt-get); tests/it/peers.rs and
# tests/it/auth_store.rs run the same scenarios without HAProxy.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed

DURATION=${DURATION:-20}
MAX_FAILURES=${MAX_FAILURES:-6}
CLIENTS=${CLIENTS:-10}
POOL_SIZE=${POOL_SIZE:-10}
. benches/lib.sh

if ! command -v haproxy >/dev/null 2>&1 && [ ! -x /usr/sbin/haproxy ]; then
  echo "installing haproxy..." >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q haproxy >/dev/null
fi
HAPROXY=$(command -v haproxy || echo /usr/sbin/haproxy)

export PGPASSWORD=bench-pw
pgbench -i -q -s 10 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
# The lockout's victim (part 3); the store's tables go in the bench database.
psql -X -q -h "$work" -p "$PGPORT" -U postgres -c "CREATE ROLE victim LOGIN PASSWORD 'victim-pw'"
mkdir -p "$work/no-hooks"

PORTS=("$(free_port)" "$(free_port)" "$(free_port)")
NAMES=(a b c)
PEERS="peers:"
for i in 0 1 2; do
  PEERS="$PEERS
  - { id: $((i + 1)), host: 127.0.0.1, port: ${PORTS[$i]} }"
done
declare -A PID
for i in 0 1 2; do
  # The forwarding instance says so at debug level (checked in part 2).
  start_usher "${NAMES[$i]}" "${PORTS[$i]}" "hooks: { dir: $work/no-hooks }
so_reuseport: true
shutdown_timeout: $((DURATION * 3))
peer_id: $((i + 1))
$PEERS
admin: { users: [bench] }
auth_monitor:
  lockout: { max_failures: $MAX_FAILURES, window_s: 60, duration_s: 600, by_address: false }
  store: { database: bench, user: bench, flush_interval_s: 0.2, refresh_interval_s: 0.2 }"
  sed -i 's/^log: { level: warn }$/log: { level: "warn,usher::frontend::peers=debug" }/' "$work/${NAMES[$i]}.yaml"
  sed -i 's/^  bench: { password: .* }$/&\n  victim: { password: victim-pw }/' "$work/${NAMES[$i]}.yaml"
  PID[${NAMES[$i]}]=$USHER_PID
done
# The log level above applies from a restart on: restart all three once
# (this also exercises the script before the measured runs).
for i in 0 1 2; do
  n=${NAMES[$i]}
  PID[$n]=$(scripts/rolling_restart.sh --pid "${PID[$n]}" --config "$work/$n.yaml" \
    --port "${PORTS[$i]}" --bin target/release/usher --log "$work/$n.log" --timeout 30)
  usher_pids="$usher_pids ${PID[$n]}"
done

HAPORT=$(free_port)
cat >"$work/haproxy.cfg" <<CFG
global
  maxconn 4096
defaults
  mode tcp
  timeout connect 5s
  timeout client 1h
  timeout server 1h
  retries 3
  option redispatch
frontend pg
  bind 127.0.0.1:$HAPORT
  default_backend ushers
backend ushers
  balance roundrobin
  server a 127.0.0.1:${PORTS[0]} check inter 500ms
  server b 127.0.0.1:${PORTS[1]} check inter 500ms
  server c 127.0.0.1:${PORTS[2]} check inter 500ms
CFG
"$HAPROXY" -f "$work/haproxy.cfg" -D -p "$work/haproxy.pid"
usher_pids="$usher_pids $(cat "$work/haproxy.pid")"
for _ in $(seq 100); do pg_isready -q -h 127.0.0.1 -p "$HAPORT" && break; sleep 0.1; done

echo
echo "three ushers (transaction mode, pool_size $POOL_SIZE each) behind $("$HAPROXY" -v | head -1 | awk '{print $1, $2, $3}'), one PostgreSQL $("$BIN/postgres" --version | awk '{print $3}')"
echo "machine: $(nproc) cores, $(uname -sr), net.ipv4.tcp_migrate_req = $(cat /proc/sys/net/ipv4/tcp_migrate_req 2>/dev/null || echo n/a)"
fails=0

# restart_during LABEL PGBENCH_ARGS...: pgbench -S through HAProxy for
# DURATION s; instance b is restarted in place a third of the way in.
restart_during() {
  local label=$1 out status=0 started
  shift
  (
    sleep $((DURATION / 3))
    started=$(date +%s.%N)
    new=$(scripts/rolling_restart.sh --pid "${PID[b]}" --config "$work/b.yaml" --port "${PORTS[1]}" \
      --bin target/release/usher --log "$work/b.log" --timeout $((DURATION * 4)))
    echo "$new" >"$work/b.newpid"
    awk -v s="$started" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f\n", e - s }' >"$work/b.restart_s"
  ) &
  local restarter=$!
  out=$(pgbench -S -n "$@" -c "$CLIENTS" -j 2 -T "$DURATION" -h 127.0.0.1 -p "$HAPORT" -U bench bench 2>&1) || status=$?
  wait "$restarter" || { echo "$label: the rolling restart failed" >&2; fails=$((fails + 1)); }
  PID[b]=$(cat "$work/b.newpid")
  usher_pids="$usher_pids ${PID[b]}"
  local txns failed aborted tps
  txns=$(awk '/actually processed/ { print $NF }' <<<"$out")
  failed=$(awk '/number of failed transactions/ { print $5 }' <<<"$out")
  tps=$(awk '/^tps = / { printf "%.0f", $3 }' <<<"$out")
  aborted=$(grep -c 'client .* aborted\|error:' <<<"$out" || true)
  printf '| %-30s | %12s | %6s | %7s | %7s | %9s s |\n' "$label" "${txns:-0}" "${failed:-?}" "$aborted" "${tps:-0}" "$(cat "$work/b.restart_s" 2>/dev/null || echo ?)"
  if [ "$status" -ne 0 ] || [ "${failed:-1}" != 0 ] || [ "$aborted" != 0 ]; then
    echo "FAILED ($label, pgbench exit $status):" >&2; echo "$out" >&2; fails=$((fails + 1))
  fi
}

echo
echo "1. pgbench -S through HAProxy, $CLIENTS clients, ${DURATION}s; instance b restarted in place at $((DURATION / 3))s"
echo
printf '| %-30s | %12s | %6s | %7s | %7s | %11s |\n' run transactions failed aborted tps "b's restart"
printf '|%s|%s|%s|%s|%s|%s|\n' "$(printf -- "-%.0s" {1..32})" "--------------" "--------" "---------" "---------" "-------------"
restart_during "a connection per transaction" -C
restart_during "long-lived connections"

echo
echo "2. a cancel through HAProxy (round robin: the cancel goes to another instance than the query)"
for n in a b c; do : >"$work/$n.forwarded"; grep -c 'cancel request forwarded' "$work/$n.log" >"$work/$n.forwarded" || true; done
psql -X -h 127.0.0.1 -p "$HAPORT" -U bench bench -c "SELECT pg_sleep(30)" >"$work/cancel.out" 2>&1 &
psql_pid=$!
for _ in $(seq 100); do
  n=$(psql -X -At -h "$work" -p "$PGPORT" -U postgres -c "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'")
  [ "$n" = 1 ] && break; sleep 0.1
done
kill -INT "$psql_pid"
wait "$psql_pid" || true
forwarders=""
for n in a b c; do
  now=$(grep -c 'cancel request forwarded' "$work/$n.log" || true)
  [ "$now" -gt "$(cat "$work/$n.forwarded")" ] && forwarders="$forwarders $n"
done
if grep -q 'canceling statement due to user request' "$work/cancel.out" && [ -n "$forwarders" ]; then
  echo "   the query was cancelled (57014); the cancel was forwarded by instance(s):$forwarders"
else
  echo "FAILED: $(cat "$work/cancel.out"); forwarded by: ${forwarders:-nobody}" >&2
  fails=$((fails + 1))
fi

# check_lockout: part 3 (issue 15, item 3). Wrong passwords for victim
# through HAProxy (round robin: a, b, c, a, ...) until one is refused as
# locked; then the right password through HAProxy three times (one per
# instance) and SHOW AUTH_MON's victim row on each instance's console.
check_lockout() {
  local tried=0 out locked=0 refusals=0 rows=() agreed=0
  echo
  echo "3. a lockout shared through PostgreSQL: wrong passwords for victim through HAProxy (max_failures $MAX_FAILURES)"
  while [ "$tried" -lt $((MAX_FAILURES * 3)) ]; do
    out=$(PGPASSWORD=wrong psql -X -h 127.0.0.1 -p "$HAPORT" -U victim bench -c 'SELECT 1' 2>&1 || true)
    if grep -q 'too many failed login attempts for user "victim"' <<<"$out"; then locked=1; break; fi
    grep -q 'password authentication failed' <<<"$out" || { echo "FAILED: unexpected answer: $out" >&2; fails=$((fails + 1)); return; }
    tried=$((tried + 1))
    sleep 0.3 # a flush and a read apart, as failures from a client retrying would be
  done
  for _ in 1 2 3; do
    out=$(PGPASSWORD=victim-pw psql -X -h 127.0.0.1 -p "$HAPORT" -U victim bench -c 'SELECT 1' 2>&1 || true)
    grep -q 'too many failed login attempts for user "victim"' <<<"$out" && refusals=$((refusals + 1))
  done
  # SHOW AUTH_MON agrees once every instance has read the others' counts.
  for _ in $(seq 50); do
    rows=()
    for i in 0 1 2; do
      rows+=("$(PGPASSWORD=bench-pw psql -X -At -h 127.0.0.1 -p "${PORTS[$i]}" -U bench usher -c 'SHOW AUTH_MON' | grep '^victim|')")
    done
    if [ "${rows[0]}" = "${rows[1]}" ] && [ "${rows[1]}" = "${rows[2]}" ] && [ -n "${rows[0]}" ]; then agreed=1; break; fi
    sleep 0.2
  done
  echo "   locked after $tried wrong passwords spread over the three instances; the right password refused $refusals of 3 times (one per instance)"
  echo "   SHOW AUTH_MON's victim row on a, b, c: $([ "$agreed" = 1 ] && echo "the same" || echo "DIFFERENT"): ${rows[0]}"
  for i in 0 1 2; do
    echo "   SHOW AUTH_STORE on ${NAMES[$i]}: $(PGPASSWORD=bench-pw psql -X -At -h 127.0.0.1 -p "${PORTS[$i]}" -U bench usher -c 'SHOW AUTH_STORE' | cut -d'|' -f3,7,8,9)"
  done
  if [ "$locked" != 1 ] || [ "$tried" -gt $((MAX_FAILURES + 2)) ] || [ "$refusals" != 3 ] || [ "$agreed" != 1 ]; then
    echo "FAILED: the lockout was not shared (locked=$locked after $tried, refusals=$refusals, agreed=$agreed)" >&2
    for i in 0 1 2; do echo "   ${NAMES[$i]}: ${rows[$i]:-}" >&2; done
    fails=$((fails + 1))
  fi
}
check_lockout

echo
if [ "$fails" -eq 0 ]; then echo "all checks passed"; else echo "$fails check(s) failed"; exit 1; fi
