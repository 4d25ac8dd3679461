"""Vanilla start vs restore of the same workload, N samples each, in one run.

Both clocks run from the moment the start or restore is issued to the first non-empty streamed token. Staging
(verification + unpacking of the capsule) is excluded from the restore clock and reported on its own."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from coldsnap.base.paths import settings
from coldsnap.contracts import CaptureRequest, ColdSnapError, ErrorCode, Launch, Policy, RestoreRequest
from coldsnap.engines import get_adapter
from coldsnap.flows.capture import capture
from coldsnap.flows.coldstart import start_cold
from coldsnap.flows.restore import restore
from coldsnap.net import allocate_plan, destroy_network
from coldsnap.workload.process import kill_tree, stop_workload, uses_gpu
from coldsnap.workload.state import load_state


def _stats(xs: list[float]) -> dict:
    return {"samples_s": [round(x, 4) for x in xs], "median_s": round(statistics.median(xs), 4),
            "min_s": round(min(xs), 4), "max_s": round(max(xs), 4)} if xs else {"samples_s": []}


def run_bench(args, progress=lambda m: None) -> dict:
    n = args.samples
    if n < 1:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--samples must be at least 1")
    device = args.device
    name = f"bench-{args.engine}"
    from coldsnap.cli.main import engine_options

    req = CaptureRequest(operation="capture",
                         engine={"name": args.engine, "options": engine_options(getattr(args, "engine_opt", None))},
                         launch=Launch(devices=[] if device == "cpu" else [device]),
                         policy=Policy(weights_mode=args.weights_mode), lifecycle={"name": name},
                         tag=f"bench-{args.engine}-{device}")
    adapter = get_adapter(args.engine)
    launch = adapter.prepare(req)

    # One unmeasured cold start first: it writes the seeded weights and fills the compile cache, so every vanilla
    # sample below pays what a real server's restart pays (compile with a warm cache, warm-up), not first-ever costs.
    progress("warm-up cold start (not measured)")
    _vanilla_once(name, req, launch, expected=None)

    progress(f"capturing {args.engine} on {device}")
    cap = capture(req, progress=progress)
    expected = cap.profile.expected_text
    capsule_bytes = cap.receipt["result"]["capsule_bytes"]

    drop = getattr(args, "drop_caches", False)
    nv = getattr(args, "vanilla_samples", None) or n
    vanilla, validated_vanilla = [], 0
    for i in range(nv):
        if drop:
            drop_page_cache()
        ttft = _vanilla_once(name, req, launch, expected)
        vanilla.append(ttft)
        validated_vanilla += 1
        progress(f"vanilla {i + 1}/{nv}: first token {ttft:.3f} s")

    progress("staging the capsule (prepare: verify digests, unpack)")
    t = time.monotonic()
    restore(RestoreRequest(operation="prepare", capsule=cap.capsule))
    staging_s = time.monotonic() - t

    restored, validated_restore, fell_back = [], 0, 0
    for i in range(n):
        if drop:
            drop_page_cache()
        r = restore(RestoreRequest(operation="restore", capsule=cap.capsule, policy=Policy(fallback_to_cold=False)))
        res = r["result"]
        restored.append(res["time_to_first_token_s"])
        validated_restore += int(res["validated_text"] == expected)
        stop_workload(load_state(res["workload"]))
        progress(f"restore {i + 1}/{n}: first token {res['time_to_first_token_s']:.3f} s")

    v, rr = _stats(vanilla), _stats(restored)
    from coldsnap.bench import bandwidth

    staged = settings().run / "staged" / cap.capsule.split(":")[1] / "images"
    pages = max(staged.glob("pages-*.img"), key=lambda p: p.stat().st_size, default=None) if staged.exists() else None
    weight_files = [w.path for w in (cap.profile.model.weights if cap.profile.model else []) if os.path.exists(w.path)]
    weights_bytes = sum(os.path.getsize(p) for p in weight_files)
    # Cold samples read their bytes from disk: the rate is measured on the biggest file a restore reads.
    cold_file = max([*weight_files, *([pages] if pages else [])], key=os.path.getsize, default=None) if drop else None
    bw = bandwidth.measure(pages, cold_file)
    apart = cap.receipt.get("result", {}).get("weights_apart", cap.profile.weights_mode == "recovery")
    limit = bandwidth.restore_limit(bw, bandwidth.dir_bytes(staged) if staged.exists() else 0, weights_bytes,
                                    weights_in_images=not apart, from_disk=drop)
    ratio = round(v["median_s"] / rr["median_s"], 2)
    data = {
        "kind": "coldsnap.bench",
        "command": "coldsnap " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": {"machine": platform.machine(), "kernel": platform.release(), "cpus": _cpus(),
                 "cpu_model": cap.profile.host.cpu_model, "criu": cap.profile.host.criu_version,
                 "gpus": [g.name for g in cap.profile.host.gpus]},
        "page_cache": "dropped before every sample" if drop else "warm",
        "engine": args.engine, "device": device, "weights_mode": cap.profile.weights_mode,
        "samples": n,
        "clock": "issue of start/restore -> first non-empty streamed token; staging excluded and reported apart",
        "vanilla": v, "restore": rr, "ratio_median": ratio,
        "vanilla_samples": nv,
        "validations": {"vanilla": f"{validated_vanilla}/{nv}", "restore": f"{validated_restore}/{n}"},
        "fell_back": fell_back,
        "bandwidth": bw, "physical_limit": limit,
        "capsule": {"digest": cap.capsule, "bytes": capsule_bytes, "staging_s": round(staging_s, 3),
                    "capture_spans": {s["name"]: s["duration_s"] for s in cap.receipt["spans"]}},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (getattr(args, "name", None) or f"{args.engine}-{device.replace(':', '')}-{cap.profile.weights_mode}")
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    _chart(data, stem.with_suffix(".png"))
    data["_summary"] = side_by_side(data) + f"\nwrote {stem}.json and {stem}.png"
    return data


def drop_page_cache() -> None:
    """Cold-cache samples: what a restore costs when its bytes come from disk, not memory."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _vanilla_once(name: str, req: CaptureRequest, launch, expected: str | None) -> float:
    plan = allocate_plan(name, req.launch.port)
    cold = start_cold(name, plan, launch.argv, launch.env, launch.cwd, req.validation, expected=expected,
                      gpu=uses_gpu(req.launch.devices))
    try:
        return cold.time_to_first_token
    finally:
        kill_tree(cold.state.pid)
        destroy_network(plan)


def _chart(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    labels = ["vanilla start", "ColdSnap restore"]
    series = [data["vanilla"]["samples_s"], data["restore"]["samples_s"]]
    meds = [data["vanilla"]["median_s"], data["restore"]["median_s"]]
    ax.bar(labels, meds, color=["#9a9a9a", "#2b7bba"], alpha=0.8)
    for i, xs in enumerate(series):
        ax.scatter([i] * len(xs), xs, color="black", s=12, zorder=3)
        top = max(xs) if xs else meds[i]  # above the highest dot, so the label stays readable
        ax.annotate(f"{meds[i]:.2f} s", (i, top), textcoords="offset points", xytext=(0, 6), ha="center")
    ax.set_ylabel("seconds to first token (median, samples as dots)")
    ax.set_title(f"{data['engine']} on {data['device']} ({data['weights_mode']}): {data['ratio_median']}x sooner, "
                 f"n={data['samples']}", fontsize=10)
    fig.text(0.01, 0.01, data["command"], fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def side_by_side(data: dict) -> str:
    v, r = data["vanilla"], data["restore"]
    rows = [
        ("", "vanilla start", "ColdSnap restore"),
        ("first token, median", f"{v['median_s']:.3f} s", f"{r['median_s']:.3f} s"),
        ("first token, min", f"{v['min_s']:.3f} s", f"{r['min_s']:.3f} s"),
        ("first token, max", f"{v['max_s']:.3f} s", f"{r['max_s']:.3f} s"),
        ("validated", data["validations"]["vanilla"], data["validations"]["restore"]),
    ]
    lines = [f"{a:<22}{b:>16}{c:>20}" for a, b, c in rows]
    lines.append(f"{data['engine']} on {data['device']}, weights {data['weights_mode']}: restore reaches the first "
                 f"token {data['ratio_median']}x sooner; capsule {data['capsule']['bytes'] / 2**20:.0f} MiB, "
                 f"staging {data['capsule']['staging_s']:.2f} s (excluded)")
    return "\n".join(lines)
