#!/usr/bin/env bash
# The cut test of tests/it/cuts.rs, longer than CI's: clients cut at sampled
# byte offsets of pipelines, logins and result streams, in both pool modes
# with one and two workers, a canary client beside them; after each cut
# PostgreSQL must hold nothing the client did not sync and the next client
# must find a clean session.
#
#   scripts/cuts.sh                        # 40 cuts per scenario, 4 configurations
#   CUTS=200 scripts/cuts.sh
#   SEED=1234 CONFIGS=session:1 scripts/cuts.sh   # replay one seed
#
# CUTS (40), SEED (random unless given), CONFIGS (mode:workers, comma-separated;
# "transaction:1,session:2,session:1,transaction:2").
set -euo pipefail
cd "$(dirname "$0")/.."
export USHER_CUTS=${CUTS:-40}
export USHER_CUT_CONFIGS=${CONFIGS:-transaction:1,session:2,session:1,transaction:2}
if [ -n "${SEED:-}" ]; then
  export USHER_CUT_SEED=$SEED
fi
exec cargo test --test it cuts::a_client_cut_at_any_byte -- --nocapture
