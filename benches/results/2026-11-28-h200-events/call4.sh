#!/bin/bash
# Issue 22, H200, call 4 (the machine call 3 left warm): Engram (event tracking off) at 4K/32K x
# b1/b16 and `engram check device`; then llama-server q4_0 KV at 32K b16 if time is left.
set -u; mkdir -p /tmp/bin
for b in engram-bench engram; do python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" gpu-dist/$b.xz /tmp/bin/$b && chmod +x /tmp/bin/$b; done
OUT=$OUT timeout 230 bash .gpu-peer/e2e.sh engram /tmp/bin/engram-bench 4096,32768 1,16 64 > $OUT/e2e-engram-1.txt 2>&1; echo "engram 1 rc=$?"; tail -4 $OUT/e2e-engram-1.txt | cut -c1-420
timeout 60 /tmp/bin/engram check device --device cuda --shape smollm2-135m > $OUT/check-device-smollm2.jsonl 2> $OUT/check-device.err; echo "check rc=$?"; tail -c 300 $OUT/check-device-smollm2.jsonl
OUT=$OUT timeout 150 bash .gpu-peer/run.sh serve 32768 16 q4_0 512 > $OUT/serve-q4.txt 2>&1; echo "serve q4_0 rc=$?"; tail -1 $OUT/serve-q4.txt | cut -c1-500
