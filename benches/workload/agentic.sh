#!/usr/bin/env bash
# `engram-bench agentic` on llama.cpp's own server and on Engram, same GGUF, same seeded trace,
# one after the other on loopback; then the two runs side by side (Engram's TTFT over the
# peer's). Writes $OUT/{llama.cpp,engram}.json, report.txt and lscpu.txt.
#
# The servers hold half the sessions' KV: llama-server has SESSIONS/2 slots (each with CTX
# tokens) and its host-RAM prompt cache (--cache-ram) for the others; Engram's hot tier is
# HOT_MIB (the default: half of what SESSIONS contexts of CTX tokens take at the CPU codecs),
# its cold tier and shadow as configured by default.
#
# Settings (environment): MODEL, SESSIONS (4), TURNS (30), TOOL_MIN / TOOL_MAX (words of a tool
# result, 200 / 2000), PAUSE_MIN_MS / PAUSE_MAX_MS (1000 / 60000), SYSTEM_WORDS (1200),
# MAX_TOKENS (8), SEED (7), CTX (8192), HOT_MIB (Engram's hot tier), PEER_CACHE_MIB (2048),
# THREADS (nproc), LLAMA_SERVER (a binary; default: llama-server.sh's native build), OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=$(realpath -m "${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
SESSIONS=${SESSIONS:-4}
CTX=${CTX:-8192}
THREADS=${THREADS:-$(nproc)}
HOT_MIB=${HOT_MIB:-0}
PEER_CACHE_MIB=${PEER_CACHE_MIB:-2048}
OUT=$(realpath -m "${OUT:-benches/results/$(date -u +%F)-agentic}")
TARGET=$(realpath -m "${CARGO_TARGET_DIR:-target}")
ENGRAM=${ENGRAM_BIN:-$TARGET/release/engram}
BENCH=${BENCH_BIN:-$TARGET/release/engram-bench}
LLAMA_SERVER=${LLAMA_SERVER:-$(benches/workload/llama-server.sh)}
ADMIN=bench-admin-key-0123456789
PORT=18090
STATE=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$STATE"' EXIT
mkdir -p "$OUT"
lscpu >"$OUT/lscpu.txt"

wait_http() { # url, seconds
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        if curl -sf -o /dev/null "$1"; then return 0; fi
        sleep 0.1
    done
    echo "agentic: $1 did not answer in $2 s" >&2
    return 1
}

trace=(--sessions "$SESSIONS" --turns "${TURNS:-30}" --tool-min "${TOOL_MIN:-200}"
    --tool-max "${TOOL_MAX:-2000}" --pause-min-ms "${PAUSE_MIN_MS:-1000}"
    --pause-max-ms "${PAUSE_MAX_MS:-60000}" --system-words "${SYSTEM_WORDS:-1200}"
    --max-tokens "${MAX_TOKENS:-8}" --seed "${SEED:-7}")

# llama.cpp's server: half the sessions in slots, prompt caching on in each slot and across
# them in host RAM.
slots=$(((SESSIONS + 1) / 2))
"$LLAMA_SERVER" --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --ctx-size $((CTX * slots)) --parallel "$slots" --threads "$THREADS" \
    --threads-batch "$THREADS" --cache-ram "$PEER_CACHE_MIB" --no-webui \
    >"$STATE/peer.log" 2>&1 &
peer=$!
wait_http "http://127.0.0.1:$PORT/health" 120
"$BENCH" agentic --endpoint "http://127.0.0.1:$PORT/v1" --label llama.cpp "${trace[@]}" \
    --out "$OUT/llama.cpp.json"
kill -TERM "$peer"; wait "$peer" 2>/dev/null || true

# Engram with its defaults but the hot tier (half the sessions' KV) and the memory graph off
# (the peer has none).
env=(ENGRAM__AUTH__ADMIN_KEY=$ADMIN ENGRAM__MODEL__PATH="$MODEL" ENGRAM__MEMORY__ENABLED=false
    ENGRAM__MODEL__THREADS=$THREADS ENGRAM__MODEL__CONTEXT_TOKENS=$CTX)
[ "$HOT_MIB" != 0 ] && env+=(ENGRAM__MODEL__HOT_MIB=$HOT_MIB)
env "${env[@]}" "$ENGRAM" serve --bind "127.0.0.1:$PORT" \
    --database-url "sqlite://$STATE/engram.db?mode=rwc" >"$STATE/engram.log" 2>&1 &
engram=$!
wait_http "http://127.0.0.1:$PORT/healthz" 300
"$BENCH" agentic --endpoint "http://127.0.0.1:$PORT/v1" --label engram \
    --engram-admin-key "$ADMIN" "${trace[@]}" --out "$OUT/engram.json"
kill -TERM "$engram"; wait "$engram" 2>/dev/null || true

"$BENCH" agentic --report "$OUT/llama.cpp.json" "$OUT/engram.json" | tee "$OUT/report.txt"
