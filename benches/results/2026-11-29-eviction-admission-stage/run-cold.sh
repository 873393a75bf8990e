#!/bin/bash
# The bench's draw with the cold tier bounded too (30 % of the working set; the bench turns the
# shadow off, so a block the cold tier drops is recomputed), the defaults with staging: the case
# where eviction changes what is computed. Build first:
#   cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-admission-stage
rm -rf /tmp/ev/c3 && mkdir -p /tmp/ev
$B eviction --turns 120 --cold-share 0.3 --policy '{"mode":"priority"}' \
    --policy '{"mode":"attention"}' --dir /tmp/ev/c3 \
    > $R/eviction-120-cold30.json 2> $R/eviction-120-cold30.err
