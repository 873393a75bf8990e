#!/bin/bash
# Issue 22, H200: pages staged through shared memory by the copy engine (cp.async.bulk into a
# ring of MMA_TMA pages per warp, mbarrier completion) against register double buffering.
set -u
mkdir -p /tmp/bin
for b in engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
nvidia-smi -L | tee $OUT/gpu.txt; date -u >> $OUT/gpu.txt
n=0
for d in none MMA_CTA_WARPS=16,MMA_TMA=4 MMA_TMA=2; do
  n=$((n+1)); if [ $d = none ]; then D=""; else D="--define $d"; fi
  timeout 100 /tmp/bin/engram-gpu-check --only mma $D > $OUT/check$n.jsonl 2>&1
  echo "gpu-check $d rc=$? rows=$(grep -c '"pass"' $OUT/check$n.jsonl) fails=$(grep -c '"pass":false' $OUT/check$n.jsonl)"
  grep '"pass":false' $OUT/check$n.jsonl | head -3 | cut -c1-400
  grep -v '"pass"' $OUT/check$n.jsonl | head -5 | cut -c1-300
done
timeout 120 python3 gpu-dist/gpu_sdpa_baseline.py 4096,32768,131072 1,16 > $OUT/sdpa.jsonl 2>&1
: > $OUT/bench.jsonl
for r in 1 2; do
  for v in none MMA_TMA=2 MMA_CTA_WARPS=16,MMA_TMA=2 MMA_CTA_WARPS=16,MMA_TMA=3 MMA_CTA_WARPS=16,MMA_TMA=4; do
    if [ $v = none ]; then D=""; else D="--define $v"; fi
    timeout 90 /tmp/bin/engram-gpu-bench --only attention --contexts 4096,32768,131072 --batches 1,16 --kernels mma --layouts head $D --out /tmp/b.jsonl > /dev/null 2>/tmp/err.txt || { echo "bench $v rc=$?"; tail -3 /tmp/err.txt; }
    sed "s/^{/{\"round\":$r,\"variant\":\"$v\",/" /tmp/b.jsonl >> $OUT/bench.jsonl
  done
done
python3 - <<'PY'
import json,os
o=os.environ['OUT']; t={}; s={}
for l in open(f'{o}/sdpa.jsonl'):
    try: j=json.loads(l)
    except Exception: continue
    if j.get('bench')=='bf16_sdpa': s[(j['context'],j['batch'])]=j['seconds_per_layer']*1e6
for l in open(f'{o}/bench.jsonl'):
    try: j=json.loads(l)
    except Exception: continue
    if j.get('bench')=='tq4_decode_mma' and j.get('planned',True):
        t.setdefault((j['context'],j['batch'],j['variant']),[]).append((j['seconds_per_layer']*1e6,j['share_of_read_bw']))
for k in sorted(t):
    sd=s.get((k[0],k[1]))
    print(f"{k[0]//1024}K b{k[1]} {k[2]:30s}: "+' / '.join(f"{v:.1f} us ({100*b:.0f}%, {sd/v if sd else 0:.2f}x)" for v,b in t[k]), f"sdpa {sd:.1f}" if sd else '')
PY
