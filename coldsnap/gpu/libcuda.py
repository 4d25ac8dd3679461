"""Finding libcuda and naming its error codes: shared by every ctypes binding of the driver here. Light on purpose
(no ColdSnap imports): a restored engine imports it on its resume path, where every import is on the clock."""

from __future__ import annotations

import ctypes
import glob
from contextlib import suppress
from typing import Any

from coldsnap.base.paths import settings

# Names for the codes we expect, used when libcuda can't name a code itself (it is absent, or cuGetErrorName fails).
_KNOWN_ERRORS = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
    46: "CUDA_ERROR_DEVICES_UNAVAILABLE",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    400: "CUDA_ERROR_INVALID_HANDLE",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    500: "CUDA_ERROR_NOT_FOUND",
    800: "CUDA_ERROR_NOT_PERMITTED",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    909: "CUDA_ERROR_TIMEOUT",
    999: "CUDA_ERROR_UNKNOWN",
}


def library_candidates() -> list[str]:
    """Where libcuda.so.1 may be: $COLDSNAP_LIBCUDA, the loader's own search, then the usual driver locations.

    The CUDA toolkit's stubs/libcuda.so is never a candidate (it loads, then every call fails with STUB_LIBRARY)."""
    names: list[str] = []
    if settings().libcuda:
        names.append(str(settings().libcuda))
    names.append("libcuda.so.1")
    for d in (
        "/usr/local/nvidia/lib64",
        "/usr/local/nvidia/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/lib/wsl/lib",
    ):
        names.extend(sorted(glob.glob(f"{d}/libcuda.so*"), key=lambda p: (not p.endswith(".so.1"), p)))
    return list(dict.fromkeys(names))  # drop repeats, keep first-seen order


def error_name(code: int, lib: Any = None) -> str:
    """CUDA_ERROR_… for a CUresult, asking the driver first (cuGetErrorName), then our table."""
    if lib is not None:
        with suppress(Exception):  # naming an error must never raise another
            s = ctypes.c_char_p()
            if lib.cuGetErrorName(int(code), ctypes.byref(s)) == 0 and s.value:
                return s.value.decode(errors="replace")
    return _KNOWN_ERRORS.get(int(code), f"CUDA_ERROR_{int(code)}")


CU_LIMIT_STACK_SIZE = 0


def set_stack_limit(stack_bytes: int) -> int | None:
    """Set the calling thread's current CUDA context's per-thread stack size (CU_LIMIT_STACK_SIZE) and return the
    one it had, or None where the driver refuses (no context current, no libcuda).

    The driver keeps that much local memory for every thread the GPU can hold at once: 264 MiB on an H200 at the
    default 1 KiB, most of a torch context's device memory once the engine has freed its own. A capture that sets it
    to 0 before the CUDA checkpoint spares the driver saving, and a restore copying back, those bytes; the engine
    sets it back before its next kernel (a kernel that needs more stack than the limit gets it from the driver
    anyway, so 0 is never wrong, only slower at that kernel's first launch)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")  # the engine's own, already loaded by its CUDA runtime
    except OSError:
        return None
    before = ctypes.c_size_t()
    if lib.cuCtxGetLimit(ctypes.byref(before), CU_LIMIT_STACK_SIZE) != 0:
        return None
    if lib.cuCtxSetLimit(CU_LIMIT_STACK_SIZE, ctypes.c_size_t(int(stack_bytes))) != 0:
        return None
    return before.value
