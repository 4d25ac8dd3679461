"""What a receipt says an operation did: one result model per operation (capture, restore and prepare, sleep,
wake). Flows fill them; the CLI and the benches read their fields, never string keys.

A field is None when the operation did not get that far or it does not apply (a fallback has no CRIU stats, a
prepare no first token); receipts leave None fields out."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from coldsnap.contracts.base import Strict

# CRIU's own account (stats-dump / stats-restore), the engine's account of a release or resume, the prefetcher's:
# reported as their producers give them, for people and benches; nothing decides on their keys.
Account = dict[str, Any]


class ZeroPages(Strict):
    bytes_before: int
    bytes_after: int
    zero_bytes_dropped: int
    processes: int
    seconds: float


class CaptureFacts(Strict):
    capsule: str = Field(description="The capsule's digest.")
    capsule_bytes: int
    signed_by: str = Field(description="The fingerprint of the key that signed it (this host's).")
    weights_apart: bool = Field(description="The weights travel apart from the images (layers of their own).")
    zero_pages: ZeroPages
    tag: str | None = None
    snapshot_driver: str | None = None
    workload: str | None = None
    container: str | None = None
    pid: int | None = None
    left_running: bool | None = None
    quiesce: str | None = None
    connections_in_flight: int | None = None
    cold_start_to_ready_s: float | None = None
    cold_time_to_first_token_s: float | None = None
    template_ready_s: float | None = None
    validated_text: str | None = None
    weights_mode: str | None = None
    cuda_processes: int | None = None
    gpu_memory_checkpointed: dict[str, int] | None = Field(default=None, description="GPU UUID → bytes the workload "
                                                           "held there as its CUDA state was checkpointed (after the "
                                                           "engine's release): what the driver saves and restores.")
    criu_options: list[str] | None = None
    criu_stats: Account | None = None
    runc_checkpoint: list[str] | None = None
    release: Account | None = Field(default=None, description="What the engine released before the dump.")
    template: CaptureFacts | None = Field(default=None, description="The template captured with it (both).")
    spans: list[Any] | None = Field(default=None, description="A template's own spans, within a both capture.")


class Hydrate(Strict):
    cuda_restore_s: dict[str, float] | None = Field(default=None, description="The driver's seconds per step.")
    cuda_restore_per_pid_s: dict[str, dict[str, float]] | None = None
    engine_resume: Account | None = None
    prefetch: Account | None = None
    weights_wait_s: float | None = Field(default=None, description="A streamed pull: how long the engine's resume "
                                         "waited for the rest of its weights (CRIU and the driver restored "
                                         "meanwhile): on its GPUs where prefetchers load them, else in its files.")


class Ranks(Strict):
    restored: int
    expected: int


class InsteadOf(Strict):
    """A full capsule refused here whose template was restored instead."""
    capsule: str
    refused: str


class RestoreFacts(Strict):
    """restore, prepare (staged, admission), a fallback (fallback_reason, started) and a container restore
    (container, address, runc_restore)."""
    capsule: str | None = None
    container: str | None = None
    snapshot_driver: str | None = None
    workload: str | None = None
    pid: int | None = None
    url: str | None = None
    address: str | None = None
    time_to_first_token_s: float | None = None
    first_token_monotonic_s: float | None = Field(
        default=None, description="CLOCK_MONOTONIC at the first token: host-wide, for benches.")
    validated_text: str | None = None
    cuda_processes: int | None = None
    criu_options: list[str] | None = None
    criu_stats: Account | None = None
    runc_restore: list[str] | None = None
    hydrate: Hydrate | None = None
    lazy_pages: Account | None = None
    weights_mode: str | None = None
    ranks: Ranks | None = None
    admit_parts: dict[str, float] | None = None
    stage_parts: dict[str, float] | None = None
    instead_of: InsteadOf | None = None
    pull: Account | None = None
    staged: str | None = None
    admission: Literal["admitted"] | None = None
    fallback_reason: str | None = None
    started: Literal["cold"] | None = None
    network_lock_removed: list[str] | None = None
    network_lock_note: str | None = None


class SleepFacts(Strict):
    workload: str
    mode: str
    cuda_processes: int
    seconds: dict[str, float]
    engine_release: Account


class WakeFacts(Strict):
    workload: str
    time_to_first_token_s: float
    validated_text: str
    mode: str
    engine_resume: Account


Operation = Literal["capture", "restore", "prepare", "sleep", "wake"]
Result = CaptureFacts | RestoreFacts | SleepFacts | WakeFacts

RESULTS: dict[str, type[Strict]] = {"capture": CaptureFacts, "restore": RestoreFacts, "prepare": RestoreFacts,
                                   "sleep": SleepFacts, "wake": WakeFacts}
