"""GPU discovery through NVML (nvidia-ml-py): driver, CUDA driver version, GPUs. Never raises: no NVML = no GPUs."""

from __future__ import annotations

from dataclasses import dataclass, field

from coldsnap.contracts import GpuInfo


@dataclass
class NvmlReport:
    driver_version: str | None = None  # "580.159.04"
    cuda_version: str | None = None  # "13.0"
    gpus: list[GpuInfo] = field(default_factory=list)
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
        try:
            report.cuda_version = cuda_version_text(int(pynvml.nvmlSystemGetCudaDriverVersion()))
        except Exception:  # noqa: BLE001 - old NVML: leave it unknown
            pass
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
    except Exception as e:  # noqa: BLE001
        report.error = f"NVML query failed: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return report


def driver_version() -> str | None:
    return discover().driver_version


def cuda_driver_version() -> str | None:
    return discover().cuda_version


def gpus() -> list[GpuInfo]:
    return discover().gpus
