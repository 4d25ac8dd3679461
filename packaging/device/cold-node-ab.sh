#!/usr/bin/env bash
# #38's runs in one call on the GPU machine: the cold-node bench (cold-node.sh, LAYERS=6 N=3 NV=1) with each variant
# of the pull named in STEPS as an arm of the one bench (`--arm`: one capture, one vanilla, each round restoring a
# fresh node once per arm in turning order, so that no arm gets the fresh machine's slow first sample), then the
# GPU container restore with the prefetch where STEPS names `container` (gpu-container.sh, CASE=cuda, the bench
# shape), started only while the call has time for it.
#   defaults        as a user gets it: on a GPU machine the direct way (COLDSNAP_PULL_DIRECT auto)
#   spool           COLDSNAP_PULL_DIRECT=0: the pull fetches the weights into memory (the spool), the images' layers
#                   on the restore's own threads, the weights' pieces after them; the prefetcher reads the spool
#   fetchers        spool with COLDSNAP_PULL_IMAGE_FETCHERS=4: the layers by fetching processes, the weights beside
#                   them (auto)
#   fetchers-after  the same with COLDSNAP_PULL_WEIGHTS_AHEAD=0: the weights after the capsule's own blobs
#   direct          COLDSNAP_PULL_DIRECT=1: the prefetcher fetches the weights' pieces from the registry itself,
#                   ordered once the profile is in (the weights beside the images)
#   direct-fetchers the same with COLDSNAP_PULL_IMAGE_FETCHERS=4: the images' layers by fetching processes
#   sync-later      COLDSNAP_PULL_SYNC_LATER=1: the capsule's own blobs fsynced past the first token (the default:
#                   as they come)
#   check           first, the GPU tests of the prefetch's paths (tests/test_gpu_prefetch.py: bit for bit, the
#                   direct way's included), so that a broken path shows before the bench spends the call
# Carry [".whl", ".carry/gpu", ".carry/registry"] (and ".carry/runc" for the container): prepare.sh makes them.
# Usage: [STEPS="check spool defaults container"; default "spool defaults container"] [CALL_S=590] [N=3] [LAYERS=6] [SHM=1] cold-node-ab.sh
source packaging/device/env.sh > /dev/null 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CALL_S=${CALL_S:-590}
left() { echo $(( CALL_S - SECONDS )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; echo "cores: $(nproc)"
arms=()
for v in ${STEPS:-spool defaults container}; do
  case $v in
    defaults) arms+=("defaults=");;
    spool) arms+=("spool=COLDSNAP_PULL_DIRECT=0");;
    fetchers) arms+=("fetchers=COLDSNAP_PULL_DIRECT=0,COLDSNAP_PULL_IMAGE_FETCHERS=4");;
    fetchers-after) arms+=("fetchers-after=COLDSNAP_PULL_DIRECT=0,COLDSNAP_PULL_IMAGE_FETCHERS=4,COLDSNAP_PULL_WEIGHTS_AHEAD=0");;
    direct) arms+=("direct=COLDSNAP_PULL_DIRECT=1");;
    direct-fetchers) arms+=("direct-fetchers=COLDSNAP_PULL_DIRECT=1,COLDSNAP_PULL_IMAGE_FETCHERS=4");;
    sync-later) arms+=("sync-later=COLDSNAP_PULL_SYNC_LATER=1");;
    container|check) ;;
    *) echo "cold-node-ab: no step $v"; exit 2;;
  esac
done
if [[ " ${STEPS:-} " == *" check "* ]]; then
  echo "== check: the prefetch's GPU tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfs tests/test_gpu_prefetch.py \
      -k "bit_for_bit or straight or changed_after" 2>&1 | grep -E "passed|failed|Error|assert|SKIP" | tail -8
fi
if [ ${#arms[@]} -gt 0 ]; then
  with_container=0; [[ " ${STEPS:-container} " == *" container "* ]] && with_container=1
  bench_s=$(( $(left) - 10 - 140 * with_container ))  # the container's share kept for it
  echo "== arms: ${arms[*]}, ${bench_s} s for the bench"
  ARMS="${arms[*]}" BENCH_TIMEOUT=$bench_s LAYERS=${LAYERS:-6} N=${N:-3} NV=1 SUFFIX=arms \
      bash packaging/device/cold-node.sh 2>&1 | grep -vE "^(Filesystem|/dev|overlay|tmpfs|shm)" | tail -8
fi
if [[ " ${STEPS:-container} " == *" container "* ]]; then
  [ "$(left)" -ge 100 ] || { echo "container: skipped, $(left) s left in the call"; exit 0; }
  echo "== container, $(left) s left"
  CASE=cuda COLDSNAP_TEST_CONTAINER_SHAPE=bench NO_DEVICE_ENV=1 TEST_TIMEOUT=$(( $(left) - 10 )) \
      bash packaging/device/gpu-container.sh
fi
