"""Adapter for the embedded reference engine (coldsnap_reference.server)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from coldsnap.base.digests import pinned_digests
from coldsnap.base.paths import settings
from coldsnap.contracts import CaptureRequest, Distributed, EngineRelease, Model, Mount, WeightFile
from coldsnap.engines.base import EngineAdapter, PreparedLaunch, option_flags, post_json

MODEL_ID = "coldsnap/reference-tiny"
SIZE_OPTIONS = ("layers", "hidden", "heads", "intermediate", "max_seq", "seed")


def default_weights_path(options: dict | None = None) -> str:
    """One weights file per model shape: the engine writes it, seeded, on first use."""
    shape = {k: v for k, v in (options or {}).items() if k in SIZE_OPTIONS}
    suffix = "" if not shape else "-" + "-".join(f"{k}{v}" for k, v in sorted(shape.items()))
    return str(settings().home / "models" / "reference" / f"model{suffix}.safetensors")


def container_mounts(weights: str) -> list[Mount]:
    """What the launch reads, for a container to bind at the same paths: this interpreter, ColdSnap's package, the
    PYTHONPATH entries, read-only; the weights' directory read-write (the engine writes its seeded file there on
    first use, as a model cache volume)."""
    import coldsnap
    from coldsnap.engines.venv_engine import interpreter_paths, outermost

    python_path = [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).is_dir()]
    readonly = outermost([Path(sys.prefix), *interpreter_paths(sys.executable),
                          Path(coldsnap.__file__).resolve().parents[1], *python_path])
    model_dir = Path(weights).resolve().parent
    model_dir.mkdir(parents=True, exist_ok=True)
    # In this order: a read-write bind of the model directory inside a read-only one lands on top of it.
    return [Mount(source=str(p), target=str(p), readonly=True) for p in readonly] + [
        Mount(source=str(model_dir), target=str(model_dir), readonly=False)]


class ReferenceAdapter(EngineAdapter):
    name = "reference"
    supports_recovery = True
    supports_prefetch = True
    supports_template = True

    def prepare(self, request: CaptureRequest) -> PreparedLaunch:
        from coldsnap import __version__

        mode = self.resolve_weights_mode(request.policy.weights_mode)
        opts = dict(request.engine.options)
        weights = str(opts.pop("weights", None) or (request.model.weights[0].path if request.model and
                                                    request.model.weights else default_weights_path(opts)))
        device = "cuda" if any(d.startswith("cuda") for d in request.launch.devices) else "cpu"
        argv = request.launch.command or [
            sys.executable, "-m", "coldsnap_reference.server",
            "--weights", weights, "--host", "0.0.0.0", "--port", str(request.launch.port),
            "--device", device, "--model-id", MODEL_ID,
            # recovery: weights stay file-backed (mmap), so CRIU images exclude them; native: anonymous copies.
            "--weights-load", "mmap" if mode == "recovery" else "copy",
        ]
        argv += option_flags(opts)
        env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", **request.launch.env}
        if int(opts.get("tensor_parallel", 1)) > 1:
            from coldsnap_reference.tp import CAPTURE_SAFE_ENV

            env = {**CAPTURE_SAFE_ENV, **env}  # in the launch (and so in the profile), not only inside the engine
        if os.environ.get("PYTHONPATH"):  # where this interpreter finds ColdSnap's dependencies (a container
            env.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])  # inherits nothing)
        return PreparedLaunch(argv=argv, env=env, weights_mode=mode, model=request.model, engine_version=__version__,
                              cwd=request.launch.workdir, mounts=container_mounts(weights), pin_ahead=[weights])

    def template_launch(self, request: CaptureRequest) -> PreparedLaunch:
        launch = self.prepare(request.model_copy(update={"policy": request.policy.model_copy(
            update={"weights_mode": "recovery"})}))  # weights file-backed (mmap): reloaded from the pinned file
        launch.argv = [*launch.argv, "--template"]
        return launch

    def describe_model(self, weights_path: str) -> Model:
        """Called once the engine has started (it writes its seeded weights on first use)."""
        pinned = pinned_digests(weights_path)
        return Model(id=MODEL_ID, revision=f"sha256:{pinned.sha256}", weights=[WeightFile(
            path=weights_path, size=os.path.getsize(weights_path), **pinned.fields())])

    def distributed(self, info: dict) -> Distributed | None:
        tp = info.get("tensor_parallel") or {}
        if int(tp.get("size", 1)) <= 1:
            return None
        return Distributed(world_size=tp["size"], backend=tp["backend"], devices=tp["devices"],
                           settings=tp.get("settings") or {})

    def before_capture(self, host: str, port: int, kv_discard: bool, weights_mode: str,
                       save_weights: bool = False, code_dir: str | None = None,
                       lease: str | None = None) -> EngineRelease:
        # recovery: weights and KV go (the engine reloads the weights from the pinned file after restore). native
        # with save_weights: the engine first saves its weights as they are in memory to a file of its own, which
        # travels beside the images as a content-addressed payload, and reloads from it after restore. native
        # otherwise: the weights stay in the dump, only the KV cache goes.
        stash = {"stash_code": code_dir} if code_dir else {}
        if lease:
            stash["lease"] = lease
        if weights_mode == "native" and save_weights:
            return EngineRelease.model_validate(
                post_json(host, port, "/coldsnap/release", {"weights": True, "save": True, **stash}))
        if not kv_discard and weights_mode != "recovery":
            return EngineRelease()
        return EngineRelease.model_validate(
            post_json(host, port, "/coldsnap/release", {"weights": weights_mode == "recovery", **stash}))

    def prefetch_taken(self, resumed: dict) -> bool | None:
        reload = resumed.get("weights_reload")  # the hydrate account of a resume that reloaded weights
        if not isinstance(reload, dict):
            return None
        return reload.get("prefetched") is True and "prefetch_error" not in reload

    def prefetch_error(self, resumed: dict) -> str | None:
        reload = resumed.get("weights_reload")
        return str(reload["prefetch_error"]) if isinstance(reload, dict) and reload.get("prefetch_error") else None

    def after_restore(self, host: str, port: int, kv_discarded: bool, weights_mode: str,
                      prefetched: str | dict[str, str] | None = None) -> dict:
        if prefetched:
            return post_json(host, port, "/coldsnap/resume", {"prefetched": prefetched})
        return post_json(host, port, "/coldsnap/resume") if (kv_discarded or weights_mode == "recovery") else {}
