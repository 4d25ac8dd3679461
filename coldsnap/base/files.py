"""File helpers, stdlib only: atomic replacement (the one way ColdSnap writes a file that someone else may read at
any moment), write-behind for large files made durable, private directories, full positional reads, the host's
submounts."""

from __future__ import annotations

import ctypes
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from coldsnap.base.paths import settings

KEEP_MODE = -1


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike, mode: int = 0o600, default_mode: int = 0o644,
                sync: bool = True) -> Iterator[BinaryIO]:
    """A file object whose bytes replace `path` only when the block ends without an exception: written to a temp
    file beside it (created with `mode` at once, so secrets are never readable by others), fsynced, renamed over
    `path`, the directory fsynced. Readers see the old file or the new one, never a part; a failure leaves no temp
    file. KEEP_MODE: the existing file's mode, else default_mode. sync=False skips the fsyncs, for files of
    gigabytes whose digest is checked before anyone relies on them (a crash may lose them, never corrupt a use)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == KEEP_MODE:
        mode = path.stat().st_mode & 0o7777 if path.exists() else default_mode
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o777)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)  # the umask may have narrowed it; and special bits need chmod
        os.replace(tmp, path)
        if sync:
            fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, data: bytes, mode: int = 0o600, default_mode: int = 0o644) -> None:
    """The one way ColdSnap writes a whole file that someone else may read at any moment (see atomic_file)."""
    with atomic_file(path, mode, default_mode) as f:
        f.write(data)


def write_run_state(path: str | os.PathLike, data: bytes, mode: int = 0o600) -> None:
    """atomic_write for the run directory's state (journals, claims, workload and shim records, prefetch plans):
    replaced whole, never fsynced. It describes processes and namespaces of this boot only, and a killed process
    leaves its writes in the page cache, so the rename is all it needs; an fsync would wait for whatever the disk
    is busy with (a first restore's weights streaming in behind it), on the restore's clock."""
    with atomic_file(path, mode, sync=False) as f:
        f.write(data)


# --- write-behind -------------------------------------------------------------------------------------------------
# A file of gigabytes written and then fsynced sits dirty in the page cache until the fsync, which then writes all of
# it at the disk's rate: receiving and writing add up instead of overlapping. Starting the disk write of each window
# as soon as it is written lets the disk work while the next bytes arrive; the final fsync waits only for what is
# still in flight. The pages stay cached: a restore reads them next. It does not wait for earlier windows (which
# would bound what is dirty): on this project's machines that made pulls slower; the kernel throttles writers anyway.
# COLDSNAP_WRITEBACK_MIB sets the window; 0 leaves write-back to the kernel (the registry bench compares the two).
WRITEBACK_WINDOW = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2
_libc = None


def _sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> int:
    """0, or the errno; advice only: a failure (EINVAL on a file system without it) costs nothing."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return 0 if _libc.sync_file_range(fd, offset, nbytes, flags) == 0 else ctypes.get_errno()


class WriteBehind:
    """Tell it of each write to `fd`, appended at `offset` onwards; it starts their write-back window by window.
    Flush a buffered file object before telling: only bytes the kernel has are written back."""

    def __init__(self, fd: int, offset: int = 0):
        self.fd, self.end, self.started = fd, offset, offset
        mib = settings().writeback_mib
        self.window = int(mib) << 20 if mib.isdigit() else WRITEBACK_WINDOW

    def wrote(self, nbytes: int) -> None:
        self.end += nbytes
        if not self.window or self.end - self.started < self.window:
            return
        _sync_file_range(self.fd, self.started, self.end - self.started, _SYNC_FILE_RANGE_WRITE)
        self.started = self.end


def private_dir(path: Path) -> Path:
    """Create a 0700 directory: capsules and run state hold process memory, i.e. secrets."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def submounts(top: str | os.PathLike) -> list[str]:
    """Mount points strictly below top on this host (e.g. a driver directory mounted at /usr/local/nvidia), shortest
    first. A container bind of top must bind them one by one: runc declares the spec's bind mounts external to CRIU,
    and a submount brought along by a recursive bind is not one of them (CRIU fails on a file system it can't dump)."""
    prefix = os.path.normpath(os.fspath(top)).rstrip("/") + "/"
    points = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")  # mountinfo escapes space as \040
            if point.startswith(prefix):
                points.add(point)
    return sorted(points, key=lambda p: (p.count("/"), p))


def pread_full(fd: int, view: memoryview, offset: int) -> None:
    """Fill view from the file at offset (a short read is continued; the file ending first is an error)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"the file ended {len(view) - done} bytes early")
        done += n


def copy_sparse(src: str | os.PathLike, dst: str | os.PathLike, size: int, block: int = 1 << 20) -> None:
    """Copy the first `size` bytes of src to dst, leaving holes where src has holes or zero blocks: the shm queues
    are hundreds of MB of which a few KB are written, and a hole in tmpfs costs no memory."""
    zero = bytes(block)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fdi = fi.fileno()
        pos = 0
        while pos < size:
            try:
                data_at = os.lseek(fdi, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            if data_at >= size:
                break
            try:
                hole_at = min(os.lseek(fdi, data_at, os.SEEK_HOLE), size)
            except OSError:
                hole_at = size
            pos = data_at
            while pos < hole_at:
                chunk = os.pread(fdi, min(block, hole_at - pos), pos)
                if not chunk:  # the file ended early: the next SEEK_DATA finds no more
                    break
                if chunk != zero[:len(chunk)]:
                    os.pwrite(fo.fileno(), chunk, pos)
                pos += len(chunk)
        fo.truncate(size)
