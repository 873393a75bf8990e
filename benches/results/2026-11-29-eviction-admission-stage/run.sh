#!/bin/bash
# The bench's draw, 120 steady turns, the defaults (the bridge staging in admission's eviction
# order): priority-only against attention-aware eviction, one run. Build first:
#   cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-admission-stage
rm -rf /tmp/ev/d2 && mkdir -p /tmp/ev
lscpu > $R/lscpu.txt
$B eviction --turns ${TURNS:-120} --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' \
    --dir /tmp/ev/d2 > $R/eviction-${TURNS:-120}.json 2> $R/eviction-${TURNS:-120}.err
