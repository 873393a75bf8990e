#!/bin/bash
# The engine on the GPU with head-major pages against the CPU engine (`engram check device`), and
# an experiment: tile t + D requested into L2 while tile t computes (`--define MMA_L2_AHEAD=D`),
# against the committed kernel, one card, two rounds.
set -u
mkdir -p /tmp/bin
for b in engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" gpu-dist/engram.xz /tmp/bin/engram && chmod +x /tmp/bin/engram
nvidia-smi -L | tee $OUT/gpu.txt; date -u >> $OUT/gpu.txt
E=/tmp/bin/engram
for w in f32 bf16; do $E check device --device cuda --shape smollm2-135m --weights $w > $OUT/check-device-$w.jsonl 2>$OUT/check-device-$w.err; echo "check device $w rc $? $(tail -1 $OUT/check-device-$w.jsonl | cut -c1-400)"; done
A="--only attention --contexts 4096,32768,131072 --batches 1,16 --kernels mma --layouts head"
: > $OUT/l2.jsonl
for r in 1 2; do
  for d in 0 2 4 8; do
    if [ $d = 0 ]; then D=""; else D="--define MMA_L2_AHEAD=$d"; fi
    /tmp/bin/engram-gpu-bench $A $D --out /tmp/b.jsonl > /dev/null 2>&1
    sed "s/^{/{\"round\":$r,\"ahead\":$d,/" /tmp/b.jsonl >> $OUT/l2.jsonl
  done
done
python3 - <<'PY'
import json,os
o=os.environ['OUT']; t={}
for l in open(f'{o}/l2.jsonl'):
    try: j=json.loads(l)
    except Exception: continue
    if j.get('bench')=='tq4_decode_mma' and j.get('planned'):
        t.setdefault((j['context'],j['batch']),{}).setdefault(j['ahead'],[]).append(j['seconds_per_layer']*1e6)
for k in sorted(t):
    print(f'{k[0]//1024}K b{k[1]}: '+' | '.join(f'ahead {d}: '+'/'.join(f'{x:.1f}' for x in v) for d,v in sorted(t[k].items())))
PY
cd $OUT && rm -f check-device-*.err
