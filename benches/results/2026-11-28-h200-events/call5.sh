#!/bin/bash
# Issue 22, H200, call 5 (same machine as calls 3-4): a second Engram process at 4K/32K x b1/b16.
set -u; mkdir -p /tmp/bin; ls /tmp/bin/engram-bench >/dev/null && OUT=$OUT timeout 200 bash .gpu-peer/e2e.sh engram /tmp/bin/engram-bench 4096,32768 1,16 64 > $OUT/e2e-engram-2.txt 2>&1; echo "engram 2 rc=$?"; tail -4 $OUT/e2e-engram-2.txt | cut -c1-300
