#!/bin/bash
# Experiment: the scores on int8 tensor cores (`--define MMA_INT8_K`: keys dequantized in
# registers from an int8 codebook, queries quantized per head, mma.m16n8k32.s8) against the
# committed f16 formulation, on kvcore's head-major pages: accuracy (engram-gpu-check's decode
# rows with the define) and time, two rounds, one card.
set -u
mkdir -p /tmp/bin
for b in engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
nvidia-smi -L | tee $OUT/gpu.txt; date -u >> $OUT/gpu.txt
/tmp/bin/engram-gpu-check --define MMA_INT8_K > $OUT/gpu-check-int8.jsonl 2>&1
python3 - <<'PY'
import json,os
o=os.environ['OUT']; rows=[]
for l in open(f'{o}/gpu-check-int8.jsonl'):
    try: j=json.loads(l)
    except Exception: continue
    if j.get('check') in ('tq4_decode_mma',): rows.append(j)
for hd in (64,128):
    r=[x for x in rows if x['head_dim']==hd]
    if r: print(f'int8 decode rows d{hd}: {len(r)}, worst rel_l2 vs f64 {max(x["rel_l2"] for x in r):.3e}, worst vs f16 emulation {max(x["rel_l2_vs_emulation"] for x in r):.3e}, layouts identical {all(x["layouts_identical"] for x in r)}')
PY
A="--only attention --contexts 4096,32768,131072 --batches 1,16 --kernels mma --layouts head"
: > $OUT/int8.jsonl
for r in 1 2; do
  for v in f16 int8; do
    if [ $v = f16 ]; then D=""; else D="--define MMA_INT8_K"; fi
    /tmp/bin/engram-gpu-bench $A $D --out /tmp/b.jsonl > /dev/null 2>&1
    sed "s/^{/{\"round\":$r,\"variant\":\"$v\",/" /tmp/b.jsonl >> $OUT/int8.jsonl
  done
done
python3 - <<'PY'
import json,os
o=os.environ['OUT']; t={}
for l in open(f'{o}/int8.jsonl'):
    try: j=json.loads(l)
    except Exception: continue
    if j.get('bench')=='tq4_decode_mma' and j.get('planned'):
        t.setdefault((j['context'],j['batch']),{}).setdefault(j['variant'],[]).append(f"{j['seconds_per_layer']*1e6:.1f} ({100*j['share_of_read_bw']:.0f}%)")
for k in sorted(t): print(f'{k[0]//1024}K b{k[1]}: '+' | '.join(f'{v}: '+' / '.join(x) for v,x in sorted(t[k].items())))
PY
