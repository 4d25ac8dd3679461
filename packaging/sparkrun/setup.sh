#!/usr/bin/env bash
# sparkrun (PyPI, Python >= 3.12) in a venv of its own with ColdSnap's plugin installed into it:
# `pip install -e '<repo>[sparkrun]'` (the plugin is this repository's coldsnap_sparkrun), plus the
# provisioned CRIU's pycriu on its path so that the venv's own `coldsnap` command captures and restores.
#
# Usage: setup.sh [VENV]   (default /var/lib/coldsnap/venvs/sparkrun). Idempotent: rebuilt only when this script,
# pyproject.toml, the interpreter or the checkout changed (the plugin is installed editable from it).
# The interpreter: $PYTHON312, else python3.12 on PATH, else pyenv's newest 3.12 (installed with `pyenv install`
# when pyenv has none).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
VENV=${1:-/var/lib/coldsnap/venvs/sparkrun}
CRIU_PREFIX=${COLDSNAP_CRIU_PREFIX:-/var/lib/coldsnap/criu}
SPARKRUN=${COLDSNAP_SPARKRUN_VERSION:-0.4.2}
log() { echo "coldsnap-sparkrun: $*" >&2; }
die() { log "error: $*"; exit 1; }

runs312() { [ -n "$1" ] && [ -x "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null; }

find_python() {
    local p root
    for p in "${PYTHON312:-}" "$(command -v python3.12 || true)"; do
        runs312 "$p" && { echo "$p"; return; }  # (a pyenv shim of a version not selected does not run)
    done
    if command -v pyenv >/dev/null; then
        root=$(pyenv root)
        p=$(ls -d "$root"/versions/3.12.* 2>/dev/null | sort -V | tail -1)
        if [ -z "$p" ]; then
            log "installing CPython 3.12 with pyenv (sparkrun needs >= 3.12)"
            pyenv install -s 3.12 >&2
            p=$(ls -d "$root"/versions/3.12.* 2>/dev/null | sort -V | tail -1)
        fi
        runs312 "$p/bin/python" && { echo "$p/bin/python"; return; }
    fi
    for p in /root/.pyenv/versions/3.12.*/bin/python; do runs312 "$p" && { echo "$p"; return; }; done
    die "no CPython 3.12 (sparkrun needs >= 3.12): set PYTHON312, install python3.12 or pyenv"
}

PY=$(find_python)
want=$( (cat "$0" "$REPO/pyproject.toml"; "$PY" --version; echo "$SPARKRUN $REPO") | sha256sum | cut -c1-16)
stamp="$VENV/.coldsnap-stamp"
if [ -x "$VENV/bin/sparkrun" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
log "building $VENV with $("$PY" --version) and sparkrun $SPARKRUN"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "sparkrun==$SPARKRUN" -e "$REPO[sparkrun]" 2>&1 \
    | grep -v "^WARNING: Location" >&2 || true
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$CRIU_PREFIX/pycriu" >"$site/coldsnap-pycriu.pth"
"$VENV/bin/python" -c "import sparkrun, coldsnap_sparkrun.identity, click" \
    || die "the venv is incomplete"
"$VENV/bin/sparkrun" --version >/dev/null || die "sparkrun does not run"
echo "$want" >"$stamp"
log "ready: $("$VENV/bin/sparkrun" --version 2>&1 | tail -1) in $VENV"
