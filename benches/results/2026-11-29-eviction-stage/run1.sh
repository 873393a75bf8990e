#!/bin/bash
# The bench's draw, 60 steady turns (a slower machine: see README), the defaults with the bridge
# staging: priority-only against attention-aware eviction, one run.
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/ev
$B eviction --turns 60 --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' \
    --dir /tmp/ev/d1 > /tmp/ev/stage.json 2> /tmp/ev/stage.err
echo finished > /tmp/ev/done1
