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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from coldsnap.base.paths import settings
from coldsnap.contracts import CaptureRequest, ColdSnapError, ErrorCode, Launch, Policy, RestoreRequest
from coldsnap.contracts.results import CaptureFacts, RestoreFacts
from coldsnap.criu.driver import CriuDriver
from coldsnap.engines import get_adapter
from coldsnap.flows.capture import capture
from coldsnap.flows.coldstart import start_cold
from coldsnap.flows.restore import restore
from coldsnap.net import destroy_network
from coldsnap.workload.process import kill_tree, stop_workload
from coldsnap.workload.state import load_state


@dataclass
class BenchOptions:
    """What `coldsnap bench` (and `demo`) measure; the CLI fills it from its arguments."""

    engine: str = "reference"
    samples: int = 5  # restore samples (and vanilla, unless vanilla_samples)
    vanilla_samples: int | None = None
    device: str = "cpu"
    weights_mode: str = "auto"
    engine_options: dict = field(default_factory=dict)
    out: str = "bench/results"
    name: str | None = None  # result file stem (default ENGINE-DEVICE-MODE)
    drop_caches: bool = False
    via: str | None = None  # podman | docker: the reference engine in a container (bench.via)
    template: bool = False  # three ways: vanilla, the template capsule's restore, the full capsule's restore
    deadline_s: float | None = None  # cold node: no sample that would end later than this after the start
    arms: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # cold node: (name, settings) in turns
    command: str = ""  # the command line that made the result, recorded in it


@dataclass
class BenchResult:
    data: dict  # what the result JSON holds
    summary: str  # the side-by-side lines a person reads


def capture_request(opts: BenchOptions, tag_suffix: str = "", snapshot_driver: str = "full") -> CaptureRequest:
    """The capture every bench of one workload makes: workload bench-ENGINE, tagged bench-ENGINE-DEVICE[-SUFFIX]."""
    return CaptureRequest(operation="capture", engine={"name": opts.engine, "options": opts.engine_options},
                          launch=Launch(devices=[] if opts.device == "cpu" else [opts.device]),
                          policy=Policy(weights_mode=opts.weights_mode), lifecycle={"name": f"bench-{opts.engine}"},
                          tag=f"bench-{opts.engine}-{opts.device}{tag_suffix}", snapshot_driver=snapshot_driver)


def host_record(profile=None) -> dict:
    """The machine a result was measured on, as every bench records it (the capsule's host profile, when it has one)."""
    host = {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count() or 0}
    if profile is not None:
        host.update({"cpu_model": profile.host.cpu_model, "criu": profile.host.criu_version,
                     "gpus": [g.name for g in profile.host.gpus]})
    return host


def _stats(xs: list[float]) -> dict:
    return {"samples_s": [round(x, 4) for x in xs], "median_s": round(statistics.median(xs), 4),
            "min_s": round(min(xs), 4), "max_s": round(max(xs), 4)} if xs else {"samples_s": []}


# A restore's clock, in order: what each part of it took (the receipt's spans, hydrate split in two), up to the
# first token. Stacked per restore in the charts, beside the same-run limit.
CLOCK_PARTS = ("network", "criu-restore", "cuda driver", "engine resume", "first token")


def clock_parts(took: dict[str, float], result: RestoreFacts) -> dict[str, float]:
    """Split a restore's time to first token (result's) into CLOCK_PARTS from its spans (took: name → seconds):
    hydrate into the CUDA driver's restore and the engine's resume (weights, KV cache, graphs), and the first token
    as what remains after them (the validation request up to its first token)."""
    cuda = sum(((result.hydrate and result.hydrate.cuda_restore_s) or {}).values())  # by step: restore, unlock
    hydrate = took.get("hydrate", 0.0)
    cuda = min(cuda, hydrate)
    parts = {"network": took.get("network", 0.0), "criu-restore": took.get("criu-restore", 0.0),
             "cuda driver": cuda, "engine resume": hydrate - cuda}
    parts["first token"] = max((result.time_to_first_token_s or 0.0) - sum(parts.values()), 0.0)
    return {k: round(v, 4) for k, v in parts.items()}


def run_bench(opts: BenchOptions, progress=lambda m: None) -> BenchResult:
    n = opts.samples
    if n < 1:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--samples must be at least 1")
    device = opts.device
    req = capture_request(opts, snapshot_driver="both" if opts.template else "full")
    name = req.lifecycle.name
    adapter = get_adapter(opts.engine)
    launch = adapter.prepare(req)
    CriuDriver()  # no CRIU, no capture: say so now (where it looked), not after the cold starts

    # One unmeasured cold start first: it writes the seeded weights and fills the compile cache, so every vanilla
    # sample below pays what a real server's restart pays (compile with a warm cache, warm-up), not first-ever costs.
    progress("warm-up cold start (not measured)")
    _vanilla_once(name, req, launch, expected=None)

    progress(f"capturing {opts.engine} on {device}")
    cap = capture(req, progress=progress)
    expected = cap.profile.expected_text
    capsule_bytes = cap.receipt.facts(CaptureFacts).capsule_bytes

    nv = opts.vanilla_samples or n
    vanilla, validated_vanilla, vanilla_phases = [], 0, []
    for i in range(nv):
        if opts.drop_caches:
            drop_page_cache()
        try:
            ttft = _vanilla_once(name, req, launch, expected)
            vanilla_phases.append(adapter.startup_timings(_engine_log(name)))
        except ColdSnapError as e:
            if e.code != ErrorCode.VALIDATION_FAILED:
                raise
            progress(f"vanilla {i + 1}/{nv}: NOT VALIDATED ({e.message})")  # counted, not timed
            continue
        vanilla.append(ttft)
        validated_vanilla += 1
        progress(f"vanilla {i + 1}/{nv}: first token {ttft:.3f} s")

    progress("staging the capsule (prepare: verify digests, unpack)")
    t = time.monotonic()
    restore(RestoreRequest(operation="prepare", capsule=cap.capsule))
    staging_s = time.monotonic() - t

    # Restores run as a user's would, falling back to a cold start when they must: a fallback is counted and its
    # time kept apart (it is not a restore), a restore that served another text is not validated.
    restored, validated_restore, fell_back, parts, resumes = [], 0, [], [], []
    for i in range(n):
        if opts.drop_caches:
            drop_page_cache()
        r = restore(RestoreRequest(operation="restore", capsule=cap.capsule))
        res = r.facts(RestoreFacts)
        stop_workload(load_state(res.workload))
        if r.state == "fell-back":
            fell_back.append(res.time_to_first_token_s)
            progress(f"restore {i + 1}/{n}: FELL BACK to a cold start ({res.fallback_reason})")
            continue
        restored.append(res.time_to_first_token_s)
        parts.append(clock_parts({s.name: s.duration_s for s in r.spans}, res))
        resumes.append((res.hydrate.engine_resume if res.hydrate else None) or {})
        validated_restore += int(res.validated_text == expected)
        steps = timings(resumes[-1])
        progress(f"restore {i + 1}/{n}: first token {res.time_to_first_token_s:.3f} s"
                 + (f"; the engine's resume steps {steps}" if steps else ""))
    template = _template_samples(cap, n, opts.drop_caches, progress) if opts.template else None
    if not vanilla or not restored:
        raise ColdSnapError(ErrorCode.VALIDATION_FAILED, f"nothing to compare: {validated_vanilla}/{nv} vanilla "
                            f"samples validated, {len(restored)}/{n} restores did not fall back")

    v, rr = _stats(vanilla), _stats(restored)
    from coldsnap_bench import bandwidth

    staged = settings().staged / cap.capsule.split(":")[1] / "images"
    pages = max(staged.glob("pages-*.img"), key=lambda p: p.stat().st_size, default=None) if staged.exists() else None
    weight_files = [w.path for w in (cap.profile.model.weights if cap.profile.model else []) if os.path.exists(w.path)]
    weights_bytes = sum(os.path.getsize(p) for p in weight_files)
    # Cold samples read their bytes from disk: the rate is measured on the biggest file a restore reads.
    cold_file = (max([*weight_files, *([pages] if pages else [])], key=os.path.getsize, default=None)
                 if opts.drop_caches else None)
    bw = bandwidth.measure(pages, cold_file)
    apart = cap.receipt.facts(CaptureFacts).weights_apart
    limit = bandwidth.restore_limit(bw, bandwidth.dir_bytes(staged) if staged.exists() else 0, weights_bytes,
                                    weights_in_images=not apart, from_disk=opts.drop_caches)
    ratio = round(v["median_s"] / rr["median_s"], 2)
    data = {
        "kind": "coldsnap.bench",
        "command": opts.command or "coldsnap " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host_record(cap.profile),
        "page_cache": "dropped before every sample" if opts.drop_caches else "warm",
        "engine": opts.engine, "device": device, "weights_mode": cap.profile.weights_mode,
        "samples": n,
        "clock": "issue of start/restore -> first non-empty streamed token; staging excluded and reported apart",
        "vanilla": v, "restore": rr, "ratio_median": ratio,
        "restore_parts": parts,  # per restore: where its clock went (CLOCK_PARTS)
        # where the time goes inside: the engine's own log of each vanilla start, its resume steps in each restore
        "vanilla_phases_median_s": _medians(vanilla_phases),
        "engine_resume_median_s": _medians(resumes),
        "engine_resume": resumes,
        "vanilla_samples": nv,
        "validations": {"vanilla": f"{validated_vanilla}/{nv}", "restore": f"{validated_restore}/{n}"},
        "fell_back": len(fell_back), "fell_back_samples_s": [round(x, 4) for x in fell_back],
        **({"template": template} if template else {}),
        "bandwidth": bw, "physical_limit": limit,
        "capsule": {"digest": cap.capsule, "bytes": capsule_bytes, "staging_s": round(staging_s, 3),
                    "capture_spans": {s.name: s.duration_s for s in cap.receipt.spans},
                    **_gpu_checkpointed(cap.receipt)},
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (opts.name or f"{opts.engine}-{device.replace(':', '')}-{cap.profile.weights_mode}"
                  + ("-template" if opts.template else ""))
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    _chart(data, stem.with_suffix(".png"))
    return BenchResult(data, side_by_side(data) + f"\nwrote {stem}.json and {stem}.png")


SPANS = ("criu-restore", "hydrate", "validate")


def _template_samples(cap, n: int, drop_caches: bool, progress) -> dict:
    """n restores of the template captured beside the full capsule (bench --template): their time to first token,
    and the median of each span (hydrate is the template's device work: load, build, compile, graphs, warm-up)."""
    digest = cap.receipt.facts(CaptureFacts).template.capsule
    restore(RestoreRequest(operation="prepare", capsule=digest))
    times, spans, phases, validated = [], {k: [] for k in SPANS}, {}, 0
    for i in range(n):
        if drop_caches:
            drop_page_cache()
        r = restore(RestoreRequest(operation="restore", capsule=digest))
        res = r.facts(RestoreFacts)
        stop_workload(load_state(res.workload))
        if r.state != "succeeded":
            progress(f"template restore {i + 1}/{n}: {r.state.upper()} ({res.fallback_reason})")
            continue
        times.append(res.time_to_first_token_s)
        validated += int(res.validated_text == cap.profile.expected_text)
        for s in r.spans:
            if s.name in spans:
                spans[s.name].append(s.duration_s)
        # the engine's device work inside hydrate: CUDA init, weights, build, compile, graphs, warm-up
        for k, v in (((res.hydrate.engine_resume if res.hydrate else None) or {}).get("phases") or {}).items():
            phases.setdefault(k, []).append(v)
        progress(f"template restore {i + 1}/{n}: first token {times[-1]:.3f} s")
    return {"capsule": digest, **_stats(times), "validated": f"{validated}/{n}",
            "span_medians_s": {k: round(statistics.median(v), 4) for k, v in spans.items() if v},
            "device_work_medians_s": {k: round(statistics.median(v), 4) for k, v in phases.items()}}


def _engine_log(name: str) -> str:
    from coldsnap.workload.state import run_dir

    try:
        return (run_dir(name) / "engine.log").read_text(errors="replace")
    except OSError:
        return ""


def timings(account: dict) -> dict[str, float]:
    """The seconds of an engine's account (keys ending in _s), for the text; the JSON keeps all of it."""
    return {k: round(v, 3) for k, v in account.items() if k.endswith("_s") and isinstance(v, (int, float))}


def _medians(samples: list[dict]) -> dict[str, float]:
    """The median of each numeric key across samples (a key missing from some: over those that have it)."""
    keys = {k for s in samples for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: round(statistics.median([s[k] for s in samples if isinstance(s.get(k), (int, float))]), 4)
            for k in sorted(keys)}


def drop_page_cache() -> None:
    """Cold-cache samples: what a restore costs when its bytes come from disk, not memory."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def _vanilla_once(name: str, req: CaptureRequest, launch, expected: str | None) -> float:
    cold = start_cold(name, req.launch.port, launch.argv, launch.env, launch.cwd, req.validation, expected=expected)
    try:
        return cold.time_to_first_token
    finally:
        kill_tree(cold.state.pid)
        destroy_network(cold.state.plan)


def _chart(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = data.get("restore_parts") or []
    if parts:  # beside the comparison: each restore's clock, part by part, against the same-run limit
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120, gridspec_kw={"width_ratios": [1.1, 1]})
        stack_parts(ax2, parts, (data.get("physical_limit") or {}).get("limit_s"))
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    labels = ["vanilla start", "ColdSnap restore"]
    series = [data["vanilla"]["samples_s"], data["restore"]["samples_s"]]
    meds = [data["vanilla"]["median_s"], data["restore"]["median_s"]]
    colors = ["#9a9a9a", "#2b7bba"]
    if data.get("template", {}).get("samples_s"):  # bench --template: the template's restore between the two
        labels[1] = "full-state restore"
        labels.insert(1, "template restore")
        series.insert(1, data["template"]["samples_s"])
        meds.insert(1, data["template"]["median_s"])
        colors.insert(1, "#ff7f0e")
    ax.bar(labels, meds, color=colors, alpha=0.8)
    for i, xs in enumerate(series):
        ax.scatter([i] * len(xs), xs, color="black", s=12, zorder=3)
        top = max(xs) if xs else meds[i]  # above the highest dot, so the label stays readable
        ax.annotate(f"{meds[i]:.2f} s", (i, top), textcoords="offset points", xytext=(0, 6), ha="center")
    floor = (data.get("floor") or {}).get("median_s")
    if floor is not None:  # what any start costs in the same run (e.g. a container that only sleeps)
        ax.axhline(floor, color="#d62728", linestyle="--", linewidth=1)
        ax.annotate(f"floor {floor:.3f} s: {data['floor']['what']}", (1.45, floor), textcoords="offset points",
                    xytext=(0, 4), ha="right", fontsize=7, color="#d62728")
    ax.set_ylabel("seconds to first token (median, samples as dots)")
    ax.set_title(f"{data['engine']} on {data['device']} ({data['weights_mode']}): {data['ratio_median']}x sooner, "
                 f"n={data['samples']}", fontsize=10)
    fig.text(0.01, 0.01, data["command"], fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)


PART_COLORS = {"network": "#bcbd22", "criu-restore": "#2b7bba", "cuda driver": "#d62728",
               "engine resume": "#ff7f0e", "first token": "#2ca02c"}


def stack_parts(ax, parts: list[dict], limit: float | None) -> None:
    """One bar per restore, its CLOCK_PARTS stacked, and the same-run limit as a line."""
    for i, run in enumerate(parts):
        bottom = 0.0
        for k in CLOCK_PARTS:
            ax.bar(i, run.get(k, 0.0), bottom=bottom, color=PART_COLORS[k], label=k if i == 0 else None)
            bottom += run.get(k, 0.0)
    if limit:
        ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"limit {limit} s (same run)")
    ax.set_xticks(range(len(parts)), [str(i + 1) for i in range(len(parts))], fontsize=7)
    ax.set_xlabel("restore")
    ax.set_ylabel("seconds from restore to first token")
    ax.set_title("where each restore's time went", fontsize=10)
    ax.legend(fontsize=7)


def side_by_side(data: dict) -> str:
    v, r = data["vanilla"], data["restore"]
    rows = [
        ("", "vanilla start", "ColdSnap restore"),
        ("first token, median", f"{v['median_s']:.3f} s", f"{r['median_s']:.3f} s"),
        ("first token, min", f"{v['min_s']:.3f} s", f"{r['min_s']:.3f} s"),
        ("first token, max", f"{v['max_s']:.3f} s", f"{r['max_s']:.3f} s"),
        ("validated", data["validations"]["vanilla"], data["validations"]["restore"]),
    ]
    if "fell_back" in data:
        rows.append(("fell back to cold", "", str(data["fell_back"])))
    lines = [f"{a:<22}{b:>16}{c:>20}" for a, b, c in rows]
    t = data.get("template")
    if t and t.get("samples_s"):
        lines.append(f"template restore: first token {t['median_s']:.3f} s median ({t['validated']} validated; "
                     f"spans {t['span_medians_s']}; its device work {t.get('device_work_medians_s')})")
    if data.get("vanilla_phases_median_s"):
        lines.append(f"vanilla, the engine's own log (medians): {data['vanilla_phases_median_s']}")
    if steps := timings(data.get("engine_resume_median_s") or {}):
        lines.append(f"restore, the engine's resume steps (medians): {steps}")
    lines.append(f"{data['engine']} on {data['device']}, weights {data['weights_mode']}: restore reaches the first "
                 f"token {data['ratio_median']}x sooner; capsule {data['capsule']['bytes'] / 2**20:.0f} MiB, "
                 f"staging {data['capsule']['staging_s']:.2f} s (excluded)")
    return "\n".join(lines)


def _gpu_checkpointed(receipt) -> dict:
    """The device memory the capture's CUDA checkpoint saved (what each restore's driver step copies back), if any."""
    held = receipt.facts(CaptureFacts).gpu_memory_checkpointed
    return {"gpu_memory_checkpointed": held} if held else {}
