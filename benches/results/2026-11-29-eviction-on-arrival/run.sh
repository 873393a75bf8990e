#!/bin/bash
# Hot hit rate on arrival (issue 25): issue 25's load (hot tier 40 % of the working set, cold tier
# bounded to 30 %, shadow off: a dropped block is recomputed, a turn whose conversation lost
# blocks replays them first), priority-only, attention-aware (the defaults then: block by block) and attention-aware ranking
# whole chains, interleaved turn by turn in one run; each turn's blocks counted where they were
# when it arrived (`cache.arrival`), before the replay.
# Build first:
#   cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-on-arrival
mkdir -p /tmp/ev
lscpu > $R/lscpu.txt
rm -rf /tmp/ev/arrival
$B eviction --turns 120 --cold-share 0.3 --interleave \
    --policy '{"mode":"priority"}' --policy '{"mode":"attention","whole_chains":false}' \
    --policy '{"mode":"attention","whole_chains":true}' --dir /tmp/ev/arrival \
    > $R/cold.json 2> $R/cold.err
