"""`coldsnap bench --via sparkrun [--engine reference|vllm]`: `sparkrun run RECIPE --hosts localhost` cold vs
restored through ColdSnap's sparkrun plugin, N samples each, in one run; and the lab the sparkrun tests share.

The lab: the real sparkrun from PyPI in its own venv with the plugin installed (packaging/sparkrun/setup.sh), a
private dockerd with coldsnap-runtime registered as the runtime "coldsnap" (packaging/containers/setup.sh), a
private sparkrun config (plugin enabled, docker's executor off so that coldsnap's is the one,
`plugins.coldsnap.cpu_slot` for this host without a GPU, no registries, no telemetry), an image made of a root
filesystem that binds the host's /usr, and a recipe per engine. Everything lives under one temporary directory.

Clock: from issuing `sparkrun run … --no-follow` to its return, which is after sparkrun's own readiness: the
port open, /health 200, and the first streamed token of a chat completion (its startup probe). sparkrun's own
reading of that first token (`TTFT …s`, from the container's start) is recorded beside it. The floor, in the same
run: `sparkrun run --dry-run` of the same recipe, sparkrun's own planning and script generation."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path

from coldsnap.base.paths import settings
from coldsnap.base.progress import Progress
from coldsnap.contracts import CaptureRequest, ColdSnapError, ErrorCode
from coldsnap_bench.rootfs import host_usr_rootfs
from coldsnap_bench.run import BenchOptions, BenchResult, _chart, _stats, host_record, side_by_side
from coldsnap_bench.via import PYTHON_HOME, REPO, VENV, Docker, container_bench_ready, private_base

SPARKRUN_SETUP = REPO / "packaging" / "sparkrun" / "setup.sh"
SPARKRUN_VENV = settings().sparkrun_venv
IMAGE = "coldsnap-sparkrun:1"
TTFT = re.compile(r"TTFT ([0-9.]+)s")
SENSITIVE = ("/etc", "/boot", "/proc", "/sys", "/dev", "/root", "/run", "/var/run", "/var/lib/docker")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SparkrunLab:
    """sparkrun with ColdSnap's plugin, on a private dockerd; env: the private ColdSnap paths (COLDSNAP_HOME, …)
    every process started here inherits (dockerd and so coldsnap-runtime, sparkrun and so the plugin)."""

    def __init__(self, base: Path, env: dict[str, str]):
        self.base = base
        self.docker = Docker(base, env)
        self.docker.image = IMAGE
        self.config_dir = base / "sparkrun-config"
        self.home = base / "sparkrun-home"
        self.recipes = base / "recipes"
        self.sparkrun_bin = SPARKRUN_VENV / "bin" / "sparkrun"
        self.aliases: list[Path] = []

    def _volume(self, source: str, dest: str, mode: str) -> str:
        """A recipe volume. sparkrun refuses bind sources under /root, /etc, /run, … (its mount guard); a host path
        there that the engine needs (pyenv's interpreter under /root) is bound from an alias of it here."""
        if any(source == p or source.startswith(p + "/") for p in SENSITIVE):
            alias = self.base / "aliases" / str(len(self.aliases))
            alias.mkdir(parents=True)
            subprocess.run(["mount", "--rbind", source, str(alias)], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(alias)], check=False)
            self.aliases.append(alias)
            source = str(alias)
        return f"{source}:{dest}:{mode}"

    def start(self, progress: Progress = lambda m: None) -> None:
        progress(f"sparkrun and the plugin in {SPARKRUN_VENV} (packaging/sparkrun/setup.sh)")
        r = subprocess.run([str(SPARKRUN_SETUP), str(SPARKRUN_VENV)], capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise ColdSnapError(ErrorCode.ENVIRONMENT, f"packaging/sparkrun/setup.sh: {r.stderr.strip()[-600:]}")
        progress("a private dockerd with the coldsnap runtime")
        self.docker.start()
        rootfs = host_usr_rootfs(self.base / "rootfs")
        with tarfile.open(self.base / "rootfs.tar", "w") as tar:
            tar.add(rootfs, arcname=".")
        self.docker.import_image(self.base / "rootfs.tar")
        for d in (self.config_dir, self.home, self.recipes):
            d.mkdir(parents=True, exist_ok=True)
        (self.config_dir / "registries.yaml").write_text("config_version: 1\nregistries: []\n")
        (self.config_dir / "config.yaml").write_text(json.dumps({  # YAML is a superset of JSON
            "plugins": {"enabled": {"coldsnap": True},
                        "coldsnap": {"docker_exec_root": str(self.docker.dir / "exec"), "cpu_slot": True}},
            "features": {"executor.docker": False},  # coldsnap, a docker executor, becomes the only (default) one
            "telemetry": {"enabled": False}}, indent=1))

    def env(self, mode: str | None = None) -> dict[str, str]:
        env = {**os.environ, "HOME": str(self.home), "SPARKRUN_CONFIG_DIR": str(self.config_dir),
               "SPARKRUN_NO_TELEMETRY": "1", "HF_HUB_OFFLINE": "1",
               "DOCKER_HOST": f"unix://{self.docker.dir}/docker.sock"}
        env.pop("COLDSNAP_SPARKRUN_MODE", None)
        if mode:
            env["COLDSNAP_SPARKRUN_MODE"] = mode
        return env

    def sparkrun(self, *args: str, mode: str | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.sparkrun_bin), *args], capture_output=True, text=True, timeout=timeout,
                              env=self.env(mode), stdin=subprocess.DEVNULL, cwd=self.recipes)

    def recipe(self, name: str, engine: str, port: int, options: dict | None = None) -> Path:
        """A recipe of the reference engine or vLLM (CPU) on this host: the image binds the host's /usr and what the
        engine reads (read-only, at the same paths)."""
        from coldsnap.oci.spec import host_bind

        if engine == "reference":
            models = self.base / "models"
            models.mkdir(exist_ok=True)
            paths = ["/usr", str(REPO), *([str(VENV)] if not str(VENV).startswith(f"{REPO}/") else []),
                     *([str(PYTHON_HOME)] if not str(PYTHON_HOME).startswith("/usr") else [])]
            volumes = [self._volume(m["source"], m["destination"], "ro") for p in paths for m in host_bind(p, p)]
            volumes.append(f"{models}:/models")
            command = (f"{VENV}/bin/python -m coldsnap_reference.server --weights /models/reference.safetensors"
                       " --host 0.0.0.0 --port {port} --device cpu --no-compile"
                       " --layers 2 --hidden 64 --heads 2 --kv-mib 4 --max-seq 256 --threads 1"
                       " --weights-load copy --warmup-tokens 2")
            env, model, served = {"PYTHONDONTWRITEBYTECODE": "1"}, "coldsnap/reference-tiny", "tiny"
        elif engine == "vllm":
            from coldsnap.engines import get_adapter

            launch = get_adapter("vllm").prepare_container(CaptureRequest(operation="capture", engine={
                "name": "vllm", "options": {"enforce_eager": True, **(options or {})}}))
            argv = list(launch.argv)
            for flag, value in (("--port", "{port}"), ("--served-model-name", "{served_model_name}")):
                argv[argv.index(flag) + 1] = value
            command = shlex.join(argv).replace("'{port}'", "{port}").replace("'{served_model_name}'",
                                                                             "{served_model_name}")
            volumes = [self._volume(m["source"], m["destination"], m["options"][-1]) for m in [
                *host_bind("/usr", "/usr"), *[x for b in launch.mounts for x in host_bind(b.source, b.target,
                                                                                        b.readonly)]]]
            env = {k: v for k, v in launch.env.items() if k not in ("HOME", "PATH")}
            model, served = launch.model_id or "vllm", "tiny-llama"
        else:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, "--via sparkrun benchmarks --engine reference or vllm")
        recipe = {
            "model": model, "runtime": "vllm", "container": IMAGE,
            "defaults": {"port": port, "served_model_name": served},
            "env": env,
            "executor_config": {"accelerator_vendor": "cpu", "ulimit": [], "volumes": volumes},
            "distribution_config": {"models": {"enabled": False}},
            "readiness": {"port_timeout_s": 900, "health_timeout_s": 900, "inference_timeout_s": 900},
            "command": command,
        }
        path = self.recipes / f"{name}.yaml"
        path.write_text(json.dumps(recipe, indent=1))
        return path

    def last_launch(self) -> dict:
        """What the plugin decided for the latest launch (its record), with the receipt of a restore."""
        records = []
        for path in (settings().run / "sparkrun").glob("sparkrun_*.json"):
            try:
                records.append(json.loads(path.read_text()))
            except ValueError:
                continue
        if not records:
            return {}
        last = max(records, key=lambda r: r.get("time", 0))
        if last.get("decision") == "restore":
            r = self.docker("inspect", "--format", "{{.Id}}", last["container"], check=False)
            rec = settings().receipts / f"{r.stdout.strip()}.json"
            last["receipt"] = json.loads(rec.read_text()) if r.returncode == 0 and rec.exists() else None
        return last

    def containers(self) -> list[str]:
        r = self.docker("ps", "--filter", "label=sparkrun.distribution=sparkrun", "--format", "{{.Names}}",
                        check=False)
        return r.stdout.split()

    def stop(self) -> None:
        try:
            names = self.containers()
            if names:
                self.docker("rm", "-f", *names, check=False)
            self.docker.remove_all()
        finally:
            self.docker.stop()
            for alias in reversed(self.aliases):
                subprocess.run(["umount", "-l", str(alias)], capture_output=True)


def ttft_of(output: str) -> float | None:
    """sparkrun's own reading of the first token (its startup probe's line), in seconds."""
    m = TTFT.search(output)
    return float(m.group(1)) if m else None


def run_sparkrun_bench(opts: BenchOptions, progress: Progress = lambda m: None) -> BenchResult:
    container_bench_ready(opts, "sparkrun", "docker", progress)
    with private_base("sparkrun", progress) as (base, env):
        lab = SparkrunLab(base, env)
        try:
            lab.start(progress)
            return _bench(opts, lab, progress)
        finally:
            progress(f"cleaning up (sparkrun workloads, dockerd, {base})")
            lab.stop()


def _timed_run(lab: SparkrunLab, recipe: Path, mode: str | None) -> tuple[float, float | None, str]:
    t0 = time.monotonic()
    r = lab.sparkrun("run", recipe.name, "--hosts", "localhost", "--no-follow", mode=mode)
    wall = time.monotonic() - t0
    out = r.stdout + r.stderr
    if r.returncode != 0:
        raise ColdSnapError(ErrorCode.RUNTIME, f"sparkrun run exited {r.returncode}: {out.strip()[-1200:]}")
    return wall, ttft_of(out), out


def _stop(lab: SparkrunLab, recipe: Path) -> None:
    r = lab.sparkrun("stop", recipe.name, "--hosts", "localhost")
    if r.returncode != 0 or lab.containers():
        raise ColdSnapError(ErrorCode.RUNTIME, f"sparkrun stop left {lab.containers()}: {r.stderr[-400:]}")


def _bench(opts: BenchOptions, lab: SparkrunLab, progress: Progress) -> BenchResult:
    n, engine = opts.samples, opts.engine
    recipe = lab.recipe(f"bench-{engine}", engine, free_port(), opts.engine_options)
    progress(f"capture: sparkrun coldsnap capture {recipe.name} --hosts localhost")
    r = lab.sparkrun("coldsnap", "capture", recipe.name, "--hosts", "localhost", "--no-follow", "--json")
    if r.returncode != 0:
        raise ColdSnapError(ErrorCode.RUNTIME, f"sparkrun coldsnap capture: {(r.stdout + r.stderr)[-1200:]}")
    receipt = json.loads(r.stdout.strip().splitlines()[-1])
    capsule = receipt["result"]["capsule"]
    floor = []
    for _ in range(n):
        t0 = time.monotonic()
        d = lab.sparkrun("run", recipe.name, "--hosts", "localhost", "--dry-run")
        floor.append(time.monotonic() - t0)
        if d.returncode != 0:
            raise ColdSnapError(ErrorCode.RUNTIME, f"sparkrun run --dry-run: {(d.stdout + d.stderr)[-600:]}")
    samples: dict[str, list] = {"cold": [], "restore": []}
    for kind, mode in (("cold", "cold"), ("restore", None)):
        for i in range(n):
            wall, ttft, out = _timed_run(lab, recipe, mode)
            launch = lab.last_launch()
            restored = launch.get("decision") == "restore" and (launch.get("receipt") or {}).get(
                "state") == "succeeded"
            if restored != (kind == "restore"):
                raise ColdSnapError(ErrorCode.RUNTIME, f"{kind} sample {i + 1}: the launch was "
                                    f"{'restored' if restored else 'cold'}: {out[-800:]}")
            samples[kind].append((wall, ttft))
            progress(f"{kind} {i + 1}/{n}: `sparkrun run` returned ready after {wall:.2f} s (sparkrun's TTFT "
                     f"{ttft} s from the container's start)")
            _stop(lab, recipe)
    v, rr = _stats([w for w, _ in samples["cold"]]), _stats([w for w, _ in samples["restore"]])
    version = lab.sparkrun("--version").stdout.strip().splitlines()
    data = {
        "kind": "coldsnap.bench", "via": "sparkrun",
        "command": opts.command or f"coldsnap bench --via sparkrun --engine {engine} --samples {n}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": host_record(),
        "sparkrun": version[-1] if version else "", "docker": lab.docker("--version").stdout.strip(),
        "python": sys.version.split()[0],
        "engine": engine, "device": "cpu", "weights_mode": "native", "samples": n, "page_cache": "warm",
        "clock": "issue of `sparkrun run RECIPE --hosts localhost --no-follow` -> its return after sparkrun's own "
                 "readiness (port, /health, first streamed chat token); sparkrun's TTFT (from the container's "
                 "start) recorded beside it",
        "vanilla": v, "restore": rr, "ratio_median": round(v["median_s"] / rr["median_s"], 2),
        "sparkrun_ttft_s": {"vanilla": _stats([t for _, t in samples["cold"] if t is not None]),
                            "restore": _stats([t for _, t in samples["restore"] if t is not None])},
        "floor": {"what": "`sparkrun run --dry-run` of the same recipe", **_stats(floor)},
        "validations": {"vanilla": f"{n}/{n}", "restore": f"{n}/{n}"},
        "capsule": {"digest": capsule, "bytes": receipt["result"].get("capsule_bytes", 0), "staging_s": 0.0,
                    "tag": receipt["result"].get("tag")},
        "recipe": json.loads(recipe.read_text()),
    }
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (opts.name or f"{engine}-sparkrun-cpu")
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    label = {**data, "engine": f"{engine} via sparkrun run"}
    _chart(label, stem.with_suffix(".png"))
    return BenchResult(data, side_by_side(label) + f"\nfloor (sparkrun run --dry-run): median "
                       f"{data['floor']['median_s']:.2f} s\nwrote {stem}.json and {stem}.png")
