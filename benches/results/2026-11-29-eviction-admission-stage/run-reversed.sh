#!/bin/bash
# Seed 2 again with the policies in the other order (attention-aware first), to tell a policy's
# TTFT from the run's drift. Build first: cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-admission-stage
rm -rf /tmp/ev/r2 && mkdir -p /tmp/ev
$B eviction --turns 120 --seed 2 --policy '{"mode":"attention"}' --policy '{"mode":"priority"}' \
    --dir /tmp/ev/r2 > $R/eviction-120-seed2-reversed.json 2> $R/eviction-120-seed2-reversed.err
