"""`coldsnap bench --via podman|docker`: the reference engine in a container, started cold vs restored by
coldsnap-runtime, N samples each, in one run; plus the runtime's pass-through overhead against plain runc.

Clock: from issuing `podman run -d` / `docker run -d` to the first non-empty streamed token of a completion
(coldsnap.workload.probe.ValidationProbe, from inside the container's network namespace, as coldsnap-hook does). For the
restored runs that includes everything the shim does inside `run` (admit, digest verification, `runc restore`,
hydrate, the poststart hook's own validation); the capsule is staged (unpacked) before the samples.

Everything runs on private paths under one temporary directory (ColdSnap home/run, podman storage or a private
dockerd, the image's rootfs, the compile cache), removed at the end. The image is built as the container tests
build theirs: a rootfs that binds the host's /usr, the repository and its interpreter read-only."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from coldsnap.base.paths import settings
from coldsnap.base.procfs import alive
from coldsnap.base.progress import Progress
from coldsnap.contracts import ColdSnapError, ErrorCode, Validation
from coldsnap.contracts import capsule as mt
from coldsnap.contracts.results import CaptureFacts
from coldsnap.criu.driver import CriuDriver
from coldsnap.workload.probe import ProbeResult, ValidationProbe
from coldsnap.workload.target import Target
from coldsnap_bench.rootfs import host_usr_rootfs
from coldsnap_bench.run import BenchOptions, BenchResult, _chart, _stats, host_record, side_by_side

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
PYTHON_HOME = Path(sys.base_prefix)
RUNTIME = VENV / "bin" / "coldsnap-runtime"
HOOK = VENV / "bin" / "coldsnap-hook"
SETUP = REPO / "packaging" / "containers" / "setup.sh"
PORT = 8000
CACHE = "/cache"  # the inductor cache, a volume: restored processes map its compiled kernels at the same paths
OVERHEAD_REPS = 20
NO_FALLBACK = json.dumps({"fallback_to_cold": False})  # a failed restore must fail the sample, not start cold
# The container tests' engine options, with torch.compile left on (the server's default).
ENGINE_ARGS = [str(VENV / "bin" / "python"), "-m", "coldsnap_reference.server",
               "--weights", "/models/reference.safetensors", "--host", "0.0.0.0", "--port", str(PORT),
               "--device", "cpu", "--compile-cache", f"{CACHE}/inductor", "--layers", "2", "--hidden", "64",
               "--heads", "2", "--kv-mib", "4", "--threads", "1", "--weights-load", "copy", "--warmup-tokens", "2"]


# --- the image and the engines, as tests/containers_fixture.py and tests/test_shim_{podman,docker}.py do ----------
def shared_volumes() -> list[str]:
    """Host /usr, the repository (with its venv) and the interpreter's home, read-only at the same paths."""
    paths = ["/usr", str(REPO)]
    if not str(VENV).startswith(str(REPO) + "/"):
        paths.append(str(VENV))
    if not str(PYTHON_HOME).startswith("/usr"):
        paths.append(str(PYTHON_HOME))
    return [a for p in paths for a in ("-v", f"{p}:{p}:ro")]


def coldsnap_env(base: Path, criu_prefix: str) -> dict[str, str]:
    return {"COLDSNAP_HOME": str(base / "home"), "COLDSNAP_RUN": str(base / "run"),
            "COLDSNAP_CRIU_PREFIX": criu_prefix}


def container_bench_ready(opts: BenchOptions, via: str, component: str, progress: Progress) -> None:
    """What every container bench needs before it starts anything: samples, root, CRIU, and the engine's packages
    (packaging/containers/setup.sh install COMPONENT)."""
    if opts.samples < 1:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--samples must be at least 1")
    if os.geteuid() != 0:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"--via {via} needs root ({component}, runc, CRIU)")
    CriuDriver()  # raises, saying where it looked, without CRIU
    progress(f"making sure {component} is installed (packaging/containers/setup.sh install {component})")
    r = _sh([str(SETUP), "install", component])
    if r.returncode != 0:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"setup.sh install {component}: "
                            f"{(r.stderr or r.stdout).strip()[-400:]}")


@contextmanager
def private_base(name: str, progress: Progress = lambda m: None) -> Iterator[tuple[Path, dict[str, str]]]:
    """(a fresh directory under /var/tmp, the environment that points ColdSnap's home and run dir into it): set in
    this process, and so in every daemon and tool a container bench starts, for the duration; then restored, and
    the directory removed."""
    criu_prefix = str(settings().criu_prefix)
    base = Path(tempfile.mkdtemp(prefix=f"coldsnap-bench-{name}-", dir="/var/tmp"))
    env = coldsnap_env(base, criu_prefix)
    saved = {k: os.environ.get(k) for k in (*env, "COLDSNAP_STORE", "COLDSNAP_RECEIPTS")}
    os.environ.update(env)
    for k in ("COLDSNAP_STORE", "COLDSNAP_RECEIPTS"):
        os.environ.pop(k, None)
    try:
        yield base, env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(base, ignore_errors=True)
        if base.exists():
            progress(f"note: {base} could not be removed entirely (a mount left behind?)")


def env_wrapper(path: Path, env: dict[str, str], target: Path) -> Path:
    """podman starts its runtime with an almost empty environment: the private paths travel in a wrapper."""
    path.write_text("#!/bin/sh\nexport " + " ".join(f"{k}={v}" for k, v in env.items()) + f"\nexec {target} \"$@\"\n")
    path.chmod(0o755)
    return path


def _sh(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


class Engine:
    via = ""
    cli: list[str] = []
    image = ""
    runtime_binary = str(RUNTIME)  # what the engine executes as its OCI runtime

    def __init__(self, base: Path, env: dict[str, str]):
        self.base, self.env = base, env
        self.models = base / "models"
        self.cache = base / "cache"
        for d in (self.models, self.cache):
            d.mkdir(exist_ok=True)
        self.engine_args = list(ENGINE_ARGS)

    def __call__(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        r = _sh([*self.cli, *args], timeout)
        if check and r.returncode != 0:
            raise ColdSnapError(ErrorCode.RUNTIME, f"{self.via} {' '.join(args[:2])} failed ({r.returncode}): "
                                f"{(r.stderr or r.stdout).strip()[-600:]}")
        return r

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def import_image(self, tar: Path) -> None:
        raise NotImplementedError

    def run_argv(self, name: str, capsule: str | None) -> list[str]:
        raise NotImplementedError

    def runc_roots(self) -> list[Path]:
        raise NotImplementedError

    def remove(self, name: str) -> None:
        self("rm", "-f", name, check=False)

    def remove_all(self) -> None:
        ids = self("ps", "-aq", check=False).stdout.split()
        if ids:
            self("rm", "-f", *ids, check=False)

    def status(self, name: str) -> str:
        r = self("inspect", "--format", "{{.State.Status}}", name, check=False)
        return r.stdout.strip()

    def logs(self, name: str) -> str:
        r = self("logs", name, check=False)
        return (r.stdout + r.stderr).strip()[-1500:]

    def startup_phases(self, name: str) -> dict:
        """The engine's own start-up phases (its {"event": "ready"} line): where a cold start's time went."""
        r = self("logs", name, check=False)
        for line in reversed((r.stdout + "\n" + r.stderr).splitlines()):
            if '"ready"' in line:
                try:
                    return {**json.loads(line).get("phases", {}), "total": json.loads(line).get("seconds")}
                except ValueError:
                    pass
        return {}

    def command(self) -> str:
        return " ".join(shlex.quote(a) for a in self.cli)


class Podman(Engine):
    via = "podman"
    image = "localhost/coldsnap-bench-via:1"
    limits = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]  # podman's defaults exceed ours

    def __init__(self, base: Path, env: dict[str, str]):
        super().__init__(base, env)
        self.cli = ["podman", "--root", str(base / "storage"), "--runroot", str(base / "runroot"),
                    "--tmpdir", str(base / "tmp"), "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
        self.runtime = env_wrapper(base / "coldsnap-runtime", env, RUNTIME)
        self.runtime_binary = str(self.runtime)
        env_wrapper(base / "coldsnap-hook", env, HOOK)
        self.hooks_dir = base / "hooks.d"
        self.hooks_dir.mkdir()
        for name in ("coldsnap.json", "coldsnap-poststop.json"):  # the packaged files, pointed at this venv
            hook = json.loads((REPO / "packaging" / "oci-hooks.d" / name).read_text())
            hook["hook"]["path"] = str(base / "coldsnap-hook")
            hook["hook"]["env"] = [f"{k}={v}" for k, v in env.items()]
            (self.hooks_dir / name).write_text(json.dumps(hook))

    def import_image(self, tar: Path) -> None:
        self("import", "--change", 'CMD ["/bin/sh"]', str(tar), self.image)

    def run_argv(self, name: str, capsule: str | None) -> list[str]:
        extra = [] if capsule is None else [
            "--annotation", f"{mt.ANNOTATION_CAPSULE}={capsule}",
            # podman splits --annotation values as CSV: a value with quotes must be a quoted CSV field
            "--annotation", '"{}={}"'.format(mt.ANNOTATION_POLICY, NO_FALLBACK.replace('"', '""')),
            "--hooks-dir", str(self.hooks_dir)]
        return [*self.cli, "run", "-d", "--name", name, "--runtime", str(self.runtime), "--network", "none",
                *self.limits, "-e", "PYTHONDONTWRITEBYTECODE=1", *shared_volumes(), "-v", f"{self.models}:/models",
                "-v", f"{self.cache}:{CACHE}", *extra, self.image, *self.engine_args]

    def runc_roots(self) -> list[Path]:
        return [Path("/run/runc")]  # podman's runc keeps its state there, whatever the runtime's path

    def remove(self, name: str) -> None:
        self("rm", "-f", "-t", "0", name, check=False)

    def remove_all(self) -> None:
        self("rm", "-a", "-f", "-t", "0", check=False)
        self("rmi", "-a", "-f", check=False)


class Docker(Engine):
    via = "docker"
    image = "coldsnap-bench-via:1"

    def __init__(self, base: Path, env: dict[str, str]):
        super().__init__(base, env)
        self.dir = base / "docker"
        self.cli = ["/usr/bin/docker", "-H", f"unix://{self.dir}/docker.sock"]  # the engine's own client version
        self.started = False

    def start(self) -> None:
        # dockerd → containerd → shim → runtime inherit this environment (the caller set the private paths)
        r = _sh([str(SETUP), "start-dockerd", str(self.dir)], 120)
        if r.returncode != 0:
            raise ColdSnapError(ErrorCode.ENVIRONMENT, f"cannot start dockerd: {(r.stderr or r.stdout).strip()[-400:]}")
        self.started = True

    def stop(self) -> None:
        if self.started:
            _sh([str(SETUP), "stop-dockerd", str(self.dir)], 120)
            # what a dockerd killed rather than stopped leaves mounted under its exec root (netns/default)
            for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
                point = line.split()[4]
                if point.startswith(f"{self.dir}/"):
                    _sh(["umount", "-l", point], 30)

    def import_image(self, tar: Path) -> None:
        self("import", str(tar), self.image)

    def run_argv(self, name: str, capsule: str | None) -> list[str]:
        # Docker 20.10 has no `run --annotation`: the shim reads COLDSNAP_* variables instead.
        extra = [] if capsule is None else ["-e", f"COLDSNAP_CAPSULE={capsule}",
                                            "-e", f"COLDSNAP_POLICY={NO_FALLBACK}"]
        return [*self.cli, "run", "-d", "--name", name, "--runtime", "coldsnap", "--network", "none",
                "-e", "PYTHONDONTWRITEBYTECODE=1", *shared_volumes(), "-v", f"{self.models}:/models",
                "-v", f"{self.cache}:{CACHE}", *extra, self.image, *self.engine_args]

    def runc_roots(self) -> list[Path]:
        exec_root = self.dir / "exec"
        return [exec_root / "runtime-runc" / "moby", *sorted(exec_root.glob("runtime-*/moby"))]

    def remove_all(self) -> None:
        super().remove_all()
        self("rmi", "-f", self.image, check=False)


ENGINES = {"podman": Podman, "docker": Docker}


# --- one sample --------------------------------------------------------------------------------------------------
def _first_token(host: str, port: int, validation: Validation, pid: int) -> ProbeResult:
    """Health, then a streamed completion (inside the container's netns); fail fast if the container died."""
    probe = ValidationProbe(host, port, validation)
    probe.wait_ready(alive=lambda: alive(pid), timeout=validation.ready_timeout_s)
    return probe.complete()


class Sample:
    def __init__(self, name: str, cid: str, pid: int, runc_root: Path, ttft: float, run_returned_s: float, text: str):
        self.name, self.cid, self.pid, self.runc_root = name, cid, pid, runc_root
        self.ttft, self.run_returned_s, self.text = ttft, run_returned_s, text


def _init_pid(engine: Engine, cid: str) -> tuple[int, Path]:
    """The container's host pid from runc's state file (no engine round trip inside the clock)."""
    for root in engine.runc_roots():
        try:
            return int(json.loads((root / cid / "state.json").read_text())["init_process_pid"]), root
        except (OSError, ValueError, KeyError):
            continue
    raise ColdSnapError(ErrorCode.RUNTIME, f"no runc state for container {cid} under "
                        f"{', '.join(map(str, engine.runc_roots()))}")


def run_once(engine: Engine, name: str, capsule: str | None, validation: Validation) -> Sample:
    argv = engine.run_argv(name, capsule)
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    returned = time.monotonic() - t0
    if r.returncode != 0:
        raise ColdSnapError(ErrorCode.RUNTIME, f"{engine.via} run failed ({r.returncode}): "
                            f"{(r.stderr or r.stdout).strip()[-800:]}")
    cid = r.stdout.strip().splitlines()[-1]
    pid, root = _init_pid(engine, cid)
    try:
        res = Target(pid=pid, port=PORT).call(_first_token, validation, pid)
    except ColdSnapError as e:
        raise ColdSnapError(e.code, f"{name}: {e.message}; container log: {engine.logs(name)}") from None
    return Sample(name, cid, pid, root, res.first_token_s - t0, returned, res.text)


# --- the wrapper's pass-through overhead -------------------------------------------------------------------------
def _time(argv: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        raise ColdSnapError(ErrorCode.RUNTIME, f"{' '.join(argv)} exited {r.returncode}")
    return dt


def passthrough_overhead(runc: str, runtime: str, runc_root: Path, cid: str, reps: int = OVERHEAD_REPS) -> dict:
    """Medians of `--version` and `state <running container>`, runc and coldsnap-runtime interleaved."""
    out = {"reps": reps, "runtime": runtime, "runc": runc, "container": cid}
    for what, tail in (("version", ["--version"]), ("state", ["--root", str(runc_root), "state", cid])):
        plain, wrapped = [], []
        for _ in range(reps):
            plain.append(_time([runc, *tail]))
            wrapped.append(_time([runtime, *tail]))
        mp, mw = statistics.median(plain), statistics.median(wrapped)
        out[what] = {"runc_median_ms": round(mp * 1e3, 2), "coldsnap_runtime_median_ms": round(mw * 1e3, 2),
                     "overhead_ms": round((mw - mp) * 1e3, 2),
                     "runc_ms": [round(x * 1e3, 2) for x in plain],
                     "coldsnap_runtime_ms": [round(x * 1e3, 2) for x in wrapped]}
    return out


# --- the bench ---------------------------------------------------------------------------------------------------
def _engine_flags(options: dict) -> list[str]:
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


def _command(opts: BenchOptions) -> str:
    return opts.command or (f"coldsnap bench --via {opts.via} --samples {opts.samples} "
                            f"--out {shlex.quote(str(opts.out))}")


def _coldsnap_settings(s: Sample) -> dict:
    from coldsnap.oci.spec import coldsnap_annotations, load_spec

    r = _sh(["runc", "--root", str(s.runc_root), "state", s.cid])
    try:
        return {k: v for k, v in coldsnap_annotations(load_spec(json.loads(r.stdout)["bundle"])).items()
                if k.startswith("io.coldsnap.")}
    except (OSError, ValueError, KeyError) as e:
        return {"error": f"cannot read the restored container's spec: {e}"}


def _receipt(cid: str) -> dict:
    path = settings().receipts / f"{cid}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def run_via_bench(opts: BenchOptions, progress: Progress = lambda m: None) -> BenchResult:
    via = opts.via
    if opts.engine != "reference" or opts.device != "cpu":
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--via benchmarks the reference engine on cpu only")
    container_bench_ready(opts, via, via, progress)
    flags = _engine_flags(opts.engine_options)

    with private_base(via, progress) as (base, env):
        engine = ENGINES[via](base, env)
        engine.engine_args += flags
        try:
            return _bench(opts, engine, progress)
        finally:
            progress(f"cleaning up ({via} containers and image, {base})")
            try:
                engine.remove_all()
            finally:
                engine.stop()


def _bench(opts: BenchOptions, engine: Engine, progress: Progress) -> BenchResult:
    from coldsnap.flows.admission import load_capsule
    from coldsnap.flows.container_capture import capture_container
    from coldsnap.flows.staging import stage

    via, n, base = engine.via, opts.samples, engine.base
    validation = Validation()
    engine.start()
    rootfs = host_usr_rootfs(base / "rootfs", extra_dirs=(CACHE,))
    with tarfile.open(base / "rootfs.tar", "w") as tar:
        tar.add(rootfs, arcname=".")
    engine.import_image(base / "rootfs.tar")
    progress(f"image {engine.image} imported into a private {via}")

    def name(kind: str) -> str:
        return f"bench-{kind}-{uuid.uuid4().hex[:8]}"

    # One unmeasured cold start: it writes the seeded weights and fills the compile cache (a volume, as the
    # restored process maps its kernels from there), so each measured cold start pays what a real restart pays
    # (torch.compile tracing, lowering and code generation; kernel binaries reused) and not first-ever costs.
    # It is the container captured.
    progress("warm-up cold start (not measured; compiles with an empty cache), then capture")
    first = run_once(engine, name("warmup"), None, validation)
    first_phases = engine.startup_phases(first.name)
    progress(f"warm-up: first token {first.ttft:.3f} s after `{via} run -d`")
    cap = capture_container(first.cid, first.runc_root, tag=f"bench-via-{via}", progress=progress)
    expected = cap.profile.expected_text
    deadline = time.monotonic() + 60
    while engine.status(first.name) not in ("exited", "stopped", "") and time.monotonic() < deadline:
        time.sleep(0.2)
    engine.remove(first.name)

    cold, validated_cold, returned_cold, phases_cold = [], 0, [], []
    for i in range(n):
        s = run_once(engine, name("cold"), None, validation)
        phases_cold.append(engine.startup_phases(s.name))
        engine.remove(s.name)
        cold.append(s.ttft)
        returned_cold.append(s.run_returned_s)
        validated_cold += int(s.text == expected)
        progress(f"cold {i + 1}/{n}: first token {s.ttft:.3f} s ({via} run returned after {s.run_returned_s:.3f} s)"
                 + ("" if s.text == expected else f"; TEXT DIFFERS: {s.text!r}"))

    progress("staging the capsule before the samples (verify digests, unpack: restore --prepare-only)")
    t = time.monotonic()
    stage(load_capsule(cap.capsule, False))
    staging_s = time.monotonic() - t

    restored, validated_restore, returned_restore, receipts, overhead = [], 0, [], [], None
    for i in range(n):
        s = run_once(engine, name("restored"), cap.capsule, validation)
        rec = _receipt(s.cid)
        if i == 0:  # what the shim read from the container (annotations, or Docker's COLDSNAP_* variables)
            annotations = _coldsnap_settings(s)
        ok = s.text == expected and rec.get("state") == "succeeded" and \
            rec.get("result", {}).get("validated_text") == expected
        if i == n - 1:
            progress(f"pass-through overhead: {OVERHEAD_REPS}x --version and state of running {s.cid[:12]}, "
                     "runc vs coldsnap-runtime")
            overhead = passthrough_overhead(shutil.which("runc") or "runc", str(RUNTIME), s.runc_root, s.cid)
        engine.remove(s.name)
        restored.append(s.ttft)
        returned_restore.append(s.run_returned_s)
        validated_restore += int(ok)
        receipts.append({"state": rec.get("state"),
                         "time_to_first_token_s": rec.get("result", {}).get("time_to_first_token_s"),
                         "spans": {sp["name"]: sp["duration_s"] for sp in rec.get("spans", [])}})
        progress(f"restore {i + 1}/{n}: first token {s.ttft:.3f} s ({via} run returned after {s.run_returned_s:.3f} s; "
                 f"receipt {rec.get('state')}, {receipts[-1]['time_to_first_token_s']} s from the restore's start)"
                 + ("" if ok else f"; NOT VALIDATED: {s.text!r}"))

    v, rr = _stats(cold), _stats(restored)
    prof = cap.profile
    data = {
        "kind": "coldsnap.bench",
        "via": via,
        "command": _command(opts),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host_record(prof),
        "container_engine": {"cli": engine.command(), "version": engine("--version", check=False).stdout.strip(),
                             "runc": _sh(["runc", "--version"]).stdout.splitlines()[0],
                             "runtime": engine.runtime_binary, "image": engine.image,
                             "run_argv_restored": engine.run_argv("NAME", cap.capsule)},
        "page_cache": "warm",
        "engine": "reference", "device": "cpu", "weights_mode": prof.weights_mode,
        "engine_argv": engine.engine_args,
        "compile": {"torch_compile": "--no-compile" not in engine.engine_args, "cache": f"{CACHE}/inductor (a volume), "
                    "policy kernels: warmed by one unmeasured cold start; every measured cold start traces, lowers "
                    "and generates code again, reusing compiled kernel binaries",
                    "first_ever_cold_start_s": round(first.ttft, 4), "first_ever_startup_phases_s": first_phases,
                    "cold_startup_phases_s": phases_cold},
        "samples": n,
        "clock": f"issue of `{via} run -d` -> first non-empty streamed token of a completion (ValidationProbe inside "
                 "the container's network namespace); restored: includes the shim's admit + digest verification + "
                 "runc restore + hydrate and the poststart hook's validation; unpacking staged beforehand",
        "staged_before_samples": True,
        "vanilla": v, "restore": rr, "ratio_median": round(v["median_s"] / rr["median_s"], 2),
        "vanilla_samples": n,
        "validations": {"vanilla": f"{validated_cold}/{n}", "restore": f"{validated_restore}/{n}"},
        "expected_text": expected,
        "run_returned_s": {"vanilla": _stats(returned_cold), "restore": _stats(returned_restore)},
        "restore_settings": annotations,
        "restore_receipts": receipts,
        "passthrough_overhead": overhead,
        "capsule": {"digest": cap.capsule, "bytes": cap.receipt.facts(CaptureFacts).capsule_bytes,
                    "staging_s": round(staging_s, 3),
                    "capture_spans": {s.name: s.duration_s for s in cap.receipt.spans}},
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"reference-{via}-cpu"
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    _chart({**data, "engine": f"reference via {via}"}, stem.with_suffix(".png"))
    o = overhead or {}
    summary = (side_by_side({**data, "engine": f"reference via {via}"}) +
                        f"\ncoldsnap-runtime pass-through vs runc (median of {OVERHEAD_REPS}): --version "
                        f"+{o.get('version', {}).get('overhead_ms')} ms, "
                        f"state +{o.get('state', {}).get('overhead_ms')} ms"
                        f"\nwrote {stem}.json and {stem}.png")
    return BenchResult(data, summary)
