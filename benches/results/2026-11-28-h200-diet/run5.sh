#!/bin/bash
# Issue 22, H200, the committed code: every kernel check (with the wide form's row) and the
# engine on the card against the CPU engine (`engram check device`, f32 and bf16 weights).
set -u
mkdir -p /tmp/bin
for b in engram-gpu-check; do gunzip -c gpu-dist/$b.gz > /tmp/bin/$b; chmod +x /tmp/bin/$b; done
python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" gpu-dist/engram.xz /tmp/bin/engram && chmod +x /tmp/bin/engram
nvidia-smi -L | tee $OUT/gpu.txt; nvidia-smi --query-gpu=driver_version --format=csv >> $OUT/gpu.txt; lscpu > $OUT/lscpu.txt; date -u >> $OUT/gpu.txt
for w in f32 bf16; do
  timeout 120 /tmp/bin/engram check device --device cuda --shape smollm2-135m --weights $w > $OUT/check-device-$w.jsonl 2>$OUT/check-device-$w.err
  echo "check device $w rc=$? $(tail -1 $OUT/check-device-$w.jsonl | cut -c1-600)"
  tail -2 $OUT/check-device-$w.err
done
timeout 330 /tmp/bin/engram-gpu-check > $OUT/gpu-check.jsonl 2>$OUT/gpu-check.err
echo "gpu-check rc=$? rows=$(grep -c '"pass"' $OUT/gpu-check.jsonl) fails=$(grep -c '"pass":false' $OUT/gpu-check.jsonl)"
grep '"pass":false' $OUT/gpu-check.jsonl | head -3 | cut -c1-400; grep 'mma_wide' $OUT/gpu-check.jsonl; tail -3 $OUT/gpu-check.err
rm -f $OUT/*.err
