"""State a process-mode workload keeps outside the CRIU images, carried in the capsule like its log file.

In process mode the engine's /dev/shm is the host's, and CRIU does not put the contents of files in it into the
images: shared mappings of a named file (vLLM's shm message queues psm_*, 160 + 240 MB, sparse) are dumped as
references to the file, and a file open under a name that was since unlinked while another link remains (glibc's
sem_open creates sem.XXXXXX, links it to sem.NAME and unlinks the temporary name) is dumped with --link-remap as a
hard link /dev/shm/link_remap.N that restore links back and then deletes. So a capsule restores once, on this
host, while those files happen to still be there; the second restore fails with
  Error (criu/files-reg.c:2258): Can't link dev/shm/link_remap.237 -> dev/shm/sem.8SOzZI: No such file or directory
and a restore after the shared memory changed (another run of the capsule) would see foreign queue contents.
These helpers let the flows carry those files in the capsule like the run dir's log file.

The same goes for the CUDA device code an engine moved into files at release (coldsnap.gpu.codestash): content-
addressed files that the restored processes map. A restore puts a missing one back after checking its bytes
against the digest in its name, and leaves one already there alone (same name, same bytes).
"""

from __future__ import annotations

import os
import stat
from contextlib import suppress
from pathlib import Path

from coldsnap.base.digests import sha256_file
from coldsnap.base.files import copy_sparse
from coldsnap.base.procfs import descendants
from coldsnap.contracts import CapturedFile, ColdSnapError, ErrorCode
from coldsnap.gpu import codestash

SHM_DIRS = ("/dev/shm/",)


def extra_files(images: Path) -> list[CapturedFile]:
    """Files outside the run dir that a restore of `images` needs back with their dump-time bytes: every regular
    file under /dev/shm the dumped tree held open or mapped, CRIU's link_remap.N links to such files, and the CUDA
    code files it maps (coldsnap.gpu.codestash). Call it right after the dump (the dumped tree is dead, so the files
    hold their dump-time bytes). Sizes are the files' real ones (CRIU records none for link_remap entries); files
    already gone are skipped (CRIU ghosted them)."""
    from coldsnap.criu import criu_images_open_files

    out: dict[str, CapturedFile] = {}
    for f in criu_images_open_files(images):
        path = f["path"]
        if not (path.startswith(SHM_DIRS) or codestash.is_code_file(path)) or path in out:
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[path] = CapturedFile(path=path, size=st.st_size, mode=stat.S_IMODE(st.st_mode))
    return sorted(out.values(), key=lambda f: f.path)


def put_back_file(src: str | os.PathLike | None, f: CapturedFile) -> None:
    """Put one captured file back at its path (atomically, sparse, dump-time size and mode). A CUDA code file is
    content-addressed: kept when already there at its size, otherwise checked against its name's digest."""
    if codestash.is_code_file(f.path):
        return _put_back_code_file(src, f)
    tmp = _tmp_beside(f.path)
    if src is not None and os.path.exists(src):
        copy_sparse(src, tmp, f.size)
    else:
        with open(tmp, "wb") as fo:
            fo.truncate(f.size)
    os.chmod(tmp, f.mode)
    os.replace(tmp, f.path)


def _tmp_beside(path: str) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return f"{path}.coldsnap-tmp{os.getpid()}"


def _put_back_code_file(src: str | os.PathLike | None, f: CapturedFile) -> None:
    with suppress(FileNotFoundError):
        if os.stat(f.path).st_size == f.size:
            return
    if src is None or not os.path.exists(src):
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"the capsule lacks the CUDA code file {f.path}")
    tmp = _tmp_beside(f.path)
    try:
        copy_sparse(src, tmp, f.size)
        named = codestash.NAME.match(os.path.basename(f.path))
        assert named is not None  # only code files (codestash.is_code_file) come here
        if sha256_file(Path(tmp))[0] != f"sha256:{named.group(1)}":
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"CUDA code file {f.path}: its bytes do not match "
                                "the digest in its name")
        os.chmod(tmp, 0o600)
        os.replace(tmp, f.path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def snapshot_file(src: str, f: CapturedFile, dest: Path) -> str:
    """Copy f's bytes (its recorded size) from src to dest, private: what a capture packs later. Returns dest."""
    put_back_file(src, f.model_copy(update={"path": str(dest), "mode": 0o600}))
    return str(dest)


def tree_shm_files(pid: int) -> list[str]:
    """/dev/shm files of the live tree rooted at pid: every name in /dev/shm whose inode the tree maps or holds open
    (so also a POSIX semaphore's real name when the tree maps it under glibc's deleted temporary name). Call before
    killing the tree, unlink after: a SIGKILLed engine leaves its queues and semaphores behind."""
    inodes: set[tuple[int, int] | None] = set()
    for p in [pid, *descendants(pid)]:
        with suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            for line in Path(f"/proc/{p}/maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(SHM_DIRS):
                    inodes.add(_inode(f"/proc/{p}/map_files/{parts[0]}"))
            for fd in Path(f"/proc/{p}/fd").iterdir():
                with suppress(OSError):
                    if os.readlink(fd).startswith(SHM_DIRS):
                        inodes.add(_inode(fd))
    inodes.discard(None)
    found = []
    for d in SHM_DIRS:
        with suppress(OSError):
            entries = list(os.scandir(d))
            found += [e.path for e in entries if _inode(e.path, follow_symlinks=False) in inodes]
    return sorted(found)


def _inode(path: str | os.PathLike, follow_symlinks: bool = True) -> tuple[int, int] | None:
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def remove_files(paths: list[str]) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)


def tree_socket_files(pid: int) -> list[str]:
    """Paths of the UNIX sockets the live tree rooted at pid has bound (ZMQ ipc:// endpoints of vLLM and SGLang,
    in $TMPDIR): a killed engine leaves the socket files behind. Call before killing the tree, unlink after (a
    restore binds them anew)."""
    inodes: set[str] = set()
    for p in [pid, *descendants(pid)]:
        with suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            for fd in Path(f"/proc/{p}/fd").iterdir():
                with suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    try:
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]  # the tree's network namespace
    except OSError:
        return []
    # Num RefCount Protocol Flags Type St Inode Path; abstract names start with "@" and are no files
    rows = [line.split() for line in lines]
    return sorted({r[7] for r in rows if len(r) >= 8 and r[6] in inodes and r[7].startswith("/")})


def remove_socket_files(paths: list[str]) -> None:
    for path in paths:
        with suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)


# --- a container's /dev/shm bound from the host ----------------------------------------------------------------------
# podman, docker and containerd give a container (or a pod) a /dev/shm of its own that is a bind mount of a host
# tmpfs, not a tmpfs in the container's spec: runc declares it external to CRIU, so CRIU stores none of its files'
# bytes, and the restored container gets the new container's empty /dev/shm (vLLM's queues missing:
# "Can't open file dev/shm/psm_… on restore"). The capture carries the files the dump refers to, as process mode
# carries the host's; the restore writes them into the new container's /dev/shm before CRIU runs.
CONTAINER_SHM = "/dev/shm/"


def bound_shm_source(spec: dict) -> str | None:
    """The host directory a container's /dev/shm is bound from, or None when /dev/shm is the container's own tmpfs
    (CRIU carries that one's contents itself) or not mounted. The last mount there is the one the container sees
    (ctr appends a user's /dev/shm after its own 64 MiB tmpfs)."""
    for m in reversed(spec.get("mounts") or []):
        if os.path.normpath(str(m.get("destination", ""))) == "/dev/shm":
            options = m.get("options") or []
            bound = m.get("type") == "bind" or "bind" in options or "rbind" in options
            return (str(m.get("source") or "") or None) if bound else None
    return None


class HeldShm:
    """The regular files of a bound /dev/shm, held open from before the dump: the container's engine dies with the
    dump and its engine (podman, docker) may unmount that tmpfs at once, but a held file keeps its bytes."""

    def __init__(self, source: str | None):
        self.source = source
        self.fds: dict[str, int] = {}
        self.dir_fd: int | None = None
        if not source:
            return
        try:
            # The directory itself too: the engine may detach the tmpfs as soon as the container is gone (docker
            # with --rm), and files CRIU makes during the dump (link_remap.N) are then only reachable through it.
            self.dir_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            entries = list(os.scandir(source))
        except OSError:
            return
        for e in entries:
            try:
                fd = _open_held(e.path)
            except OSError:
                continue
            if stat.S_ISREG(os.fstat(fd).st_mode):
                self.fds[e.name] = fd
            else:
                os.close(fd)

    def captured(self, images: Path) -> tuple[list[CapturedFile], dict[str, str]]:
        """The files the dump refers to under /dev/shm (as container paths) and where to read each one's bytes;
        a file created during the dump (CRIU's link_remap.N) is opened now, at the host path."""
        from coldsnap.criu import criu_images_open_files

        if not self.source:
            return [], {}
        files, sources = [], {}
        for f in criu_images_open_files(images):
            path = f["path"]
            name = path[len(CONTAINER_SHM):]
            if not path.startswith(CONTAINER_SHM) or "/" in name or path in sources:
                continue
            if name not in self.fds:
                try:
                    self.fds[name] = (os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
                                      if self.dir_fd is not None else _open_held(os.path.join(self.source, name)))
                except OSError:
                    continue  # gone: CRIU ghosted it into the images
            st = os.fstat(self.fds[name])
            if stat.S_ISREG(st.st_mode):
                files.append(CapturedFile(path=path, size=st.st_size, mode=stat.S_IMODE(st.st_mode)))
                sources[path] = f"/proc/self/fd/{self.fds[name]}"
        return sorted(files, key=lambda f: f.path), sources

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None


def _open_held(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)


def put_back_container_shm(files_dir: Path | None, files: list[CapturedFile], spec: dict) -> list[str]:
    """Write a capsule's /dev/shm files into the new container's bound /dev/shm (its spec's bind source) before
    the restore. Returns the host paths written (for removal if the restore fails). Nothing to do when the
    capsule has none; when the new container's /dev/shm is not bound, the restore will say what is missing."""
    shm = [(i, f) for i, f in enumerate(files) if f.path.startswith(CONTAINER_SHM)]
    source = bound_shm_source(spec)
    if not shm or not source:
        return []
    written = []
    for i, f in shm:
        host = os.path.join(source, f.path[len(CONTAINER_SHM):])
        put_back_file(files_dir / str(i) if files_dir else None, f.model_copy(update={"path": host}))
        written.append(host)
    return written
