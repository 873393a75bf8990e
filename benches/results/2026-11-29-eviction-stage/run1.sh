#!/bin/bash
# The bench's draw: the bridge spilling ahead (stage off, as before) and staging (the new
# default), priority-only and attention-aware eviction, one run.
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/ev
$B eviction --turns 120 --policy '{"mode":"priority","stage":false}' --policy '{"mode":"attention","stage":false}' \
    --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' --dir /tmp/ev/d1 > /tmp/ev/stage.json 2> /tmp/ev/stage.err
echo finished > /tmp/ev/done1
