"""One line per restore receipt: where its time went (device runs print this after a bench).
Usage: python3 packaging/device/summary.py [RECEIPTS_DIR] (default $COLDSNAP_HOME/receipts)."""
import json
import os
import sys
from pathlib import Path

d = Path(sys.argv[1] if len(sys.argv) > 1 else Path(os.environ.get("COLDSNAP_HOME", "/tmp/coldsnap")) / "receipts")
for f in sorted(d.glob("*.json"), key=lambda p: p.stat().st_mtime):
    r = json.loads(f.read_text())
    res = r.get("result") or {}
    if r.get("operation") == "capture":
        rel = res.get("release") or {}
        pages = (res.get("criu_stats") or {}).get("pages_written")
        print(f"capture {res.get('capsule', '')[:19]} pages_written={pages} "
              f"gpu_used_after_release={rel.get('gpu_used_bytes')} torch_reserved={rel.get('torch_reserved_bytes')} "
              f"code_stash={rel.get('code_stash')}")
        continue
    if r.get("operation") != "restore" or r.get("state") != "succeeded":
        continue
    spans = {s["name"]: round(s["duration_s"], 3) for s in r["spans"]}
    h = res.get("hydrate") or {}
    er = h.get("engine_resume") or {}
    wr = er.get("weights_reload") or {}
    pf = h.get("prefetch") or {}
    pf = pf if isinstance(pf, dict) and "ready_s" in pf else {}
    cs = res.get("criu_stats") or {}
    print(f"ttft {res.get('time_to_first_token_s')} criu {spans.get('criu-restore')} (criu {cs.get('restore_s')}, "
          f"{cs.get('pages_restored')} pages) cuda {(h.get('cuda_restore_s') or {}).get('restore')} "
          f"resume {er.get('seconds')} {er.get('took_s')} reload {wr.get('took_s')} "
          f"prefetch init {pf.get('cuda_init_s')} load {pf.get('load_s')} ready {pf.get('ready_s')} "
          f"validate {spans.get('validate')}"
          + "".join(f" | peer reload {(q.get('weights_reload') or {}).get('seconds')} {q.get('took_s')}"
                    for q in er.get("peers") or []))
