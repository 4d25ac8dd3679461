#!/usr/bin/env bash
# The reference engine on a GPU inside a runc container, through coldsnap-runtime: tests/test_gpu_container.py on
# the GPU machine. It has no runc and nothing can be installed there, so runc travels in .carry/runc (made by
# prepare.sh; it needs only libc and libseccomp2, which the machine has), and coldsnap-runtime / coldsnap-hook are
# small wrappers around this checkout. Usage (repo root there, .whl and .carry/gpu carried: prepare.sh): gpu-container.sh
[ -n "${NO_DEVICE_ENV:-}" ] || source packaging/device/env.sh
PY=${PY:-python3}
BIN=/tmp/coldsnap-bin; mkdir -p "$BIN"
cp .carry/runc/runc "$BIN/runc"
for tool in coldsnap-runtime:coldsnap.shim.main coldsnap-hook:coldsnap.hooks.main; do
  cat > "$BIN/${tool%%:*}" <<WRAP
#!/bin/sh
export PYTHONPATH="$PYTHONPATH" PYTHONUNBUFFERED=1
exec $PY -c 'import sys; from ${tool#*:} import main; sys.exit(main())' "\$@"
WRAP
  chmod +x "$BIN/${tool%%:*}"
done
export PATH="$BIN:$PATH" COLDSNAP_TEST_RUNTIME="$BIN/coldsnap-runtime" COLDSNAP_DEBUG=1; mkdir -p "${OUT:-/tmp/out}"
runc --version | head -1; nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
timeout ${TEST_TIMEOUT:-500} $PY -m pytest -q -s -p no:cacheprovider -o addopts="" -o tmp_path_retention_policy=all tests/test_gpu_container.py ${CASE:+-k "$CASE"} \
    -rfs > "${OUT:-/tmp/out}/gpu-container.log" 2>&1
grep -E "measured|passed|failed|Error|assert|SKIP" "${OUT:-/tmp/out}/gpu-container.log" | tail -20

# receipts, and CRIU's restore logs (COLDSNAP_DEBUG=1 keeps them for successful restores too: where the time went)
find /tmp/pytest-of-root -path '*/home/receipts/*' \( -name '*.json' -o -name '*.restore.log' \) 2>/dev/null \
    | tar czf "${OUT:-/tmp/out}/receipts-gpu-container.tgz" -T -
