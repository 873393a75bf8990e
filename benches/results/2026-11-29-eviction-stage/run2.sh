#!/bin/bash
# Two more draws of the same load (seeds 1 and 2), the defaults: priority-only against
# attention-aware eviction, the bridge staging.
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/ev
for seed in 1 2; do
    $B eviction --turns 120 --seed $seed --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' \
        --dir /tmp/ev/d2-$seed > /tmp/ev/stage-seed$seed.json 2> /tmp/ev/stage-seed$seed.err
done
echo finished > /tmp/ev/done2
