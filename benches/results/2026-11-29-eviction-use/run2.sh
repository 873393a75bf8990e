#!/bin/bash
B=/root/.cache/engram-target/debug/engram-bench
cd /work/main
$B eviction --turns 120 --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' --dir /tmp/ev/d2 > /tmp/ev/run2.json 2> /tmp/ev/run2.err
$B eviction --turns 120 --seed 1 --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' --dir /tmp/ev/d3 > /tmp/ev/seed1.json 2> /tmp/ev/seed1.err
$B eviction --turns 120 --seed 2 --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' --dir /tmp/ev/d4 > /tmp/ev/seed2.json 2> /tmp/ev/seed2.err
echo finished > /tmp/ev/done
