"""Move a process's decompressed CUDA device code out of its anonymous memory into content-addressed files.

The CUDA runtime decompresses each library's fatbin into plain anonymous memory and keeps it (lazy loading reads
kernels from it later): 200 MiB a process for NCCL alone, more for torch's and Triton's kernels. CRIU would dump
those pages and write every one of them back at restore, in each process. The same bytes sit in every rank and
every capture of the same libraries, so they are better as a file: an engine calls stash_code() in its release
hook (the process quiet, nothing running on the GPU). Each mapping that holds CUDA code is written once to
DIR/sha256-HEX.cubin and mapped over itself, private and at the same address, so the process sees the same bytes.
Found by their first bytes: a mapping that starts with such an image (a fatbin, or a GPU ELF within its first
64 KiB; a malloc chunk header first bounds it by its size). An image that shares its mapping with memory below it stays in the dump.
CRIU then records a file mapping with no dirty pages; a restore maps the file from the page cache instead of
copying the pages. The capture packs the files beside the images and a restore puts them back, verified, at the
same path (hoststate.code_files, restore.stage).

Only stdlib: it runs inside engines."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
from pathlib import Path

EM_CUDA = 190  # ELF e_machine of NVIDIA device code
FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")
HEAD_BYTES = 64 << 10  # how far into a mapping its first CUDA image may start
MIN_BYTES = 8 << 20  # smaller images are not worth a file
NAME = re.compile(r"^sha256-([0-9a-f]{64})\.cubin$")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def is_code_file(path: str) -> bool:
    return bool(NAME.match(os.path.basename(path)))


def holds_cuda_code(head: bytes) -> bool:
    """An allocation that starts with CUDA code: a fatbin's magic in its first page, or a 64-bit ELF image for
    NVIDIA GPUs in its first 64 KiB (after a malloc chunk header, fatbin headers, whatever the runtime puts first)."""
    if head.find(FATBIN_MAGIC, 0, 4096) >= 0:
        return True
    at = head.find(b"\x7fELF\x02", 0, HEAD_BYTES)
    while at >= 0:
        if len(head) >= at + 20 and int.from_bytes(head[at + 18:at + 20], "little") == EM_CUDA:
            return True
        at = head.find(b"\x7fELF\x02", at + 1, HEAD_BYTES)
    return False


def allocation_bytes(head: bytes, mapping_bytes: int) -> int:
    """How much of a mapping the allocation at its start takes: a glibc chunk of its own (malloc's mmap for large
    sizes: prev_size 0, size with IS_MMAPPED) says so in its header; otherwise the whole mapping. The kernel merges
    neighbouring anonymous mappings, so memory above the chunk can be someone else's and stays where it is."""
    prev_size = int.from_bytes(head[0:8], "little")
    size = int.from_bytes(head[8:16], "little")
    if prev_size == 0 and size & 2 and not size & 4:  # IS_MMAPPED, not NON_MAIN_ARENA
        size &= ~7
        if 0 < size <= mapping_bytes and size % mmap.PAGESIZE == 0:
            return size
    return mapping_bytes


def candidate_mappings(maps: str) -> list[tuple[int, int, int]]:
    """(start, end, prot) of private anonymous read-write mappings big enough to be worth a file."""
    out = []
    for line in maps.splitlines():
        parts = line.split()
        if len(parts) != 5 or parts[1] != "rw-p" or parts[4] != "0":  # named mappings have a sixth field
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if hi - lo >= MIN_BYTES:
            out.append((lo, hi, mmap.PROT_READ | mmap.PROT_WRITE))
    return out


def stash_code(directory: str | os.PathLike) -> dict:
    """Back every anonymous mapping of this process that holds CUDA device code with a file of its bytes. Returns
    {"files": n, "bytes": moved, "left": [the first bytes of each big mapping left alone]}. Call only while no
    thread of the process writes such memory (a release hook)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    moved, files, left = 0, 0, []
    for lo, hi, prot in candidate_mappings(Path("/proc/self/maps").read_text()):
        head = ctypes.string_at(lo, HEAD_BYTES)
        if not holds_cuda_code(head):
            if hi - lo >= 64 << 20:  # what a big one that stays starts with, to tell next time
                left.append(f"{(hi - lo) >> 20} MiB at {lo:#x}: {head[:48].hex()}")
            continue
        hi = lo + allocation_bytes(head, hi - lo)
        data = ctypes.string_at(lo, hi - lo)
        path = directory / f"sha256-{hashlib.sha256(data).hexdigest()}.cubin"
        if not path.exists():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(data)
            os.replace(tmp, path)
        del data
        fd = os.open(path, os.O_RDONLY)
        try:
            # Same address, same protection, private: the process cannot tell, and its writes (if any) stay its own.
            got = _libc.mmap(lo, hi - lo, prot, mmap.MAP_PRIVATE | 0x10, fd, 0)  # 0x10: MAP_FIXED
        finally:
            os.close(fd)
        if got != lo:
            raise OSError(ctypes.get_errno(), f"mapping {path.name} over {lo:#x} failed")
        moved += hi - lo
        files += 1
    return {"files": files, "bytes": moved, "left": left}
