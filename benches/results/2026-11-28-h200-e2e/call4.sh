#!/bin/bash
# Issue 22, H200: Engram alone after the host-walk fix, with the step breakdown (`step_ms` in
# each JSON line). A fresh machine: the GGUF is written again (make_gguf.py, same seed), then one
# process at 4K/32K x b1/b16 and a second at 32K b16.
set -u
mkdir -p /tmp/bin /tmp/gpu-peer
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" gpu-dist/engram-bench.xz /tmp/bin/engram-bench && chmod +x /tmp/bin/engram-bench
nvidia-smi -L | tee $OUT/gpu.txt; lscpu > $OUT/lscpu.txt; date -u >> $OUT/gpu.txt
tar xzf .gpu-peer/llama.cpp.tar.gz -C /tmp/gpu-peer llama.cpp/gguf-py
start=$(date +%s)
python3 .gpu-peer/make_gguf.py /tmp/gpu-peer/llama3-8b-bf16.gguf bf16 /tmp/gpu-peer/llama.cpp/gguf-py > $OUT/gguf.txt 2>&1
echo "gguf rc=$? $(($(date +%s) - start)) s"
OUT=$OUT timeout 240 bash .gpu-peer/e2e.sh engram /tmp/bin/engram-bench 4096,32768 1,16 64 > $OUT/e2e-engram.txt 2>&1
echo "engram rc=$?"; grep "^e2e" $OUT/e2e-engram.txt
OUT=$OUT timeout 200 bash .gpu-peer/e2e.sh engram /tmp/bin/engram-bench 32768 16 64 > $OUT/e2e-engram-b16.txt 2>&1
echo "engram b16 rc=$?"; grep "^e2e" $OUT/e2e-engram-b16.txt
