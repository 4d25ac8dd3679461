"""Layers as tar + zstd, streamed (never a whole layer in memory).

A layer is a series of independent zstd frames, each holding FRAME bytes of the tar stream (its size in its
header): any zstd reader reads it as one stream, and unpack_layer decompresses its frames on several cores at
once, found by walking their block headers. A first restore on a node waits for that unpack; one frame
decompresses at about 1 GB/s on one core.

A directory may also be packed as several layers of about equal bytes (pack_parts), which a pull fetches, checks
and unpacks side by side (unpack_layers): a file too big for one layer is cut across them, each part a member of
its own named as the file, with its offset and the whole file's size as PAX keywords (PART_OFFSET, PART_SIZE)."""

from __future__ import annotations

import io
import os
import tarfile
import threading
from collections import defaultdict, deque
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
PART_OFFSET = "COLDSNAP.part.offset"  # PAX keywords of a member that is a part of a file cut across layers
PART_SIZE = "COLDSNAP.part.size"


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
    _write_layer(dest, [(e, 0, None) for e in sorted(e for e in src.iterdir() if e.name not in skip)], level)


def pack_parts(src: Path, dest: Path, count: int, level: int = 1, skip: tuple[str, ...] = ()) -> list[Path]:
    """src's contents as up to `count` layers of about equal bytes (dest/0.tar.zst, …), for a pull to fetch, check
    and unpack side by side: src's entries in name order, a regular file cut where a layer is full (at a whole
    CHUNK of the file: its parts are written, and their runs of zeros found, a whole CHUNK at a time). Returns the
    layers written, in order."""
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    plan = _plan(sorted(e for e in src.iterdir() if e.name not in skip), max(1, count))
    layers = [dest / f"{i}.tar.zst" for i in range(len(plan))]
    for layer, members in zip(layers, plan):
        _write_layer(layer, members, level)
    return layers


Member = tuple[Path, int, "int | None"]  # (entry, offset, part length; None: the entry whole)


def _plan(entries: list[Path], count: int) -> list[list[Member]]:
    """The members of each layer: the regular files' bytes, one after another, cut into `count` shares; other
    entries (directories) whole, in the layer their place falls in. Layers left empty are dropped."""
    sizes = [e.stat().st_size if e.is_file() and not e.is_symlink() else None for e in entries]
    total = sum(size or 0 for size in sizes)
    share = max(CHUNK, -(-total // count // CHUNK) * CHUNK)  # whole CHUNKs
    plan: list[list[Member]] = [[] for _ in range(count)]
    at = 0  # where the next file's bytes begin in the run of all of them
    for entry, size in zip(entries, sizes):
        if size is None:
            plan[min(at // share, count - 1)].append((entry, 0, None))
            continue
        offset = 0
        while True:
            layer = min((at + offset) // share, count - 1)
            cut = -(-((layer + 1) * share - at) // CHUNK) * CHUNK  # the layer's end, at a whole CHUNK of the file
            end = size if layer == count - 1 else min(size, cut)
            whole = offset == 0 and end == size
            plan[layer].append((entry, offset, None if whole else end - offset))
            offset = end
            if offset >= size:
                break
        at += size
    return [members for members in plan if members]


def _write_layer(dest: Path, members: list[Member], level: int) -> None:
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as raw:
        framed = _FramedWriter(raw, level)
        try:
            # whole MiBs handed on (tarfile's 10 KiB records cost more than the compression); copybufsize is
            # TarFile's, missing from typeshed's open()
            opened = tarfile.open(fileobj=framed, mode="w|", format=tarfile.PAX_FORMAT,  # type: ignore[call-overload]
                                  bufsize=CHUNK, copybufsize=CHUNK)
            with opened as tar:
                for entry, offset, length in members:
                    if length is None:
                        tar.add(entry, arcname=entry.name)
                        continue
                    info = tar.gettarinfo(entry, arcname=entry.name)
                    info.pax_headers = {PART_OFFSET: str(offset), PART_SIZE: str(info.size)}
                    info.size = length
                    with open(entry, "rb") as f:
                        f.seek(offset)
                        tar.addfile(info, f)  # reads exactly info.size bytes
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

    def __init__(self, fd: int, frames: Iterable[tuple[int, int, int]], workers: int):
        self.pool = ThreadPoolExecutor(workers)
        self.todo: Iterator[tuple[int, int, int]] = iter(frames)
        self.ahead: deque[Future[bytes]] = deque()
        self.fd, self.frame, self.at = fd, memoryview(b""), 0
        for _ in range(2 * workers):
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

    def take(self, n: int) -> memoryview:
        """Up to n next bytes of the stream, as they lie in their decompressed frame (nothing copied: the unpack
        writes them from there, holding the GIL less); empty at its end."""
        while self.at >= len(self.frame):
            if not self.ahead:
                return memoryview(b"")
            self.frame, self.at = memoryview(self.ahead.popleft().result()), 0
            self._submit()
        taken = self.frame[self.at:self.at + n]
        self.at += len(taken)
        return taken

    def readinto(self, b) -> int:  # type: ignore[override]
        taken = self.take(len(b))
        b[:len(taken)] = taken
        return len(taken)

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


def _decompressed(raw, following: Growing | None, workers: int) -> io.RawIOBase:
    """The layer's tar stream: its frames on several cores when they can be, else one stream (across frames);
    following: frame by frame as the file arrives."""
    if following is not None:
        return _FrameStream(raw.fileno(), _following(raw.fileno(), following), workers)
    frames = _frames(raw.fileno(), os.fstat(raw.fileno()).st_size)
    if frames is not None and len(frames) > 1:
        return _FrameStream(raw.fileno(), frames, workers)
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

    def take(self, n: int, buf: memoryview) -> memoryview:
        """Up to n next bytes: where the frames lie when they can (_FrameStream.take), else read into buf."""
        taken = self.raw.take(n) if isinstance(self.raw, _FrameStream) else buf[:self.raw.readinto(buf[:n])]
        self.pos += len(taken)
        return taken

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


Placed = tuple[str, int, int, "int | None"]  # (file, offset, bytes, the whole file's size for a part; None: whole)


def unpack_layers(layers: list[Path], dest: Path, following: list[Growing] | None = None) -> int:
    """Layers into one directory side by side, each on a thread of its own (pack_parts' layers, or one), the files
    cut across them put together; returns the bytes taken on disk. Refused (CAPSULE_CORRUPT) unless the parts of
    every cut file add up to it exactly, each file named once otherwise. following: each layer's file still
    arriving, as unpack_layer's; the first layer to fail stops the others."""
    placed: list[Placed] = []
    stop = threading.Event()
    workers = max(2, min(8, (os.cpu_count() or 1) // max(1, len(layers))))

    def one(i: int) -> int:
        try:
            return unpack_layer(layers[i], dest, following[i] if following else None, placed=placed,
                                stop=stop, workers=workers)
        except BaseException:
            stop.set()
            raise

    if len(layers) == 1:
        written = one(0)
    else:
        with ThreadPoolExecutor(len(layers), thread_name_prefix="coldsnap-unpack") as pool:
            futures = [pool.submit(one, i) for i in range(len(layers))]
            errors = [e for f in futures if (e := f.exception()) is not None]
            stopped = [e for e in errors if not isinstance(e, _Stopped)]
            if errors:
                raise (stopped or errors)[0]
            written = sum(f.result() for f in futures)
    _check_placed(placed)
    return written


def _check_placed(placed: list[Placed]) -> None:
    """Each file named once, or its parts covering it exactly, end to end, all of one size."""
    by_name: dict[str, list[Placed]] = defaultdict(list)
    for item in placed:
        by_name[item[0]].append(item)
    for name, items in by_name.items():
        wholes = {whole for _, _, _, whole in items}
        if len(items) == 1 and wholes == {None}:
            continue
        if None in wholes or len(wholes) != 1:
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layers name {short(name)} more than once")
        at = 0
        for _, offset, length, _ in sorted(items, key=lambda item: item[1]):
            if offset != at:
                raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"the parts of {short(name)} do not fit together "
                                    f"(at byte {at}: a part from byte {offset})")
            at += length
        if at != wholes.pop():
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"the parts of {short(name)} end at byte {at}, short of "
                                "its size")


class _Stopped(Exception):
    """Another layer of the same unpack failed: this one stops too."""


def _part(member: tarfile.TarInfo) -> tuple[int, int] | None:
    """(offset, whole file's size) of a member that is a part of a file cut across layers; None: a whole file."""
    if PART_OFFSET not in member.pax_headers and PART_SIZE not in member.pax_headers:
        return None
    try:
        offset, whole = int(member.pax_headers[PART_OFFSET]), int(member.pax_headers[PART_SIZE])
    except (KeyError, ValueError):
        offset = whole = -1
    if not 0 <= offset <= offset + member.size <= whole <= MAX_FILE:
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member {short(member.name)} is a part that does not "
                            "fit its file: refused")
    return offset, whole


def unpack_layer(layer: Path, dest: Path, following: Growing | None = None, *, placed: list[Placed] | None = None,
                 stop: threading.Event | None = None, workers: int | None = None) -> int:
    """Extract a tar.zst layer into dest; returns the bytes it took on disk. Only regular files and directories, each
    inside dest (no absolute paths, no `..`, no links, no devices). Runs of zeros become holes (a layer's /dev/shm
    queues are mostly holes; so is a bomb of zeros), and the data written may not exceed MAX_RATIO times the layer's
    size nor dest's free space. Anything else: ColdSnapError(CAPSULE_CORRUPT), one line; what was written stays
    under dest for the caller to remove. A file's bytes go from the decompressor into one buffer and from there to
    the file (a first restore on a node waits for this: tarfile's own reads copy each byte several times).
    following: the layer's file is still arriving (coldsnap.capsule.growing): read as it does, raising
    StopFollowing when it will not come whole that way; its digest is not yet checked, so dest is the caller's to
    publish only once it is. A part of a file cut across layers is written at its offset into a file of its whole
    size; placed: where each file and part went, for unpack_layers to check that they fit together (only it
    unpacks layers with parts). stop: set by another layer's failure (raises _Stopped)."""
    if following is not None and following.wait_started(timeout=120.0) is None:
        raise StopFollowing("the layer's stream did not start from its first byte")
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.statvfs(dest)
    size = following.size if following is not None else os.path.getsize(layer)
    budget = min(MAX_RATIO * size + SLACK, st.f_bavail * st.f_frsize)
    written = 0
    zeros = bytes(CHUNK)
    view = memoryview(bytearray(CHUNK))
    try:
        with open(layer, "rb") as raw, _decompressed(raw, following, workers or _workers()) as zr:
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
                part = _part(member)
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                source.seek(member.offset_data)
                flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if part else os.O_EXCL)
                fd = os.open(target, flags, 0o600)
                try:
                    at = 0
                    if part is not None:
                        at, whole = part
                        if os.fstat(fd).st_size > whole:
                            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"the parts of {short(member.name)} "
                                                "disagree on its size")
                        os.ftruncate(fd, whole)  # a part of any layer may come first: all of them see one size
                    if placed is not None:
                        placed.append((str(target), at, member.size, part[1] if part else None))
                    left = member.size
                    while left:
                        if stop is not None and stop.is_set():
                            raise _Stopped()
                        out = source.take(min(CHUNK, left), view)
                        n = len(out)
                        if not n:
                            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member {short(member.name)} is "
                                                "truncated")
                        left -= n
                        if zeros.startswith(out):  # all zeros (a memcmp; comparing a memoryview goes byte by byte)
                            at += n  # a hole
                            continue
                        written += n
                        if written > budget:
                            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer {layer.name[:19]}… expands "
                                                f"beyond {budget} bytes of data (at {short(member.name)}): refused")
                        while out:
                            wrote = os.pwrite(fd, out, at)
                            out, at = out[wrote:], at + wrote
                    if part is None:
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
