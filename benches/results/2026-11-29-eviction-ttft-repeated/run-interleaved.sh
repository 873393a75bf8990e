#!/bin/bash
# Issue 25's load (defaults: hot tier 40 % of the working set, cold tier unbounded, staging on):
# priority-only, attention-aware, and priority-only with every block hot (hot_share 1.0: the
# TTFT no eviction policy can beat), interleaved turn by turn in one run (each turn goes to the
# three servers before the next turn, the order flipping every turn), one repetition by default (REPEAT=n for more). Build
# first:
#   cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-ttft-repeated
rm -rf /tmp/ev/il && mkdir -p /tmp/ev
lscpu > $R/lscpu.txt
$B eviction --turns ${TURNS:-120} --repeat ${REPEAT:-1} --interleave \
    --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' \
    --policy '{"mode":"priority","hot_share":1.0}' --dir /tmp/ev/il \
    > $R/interleaved-${TURNS:-120}-x${REPEAT:-1}.json 2> $R/interleaved-${TURNS:-120}-x${REPEAT:-1}.err
