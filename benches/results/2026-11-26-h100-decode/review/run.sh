set -u
mkdir -p /tmp/bin; for b in gb-old engram-gpu-bench engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
nvidia-smi -L | tee $OUT/gpu.txt
/tmp/bin/engram-gpu-check > $OUT/gpu-check.jsonl 2>/dev/null; echo "gpu-check rc=$? rows=$(grep -c '"pass"' $OUT/gpu-check.jsonl) fails=$(grep -c '"pass":false' $OUT/gpu-check.jsonl)"; tail -1 $OUT/gpu-check.jsonl
for r in 1 2; do for b in gb-old engram-gpu-bench; do /tmp/bin/$b --only prefill --contexts 4096,32768 --out $OUT/prefill-$b-$r.jsonl > /dev/null 2>&1; /tmp/bin/$b --only attention --contexts 4096,32768 --batches 1,16 --kernels mma --layouts token --out $OUT/decode-$b-$r.jsonl > /dev/null 2>&1; done; done
for f in $OUT/prefill-*.jsonl $OUT/decode-*.jsonl; do echo "$(basename $f) $(grep -h 'tq4_prefill_mma\|tq4_decode_mma' $f | python3 -c "
import sys,json
print(' '.join(f\"{j.get('context')}/{j.get('batch',j.get('tiles',''))}:{j.get('seconds_per_layer',j.get('seconds',0))*1e6:.1f}\" for j in map(json.loads,sys.stdin)))")"; done
cd $OUT && tar czf benches.tgz prefill-*.jsonl decode-*.jsonl && rm prefill-*.jsonl decode-*.jsonl
