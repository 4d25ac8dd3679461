"""GPU step of capture/restore: checkpoint the CUDA state of every CUDA process of a tree, or say there is none.

A thin seam over coldsnap.gpu so flows stay readable and CPU-only hosts never load libcuda."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GpuCheckpoint:
    pids: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    summary: str = "no CUDA processes"


def checkpoint_tree(root_pid: int) -> GpuCheckpoint:
    from .gpu.cuda_checkpoint import CudaCheckpointAPI

    api = CudaCheckpointAPI()
    if not api.available():
        return GpuCheckpoint(summary="no CUDA processes (no CUDA driver with the checkpoint API on this host)")
    from .contracts import ColdSnapError, ErrorCode
    from .gpu import tree

    found = tree.cuda_pids(root_pid, api)
    foreign = tree.foreign_nvidia_mappings(root_pid, found)
    if foreign:  # CRIU would fail on them ("Can't handle non-regular mapping"): refuse by name, workload untouched
        raise ColdSnapError(ErrorCode.GPU_FAILED, tree.describe_foreign(foreign))
    report = tree.checkpoint_tree(root_pid, pids=found, api=api)
    pids = list(report.pids)
    if not pids:
        return GpuCheckpoint(summary="no CUDA processes")
    return GpuCheckpoint(pids=pids, seconds=dict(report.seconds),
                         summary=f"CUDA state of {len(pids)} process(es) checkpointed")


def restore_tree(ckpt: GpuCheckpoint, gpu_pairs=None) -> GpuCheckpoint:
    if not ckpt.pids:
        return ckpt
    from .gpu import tree

    report = tree.restore_tree(ckpt.pids, gpu_pairs=gpu_pairs)
    return GpuCheckpoint(pids=list(report.pids), seconds=dict(report.seconds),
                         summary=f"CUDA state of {len(ckpt.pids)} process(es) restored")


def restore_restored_tree(root_pid: int, gpu_pairs=None) -> GpuCheckpoint:
    """After `criu restore`: restore + unlock every process of the tree whose CUDA state is checkpointed.
    Their host PIDs are new (the PID namespace kept the inner ones), so find them again."""
    from .gpu.cuda_checkpoint import CudaCheckpointAPI

    api = CudaCheckpointAPI()
    if not api.available():
        return GpuCheckpoint(summary="no CUDA processes (no CUDA driver on this host)")
    from .gpu import tree

    pids = tree.checkpointed_pids(root_pid)
    if not pids:
        return GpuCheckpoint(summary="no CUDA processes")
    report = tree.restore_tree(pids, gpu_pairs=gpu_pairs)
    return GpuCheckpoint(pids=list(report.pids), seconds=dict(report.seconds),
                         summary=f"CUDA state of {len(pids)} process(es) restored")
