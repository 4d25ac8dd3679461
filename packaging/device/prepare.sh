#!/usr/bin/env bash
# Prepare what the GPU machine (device tool) needs carried, from this checkout: the machine has python3 3.12 with
# torch but no network and nothing installable. Makes (idempotently) .carry/criu — a copy of the provisioned CRIU
# prefix — and .carry/gpu/criu.tar.xz, the same as one archive (5 MiB instead of 18; the device scripts unpack it),
# .carry/runc — this machine's runc, for GPU containers — and .whl — wheels of ColdSnap's Python dependencies for
# CPython 3.12, the versions in .venv — and, with WITH_REGISTRY=1, .carry/registry (Debian's docker-registry and
# the registry client's wheels, for `bench --cold-node`). All ignored by git (.git/info/exclude).
# A call carries at most 64 MiB; what earlier calls carried stays while the machine is warm. So, back to back:
#   [".carry/vllm-gpu", ".whl", ".carry/gpu"]   vLLM (packaging/device/vllm-gpu.sh; vllm_carry.py makes the first)
#   [".carry/runc"]                             GPU containers (vllm-gpu.sh STEPS=container, gpu-container.sh)
#   [".carry/registry"]                         the cold-node bench (cold-node.sh)
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
PY=.venv/bin/python
wheels() {  # DIR NAME...: wheels of these dependencies for the machine's CPython 3.12, the versions in .venv
  local dir=$1; shift
  local pins; pins=$($PY -c 'import sys; from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "$@")
  rm -rf "$dir" && mkdir -p "$dir"  # only the wheels asked for this time
  $PY -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$dir" $pins
  echo "$dir: $pins"
}
wheels .whl pydantic pydantic-core annotated-types typing-inspection pyroute2 zstandard cryptography cffi pycparser \
    blake3
# docker-registry for the cold-node bench (a registry on the same machine; static but for libc, 20 MB), and the
# registry client's wheels (push/pull) beside it: packaging/device/env.sh installs them when they are carried.
if [ -n "${WITH_REGISTRY:-}" ]; then
  bash packaging/registry/ensure.sh docker-registry
  cmp -s "$(command -v docker-registry)" .carry/registry/docker-registry 2>/dev/null ||
    { mkdir -p .carry/registry && cp "$(command -v docker-registry)" .carry/registry/; }
  wheels .carry/registry/whl oras requests urllib3 idna certifi charset-normalizer jsonschema \
      jsonschema-specifications referencing rpds-py attrs
fi
for ex in .whl .carry; do grep -qx "$ex" .git/info/exclude 2>/dev/null || echo "$ex" >> .git/info/exclude; done
mkdir -p .carry/gpu && tar -C .carry -cJf .carry/gpu/criu.tar.xz criu
echo "prepared .carry/criu, .carry/gpu/criu.tar.xz ($(du -sh .carry/gpu | cut -f1)) and .whl ($(ls .whl | wc -l) wheels)"
