#!/bin/bash
# Issue 22, H200, call 1: Engram with cudarc's event tracking off (the default now) — `engram
# check device`, the random-weight Llama-3-8B-shape bf16 GGUF written (llama.cpp's gguf-py, no
# build yet), one process at 4K/32K x b1/b16; then one process at 4K b1 with
# ENGRAM_CUDA_EVENTS=tracked (cudarc's tracking kept, as before this change).
set -u; mkdir -p /tmp/bin /tmp/gpu-peer
for b in engram-bench engram; do python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" gpu-dist/$b.xz /tmp/bin/$b && chmod +x /tmp/bin/$b; done
nvidia-smi -L | tee $OUT/gpu.txt; nvidia-smi --query-gpu=driver_version --format=csv >> $OUT/gpu.txt; lscpu > $OUT/lscpu.txt; date -u >> $OUT/gpu.txt
timeout 60 /tmp/bin/engram check device --device cuda --shape smollm2-135m > $OUT/check-device-smollm2.jsonl 2> $OUT/check-device.err; echo "check rc=$?"; tail -c 600 $OUT/check-device-smollm2.jsonl
tar xzf .gpu-peer/llama.cpp.tar.gz -C /tmp/gpu-peer
( time (python3 .gpu-peer/make_gguf.py /tmp/gpu-peer/llama3-8b-bf16.gguf.part bf16 /tmp/gpu-peer/llama.cpp/gguf-py && mv /tmp/gpu-peer/llama3-8b-bf16.gguf.part /tmp/gpu-peer/llama3-8b-bf16.gguf) ) > $OUT/gguf.txt 2>&1; echo "gguf rc=$?"; tail -4 $OUT/gguf.txt
OUT=$OUT timeout 210 bash .gpu-peer/e2e.sh engram /tmp/bin/engram-bench 4096,32768 1,16 64 > $OUT/e2e-engram-1.txt 2>&1; echo "engram 1 rc=$?"; tail -5 $OUT/e2e-engram-1.txt | cut -c1-420
ENGRAM_CUDA_EVENTS=tracked OUT=$OUT timeout 130 bash .gpu-peer/e2e.sh engram /tmp/bin/engram-bench 4096 1 64 > $OUT/e2e-engram-tracked.txt 2>&1; echo "engram tracked rc=$?"; tail -2 $OUT/e2e-engram-tracked.txt | cut -c1-420
