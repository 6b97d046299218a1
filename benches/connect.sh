#!/usr/bin/env bash
# The cost of hooks on connecting: pgbench -C -S (a new connection per
# transaction) through usher with hooks switched off, and with one trivial
# client_connection + session_start hook, in one run, alternating rounds.
# Target (issue 5): with hooks off, no measurable difference in connection
# rate; the trivial hook within a few percent.
#
#   benches/connect.sh            # 3 rounds of 10 s each per variant
#   ROUNDS=5 DURATION=20 benches/connect.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed
DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
CLIENTS=${CLIENTS:-8}
. benches/lib.sh

mkdir -p "$work/trivial"
cat >"$work/trivial/10-trivial.lua" <<'LUA'
function client_connection(ctx) end
function session_start(ctx) ctx:set("application_name", "bench") end
LUA
OFF_PORT=$(free_port)
ON_PORT=$(free_port)
start_usher off "$OFF_PORT" "hooks: { enabled: false, dir: $work/trivial }"
start_usher on "$ON_PORT" "hooks: { dir: $work/trivial }"

export PGPASSWORD=bench-pw
pgbench -i -q -s 1 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
tps() {
  pgbench -C -S -n -c "$CLIENTS" -j 2 -T "$DURATION" -h 127.0.0.1 -p "$1" -U bench bench 2>/dev/null |
    awk '/^tps = / { printf "%.0f", $3 }'
}
echo
echo "pgbench -C -S, $CLIENTS clients, ${DURATION}s x $ROUNDS rounds per variant; machine: $(nproc) cores"
off_sum=0; on_sum=0
for r in $(seq "$ROUNDS"); do
  off=$(tps "$OFF_PORT"); on=$(tps "$ON_PORT")
  echo "round $r: hooks off $off tps, trivial hook $on tps"
  off_sum=$((off_sum + off)); on_sum=$((on_sum + on))
done
awk -v a="$off_sum" -v b="$on_sum" -v n="$ROUNDS" 'BEGIN { printf "mean: hooks off %.0f, trivial hook %.0f connections/s; ratio %.3f\n", a/n, b/n, b/a }'
