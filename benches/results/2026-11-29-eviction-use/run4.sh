#!/bin/bash
# The tier loop off (only admissions move blocks), the bench's draw and seed 1.
B=${CARGO_TARGET_DIR:-$HOME/.cache/engram-target}/debug/engram-bench
cd "$(dirname "$0")/../../.."
$B eviction --turns 120 --no-tier-loop --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' --dir /tmp/ev/d6 > /tmp/ev/noloop.json 2> /tmp/ev/noloop.err
$B eviction --turns 120 --no-tier-loop --seed 1 --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' --dir /tmp/ev/d7 > /tmp/ev/noloop-seed1.json 2> /tmp/ev/noloop-seed1.err
echo finished > /tmp/ev/done4
