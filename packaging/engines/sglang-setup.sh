#!/usr/bin/env bash
# Cached, idempotent CPU venv for SGLang 0.5.23 (no CUDA wheels). usage: sglang-setup.sh [VENV]
# (default /var/lib/coldsnap/venvs/sglang). A stamp file (hash of this script, its data files and the python) marks
# a complete venv; a valid one is reused, anything else is rebuilt from scratch. ~80 s, ~3.2 GB.
#
# PyPI has no CPU build of SGLang's kernel package and only a CUDA build of torchvision, so two stand-ins from
# packaging/engines/sglang/ are installed: a pure-PyTorch `sgl_kernel` with the CPU ops a dense model needs, and a
# guard in torchvision's __init__ that skips its op registrations when its compiled ops cannot load.
set -euo pipefail
V=${1:-${COLDSNAP_SGLANG_VENV:-/var/lib/coldsnap/venvs/sglang}}
PY=${PY:-python3}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
HERE=$(cd "$(dirname "$0")" && pwd)
DATA="$HERE/sglang"
log() { echo "sglang-setup: $*" >&2; }

want=$( { cat "$0"; find "$DATA" -type f -name '*.py' -o -type f -name '*.txt' | LC_ALL=C sort | xargs cat;
          echo "$SGLANG_VERSION"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
stamp="$V/.coldsnap-stamp"
check() { SGLANG_USE_CPU_ENGINE=1 "$V/bin/python" -c "import sglang.launch_server, sgl_kernel, transformers, torchvision" 2>/dev/null; }

mkdir -p "$(dirname "$V")"
exec 9>"$V.lock"
flock 9   # two builders of one venv wait for each other
if [ -x "$V/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    if [ "${COLDSNAP_SETUP_DEEP_CHECK:-0}" != 1 ] || check; then log "reusing $V"; exit 0; fi
    log "stamp present but imports fail: rebuilding"
fi

log "building $V (sglang $SGLANG_VERSION, CPU)"
rm -rf "$V"
"$PY" -m venv "$V"
pip() { "$V/bin/pip" --disable-pip-version-check "$@"; }
pip install -q --upgrade pip
cons="$V/coldsnap-constraints.txt"
echo "torch==2.13.0+cpu" >"$cons"
# torch 2.13.0: pip takes the CPU build from the wheel on this machine's disk (find-links + the torch cap).
pip install -q torch==2.13.0
pip install -q --no-deps "sglang==$SGLANG_VERSION" torchvision==0.28.0
pip install -q -c "$cons" -r "$DATA/requirements.txt"
"$V/bin/python" "$DATA/torchvision_guard.py" "$V"
site=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/sgl_kernel"
mkdir -p "$site/sgl_kernel"
cp "$DATA"/sgl_kernel/*.py "$site/sgl_kernel/"
check || { log "the venv is incomplete: sglang/sgl_kernel/transformers do not import"; exit 1; }
"$V/bin/python" -c 'import torch, sglang; print("torch", torch.__version__, "sglang", sglang.__version__)' >&2 || true
echo "$want" >"$stamp"
log "ready: $V"
