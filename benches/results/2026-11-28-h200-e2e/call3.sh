#!/bin/bash
# Issue 22, H200, call 3 of 3: llama-server at 32K prompts, batch 16 (16 slots), 512 tokens each,
# f16 KV and then q4_0 KV.
set -u
OUT=$OUT timeout 280 bash .gpu-peer/run.sh serve 32768 16 f16 512 > $OUT/serve-f16.txt 2>&1; echo "serve f16 rc=$?"; tail -1 $OUT/serve-f16.txt | cut -c1-500
OUT=$OUT timeout 280 bash .gpu-peer/run.sh serve 32768 16 q4_0 512 > $OUT/serve-q4.txt 2>&1; echo "serve q4_0 rc=$?"; tail -1 $OUT/serve-q4.txt | cut -c1-500
