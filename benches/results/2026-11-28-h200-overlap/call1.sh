#!/bin/bash
# Issue 22, H200, the step's host work off the critical path: call 1 of 3 (one warm machine).
# llama.cpp's CUDA build and the random-weight Llama-3-8B-shape bf16 GGUF (run.sh build), then
# Engram's engine at 32K prompts, batch 16, 64 tokens (process 1).
set -u
mkdir -p /tmp/bin
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" gpu-dist/engram-bench.xz /tmp/bin/engram-bench && chmod +x /tmp/bin/engram-bench
nvidia-smi -L | tee $OUT/gpu.txt; nvidia-smi --query-gpu=driver_version --format=csv >> $OUT/gpu.txt; lscpu > $OUT/lscpu.txt; date -u >> $OUT/gpu.txt
( time bash .gpu-peer/run.sh build ) > $OUT/build.txt 2>&1; echo "build rc=$?"; tail -5 $OUT/build.txt
OUT=$OUT timeout 190 bash .gpu-peer/e2e.sh engram /tmp/bin/engram-bench 32768 16 64 > $OUT/e2e-engram-b16-1.txt 2>&1
echo "engram b16 rc=$?"; tail -3 $OUT/e2e-engram-b16-1.txt | cut -c1-600
