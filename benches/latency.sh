#!/usr/bin/env bash
# Tail latency with many clients (issue 14, item 5): pgbench -S through usher
# and through PgBouncer (Debian's package, installed when missing), both in
# transaction mode with pool_size POOL_SIZE and the same SCRAM verifier, at
# 100, 1,000 and 5,000 clients. Every transaction's latency is logged
# (pgbench -l) and the p50 / p99 / p99.9 are computed from the logs, beside
# pgbench's tps (without the initial connection time). The two poolers
# alternate at each client count. (CPU per transaction is pgbench.sh's:
# here the logins would be in it.)
#
#   benches/latency.sh                      # 10 s per run
#   CLIENTS="100 1000" DURATION=20 benches/latency.sh
#
# pgbench logs in every client first (SCRAM: about 10 ms each on this
# machine, most of it pgbench's own key derivation), inside its -T: each
# run gets a second more per 80 clients for that.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed
DURATION=${DURATION:-10}
CLIENTS=${CLIENTS:-"100 1000 5000"}
POOL_SIZE=${POOL_SIZE:-20}
# 5,000 clients need as many descriptors in pgbench and in each pooler.
ulimit -n "$(ulimit -Hn)"
. benches/lib.sh

export PGPASSWORD=bench-pw
pgbench -i -q -s 10 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
start_usher_and_pgbouncer "max_client_conn: 20000"
mkdir -p "$work/logs" && chmod 777 "$work/logs"

# measure PORT CLIENTS: "tps p50_ms p99_ms p999_ms"
measure() {
  local out txns tps
  rm -f "$work/logs"/lat*
  out=$(cd "$work/logs" && pgbench -S -n -c "$2" -j 2 -T "$((DURATION + $2 / 80))" -l --log-prefix=lat \
    -h 127.0.0.1 -p "$1" -U bench bench 2>"$work/pgbench.err") || true
  txns=$(awk '/actually processed/ { print $NF }' <<<"$out")
  [ "${txns:-0}" -gt 0 ] || { echo "pgbench did no transaction ($2 clients):" >&2; tail -3 "$work/pgbench.err" >&2; }
  tps=$(awk '/^tps = / { printf "%.0f", $3 }' <<<"$out")
  # Field 3 of pgbench's per-transaction log is the latency in µs.
  cat "$work/logs"/lat* 2>/dev/null | awk '{ print $3 }' | sort -n | awk -v t="${tps:-0}" '
    { v[NR] = $1 }
    END {
      if (NR == 0) { print t, 0, 0, 0; exit }
      printf "%s %.2f %.2f %.2f\n", t,
        v[int(NR * 0.5) + 1] / 1000, v[int(NR * 0.99) + 1] / 1000, v[int(NR * 0.999) + 1] / 1000
    }'
}

echo
echo "pgbench -S, ${DURATION}s per run, pool_size $POOL_SIZE, transaction mode; machine: $(nproc) cores"
printf '| %7s | %-9s | %8s | %8s | %8s | %9s |\n' clients pooler tps "p50 ms" "p99 ms" "p99.9 ms"
printf '|---------|-----------|----------|----------|----------|-----------|\n'
for c in $CLIENTS; do
  for who in usher pgbouncer; do
    if [ "$who" = usher ]; then r=$(measure "$USHER_PORT" "$c"); else r=$(measure "$PGB_PORT" "$c"); fi
    read -r tps p50 p99 p999 <<<"$r"
    printf '| %7s | %-9s | %8s | %8s | %8s | %9s |\n' "$c" "$who" "$tps" "$p50" "$p99" "$p999"
  done
done
