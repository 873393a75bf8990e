#!/bin/bash
# Issue 25's load (the defaults: hot tier 40 % of the working set, cold tier unbounded, staging
# on), priority-only against attention-aware eviction, four repetitions in alternating order
# (P A, A P, P A, A P), TTFT compared turn by turn. Build first:
#   cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-ttft-repeated
rm -rf /tmp/ev/rep && mkdir -p /tmp/ev
lscpu > $R/lscpu.txt
$B eviction --turns ${TURNS:-120} --repeat ${REPEAT:-4} --policy '{"mode":"priority"}' \
    --policy '{"mode":"attention"}' --dir /tmp/ev/rep \
    > $R/eviction-${TURNS:-120}-x${REPEAT:-4}.json 2> $R/eviction-${TURNS:-120}-x${REPEAT:-4}.err
