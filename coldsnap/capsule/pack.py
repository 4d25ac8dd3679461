"""Layers as tar + zstd, streamed (never a whole layer in memory)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import zstandard

from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.contracts.parse import short


def pack_dir(src: Path, dest: Path, level: int = 1, skip: tuple[str, ...] = ()) -> None:
    """tar.zst of src's contents; level 1 because restore latency, not capsule size, is what users wait on."""
    cctx = zstandard.ZstdCompressor(level=level, threads=-1)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as raw, cctx.stream_writer(raw, closefd=False) as zw:
        with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for entry in sorted(e for e in src.iterdir() if e.name not in skip):
                tar.add(entry, arcname=entry.name)


MAX_RATIO = 1000  # zeros become holes; a layer whose other bytes expand more than this is a bomb
MAX_FILE = 1 << 40  # no file of a capsule is a terabyte
SLACK = 64 << 20
CHUNK = 1 << 20


def _member_path(dest: Path, name: str) -> Path:
    """Where a member goes: a relative path of plain components inside dest, or ColdSnapError."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or "\0" in name or ".." in parts:
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member escapes its directory: {short(name)}")
    if not parts:
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member names no file: {short(name)}")
    return dest.joinpath(*parts)


class _ForwardReader(io.RawIOBase):
    """A decompressing stream as the seekable file tarfile's random-access mode ("r:") reads, for a reader that only
    ever goes forward: tarfile's stream mode ("r|") pulls data through Python in 10 KiB records, several times slower
    than the decompression itself. A backward seek is refused (tarfile never asks for one reading in order)."""

    def __init__(self, raw):
        self.raw, self.pos = raw, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:  # type: ignore[override]
        n = self.raw.readinto(b)
        self.pos += n
        return n

    def read(self, n: int | None = -1) -> bytes:
        data = self.raw.read(-1 if n is None else n)
        self.pos += len(data)
        return data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self.pos
        if whence not in (os.SEEK_SET, os.SEEK_CUR) or offset < self.pos:
            raise io.UnsupportedOperation("a layer is read forward only")
        while self.pos < offset and (skipped := len(self.raw.read(min(offset - self.pos, CHUNK)))):
            self.pos += skipped
        return self.pos


def unpack_layer(layer: Path, dest: Path) -> int:
    """Extract a tar.zst layer into dest; returns the bytes it took on disk. Only regular files and directories, each
    inside dest (no absolute paths, no `..`, no links, no devices). Runs of zeros become holes (a layer's /dev/shm
    queues are mostly holes; so is a bomb of zeros), and the data written may not exceed MAX_RATIO times the layer's
    size nor dest's free space. Anything else: ColdSnapError(CAPSULE_CORRUPT), one line; what was written stays
    under dest for the caller to remove. A file's bytes go from the decompressor into one buffer and from there to
    the file (a first restore on a node waits for this: tarfile's own reads copy each byte several times)."""
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.statvfs(dest)
    budget = min(MAX_RATIO * os.path.getsize(layer) + SLACK, st.f_bavail * st.f_frsize)
    written = 0
    zeros = bytes(CHUNK)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    dctx = zstandard.ZstdDecompressor()
    try:
        with open(layer, "rb") as raw, dctx.stream_reader(raw) as zr:
            source = _ForwardReader(zr)
            tar = tarfile.open(fileobj=source, mode="r:")  # type: ignore[call-overload]
            for member in tar:
                target = _member_path(dest, member.name)
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True, mode=0o700)
                    continue
                if not member.isfile() or member.sparse is not None:
                    raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member {short(member.name)} is not a "
                                        "regular file or a directory")
                if member.size > MAX_FILE:
                    raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member {short(member.name)} claims "
                                        f"{member.size} bytes: refused")
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                source.seek(member.offset_data)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    left = member.size
                    while left:
                        n = source.readinto(view[:min(CHUNK, left)])
                        if not n:
                            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member {short(member.name)} is "
                                                "truncated")
                        left -= n
                        if (buf if n == CHUNK else view[:n].tobytes()) == zeros[:n]:
                            os.lseek(fd, n, os.SEEK_CUR)  # a hole
                            continue
                        written += n
                        if written > budget:
                            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer {layer.name[:19]}… expands "
                                                f"beyond {budget} bytes of data (at {short(member.name)}): refused")
                        out = view[:n]
                        while out:
                            out = out[os.write(fd, out):]
                    os.ftruncate(fd, member.size)  # trailing holes
                finally:
                    os.close(fd)
    except FileExistsError as e:
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer names {short(e.filename)} twice") from None
    except (tarfile.TarError, zstandard.ZstdError, EOFError, io.UnsupportedOperation) as e:
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer {layer.name[:19]}… is not a tar+zstd layer: "
                            f"{short(str(e), 120)}") from None
    except (NotADirectoryError, IsADirectoryError) as e:
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member {short(e.filename)} clashes with another") \
            from None
    return written
