#!/bin/bash
# Issue 22, H200: after the review (the two decode bodies share their page window, query
# rotation, fragments and partial write; the checks share their page uploads): the tensor-core
# decode checks and the decode times again.
set -u
mkdir -p /tmp/bin
for b in engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
nvidia-smi -L | tee $OUT/gpu.txt; date -u >> $OUT/gpu.txt
timeout 200 /tmp/bin/engram-gpu-check --only mma > $OUT/gpu-check-mma.jsonl 2>$OUT/err.txt
echo "gpu-check --only mma rc=$? rows=$(grep -c '"pass"' $OUT/gpu-check-mma.jsonl) fails=$(grep -c '"pass":false' $OUT/gpu-check-mma.jsonl)"; tail -2 $OUT/err.txt
grep '"pass":false' $OUT/gpu-check-mma.jsonl | head -3 | cut -c1-300
timeout 60 python3 gpu-dist/gpu_sdpa_baseline.py 4096,32768 1,16 > $OUT/sdpa.jsonl 2>&1
timeout 90 /tmp/bin/engram-gpu-bench --only attention --contexts 4096,32768 --batches 1,16 --kernels mma,mass --layouts head --out $OUT/bench.jsonl > /dev/null 2>$OUT/err.txt || tail -3 $OUT/err.txt
python3 - <<'PY'
import json,os
o=os.environ['OUT']; s={}
for l in open(f'{o}/sdpa.jsonl'):
    try: j=json.loads(l)
    except Exception: continue
    if j.get('bench')=='bf16_sdpa': s[(j['context'],j['batch'])]=j['seconds_per_layer']*1e6
for l in open(f'{o}/bench.jsonl'):
    try: j=json.loads(l)
    except Exception: continue
    if j.get('bench') in ('tq4_decode_mma','tq4_decode_mma_mass') and j.get('planned',True):
        sd=s.get((j['context'],j['batch']),0); v=j['seconds_per_layer']*1e6
        print(f"{j['context']//1024}K b{j['batch']} {j['bench']}: {v:.1f} us ({100*j['share_of_read_bw']:.0f}%, {sd/v:.2f}x SDPA {sd:.1f})")
PY
rm -f $OUT/err.txt
