"""Move a process's decompressed CUDA device code out of its anonymous memory into content-addressed files.

The CUDA runtime decompresses a library's fatbin into plain anonymous memory and keeps it there (lazy loading reads
kernels from it later): NCCL's kernels take 200 MiB in every tensor-parallel rank on the H200. CRIU would dump
those pages and write each one back at restore, in every process, although the same bytes sit in every rank and
every capture of the same libraries. So an engine calls stash_code() in its release hook (the process quiet,
nothing running on the GPU), which writes each piece of CUDA code (code_ranges) once to DIR/sha256-HEX.cubin and
maps that file over it, private and at the same address. CRIU then records a file mapping without dirty pages,
and a restore maps the file from the page cache instead of copying pages. The capture carries the files in the
capsule (hoststate.extra_files); staging puts a missing one back, checked against its name (hoststate.put_back_file).

Only stdlib: it runs inside engines."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
from pathlib import Path

from coldsnap.base.files import atomic_write

EM_CUDA = 190  # ELF e_machine of NVIDIA device code
FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")
CUDA_ELF = re.compile(rb"\x7fELF\x02.{13}" + EM_CUDA.to_bytes(2, "little"), re.S)  # e_machine at 18
HEAD_BYTES = 64 << 10  # how far into a mapping its first CUDA image may start
MIN_BYTES = 8 << 20  # smaller images are not worth a file
NAME = re.compile(r"^sha256-([0-9a-f]{64})\.cubin$")
MAP_FIXED = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def is_code_file(path: str) -> bool:
    return bool(NAME.match(os.path.basename(path)))


def has_cuda_elf(data, limit: int | None = None) -> bool:
    """Whether data (any buffer) holds a 64-bit ELF header for NVIDIA GPUs (within its first `limit` bytes)."""
    return CUDA_ELF.search(data, 0, len(data) if limit is None else limit) is not None


def holds_cuda_code(head: bytes) -> bool:
    """A mapping that starts with CUDA code: a fatbin's magic in its first page, or a GPU ELF image in its first
    64 KiB (after whatever the runtime puts first)."""
    return FATBIN_MAGIC in head[:4096] or has_cuda_elf(head, HEAD_BYTES)


def mmapped_chunk_bytes(header: bytes, room: int) -> int:
    """The size of the glibc chunk this 16-byte header starts (malloc's own mmap for a large allocation: prev_size
    0, size with IS_MMAPPED, not NON_MAIN_ARENA, whole pages, fits in `room`), else 0."""
    prev_size = int.from_bytes(header[0:8], "little")
    size = int.from_bytes(header[8:16], "little")
    if prev_size != 0 or not size & 2 or size & 4:
        return 0
    size &= ~7
    return size if 0 < size <= room and size % mmap.PAGESIZE == 0 else 0


def code_ranges(read, lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of the anonymous mapping [lo, hi) that hold CUDA code; read(addr, n) returns its bytes.
    The kernel merges neighbouring anonymous mappings, so a mapping is often several of malloc's mmapped chunks in
    a row (the CUDA runtime keeps each decompressed fatbin in one): each chunk that holds a GPU ELF image is one
    range. A mapping that does not start with a chunk is one range if its start holds CUDA code."""
    out, at = [], lo
    while at + 16 <= hi:
        size = mmapped_chunk_bytes(read(at, 16), hi - at)
        if not size:
            break
        if has_cuda_elf(read(at, size)):
            out.append((at, at + size))
        at += size
    if at == lo and holds_cuda_code(read(lo, min(HEAD_BYTES, hi - lo))):
        out.append((lo, hi))
    return out


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
    for start, end, prot in candidate_mappings(Path("/proc/self/maps").read_text()):
        ranges = code_ranges(_memory, start, end)
        if not ranges and end - start >= 64 << 20:  # what a big one left alone starts with, to tell next time
            left.append(f"{(end - start) >> 20} MiB at {start:#x}: {ctypes.string_at(start, 48).hex()}")
        for lo, hi in ranges:
            moved += _back_with_file(directory, lo, hi, prot)
            files += 1
    return {"files": files, "bytes": moved, "left": left}


def _memory(addr: int, n: int):
    """n bytes of this process's memory at addr, without copying them."""
    return (ctypes.c_char * n).from_address(addr)


def _back_with_file(directory: Path, lo: int, hi: int, prot: int) -> int:
    data = _memory(lo, hi - lo)  # read in place: no second copy of hundreds of MiB
    path = directory / f"sha256-{hashlib.sha256(data).hexdigest()}.cubin"
    if not path.exists():
        atomic_write(path, data)
    fd = os.open(path, os.O_RDONLY)
    try:
        # Same address, same protection, private: the process cannot tell, and its writes (if any) stay its own.
        got = _libc.mmap(lo, hi - lo, prot, mmap.MAP_PRIVATE | MAP_FIXED, fd, 0)
    finally:
        os.close(fd)
    if got != lo:
        raise OSError(ctypes.get_errno(), f"mapping {path.name} over {lo:#x} failed")
    return hi - lo
