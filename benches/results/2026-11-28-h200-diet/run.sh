#!/bin/bash
# Issue 22, H200: the decode kernel's head-major entry point (page offsets by one multiply-add
# per plane, rows at immediate offsets) against the general path on the same pages, an L1
# prefetch of the next tiles' lines, and 16-warp CTAs (one pair table an SM, one CTA an SM).
#   bash benches/results/2026-11-28-h200-diet/run.sh   (repository root; gpu-dist/ carried)
set -u
mkdir -p /tmp/bin
for b in engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
nvidia-smi -L | tee $OUT/gpu.txt; nvidia-smi --query-gpu=driver_version --format=csv >> $OUT/gpu.txt; lscpu > $OUT/lscpu.txt; date -u >> $OUT/gpu.txt
for d in none MMA_CTA_WARPS=16; do
  if [ $d = none ]; then D=""; else D="--define $d"; fi
  timeout 150 /tmp/bin/engram-gpu-check $D > $OUT/gpu-check-$d.jsonl 2>$OUT/gpu-check.err
  echo "gpu-check $d rc=$? rows=$(grep -c '"pass"' $OUT/gpu-check-$d.jsonl) fails=$(grep -c '"pass":false' $OUT/gpu-check-$d.jsonl)"
  grep '"pass":false' $OUT/gpu-check-$d.jsonl | head -3 | cut -c1-300
done
timeout 120 python3 gpu-dist/gpu_sdpa_baseline.py 4096,32768 1,16 > $OUT/sdpa.jsonl 2>&1
: > $OUT/bench.jsonl
A="--only attention --contexts 4096,32768 --batches 1,16 --kernels mma --layouts head"
for r in 1 2; do
  for v in MMA_NO_HM_FAST none MMA_L1_AHEAD=1 MMA_L1_AHEAD=2 MMA_CTA_WARPS=16 MMA_CTA_WARPS=16,MMA_L1_AHEAD=1 MMA_CTA_WARPS=16,MMA_L1_AHEAD=2 MMA_CTA_WARPS=16,MMA_L1_AHEAD=4; do
    if [ $v = none ]; then D=""; else D="--define $v"; fi
    timeout 60 /tmp/bin/engram-gpu-bench $A $D --out /tmp/b.jsonl > /dev/null 2>&1 || echo "bench $v rc=$?"
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
    if j.get('bench')=='read_stream': print('read ceiling', j['bytes_per_s']/1e12, 'TB/s')
    if j.get('bench')=='tq4_decode_mma' and j.get('planned',True):
        t.setdefault((j['variant'],j['context'],j['batch']),[]).append((j['seconds_per_layer']*1e6,j['share_of_read_bw']))
for k in sorted(t, key=lambda k:(k[1],k[2],k[0])):
    sd=s.get((k[1],k[2]))
    print(f"{k[1]//1024}K b{k[2]} {k[0]:36s} "+' / '.join(f"{v:.1f} us ({100*b:.0f}%, {sd/v if sd else 0:.2f}x)" for v,b in t[k]), f"sdpa {sd:.1f}" if sd else '')
PY
rm -f $OUT/gpu-check.err
