#!/usr/bin/env bash
# The differential run of tests/settings.rs (differential_against_postgres),
# longer than CI's: random clients beside direct connections to PostgreSQL,
# through usher on pool_size 1 and 2 in both pool modes; any difference in
# what a client is sent fails it, naming the seed and how to replay it.
#
#   scripts/differential.sh                      # 48 seeds x 300 steps per configuration
#   SEEDS=200 STEPS=500 scripts/differential.sh
#   FIRST_SEED=1234 CONFIGS="transaction/1" scripts/differential.sh
#   USHER_DIFF_SEED=1234 USHER_DIFF_CONFIGS=session/2 USHER_DIFF_STEPS=300 \
#     cargo test --test settings differential   # replay one seed
#
# SEEDS (48), STEPS (300), FIRST_SEED (random unless given), CONFIGS
# ("transaction/1 transaction/2 session/1 session/2").
set -euo pipefail
cd "$(dirname "$0")/.."
export USHER_DIFF_SEEDS=${SEEDS:-48}
export USHER_DIFF_STEPS=${STEPS:-300}
export USHER_DIFF_FIRST_SEED=${FIRST_SEED:-$(( (RANDOM << 15) | RANDOM ))}
if [ -n "${CONFIGS:-}" ]; then
  export USHER_DIFF_CONFIGS=$CONFIGS
fi
echo "differential run: seeds $USHER_DIFF_FIRST_SEED..$((USHER_DIFF_FIRST_SEED + USHER_DIFF_SEEDS - 1)) per configuration, $USHER_DIFF_STEPS steps each"
exec cargo test --test settings differential_against_postgres -- --nocapture
