#!/bin/bash
# Issue 22, H200, call 3: llama-server with q4_0 KV at 32K b16; then the machine held (sleep)
# while the fixed Engram binaries were built here.
set -u; OUT=$OUT timeout 200 bash .gpu-peer/run.sh serve 32768 16 q4_0 512 > $OUT/serve-q4.txt 2>&1; echo "serve q4_0 rc=$?"; tail -1 $OUT/serve-q4.txt | cut -c1-500; sleep 210; echo slept
# (a further `sleep 330` call held it until the build was done)
