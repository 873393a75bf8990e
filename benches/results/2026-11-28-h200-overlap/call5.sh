#!/bin/bash
# Issue 22, H200, call 5 (same machine): a third Engram process at 4K and 32K, batch 1.
set -u; OUT=$OUT timeout 150 bash .gpu-peer/e2e.sh engram /tmp/bin/engram-bench 4096,32768 1 64 > $OUT/e2e-engram-3.txt 2>&1; echo "engram 3 rc=$?"; tail -3 $OUT/e2e-engram-3.txt | cut -c1-420
