"""The engine adapter contract. Engine-specific knowledge (how to launch, what makes it safe to capture,
how to release and resume memory) lives only in adapters; flows speak to this interface."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from coldsnap.contracts import CaptureRequest, ColdSnapError, Distributed, EngineRelease, ErrorCode, Model, Mount

# What a container's process starts with besides the launch's own variables (process mode adds the same two in
# coldsnap.workload.process.workload_env; a container gets nothing from its engine unless the spec names it).
CONTAINER_BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}


@dataclass
class PreparedLaunch:
    argv: list[str]
    env: dict[str, str]
    weights_mode: str  # native | recovery (auto resolved)
    model: Model | None
    cwd: str | None = None
    engine_version: str | None = None
    notes: list[str] = field(default_factory=list)
    # Host paths the launch reads (interpreters, venv, model): a container binds them read-only at the same paths.
    mounts: list[Mount] = field(default_factory=list)
    # Weight files a capture may pin (hash) while the engine starts, where they exist before it does.
    pin_ahead: list[str] = field(default_factory=list)
    # Where prepare leaves `model` None so that pinning overlaps the cold start: the name it serves the model under,
    # and how a capture describes (pins) it once the engine is up, after pin_ahead has done the hashing.
    model_id: str | None = None
    describe_model: Callable[[], Model] | None = None


class EngineAdapter:
    name = "base"
    supports_recovery = False
    supports_prefetch = False  # after_restore(prefetched=…): takes weights a coldsnap.gpu.prefetch loaded
    prefetch_by_file = False  # …one prefetcher per weights file ({file: socket}), on one GPU
    # template_launch: a start that stops before the device (the criu-template snapshot driver)
    supports_template = False

    def prepare(self, request: CaptureRequest) -> PreparedLaunch:
        raise NotImplementedError

    def template_launch(self, request: CaptureRequest) -> PreparedLaunch:
        """The launch as a pre-device template: imports, configuration, tokenizer, model construction and the
        weights file opened, the device untouched; it reports the template ready (GET /coldsnap/info: template
        true) and does the device work when after_restore resumes it. Its weights are always reloaded from the
        pinned file (weights mode recovery)."""
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"engine {self.name} does not support the criu-template "
                            "snapshot driver yet: it has no start that stops before the device (the reference "
                            "engine does); use --snapshot-driver full")

    def prepare_container(self, request: CaptureRequest) -> PreparedLaunch:
        """The same launch (one implementation with process mode) as the process of a container: every path in
        argv is a host path that .mounts lists (bind each read-only at its own path and argv runs unchanged), and
        .env is complete, since a container inherits nothing. Raises INVALID_REQUEST for an engine whose launch
        does not say what it reads."""
        launch = self.prepare(request)
        if not launch.mounts and not request.launch.command:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"engine {self.name} has no container launch (it does "
                                "not list the host paths it reads); give launch.command and mounts yourself")
        launch.env = {**CONTAINER_BASE_ENV, **launch.env}
        launch.mounts = [*launch.mounts, *request.launch.mounts]
        return launch

    def resolve_weights_mode(self, requested: str) -> str:
        if requested == "auto":
            return "recovery" if self.supports_recovery else "native"
        if requested == "recovery" and not self.supports_recovery:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"engine {self.name} cannot release its weights: "
                                "use weights_mode native")
        return requested

    def describe_model(self, weights_path: str) -> Model | None:
        """The model (its weight files, pinned) that the engine serves from weights_path; None: it cannot say."""
        return None

    def saved_model(self, released: EngineRelease) -> Model | None:
        """The model as the engine saved its in-memory weights at release (native mode, engines that can): that
        file, not the one it loaded, is what a restore reloads."""
        return self.describe_model(released.saved_weights) if released.saved_weights else None

    def distributed(self, info: dict) -> Distributed | None:
        """The ranks of a multi-process (tensor-parallel) workload, from what the running engine reports."""
        return None

    # Hooks around capture and restore; default: nothing to release.
    def before_capture(self, host: str, port: int, kv_discard: bool, weights_mode: str,
                       save_weights: bool = False, code_dir: str | None = None,
                       lease: str | None = None) -> EngineRelease:
        """Release what the capture should not carry. save_weights (native mode, process capture): an engine that
        can writes its in-memory weights to a file of its own, drops them, and names the file in the answer's
        saved_weights; one that cannot ignores it (its weights stay in the dump). code_dir (process capture): an
        engine that can moves the CUDA device code it holds in anonymous memory into files there
        (coldsnap.gpu.codestash); one that cannot ignores it. lease (process capture): the capturer's lease file
        (coldsnap.engines.lease); an engine that releases anything resumes itself once the lease is let go."""
        return EngineRelease()

    def after_restore(self, host: str, port: int, kv_discarded: bool, weights_mode: str,
                      prefetched: str | dict[str, str] | None = None) -> dict:
        """Bring back what before_capture released. prefetched (engines with supports_prefetch): the socket of a
        coldsnap.gpu.prefetch that loaded the weights onto the GPU during the restore, or {GPU UUID: socket}, or
        (prefetch_by_file) {weights file: socket}."""
        return {}

    def prefetch_taken(self, resumed: dict) -> bool | None:
        """Whether the engine's resume (after_restore's answer) took its weights from the prefetchers (False: it
        read its files instead); None when the answer does not say. A restore whose weights are still arriving
        resumes the engine before its files hold them, once the prefetchers have them all: an engine that read
        the files then read holes, and is not let serve."""
        return None

    def prefetch_error(self, resumed: dict) -> str | None:
        """Why the engine's resume did not take its weights from the prefetchers, as its answer says (None: it
        says nothing of it)."""
        return None

    def after_capture_left_running(self, host: str, port: int, kv_discarded: bool, weights_mode: str) -> dict:
        return self.after_restore(host, port, kv_discarded, weights_mode)

    def startup_timings(self, log: str) -> dict[str, float]:
        """Where a cold start's time went, as the engine's own log says (seconds by phase); {} when it says
        nothing. For benches: what a restore skips."""
        return {}


def option_flags(opts: dict) -> list[str]:
    """Engine options as command-line flags: key_name → --key-name VALUE; True → --key-name; False → --no-key-name."""
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


def engine_info(host: str, port: int) -> dict:
    """What a running engine says of itself (GET /coldsnap/info: version, weights, tensor parallel ranks); {} when
    it has no such endpoint or does not answer."""
    try:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/coldsnap/info", headers={"Connection": "close"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return json.loads(data) if resp.status == 200 else {}
    except (OSError, ValueError):
        return {}


def post_json(host: str, port: int, path: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body or {}),
                     headers={"Content-Type": "application/json", "Connection": "close"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise ColdSnapError(ErrorCode.WORKLOAD_FAILED, f"POST {path} answered HTTP {resp.status}: {data[:200]!r}")
        return json.loads(data or b"{}")
    except OSError as e:
        raise ColdSnapError(ErrorCode.WORKLOAD_FAILED, f"POST {path} failed: {e}") from None
    finally:
        conn.close()
