#!/usr/bin/env bash
# On the GPU machine, from the folder prepare.sh filled (.gpu-peer/): builds llama.cpp with CUDA
# (llama-batched-bench, llama-bench, llama-server) and measures it on a random-weight Llama-3-8B-shape GGUF
# (bf16) with llama-batched-bench:
# prompt processing (TTFT at batch 1 = T_PP) and generation (time per output token = T_TG / ntg)
# at each prompt length and batch, with flash attention, f16 KV and again q4_0 KV.
#
#   ./run.sh build                      # cmake + build (~5 min on 16 cores) and the GGUF, in parallel
#   ./run.sh bench 4096 1,16 [NTG]      # one prompt length, batches; $OUT/peer-p4096-b1-16-kvf16.txt …
#   ./run.sh serve 32768 16 f16 [NTG]   # llama-server (flash attention, KV type f16 or q4_0, one
#                                       # slot per sequence) timed by serve_client.py: one JSON
#                                       # line appended to $OUT/peer-serve.jsonl
#
# The work folder ($WORK, default /tmp/gpu-peer) must survive between the two: run them in one
# command, or in calls that find the machine still warm.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
W="${WORK:-/tmp/gpu-peer}"
OUT="${OUT:-$HERE/out}"
mkdir -p "$W" "$OUT"
GGUF="$W/llama3-8b-bf16.gguf"
case "${1:-}" in
build)
  [ -d "$W/llama.cpp" ] || tar xzf "$HERE/llama.cpp.tar.gz" -C "$W"
  # Written aside and renamed, so that a half-written file is never read.
  if [ -f "$GGUF" ]; then
    echo "kept $GGUF" >"$W/gguf.log"
    gen=""
  else
    (python3 "$HERE/make_gguf.py" "$GGUF.part" bf16 "$W/llama.cpp/gguf-py" && mv "$GGUF.part" "$GGUF") \
      >"$W/gguf.log" 2>&1 &
    gen=$!
  fi
  start=$(date +%s)
  cmake -S "$W/llama.cpp" -B "$W/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    >"$W/cmake.log" 2>&1
  # No npm and no download of the web UI (the GPU machine has no network): llama-server embeds
  # an empty one.
  cmake --build "$W/build" -j"$(nproc)" --target llama-batched-bench llama-bench llama-server \
    >"$W/build.log" 2>&1 || { tail -40 "$W/build.log"; exit 1; }
  echo "build: $(($(date +%s) - start)) s"
  [ -z "$gen" ] || wait "$gen" || { cat "$W/gguf.log"; exit 1; }
  cat "$W/gguf.log"
  ls -la "$GGUF"
  ;;
bench)
  p="$2"; npl="$3"; ntg="${4:-32}"
  maxb="$(echo "$npl" | tr ',' '\n' | sort -n | tail -1)"
  ctx=$((maxb * (p + ntg) + 256))
  for kv in f16 q4_0; do
    "$W/build/bin/llama-batched-bench" -m "$GGUF" -ngl 99 -fa on -kvu -c "$ctx" -b 2048 -ub 512 \
      -ctk "$kv" -ctv "$kv" -npp "$p" -ntg "$ntg" -npl "$npl" \
      >"$OUT/peer-p$p-b${npl//,/-}-kv$kv.txt" 2>"$W/peer-p$p-kv$kv.log" ||
      { tail -20 "$W/peer-p$p-kv$kv.log"; exit 1; }
    grep -E "^\|" "$OUT/peer-p$p-b${npl//,/-}-kv$kv.txt" | sed "s/^/kv $kv: /"
  done
  ;;
serve)
  p="$2"; b="$3"; kv="$4"; ntg="${5:-64}"
  port=8089
  "$W/build/bin/llama-server" -m "$GGUF" -ngl 99 -fa on -ctk "$kv" -ctv "$kv" \
    -np "$b" -c $((b * (p + ntg + 64))) --port "$port" --host 127.0.0.1 --no-webui \
    >"$W/server-p$p-b$b-$kv.log" 2>&1 &
  srv=$!
  trap 'kill $srv 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "$srv" 2>/dev/null || { tail -20 "$W/server-p$p-b$b-$kv.log"; exit 1; }
    sleep 0.5
  done
  # One short request first: CUDA graphs and kernels warm, as Engram's warm-up.
  python3 "$HERE/serve_client.py" "http://127.0.0.1:$port" 64 1 4 1 >/dev/null
  python3 "$HERE/serve_client.py" "http://127.0.0.1:$port" "$p" "$b" "$ntg" |
    sed "s/^{/{\"engine\": \"llama-server\", \"kv\": \"$kv\", /" | tee -a "$OUT/peer-serve.jsonl"
  kill "$srv"; wait "$srv" 2>/dev/null || true
  trap - EXIT
  ;;
*)
  echo "usage: $0 build | bench PROMPT BATCHES [NTG] | serve PROMPT BATCH KV [NTG]" >&2
  exit 2
  ;;
esac
