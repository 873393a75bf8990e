#!/bin/bash
# Issue 22, H200, a fresh machine (the first one was released between calls), call 3: llama.cpp's
# CUDA build and the GGUF (run.sh build), llama-server f16 KV at 32K b16 (512 tokens) and at
# 4K/32K b1 (64 tokens).
set -u; mkdir -p /tmp/bin
nvidia-smi -L | tee $OUT/gpu.txt; nvidia-smi --query-gpu=driver_version --format=csv >> $OUT/gpu.txt; lscpu > $OUT/lscpu.txt; date -u >> $OUT/gpu.txt
( time bash .gpu-peer/run.sh build ) > $OUT/build.txt 2>&1; echo "build rc=$?"; tail -4 $OUT/build.txt
OUT=$OUT timeout 120 bash .gpu-peer/run.sh serve 32768 16 f16 512 > $OUT/serve-f16.txt 2>&1; echo "serve f16 rc=$?"; tail -1 $OUT/serve-f16.txt | cut -c1-500
OUT=$OUT timeout 70 bash .gpu-peer/e2e.sh peer 4096,32768 1 f16 64 > $OUT/e2e-peer.txt 2>&1; echo "peer b1 rc=$?"; tail -2 $OUT/e2e-peer.txt | cut -c1-400
