"""Operation requests: what a caller asks ColdSnap to do. One model per operation, tagged by `operation`."""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union, get_args

from pydantic import Field, TypeAdapter, field_validator, model_validator

from coldsnap.contracts.base import FORMAT_VERSION, Strict

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
EngineName = Literal["reference", "vllm", "sglang"]  # the engines with an adapter (coldsnap.engines.ADAPTERS)
ENGINE_NAMES: tuple[str, ...] = get_args(EngineName)


class WeightFile(Strict):
    path: str = Field(description="Absolute path of a safetensors file the engine loads.")
    sha256: str = Field(description="Content digest (hex) the file must have; checked before any restore.")
    size: int | None = Field(default=None, ge=0)
    chunk_bytes: int | None = Field(default=None, gt=0, description="The piece size of `chunks`.")
    chunks: list[str] = Field(default_factory=list, description="The digest (hex, by chunk_digest) of each "
                              "chunk_bytes piece, in order: a restore checks these in parallel instead of the "
                              "whole-file stream, and a pull checks each piece as it arrives")
    chunk_digest: Literal["sha256", "blake3"] = Field(default="sha256", description="The hash of `chunks`: sha256, "
                                                      "or blake3 (what a capture pins them by: less CPU a byte)")

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not SHA256_RE.match(v):
            raise ValueError("must be 64 lowercase hex digits")
        return v

    @field_validator("chunks")
    @classmethod
    def _hex_chunks(cls, v: list[str]) -> list[str]:
        if not all(SHA256_RE.match(c) for c in v):
            raise ValueError("each chunk digest must be 64 lowercase hex digits")
        return v

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must be an absolute path")
        return v


class Model(Strict):
    id: str = Field(min_length=1, description="Model name, e.g. coldsnap/reference-tiny.")
    revision: str = Field(min_length=1,
                          description="Immutable revision (a commit hash or content digest, not a branch).")
    weights: list[WeightFile] = Field(default_factory=list)


class Engine(Strict):
    name: EngineName = "reference"
    version: str | None = None
    options: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Engine-specific launch options (the adapter documents them)."
    )


class Mount(Strict):
    source: str
    target: str
    readonly: bool = True


class Launch(Strict):
    command: list[str] | None = Field(default=None, description="argv; omitted = the engine adapter builds it.")
    image_digest: str | None = Field(default=None, description="Container image pinned by digest (sha256:…).")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment. Values are never logged.")
    mounts: list[Mount] = Field(default_factory=list)
    devices: list[str] = Field(default_factory=list, description="e.g. ['cuda:0']; empty = CPU.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port the engine serves on inside its namespace.")
    workdir: str | None = None

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not ENV_NAME_RE.match(name):
                raise ValueError(f"invalid environment variable name {name!r}")
        return v

    @field_validator("image_digest")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^sha256:[0-9a-f]{64}$", v):
            raise ValueError("must be sha256:<64 hex digits>")
        return v


class Policy(Strict):
    weights_mode: Literal["native", "recovery", "auto"] = "auto"
    kv_discard: bool = Field(default=True, description="Drop the KV cache before capture (the engine re-allocates it).")
    compatibility: Literal["strict", "relaxed"] = Field(
        default="strict", description="strict: every profile field must match; relaxed: only what breaks restore."
    )
    fallback_to_cold: bool = Field(default=True, description="On refusal or failed restore, start the workload cold.")
    allow_unpinned: bool = Field(default=False, description="Accept a capsule reference that is not pinned by digest.")
    quiesce: Literal["drain", "none"] = Field(
        default="drain", description="Container capture only. drain: release memory and capture once no client "
        "connection is open (waits up to 30 s). none: capture with requests in flight: their connections are "
        "checkpointed with the server and the network namespace stays locked (CRIU's network lock) from the dump "
        "to the restore, so a client sees a pause, not an error; nothing is released (in-flight requests hold the "
        "KV cache). Process-mode capture starts its own workload, which has no clients: drain only.")


class Validation(Strict):
    health_path: str = "/health"
    prompt: str = "ColdSnap says"
    max_tokens: int = Field(default=16, ge=1, le=4096)
    expected_text: str | None = Field(default=None, description="When set, the completion must equal it exactly.")
    ready_timeout_s: float = Field(default=600.0, gt=0)
    request_timeout_s: float = Field(default=120.0, gt=0)


class Lifecycle(Strict):
    leave_running: bool = Field(default=False, description="Keep the captured workload running after capture.")
    name: str | None = Field(default=None, pattern=r"^[a-z0-9][a-z0-9-]{0,40}$", description="Workload name.")


class _Request(Strict):
    format: Literal[1] = FORMAT_VERSION
    id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class CaptureRequest(_Request):
    operation: Literal["capture"]
    engine: Engine = Field(default_factory=Engine)
    model: Model | None = None
    launch: Launch = Field(default_factory=Launch)
    policy: Policy = Field(default_factory=Policy)
    validation: Validation = Field(default_factory=Validation)
    lifecycle: Lifecycle = Field(default_factory=Lifecycle)
    tag: str | None = Field(default=None, description="Local store tag for the capsule.")
    snapshot_driver: Literal["full", "template", "both"] = Field(
        default="full", description="full: the workload with its device state (criu-process); template: the engine "
        "captured before it touches its device (criu-template), which rebuilds its device state at restore; both: "
        "a template capsule, then a full one that names it (a restore the full one is refused for falls to it).")


class RestoreRequest(_Request):
    operation: Literal["restore", "prepare"]
    capsule: str = Field(min_length=1, description="Capsule reference, pinned: sha256:…, NAME@sha256:… or a path; "
                         "or a registry reference HOST[:PORT]/REPO@sha256:…, pulled first unless the store has it.")
    insecure_registry: bool = Field(default=False, description="Pull a registry reference over plain HTTP (a "
                                    "registry on loopback or a private network).")
    policy: Policy = Field(default_factory=Policy)
    validation: Validation | None = Field(default=None, description="Override the validation recorded at capture.")
    lifecycle: Lifecycle = Field(default_factory=Lifecycle)
    gpu_map: dict[str, str] = Field(default_factory=dict, description="Captured GPU UUID → GPU UUID here: restore "
                                    "onto another GPU of the same kind (driver r575+).")


class WorkloadRequest(_Request):
    operation: Literal["sleep", "wake", "status", "stop"]
    workload: str | None = Field(default=None, description="Workload name; status without one lists all.")
    sleep_mode: Literal["auto", "engine", "cuda"] = Field(
        default="auto", description="sleep: engine = the engine releases its weights (reloaded from the pinned file "
        "at wake) and KV cache first, then the rest of its GPU state is checkpointed in place; cuda = all GPU state "
        "is checkpointed into host memory; auto = engine when the engine can and its weights are pinned files.")

    @model_validator(mode="after")
    def _needs_workload(self) -> "WorkloadRequest":
        if self.operation != "status" and not self.workload:
            raise ValueError(f"{self.operation} needs a workload")
        return self


OperationRequest = Annotated[Union[CaptureRequest, RestoreRequest, WorkloadRequest], Field(discriminator="operation")]
REQUEST_ADAPTER: TypeAdapter = TypeAdapter(OperationRequest)
OPERATIONS = ("capture", "restore", "prepare", "sleep", "wake", "status", "stop")
