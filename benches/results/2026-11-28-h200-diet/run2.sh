#!/bin/bash
# Issue 22, H200: how the order of a sequence's pages in the pool moves the decode kernel (runs
# of N consecutive slots in shuffled order; 0 = every sequence's pages in order), and the load
# structure alone at each order.
set -u
mkdir -p /tmp/bin
gunzip -c gpu-dist/engram-gpu-bench.gz > /tmp/bin/engram-gpu-bench; chmod +x /tmp/bin/engram-gpu-bench
nvidia-smi -L | tee $OUT/gpu.txt; date -u >> $OUT/gpu.txt
timeout 120 python3 gpu-dist/gpu_sdpa_baseline.py 4096,32768,131072 1,16 > $OUT/sdpa.jsonl 2>&1
: > $OUT/bench.jsonl
for r in 1 2; do
  for pr in 1 16 256 0; do
    for v in none MMA_PROFILE_NO_QK,MMA_PROFILE_NO_PV; do
      if [ $v = none ]; then D=""; C="4096,32768,131072"; else D="--define $v"; C="32768"; fi
      timeout 90 /tmp/bin/engram-gpu-bench --only attention --contexts $C --batches 1,16 --kernels mma --layouts head --page-run $pr $D --out /tmp/b.jsonl > /dev/null 2>&1 || echo "bench $pr $v rc=$?"
      sed "s/^{/{\"round\":$r,\"variant\":\"$v\",/" /tmp/b.jsonl >> $OUT/bench.jsonl
    done
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
        t.setdefault((j['context'],j['batch'],j['variant'],j['page_run']),[]).append((j['seconds_per_layer']*1e6,j['share_of_read_bw']))
for k in sorted(t):
    sd=s.get((k[0],k[1]))
    print(f"{k[0]//1024}K b{k[1]} {k[2]:36s} run {k[3]:4d}: "+' / '.join(f"{v:.1f} us ({100*b:.0f}%, {sd/v if sd else 0:.2f}x)" for v,b in t[k]), f"sdpa {sd:.1f}" if sd else '')
PY
