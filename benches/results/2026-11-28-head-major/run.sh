#!/bin/bash
# Head-major pages in kvcore (issue 22): the kernel checks and decode
# attention on kvcore's (now head-major) pages and on token-major pages beside bf16 SDPA, one card.
#   bash benches/results/2026-11-28-head-major/run.sh      (from the repository root; gpu-dist/ carried)
set -u
mkdir -p /tmp/bin
for b in engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
nvidia-smi -L | tee $OUT/gpu.txt; nvidia-smi --query-gpu=driver_version --format=csv >> $OUT/gpu.txt; lscpu > $OUT/lscpu.txt; date -u >> $OUT/gpu.txt
/tmp/bin/engram-gpu-check > $OUT/gpu-check.jsonl 2>$OUT/gpu-check.err; echo "gpu-check rc=$? rows=$(grep -c '"pass"' $OUT/gpu-check.jsonl) fails=$(grep -c '"pass":false' $OUT/gpu-check.jsonl)"
grep '"pass":false' $OUT/gpu-check.jsonl | head -3 | cut -c1-300
A="--only attention --contexts 4096,32768,131072 --batches 1,16"
for r in 1 2; do
  python3 gpu-dist/gpu_sdpa_baseline.py 4096,32768,131072 1,16 > $OUT/sdpa$r.jsonl 2>&1
  /tmp/bin/engram-gpu-bench $A --kernels mma,mass --layouts head,token --out $OUT/bench$r.jsonl > /dev/null 2>&1
done
python3 - <<'PY'
import json,os
o=os.environ['OUT']
for r in (1,2):
    t={}; read=None
    for f in (f'sdpa{r}.jsonl', f'bench{r}.jsonl'):
        for l in open(f'{o}/{f}'):
            try: j=json.loads(l)
            except Exception: continue
            b=j.get('bench')
            if b=='read_stream': read=j['bytes_per_s']
            if b=='bf16_sdpa': t[('sdpa',j['context'],j['batch'])]=j['seconds_per_layer']*1e6
            if b in ('tq4_decode_mma','tq4_decode_mma_mass') and j.get('planned',True):
                t[(b.replace('tq4_decode_','')+':'+j['layout'],j['context'],j['batch'])]=(j['seconds_per_layer']*1e6,j['share_of_read_bw'])
    print(f'round {r}: read ceiling {read/1e12 if read else 0:.2f} TB/s')
    for (ctx,b) in sorted(set((k[1],k[2]) for k in t)):
        s=t.get(('sdpa',ctx,b))
        row=[f'{ctx//1024}K b{b}', f'sdpa {s:.1f}' if s else 'sdpa -']
        for k in ('mma:HeadMajor','mma:TokenMajor','mma_mass:HeadMajor'):
            v=t.get((k,ctx,b))
            if v: row.append(f'{k} {v[0]:.1f} us ({s/v[0] if s else 0:.2f}x, {100*v[1]:.0f}%)')
        print('  '+' | '.join(row))
PY
cd $OUT && rm -f gpu-check.err
