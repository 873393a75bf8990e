#!/bin/bash
# Issue 22, H200, call 2 of 3 (the machine call 1 left warm: /tmp/gpu-peer and /tmp/bin kept):
# llama-server (flash attention, f16 KV) at 4K and 32K prompts, batch 1, 64 tokens; then Engram
# at 32K batch 16.
set -u
OUT=$OUT timeout 260 bash .gpu-peer/e2e.sh peer 4096,32768 1 f16 64 > $OUT/e2e-peer.txt 2>&1
echo "peer b1 rc=$?"; tail -2 $OUT/e2e-peer.txt | cut -c1-400
OUT=$OUT timeout 300 bash .gpu-peer/e2e.sh engram /tmp/bin/engram-bench 32768 16 64 > $OUT/e2e-engram-b16.txt 2>&1
echo "engram b16 rc=$?"; tail -2 $OUT/e2e-engram-b16.txt | cut -c1-300
