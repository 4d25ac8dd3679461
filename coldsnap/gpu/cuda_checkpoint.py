"""ctypes binding of the CUDA driver checkpoint API (cuCheckpointProcess*, driver r570+).

We call the driver ourselves instead of shelling out to NVIDIA's `cuda-checkpoint` utility: it is not installable on
our machines, and calling the API directly gives typed errors and per-step timings. The calls act on *another*
process (pid); the caller only needs libcuda and cuInit(0), no CUDA context of its own.

The structs below follow cuda.h field for field (CUcheckpointLockArgs 64 bytes, CUcheckpointGpuPair 32,
CUcheckpointRestoreArgs 64) and are zeroed whole before use: reserved fields must be 0. Checkpoint and unlock take
optional args that are all reserved: we pass NULL (measured to work on r580).
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import suppress
from typing import Any, Iterable, Sequence

from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.gpu.libcuda import error_name, library_candidates
from coldsnap.gpu.nvml import cuda_version_text

# CUprocessState
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}

CHECKPOINT_SYMBOLS = (
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)

# GPU UUID remapping at restore (CUcheckpointRestoreArgs.gpuPairs) arrived with the r575 driver (CUDA 12.9).
REMAP_MIN_DRIVER = 12090

class CUcheckpointLockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class CUcheckpointGpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


def format_cuda_error(function: str, pid: int | None, code: int, name: str) -> str:
    """'cuCheckpointProcessRestore(pid 123): CUDA_ERROR_NOT_SUPPORTED (801)'."""
    where = f"{function}(pid {pid})" if pid is not None else function
    return f"{where}: {name} ({code})"


def parse_gpu_uuid(value: str | bytes) -> bytes:
    """'GPU-8d0a62a0-…' (NVML's form), bare hex, or 16 raw bytes → the 16 bytes of a CUuuid."""
    if isinstance(value, (bytes, bytearray)):
        if len(value) != 16:
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"a GPU UUID is 16 bytes, got {len(value)}")
        return bytes(value)
    text = value.strip()
    if text.upper().startswith("GPU-"):
        text = text[4:]
    raw = b""
    with suppress(ValueError):
        raw = bytes.fromhex(text.replace("-", ""))
    if len(raw) != 16:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"not a GPU UUID: {value!r} (expected GPU-xxxxxxxx-xxxx-…)")
    return raw


def build_restore_args(gpu_pairs: Sequence[tuple[str | bytes, str | bytes]]):
    """(args, pairs_array): a zeroed CUcheckpointRestoreArgs pointing at the remapping pairs. Keep both alive."""
    pairs = (CUcheckpointGpuPair * len(gpu_pairs))()
    for i, (old, new) in enumerate(gpu_pairs):
        pairs[i].oldUuid.bytes[:] = list(parse_gpu_uuid(old))
        pairs[i].newUuid.bytes[:] = list(parse_gpu_uuid(new))
    args = CUcheckpointRestoreArgs()
    ctypes.memset(ctypes.byref(args), 0, ctypes.sizeof(args))
    args.gpuPairs = ctypes.cast(pairs, ctypes.POINTER(CUcheckpointGpuPair))
    args.gpuPairsCount = len(gpu_pairs)
    return args, pairs


class CudaCheckpointAPI:
    """The six cuCheckpointProcess* calls on libcuda.so.1. Loaded lazily; safe to construct on a host without GPUs.

    Every failing call raises ColdSnapError(GPU_FAILED, "<function>(pid N): CUDA_ERROR_… (code)").
    `lib` injects a stand-in for libcuda (tests)."""

    def __init__(self, lib: Any = None, lib_path: str | None = None):
        self._lib = lib
        self.lib_path: str | None = lib_path if lib is None else (lib_path or "<injected>")
        self._reason: str | None = None
        self._loaded = lib is not None
        self._init_done = False
        self._mutex = threading.Lock()

    # ---- loading -------------------------------------------------------------------------------------------
    def _load(self) -> None:
        with self._mutex:
            if not self._loaded:
                self._loaded = True
                tried = []
                for name in [self.lib_path] if self.lib_path else library_candidates():
                    try:
                        self._lib = ctypes.CDLL(name)
                        self.lib_path = name
                        break
                    except OSError as e:
                        tried.append(f"{name} ({e})")
                if self._lib is None:
                    self._reason = (
                        f"cannot load {tried[0]}" if self.lib_path
                        else "libcuda.so.1 not found (no NVIDIA driver on this host)"
                    )
                    return
                self._declare()
            if self._lib is None or self._init_done or self._reason:
                return
            missing = [s for s in CHECKPOINT_SYMBOLS if not hasattr(self._lib, s)]
            if missing:
                self._reason = (
                    f"{self.lib_path} lacks the checkpoint API ({', '.join(missing)}): the driver is older than r570"
                )
                return
            rc = self._lib.cuInit(0)
            if rc != 0:
                self._reason = f"cuInit(0) failed: {error_name(rc, self._lib)} ({rc})"
                return
            self._init_done = True

    def _declare(self) -> None:
        c_int_p = ctypes.POINTER(ctypes.c_int)
        sigs = {
            "cuInit": [ctypes.c_uint],
            "cuDriverGetVersion": [c_int_p],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuCheckpointProcessGetRestoreThreadId": [ctypes.c_int, c_int_p],
            "cuCheckpointProcessGetState": [ctypes.c_int, c_int_p],
            "cuCheckpointProcessLock": [ctypes.c_int, ctypes.POINTER(CUcheckpointLockArgs)],
            "cuCheckpointProcessCheckpoint": [ctypes.c_int, ctypes.c_void_p],
            "cuCheckpointProcessRestore": [ctypes.c_int, ctypes.POINTER(CUcheckpointRestoreArgs)],
            "cuCheckpointProcessUnlock": [ctypes.c_int, ctypes.c_void_p],
        }
        for name, argtypes in sigs.items():
            fn = getattr(self._lib, name, None)
            if fn is not None:
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int

    def available(self) -> bool:
        """libcuda loads, exports the checkpoint API, and cuInit(0) succeeds."""
        self._load()
        return self._init_done

    def unavailable_reason(self) -> str | None:
        """Why available() is False (None when it is True)."""
        self._load()
        return None if self._init_done else (self._reason or "CUDA checkpoint API unavailable")

    def _require(self) -> Any:
        if not self.available():
            raise ColdSnapError(ErrorCode.ENVIRONMENT, f"CUDA checkpoint API unavailable: {self.unavailable_reason()}")
        return self._lib

    def _call(self, function: str, pid: int, *args: Any, hint: str = "") -> None:
        lib = self._require()
        rc = getattr(lib, function)(int(pid), *args)
        if rc != 0:
            msg = format_cuda_error(function, pid, rc, error_name(rc, lib))
            raise ColdSnapError(ErrorCode.GPU_FAILED, msg + hint)

    # ---- queries -------------------------------------------------------------------------------------------
    def driver_version(self) -> int:
        """The driver's CUDA version as an int (13000 = CUDA 13.0)."""
        self._load()
        if self._lib is None:
            raise ColdSnapError(ErrorCode.ENVIRONMENT, f"CUDA checkpoint API unavailable: {self.unavailable_reason()}")
        v = ctypes.c_int()
        rc = self._lib.cuDriverGetVersion(ctypes.byref(v))
        if rc != 0:
            raise ColdSnapError(ErrorCode.GPU_FAILED,
                                format_cuda_error("cuDriverGetVersion", None, rc, error_name(rc, self._lib)))
        return v.value

    def driver_version_text(self) -> str:
        return cuda_version_text(self.driver_version())

    def state(self, pid: int) -> str:
        """'running' | 'locked' | 'checkpointed' | 'failed'."""
        st = ctypes.c_int()
        self._call("cuCheckpointProcessGetState", pid, ctypes.byref(st))
        return STATES.get(st.value, f"unknown({st.value})")

    def restore_thread_id(self, pid: int) -> int:
        """The tid of the process's CUDA restore thread; succeeds only for processes that are CUDA clients."""
        tid = ctypes.c_int()
        self._call("cuCheckpointProcessGetRestoreThreadId", pid, ctypes.byref(tid))
        return tid.value

    def is_cuda_process(self, pid: int) -> bool:
        """True when the driver knows the process as a CUDA client (its restore thread id can be queried)."""
        try:
            self.restore_thread_id(pid)
            return True
        except ColdSnapError:
            return False

    # ---- actions -------------------------------------------------------------------------------------------
    def lock(self, pid: int, timeout_ms: int = 30000) -> None:
        """Block further CUDA calls of the process and wait (up to timeout_ms) for its in-flight work to finish."""
        args = CUcheckpointLockArgs()
        ctypes.memset(ctypes.byref(args), 0, ctypes.sizeof(args))
        args.timeoutMs = int(timeout_ms)
        self._call("cuCheckpointProcessLock", pid, ctypes.byref(args))

    def checkpoint(self, pid: int) -> None:
        """Move a locked process's GPU memory into its host memory and release the GPU (state → checkpointed)."""
        self._call("cuCheckpointProcessCheckpoint", pid, None)

    def restore(self, pid: int, gpu_pairs: Iterable[tuple[str | bytes, str | bytes]] | None = None) -> None:
        """Bring a checkpointed process's GPU state back (state → locked).

        gpu_pairs: (uuid at capture, uuid now) pairs to restore onto other GPUs of the same kind; needs r575+."""
        pairs = list(gpu_pairs or [])
        if not pairs:
            self._call("cuCheckpointProcessRestore", pid, None)
            return
        self._require()
        version = self.driver_version()
        if version < REMAP_MIN_DRIVER:
            raise ColdSnapError(
                ErrorCode.INCOMPATIBLE,
                f"cuCheckpointProcessRestore(pid {pid}): restoring onto other GPUs (UUID remapping) needs a driver "
                f"with CUDA {cuda_version_text(REMAP_MIN_DRIVER)}+ (r575+); this driver is CUDA "
                f"{cuda_version_text(version)}",
            )
        args, keep = build_restore_args(pairs)
        hint = f" [with {len(pairs)} GPU UUID remapping pair(s); the driver may not support remapping these GPUs]"
        self._call("cuCheckpointProcessRestore", pid, ctypes.byref(args), hint=hint)
        del keep

    def unlock(self, pid: int) -> None:
        """Let a locked process make CUDA calls again (state → running)."""
        self._call("cuCheckpointProcessUnlock", pid, None)
