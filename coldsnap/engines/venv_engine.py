"""What the engines that run from their own venv (vLLM, SGLang) share: building that venv, the local tiny model,
the io_uring-blocking launch prefix and an offline environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorCode, Mount
from coldsnap_reference import tinymodel

REPO = Path(__file__).resolve().parents[2]


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


TINY = "tiny"  # model=tiny: ColdSnap's generated tiny Llama (coldsnap_reference.tinymodel), made on first use


def resolve_model(opts: dict, python: Path) -> tuple[Path, str]:
    """(model dir, served name) from the options: model=DIR, a Hugging Face model directory (config.json), or
    model=tiny for the tiny model made locally (deterministic, at $COLDSNAP_TINY_MODEL). Nothing else: a mistyped
    path is an error, never a generated model served in its place."""
    model_opt = opts.pop("model", None)
    if model_opt is None:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "this engine needs a model: --engine-opt model=DIR (a Hugging "
                            f"Face model directory) or model={TINY} (ColdSnap's generated tiny model)")
    if str(model_opt) == TINY:
        model_dir = settings().tiny_model
        if not tinymodel.is_complete(model_dir):
            tinymodel.ensure(model_dir, str(python))
    else:
        model_dir = Path(str(model_opt))
        if not model_dir.is_absolute():
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"model directory must be absolute: {model_dir}")
        if not model_dir.is_dir():
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"model directory {model_dir} does not exist "
                                f"(model={TINY} for ColdSnap's generated tiny model)")
        if not (model_dir / "config.json").exists():
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"model directory {model_dir} has no config.json")
    served = str(opts.pop("served_model_name", None) or
                 (tinymodel.MODEL_ID if tinymodel.is_complete(model_dir) else model_dir.name))
    return model_dir, served


def context_length(model_dir: Path) -> int | None:
    """The longest sequence the model was made for, from its config.json (None when it does not say)."""
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        value = config.get(key) if isinstance(config, dict) else None
        if type(value) is int and value > 0:
            return value
    return None


def seccomp_prefix() -> list[str]:
    """ColdSnap's interpreter installs the io_uring filter, then execs the engine's: nothing of ColdSnap stays in
    the engine's process or its environment."""
    return [sys.executable, "-m", "coldsnap.engines.seccomp", "--"]


# Prefixes an interpreter shares with the rest of the system: bind only what the interpreter needs from them.
SHARED_PREFIXES = ("/", "/usr", "/usr/local")


def interpreter_paths(python: Path | str) -> list[Path]:
    """What a (venv's) interpreter runs from: its real executable's prefix when the prefix is its own (pyenv,
    /opt/python), else the executable and its standard library (a system python under /usr)."""
    real = Path(os.path.realpath(python))
    prefix = real.parent.parent
    if str(prefix) not in SHARED_PREFIXES:
        return [prefix]
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = sorted(prefix.glob("lib/python3.*"))
    named = [p for p in stdlib if real.name.startswith(p.name)] or [p for p in stdlib if p.name == ver]
    return [real, *named]


def outermost(paths: list[Path]) -> list[Path]:
    """Unique paths, dropping any that lies inside another (one bind covers it)."""
    unique = sorted({Path(os.path.normpath(p)) for p in paths}, key=lambda p: len(p.parts))
    out: list[Path] = []
    for p in unique:
        if not any(p == q or q in p.parents for q in out):
            out.append(p)
    return out


def host_mounts(python: Path, model_dir: Path) -> list[Mount]:
    """Host paths a venv engine's launch reads, for a container to bind read-only at the same paths: ColdSnap's
    interpreter and package (the io_uring prefix runs them before exec), the engine's venv and the interpreter it
    points at, and the model. Nothing is written there (the engine writes to /tmp, $HOME and /dev/shm)."""
    import coldsnap

    venv = python.parent.parent
    paths = [Path(sys.prefix), *interpreter_paths(sys.executable), Path(coldsnap.__file__).resolve().parents[1],
             venv, *interpreter_paths(python), model_dir]
    return [Mount(source=str(p), target=str(p), readonly=True) for p in outermost(paths)]


def base_env() -> dict[str, str]:
    return {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
        "DO_NOT_TRACK": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def cpu_engine_setup(engine: str, request, configured: str | None, default_venv: str) -> tuple[dict, Path, Path, str]:
    """What every venv engine's prepare() starts with: CPU only, its venv (built on first use), its model.
    Returns (remaining options, venv python, model dir, served model name)."""
    if any(d.startswith("cuda") for d in request.launch.devices):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"the {engine} adapter drives the engine's CPU build only "
                            "(launch.devices must be empty)")
    opts = dict(request.engine.options)
    venv = ensure_venv(engine, Path(str(opts.pop("venv", None) or configured or default_venv)), default_venv)
    python = venv / "bin" / "python"
    model_dir, served = resolve_model(opts, python)
    return opts, python, model_dir, served


def model_pinned_later(model_dir: Path, served: str, given=None) -> dict:
    """The PreparedLaunch fields that pin a model directory under the cold start rather than before it: its files
    are hashed on a thread while the engine starts, and the model is described from what that remembered. A model
    the request gives is not hashed at all."""
    if given is not None:
        return {"model_id": served}
    files = [str(p) for p in sorted(model_dir.resolve().iterdir()) if p.is_file() and not p.name.startswith(".")]
    return {"model_id": served, "pin_ahead": files,
            "describe_model": lambda: describe_model_dir(model_dir, served)}


def describe_model_dir(directory: str | os.PathLike, model_id: str):
    """The model contract of a Hugging Face style directory: every *.safetensors file with its sha256, and a
    revision that is the digest of every file the engine reads (weights, config, tokenizer)."""
    import hashlib

    from coldsnap.base.digests import pinned_digests
    from coldsnap.contracts import Model, WeightFile

    d = Path(directory).resolve()
    files = sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith("."))
    weights, h = [], hashlib.sha256()
    for p in files:
        pinned = pinned_digests(str(p))
        h.update(f"{p.name}\0{pinned.sha256}\n".encode())
        if p.suffix == ".safetensors":
            weights.append(WeightFile(path=str(p), size=p.stat().st_size, **pinned.fields()))
    return Model(id=model_id, revision=f"sha256:{h.hexdigest()}", weights=weights)
