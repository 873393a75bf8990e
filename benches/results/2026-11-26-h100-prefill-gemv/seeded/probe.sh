# check device with seeded CPU random weights: run-to-run fingerprints, f32 and bf16
set -u
cd gpu-dist && python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" engram.xz engram && chmod +x engram && cd ..
E=gpu-dist/engram
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt; cat $OUT/gpu.txt
for w in f32 bf16; do for i in 1 2; do $E check device --device cuda --shape smollm2-135m --weights $w > $OUT/seeded-$w-$i.jsonl 2>/dev/null; echo "$w $i rc $? $(tail -1 $OUT/seeded-$w-$i.jsonl | cut -c1-200)"; done; done
ENGRAM_CUDA_PREFILL=dense $E check device --device cuda --shape smollm2-135m --weights f32 > $OUT/seeded-f32-dense.jsonl 2>/dev/null; echo "dense rc $? $(tail -1 $OUT/seeded-f32-dense.jsonl | cut -c1-200)"
python3 - <<'PY'
import json,os
o=os.environ['OUT']
for w in ('f32','bf16'):
    runs=[[json.loads(l) for l in open(os.path.join(o,f'seeded-{w}-{i}.jsonl')) if '"phase"' in l] for i in (1,2)]
    cpu=all(a['cpu_logits_fnv']==b['cpu_logits_fnv'] for a,b in zip(*runs))
    dev=all(a['device_logits_fnv']==b['device_logits_fnv'] for a,b in zip(*runs))
    print(w,'cpu logits identical across runs:',cpu,'device logits identical:',dev)
PY
