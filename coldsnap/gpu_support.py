"""GPU step of capture/restore: checkpoint the CUDA state of every CUDA process of a tree, or say there is none.

A thin seam over coldsnap.gpu so flows stay readable and CPU-only hosts never load libcuda."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GpuCheckpoint:
    pids: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    summary: str = "no CUDA processes"
    gpu_uuids: list[str] = field(default_factory=list)  # the GPUs they use, by index (known at checkpoint)


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
    from .gpu.nvml import gpus_used_by

    used = gpus_used_by(found)  # while their contexts are still on the GPUs
    report = tree.checkpoint_tree(root_pid, pids=found, api=api)
    pids = list(report.pids)
    if not pids:
        return GpuCheckpoint(summary="no CUDA processes")
    return GpuCheckpoint(pids=pids, seconds=dict(report.seconds), gpu_uuids=used,
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


# --- weights prefetch (coldsnap.gpu.prefetch) --------------------------------------------------------------------
@dataclass
class Prefetch:
    """A prefetcher loading the weights onto the GPU while the restore goes on, or why there is none."""

    socket: str | None = None
    proc: object = None  # subprocess.Popen
    skipped: str | None = None


def start_prefetch(profile, supported: bool, gpu_map: dict[str, str], run_dir) -> Prefetch:
    """Start a prefetcher when the restore will reload weights from one file onto one GPU, there is room for a
    second copy of them for a moment, and COLDSNAP_PREFETCH is not 0. Never raises: no prefetch is only slower."""
    import os
    import subprocess
    import sys
    import uuid

    from .gpu.nvml import free_bytes

    weights = profile.model.weights if profile.model else []
    if os.environ.get("COLDSNAP_PREFETCH", "1") == "0":
        return Prefetch(skipped="COLDSNAP_PREFETCH=0")
    if not supported:
        return Prefetch(skipped=f"the {profile.engine.name} engine takes no prefetched weights")
    if not profile.cuda_pids or len(profile.gpus_used) != 1 or profile.distributed is not None:
        return Prefetch(skipped="not one CUDA process on one GPU")
    if len(weights) != 1:
        return Prefetch(skipped="the weights are not one file")
    gpu = gpu_map.get(profile.gpus_used[0], profile.gpus_used[0])
    free = free_bytes(gpu)
    if free is None or free < 2 * weights[0].size + (8 << 30):
        return Prefetch(skipped=f"not enough free memory on {gpu} for a second copy of the weights")
    sock = f"{run_dir}/{uuid.uuid4().hex[:12]}.sock"
    if len(sock.encode()) > 100:
        return Prefetch(skipped="the socket path would be too long")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # the GPU is named by UUID
    try:
        proc = subprocess.Popen([sys.executable, "-m", "coldsnap.gpu.prefetch", "--file", weights[0].path,
                                 "--gpu", gpu, "--socket", sock, "--hold"], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        return Prefetch(skipped=f"could not start the prefetcher: {e}")
    return Prefetch(socket=sock, proc=proc)


def finish_prefetch(p: Prefetch, served: bool, wait_s: float = 10.0) -> dict:
    """Reap the prefetcher: what it reported. served: the engine took the memory (the prefetcher frees its own
    once its stdin closes, here); otherwise it would still wait for the engine and is killed now."""
    import json
    import os
    import subprocess

    if p.proc is None:
        return {"skipped": p.skipped}
    if not served:
        p.proc.kill()
    try:
        out, err = p.proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        p.proc.kill()
        out, err = p.proc.communicate()
    try:
        os.unlink(p.socket)
    except (FileNotFoundError, TypeError):
        pass
    lines = [line for line in out.decode(errors="replace").splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    tail = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {p.proc.returncode}"]
    return {"error": f"the prefetcher reported nothing: {tail[0][:300]}"}
