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
#
# The run has two passes, the second with the two ushers started in the
# other order (a run of one pass favoured the usher started second), and
# the rounds take the six orders of direct, A and B in turn: each median
# is over 2 x ROUNDS runs, half of them from each pass.
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
ORDERS=("d a b" "a b d" "b d a" "d b a" "b a d" "a d b")

# start_both FIRST: starts usher a and b, FIRST (a or b) first.
start_both() {
  local who
  for who in $1 $([ "$1" = a ] && echo b || echo a); do
    if [ "$who" = a ]; then
      start_usher a "$A_PORT" "hooks: { dir: $work/no-hooks }" "$USHER_A"; A_PID=$USHER_PID
    else
      start_usher b "$B_PORT" "hooks: { dir: $work/no-hooks }" "$USHER_B"; B_PID=$USHER_PID
    fi
  done
}

stop_both() {
  kill "$A_PID" "$B_PID"
  wait "$A_PID" "$B_PID" 2>/dev/null || true
}

export PGPASSWORD=bench-pw
pgbench -i -q -s 10 -h 127.0.0.1 -p "$PGPORT" -U bench bench >/dev/null 2>&1
for mode in $MODES; do
  for c in $CLIENTS; do
    : >"$work/$mode.$c.d"; : >"$work/$mode.$c.a"; : >"$work/$mode.$c.b"
  done
done
for pass in 1 2; do
  echo "pass $pass: usher $([ $pass = 1 ] && echo A || echo B) started first" >&2
  start_both "$([ $pass = 1 ] && echo a || echo b)"
  for mode in $MODES; do
    for c in $CLIENTS; do
      for r in $(seq "$ROUNDS"); do
        order=${ORDERS[$(( ((pass - 1) * ROUNDS + r - 1) % 6 ))]}
        for who in $order; do
          case $who in
            d) run "$PGPORT" 0 "$mode" "$c" >>"$work/$mode.$c.d" ;;
            a) run "$A_PORT" "$A_PID" "$mode" "$c" >>"$work/$mode.$c.a" ;;
            b) run "$B_PORT" "$B_PID" "$mode" "$c" >>"$work/$mode.$c.b" ;;
          esac
        done
      done
    done
  done
  stop_both
done

echo
printf '%-9s %7s | %8s | %8s %8s %6s | %9s %9s\n' mode clients direct "A tps" "B tps" "B/A" "A us/txn" "B us/txn"
for mode in $MODES; do
  for c in $CLIENTS; do
    f="$work/$mode.$c"
    d=$(cut -d' ' -f1 "$f.d" | median)
    at=$(cut -d' ' -f1 "$f.a" | median); ac=$(cut -d' ' -f2 "$f.a" | median)
    bt=$(cut -d' ' -f1 "$f.b" | median); bc=$(cut -d' ' -f2 "$f.b" | median)
    awk -v m="$mode" -v c="$c" -v d="$d" -v at="$at" -v bt="$bt" -v ac="$ac" -v bc="$bc" \
      'BEGIN { printf "%-9s %7s | %8s | %8s %8s %6.2f | %9s %9s\n", m, c, d, at, bt, (at > 0 ? bt / at : 0), ac, bc }'
  done
done
