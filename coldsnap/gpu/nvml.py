"""GPU discovery through NVML (nvidia-ml-py): driver, CUDA driver version, GPUs. Never raises: no NVML = no GPUs."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, field

from coldsnap.contracts import GpuInfo


@dataclass
class NvmlReport:
    driver_version: str | None = None  # "580.159.04"
    cuda_version: str | None = None  # "13.0"
    gpus: list[GpuInfo] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # "0-1:NV18" per pair of GPUs
    error: str | None = None  # why NVML gave nothing (None when it answered)


def cuda_version_text(version: int) -> str:
    """13000 → '13.0', 12090 → '12.9' (the driver API's integer form)."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def discover() -> NvmlReport:
    """Everything NVML knows that a capsule's profile records. Any NVML problem becomes report.error."""
    try:
        import pynvml
    except Exception as e:  # noqa: BLE001 - missing module or a broken install: no GPUs either way
        return NvmlReport(error=f"nvidia-ml-py not importable: {e}")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound on hosts without a driver
        return NvmlReport(error=f"NVML unavailable: {e}")
    report = NvmlReport()
    try:
        report.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        with suppress(Exception):  # old NVML: leave it unknown
            report.cuda_version = cuda_version_text(int(pynvml.nvmlSystemGetCudaDriverVersion()))
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            report.gpus.append(
                GpuInfo(
                    index=i,
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // (1 << 20),
                    compute_capability=f"{major}.{minor}",
                )
            )
        report.links = gpu_links(pynvml)
    except Exception as e:  # noqa: BLE001
        report.error = f"NVML query failed: {e}"
    finally:
        with suppress(Exception):
            pynvml.nvmlShutdown()
    return report


# nvmlDeviceGetTopologyCommonAncestor levels, named as `nvidia-smi topo -m` names them.
TOPOLOGY_LEVELS = {0: "SELF", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def gpu_links(pynvml) -> list[str]:
    """How each pair of GPUs is connected: 'i-j:NVn' when they reach each other over NVLink (n = active links of
    GPU i, as `nvidia-smi topo -m` counts them, directly or through NVSwitches), else 'i-j:LEVEL' from the PCIe/CPU
    topology. What a tensor-parallel capture recorded must match at restore (NCCL chose its paths for it)."""
    n = pynvml.nvmlDeviceGetCount()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    out = []
    for i in range(n):
        for j in range(i + 1, n):
            nvlink = False
            with suppress(Exception):  # old NVML or no NVLink
                nvlink = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK) \
                    == pynvml.NVML_P2P_STATUS_OK
            if nvlink:
                out.append(f"{i}-{j}:NV{_active_links(pynvml, handles[i])}")
                continue
            try:
                level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                out.append(f"{i}-{j}:{TOPOLOGY_LEVELS.get(int(level), str(level))}")
            except Exception:  # noqa: BLE001
                out.append(f"{i}-{j}:unknown")
    return out


def _active_links(pynvml, handle) -> int:
    count = 0
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        with suppress(Exception):  # no such link
            count += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
    return count


def _query(ask, unknown):
    """ask(pynvml) between nvmlInit and nvmlShutdown; unknown when NVML is missing or fails (never raises)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: unknown
        return unknown
    try:
        return ask(pynvml)
    except Exception:  # noqa: BLE001
        return unknown
    finally:
        with suppress(Exception):
            pynvml.nvmlShutdown()


def _processes(pynvml):
    """(GPU UUID, its compute processes) for each GPU, by index."""
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        yield _text(pynvml.nvmlDeviceGetUUID(h)), pynvml.nvmlDeviceGetComputeRunningProcesses(h)


def gpus_used_by(pids) -> list[str]:
    """UUIDs of the GPUs on which any of these (host) PIDs has a CUDA context, by GPU index; [] when NVML can't say."""
    wanted = {int(p) for p in pids}
    return _query(lambda nv: [uuid for uuid, procs in _processes(nv) if any(int(p.pid) in wanted for p in procs)],
                  [])


def memory_used_by(pids) -> dict[str, int]:
    """GPU UUID → bytes the processes with these (host) PIDs hold there; {} when NVML can't say."""
    wanted = {int(p) for p in pids}

    def held(nv) -> dict[str, int]:
        out = {uuid: sum(int(p.usedGpuMemory or 0) for p in procs if int(p.pid) in wanted)
               for uuid, procs in _processes(nv)}
        return {uuid: n for uuid, n in out.items() if n}

    return _query(held, {})


def free_bytes(uuid: str) -> int | None:
    """Free memory of the GPU with that UUID, or None when NVML can't say."""
    return _query(lambda nv: int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByUUID(uuid)).free), None)
