#!/bin/bash
# Decode kernel with the folded combine: checks, old vs new (same card), SDPA, check device.
set -u
mkdir -p /tmp/bin
for b in gb-old engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" gpu-dist/engram.xz /tmp/bin/engram && chmod +x /tmp/bin/engram
nvidia-smi -L | tee $OUT/gpu.txt; nvidia-smi --query-gpu=driver_version --format=csv >> $OUT/gpu.txt; lscpu > $OUT/lscpu.txt
/tmp/bin/engram-gpu-check > $OUT/gpu-check.jsonl 2>$OUT/gpu-check.err; echo "gpu-check rc=$? rows=$(grep -c '"pass"' $OUT/gpu-check.jsonl) fails=$(grep -c '"pass":false' $OUT/gpu-check.jsonl)"; tail -1 $OUT/gpu-check.jsonl
grep '"pass":false' $OUT/gpu-check.jsonl | head -3
A="--only attention --contexts 4096,32768,131072 --batches 1,16"
python3 gpu-dist/gpu_sdpa_baseline.py 4096,32768,131072 1,16 > $OUT/sdpa.jsonl 2>&1
/tmp/bin/gb-old $A --kernels mma --layouts token,head --out $OUT/old.jsonl > /dev/null 2>&1
/tmp/bin/engram-gpu-bench $A --kernels fp32,mma --layouts token,head --out $OUT/new.jsonl > /dev/null 2>&1
/tmp/bin/gb-old $A --kernels mma --layouts token --out $OUT/old2.jsonl > /dev/null 2>&1
/tmp/bin/engram-gpu-bench $A --kernels mma --layouts token --out $OUT/new2.jsonl > /dev/null 2>&1
/tmp/bin/engram-gpu-bench --only attention --contexts 1024,2048 --batches 1,16,64 --kernels mma --layouts token --out $OUT/new-short.jsonl > /dev/null 2>&1
/tmp/bin/gb-old --only attention --contexts 1024,2048 --batches 1,16,64 --kernels mma --layouts token --out $OUT/old-short.jsonl > /dev/null 2>&1
cat $OUT/*.jsonl > $OUT/all-benches.txt 2>/dev/null; python3 - <<'PY'
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
sd=load('sdpa.jsonl'); runs={f:load(f) for f in ['old.jsonl','new.jsonl','old2.jsonl','new2.jsonl','old-short.jsonl','new-short.jsonl']}
keys=sorted(set(k for f in runs for k in runs[f] if isinstance(k,tuple)))
for k in keys:
    s=sd.get(('sdpa',k[1],k[2]))
    vals=' '.join(f"{f[:-6]}={runs[f].get(k,float('nan')):.1f}" for f in runs)
    print(k, vals, f"sdpa={s:.1f}" if s else '')
print('read', {f: round(runs[f].get('read',0)/1e12,3) for f in runs})
PY
E=/tmp/bin/engram
for w in f32 bf16; do $E check device --device cuda --shape smollm2-135m --weights $w > $OUT/check-device-$w.jsonl 2>$OUT/check-device-$w.err; echo "check device $w rc $? $(tail -1 $OUT/check-device-$w.jsonl | cut -c1-300)"; done
cd $OUT && tar czf benches.tgz old.jsonl new.jsonl old2.jsonl new2.jsonl old-short.jsonl new-short.jsonl sdpa.jsonl && rm -f old.jsonl new.jsonl old2.jsonl new2.jsonl old-short.jsonl new-short.jsonl sdpa.jsonl all-benches.txt check-device-*.err gpu-check.err; ls $OUT
