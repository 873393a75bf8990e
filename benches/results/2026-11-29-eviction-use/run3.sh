#!/bin/bash
while [ ! -f /tmp/ev/done ]; do sleep 5; done
B=/root/.cache/engram-target/debug/engram-bench
cd /work/main
$B eviction --turns 120 --cold-share 0.3 --policy '{"mode":"priority"}' --policy '{"mode":"attention"}' --dir /tmp/ev/d5 > /tmp/ev/cold.json 2> /tmp/ev/cold.err
echo finished > /tmp/ev/done3
