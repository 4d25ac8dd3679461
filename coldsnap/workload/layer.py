"""The files a container wrote into its own root filesystem, carried in its capsule.

CRIU dumps an open file as a name and an offset, and a restore into a new container of the same image finds the
image's files there but not what the old container wrote on top of them: a server's log under /tmp (sparkrun's
serve log, which the server writes to), the script a shell still reads, a pid file. Those live in the writable
(upper) layer of the overlay mounted as the container's root (docker's, podman's and containerd's snapshotters
all mount one). Like a bound /dev/shm's files (coldsnap.workload.hostfiles.HeldShm) they are held open from before
the dump, copied at their dump-time bytes afterwards (CRIU checks an open file's size at restore), and written into
the new container's root before `runc restore`: through its mounted overlay, so they land in its own upper layer.

Only regular files of the upper layer are carried; whiteouts (files of the image the container deleted),
directories' own modes and symlinks are not. The layer is bounded (COLDSNAP_LAYER_MAX_MIB, default 1024): a
container that wrote more is refused at capture with the largest files named."""

from __future__ import annotations

import errno
import os
import stat
from contextlib import suppress
from pathlib import Path

from coldsnap.base.files import copy_sparse
from coldsnap.base.paths import settings
from coldsnap.contracts import CapturedFile, ColdSnapError, ErrorCode

MAX_FILES = 10_000
SKIP = ("/proc/", "/sys/", "/dev/")  # never on the root filesystem of a container that mounts them


def max_bytes() -> int:
    return int(float(settings().layer_max_mib) * 2**20)


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def writable_layer(rootfs: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The upper directory of the overlay mounted at rootfs, or None (not an overlay: a plain directory root)."""
    target = os.path.realpath(rootfs)
    upper = None
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3 or _unescape(fields[4]) != target:
            continue
        # the last mount at that point is the one seen there
        upper = None
        if tail[0] == "overlay":
            for option in tail[2].split(","):
                if option.startswith("upperdir="):
                    upper = _unescape(option[len("upperdir="):])
    return upper


def _covered(path: str, mount_points: list[str]) -> bool:
    """Whether path (in the container) lies under one of the container's mounts (not on its root filesystem)."""
    return path.startswith(SKIP) or any(path == m or path.startswith(m.rstrip("/") + "/") for m in mount_points)


class HeldLayer:
    """The regular files of a container's writable layer, held open from before the dump."""

    def __init__(self, rootfs: str | None, mount_points: list[str]):
        self.upper = writable_layer(rootfs) if rootfs else None
        self.fds: dict[str, int] = {}  # container path -> fd
        if not self.upper:
            return
        points = [os.path.normpath(m) for m in mount_points if m and os.path.normpath(m) != "/"]
        sizes: list[tuple[int, str]] = []
        for top, dirs, names in os.walk(self.upper):
            rel = os.path.relpath(top, self.upper)
            base = "/" if rel == "." else "/" + rel
            dirs[:] = [d for d in dirs if not _covered(os.path.join(base, d), points)]
            for name in names:
                path = os.path.join(base, name)
                if _covered(path, points):
                    continue
                try:
                    fd = os.open(os.path.join(top, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
                except OSError:
                    continue  # a symlink, a vanished file
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):  # whiteouts are 0:0 character devices; fifos, sockets
                    os.close(fd)
                    continue
                self.fds[path] = fd
                sizes.append((st.st_size, path))
                if len(self.fds) > MAX_FILES:
                    self.close()
                    raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"the container wrote more than {MAX_FILES} "
                                        f"files into its root filesystem ({self.upper}); ColdSnap carries at most "
                                        f"{MAX_FILES}: write them to a volume or a tmpfs")
        total = sum(s for s, _ in sizes)
        if total > max_bytes():
            self.close()
            biggest = ", ".join(f"{p} ({s / 2**20:.0f} MiB)" for s, p in sorted(sizes, reverse=True)[:3])
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"the container wrote {total / 2**20:.0f} MiB into its "
                                f"root filesystem, more than COLDSNAP_LAYER_MAX_MIB ({max_bytes() / 2**20:.0f} "
                                f"MiB) lets a capsule carry; largest: {biggest}")

    def captured(self) -> tuple[list[CapturedFile], dict[str, str]]:
        """After the dump: each file at its dump-time size, and where to read its bytes."""
        files, sources = [], {}
        for path, fd in sorted(self.fds.items()):
            st = os.fstat(fd)
            files.append(CapturedFile(path=path, size=st.st_size, mode=stat.S_IMODE(st.st_mode), layer=True))
            sources[path] = f"/proc/self/fd/{fd}"
        return files, sources

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _open_dir_in(root_fd: int, parts: list[str]) -> int:
    """The directory root/parts..., made where missing, never following a symlink (an image's /tmp → /host would
    otherwise lead a write out of the container's root)."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            with suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


class PutBack:
    """What put_back_layer wrote into a new container's root, and how to take it back (a cold start that follows a
    failed restore gets the image's files as they were): new files are removed, replaced ones moved back."""

    def __init__(self) -> None:
        self.made: list[str] = []  # host paths of files that were not there
        self.replaced: list[tuple[str, str]] = []  # (host path, where the image's file was moved aside)

    def undo(self) -> None:
        for path in self.made:
            with suppress(OSError):
                os.unlink(path)
        for path, aside in self.replaced:
            with suppress(OSError):
                os.replace(aside, path)
        self.made, self.replaced = [], []

    def settle(self) -> None:
        """After a restore that succeeded: drop the image's files that were moved aside."""
        for _, aside in self.replaced:
            with suppress(OSError):
                os.unlink(aside)
        self.replaced = []


def put_back_layer(files_dir: Path | None, files: list[CapturedFile], rootfs: str,
                   done: PutBack | None = None) -> PutBack:
    """Write a capsule's writable-layer files into the new container's root (mounted at rootfs) before the restore.
    Records in `done` (also returned) what it wrote as it goes, so that a failure at any point can be undone."""
    done = PutBack() if done is None else done
    layer = [(i, f) for i, f in enumerate(files) if f.layer]
    if not layer:
        return done
    root_fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, f in layer:
            parts = [p for p in f.path.split("/") if p]
            if not parts or any(p in (".", "..") for p in parts):
                raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer file {f.path!r}: not a plain absolute path")
            dir_fd = _open_dir_in(root_fd, parts[:-1])
            try:
                _put_one(dir_fd, parts[-1], files_dir / str(i) if files_dir else None, f,
                         os.path.join(rootfs, *parts), done)
            finally:
                os.close(dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"the new container's root has a symlink where the capsule "
                                f"puts a file back ({e.filename}); not following it") from None
        raise
    finally:
        os.close(root_fd)
    return done


def _put_one(dir_fd: int, name: str, src: Path | None, f: CapturedFile, host_path: str, done: PutBack) -> None:
    tmp = f".{name}.coldsnap-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    os.close(fd)
    host_tmp = f"/proc/self/fd/{dir_fd}/{tmp}"
    try:
        if src is not None and src.exists():
            copy_sparse(src, host_tmp, f.size)
        else:
            os.truncate(host_tmp, f.size)
        os.chmod(host_tmp, f.mode)  # the file made above (O_EXCL, O_NOFOLLOW): not a link
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode):
                raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"the new container's root has a "
                                    f"{'symlink' if stat.S_ISLNK(st.st_mode) else 'directory'} at {f.path}, where "
                                    "the capsule puts a file back")
            aside = f".{name}.coldsnap-image-{os.getpid()}"
            os.replace(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            done.replaced.append((host_path, os.path.join(os.path.dirname(host_path), aside)))
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if st is None:
            done.made.append(host_path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
