#!/usr/bin/env bash
# criu-template on the GPU machine: (1) `coldsnap bench --template` (vanilla vs template restore vs full restore,
# same run, N samples; 10.9 GB of weights by default), then (2) the portability case: a full capsule rewritten to
# claim another GPU model (a simulated refusal, named as such in the output) restored on this H200: admission
# refuses it and the restore falls to its template, whose receipt says so. (A template initialises CUDA with the
# environment it was captured with: CUDA_VISIBLE_DEVICES of the capture.)
# Usage (repo root there, .whl and .carry/gpu carried: prepare.sh): [N=5] [BENCH=1] [PORTABLE=1] packaging/device/template-bench.sh
source packaging/device/env.sh
CS="python3 -m coldsnap.cli.main"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SIZE=${SIZE:-"--engine-opt layers=6 --engine-opt hidden=6144 --engine-opt heads=48 --engine-opt kv_mib=4096"}
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
if [ "${BENCH:-1}" = 1 ]; then
  timeout ${BENCH_TIMEOUT:-500} $CS bench --template --device cuda --weights-mode recovery -n "${N:-5}" \
      --vanilla-samples "${NV:-2}" $SIZE --out "$OUT" --name reference-cuda-template
  echo "bench rc=$?"
fi
if [ "${PORTABLE:-1}" = 1 ]; then
  if [ -f "$OUT/reference-cuda-template.json" ]; then  # the bench's full capsule, which names its template
    FULL=$(python3 -c "import json;print(json.load(open('$OUT/reference-cuda-template.json'))['capsule']['digest'])")
  else
    $CS capture --device cuda --snapshot-driver both --name portable $SIZE --json > "$OUT/portable-capture.json"
    echo "capture rc=$?"
    FULL=$(python3 -c "import json;print(json.load(open('$OUT/portable-capture.json'))['result']['capsule'])")
  fi
  FOREIGN=$(python3 - "$FULL" <<'PY'
import sys
from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore
store = CapsuleStore(settings().store)
full = store.load(sys.argv[1])
host = full.profile.host
gpus = [g.model_copy(update={"name": "NVIDIA B200 (simulated)"}) for g in host.gpus]
claimed = full.profile.model_copy(update={"host": host.model_copy(update={"gpus": gpus})})
print(store.write_capsule(claimed, full.layers, dict(full.manifest["annotations"])))
PY
)
  echo "full capsule rewritten to claim another GPU model (simulated refusal): $FOREIGN"
  $CS restore --capsule "$FOREIGN" --name portable --no-fallback --json > "$OUT/portable-restore.json"
  echo "restore rc=$?"
  python3 -c "import json;r=json.load(open('$OUT/portable-restore.json'));x=r['result'];print(r['state'],x.get('snapshot_driver'),x.get('instead_of'),x.get('time_to_first_token_s'))"
  $CS stop portable
fi
