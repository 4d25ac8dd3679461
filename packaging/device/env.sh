# Source on the GPU machine (device tool): its python3 has torch but not our pure-Python deps; they travel as wheels
# in .whl, and CRIU as a carried prefix in .carry/criu (see README, "GPU machine").
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export COLDSNAP_CRIU_PREFIX=$PWD/.carry/criu COLDSNAP_HOME=/tmp/coldsnap COLDSNAP_RUN=/tmp/coldsnap-run
export TORCHINDUCTOR_COMPILE_THREADS=1
[ -x .carry/registry/docker-registry ] && export PATH=$PWD/.carry/registry:$PATH
alias coldsnap="python3 -m coldsnap.cli.main"
set +e
