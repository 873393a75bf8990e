#!/bin/bash
# Issue 22, H200, call 2 (the machine call 1 left warm): llama.cpp's CUDA build, then
# llama-server (flash attention, f16 KV) at 4K and 32K prompts, batch 1, 64 tokens. The machine
# was released before the next call (30 s idle), so calls 3-5 start again on a fresh one.
set -u; ( time bash .gpu-peer/run.sh build ) > $OUT/build.txt 2>&1; echo "build rc=$?"; tail -4 $OUT/build.txt; OUT=$OUT timeout 150 bash .gpu-peer/e2e.sh peer 4096,32768 1 f16 64 > $OUT/e2e-peer.txt 2>&1; echo "peer b1 rc=$?"; tail -2 $OUT/e2e-peer.txt | cut -c1-400
