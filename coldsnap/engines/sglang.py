"""Adapter for SGLang's OpenAI-compatible server on CPU (PyPI sglang 0.5.23 with SGLANG_USE_CPU_ENGINE=1, set up by
packaging/engines/sglang-setup.sh with ColdSnap's pure-PyTorch sgl_kernel stand-in).

The engine runs from its own venv (default /var/lib/coldsnap/venvs/sglang). What makes the tree checkpointable
(measured, knowledge base "A real engine on CPU: SGLang"):
  - io_uring blocked by a seccomp filter installed before exec (uvloop), as for vLLM;
  - --sleep-on-idle: without it the idle scheduler busy-polls a core;
  - own PID namespace, --tcp-established (the scheduler's TCPStore connection to itself), --link-remap (a POSIX
    semaphore mapped under a deleted name): provided by the generic process-mode flow;
  - /dev/shm/sglang_loads_*.shm and the semaphore's link_remap.N are state outside the CRIU images in process
    mode: coldsnap.workload.hostfiles carries them in the capsule (in a container, its own /dev/shm tmpfs is in
    the images);
  - as PID 1 of its namespace the leader hangs on SIGTERM: stop it with SIGKILL (kill_tree does).

Weights mode is native only. SGLang's /release_memory_occupation and /resume_memory_occupation are implemented with
torch_memory_saver, which needs CUDA VMM (or Intel XPU); on CPU the adapter there is a no-op that logs "will not save
memory", so releasing before the dump would shrink nothing, and the weights travel in the CRIU images.

Engine options (request.engine.options):
  venv                engine venv (default /var/lib/coldsnap/venvs/sglang, or $COLDSNAP_SGLANG_VENV); the default
                      one is built on first use by packaging/engines/sglang-setup.sh
  model               model directory (default /var/lib/coldsnap/fixtures/tiny-llama, made locally on first use)
  served_model_name   default coldsnap/tiny-llama for the tiny model, else the directory name
  dtype               auto (default: the checkpoint's, float32 for the tiny model) | float32 | bfloat16
  max_total_tokens    default 4096 (the KV pool: an explicit size, not a fraction of what /proc reports)
  mem_fraction_static default 0.05
  attention_backend   default torch_native
  seed                --random-seed, default 0
  any other key       passed as --key-with-dashes VALUE (true: bare flag, false: --no-flag)
"""

from __future__ import annotations

from coldsnap.base.paths import settings
from coldsnap.contracts import CaptureRequest
from coldsnap.engines.base import EngineAdapter, PreparedLaunch, option_flags
from coldsnap.engines.venv_engine import (
    base_env,
    cpu_engine_setup,
    dist_version,
    host_mounts,
    model_pinned_later,
    seccomp_prefix,
)

DEFAULT_VENV = "/var/lib/coldsnap/venvs/sglang"


class SglangAdapter(EngineAdapter):
    name = "sglang"
    supports_recovery = False  # see the module docstring: no memory release on CPU

    def prepare(self, request: CaptureRequest) -> PreparedLaunch:
        mode = self.resolve_weights_mode(request.policy.weights_mode)
        opts, python, model_dir, served = cpu_engine_setup("sglang", request, settings().sglang_venv, DEFAULT_VENV)
        argv = request.launch.command or [
            *seccomp_prefix(),
            str(python), "-m", "sglang.launch_server",
            "--model-path", str(model_dir), "--served-model-name", served,
            "--host", "0.0.0.0", "--port", str(request.launch.port),
            "--device", "cpu", "--disable-cuda-graph", "--sleep-on-idle",
            "--attention-backend", str(opts.pop("attention_backend", "torch_native")),
            "--max-total-tokens", str(int(opts.pop("max_total_tokens", 4096))),
            "--mem-fraction-static", str(float(opts.pop("mem_fraction_static", 0.05))),
            "--dtype", str(opts.pop("dtype", "auto")),
            "--random-seed", str(int(opts.pop("seed", 0))),
            *option_flags(opts),
        ]
        env = {**base_env(), "SGLANG_USE_CPU_ENGINE": "1", **request.launch.env}
        return PreparedLaunch(argv=argv, env=env, weights_mode=mode, model=request.model, cwd=request.launch.workdir,
                              mounts=host_mounts(python, model_dir),
                              **model_pinned_later(model_dir, served, request.model),
                              engine_version=dist_version(python.parent.parent, "sglang"))
