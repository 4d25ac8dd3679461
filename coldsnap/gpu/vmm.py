"""ctypes binding of the CUDA driver's virtual memory management (cuMem*) calls that hand GPU memory from one process
to another: one side creates an allocation exportable as a POSIX file descriptor and maps it; the other imports the
descriptor (passed over a UNIX socket) and maps the same physical memory. Used to fill the weights of a restoring
engine on the GPU while CRIU and the driver are still restoring it (coldsnap.gpu.prefetch).

The structs below follow cuda.h field for field (CUmemLocation 8 bytes, CUmemAllocationProp 32, CUmemAccessDesc 12,
CUDA_MEMCPY2D 128) and are zeroed whole before use: reserved fields must be 0.
"""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from typing import Iterator

from coldsnap.gpu.libcuda import error_name, library_candidates

ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
HANDLE_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
ACCESS_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
GRANULARITY_MINIMUM = 0
STREAM_NON_BLOCKING = 1
EVENT_DISABLE_TIMING = 2
MEMORYTYPE_HOST = 1  # CU_MEMORYTYPE_HOST
MEMORYTYPE_DEVICE = 2
HOSTREGISTER_READ_ONLY = 0x08  # CU_MEMHOSTREGISTER_READ_ONLY: the GPU only reads it (a read-only file mapping)

u64, usz, vp, c_int, c_uint = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint


class CudaError(RuntimeError):
    """A driver call failed; the message names the call and the error."""


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", vp), ("allocFlags", _AllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", c_int)]


class CUDA_MEMCPY2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", usz), ("srcY", usz), ("srcMemoryType", c_int), ("srcHost", vp), ("srcDevice", u64),
                ("srcArray", vp), ("srcPitch", usz), ("dstXInBytes", usz), ("dstY", usz), ("dstMemoryType", c_int),
                ("dstHost", vp), ("dstDevice", u64), ("dstArray", vp), ("dstPitch", usz), ("WidthInBytes", usz),
                ("Height", usz)]


_SIGNATURES = {
    "cuInit": [c_uint],
    "cuDeviceGetCount": [ctypes.POINTER(c_int)],
    "cuDeviceGet": [ctypes.POINTER(c_int), c_int],
    "cuDeviceGetUuid_v2": [ctypes.c_char_p, c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(vp), c_int],
    "cuCtxSetCurrent": [vp],
    "cuMemGetAllocationGranularity": [ctypes.POINTER(usz), ctypes.POINTER(CUmemAllocationProp), c_int],
    "cuMemCreate": [ctypes.POINTER(u64), usz, ctypes.POINTER(CUmemAllocationProp), u64],
    "cuMemAddressReserve": [ctypes.POINTER(u64), usz, usz, u64, u64],
    "cuMemAddressFree": [u64, usz],
    "cuMemMap": [u64, usz, usz, u64, u64],
    "cuMemUnmap": [u64, usz],
    "cuMemSetAccess": [u64, usz, ctypes.POINTER(CUmemAccessDesc), usz],
    "cuMemRelease": [u64],
    "cuMemExportToShareableHandle": [vp, u64, c_int, u64],
    "cuMemImportFromShareableHandle": [ctypes.POINTER(u64), vp, c_int],
    "cuMemHostAlloc": [ctypes.POINTER(vp), usz, c_uint],
    "cuMemFreeHost": [vp],
    "cuMemHostRegister_v2": [vp, usz, c_uint],
    "cuMemHostUnregister": [vp],
    "cuMemcpyDtoH_v2": [vp, u64, usz],
    "cuMemsetD8_v2": [u64, ctypes.c_ubyte, usz],
    "cuStreamCreate": [ctypes.POINTER(vp), c_uint],
    "cuStreamSynchronize": [vp],
    "cuStreamDestroy_v2": [vp],
    "cuEventCreate": [ctypes.POINTER(vp), c_uint],
    "cuEventRecord": [vp, vp],
    "cuEventSynchronize": [vp],
    "cuEventDestroy_v2": [vp],
    "cuMemcpyHtoDAsync_v2": [u64, vp, usz, vp],
    "cuMemcpy2DAsync_v2": [ctypes.POINTER(CUDA_MEMCPY2D), vp],
}


class Driver:
    """libcuda with the calls above declared; every call raises CudaError on failure."""

    def __init__(self) -> None:
        errors = []
        for name in library_candidates():
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(f"{name}: {e}")
        else:
            raise CudaError("no libcuda: " + "; ".join(errors[:3]))
        for fn, argtypes in _SIGNATURES.items():
            f = getattr(self.lib, fn)
            f.argtypes, f.restype = argtypes, c_int
        self.call("cuInit", 0)

    def call(self, fn: str, *args) -> None:
        rc = getattr(self.lib, fn)(*args)
        if rc != 0:
            raise CudaError(f"{fn} failed: {error_name(rc, self.lib)} ({rc})")

    def device_by_uuid(self, uuid: bytes) -> int:
        """The ordinal of the GPU with that 16-byte UUID among the visible ones."""
        count = c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        for ordinal in range(count.value):
            dev, raw = c_int(), ctypes.create_string_buffer(16)
            self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
            self.call("cuDeviceGetUuid_v2", raw, dev)
            if raw.raw == uuid:
                return dev.value
        raise CudaError(f"no visible GPU has UUID {uuid.hex()}")

    def use_primary_context(self, device: int) -> ctypes.c_void_p:
        """Make the device's primary context (the one the CUDA runtime and torch use) current on this thread."""
        ctx = vp()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
        self.call("cuCtxSetCurrent", ctx)
        return ctx

    @staticmethod
    def _prop(device: int, exportable: bool) -> CUmemAllocationProp:
        prop = CUmemAllocationProp()
        prop.type = ALLOCATION_PINNED
        prop.requestedHandleTypes = HANDLE_POSIX_FD if exportable else 0
        prop.location.type, prop.location.id = LOCATION_DEVICE, device
        return prop

    def granularity(self, device: int) -> int:
        g = usz()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(self._prop(device, True)),
                  GRANULARITY_MINIMUM)
        return g.value

    def map_handle(self, handle: int, size: int, device: int) -> int:
        """Reserve a VA range of size, map the allocation there, allow this device to read and write it."""
        ptr = u64()
        self.call("cuMemAddressReserve", ctypes.byref(ptr), size, 0, 0, 0)
        try:
            self.call("cuMemMap", ptr, size, 0, handle, 0)
            access = CUmemAccessDesc()
            access.location.type, access.location.id, access.flags = LOCATION_DEVICE, device, ACCESS_READWRITE
            self.call("cuMemSetAccess", ptr, size, ctypes.byref(access), 1)
        except CudaError:
            self.lib.cuMemUnmap(ptr, size)
            self.lib.cuMemAddressFree(ptr, size)
            raise
        return ptr.value

    def unmap(self, ptr: int, size: int) -> None:
        self.call("cuMemUnmap", ptr, size)
        self.call("cuMemAddressFree", ptr, size)


class ExportableBuffer:
    """GPU memory of at least `size` bytes, mapped in this process, exportable as a file descriptor."""

    def __init__(self, driver: Driver, device: int, size: int) -> None:
        self.driver, self.device = driver, device
        g = driver.granularity(device)
        self.size = -(-size // g) * g
        handle = u64()
        driver.call("cuMemCreate", ctypes.byref(handle), self.size, ctypes.byref(driver._prop(device, True)), 0)
        self.handle = handle.value
        try:
            self.ptr = driver.map_handle(self.handle, self.size, device)
        except CudaError:
            driver.lib.cuMemRelease(self.handle)
            raise

    def export_fd(self) -> int:
        fd = c_int(-1)
        self.driver.call("cuMemExportToShareableHandle", ctypes.byref(fd), self.handle, HANDLE_POSIX_FD, 0)
        return fd.value

    def close(self) -> None:
        if self.handle:
            self.driver.lib.cuMemUnmap(self.ptr, self.size)
            self.driver.lib.cuMemAddressFree(self.ptr, self.size)
            self.driver.lib.cuMemRelease(self.handle)
            self.handle = 0


class DeviceRegion:
    """A device byte range as a __cuda_array_interface__ exporter, for torch.as_tensor (no copy, not owned)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


@contextmanager
def imported(driver: Driver, fd: int, size: int, device: int) -> Iterator[int]:
    """Map the GPU memory another process exported as fd (size bytes, on `device`, the ordinal as this process
    sees it) and yield its device pointer; unmapped and released after. The caller's thread must have a context
    of that device current (torch's, for instance). The fd is closed."""
    handle = u64()
    try:
        driver.call("cuMemImportFromShareableHandle", ctypes.byref(handle), vp(fd), HANDLE_POSIX_FD)
    finally:
        os.close(fd)
    try:
        ptr = driver.map_handle(handle.value, size, device)
        try:
            yield ptr
        finally:
            driver.unmap(ptr, size)
    finally:
        driver.lib.cuMemRelease(handle.value)
