#!/usr/bin/env bash
# GPU qualification on the device machine: doctor, GPU tests, bench (recovery or native), sleep/wake.
# Usage (from the repo root there, with .whl and .carry/gpu carried: prepare.sh): packaging/device/gpu-bench.sh MODE [SAMPLES]
# MODE: recovery | native (bench) | sleepwake (sleep/wake of a running workload, SLEEP_MODES) | none (TESTS only)
# DRIVER=1: time the driver's own checkpoint/restore first; ACCOUNT=1: CRIU pages of the capsule after
# TESTS: pytest files to run first; SUFFIX: appended to the result name (e.g. -noprefetch with COLDSNAP_PREFETCH=0)
MODE=${1:-recovery}; N=${2:-5}; NV=${NV:-2}
source packaging/device/env.sh
CS="python3 -m coldsnap.cli.main"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SIZE=${SIZE:-"--engine-opt layers=6 --engine-opt hidden=6144 --engine-opt heads=48 --engine-opt kv_mib=4096"}
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
if [ "${DOCTOR:-0}" = 1 ]; then
  $CS doctor --json > "$OUT/doctor-gpu.json"; echo "doctor rc=$?"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_reference_engine.py -k "cuda or gpu" \
      -o addopts="" 2>&1 | tail -4
fi
if [ -n "${TESTS:-}" ]; then  # e.g. TESTS=tests/test_gpu_prefetch.py
  timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" $TESTS -rs -s 2>&1 | grep -v "^$" | tail -12
fi
if [ "${DRIVER:-0}" = 1 ]; then  # the driver's own checkpoint/restore, apart from ours
  python3 -m coldsnap_bench.driver_rate --gib 0 --gib 4 --repeat 3 --json | tee "$OUT/driver-rate.json"
fi
if [ "$MODE" = sleepwake ]; then
  # Sleep/wake of a running 15 GiB workload, engine mode (weights released, reloaded at wake) then cuda mode.
  $CS capture --device cuda --leave-running --name sw --weights-mode recovery $SIZE --json > "$OUT/sw-capture.json"
  echo "capture rc=$?"
  for m in ${SLEEP_MODES:-engine engine engine}; do
    $CS sleep sw --mode $m --json | python3 -c "import json,sys;r=json.load(sys.stdin);print('sleep',r['result']['mode'],[(s['name'],round(s['duration_s'],2)) for s in r['spans']])"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1
    $CS wake sw --json | python3 -c "import json,sys;r=json.load(sys.stdin);x=r['result'];print('wake',x['mode'],x['time_to_first_token_s'],[(s['name'],round(s['duration_s'],2)) for s in r['spans']],(x.get('engine_resume') or {}).get('weights_reload'))"
  done
  $CS stop sw
  cp -r /tmp/coldsnap/receipts "$OUT/sw-receipts" 2>/dev/null
  exit 0
fi
[ "$MODE" = none ] && exit 0
echo "== bench $MODE"
NAME=reference-cuda-$MODE${DROP:+-cold}${SUFFIX:-}
timeout ${BENCH_TIMEOUT:-420} $CS bench --device cuda -n "$N" --vanilla-samples "$NV" --weights-mode "$MODE" $SIZE \
    --out "$OUT" --name "$NAME" ${DROP:+--drop-caches}
echo "bench rc=$?"
D=$(python3 -c "import json;print(json.load(open('$OUT/$NAME.json'))['capsule']['digest'])")
if [ "${GPUMAP:-0}" = 1 ]; then
  U=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
  echo "== restore with --gpu-map $U=$U"
  $CS restore --capsule "$D" --gpu-map "$U=$U" --no-fallback --json | python3 -c "import json,sys;r=json.load(sys.stdin);print(r['state'],r['result'].get('time_to_first_token_s'),r['result'].get('hydrate'))"
  $CS stop bench-reference
fi
if [ "${SLEEP:-0}" = 1 ]; then
  echo "== sleep/wake"
  $CS restore --capsule "$D" --json > /dev/null && for i in 1 2 3; do
    $CS sleep bench-reference --json | python3 -c "import json,sys;r=json.load(sys.stdin);print('sleep',r['result'])"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    $CS wake bench-reference --json | python3 -c "import json,sys;r=json.load(sys.stdin);print('wake',r['result']['time_to_first_token_s'],[(s['name'],s['duration_s']) for s in r['spans']])"
  done
  $CS stop bench-reference
fi
python3 packaging/device/summary.py
if [ "${ACCOUNT:-0}" = 1 ]; then  # where the capsule's CRIU pages are
  python3 -m coldsnap_bench.criu_account $COLDSNAP_HOME/staged/${D#sha256:}/images --top 10 --zeros
fi
cp -r /tmp/coldsnap/receipts "$OUT/" 2>/dev/null; tar czf "$OUT/receipts.tgz" -C /tmp/coldsnap receipts 2>/dev/null; rm -rf "$OUT/receipts"
