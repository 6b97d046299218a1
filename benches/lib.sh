# Shared by the benchmark scripts: a throwaway PostgreSQL and usher
# instances on free ports, stopped on exit. Source it after scripts/pg-env.sh.

BIN=$(pg_bindir)
work=$(mktemp -d /tmp/usher-bench.XXXXXX)
[ "$(id -u)" -eq 0 ] && chown postgres:postgres "$work"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PGPORT=$(free_port)
usher_pids=""
cleanup() {
  for p in $usher_pids; do kill "$p" 2>/dev/null || true; done
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
max_connections = ${PG_MAX_CONNECTIONS:-250}
fsync = off
synchronous_commit = off
CONF
as_postgres "$BIN/pg_ctl" -D "$work/data" -l "$work/pg.log" -w start >/dev/null
psql -X -q -h "$work" -p "$PGPORT" -U postgres -c "CREATE ROLE bench LOGIN PASSWORD 'bench-pw'" -c "CREATE DATABASE bench OWNER bench"

# start_usher NAME PORT EXTRA_YAML [BINARY]: runs usher (this tree's release
# build unless BINARY is given) in transaction mode in front of the
# cluster; EXTRA_YAML is appended to its configuration.
start_usher() {
  cat >"$work/$1.yaml" <<YAML
listen: 127.0.0.1:$2
pool_mode: transaction
pool_size: ${POOL_SIZE:-20}
databases:
  bench: { host: 127.0.0.1, port: $PGPORT }
users:
  bench: { password: bench-pw }
log: { level: warn }
$3
YAML
  "${4:-target/release/usher}" --config "$work/$1.yaml" 2>"$work/$1.log" &
  usher_pids="$usher_pids $!"
  for _ in $(seq 100); do pg_isready -q -h 127.0.0.1 -p "$2" && return; sleep 0.1; done
  echo "usher ($1) did not start:" >&2; cat "$work/$1.log" >&2; exit 1
}
