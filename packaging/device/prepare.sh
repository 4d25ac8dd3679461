#!/usr/bin/env bash
# Prepare what the GPU machine (device tool) needs carried, from this checkout: the machine has python3 3.12 with
# torch but no network and nothing installable. Makes (idempotently) .carry/criu — a copy of the provisioned CRIU
# prefix —, .carry/runc — this machine's runc, for GPU containers — and .whl — wheels of ColdSnap's pure-Python
# dependencies for CPython 3.12, the versions in .venv — and, with WITH_REGISTRY=1, .carry/registry (Debian's
# docker-registry, for `bench --cold-node`). Both paths are ignored by git (.git/info/exclude); pass them
# as the device tool's carry: [".whl", ".carry"].
#
# FOR=vllm: what packaging/device/vllm-gpu.sh needs beside .carry/vllm-gpu (vllm_carry.py), in one call's 64 MiB:
# .whl without the registry client's wheels, and the CRIU prefix as one archive, .carry/gpu/criu.tar.xz (5 MiB
# instead of 18); carry [".carry/vllm-gpu", ".whl", ".carry/gpu"], and .carry/runc (vLLM in a container) in a
# call of its own while the machine is warm.
set -euo pipefail
cd "$(dirname "$0")/../.."
PREFIX=${COLDSNAP_CRIU_PREFIX:-/var/lib/coldsnap/criu}
[ -x "$PREFIX/bin/criu" ] || { echo "prepare: no CRIU prefix at $PREFIX: run make setup first" >&2; exit 12; }
if [ ! -f .carry/criu/STAMP ] || ! cmp -s "$PREFIX/STAMP" .carry/criu/STAMP; then
  rm -rf .carry/criu && mkdir -p .carry && cp -a "$PREFIX" .carry/criu
fi
# runc for GPU containers (the machine has none): dynamic, but needs only libc and libseccomp2, which it has.
RUNC=$(command -v runc || true)
if [ -n "$RUNC" ] && ! cmp -s "$RUNC" .carry/runc/runc 2>/dev/null; then
  mkdir -p .carry/runc && cp "$RUNC" .carry/runc/runc
fi
# docker-registry for the cold-node bench (a registry on the same machine): static but for libc (20 MB).
if [ -n "${WITH_REGISTRY:-}" ]; then
  bash packaging/registry/ensure.sh docker-registry
  cmp -s "$(command -v docker-registry)" .carry/registry/docker-registry 2>/dev/null ||
    { mkdir -p .carry/registry && cp "$(command -v docker-registry)" .carry/registry/; }
else
  rm -rf .carry/registry  # 20 MB of the 64 MiB a call carries, only for the cold-node bench
fi
PY=.venv/bin/python
pins=$($PY - <<'PY'
import os
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in
               ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "pyroute2", "zstandard",
                "cryptography", "cffi", "pycparser",
                # the registry client (push/pull: the cold-node bench), with what it needs
                *(() if os.environ.get("FOR") == "vllm" else
                  ("oras", "requests", "urllib3", "idna", "certifi", "charset-normalizer", "jsonschema",
                   "jsonschema-specifications", "referencing", "rpds-py", "attrs")))))
PY
)
rm -rf .whl && mkdir -p .whl  # only the wheels asked for this time
$PY -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl $pins
for ex in .whl .carry; do grep -qx "$ex" .git/info/exclude 2>/dev/null || echo "$ex" >> .git/info/exclude; done
if [ "${FOR:-}" = vllm ]; then
  mkdir -p .carry/gpu && tar -C .carry -cJf .carry/gpu/criu.tar.xz criu
fi
echo "prepared .carry/criu ($(du -sh .carry | cut -f1)) and .whl ($(ls .whl | wc -l) wheels: $pins)"
