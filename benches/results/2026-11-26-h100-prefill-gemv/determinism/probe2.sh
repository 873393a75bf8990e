set -u
cd gpu-dist && python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]),open(sys.argv[2],'wb'))" engram.xz engram && chmod +x engram && cd ..
E=gpu-dist/engram
for i in 1 2; do ENGRAM_CUDA_PREFILL=dense $E check device --device cuda --shape smollm2-135m --weights f32 > $OUT/dense-$i.jsonl 2>/dev/null; echo "dense $i: $(head -1 $OUT/dense-$i.jsonl | cut -c1-60)"; done
for i in 1 2; do ENGRAM_CUDA_GLUE=candle $E check device --device cuda --shape smollm2-135m --weights f32 > $OUT/candle-$i.jsonl 2>/dev/null; echo "candle glue $i: $(head -1 $OUT/candle-$i.jsonl | cut -c1-60)"; done
for i in 1 2; do ENGRAM_CUDA_GLUE=candle ENGRAM_CUDA_PREFILL=dense $E check device --device cuda --shape smollm2-135m --weights f32 > $OUT/both-$i.jsonl 2>/dev/null; echo "candle+dense $i: $(head -1 $OUT/both-$i.jsonl | cut -c1-60)"; done
for i in 1 2; do CUBLAS_WORKSPACE_CONFIG=:0:0 $E check device --device cuda --shape smollm2-135m --weights f32 > $OUT/ws-$i.jsonl 2>/dev/null; echo "no cublas workspace $i: $(head -1 $OUT/ws-$i.jsonl | cut -c1-60)"; done
