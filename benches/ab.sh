#!/usr/bin/env bash
# Two usher builds side by side, in one run: pgbench -S against PostgreSQL
# directly, through usher A and through usher B (transaction mode), in
# interleaved rounds; prints median tps, B/A, and each usher's CPU time per
# transaction (user + system from /proc/PID/stat, over the transactions
# pgbench reports). Use it to show that a change costs nothing (or what it
# gains): build the commit before it into a binary, then
#
#   git worktree add /tmp/before <commit> && (cd /tmp/before && cargo build --release)
#   USHER_B=/tmp/before/target/release/usher benches/ab.sh
#
# A defaults to this tree's release build. ROUNDS (3), DURATION (5 s),
# CLIENTS ("1 10 50"), MODES ("simple extended prepared"), POOL_SIZE (20).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed

DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-3}
JOBS=${JOBS:-2}
CLIENTS=${CLIENTS:-"1 10 50"}
MODES=${MODES:-"simple extended prepared"}
. benches/lib.sh
USHER_A=${USHER_A:-target/release/usher}
: "${USHER_B:?set USHER_B to the other usher binary}"
mkdir -p "$work/no-hooks"
A_PORT=$(free_port)
B_PORT=$(free_port)
start_usher a "$A_PORT" "hooks: { dir: $work/no-hooks }" "$USHER_A"
A_PID=$USHER_PID
start_usher b "$B_PORT" "hooks: { dir: $work/no-hooks }" "$USHER_B"
B_PID=$USHER_PID

export PGPASSWORD=bench-pw
pgbench -i -q -s 10 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
echo
printf '%-9s %7s | %8s | %8s %8s %6s | %9s %9s\n' mode clients direct "A tps" "B tps" "B/A" "A us/txn" "B us/txn"
for mode in $MODES; do
  for c in $CLIENTS; do
    : >"$work/d"; : >"$work/a"; : >"$work/b"
    for r in $(seq "$ROUNDS"); do
      # Rotate the order each round, so neither build always goes first.
      case $((r % 3)) in
        1) order="d a b" ;; 2) order="a b d" ;; *) order="b d a" ;;
      esac
      for who in $order; do
        case $who in
          d) run "$PGPORT" 0 "$mode" "$c" >>"$work/d" ;;
          a) run "$A_PORT" "$A_PID" "$mode" "$c" >>"$work/a" ;;
          b) run "$B_PORT" "$B_PID" "$mode" "$c" >>"$work/b" ;;
        esac
      done
    done
    d=$(cut -d' ' -f1 "$work/d" | median)
    at=$(cut -d' ' -f1 "$work/a" | median); ac=$(cut -d' ' -f2 "$work/a" | median)
    bt=$(cut -d' ' -f1 "$work/b" | median); bc=$(cut -d' ' -f2 "$work/b" | median)
    awk -v m="$mode" -v c="$c" -v d="$d" -v at="$at" -v bt="$bt" -v ac="$ac" -v bc="$bc" \
      'BEGIN { printf "%-9s %7s | %8s | %8s %8s %6.2f | %9s %9s\n", m, c, d, at, bt, (at > 0 ? bt / at : 0), ac, bc }'
  done
done
