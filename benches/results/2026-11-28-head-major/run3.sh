#!/bin/bash
# What bounds the kernel on kvcore's head-major pages on this card (32K and 128K, batch 16): the
# committed kernel against itself with the scores' lookups and MMAs left out
# (MMA_PROFILE_NO_QK), the values' (MMA_PROFILE_NO_PV), and both (the load structure alone;
# wrong results, timing only), and a chunk sweep. Two rounds.
set -u
mkdir -p /tmp/bin
gunzip -c gpu-dist/engram-gpu-bench.gz > /tmp/bin/engram-gpu-bench; chmod +x /tmp/bin/engram-gpu-bench
nvidia-smi -L | tee $OUT/gpu.txt; date -u >> $OUT/gpu.txt
A="--only attention --contexts 32768,131072 --batches 16 --kernels mma --layouts head,token"
: > $OUT/bound.jsonl
for r in 1 2; do
  for v in none MMA_PROFILE_NO_QK MMA_PROFILE_NO_PV MMA_PROFILE_NO_QK,MMA_PROFILE_NO_PV; do
    if [ $v = none ]; then D="--mma-chunks 512,1024,4096"; else D="--define $v"; fi
    /tmp/bin/engram-gpu-bench $A $D --out /tmp/b.jsonl > /dev/null 2>&1
    sed "s/^{/{\"round\":$r,\"variant\":\"$v\",/" /tmp/b.jsonl >> $OUT/bound.jsonl
  done
done
python3 - <<'PY'
import json,os
o=os.environ['OUT']; t={}
for l in open(f'{o}/bound.jsonl'):
    try: j=json.loads(l)
    except Exception: continue
    if j.get('bench')=='tq4_decode_mma':
        k=(j['context'],j['layout'],j['variant'] if j.get('planned') else f"chunk {j['chunk']}")
        t.setdefault(k,[]).append(f"{j['seconds_per_layer']*1e6:.1f} ({100*j['share_of_read_bw']:.0f}%)")
for k in sorted(t): print(f'{k[0]//1024}K b16 {k[1]} {k[2]}: '+' / '.join(t[k]))
PY
