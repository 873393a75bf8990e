#!/bin/bash
# Aging the use counts (issue 25, `[eviction] use_half_life`): issue 25's load (hot tier 40 % of
# the working set, default cold tier), interleaved turn by turn in one run.
#   shift:  popularity shifts at steady turn 60 of 120 (Zipf rank k draws agent k + 6 mod 12):
#           priority-only, attention-aware with the default half-life (65,536 sampled steps: no
#           halving within this bench), and half-lives of 1,024 and 256 sampled steps.
#   steady: no shift, the default half-life against 1,024 and 256 (what aging costs when the
#           popularity holds).
# Build first:
#   cargo build -p engram-benches --bin engram-bench
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
R=benches/results/2026-11-29-eviction-aging
mkdir -p /tmp/ev
lscpu > $R/lscpu.txt
if [ "${1:-shift}" = shift ]; then
    rm -rf /tmp/ev/shift
    $B eviction --turns 120 --shift-at 60 --interleave \
        --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' \
        --policy '{"mode":"attention","use_half_life":1024}' \
        --policy '{"mode":"attention","use_half_life":256}' --dir /tmp/ev/shift \
        > $R/shift.json 2> $R/shift.err
else
    rm -rf /tmp/ev/steady
    $B eviction --turns 120 --interleave \
        --policy '{"mode":"attention"}' \
        --policy '{"mode":"attention","use_half_life":1024}' \
        --policy '{"mode":"attention","use_half_life":256}' --dir /tmp/ev/steady \
        > $R/steady.json 2> $R/steady.err
fi
