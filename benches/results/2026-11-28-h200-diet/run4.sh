#!/bin/bash
# Issue 22, H200: the committed kernels — head-major pages staged through shared memory
# (tq4_decode_mma_hm, 8-warp CTAs, or _wide 16-warp CTAs for long items over the whole card)
# against register double buffering on token-major pages; every check; decode attention beside
# bf16 SDPA, two rounds; the planned chunk and a sweep at 32K batch 16.
set -u
mkdir -p /tmp/bin
for b in engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
nvidia-smi -L | tee $OUT/gpu.txt; nvidia-smi --query-gpu=driver_version --format=csv >> $OUT/gpu.txt; lscpu > $OUT/lscpu.txt; date -u >> $OUT/gpu.txt
timeout 280 /tmp/bin/engram-gpu-check > $OUT/gpu-check.jsonl 2>$OUT/gpu-check.err
echo "gpu-check rc=$? rows=$(grep -c '"pass"' $OUT/gpu-check.jsonl) fails=$(grep -c '"pass":false' $OUT/gpu-check.jsonl)"
grep '"pass":false' $OUT/gpu-check.jsonl | head -3 | cut -c1-400; tail -3 $OUT/gpu-check.err
: > $OUT/bench.jsonl
for r in 1 2; do
  timeout 100 python3 gpu-dist/gpu_sdpa_baseline.py 4096,32768,131072 1,16 > $OUT/sdpa$r.jsonl 2>&1
  timeout 120 /tmp/bin/engram-gpu-bench --only attention --contexts 4096,32768,131072 --batches 1,16 --kernels mma,mass --layouts head,token --out /tmp/b.jsonl > /dev/null 2>/tmp/err.txt || { echo "bench rc=$?"; tail -3 /tmp/err.txt; }
  sed "s/^{/{\"round\":$r,/" /tmp/b.jsonl >> $OUT/bench.jsonl
done
timeout 60 /tmp/bin/engram-gpu-bench --only attention --contexts 32768 --batches 16 --kernels mma --layouts head --mma-chunks 512,1024,4096 --out $OUT/sweep.jsonl > /dev/null 2>&1
python3 - <<'PY'
import json,os
o=os.environ['OUT']; t={}; s={}
for r in (1,2):
    for l in open(f'{o}/sdpa{r}.jsonl'):
        try: j=json.loads(l)
        except Exception: continue
        if j.get('bench')=='bf16_sdpa': s.setdefault((j['context'],j['batch']),[]).append(j['seconds_per_layer']*1e6)
for f in ('bench.jsonl','sweep.jsonl'):
    for l in open(f'{o}/{f}'):
        try: j=json.loads(l)
        except Exception: continue
        if j.get('bench')=='read_stream': print('read ceiling', round(j['bytes_per_s']/1e12,3), 'TB/s')
        if j.get('bench') in ('tq4_decode_mma','tq4_decode_mma_mass'):
            k=(j['context'],j['batch'],j['bench'][14:]+':'+j['layout']+('' if j.get('planned',True) else f" chunk {j['chunk']}"))
            t.setdefault(k,[]).append((j['seconds_per_layer']*1e6,j['share_of_read_bw']))
for k in sorted(t):
    sd=s.get((k[0],k[1]),[0,0])
    print(f"{k[0]//1024}K b{k[1]} {k[2]:24s}: "+' / '.join(f"{v:.1f} us ({100*b:.0f}%, {sd[min(i,len(sd)-1)]/v:.2f}x)" for i,(v,b) in enumerate(t[k])), "sdpa "+' / '.join(f"{x:.1f}" for x in sd))
PY
rm -f $OUT/gpu-check.err
