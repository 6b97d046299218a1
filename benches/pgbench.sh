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
BIN=$(pg_bindir)

work=$(mktemp -d /tmp/usher-bench.XXXXXX)
[ "$(id -u)" -eq 0 ] && chown postgres:postgres "$work"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PGPORT=$(free_port)
USHER_PORT=$(free_port)
usher_pid=""
cleanup() {
  [ -n "$usher_pid" ] && kill "$usher_pid" 2>/dev/null || true
  as_postgres "$BIN/pg_ctl" -D "$work/data" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

echo "building usher (release)..." >&2
cargo build --release --quiet

echo "starting PostgreSQL on :$PGPORT..." >&2
echo "bench-pw" >"$work/pw"; [ "$(id -u)" -eq 0 ] && chown postgres "$work/pw"
as_postgres "$BIN/initdb" -D "$work/data" -U postgres -E UTF8 --locale=C -N \
  --auth-local=trust --auth-host=scram-sha-256 --pwfile="$work/pw" >/dev/null
cat >>"$work/data/postgresql.conf" <<CONF
port = $PGPORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$work'
max_connections = 250
fsync = off
synchronous_commit = off
CONF
as_postgres "$BIN/pg_ctl" -D "$work/data" -l "$work/pg.log" -w start >/dev/null
psql -X -q -h "$work" -p "$PGPORT" -U postgres -c "CREATE ROLE bench LOGIN PASSWORD 'bench-pw'" -c "CREATE DATABASE bench OWNER bench"

cat >"$work/usher.yaml" <<YAML
listen: 127.0.0.1:$USHER_PORT
pool_mode: transaction
pool_size: $POOL_SIZE
databases:
  bench: { host: 127.0.0.1, port: $PGPORT }
users:
  bench: { password: bench-pw }
log: { level: warn }
YAML
target/release/usher --config "$work/usher.yaml" 2>"$work/usher.log" &
usher_pid=$!
for _ in $(seq 100); do pg_isready -q -h 127.0.0.1 -p "$USHER_PORT" && break; sleep 0.1; done

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
