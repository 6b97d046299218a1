#!/usr/bin/env bash
# PostgreSQL restarting under a pooler (issue 29): CLIENTS clients each run
# SELECT 1 every 50 ms (examples/restart_load.rs) while PostgreSQL is
# stopped (pg_ctl stop -m fast) for STOP seconds and started again, twice,
# through usher and then through PgBouncer (1.24 when built, see
# benches/lib.sh), both in transaction mode with pool_size 20, the same
# SCRAM verifier and their default settings otherwise (usher: clients wait
# for the server, server_login_retry 15; PgBouncer: server_login_retry 15,
# fast fail). A client whose connection closes logs in again every 50 ms.
#
# Reports per pooler: statements that succeeded, client errors (by
# SQLSTATE; "login" for failed logins, "closed" for a connection that
# closed without an error), clients that lost their connection at least
# once (and how many times connections were lost), and the longest stall
# (one client, from a statement that did not succeed at once to the end of
# its next one that did).
#
#   benches/restarts.sh
#   CLIENTS=50 STOP=5 benches/restarts.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed
CLIENTS=${CLIENTS:-20}
STOP=${STOP:-2}
# Seconds before the first stop, between the first start and the second
# stop, and of the whole run (long enough for PgBouncer's 15 s retry).
FIRST=${FIRST:-5}
GAP=${GAP:-8}
SECS=${SECS:-40}
. benches/lib.sh

cargo build --release --quiet --example restart_load
start_usher_and_pgbouncer

pg_stop() { as_postgres "$BIN/pg_ctl" -D "$work/data" -m fast -w stop >/dev/null; }
pg_start() { as_postgres "$BIN/pg_ctl" -D "$work/data" -l "$work/pg.log" -w start >/dev/null; }

# scenario PORT NAME: the load through the pooler on PORT, and the two stops.
scenario() {
  target/release/examples/restart_load \
    --conn "host=127.0.0.1 port=$1 user=bench password=bench-pw dbname=bench" \
    --clients "$CLIENTS" --secs "$SECS" >"$work/$2.out" &
  local load=$!
  sleep "$FIRST"
  for stop in 1 2; do
    pg_stop
    sleep "$STOP"
    pg_start
    [ "$stop" = 1 ] && sleep "$GAP"
  done
  wait "$load"
}

echo "usher..." >&2
scenario "$USHER_PORT" usher
echo "PgBouncer..." >&2
scenario "$PGB_PORT" pgbouncer

echo
echo "PostgreSQL stopped ${STOP}s (pg_ctl stop -m fast), twice, $CLIENTS clients, SELECT 1 every 50 ms for ${SECS}s; machine: $(nproc) cores"
printf '| %-9s | %13s | %13s | %-36s | %22s | %14s |\n' pooler "statements ok" "client errors" "errors by SQLSTATE" "clients disconnected" "longest stall"
printf '|-----------|---------------|---------------|--------------------------------------|------------------------|----------------|\n'
for who in usher pgbouncer; do
  line=$(cat "$work/$who.out")
  get() { sed -n "s/.*\b$1=\([^ ]*\).*/\1/p" <<<"$line"; }
  printf '| %-9s | %13s | %13s | %-36s | %11s (%s times) | %11s ms |\n' "$who" "$(get ok)" "$(get errors)" "$(get by_code)" \
    "$(get disconnected_clients)" "$(get disconnections)" "$(get longest_stall_ms)"
done
