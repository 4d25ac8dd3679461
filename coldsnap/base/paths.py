"""ColdSnap's settings: every COLDSNAP_* environment variable is read here and nowhere else (docs/settings.md lists
them; tests/test_settings.py holds the code and the docs to the same list). Stdlib only: the shim's pass-through
path reads its run directory here too."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # as documented ("" : unset)
    effect: str


# name, default, effect: the table docs/settings.md shows (tests/test_settings.py checks they agree)
VARIABLES = (
    Variable("COLDSNAP_HOME", "/var/lib/coldsnap", "where ColdSnap keeps its state; the other paths default under it"),
    Variable("COLDSNAP_STORE", "$COLDSNAP_HOME/store", "the local capsule store (an OCI image layout)"),
    Variable("COLDSNAP_RUN", "/run/coldsnap", "workloads' run directories and state, operation journals, shim records"),
    Variable("COLDSNAP_RECEIPTS", "$COLDSNAP_HOME/receipts", "where receipts are written"),
    Variable("COLDSNAP_STAGED", "$COLDSNAP_HOME/staged", "capsules unpacked for restore, one directory per digest"),
    Variable("COLDSNAP_STAGED_MAX_GIB", "a quarter of its file system", "the staging area's cap (least recently used "
             "capsules go first)"),
    Variable("COLDSNAP_CRIU_PREFIX", "$COLDSNAP_HOME/criu", "the provisioned CRIU (bin/criu, pycriu)"),
    Variable("COLDSNAP_CRIU", "", "a CRIU binary to use instead of the prefix's"),
    Variable("COLDSNAP_RUNC", "", "the runc coldsnap-runtime wraps (else /etc/coldsnap/runtime.json, else PATH)"),
    Variable("COLDSNAP_SIGNING_KEY", "", "a PEM private key to sign capsules with (else the host's own key)"),
    Variable("COLDSNAP_POLICY_FILE", "/etc/coldsnap/policy.json", "the restore policy (who may restore what)"),
    Variable("COLDSNAP_REGISTRY_USER", "", "registry user name when ~/.docker/config.json has none"),
    Variable("COLDSNAP_REGISTRY_PASSWORD", "", "registry password or token (never logged)"),
    Variable("COLDSNAP_INSECURE_REGISTRIES", "", "comma-separated HOST[:PORT]s pulled from over plain HTTP"),
    Variable("COLDSNAP_PULL_PIECES", "1", "0: pull each blob in one stream instead of parallel pinned pieces"),
    Variable("COLDSNAP_PULL_SPOOL", "auto", "a restore's streamed weights land in memory first (1), straight in the "
             "store's file (0), or in memory when the node has twice their size free (auto)"),
    Variable("COLDSNAP_PULL_WEIGHTS_AHEAD", "auto", "1: a restore's pull starts the weights once the profile that "
             "pins them is in, beside the CRIU images; 0: after the capsule's own blobs; auto: beside them where "
             "the images come by fetching processes of their own (COLDSNAP_PULL_IMAGE_FETCHERS) or the weights go "
             "direct (COLDSNAP_PULL_DIRECT)"),
    Variable("COLDSNAP_PULL_DIRECT", "auto", "1: a restore's GPU prefetcher fetches the streamed weights' pieces "
             "from the registry itself, each checked against its pin, and the pull fetches them for the node's store "
             "after the first token (a second transfer); 0: the pull fetches them, the prefetcher takes them from it; "
             "auto: 1 for a process restore on a node with an NVIDIA driver whose weights are one file for one GPU"),
    Variable("COLDSNAP_PULL_SYNC_LATER", "0", "1: a restore's pull fsyncs the capsule's own blobs (its CRIU "
             "images) past the restore's first token, before it lists the capsule; 0: as each one comes"),
    Variable("COLDSNAP_PULL_CONNECTIONS", "", "connections a pull by pieces uses at once (1-64); default one per "
             "core, 2 to 16"),
    Variable("COLDSNAP_PULL_IMAGE_FETCHERS", "", "a streamed restore fetches this many of its CRIU images' layers "
             "(0-4) in processes of their own; default 0: all on its own threads"),
    Variable("COLDSNAP_PIN_PIECE_MIB", "256", "the pieces (MiB, at least 1) a weights file is pinned by at capture; "
             "a file of more than one piece pulls by pieces and streams into a restore"),
    Variable("COLDSNAP_PIN_PIECE_HASH", "blake3", "the hash a capture pins those pieces by: blake3 (about 4x less "
             "CPU a byte, on every core a pull and a restore check them on) or sha256"),
    Variable("COLDSNAP_IMAGES_LAYER_MIB", "64", "the CRIU images (MiB, at least 1) a capture packs per layer, in up "
             "to 4 layers that a pull fetches and unpacks side by side"),
    Variable("COLDSNAP_WRITEBACK_MIB", "32", "write-back window of large files; 0 leaves it to the kernel"),
    Variable("COLDSNAP_LAYER_MAX_MIB", "1024", "the largest container file-system layer a capture packs"),
    Variable("COLDSNAP_LAZY_PAGES", "0", "1: CRIU restores memory pages lazily (userfaultfd)"),
    Variable("COLDSNAP_CODE_STASH", "1", "0: CUDA device code stays in the engine's memory at capture"),
    Variable("COLDSNAP_PREFETCH", "1", "0: no GPU weight prefetch during a restore"),
    Variable("COLDSNAP_PREFETCH_THREADS", "8", "readers per weight prefetcher"),
    Variable("COLDSNAP_PREFETCH_MODE", "auto", "how prefetched weights reach the GPU: buffered, mapped, or auto "
             "(mapped for weights in several files, each its own prefetcher; buffered for one file)"),
    Variable("COLDSNAP_PREFETCH_LINGER", "1", "0: a weights file's prefetcher exits once its copy is taken, "
             "instead of after the first token"),
    Variable("COLDSNAP_LIBCUDA", "", "the libcuda.so.1 to load first"),
    Variable("COLDSNAP_TINY_MODEL", "/var/lib/coldsnap/fixtures/tiny-llama", "where model=tiny is made and read"),
    Variable("COLDSNAP_VLLM_VENV", "/var/lib/coldsnap/venvs/vllm", "the vLLM CPU build's venv"),
    Variable("COLDSNAP_SGLANG_VENV", "/var/lib/coldsnap/venvs/sglang", "the SGLang CPU build's venv"),
    Variable("COLDSNAP_VLLM_CUDA_SITE", "/tmp/vllm-site", "where vLLM's CUDA build is installed (GPU machine)"),
    Variable("COLDSNAP_VLLM_RELOAD", "direct", "how a vLLM recovery restore reloads weights: layerwise (vLLM's "
             "reload) or direct (the model's own loaders into its parameters; unquantized models)"),
    Variable("COLDSNAP_RESULTS", "the checkout's bench/results", "result files `coldsnap capabilities` cites"),
    Variable("COLDSNAP_DEBUG", "", "1: an internal error prints its traceback"),
    Variable("COLDSNAP_CLI", "the coldsnap beside the interpreter", "the coldsnap command sparkrun's plugin runs"),
    Variable("COLDSNAP_DOCKER_EXEC_ROOT", "/run/docker", "dockerd's exec root, for sparkrun's plugin"),
    Variable("COLDSNAP_SPARKRUN_MODE", "", "set by `sparkrun coldsnap capture/restore` for the plugin's executor"),
    Variable("COLDSNAP_SPARKRUN_RECORD", "", "where the plugin's executor records what it started (capture)"),
    Variable("COLDSNAP_SPARKRUN_VENV", "/var/lib/coldsnap/venvs/sparkrun", "sparkrun's venv (the sparkrun bench)"),
)


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def _flag(name: str, default: bool) -> bool:
    """'0' is off, any other value on; unset is the default."""
    return value != "0" if (value := os.environ.get(name)) else default


@dataclass(frozen=True)
class Settings:
    home: Path
    store: Path  # local capsule store (OCI image layout)
    run: Path  # per-workload run directories (logs, pidfiles, state)
    receipts: Path
    staged: Path  # capsules unpacked for restore, one directory per capsule digest (coldsnap.flows.staging)
    criu_prefix: Path
    criu_binary: str | None = None  # explicit CRIU entry point; wins over the prefix
    staged_max_gib: str | None = None
    runc: str | None = None
    signing_key: str | None = None
    policy_file: Path = Path("/etc/coldsnap/policy.json")
    registry_user: str | None = None
    registry_password: str | None = field(default=None, repr=False)
    insecure_registries: frozenset[str] = frozenset()
    pull_pieces: bool = True
    pull_spool: str = "auto"
    pull_weights_ahead: str = "auto"
    pull_connections: str = ""
    pull_image_fetchers: str = ""
    pull_direct: str = "auto"
    pull_sync_later: bool = False
    pin_piece_mib: str = "256"
    pin_piece_hash: str = "blake3"
    images_layer_mib: str = "64"
    writeback_mib: str = ""
    layer_max_mib: str = "1024"
    lazy_pages: bool = False
    code_stash: bool = True
    prefetch: bool = True
    prefetch_threads: str = "8"
    prefetch_mode: str = "auto"
    prefetch_linger: bool = True
    libcuda: str | None = None
    tiny_model: Path = Path("/var/lib/coldsnap/fixtures/tiny-llama")
    vllm_venv: str | None = None
    sglang_venv: str | None = None
    vllm_cuda_site: Path = Path("/tmp/vllm-site")
    vllm_reload: str = "direct"
    results: str | None = None
    debug: bool = False
    cli: str | None = None
    docker_exec_root: str | None = None
    sparkrun_mode: str = ""
    sparkrun_record: str | None = None
    sparkrun_venv: Path = Path("/var/lib/coldsnap/venvs/sparkrun")

    @property
    def code(self) -> Path:
        """CUDA device code moved out of engines' memory at capture (coldsnap.gpu.codestash), one file per content."""
        return self.home / "code"

    @property
    def criu(self) -> str:
        return self.criu_binary or str(self.criu_prefix / "bin" / "criu")

    @property
    def pycriu_path(self) -> Path:
        return self.criu_prefix / "pycriu"


def settings() -> Settings:
    """The settings as the environment gives them now (read whole, each call: cheap, and a test or a bench that
    moves COLDSNAP_HOME between calls sees the move)."""
    home = Path(os.environ.get("COLDSNAP_HOME", "/var/lib/coldsnap"))
    return Settings(
        home=home,
        store=Path(os.environ.get("COLDSNAP_STORE", home / "store")),
        run=Path(os.environ.get("COLDSNAP_RUN", "/run/coldsnap")),
        receipts=Path(os.environ.get("COLDSNAP_RECEIPTS", home / "receipts")),
        staged=Path(os.environ.get("COLDSNAP_STAGED", home / "staged")),
        criu_prefix=Path(os.environ.get("COLDSNAP_CRIU_PREFIX", home / "criu")),
        criu_binary=_env("COLDSNAP_CRIU"),
        staged_max_gib=_env("COLDSNAP_STAGED_MAX_GIB"),
        runc=_env("COLDSNAP_RUNC"),
        signing_key=_env("COLDSNAP_SIGNING_KEY"),
        policy_file=Path(_env("COLDSNAP_POLICY_FILE") or "/etc/coldsnap/policy.json"),
        registry_user=_env("COLDSNAP_REGISTRY_USER"),
        registry_password=_env("COLDSNAP_REGISTRY_PASSWORD"),
        insecure_registries=frozenset(h.strip() for h in os.environ.get("COLDSNAP_INSECURE_REGISTRIES", "").split(",")
                                      if h.strip()),
        pull_pieces=_flag("COLDSNAP_PULL_PIECES", True),
        pull_spool=os.environ.get("COLDSNAP_PULL_SPOOL", "auto"),
        pull_weights_ahead=os.environ.get("COLDSNAP_PULL_WEIGHTS_AHEAD", "auto"),
        pull_connections=os.environ.get("COLDSNAP_PULL_CONNECTIONS", ""),
        pull_image_fetchers=os.environ.get("COLDSNAP_PULL_IMAGE_FETCHERS", ""),
        pull_direct=os.environ.get("COLDSNAP_PULL_DIRECT", "auto"),
        pull_sync_later=_flag("COLDSNAP_PULL_SYNC_LATER", False),
        pin_piece_mib=os.environ.get("COLDSNAP_PIN_PIECE_MIB", "256"),
        pin_piece_hash=os.environ.get("COLDSNAP_PIN_PIECE_HASH", "blake3"),
        images_layer_mib=os.environ.get("COLDSNAP_IMAGES_LAYER_MIB", "64"),
        writeback_mib=os.environ.get("COLDSNAP_WRITEBACK_MIB", ""),
        layer_max_mib=os.environ.get("COLDSNAP_LAYER_MAX_MIB", "1024"),
        lazy_pages=os.environ.get("COLDSNAP_LAZY_PAGES", "0") == "1",
        code_stash=_flag("COLDSNAP_CODE_STASH", True),
        prefetch=_flag("COLDSNAP_PREFETCH", True),
        prefetch_threads=os.environ.get("COLDSNAP_PREFETCH_THREADS", "8"),
        prefetch_mode=os.environ.get("COLDSNAP_PREFETCH_MODE", "auto"),
        prefetch_linger=_flag("COLDSNAP_PREFETCH_LINGER", True),
        libcuda=_env("COLDSNAP_LIBCUDA"),
        tiny_model=Path(os.environ.get("COLDSNAP_TINY_MODEL", "/var/lib/coldsnap/fixtures/tiny-llama")),
        vllm_venv=_env("COLDSNAP_VLLM_VENV"),
        sglang_venv=_env("COLDSNAP_SGLANG_VENV"),
        vllm_cuda_site=Path(_env("COLDSNAP_VLLM_CUDA_SITE") or "/tmp/vllm-site"),
        vllm_reload=_env("COLDSNAP_VLLM_RELOAD") or "direct",
        results=_env("COLDSNAP_RESULTS"),
        debug=bool(os.environ.get("COLDSNAP_DEBUG")),
        cli=_env("COLDSNAP_CLI"),
        docker_exec_root=_env("COLDSNAP_DOCKER_EXEC_ROOT"),
        sparkrun_mode=os.environ.get("COLDSNAP_SPARKRUN_MODE", ""),
        sparkrun_record=_env("COLDSNAP_SPARKRUN_RECORD"),
        sparkrun_venv=Path(os.environ.get("COLDSNAP_SPARKRUN_VENV", "/var/lib/coldsnap/venvs/sparkrun")),
    )
