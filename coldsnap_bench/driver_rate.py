"""The CUDA driver's own checkpoint and restore, timed apart from everything of ColdSnap's.

A child process holds a CUDA context (torch's, with cuBLAS loaded, as an engine's is) and N GiB of device memory
filled with a known value; this process locks, checkpoints, restores and unlocks it in place, times each call and
has the child check its memory afterwards. Restoring with nothing allocated gives the driver's fixed cost (the
context); the difference with N GiB gives its per-byte rate. A restore's "driver restore" span is bounded by these.

    python -m coldsnap_bench.driver_rate --gib 0 --gib 2 --repeat 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# The child: a context like an engine's (torch + cuBLAS), `gib` GiB at 1.0, then after each restore the check.
_CHILD = r"""
import sys, torch
n = int(float(sys.argv[1]) * (1 << 30) // 4)
x = torch.ones(n, device="cuda") if n else None
a = torch.randn(1024, 1024, device="cuda")
(a @ a).sum().item()
torch.cuda.synchronize()
print("ready", flush=True)
for line in sys.stdin:
    ok = x is None or bool((x == 1).all().item())
    print("ok" if ok else "corrupt", flush=True)
"""


def measure(gib: float, repeat: int, device: int = 0) -> dict:
    """Checkpoint and restore a child holding `gib` GiB `repeat` times; seconds of each driver call."""
    from coldsnap.gpu.cuda_checkpoint import CudaCheckpointAPI

    api = CudaCheckpointAPI()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(device)}
    err = tempfile.TemporaryFile("w+")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(gib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=err, text=True, env=env)
    try:
        stdin, stdout = child.stdin, child.stdout
        assert stdin is not None and stdout is not None  # both PIPE
        if stdout.readline().strip() != "ready":
            child.wait()
            err.seek(0)
            last = (err.read().strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the child holding {gib:g} GiB did not start: {last}")
        rounds = []
        for _ in range(repeat):
            took = {}
            for step in ("lock", "checkpoint", "restore", "unlock"):
                t = time.perf_counter()
                getattr(api, step)(child.pid)
                took[step] = round(time.perf_counter() - t, 4)
            stdin.write("check\n")
            stdin.flush()
            took["memory_intact"] = stdout.readline().strip() == "ok"
            rounds.append(took)
    finally:
        child.kill()
        child.wait()
        err.close()
    restores = [r["restore"] for r in rounds]
    return {"gib": gib, "rounds": rounds, "restore_median_s": round(statistics.median(restores), 4),
            "all_intact": all(r["memory_intact"] for r in rounds)}


def rate(results: list[dict]) -> dict:
    """Fixed cost (the smallest size's median restore) and per-byte rate (between the smallest and largest)."""
    lo, hi = min(results, key=lambda r: r["gib"]), max(results, key=lambda r: r["gib"])
    out = {"fixed_restore_s": lo["restore_median_s"]}
    extra = hi["restore_median_s"] - lo["restore_median_s"]
    if hi["gib"] > lo["gib"] and extra > 0:
        out["restore_gb_per_s"] = round((hi["gib"] - lo["gib"]) * (1 << 30) / extra / 1e9, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m coldsnap_bench.driver_rate", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, action="append", help="device memory the child holds (repeatable; "
                   "default 0 and 2)")
    p.add_argument("--repeat", type=int, default=3, help="checkpoint/restore rounds per size (default 3)")
    p.add_argument("--device", type=int, default=0, help="GPU ordinal (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    try:
        results = [measure(g, max(1, a.repeat), a.device) for g in (a.gib or [0.0, 2.0])]
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        print(f"coldsnap_bench.driver_rate: {e}", file=sys.stderr)
        return 2
    report = {"sizes": results, **rate(results)}
    if a.json:
        print(json.dumps(report))
    else:
        for r in results:
            print(f"{r['gib']:g} GiB: restore {r['restore_median_s']:.3f} s (median of {len(r['rounds'])}), "
                  f"memory intact: {r['all_intact']}")
        print(f"fixed {report['fixed_restore_s']:.3f} s" + (f", {report['restore_gb_per_s']} GB/s beyond it"
                                                             if "restore_gb_per_s" in report else ""))
    return 0 if all(r["all_intact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
