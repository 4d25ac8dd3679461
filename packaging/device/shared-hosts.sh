#!/usr/bin/env bash
# Shared hosts on the GPU machine: tests/test_shared_hosts.py's cuda cases (the reference workload in recovery mode,
# COLDSNAP_TEST_CUDA_SIZE its engine options: a restore while the capture's PIDs are taken, 20 restore/stop cycles, 4 restores of
# one capsule at once, a restore refused while its workload runs, one refused for want of GPU room), then, with
# REPLICAS=N, `coldsnap bench --replicas N` on the GPU. The tests keep their temp dirs (retention all), whose
# receipts are archived.
# Usage (repo root there, .whl and .carry/gpu carried: prepare.sh): [TESTS=0] [REPLICAS=4] packaging/device/shared-hosts.sh
source packaging/device/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -x -p no:cacheprovider -o addopts="" -o tmp_path_retention_policy=all tests/test_shared_hosts.py \
      -k cuda -rfs --durations=0 > "$OUT/shared-hosts.log" 2>&1
  echo "pytest rc=$?"
  grep -E "passed|failed|Error|assert|SKIP|s call" "$OUT/shared-hosts.log" | cut -c1-400 | tail -30
  for log in $(find /tmp/pytest-of-root -name engine.log 2>/dev/null | head -3); do echo "== $log"; tail -5 "$log"; done
  find /tmp/pytest-of-root -path '*/home/receipts/*.json' 2>/dev/null | tar czf "$OUT/receipts-shared-hosts.tgz" -T -
fi
if [ -n "${REPLICAS:-}" ]; then
  SIZE="--engine-opt layers=6 --engine-opt hidden=6144 --engine-opt heads=48 --engine-opt kv_mib=4096"
  timeout ${BENCH_TIMEOUT:-560} python3 -m coldsnap.cli.main bench --device cuda --weights-mode recovery \
      --replicas "$REPLICAS" $SIZE --out "$OUT" --name reference-cuda-replicas
  echo "bench rc=$?"
fi
