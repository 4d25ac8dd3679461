#!/usr/bin/env bash
# #38's runs in one call on the GPU machine, in order of worth, each started only while the call has time for it:
# the cold-node bench (cold-node.sh, LAYERS=6 N=3 NV=1) for each variant of the pull named in STEPS, and the GPU
# container restore with the prefetch where STEPS names `container` (gpu-container.sh, CASE=cuda, the bench shape).
#   defaults       on 16 cores: the images' layers by fetching processes, the weights beside them
#   weights-after  COLDSNAP_PULL_WEIGHTS_AHEAD=0: the weights' pieces start after the capsule's own blobs
#   threads        COLDSNAP_PULL_IMAGE_FETCHERS=0: the images' layers on the restore's own threads (the weights then
#                  follow them too: COLDSNAP_PULL_WEIGHTS_AHEAD=auto)
# Carry [".whl", ".carry/gpu", ".carry/registry"] (and ".carry/runc" for the container): prepare.sh makes them.
# Usage: [STEPS="defaults weights-after container threads"] [CALL_S=590] cold-node-ab.sh
source packaging/device/env.sh > /dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CALL_S=${CALL_S:-590}
left() { echo $(( CALL_S - SECONDS )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "cores: $(nproc)"
for v in ${STEPS:-defaults weights-after container threads}; do
  case $v in
    defaults) e=();;
    weights-after) e=(COLDSNAP_PULL_WEIGHTS_AHEAD=0);;
    threads) e=(COLDSNAP_PULL_IMAGE_FETCHERS=0);;
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
