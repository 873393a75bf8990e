#!/usr/bin/env bash
# Prepares a CUDA 13.0 build environment on a machine without a GPU or a system CUDA, from PyPI
# wheels only, for `cargo build --features cuda` (candle-core's `cuda` and cudarc 0.19).
#
#   source scripts/cuda-env.sh     # then: cargo build --release --features cuda …
#
# What it does (idempotent; ~1.1 GB of wheels under $ENGRAM_CUDA_CACHE, default ~/.cache):
# - installs nvcc, NVRTC, the runtime headers and link-time cuBLAS/cuRAND, pinned to 13.0.x —
#   PTX from nvcc 13.1+ is refused by the 580 driver of the GPU machines;
# - lays them out as a toolkit tree ($CUDA_ROOT/{bin,include,lib64,nvvm});
# - builds a link-time stub of libcuda (the driver has no wheel) exporting every `cu*` symbol
#   cudarc declares; at run time the real driver library is loaded instead;
# - exports CUDA_ROOT/CUDA_HOME, PATH, LIBRARY_PATH and CUDA_COMPUTE_CAP=90 (H100/H200).
# A binary built this way needs the NVIDIA driver to start: keep `cuda` out of default features.

_engram_cuda_setup() {
  local cache="${ENGRAM_CUDA_CACHE:-$HOME/.cache}"
  local wheels="$cache/engram-cuda-wheels"
  export CUDA_ROOT="${CUDA_ROOT:-$cache/engram-cuda-13.0}"
  if [ ! -x "$CUDA_ROOT/bin/nvcc" ]; then
    echo "cuda-env: installing the CUDA 13.0 wheels into $wheels" >&2
    python3 -m pip install --quiet --no-deps --target "$wheels" \
      nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 \
      nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 || return 1
    local src="$wheels/nvidia/cu13"
    mkdir -p "$CUDA_ROOT/lib64/stubs" || return 1
    local d
    for d in bin include nvvm; do ln -sfn "$src/$d" "$CUDA_ROOT/$d"; done
    local f
    for f in "$src"/lib/*.so* "$src"/lib/*.a; do ln -sf "$f" "$CUDA_ROOT/lib64/"; done
    local pair
    for pair in cudart:13 nvrtc:13 curand:10 cublas:13 cublasLt:13; do
      ln -sf "lib${pair%%:*}.so.${pair##*:}" "$CUDA_ROOT/lib64/lib${pair%%:*}.so"
    done
  fi
  if [ ! -e "$CUDA_ROOT/lib64/stubs/libcuda.so" ]; then
    cargo fetch --quiet >/dev/null 2>&1 || true
    local sys
    sys=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null | head -1)
    if [ -z "$sys" ]; then
      # cargo fetch downloads crates but unpacks them only when building: unpack cudarc here.
      local crate
      crate=$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/cudarc-0.19.*.crate 2>/dev/null | head -1)
      if [ -n "$crate" ]; then
        local unpack="${TMPDIR:-/tmp}/engram-cudarc-src"
        mkdir -p "$unpack" && tar xzf "$crate" -C "$unpack" || return 1
        sys=$(ls -d "$unpack"/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null | head -1)
      fi
    fi
    if [ -z "$sys" ]; then
      echo "cuda-env: cudarc 0.19 sources not found (run cargo fetch with network)" >&2
      return 1
    fi
    local stub="${TMPDIR:-/tmp}/engram-libcuda-stub.c"
    grep -oP '^pub unsafe fn \Kcu\w+(?=\()' "$sys" | sort -u \
      | awk '{ print "int " $1 "(void) { return 999; }" }' > "$stub"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA_ROOT/lib64/stubs/libcuda.so" "$stub" || return 1
  fi
  export CUDA_HOME="$CUDA_ROOT"
  export PATH="$CUDA_ROOT/bin:$PATH"
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  export LIBRARY_PATH="$CUDA_ROOT/lib64:$CUDA_ROOT/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
  echo "cuda-env: CUDA_ROOT=$CUDA_ROOT (nvcc $("$CUDA_ROOT/bin/nvcc" --version | grep -o 'V[0-9.]*'))" >&2
}
_engram_cuda_setup
