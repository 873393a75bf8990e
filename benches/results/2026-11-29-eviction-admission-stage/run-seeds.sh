#!/bin/bash
# The same comparison as run.sh on two other draws of the load (--seed 1, --seed 2), 120 steady
# turns each, one run per draw. Build first:
#   cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-admission-stage
mkdir -p /tmp/ev
for seed in 1 2; do
    rm -rf /tmp/ev/s$seed
    $B eviction --turns 120 --seed $seed --policy '{"mode":"priority"}' \
        --policy '{"mode":"attention"}' --dir /tmp/ev/s$seed \
        > $R/eviction-120-seed$seed.json 2> $R/eviction-120-seed$seed.err
done
