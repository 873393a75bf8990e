#!/bin/bash
# Issue 22, H200, call 2 (the machine call 1 left warm): llama-server (flash attention, f16 KV,
# one slot per sequence) at 32K prompts, batch 16, 512 tokens each; then at 4K and 32K prompts,
# batch 1, 64 tokens.
set -u; OUT=$OUT timeout 280 bash .gpu-peer/run.sh serve 32768 16 f16 512 > $OUT/serve-f16.txt 2>&1; echo "serve f16 rc=$?"; tail -1 $OUT/serve-f16.txt | cut -c1-500; OUT=$OUT timeout 250 bash .gpu-peer/e2e.sh peer 4096,32768 1 f16 64 > $OUT/e2e-peer.txt 2>&1; echo "peer b1 rc=$?"; tail -2 $OUT/e2e-peer.txt | cut -c1-400
