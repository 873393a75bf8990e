#!/bin/bash
# Where a turn's time goes at cold 30 %: the eviction bench under perf (cpu-clock sampling; this
# machine has no hardware counters), one policy per process, 60 steady turns. Build first:
#   cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-ttft-repeated
mkdir -p /tmp/ev /tmp/prof
for m in priority attention; do
    rm -rf /tmp/ev/prof-$m
    perf record -F 499 -e cpu-clock -o /tmp/prof/$m.data -- $B eviction --turns 60 \
        --cold-share 0.3 --policy "{\"mode\":\"$m\"}" --dir /tmp/ev/prof-$m \
        > $R/profile-cold30-$m.json 2> /tmp/prof/$m.err
    perf report -i /tmp/prof/$m.data --no-children --sort sym --stdio > /tmp/prof/$m.txt
done
