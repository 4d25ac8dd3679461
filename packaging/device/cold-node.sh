#!/usr/bin/env bash
# The first restore on a node that never saw the capsule, on the GPU machine: `coldsnap bench --cold-node` with the
# reference engine in recovery mode, LAYERS layers (6: 10.9 GB of weights, 18: 31 GB), N fresh nodes, the capsule
# and its payload in Debian's docker-registry on loopback (WITH_REGISTRY=1 packaging/device/prepare.sh; carry
# [".whl", ".carry/gpu", ".carry/registry"], or only .carry/registry after a call that carried the others).
# SHM=1 puts the ColdSnap home, its run dir, the registry's storage and the nodes on /dev/shm (tmpfs): the
# machine's 64 GiB disk cannot hold 31 GB of weights and a node's pulled copy beside everything else. The limit is
# measured on the same storage in the same run, so the ratio stays honest; the result says which storage it used.
# WARMUP=1 does only a first capture (the seeded weights written, the compile cache filled) and removes its capsule:
# on a fresh machine the first cold start of the 31 GB workload takes ~410 s, more than one call leaves the bench.
# Run it as its own call, then the bench as the next call on the same (still warm) machine.
# Usage (repo root there, .whl and .carry/gpu carried: prepare.sh):
#   [LAYERS=6] [N=3] [SHM=1] [WARMUP=1] [SUFFIX=name] [ARMS="NAME=[VAR=VALUE,...] ..."] packaging/device/cold-node.sh
# ARMS: variants of the restore's settings side by side in the one bench (`coldsnap bench --cold-node --arm`).
source packaging/device/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
command -v docker-registry >/dev/null || { echo "cold-node: no docker-registry: carry .carry/registry"; exit 12; }
L=${LAYERS:-6}
NAME=reference-cuda-cold-node-$L${SUFFIX:+-$SUFFIX}  # SUFFIX: runs side by side in one call keep apart
if [ "${SHM:-0}" = 1 ]; then
  export COLDSNAP_HOME=/dev/shm/coldsnap COLDSNAP_RUN=/dev/shm/coldsnap-run
  NAME=$NAME-tmpfs
fi
df -h / /dev/shm | tail -2
SIZE="--engine-opt layers=$L --engine-opt hidden=6144 --engine-opt heads=48 --engine-opt kv_mib=4096"
if [ "${WARMUP:-0}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-560} python3 -m coldsnap.cli.main capture --device cuda --weights-mode recovery $SIZE \
      --name warmup --json > /tmp/warmup.json
  echo "warm-up capture rc=$?"
  python3 -m coldsnap.cli.main rm "$(python3 -c "import json;print(json.load(open('/tmp/warmup.json'))['result']['capsule'])")"
  exit 0
fi
# the bench stops sampling in time to write what it has before the timeout would cut it off
BT=${BENCH_TIMEOUT:-540}
timeout "$BT" python3 -m coldsnap.cli.main bench --cold-node --device cuda --weights-mode recovery \
    -n "${N:-3}" --vanilla-samples "${NV:-2}" $SIZE --out "$OUT" --name "$NAME" --deadline-s $(( BT - 10 )) \
    $(for a in ${ARMS:-}; do echo "--arm $a"; done)
echo "bench rc=$?"
df -h / /dev/shm | tail -2
