#!/bin/bash
# Issue 25's load with the cold tier bounded (COLD share of the working set, default 0.3; shadow
# off, so a block the cold tier drops is recomputed: the policy decides misses, and TTFT depends
# on it): priority-only, attention-aware, and priority-only with every block hot (hot_share 1.0:
# the TTFT no eviction beats), interleaved turn by turn in one run. Build first:
#   cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-cold-interleaved
C=${COLD:-0.3}
T=${TURNS:-120}
rm -rf /tmp/ev/cold && mkdir -p /tmp/ev
lscpu > $R/lscpu.txt
$B eviction --turns $T --cold-share $C --interleave \
    --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' \
    --policy '{"mode":"priority","hot_share":1.0}' --dir /tmp/ev/cold \
    > $R/cold$C-$T.json 2> $R/cold$C-$T.err
