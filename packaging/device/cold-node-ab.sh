#!/usr/bin/env bash
# #38's runs in one call on the GPU machine, in order of worth, each started only while the call has time for it:
# the cold-node bench (cold-node.sh, LAYERS=6 N=3 NV=1) for each variant of the pull named in STEPS, and the GPU
# container restore with the prefetch where STEPS names `container` (gpu-container.sh, CASE=cuda, the bench shape).
#   defaults        the images' layers on the restore's own threads, the weights' pieces after them
#   fetchers        COLDSNAP_PULL_IMAGE_FETCHERS=4: the layers by fetching processes, the weights beside them (auto)
#   fetchers-after  the same with COLDSNAP_PULL_WEIGHTS_AHEAD=0: the weights after the capsule's own blobs
# Carry [".whl", ".carry/gpu", ".carry/registry"] (and ".carry/runc" for the container): prepare.sh makes them.
# Usage: [STEPS="defaults fetchers container fetchers-after"] [CALL_S=590] cold-node-ab.sh
source packaging/device/env.sh > /dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CALL_S=${CALL_S:-590}
left() { echo $(( CALL_S - SECONDS )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "cores: $(nproc)"
for v in ${STEPS:-defaults fetchers container fetchers-after}; do
  case $v in
    defaults) e=();;
    fetchers) e=(COLDSNAP_PULL_IMAGE_FETCHERS=4);;
    fetchers-after) e=(COLDSNAP_PULL_IMAGE_FETCHERS=4 COLDSNAP_PULL_WEIGHTS_AHEAD=0);;
    container)
      [ "$(left)" -ge 100 ] || { echo "container: skipped, $(left) s left in the call"; continue; }
      echo "== container, $(left) s left"
      CASE=cuda COLDSNAP_TEST_CONTAINER_SHAPE=bench NO_DEVICE_ENV=1 TEST_TIMEOUT=$(( $(left) - 10 )) \
          bash packaging/device/gpu-container.sh
      continue;;
    *) echo "cold-node-ab: no step $v"; exit 2;;
  esac
  [ "$(left)" -ge 120 ] || { echo "$v: skipped, $(left) s left in the call"; continue; }
  echo "== $v (${e[*]:-defaults}), $(left) s left"
  env "${e[@]}" BENCH_TIMEOUT=$(( $(left) - 10 < 200 ? $(left) - 10 : 200 )) LAYERS=6 N=3 NV=1 SUFFIX=$v \
      bash packaging/device/cold-node.sh 2>&1 | grep -vE "^(Filesystem|/dev|overlay|tmpfs|shm)" | tail -4
done
