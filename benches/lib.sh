# Shared by the benchmark scripts: a throwaway PostgreSQL and usher
# instances on free ports, stopped on exit. Source it after scripts/pg-env.sh.

BIN=$(pg_bindir)
work=$(mktemp -d /tmp/usher-bench.XXXXXX)
[ "$(id -u)" -eq 0 ] && chown postgres:postgres "$work"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PGPORT=$(free_port)
usher_pids=""
# SERVER_SOCKET=1: the poolers reach PostgreSQL through its Unix-domain
# socket (in $work) instead of TCP on 127.0.0.1.
SERVER_HOST=127.0.0.1
[ "${SERVER_SOCKET:-0}" = 1 ] && SERVER_HOST=$work
cleanup() {
  for p in $usher_pids; do kill "$p" 2>/dev/null || true; done
  as_postgres "$BIN/pg_ctl" -D "$work/data" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# Build this tree's release binary, unless every usher the script runs was
# named (USHER_BIN; W1_BIN and W2_BIN; USHER_A and USHER_B): a bench given
# its binaries measures them, not a half-edited tree, and no build competes
# with it for CPU.
if [ -n "${USHER_BIN:-}" ] || { [ -n "${W1_BIN:-}" ] && [ -n "${W2_BIN:-}" ]; } ||
  { [ -n "${USHER_A:-}" ] && [ -n "${USHER_B:-}" ]; }; then
  echo "not building: measuring the binaries given" >&2
else
  echo "building usher (release)..." >&2
  cargo build --release --quiet
fi

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

# start_usher NAME PORT EXTRA_YAML [BINARY]: runs usher (BINARY, else
# USHER_BIN, else this tree's release build) in transaction mode in front of the
# cluster; EXTRA_YAML is appended to its configuration. USHER_SECRET (the
# bench role's password unless set) is what usher checks clients against.
start_usher() {
  cat >"$work/$1.yaml" <<YAML
listen: 127.0.0.1:$2
pool_mode: transaction
pool_size: ${POOL_SIZE:-20}
databases:
  bench: { host: $SERVER_HOST, port: $PGPORT }
users:
  bench: { password: '${USHER_SECRET:-bench-pw}' }
log: { level: warn }
$3
YAML
  "${4:-${USHER_BIN:-target/release/usher}}" --config "$work/$1.yaml" 2>"$work/$1.log" &
  USHER_PID=$!
  usher_pids="$usher_pids $!"
  for _ in $(seq 100); do pg_isready -q -h 127.0.0.1 -p "$2" && return; sleep 0.1; done
  echo "usher ($1) did not start:" >&2; cat "$work/$1.log" >&2; exit 1
}

TICK=$(getconf CLK_TCK)
# cpu_ticks PID: user + system CPU ticks of a process so far.
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

# run PORT PID MODE CLIENTS [pgbench args...]: one pgbench -S run of
# DURATION seconds; prints "tps cpu_us_per_txn", the CPU (user + system)
# the process PID (a pooler) used per transaction pgbench reports (0 when
# PID is 0: PostgreSQL directly). Prepared mode runs a pgbench thread per
# client (pgbench prepares synchronously; see tests/it/prepared.rs).
run() {
  local port=$1 pid=$2 mode=$3 clients=$4 jobs=${JOBS:-2} before=0 after=0 out txns tps
  shift 4
  [ "$mode" = prepared ] && jobs=$clients
  [ "$jobs" -gt "$clients" ] && jobs=$clients
  [ "$pid" != 0 ] && before=$(cpu_ticks "$pid")
  out=$(pgbench -S -n -M "$mode" -c "$clients" -j "$jobs" -T "$DURATION" "$@" \
    -h 127.0.0.1 -p "$port" -U bench bench 2>/dev/null) || true
  [ "$pid" != 0 ] && after=$(cpu_ticks "$pid")
  txns=$(awk '/actually processed/ { print $NF }' <<<"$out")
  tps=$(awk '/^tps = / { printf "%.0f", $3 }' <<<"$out")
  awk -v t="${tps:-0}" -v n="${txns:-0}" -v d="$((after - before))" -v k="$TICK" \
    'BEGIN { printf "%s %.1f\n", t, (n > 0 ? d * 1e6 / k / n : 0) }'
}

# scram_verifier ROLE: the role's SCRAM verifier as pg_authid holds it, so
# that every pooler checks clients against the same secret.
scram_verifier() {
  psql -X -At -h "$work" -p "$PGPORT" -U postgres -c "SELECT rolpassword FROM pg_authid WHERE rolname = '$1'"
}

# pgbouncer_bin: the PgBouncer the benches measure against: PGB_BIN if
# set, else PgBouncer 1.24 as ../shared/tools/pgbouncer.sh builds it
# (under PGB_HOME, /var/tmp/pgbouncer-1.24 by default) when present, else
# Debian's package (1.18 on Debian 12; installed when missing).
pgbouncer_bin() {
  local built=${PGB_HOME:-/var/tmp/pgbouncer-1.24}/inst/bin/pgbouncer
  if [ -n "${PGB_BIN:-}" ]; then
    echo "$PGB_BIN"
  elif [ -x "$built" ]; then
    echo "$built"
  else
    if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
      echo "installing pgbouncer..." >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >/dev/null
    fi
    command -v pgbouncer || echo /usr/sbin/pgbouncer
  fi
}

# start_pgbouncer PORT: PgBouncer (pgbouncer_bin, its version printed) in
# transaction mode in front of the cluster, pool_size POOL_SIZE, checking
# the bench role's SCRAM verifier; sets PGB_PID.
start_pgbouncer() {
  local bin
  bin=$(pgbouncer_bin)
  local version
  version=$("$bin" --version 2>/dev/null | head -1)
  echo "PgBouncer: $bin ($version)" >&2
  # Protocol-level prepared statements in transaction mode came in 1.21
  # (max_prepared_statements); PGB_PREPARED says whether this one has them.
  PGB_PREPARED=0
  local prepared_line=""
  if awk '{ split($2, v, "."); exit !(v[1] > 1 || (v[1] == 1 && v[2] >= 21)) }' <<<"$version"; then
    PGB_PREPARED=1
    prepared_line="max_prepared_statements = ${PGB_MAX_PREPARED:-200}"
  fi
  mkdir -p "$work/pgbouncer"
  printf '"bench" "%s"\n' "$(scram_verifier bench)" >"$work/pgbouncer/users.txt"
  cat >"$work/pgbouncer/pgbouncer.ini" <<INI
[databases]
bench = host=$SERVER_HOST port=$PGPORT dbname=bench
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $1
unix_socket_dir =
auth_type = scram-sha-256
auth_file = $work/pgbouncer/users.txt
pool_mode = transaction
default_pool_size = ${POOL_SIZE:-20}
max_client_conn = 10000
$prepared_line
logfile = $work/pgbouncer/pgbouncer.log
pidfile = $work/pgbouncer/pgbouncer.pid
INI
  [ "$(id -u)" -eq 0 ] && chown -R postgres "$work/pgbouncer"
  # runuser's PAM session starts PgBouncer with 1,024 descriptors whatever
  # this shell's limit: past about 1,000 clients its accept() fails with
  # EMFILE and pgbench waits forever. It raises its own to the hard limit.
  as_postgres sh -c 'ulimit -n "$(ulimit -Hn)"; exec "$0" -d "$1"' "$bin" "$work/pgbouncer/pgbouncer.ini" >/dev/null
  for _ in $(seq 100); do pg_isready -q -h 127.0.0.1 -p "$1" && break; sleep 0.1; done
  PGB_PID=$(cat "$work/pgbouncer/pgbouncer.pid")
  usher_pids="$usher_pids $PGB_PID"

}

# start_usher_and_pgbouncer [EXTRA_YAML]: usher without hooks and PgBouncer,
# both checking the bench role's SCRAM verifier; sets USHER_PORT, U_PID,
# PGB_PORT and PGB_PID.
start_usher_and_pgbouncer() {
  USHER_PORT=$(free_port)
  PGB_PORT=$(free_port)
  mkdir -p "$work/no-hooks"
  USHER_SECRET=$(scram_verifier bench) start_usher usher "$USHER_PORT" "hooks: { dir: $work/no-hooks }
${1:-}"
  U_PID=$USHER_PID
  start_pgbouncer "$PGB_PORT"
}

# write_route_hook DIR plain|routed: a client_connection hook that builds a
# route to the bench database (the same server) and calls ctx:route with it
# (routed) or not (plain), and the trivial session_start: what a route
# costs (connect.sh ROUTING=1, connect_callgrind.sh VARIANTS="plain routed").
# ROUTING_YAML is the routing section both use.
write_route_hook() {
  local call='local _ = target'
  [ "$2" = routed ] && call='ctx:route(target)'
  mkdir -p "$1"
  cat >"$1/10-route.lua" <<LUA
function client_connection(ctx)
  local target = { database = "bench", host = "127.0.0.1", port = $PGPORT, dbname = "bench", user = ctx.user }
  $call
end
function session_start(ctx) ctx:set("application_name", "bench") end
LUA
  ROUTING_YAML="routing: { allow: { hosts: [127.0.0.1], ports: [$PGPORT], databases: [bench] } }"
}

# write_trivial_hook DIR: the trivial client_connection + session_start
# hook whose cost connect.sh and connect_callgrind.sh measure.
write_trivial_hook() {
  mkdir -p "$1"
  cat >"$1/10-trivial.lua" <<'LUA'
function client_connection(ctx) end
function session_start(ctx) ctx:set("application_name", "bench") end
LUA
}
