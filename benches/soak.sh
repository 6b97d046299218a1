#!/usr/bin/env bash
# Soak and storm: 10,000 clients held on usher at once (transaction mode,
# pool_size 20, PostgreSQL max_connections pool_size + 10), first idle, then
# all active at once; then a storm of logins (new connections continuously)
# while some of the held clients keep working, PostgreSQL is restarted
# (pg_ctl restart -m fast) and usher's configuration is reloaded (SIGHUP,
# pool_size flipped between POOL_SIZE and 3/4 of it) in turn; then every
# held client runs one more transaction and all leave.
#
# Reports, per phase: operations ok, errors by SQLSTATE, lost clients (closed
# without an ErrorResponse), hung ones (neither an answer nor an error within
# DEADLINE seconds), wrong answers, usher's peak resident memory and
# descriptors (/proc/PID, sampled every 200 ms) and usher's CPU time; then
# VmHWM and usher's descriptors before the clients came and after they left.
# Exits 1 if a client was lost or hung or answered wrongly, or usher panicked.
# The clients are examples/soak_client.rs (a raw protocol client on tokio).
#
#   benches/soak.sh                         # 10,000 clients, 60 s storm
#   CLIENTS=1000 DURATION=20 benches/soak.sh
#
# Not part of CI; run by hand. Needs CLIENTS + 300 descriptors for usher and
# for the driver: it raises `ulimit -n` to the hard limit and stops if that
# is too low. Knobs: CLIENTS, DURATION (storm seconds), IDLE (seconds),
# ACTIVE_TXNS (per client, all at once), STORM_WORKERS (login loops),
# STORM_ACTIVE (held clients working through the storm), EVENTS (restarts
# and reloads in turn), POOL_SIZE, AUTH (usher's auth.method for clients:
# md5 by default, as SCRAM's key derivation would make the driver the
# bottleneck; scram-sha-256 works too), QUERY_WAIT_TIMEOUT, DEADLINE,
# ROUNDS (the whole run again against the same usher: memory and
# descriptors after each round show whether anything accumulates).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed

CLIENTS=${CLIENTS:-10000}
DURATION=${DURATION:-60}
IDLE=${IDLE:-10}
ACTIVE_TXNS=${ACTIVE_TXNS:-3}
STORM_WORKERS=${STORM_WORKERS:-20}
STORM_ACTIVE=${STORM_ACTIVE:-200}
EVENTS=${EVENTS:-6}
POOL_SIZE=${POOL_SIZE:-20}
AUTH=${AUTH:-md5}
QUERY_WAIT_TIMEOUT=${QUERY_WAIT_TIMEOUT:-30}
ROUNDS=${ROUNDS:-1}
DEADLINE=${DEADLINE:-$((QUERY_WAIT_TIMEOUT + 30))}

# Descriptors: usher holds one per client (plus servers, listeners, logs),
# the driver one per client. Both inherit this shell's limit.
need=$((CLIENTS + STORM_WORKERS + 300))
hard=$(ulimit -Hn)
[ "$hard" = unlimited ] && hard=1048576
ulimit -n "$hard"
if [ "$(ulimit -n)" -lt "$need" ]; then
  echo "soak: $CLIENTS clients need $need descriptors, ulimit -Hn is $hard" >&2
  exit 2
fi
export PG_MAX_CONNECTIONS=$((POOL_SIZE + 10))

. benches/lib.sh
echo "building the soak client (release)..." >&2
cargo build --release --quiet --example soak_client

USHER_PORT=$(free_port)
mkdir -p "$work/no-hooks"
start_usher usher "$USHER_PORT" "max_client_conn: $((CLIENTS + STORM_WORKERS + 100))
query_wait_timeout: $QUERY_WAIT_TIMEOUT
auth: { method: $AUTH }
hooks: { dir: $work/no-hooks }"
USHER_PID=${usher_pids##* }

cat >"$work/restart.sh" <<SH
#!/bin/sh
exec runuser -u postgres -- "$BIN/pg_ctl" -D "$work/data" -l "$work/pg.log" -m fast -w restart >/dev/null
SH
[ "$(id -u)" -eq 0 ] || sed -i 's/runuser -u postgres -- //' "$work/restart.sh"
small=$((POOL_SIZE * 3 / 4))
cat >"$work/reload.sh" <<SH
#!/bin/sh
f="$work/usher.yaml"
if grep -q '^pool_size: $POOL_SIZE\$' "\$f"; then to=$small; else to=$POOL_SIZE; fi
sed -i "s/^pool_size: .*/pool_size: \$to/" "\$f"
kill -HUP $USHER_PID
SH
chmod +x "$work/restart.sh" "$work/reload.sh"

echo
echo "soak: $CLIENTS clients, idle ${IDLE}s, $ACTIVE_TXNS transactions each at once, ${DURATION}s storm ($STORM_WORKERS login loops, $STORM_ACTIVE held clients working, $EVENTS restarts/reloads); pool_size $POOL_SIZE, transaction mode, auth $AUTH"
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr), PostgreSQL $("$BIN/postgres" --version | awk '{print $3}'), $(date -u +%Y-%m-%d)"
echo
status=0
for round in $(seq "$ROUNDS"); do
  [ "$ROUNDS" -gt 1 ] && echo "round $round of $ROUNDS (same usher)"
  target/release/examples/soak_client --addr "127.0.0.1:$USHER_PORT" \
    --clients "$CLIENTS" --idle-secs "$IDLE" --active-txns "$ACTIVE_TXNS" \
    --storm-secs "$DURATION" --storm-workers "$STORM_WORKERS" --storm-active "$STORM_ACTIVE" \
    --events "$EVENTS" --restart-cmd "$work/restart.sh" --reload-cmd "$work/reload.sh" \
    --usher-pid "$USHER_PID" --deadline-secs "$DEADLINE" || status=$?
  echo
  if ! kill -0 "$USHER_PID" 2>/dev/null; then
    echo "usher is gone (exited during the run)"; status=1; break
  fi
  # What usher still holds with no client left: its pool's idle server
  # connections (up to POOL_SIZE) and a few fixed descriptors; more is a leak.
  servers=$(ss -Htn state established "( dport = :$PGPORT )" | wc -l)
  echo "usher after the clients left: $(ls "/proc/$USHER_PID/fd" | wc -l) descriptors, $servers of them server connections; $(grep VmRSS "/proc/$USHER_PID/status" | tr -s ' \t' ' ')"
  echo
done
if grep -q panicked "$work/usher.log"; then
  echo "usher panicked:"; grep -A3 panicked "$work/usher.log" | head -20; status=1
fi
# usher's warnings and errors, by message (log level warn; digits masked)
lines=$(wc -l <"$work/usher.log")
echo "usher log: $lines lines at level warn; most frequent:"
sed -E 's/^[^ ]+ +//; s/\x1b\[[0-9;]*m//g; s/[0-9]+/#/g' "$work/usher.log" | cut -c1-160 |
  sort | uniq -c | sort -rn | head -8 || true
exit "$status"
