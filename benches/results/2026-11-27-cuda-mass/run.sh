#!/bin/bash
# Issue 25 on the GPU: the decode kernel's per-page mass records. Checks (gpu-check, check
# device with the mass comparison) and the mass variant's cost against the plain kernel, one card.
set -u
mkdir -p /tmp/bin
for b in engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" gpu-dist/engram.xz /tmp/bin/engram && chmod +x /tmp/bin/engram
nvidia-smi -L | tee $OUT/gpu.txt; nvidia-smi --query-gpu=driver_version --format=csv >> $OUT/gpu.txt; lscpu > $OUT/lscpu.txt
/tmp/bin/engram-gpu-check > $OUT/gpu-check.jsonl 2>$OUT/gpu-check.err; echo "gpu-check rc=$? rows=$(grep -c '"pass"' $OUT/gpu-check.jsonl) fails=$(grep -c '"pass":false' $OUT/gpu-check.jsonl)"
grep '"pass":false' $OUT/gpu-check.jsonl | head -3
grep tq4_decode_mma_mass $OUT/gpu-check.jsonl | python3 -c "
import json,sys
r=[json.loads(l) for l in sys.stdin]
print('mass rows',len(r),'worst vs dense %.3e'%max(x['mass_rel_l2'] for x in r),'worst vs emulation %.3e'%max(x['rel_l2_vs_emulation'] for x in r),'all identical',all(x['output_identical'] for x in r))"
A="--only attention --contexts 4096,32768 --batches 1,16 --kernels mma,mass --layouts token"
/tmp/bin/engram-gpu-bench $A --out $OUT/bench1.jsonl > /dev/null 2>&1
/tmp/bin/engram-gpu-bench $A --out $OUT/bench2.jsonl > /dev/null 2>&1
python3 - <<'PY'
import json,os
o=os.environ['OUT']
for f in ['bench1.jsonl','bench2.jsonl']:
    r={}
    for l in open(f'{o}/{f}'):
        try: j=json.loads(l)
        except: continue
        if j.get('bench') in ('tq4_decode_mma','tq4_decode_mma_mass') and j.get('planned',True):
            r.setdefault((j['context'],j['batch']),{})[j['bench']]=j['seconds_per_layer']*1e6
    for k,v in sorted(r.items()):
        a=v.get('tq4_decode_mma',float('nan')); b=v.get('tq4_decode_mma_mass',float('nan'))
        print(f, k, 'plain %.1f us'%a, 'mass %.1f us'%b, 'ratio %.3f'%(b/a))
PY
E=/tmp/bin/engram
for w in f32 bf16; do $E check device --device cuda --shape smollm2-135m --weights $w > $OUT/check-device-$w.jsonl 2>$OUT/check-device-$w.err; echo "check device $w rc $? $(tail -1 $OUT/check-device-$w.jsonl | cut -c1-400)"; done
grep mass_rel_l2 $OUT/check-device-f32.jsonl | head -3 | cut -c1-200
