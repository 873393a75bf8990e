# fingerprint probe: which side of the device check moves between identical runs
set -u
cd gpu-dist && python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" engram.xz engram && chmod +x engram && cd ..
E=gpu-dist/engram
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt
for i in 1 2 3; do $E check device --device cuda --shape smollm2-135m --weights f32 > $OUT/fp-$i.jsonl 2>/dev/null; done
for i in 1 2; do ENGRAM_CUDA_PREFILL=dense ENGRAM_CUDA_GLUE=candle $E check device --device cuda --shape smollm2-135m --weights f32 > $OUT/fp-dense-candle-$i.jsonl 2>/dev/null; done
python3 - <<'PY'
import json,os
o=os.environ['OUT']
for tag in ['fp-%d','fp-dense-candle-%d']:
    runs=[]
    for i in (1,2,3):
        f=os.path.join(o,(tag%i)+'.jsonl')
        if os.path.exists(f): runs.append([json.loads(l) for l in open(f) if '"phase"' in l])
    print(tag, 'runs', len(runs))
    for k in range(len(runs[0])):
        print(' ', runs[0][k]['phase'], runs[0][k]['step'], 'cpu', len({r[k]['cpu_logits_fnv'] for r in runs}), 'distinct; device', len({r[k]['device_logits_fnv'] for r in runs}), 'distinct; rel', ['%.2e'%r[k]['rel_l2'] for r in runs])
PY
