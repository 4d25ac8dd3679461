"""`coldsnap bench --via cri [--engine reference|vllm]`: a pod of the engine through containerd's CRI plugin, the
way a kubelet starts it, cold vs restored by coldsnap-runtime (runtime class "coldsnap", the pod annotated with
the capsule), N samples each, in one run.

Clock: from issuing StartContainer to the first non-empty streamed token of a completion from the host at the pod's
IP (coldsnap.workload.probe.ValidationProbe). RunPodSandbox and CreateContainer come before it (a kubelet makes
them whatever starts); for a restore StartContainer includes the shim's admit, digest verification, `runc
restore`, hydrate and the poststart hook's validation, and the capsule is staged before the samples. The floor in
the same run: StartContainer of a container that does nothing (`sleep`) from the same image, in the same kind of
pod: what any container start costs on this node.

Everything runs on private paths under one temporary directory (a private containerd with CRI, ColdSnap
home/run, the image's rootfs), removed at the end."""

from __future__ import annotations

import json
import os
import shlex
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from coldsnap.base.paths import settings
from coldsnap.base.procfs import alive
from coldsnap.base.progress import Progress
from coldsnap.contracts import CaptureRequest, ColdSnapError, ErrorCode, Validation
from coldsnap.contracts import capsule as mt
from coldsnap.contracts.results import CaptureFacts
from coldsnap.workload.probe import ValidationProbe
from coldsnap_bench.rootfs import host_usr_rootfs
from coldsnap_bench.run import BenchOptions, BenchResult, _chart, _stats, host_record, side_by_side
from coldsnap_bench.via import CACHE, ENGINE_ARGS, PORT, _sh, container_bench_ready, private_base

IMAGE = "localhost/coldsnap-bench:1"
NO_FALLBACK = json.dumps({"fallback_to_cold": False})  # a failed restore must fail the sample, not start cold


class PodSpec:
    """What the engine's container is made of: argv, environment, working directory, CRI mounts, and whether it
    wants a Memory emptyDir as /dev/shm (vLLM's queues)."""

    def __init__(self, engine: str, options: dict, base: Path):
        from coldsnap.oci.spec import host_bind
        from coldsnap_bench.cri import binds_to_mounts

        self.engine, self.base = engine, base
        if engine == "reference":
            from coldsnap_bench.via import PYTHON_HOME, REPO, VENV

            paths = ["/usr", str(REPO), *([str(VENV)] if not str(VENV).startswith(f"{REPO}/") else []),
                     *([str(PYTHON_HOME)] if not str(PYTHON_HOME).startswith("/usr") else [])]
            for d in ("models", "cache"):
                (base / d).mkdir(exist_ok=True)
            self.argv, self.env, self.cwd, self.model = list(ENGINE_ARGS), {"PYTHONDONTWRITEBYTECODE": "1"}, "", ""
            self.mounts = [*binds_to_mounts([m for p in paths for m in host_bind(p, p)]),
                           {"host_path": str(base / "models"), "container_path": "/models", "readonly": False},
                           {"host_path": str(base / "cache"), "container_path": CACHE, "readonly": False}]
            self.memory_shm = False
        elif engine == "vllm":
            from coldsnap.engines import get_adapter

            launch = get_adapter("vllm").prepare_container(CaptureRequest(operation="capture", engine={
                "name": "vllm", "options": {"enforce_eager": True, **options}}))
            self.argv, self.env, self.cwd = launch.argv, {**launch.env, "HOME": "/root"}, launch.cwd or ""
            self.model = launch.model_id or ""
            self.mounts = binds_to_mounts([*host_bind("/usr", "/usr"), *[
                m for b in launch.mounts for m in host_bind(b.source, b.target, b.readonly)]])
            self.memory_shm = True
        else:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--via cri benchmarks --engine reference or vllm")

    def scratch(self, node, name: str) -> list[dict]:
        """The pod's emptyDirs: /tmp and $HOME (and /dev/shm in memory, when the engine wants it)."""
        out = []
        for dest in ("/tmp", "/root"):
            path = self.base / "scratch" / f"{name}{dest.replace('/', '-')}"
            path.mkdir(parents=True, mode=0o1777)
            out.append({"host_path": str(path), "container_path": dest, "readonly": False})
        if self.memory_shm:
            out.append({"host_path": str(node.memory_dir(f"{name}-shm")), "container_path": "/dev/shm",
                        "readonly": False})
        return out


class Sample:
    def __init__(self, pod, cid: str, start_s: float, ttft: float, text: str):
        self.pod, self.cid, self.start_s, self.ttft, self.text = pod, cid, start_s, ttft, text


def _init_pid(cid: str) -> int:
    from coldsnap_bench.cri import RUNC_ROOT

    return int(json.loads((Path(RUNC_ROOT) / cid / "state.json").read_text())["init_process_pid"])


def run_pod_once(node, spec: PodSpec, kind: str, annotations: dict[str, str] | None,
                 validation: Validation) -> Sample:
    name = f"bench-{kind}-{uuid.uuid4().hex[:8]}"
    pod = node.run_pod(name, annotations)
    cid = node.create(pod, "engine", IMAGE, spec.argv, [*spec.scratch(node, name), *spec.mounts], spec.env,
                      workdir=spec.cwd)
    t0 = time.monotonic()
    node.start_container(cid)
    start_s = time.monotonic() - t0
    pid = _init_pid(cid)
    probe = ValidationProbe(node.pod_ip(pod), PORT, validation, spec.model)
    try:
        probe.wait_ready(alive=lambda: alive(pid), timeout=validation.ready_timeout_s)
        res = probe.complete()
    except ColdSnapError as e:
        raise ColdSnapError(e.code, f"{name}: {e.message}; its log: {node.log_lines(pod, cid)[-5:]}") from None
    return Sample(pod, cid, start_s, res.first_token_s - t0, res.text)


def floor_once(node) -> float:
    """StartContainer of a container that only sleeps, in a pod of its own: the node's cost of any start."""
    pod = node.run_pod(f"bench-floor-{uuid.uuid4().hex[:8]}")
    cid = node.create(pod, "sleep", IMAGE, ["/bin/sleep", "600"], [
        {"host_path": "/usr", "container_path": "/usr", "readonly": True}])
    try:
        return node.start_container(cid)
    finally:
        node.remove_pod(pod)


def run_pods_bench(opts: BenchOptions, progress: Progress = lambda m: None) -> BenchResult:
    from coldsnap_bench.cri import Node

    if opts.device != "cpu":
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--via cri benchmarks on cpu only")
    container_bench_ready(opts, "cri", "containerd", progress)

    with private_base("cri", progress) as (base, _):
        node = Node(base)
        try:
            spec = PodSpec(opts.engine, opts.engine_options, base)
            progress(f"a private containerd with CRI under {base} (runtime class coldsnap from `coldsnap runtime "
                     "configure --runtime containerd`)")
            node.start(dict(os.environ))
            node.import_image(host_usr_rootfs(base / "rootfs", extra_dirs=(CACHE,)), name=IMAGE)
            return _bench(opts, node, spec, progress)
        finally:
            progress(f"cleaning up (pods, containerd, {base})")
            node.stop()


def _bench(opts: BenchOptions, node, spec: PodSpec, progress: Progress) -> BenchResult:
    from coldsnap.flows.admission import load_capsule
    from coldsnap.flows.container_capture import capture_container
    from coldsnap.flows.staging import stage
    from coldsnap_bench.cri import RUNC_ROOT

    n, engine = opts.samples, opts.engine
    # One unmeasured cold pod: it writes the seeded weights and fills the compile cache; it is the one captured.
    progress("warm-up cold pod (not measured), then capture it (coldsnap capture --container, CRI's runc root)")
    first = run_pod_once(node, spec, "warmup", None, Validation())
    progress(f"warm-up: first token {first.ttft:.3f} s after StartContainer")
    cap = capture_container(first.cid, RUNC_ROOT, engine=engine, tag=f"bench-cri-{engine}", progress=progress)
    node.remove_pod(first.pod)
    validation, expected = cap.profile.validation, cap.profile.expected_text

    floor = []
    for _ in range(n):
        floor.append(floor_once(node))
    progress(f"floor: StartContainer of a sleeping container, median {sorted(floor)[len(floor) // 2]:.3f} s")

    def samples(kind: str, annotations: dict[str, str] | None) -> tuple[list[Sample], int, list[dict]]:
        out, ok, receipts = [], 0, []
        for i in range(n):
            s = run_pod_once(node, spec, kind, annotations, validation)
            node.remove_pod(s.pod)
            rec_path = settings().receipts / f"{s.cid}.json"
            rec = json.loads(rec_path.read_text()) if rec_path.exists() else {}
            good = s.text == expected and (annotations is None or (
                rec.get("state") == "succeeded" and rec.get("result", {}).get("validated_text") == expected))
            ok += int(good)
            if annotations is not None:
                receipts.append({"state": rec.get("state"), "spans": {sp["name"]: sp["duration_s"]
                                                                      for sp in rec.get("spans", [])}})
            out.append(s)
            progress(f"{kind} {i + 1}/{n}: first token {s.ttft:.3f} s after StartContainer (returned after "
                     f"{s.start_s:.3f} s)" + ("" if good else f"; NOT VALIDATED: {s.text!r} {rec.get('state')}"))
        return out, ok, receipts

    cold, ok_cold, _ = samples("cold", None)
    progress("staging the capsule before the samples (verify digests, unpack)")
    t = time.monotonic()
    stage(load_capsule(cap.capsule, False))
    staging_s = time.monotonic() - t
    restored, ok_restored, receipts = samples("restored", {mt.ANNOTATION_CAPSULE: cap.capsule,
                                                           mt.ANNOTATION_POLICY: NO_FALLBACK})

    v, rr = _stats([s.ttft for s in cold]), _stats([s.ttft for s in restored])
    prof = cap.profile
    command = opts.command or (f"coldsnap bench --via cri --engine {engine} --samples {n} "
                               f"--out {shlex.quote(str(opts.out))}")
    data = {
        "kind": "coldsnap.bench", "via": "cri", "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host_record(prof),
        "node": {"containerd": _sh(["containerd", "--version"]).stdout.strip(),
                 "runc": _sh(["runc", "--version"]).stdout.splitlines()[0], "runtime_handler": "coldsnap",
                 "cni": "bridge + host-local (Debian containernetworking-plugins)"},
        "page_cache": "warm", "engine": engine, "device": "cpu", "weights_mode": prof.weights_mode,
        "engine_argv": spec.argv, "samples": n,
        "clock": "issue of CRI StartContainer -> first non-empty streamed token of a completion from the host at "
                 "the pod's IP; RunPodSandbox and CreateContainer before it; restored: StartContainer includes "
                 "admit + digest verification + runc restore + hydrate + the poststart validation; unpacking "
                 "staged beforehand",
        "staged_before_samples": True,
        "vanilla": v, "restore": rr, "ratio_median": round(v["median_s"] / rr["median_s"], 2),
        "floor": {"what": "StartContainer of a sleeping container from the same image", **_stats(floor)},
        "start_container_returned_s": {"vanilla": _stats([s.start_s for s in cold]),
                                       "restore": _stats([s.start_s for s in restored])},
        "validations": {"vanilla": f"{ok_cold}/{n}", "restore": f"{ok_restored}/{n}"},
        "expected_text": expected, "restore_receipts": receipts,
        "capsule": {"digest": cap.capsule, "bytes": cap.receipt.facts(CaptureFacts).capsule_bytes,
                    "staging_s": round(staging_s, 3),
                    "capture_spans": {s.name: s.duration_s for s in cap.receipt.spans}},
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (opts.name or f"{engine}-cri-cpu")
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    label = {**data, "engine": f"{engine} pod via CRI"}
    _chart(label, stem.with_suffix(".png"))
    summary = (side_by_side(label) + f"\nfloor (StartContainer of a sleeping container): median "
               f"{data['floor']['median_s']:.3f} s\nwrote {stem}.json and {stem}.png")
    return BenchResult(data, summary)
