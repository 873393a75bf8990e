#!/bin/bash
# Whole chains (issue 25, `[eviction] whole_chains`): issue 25's load (hot tier 40 % of the working
# set), priority-only, attention-aware (the defaults then: block by block) and attention-aware ranking whole chains,
# interleaved turn by turn in one run.
#   cold:    the cold tier bounded to 30 % of the working set, shadow off (a dropped block is
#            recomputed; a turn whose conversation lost blocks replays them first)
#   default: the default cold tier (it holds the load)
# Build first:
#   cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-whole-chains
mkdir -p /tmp/ev
lscpu > $R/lscpu.txt
M=${1:-cold}
rm -rf /tmp/ev/whole-$M
EXTRA=()
[ "$M" = cold ] && EXTRA=(--cold-share 0.3)
$B eviction --turns 120 "${EXTRA[@]}" --interleave \
    --policy '{"mode":"priority"}' --policy '{"mode":"attention","whole_chains":false}' \
    --policy '{"mode":"attention","whole_chains":true}' --dir /tmp/ev/whole-$M \
    > $R/$M.json 2> $R/$M.err
