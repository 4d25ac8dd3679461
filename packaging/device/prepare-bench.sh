#!/usr/bin/env bash
# The first verification and staging of a capsule on a node, on the GPU machine: capture the reference engine in
# recovery mode with LAYERS layers (6: 10.9 GB of weights, 18: 31 GB), then `restore --prepare-only` with no memo of
# earlier digests and nothing staged (a node that has the weights file but never checked it), then one restore.
# Usage (repo root there, .whl and .carry/gpu carried: prepare.sh): LAYERS="6 18" packaging/device/prepare-bench.sh
# Writes $OUT/prepare-LAYERS.json (the prepare receipt) and prints one line per size.
source packaging/device/env.sh
CS="python3 -m coldsnap.cli.main"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for L in ${LAYERS:-18}; do
  SIZE="--engine-opt layers=$L --engine-opt hidden=6144 --engine-opt heads=48 --engine-opt kv_mib=4096"
  t0=$(date +%s.%N)
  timeout ${CAPTURE_TIMEOUT:-400} $CS capture --device cuda --weights-mode recovery --name "prep$L" $SIZE --json \
      > "$OUT/capture-$L.json" 2> "$OUT/capture-$L.err" || { echo "capture $L failed: $(tail -2 "$OUT/capture-$L.err")"; continue; }
  t1=$(date +%s.%N)
  D=$(python3 -c "import json,sys; print(json.load(open('$OUT/capture-$L.json'))['result']['capsule'])")
  W=$(python3 -c "import json; r=json.load(open('$OUT/capture-$L.json')); print(r['result'].get('weights_bytes') or '')")
  rm -f "$COLDSNAP_HOME/digests.json"; rm -rf "$COLDSNAP_HOME/staged"
  $CS restore --capsule "$D" --prepare-only --json > "$OUT/prepare-$L.json" 2> "$OUT/prepare-$L.err"
  $CS restore --capsule "$D" --no-fallback --json > "$OUT/restore-$L.json" 2> "$OUT/restore-$L.err"
  python3 - "$OUT" "$L" "$t0" "$t1" <<'PY'
import json, sys, os
out, L, t0, t1 = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
cap = json.load(open(f"{out}/capture-{L}.json"))
prep = json.load(open(f"{out}/prepare-{L}.json"))
rest = json.load(open(f"{out}/restore-{L}.json")) if os.path.getsize(f"{out}/restore-{L}.json") else {}
spans = lambda r: {s["name"]: round(s["duration_s"], 3) for s in r.get("spans", [])}
print(json.dumps({"layers": int(L), "capture_s": round(t1 - t0, 1), "capture_spans": spans(cap),
                  "prepare_state": prep.get("state"), "prepare_spans": spans(prep),
                  "restore_state": rest.get("state"), "restore_ttft_s": (rest.get("result") or {}).get("time_to_first_token_s"),
                  "restore_spans": spans(rest)}))
PY
  $CS stop "prep$L" >/dev/null 2>&1; $CS rm "$D" >/dev/null 2>&1
done
