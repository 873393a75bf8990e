#!/usr/bin/env bash
# End to end on the GPU machine, both engines on the same random-weight bf16 GGUF that
# `run.sh build` writes: Engram's engine (`engram-bench e2e`: TTFT per sequence, time per output
# token from arrival gaps) and llama-server (`run.sh serve`, the same figures from its streamed
# tokens), at the prompt lengths and batches given.
#
#   ./e2e.sh engram ENGRAM_BENCH [PROMPTS] [BATCHES] [STEPS]   # JSON lines → $OUT/engram-e2e.jsonl
#   ./e2e.sh peer [PROMPTS] [BATCHES] [KV_TYPES] [STEPS]        # JSON lines → $OUT/peer-serve.jsonl
#
# Defaults: prompts 4096,32768, batches 1,16, KV types f16,q4_0, 64 generated tokens.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
W="${WORK:-/tmp/gpu-peer}"
OUT="${OUT:-$HERE/out}"
GGUF="$W/llama3-8b-bf16.gguf"
mkdir -p "$OUT"
case "${1:-}" in
engram)
  bin="$2"; prompts="${3:-4096,32768}"; batches="${4:-1,16}"; steps="${5:-64}"
  "$bin" e2e --model "$GGUF" --weights f32 --device cuda --prompts "$prompts" \
    --batches "$batches" --steps "$steps" --json | tee -a "$OUT/engram-e2e.jsonl"
  ;;
peer)
  prompts="${2:-4096,32768}"; batches="${3:-1,16}"; kvs="${4:-f16,q4_0}"; steps="${5:-64}"
  for kv in ${kvs//,/ }; do
    for p in ${prompts//,/ }; do
      for b in ${batches//,/ }; do
        "$HERE/run.sh" serve "$p" "$b" "$kv" "$steps"
      done
    done
  done
  ;;
*)
  echo "usage: $0 engram ENGRAM_BENCH [PROMPTS] [BATCHES] [STEPS] | peer [PROMPTS] [BATCHES] [KV_TYPES] [STEPS]" >&2
  exit 2
  ;;
esac
