# Source on the GPU machine (device tool): its python3 has torch but not our pure-Python deps; they travel as wheels
# in .whl (the registry client's in .carry/registry/whl), and CRIU as a carried prefix, .carry/gpu/criu.tar.xz
# unpacked into .carry/criu (packaging/device/prepare.sh).
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls .carry/registry/whl/*.whl 2>/dev/null)  # the registry client, where the cold-node bench's carry brought it
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# bytecode, as an installed ColdSnap has it (pip compiles at install; this image's python writes none on import)
python3 -m compileall -q -j 0 /tmp/site coldsnap coldsnap_bench coldsnap_reference coldsnap_sparkrun >/dev/null || true
export COLDSNAP_CRIU_PREFIX=$PWD/.carry/criu COLDSNAP_HOME=/tmp/coldsnap COLDSNAP_RUN=/tmp/coldsnap-run
export TORCHINDUCTOR_COMPILE_THREADS=1
[ -x .carry/registry/docker-registry ] && export PATH=$PWD/.carry/registry:$PATH
[ -x .carry/criu/bin/criu ] || { [ -f .carry/gpu/criu.tar.xz ] && tar -C .carry -xJf .carry/gpu/criu.tar.xz; }
alias coldsnap="python3 -m coldsnap.cli.main"
set +e
