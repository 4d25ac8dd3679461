#!/usr/bin/env bash
# Restores of one capsule taking turns between settings, on the GPU machine, after a bench has left its capsule
# staged: each round restores once under each setting (an environment assignment), validated, then stops it.
# Usage (repo root there): AB="COLDSNAP_LAZY_PAGES=0 COLDSNAP_LAZY_PAGES=1" [N=5] packaging/device/ab.sh DIGEST
# A setting may assign several variables, comma-separated (A=1,B=2).
# With RECEIPTS=FILE, every restore's receipt is appended to FILE (JSON lines: the setting and the receipt).
source packaging/device/env.sh
D=$1; CS="python3 -m coldsnap.cli.main"
for i in $(seq "${N:-5}"); do
  for setting in ${AB:?name the settings in AB}; do
    env ${setting//,/ } $CS restore --capsule "$D" --no-fallback --name ab --json > /tmp/ab.json
    python3 - "$setting" "${RECEIPTS:-}" <<'PY'
import json, sys
r = json.load(open("/tmp/ab.json")); x = r.get("result") or {}; h = x.get("hydrate") or {}
spans = " ".join(f"{s['name']}={s['duration_s']:.3f}" for s in r.get("spans", []))
print(f"{sys.argv[1]}: {r.get('state')} ttft={x.get('time_to_first_token_s')} {spans} "
      f"cuda={(h.get('cuda_restore_s') or {}).get('restore')} lazy={x.get('lazy_pages')} "
      f"prefetch_ready={(h.get('prefetch') or {}).get('ready_s')} resume={h.get('engine_resume')} "
      f"{r.get('error') or ''}")
if len(sys.argv) > 2 and sys.argv[2]:
    with open(sys.argv[2], "a") as f:
        f.write(json.dumps({"setting": sys.argv[1], "receipt": r}) + "\n")
PY
    $CS stop ab > /dev/null 2>&1
  done
done
