#!/usr/bin/env bash
# One-shot, idempotent set-up of everything ColdSnap needs on a Debian 12/13 host: system packages, CRIU >= 4.2
# in a prefix, and the Python venv. Re-running it reuses what is present and valid.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PY:-python3}
CRIU_PREFIX=${COLDSNAP_CRIU_PREFIX:-/var/lib/coldsnap/criu}
log() { echo "setup: $*" >&2; }

# System packages: only what is missing (apt is slow even when there is nothing to do).
need=()
for pair in ip:iproute2 nsenter:util-linux unshare:util-linux ps:procps curl:curl; do
    command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    log "installing ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

packaging/criu/provision.sh "$CRIU_PREFIX"

# Python venv, rebuilt only when pyproject.toml or the set of top-level packages changed (an editable install
# maps each package by name: a package added later is not importable until it is reinstalled).
want=$( (sha256sum pyproject.toml packaging/setup.sh; ls -d coldsnap*/__init__.py) | sha256sum | cut -c1-16)
stamp="$VENV/.coldsnap-stamp"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "creating the venv in $VENV"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    # torch==2.13.0 is the CPU build on this machine's disk (pip's find-links); a plain `torch` would fetch CUDA.
    "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 numpy 2>&1 | grep -v "^WARNING: Location" || true
    "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[engine,bench,test]' 2>&1 | grep -v "^WARNING: Location" || true
    [ -x "$VENV/bin/ruff" ] && [ -x "$VENV/bin/lint-imports" ] && [ -x "$VENV/bin/mypy" ] && \
    "$VENV/bin/python" -c "import coldsnap, coldsnap_reference, coldsnap_bench, torch, pydantic, pyroute2, zstandard, oras, matplotlib, pytest, hypothesis, grpc, cri_api, kubernetes_validate" \
        || { log "venv is incomplete"; exit 1; }
    echo "$want" >"$stamp"
fi
# coldsnap-runc: the runtime's front door in C (packaging/launcher), so that a pass-through call starts no Python.
launcher="$VENV/bin/coldsnap-runc"
if [ ! -x "$launcher" ] || [ packaging/launcher/coldsnap-runc.c -nt "$launcher" ]; then
    command -v cc >/dev/null || { log "installing gcc (for coldsnap-runc)"; apt-get update -qq && \
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev; }
    cc -O2 -Wall -o "$launcher.tmp" packaging/launcher/coldsnap-runc.c && mv "$launcher.tmp" "$launcher"
fi
# pycriu comes with the provisioned CRIU (it must match the criu binary): put it on the venv's path.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$CRIU_PREFIX/pycriu" >"$site/coldsnap-pycriu.pth"
"$VENV/bin/python" -c "import pycriu" || { log "pycriu does not import"; exit 1; }
log "ready: $("$CRIU_PREFIX/bin/criu" --version | head -1), venv $VENV"
