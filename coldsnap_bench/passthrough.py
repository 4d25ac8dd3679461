"""`coldsnap bench --passthrough`: what coldsnap-runtime costs a runc call it passes through, as the node's runtime
for every pod. Each subcommand runs under runc itself, under coldsnap-runc (the C front door) and under the
coldsnap-runtime script (Python), side by side, best of N (the floor, not the scheduler's noise). Calls that runc
answers quickly with an error (state of no container, create of a bundle without a rootfs) cost runc the same
decision work as real ones and leave nothing behind."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap_bench.run import BenchOptions, BenchResult, host_record


def _best(argv: list[str], reps: int, env: dict) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=env)
        best = min(best, time.perf_counter() - t)
    return best


def run_passthrough(opts: BenchOptions, reps: int = 20, progress=lambda m: None) -> BenchResult:
    runc = shutil.which("runc")
    if runc is None:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, "no runc on PATH to compare with")
    bindir = Path(sys.prefix) / "bin"
    doors = {"runc": runc, "coldsnap-runc": str(bindir / "coldsnap-runc"),
             "coldsnap-runtime": str(bindir / "coldsnap-runtime")}
    doors = {k: v for k, v in doors.items() if os.path.exists(v)}
    env = {**os.environ, "COLDSNAP_RUNC": runc}
    with tempfile.TemporaryDirectory() as tmp:
        root, bundle = Path(tmp) / "root", Path(tmp) / "bundle"
        root.mkdir()
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "no-rootfs"},
                                                        "process": {"args": ["true"], "cwd": "/"}}))
        calls = {
            "--version": ["--version"],
            "list": ["--root", str(root), "list"],
            "state": ["--root", str(root), "state", "bench-none"],
            "create (unannotated)": ["--root", str(root), "create", "--bundle", str(bundle), "bench-none"],
            "start": ["--root", str(root), "start", "bench-none"],
            "delete": ["--root", str(root), "delete", "bench-none"],
            "kill": ["--root", str(root), "kill", "bench-none", "KILL"],
        }
        rows = []
        for what, args in calls.items():
            times = {door: _best([path, *args], reps, env) for door, path in doors.items()}
            row = {"call": what, **{f"{d}_ms": round(t * 1e3, 2) for d, t in times.items()}}
            for door in doors:
                if door != "runc":
                    row[f"{door}_overhead_ms"] = round((times[door] - times["runc"]) * 1e3, 2)
            rows.append(row)
            progress(f"{what}: " + ", ".join(f"{d} {t * 1e3:.1f} ms" for d, t in times.items()))
    worst = max((r.get("coldsnap-runc_overhead_ms", 0) for r in rows), default=None)
    data = {"kind": "coldsnap.bench.passthrough",
            "command": opts.command or "coldsnap " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "host": host_record(),
            "runc": subprocess.run([runc, "--version"], capture_output=True, text=True).stdout.splitlines()[0],
            "clock": f"best of {reps} of each call, runc vs the same call through each door",
            "rows": rows, "worst_front_door_overhead_ms": worst}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (opts.name or "passthrough")
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    _chart(data, stem.with_suffix(".png"), list(doors))
    lines = [f"{'call':<22}" + "".join(f"{d:>18}" for d in doors)]
    lines += [f"{r['call']:<22}" + "".join(f"{r[d + '_ms']:>15.2f} ms" for d in doors) for r in rows]
    lines.append(f"coldsnap-runc adds at most {worst} ms to a passed-through call\nwrote {stem}.json and {stem}.png")
    return BenchResult(data, "\n".join(lines))


def _chart(data: dict, path: Path, doors: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=120)
    width = 0.8 / len(doors)
    colors = {"runc": "#9a9a9a", "coldsnap-runc": "#2b7bba", "coldsnap-runtime": "#d98c1f"}
    for i, door in enumerate(doors):
        ax.bar([x + i * width for x in range(len(rows))], [r[f"{door}_ms"] for r in rows], width,
               label=door, color=colors.get(door))
    ax.set_xticks([x + width * (len(doors) - 1) / 2 for x in range(len(rows))], [r["call"] for r in rows],
                  rotation=20, fontsize=7)
    ax.set_ylabel("milliseconds (best of the samples)")
    ax.set_title(f"a passed-through runc call: coldsnap-runc adds at most {data['worst_front_door_overhead_ms']} ms",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, data["command"], fontsize=6, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)
