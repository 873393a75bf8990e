#!/bin/bash
# Persistent decode kernel: checks, then old vs new on one card, SDPA in the same run.
set -u
mkdir -p /tmp/bin
for b in gb-old engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
nvidia-smi -L | tee $OUT/gpu.txt; nvidia-smi --query-gpu=driver_version,clocks.max.sm,clocks.max.mem --format=csv >> $OUT/gpu.txt; lscpu > $OUT/lscpu.txt
/tmp/bin/engram-gpu-check > $OUT/gpu-check.jsonl 2>$OUT/gpu-check.err; echo "gpu-check rc=$?"; tail -1 $OUT/gpu-check.jsonl
grep -c '"pass":false' $OUT/gpu-check.jsonl; grep '"pass":false' $OUT/gpu-check.jsonl | head -5
A="--only attention --contexts 4096,32768,131072 --batches 1,16"
python3 gpu-dist/gpu_sdpa_baseline.py 4096,32768,131072 1,16 > $OUT/sdpa.jsonl 2>&1
/tmp/bin/gb-old $A --kernels mma --layouts token,head --out $OUT/old.jsonl > /dev/null 2>&1
/tmp/bin/engram-gpu-bench $A --kernels fp32,mma --layouts token,head --out $OUT/new.jsonl > /dev/null 2>&1
/tmp/bin/gb-old $A --kernels mma --layouts token --out $OUT/old2.jsonl > /dev/null 2>&1
/tmp/bin/engram-gpu-bench $A --kernels mma --layouts token --out $OUT/new2.jsonl > /dev/null 2>&1
python3 - <<'PY'
import json,os
o=os.environ['OUT']
def load(f):
    r={}
    for l in open(f'{o}/{f}'):
        try: j=json.loads(l)
        except: continue
        if j.get('bench')=='tq4_decode_mma' and j.get('planned',True): r[(j['layout'],j['context'],j['batch'])]=j['seconds_per_layer']*1e6
        if j.get('bench')=='bf16_sdpa': r[('sdpa',j['context'],j['batch'])]=j['seconds_per_layer']*1e6
        if j.get('bench')=='read_stream': r['read']=j['bytes_per_s']
    return r
sd=load('sdpa.jsonl'); runs={f:load(f) for f in ['old.jsonl','new.jsonl','old2.jsonl','new2.jsonl']}
for k in sorted(x for x in runs['new.jsonl'] if isinstance(x,tuple)):
    s=sd.get(('sdpa',k[1],k[2]))
    vals=' '.join(f"{f[:-6]}={runs[f].get(k,float('nan')):.1f}" for f in runs)
    print(k, vals, f"sdpa={s:.1f}" if s else '')
PY
