# determinism probe: the same check twice on one machine, CUDA and CPU
set -u
cd gpu-dist && python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" engram.xz engram && chmod +x engram && cd ..
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/gpu.txt; cat $OUT/gpu.txt
for i in 1 2 3; do gpu-dist/engram check device --device cuda --shape smollm2-135m --weights f32 > $OUT/cuda-f32-$i.jsonl 2>/dev/null; echo "cuda $i: $(head -2 $OUT/cuda-f32-$i.jsonl | cut -c1-70 | tr '\n' ' ')"; done
for i in 1 2; do gpu-dist/engram check device --device cpu --shape smollm2-135m > $OUT/cpu-$i.jsonl 2>/dev/null; echo "cpu $i: $(head -2 $OUT/cpu-$i.jsonl | cut -c1-70 | tr '\n' ' ')"; done
ENGRAM_CUDA_PREFILL=dense gpu-dist/engram check device --device cuda --shape smollm2-135m --weights f32 > $OUT/cuda-f32-dense.jsonl 2>/dev/null; echo "dense: $(head -2 $OUT/cuda-f32-dense.jsonl | cut -c1-70 | tr '\n' ' ')"
