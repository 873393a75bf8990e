#!/bin/bash
# Decode-kernel experiments, 32K b16 (one process per variant).
set -u
mkdir -p /tmp/bin && gunzip -c gpu-dist/engram-gpu-bench.gz > /tmp/bin/gb && chmod +x /tmp/bin/gb
nvidia-smi -L | tee $OUT/gpu.txt; lscpu > $OUT/lscpu.txt
B=/tmp/bin/gb
run() { # name defines layouts [extra]
  local name=$1 defs=$2 lay=$3; shift 3
  if [ -n "$defs" ]; then D="--define $defs"; else D=""; fi
  $B --only attention --kernels mma --contexts 32768 --batches 16 --layouts $lay $D "$@" 2>&1 | grep tq4_decode_mma | sed "s/^/$name /" | tee -a $OUT/exp.txt
}
python3 benches/gpu_sdpa_baseline.py 32768,4096 16,1 2>&1 | tee $OUT/sdpa.txt
run base "" token,head --mma-chunks 1024,4096
run hm8 "MMA_KV_HEADS=8,MMA_HEAD_MAJOR" head
run hm8_l1pf1 "MMA_KV_HEADS=8,MMA_HEAD_MAJOR,MMA_L1_PREFETCH=1" head
run hm8_l1pf2 "MMA_KV_HEADS=8,MMA_HEAD_MAJOR,MMA_L1_PREFETCH=2" head
run hm8_l1pf4 "MMA_KV_HEADS=8,MMA_HEAD_MAJOR,MMA_L1_PREFETCH=4" head
run hm_l2_256 "MMA_L2_PREFETCH=256" head,token
run hm_l2_128 "MMA_L2_PREFETCH=128" head,token
run tm_l1pf1 "MMA_L1_PREFETCH=1" token,head
run floor "MMA_PROFILE_NO_QK,MMA_PROFILE_NO_PV" token,head
run floor_l1pf2 "MMA_PROFILE_NO_QK,MMA_PROFILE_NO_PV,MMA_KV_HEADS=8,MMA_HEAD_MAJOR,MMA_L1_PREFETCH=2" head
run base2 "" token,head
which ncu && timeout 200 ncu --clock-control none -k regex:tq4_decode_mma --launch-skip 3 -c 1 --set full --import-source no -o $OUT/ncu-hm8 $B --only attention --kernels mma --contexts 32768 --batches 16 --layouts head --reps 2 --warmup 1 --define MMA_KV_HEADS=8,MMA_HEAD_MAJOR > $OUT/ncu-run.txt 2>&1
ls -la $OUT
