#!/usr/bin/env bash
# usher against PgBouncer, in one run: pgbench -S through PostgreSQL
# directly, usher and PgBouncer (Debian's package, installed when missing),
# both poolers in transaction mode with the same pool size and checking the
# same SCRAM verifier, for the simple, extended and prepared protocols and
# 1, 10, 50 and 100 clients. Rounds are interleaved (the order rotates) and
# medians printed: tps, and each pooler's CPU per transaction (user +
# system from /proc/PID/stat over the transactions pgbench reports), with
# usher/PgBouncer ratios. On a small machine the pooler's CPU comes out of
# PostgreSQL's and pgbench's share, so CPU per transaction decides tps.
#
#   benches/pgbench.sh                       # 3 rounds of 5 s per point
#   ROUNDS=5 DURATION=10 CLIENTS="10 50" MODES=simple benches/pgbench.sh
#   SERVER_SOCKET=1 benches/pgbench.sh       # both poolers reach PostgreSQL
#                                            # through its Unix-domain socket
#
# PgBouncer 1.18 has no protocol-level prepared statements in transaction
# mode: its prepared column is empty (1.21 and later run it with
# max_prepared_statements = 200, PGB_MAX_PREPARED to change). Starts its own throwaway PostgreSQL,
# usher (release build) and PgBouncer on free ports, stops them at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed

DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-3}
JOBS=${JOBS:-2}
POOL_SIZE=${POOL_SIZE:-20}
CLIENTS=${CLIENTS:-"1 10 50 100"}
MODES=${MODES:-"simple extended prepared"}
. benches/lib.sh

export PGPASSWORD=bench-pw
pgbench -i -q -s 10 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
start_usher_and_pgbouncer

echo
echo "pgbench -S, scale 10, ${DURATION}s x $ROUNDS interleaved rounds per point, medians; pool_size $POOL_SIZE, transaction mode; poolers to PostgreSQL: $([ "$SERVER_HOST" = 127.0.0.1 ] && echo TCP || echo "Unix-domain socket")"
echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(uname -sr), PostgreSQL $("$BIN/postgres" --version | awk '{print $3}'), $("$(pgbouncer_bin)" --version 2>/dev/null | head -1)"
echo
printf '| %-8s | %7s | %8s | %9s | %9s | %5s | %5s | %8s | %8s | %5s |\n' \
  mode clients direct "usher" "pgbouncer" "u/d" "u/p" "usher µs" "pgb µs" "u/p"
printf '|----------|---------|----------|-----------|-----------|-------|-------|----------|----------|-------|\n'
for mode in $MODES; do
  for c in $CLIENTS; do
    : >"$work/d"; : >"$work/u"; : >"$work/p"
    for r in $(seq "$ROUNDS"); do
      case $((r % 3)) in
        1) order="d u p" ;; 2) order="u p d" ;; *) order="p d u" ;;
      esac
      for who in $order; do
        case $who in
          d) run "$PGPORT" 0 "$mode" "$c" >>"$work/d" ;;
          u) run "$USHER_PORT" "$U_PID" "$mode" "$c" >>"$work/u" ;;
          p) if [ "$mode" != prepared ] || [ "$PGB_PREPARED" = 1 ]; then
               run "$PGB_PORT" "$PGB_PID" "$mode" "$c" >>"$work/p"
             fi ;;
        esac
      done
    done
    d=$(cut -d' ' -f1 "$work/d" | median)
    ut=$(cut -d' ' -f1 "$work/u" | median); uc=$(cut -d' ' -f2 "$work/u" | median)
    pt=$(cut -d' ' -f1 "$work/p" | median); pc=$(cut -d' ' -f2 "$work/p" | median)
    awk -v m="$mode" -v c="$c" -v d="$d" -v ut="$ut" -v uc="$uc" -v pt="$pt" -v pc="$pc" 'BEGIN {
      ud = (d > 0) ? sprintf("%.2f", ut / d) : "-"
      upt = (pt > 0) ? sprintf("%.2f", ut / pt) : "-"
      upc = (pc > 0) ? sprintf("%.2f", uc / pc) : "-"
      printf "| %-8s | %7s | %8s | %9s | %9s | %5s | %5s | %8s | %8s | %5s |\n", m, c, d, ut, (pt == "" ? "-" : pt), ud, upt, uc, (pc == "" ? "-" : pc), upc
    }'
  done
done
