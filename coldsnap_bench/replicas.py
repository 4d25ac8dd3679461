"""`coldsnap bench --replicas N`: N restores of one capsule issued at once, against N vanilla starts issued at once,
for N = 1 … N, in one run. Each clock runs from issuing the N starts (or restores) to the last of them validated (its
real completion served and checked), so the figure is what a burst of N replicas waits for. Restores share one
staged capsule and the page cache; the limit beside each N is N times one restore's data movement at the
bandwidths measured in the same run (each replica reads its images and weights once)."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorCode, Policy, RestoreRequest
from coldsnap.contracts.results import CaptureFacts
from coldsnap.engines import get_adapter
from coldsnap.flows.capture import capture
from coldsnap.flows.coldstart import start_cold
from coldsnap.flows.restore import restore
from coldsnap.net import destroy_network
from coldsnap.workload.process import kill_tree, stop_workload
from coldsnap.workload.state import load_state
from coldsnap_bench import bandwidth
from coldsnap_bench.run import BenchOptions, BenchResult, capture_request, host_record


def _burst(n: int, one) -> tuple[float, list[bool]]:
    """Issue one(i) for i < n at once. Each returns (validated, when it was validated, how to stop it): the clock
    runs to the last of them validated; the workloads are stopped only after it, all together, so that no stop
    runs on the clock or beside a replica still coming up."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    seconds = max(done for _, done, _ in results) - t0
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda r: r[2](), results))
    return seconds, [ok for ok, _, _ in results]


def run_replicas(opts: BenchOptions, replicas: int, progress=lambda m: None) -> BenchResult:
    if replicas < 1:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--replicas must be at least 1")
    req = capture_request(opts, "-replicas")
    name = req.lifecycle.name
    launch = get_adapter(opts.engine).prepare(req)
    progress(f"capturing {opts.engine} on {opts.device}")
    cap = capture(req, progress=progress)
    expected = cap.profile.expected_text
    restore(RestoreRequest(operation="prepare", capsule=cap.capsule))  # staged once, shared by every replica

    def vanilla(i: int):
        cold = start_cold(f"{name}-v{i}", req.launch.port, launch.argv, launch.env, launch.cwd, req.validation,
                          expected=expected)  # returns once its completion served the expected text
        done = time.monotonic()

        def stop() -> None:
            kill_tree(cold.state.pid)
            destroy_network(cold.state.plan)
        return True, done, stop

    def restored(i: int):
        r = restore(RestoreRequest(operation="restore", capsule=cap.capsule, lifecycle={"name": f"{name}-r{i}"},
                                   policy=Policy(fallback_to_cold=False)))
        done = time.monotonic()
        ok = r.state == "succeeded" and r.result.validated_text == expected
        return ok, done, lambda: stop_workload(load_state(r.result.workload))

    rows = []
    for n in range(1, replicas + 1):
        v_s, v_ok = _burst(n, vanilla)
        r_s, r_ok = _burst(n, restored)
        rows.append({"replicas": n, "vanilla_s": round(v_s, 3), "restore_s": round(r_s, 3),
                     "validated": {"vanilla": f"{sum(v_ok)}/{n}", "restore": f"{sum(r_ok)}/{n}"}})
        progress(f"{n} at once: vanilla {v_s:.2f} s, restore {r_s:.2f} s")

    staged = settings().staged / cap.capsule.split(":")[1] / "images"
    pages = max(staged.glob("pages-*.img"), key=lambda p: p.stat().st_size, default=None) if staged.exists() else None
    bw = bandwidth.measure(pages, None)
    weights = sum(os.path.getsize(w.path) for w in (cap.profile.model.weights if cap.profile.model else [])
                  if os.path.exists(w.path))
    images = bandwidth.dir_bytes(staged) if staged.exists() else 0
    apart = cap.receipt.facts(CaptureFacts).weights_apart
    for row in rows:
        n = row["replicas"]
        limit = bandwidth.restore_limit(bw, n * images, n * weights, weights_in_images=not apart)
        row["limit_s"] = limit.get("limit_s")
    first = rows[0]
    data = {
        "kind": "coldsnap.bench.replicas",
        "command": opts.command or "coldsnap " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host_record(cap.profile),
        "engine": opts.engine, "device": opts.device, "weights_mode": cap.profile.weights_mode,
        "clock": "issue of N starts (or restores) at once -> the last of them validated (admission included, the "
                 "stops after the clock); staging done once before",
        "rows": rows,
        "growth": {"vanilla_per_replica_s": _slope(rows, "vanilla_s"), "restore_per_replica_s": _slope(rows,
                                                                                                        "restore_s")},
        "bandwidth": bw,
        "capsule": {"digest": cap.capsule, "bytes": cap.receipt.facts(CaptureFacts).capsule_bytes},
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (opts.name or f"{opts.engine}-{opts.device.replace(':', '')}-replicas")
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    _chart(data, stem.with_suffix(".png"))
    lines = [f"{'replicas':>9}{'vanilla':>12}{'restore':>12}{'limit':>10}{'validated':>14}"]
    lines += [f"{r['replicas']:>9}{r['vanilla_s']:>11.2f}s{r['restore_s']:>11.2f}s"
              f"{(r['limit_s'] or 0):>9.3f}s{r['validated']['restore']:>14}" for r in rows]
    lines.append(f"{opts.engine} on {opts.device}: one restore {first['restore_s']:.2f} s, each more +"
                 f"{data['growth']['restore_per_replica_s']} s; one vanilla start {first['vanilla_s']:.2f} s, each "
                 f"more +{data['growth']['vanilla_per_replica_s']} s\nwrote {stem}.json and {stem}.png")
    return BenchResult(data, "\n".join(lines))


def _slope(rows: list[dict], key: str) -> float | None:
    """Seconds each further replica adds (least squares over N)."""
    if len(rows) < 2:
        return None
    xs, ys = [r["replicas"] for r in rows], [r[key] for r in rows]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 3)


def _chart(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    xs = [r["replicas"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(xs, [r["vanilla_s"] for r in rows], "o-", color="#9a9a9a", label="N vanilla starts at once")
    ax.plot(xs, [r["restore_s"] for r in rows], "o-", color="#2b7bba", label="N restores of one capsule at once")
    if all(r.get("limit_s") for r in rows):
        ax.plot(xs, [r["limit_s"] for r in rows], "--", color="#2b7bba", alpha=0.5, label="physical limit (same run)")
    ax.set_xlabel("replicas issued at once (N)")
    ax.set_ylabel("seconds until all N validated")
    ax.set_xticks(xs)
    ax.set_title(f"{data['engine']} on {data['device']} ({data['weights_mode']}): N replicas", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, data["command"], fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)
