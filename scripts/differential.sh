#!/usr/bin/env bash
# The differential runs, longer than CI's: random clients beside direct
# connections to PostgreSQL, through usher on pool_size 1 and 2 in both
# pool modes; any difference in what a client is sent fails it, naming the
# seed and how to replay it.
#   settings (default): tests/it/settings.rs, differential_against_postgres
#   --extended: tests/it/extended_protocol.rs (issue 26: Parse/Bind/Describe/
#     Execute/Close/Sync/Flush, transactions and DDL, beside a twin
#     database); CONFIGS may also name `direct`, the harness's self-check;
#     LEAVE_OUT (e.g. "stale ddl") sets parts of the generator
#     aside (its default: the module doc's; LEAVE_OUT= puts all back)
#
#   scripts/differential.sh                      # 48 seeds x 300 steps per configuration
#   SEEDS=200 STEPS=500 scripts/differential.sh
#   FIRST_SEED=1234 CONFIGS="transaction/1" scripts/differential.sh --extended
#   USHER_DIFF_SEED=1234 USHER_DIFF_CONFIGS=session/2 USHER_DIFF_STEPS=300 \
#     cargo test --test it settings::differential   # replay one seed
#
# SEEDS (48), STEPS (300), FIRST_SEED (random unless given), CONFIGS
# ("transaction/1 transaction/2 session/1 session/2").
set -euo pipefail
cd "$(dirname "$0")/.."
test=settings::
filter=differential_against_postgres
if [ "${1:-}" = --extended ]; then
  test=extended_protocol::
  filter=extended_protocol_differential_against_postgres
fi
export USHER_DIFF_SEEDS=${SEEDS:-48}
export USHER_DIFF_STEPS=${STEPS:-300}
export USHER_DIFF_FIRST_SEED=${FIRST_SEED:-$(( (RANDOM << 15) | RANDOM ))}
if [ -n "${LEAVE_OUT+set}" ]; then
  export USHER_DIFF_LEAVE_OUT=$LEAVE_OUT
fi
export USHER_DIFF_CONFIGS=${CONFIGS:-transaction/1 transaction/2 session/1 session/2}
echo "$test differential run: seeds $USHER_DIFF_FIRST_SEED..$((USHER_DIFF_FIRST_SEED + USHER_DIFF_SEEDS - 1)) per configuration ($USHER_DIFF_CONFIGS), $USHER_DIFF_STEPS steps each"
exec cargo test --test it "$test$filter" -- --nocapture
