"""Diagnosis on the GPU machine: how much device memory a torch process holds once its own memory is freed (what a
capture's CUDA checkpoint still moves, and the CUDA driver's restore copies back), and which of it can be shed.

Prints one JSON object: the device memory in use (NVML, this process) after each step, and the CUDA limits read
through the driver API. Run from the repo root there: python3 packaging/device/context-memory.py"""

import ctypes
import json
import time

import torch


def used_mib() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**20, 1)


def main() -> None:
    steps = {}
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    steps["context + one tensor"] = used_mib()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    torch.nn.functional.scaled_dot_product_attention(a[None, None, :128, :128], a[None, None, :128, :128],
                                                     a[None, None, :128, :128])
    steps["after cuBLAS, attention"] = used_mib()
    del a
    torch.cuda.empty_cache()
    steps["empty_cache"] = used_mib()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    steps["cuBLAS workspaces cleared"] = used_mib()

    cuda = ctypes.CDLL("libcuda.so.1")
    limits = {"stack": 0, "printf_fifo": 1, "malloc_heap": 2}
    read = {}
    for name, code in limits.items():
        v = ctypes.c_size_t()
        rc = cuda.cuCtxGetLimit(ctypes.byref(v), code)
        read[name] = v.value if rc == 0 else f"rc {rc}"
    for name, code, value in (("stack", 0, 0), ("printf_fifo", 1, 0), ("malloc_heap", 2, 0)):
        t = time.perf_counter()
        rc = cuda.cuCtxSetLimit(code, ctypes.c_size_t(value))
        steps[f"{name} limit set to {value} (rc {rc}, {time.perf_counter() - t:.3f} s)"] = used_mib()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "limits_before": read,
                      "used_mib": steps}, indent=1))


if __name__ == "__main__":
    main()
