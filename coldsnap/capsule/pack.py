"""Layers as tar + zstd, streamed (never a whole layer in memory).

A layer is a series of independent zstd frames, each holding FRAME bytes of the tar stream (its size in its
header): any zstd reader reads it as one stream, and unpack_layer decompresses its frames on several cores at
once, found by walking their block headers. A first restore on a node waits for that unpack; one frame
decompresses at about 1 GB/s on one core."""

from __future__ import annotations

import io
import os
import tarfile
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator

import zstandard

from coldsnap.capsule.growing import Growing, StopFollowing
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.contracts.parse import short

FRAME = 16 << 20  # of the tar stream per frame: enough to compress well, small enough to spread over cores
FRAME_MAX = 64 << 20  # a frame claiming more is decompressed as a stream (never a buffer of its claimed size)
MAX_RATIO = 1000  # zeros become holes; a layer whose other bytes expand more than this is a bomb
MAX_FILE = 1 << 40  # no file of a capsule is a terabyte
SLACK = 64 << 20
CHUNK = 1 << 20


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class _FramedWriter(io.RawIOBase):
    """What tarfile writes into: each FRAME bytes compressed as a frame of its own, several at once, written in
    order (at most 2 x workers frames in memory)."""

    def __init__(self, raw, level: int):
        self.raw, self.level = raw, level
        self.parts: list[bytes] = []
        self.size = 0
        self.local = threading.local()  # a compressor per thread: one is not safe to share
        self.pool = ThreadPoolExecutor(_workers())
        self.pending: deque[Future[bytes]] = deque()

    def _compress(self, data: bytes) -> bytes:
        if not hasattr(self.local, "cctx"):
            self.local.cctx = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
        return self.local.cctx.compress(data)

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        self.parts.append(bytes(data))
        self.size += len(data)
        if self.size >= FRAME:  # joined once per frame
            joined = b"".join(self.parts)
            for start in range(0, len(joined) - FRAME + 1, FRAME):
                self._frame(joined[start:start + FRAME])
            rest = joined[len(joined) - len(joined) % FRAME:]
            self.parts, self.size = [rest] if rest else [], len(rest)
        return len(data)

    def _frame(self, data: bytes) -> None:
        self.pending.append(self.pool.submit(self._compress, data))
        while len(self.pending) > 2 * _workers():
            self.raw.write(self.pending.popleft().result())

    def finish(self) -> None:
        if self.size:
            self._frame(b"".join(self.parts))
            self.parts, self.size = [], 0
        while self.pending:
            self.raw.write(self.pending.popleft().result())
        self.pool.shutdown()


def pack_dir(src: Path, dest: Path, level: int = 1, skip: tuple[str, ...] = ()) -> None:
    """tar.zst of src's contents, in frames of FRAME bytes; level 1 because restore latency, not capsule size, is
    what users wait on."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as raw:
        framed = _FramedWriter(raw, level)
        try:
            # whole MiBs handed on (tarfile's 10 KiB records cost more than the compression); copybufsize is
            # TarFile's, missing from typeshed's open()
            opened = tarfile.open(fileobj=framed, mode="w|", format=tarfile.PAX_FORMAT,  # type: ignore[call-overload]
                                  bufsize=CHUNK, copybufsize=CHUNK)
            with opened as tar:
                for entry in sorted(e for e in src.iterdir() if e.name not in skip):
                    tar.add(entry, arcname=entry.name)
            framed.finish()
        finally:
            framed.pool.shutdown(cancel_futures=True)


def _frames(fd: int, size: int) -> list[tuple[int, int, int]] | None:
    """(offset, compressed bytes, content bytes) of each zstd frame of the file, found by walking the block headers
    (nothing decompressed); None when they cannot be decompressed one by one: a frame without its content size
    or claiming more than FRAME_MAX, a skippable or unknown frame, or a layout that does not add up (the stream
    reader then reads it, and says what is wrong)."""
    try:
        return list(_walk_frames(fd, size))
    except _NotFramed:
        return None


class _NotFramed(Exception):
    pass


def _walk_frames(fd: int, size: int, wait: Callable[[int], None] = lambda n: None
                 ) -> Iterator[tuple[int, int, int]]:
    """_frames one by one; wait(n) returns once the file's first n bytes are there (a file still arriving)."""
    at = 0
    walk = size // 1024 + 4096  # a compressor's blocks hold up to 128 KiB: far more headers is not one of ours
    while at < size:
        wait(min(at + 18, size))
        head = os.pread(fd, 18, at)
        try:
            params = zstandard.get_frame_parameters(head)
            pos = at + zstandard.frame_header_size(head)
        except zstandard.ZstdError:
            raise _NotFramed() from None
        content = params.content_size
        if content in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) or content > FRAME_MAX:
            raise _NotFramed()
        while True:  # blocks: a 3-byte header (last flag, type, size); an RLE block stores one byte
            walk -= 1
            wait(min(pos + 3, size))
            block = os.pread(fd, 3, pos)
            if len(block) < 3 or walk < 0:
                raise _NotFramed()
            word = int.from_bytes(block, "little")
            kind, length = (word >> 1) & 3, word >> 3
            if kind == 3:
                raise _NotFramed()
            pos += 3 + (1 if kind == 1 else length)
            if word & 1:
                break
        pos += 4 if params.has_checksum else 0
        if pos > size:
            raise _NotFramed()
        wait(pos)
        yield at, pos - at, content
        at = pos


def _following(fd: int, growing: Growing) -> Iterator[tuple[int, int, int]]:
    """The frames of a file still arriving, each once its bytes are in; StopFollowing when it is not ours."""
    try:
        yield from _walk_frames(fd, growing.size, growing.wait_for)
    except _NotFramed:
        raise StopFollowing("the layer is not in frames that decompress one by one") from None


class _FrameStream(io.RawIOBase):
    """A layer's frames decompressed on several cores, read in order (at most 2 x workers frames ahead)."""

    def __init__(self, fd: int, frames: Iterable[tuple[int, int, int]]):
        self.pool = ThreadPoolExecutor(_workers())
        self.todo: Iterator[tuple[int, int, int]] = iter(frames)
        self.ahead: deque[Future[bytes]] = deque()
        self.fd, self.view, self.at = fd, memoryview(b""), 0
        for _ in range(2 * _workers()):
            self._submit()

    def _submit(self) -> None:
        frame = next(self.todo, None)
        if frame is not None:
            self.ahead.append(self.pool.submit(self._decompress, *frame))

    def _decompress(self, offset: int, length: int, content: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=content)
        if len(out) != content:
            raise zstandard.ZstdError(f"a frame at byte {offset} holds {len(out)} bytes, not {content}")
        return out

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        while self.at >= len(self.view):
            if not self.ahead:
                return 0
            self.view, self.at = memoryview(self.ahead.popleft().result()), 0
            self._submit()
        n = min(len(b), len(self.view) - self.at)
        b[:n] = self.view[self.at:self.at + n]
        self.at += n
        return n

    def read(self, n: int | None = -1) -> bytes:
        buf = bytearray(CHUNK if n is None or n < 0 else n)
        got = self.readinto(buf)
        return bytes(buf[:got])

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)
        super().close()


def _member_path(dest: Path, name: str) -> Path:
    """Where a member goes: a relative path of plain components inside dest, or ColdSnapError."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or "\0" in name or ".." in parts:
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member escapes its directory: {short(name)}")
    if not parts:
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member names no file: {short(name)}")
    return dest.joinpath(*parts)


def _decompressed(raw, following: Growing | None = None) -> io.RawIOBase:
    """The layer's tar stream: its frames on several cores when they can be, else one stream (across frames);
    following: frame by frame as the file arrives."""
    if following is not None:
        return _FrameStream(raw.fileno(), _following(raw.fileno(), following))
    frames = _frames(raw.fileno(), os.fstat(raw.fileno()).st_size)
    if frames is not None and len(frames) > 1:
        return _FrameStream(raw.fileno(), frames)
    return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)  # type: ignore[return-value]


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


def unpack_layer(layer: Path, dest: Path, following: Growing | None = None) -> int:
    """Extract a tar.zst layer into dest; returns the bytes it took on disk. Only regular files and directories, each
    inside dest (no absolute paths, no `..`, no links, no devices). Runs of zeros become holes (a layer's /dev/shm
    queues are mostly holes; so is a bomb of zeros), and the data written may not exceed MAX_RATIO times the layer's
    size nor dest's free space. Anything else: ColdSnapError(CAPSULE_CORRUPT), one line; what was written stays
    under dest for the caller to remove. A file's bytes go from the decompressor into one buffer and from there to
    the file (a first restore on a node waits for this: tarfile's own reads copy each byte several times).
    following: the layer's file is still arriving (coldsnap.capsule.growing): read as it does, raising
    StopFollowing when it will not come whole that way; its digest is not yet checked, so dest is the caller's to
    publish only once it is."""
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.statvfs(dest)
    size = following.size if following is not None else os.path.getsize(layer)
    budget = min(MAX_RATIO * size + SLACK, st.f_bavail * st.f_frsize)
    written = 0
    zeros = bytes(CHUNK)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        with open(layer, "rb") as raw, _decompressed(raw, following) as zr:
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
