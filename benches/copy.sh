#!/usr/bin/env bash
# Large results: COPY of ROWS rows (10 million by default) out of and into
# PostgreSQL, directly and through usher (transaction mode), in one run:
# interleaved rounds, medians of the time each took, rows per second and
# usher/direct ratios (issue 14's bar: at least 0.95). COPY OUT goes to
# /dev/null through psql; COPY IN reads the file the first COPY OUT wrote.
#
#   benches/copy.sh                    # 10M rows, 3 rounds
#   ROWS=1000000 ROUNDS=5 benches/copy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/pg-env.sh
ensure_postgres_installed
ROWS=${ROWS:-10000000}
ROUNDS=${ROUNDS:-3}
. benches/lib.sh

export PGPASSWORD=bench-pw
q() { psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U bench bench "${@:2}"; }
echo "filling copy_out with $ROWS rows..." >&2
q "$PGPORT" -c "CREATE TABLE copy_out (id bigint, balance int, note text)" \
  -c "INSERT INTO copy_out SELECT g, g % 100000, md5(g::text) FROM generate_series(1, $ROWS) g" \
  -c "CREATE UNLOGGED TABLE copy_in (LIKE copy_out)" -c "VACUUM ANALYZE copy_out"
q "$PGPORT" -c "COPY copy_out TO STDOUT" >"$work/rows.copy"
size=$(stat -c %s "$work/rows.copy")

USHER_PORT=$(free_port)
mkdir -p "$work/no-hooks"
USHER_SECRET=$(scram_verifier bench) start_usher usher "$USHER_PORT" "hooks: { dir: $work/no-hooks }"

# timed PORT out|in: seconds one COPY took.
timed() {
  local start end
  [ "$2" = in ] && q "$1" -c "TRUNCATE copy_in"
  start=$(date +%s.%N)
  if [ "$2" = out ]; then
    q "$1" -c "COPY copy_out TO STDOUT" >/dev/null
  else
    q "$1" -c "\\copy copy_in FROM '$work/rows.copy'"
  fi
  end=$(date +%s.%N)
  awk -v s="$start" -v e="$end" 'BEGIN { printf "%.3f\n", e - s }'
}

echo
echo "COPY of $ROWS rows ($((size / 1048576)) MiB as text), $ROUNDS interleaved rounds, medians; usher in transaction mode"
printf '| %-8s | %9s | %9s | %12s | %12s | %5s |\n' direction "direct s" "usher s" "direct rows/s" "usher rows/s" "u/d"
printf '|----------|-----------|-----------|--------------|--------------|-------|\n'
for dir in out in; do
  : >"$work/d"; : >"$work/u"
  for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then order="d u"; else order="u d"; fi
    for who in $order; do
      case $who in
        d) timed "$PGPORT" "$dir" >>"$work/d" ;;
        u) timed "$USHER_PORT" "$dir" >>"$work/u" ;;
      esac
    done
  done
  d=$(median <"$work/d"); u=$(median <"$work/u")
  awk -v dir="$dir" -v d="$d" -v u="$u" -v n="$ROWS" 'BEGIN {
    printf "| %-8s | %9.2f | %9.2f | %12.0f | %12.0f | %5.2f |\n", dir, d, u, n / d, n / u, d / u
  }'
done
