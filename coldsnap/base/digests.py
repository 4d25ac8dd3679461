"""SHA-256 (and the pieces' blake3) of files, and of files already checked: the one place ColdSnap hashes what it
verifies.

Hashing a capsule's layers (hundreds of MB) or a weights file (GBs) takes from a tenth of a second to many seconds,
and a restore checks them every time. `checked_sha256` remembers a digest together with the file's version: device,
inode, size, mtime and ctime. Any write to the file moves its ctime, and no system call sets a ctime back, so a file
changed after its check is hashed again before use. A file changed within a second before its check is not
remembered: timestamps advance by clock ticks, so a second change in the same tick could leave the same ctime (git's
"racily clean" index entries, the same answer). (Not caught: a write to the disk underneath the file system. The
store is as safe as the disk that holds it.) The memo lives in $COLDSNAP_HOME/digests.json, mode 0600."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from coldsnap.base.files import atomic_write
from coldsnap.base.paths import settings
from coldsnap.base.procfs import boot_id

CHUNK = 8 << 20
SETTLED_NS = 1_000_000_000  # a file changed less than this before its check is hashed again next time


def sha256_file(path: str | os.PathLike) -> tuple[str, int]:
    """("sha256:HEX", size) of the file's bytes, read now."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size


def _version(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _memo_path() -> Path:
    return settings().home / "digests.json"


def _read_memo() -> dict:
    try:
        memo = json.loads(_memo_path().read_text())
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember(key: str, before: os.stat_result, started_ns: int | None, **facts) -> None:
    """Add facts about the file at `before`'s version to the memo, unless it changed while we read it or too
    recently to tell a later change by its ctime (started_ns None: only this process wrote it; see remember_hashed)."""
    if _version(os.stat(key)) != _version(before):
        return
    if started_ns is not None and started_ns - before.st_ctime_ns < SETTLED_NS:
        return
    memo = {p: e for p, e in _read_memo().items() if os.path.exists(p)}  # forget files that are gone
    entry = {**_memo_entry(key, before, memo), "version": _version(before), **facts}
    memo[key] = {k: v for k, v in entry.items() if v is not None}  # a fact given as None is forgotten
    with suppress(OSError):  # no memo: the next check hashes again
        atomic_write(_memo_path(), json.dumps(memo).encode())


def remember_hashed(path: str | os.PathLike, digest: str, durable: bool = True, **facts) -> None:
    """Record the digest (and facts such as chunk pins) of a file whose bytes ColdSnap hashed as it wrote them (a
    pull streams, hashes and writes a blob in one pass) or linked from such a file, so that its first use does not
    read it again. Recorded at the file's version now, after the writes and the rename or link (which move its
    ctime); the settling rule is waived because nothing but this process wrote the file, under the blob's lock,
    in a 0700 store: any later write moves its ctime past the one recorded here.
    durable False: its bytes are not fsynced yet (a restore's pull leaves the disk to the restore until its first
    token): trusted in this boot only, since a power loss can keep a file's size and times but not its bytes;
    remembered again, durable, once they are."""
    key = os.path.abspath(os.fspath(path))
    _remember(key, os.stat(key), None, sha256=digest, boot=None if durable else boot_id(), **facts)


def remember_pieces(path: str | os.PathLike, chunks: list[str], chunk_bytes: int, algorithm: str = "sha256") -> None:
    """Record that the file's pieces hash to `chunks` (by `algorithm`), for a file ColdSnap wrote piece by piece,
    checking each against its pin as it arrived (coldsnap.capsule.pieces): its whole-file digest was never
    computed, so none is recorded. Same rules as remember_hashed."""
    key = os.path.abspath(os.fspath(path))
    _remember(key, os.stat(key), None, chunks=chunks, chunk_bytes=chunk_bytes, chunk_digest=algorithm)


def known_by_pieces_only(path: str | os.PathLike) -> bool:
    """Whether the file, as it is now, was checked only piece by piece (remember_pieces), never as a whole."""
    key = os.path.abspath(os.fspath(path))
    entry = _memo_entry(key, os.stat(key))
    return "chunks" in entry and "sha256" not in entry


def _memo_entry(key: str, before: os.stat_result, memo: dict | None = None) -> dict:
    """The memo's entry for the file at `before`'s version; {} for none, for one of another version, or for one
    recorded before its bytes were durable in a boot that is over."""
    entry = (_read_memo() if memo is None else memo).get(key)
    if not isinstance(entry, dict) or entry.get("version") != _version(before):
        return {}
    return {} if entry.get("boot", boot_id()) != boot_id() else entry  # not durable then, and that boot is over


def checked_sha256(path: str | os.PathLike) -> tuple[str, int]:
    """sha256_file, hashing only when the file is new to the memo or changed since it was last hashed."""
    key = os.path.abspath(os.fspath(path))
    before = os.stat(key)
    entry = _memo_entry(key, before)
    if "sha256" in entry:
        return entry["sha256"], before.st_size
    started_ns = time.time_ns()
    digest, size = sha256_file(key)
    _remember(key, before, started_ns, sha256=digest)
    return digest, size


# --- chunks: weights verified at the speed of the storage ---------------------------------------------------------
# One sha256 stream runs at about 1 GB/s; a 31 GB weights file takes half a minute. A capsule therefore also pins
# each CHUNK_BYTES piece of a large weights file by its own digest (in its digest-verified profile), and a restore
# checks the pieces on every core at once. The pieces' hash is blake3 (a capture's default: about 5 GB/s a core
# against sha256's 1.2 on the GPU machine, where a streamed pull's every byte is hashed on the cores CRIU, the
# registry and the prefetchers share) or sha256 (capsules pinned before, or COLDSNAP_PIN_PIECE_HASH=sha256); the
# blob's own OCI digest stays sha256 either way.
CHUNK_BYTES = 256 << 20
PIECE_HASHES = ("sha256", "blake3")


def piece_hasher(algorithm: str):
    """A new hash object of a pieces' algorithm (PIECE_HASHES): update(), hexdigest()."""
    if algorithm == "blake3":
        import blake3

        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown piece hash {algorithm!r} (known: {', '.join(PIECE_HASHES)})")


def pin_piece_bytes() -> int:
    """The pieces a large weights file is pinned by: CHUNK_BYTES, or COLDSNAP_PIN_PIECE_MIB (at least 1) MiB.
    Smaller pieces let a small model's pull go piece by piece too, at the cost of more pins in its profile."""
    from coldsnap.base.paths import settings

    raw = settings().pin_piece_mib
    try:
        mib = int(raw)
    except ValueError:
        raise ValueError(f"COLDSNAP_PIN_PIECE_MIB must be a whole number of MiB, not {raw!r}") from None
    return max(1, mib) << 20


def pin_piece_hash() -> str:
    """The hash a capture pins pieces by: COLDSNAP_PIN_PIECE_HASH, blake3 unless it says sha256."""
    from coldsnap.base.paths import settings

    algorithm = settings().pin_piece_hash
    if algorithm not in PIECE_HASHES:
        raise ValueError(f"COLDSNAP_PIN_PIECE_HASH must be one of {', '.join(PIECE_HASHES)}, not {algorithm!r}")
    return algorithm


def chunk_digest(fd: int, offset: int, length: int, algorithm: str = "sha256") -> str:
    h = piece_hasher(algorithm)
    done = 0
    while done < length:
        data = os.pread(fd, min(CHUNK, length - done), offset + done)  # both release the GIL: threads run in parallel
        if not data:
            break
        h.update(data)
        done += len(data)
    return h.hexdigest()


def chunk_digests(path: str | os.PathLike, chunk_bytes: int = CHUNK_BYTES, algorithm: str = "sha256") -> list[str]:
    """The digest (hex, by `algorithm`) of each chunk_bytes piece of the file, in order, hashed by a thread per
    core."""
    from concurrent.futures import ThreadPoolExecutor

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        offsets = range(0, size, chunk_bytes)
        with ThreadPoolExecutor(max(1, min(32, os.cpu_count() or 1))) as pool:
            return list(pool.map(lambda o: chunk_digest(fd, o, min(chunk_bytes, size - o), algorithm), offsets))
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Pinned:
    """What a weights file is pinned by: its whole sha256 (hex), and its pieces' digests ([] for a file of one
    piece or less), their size and their hash."""
    sha256: str
    chunks: list[str]
    chunk_bytes: int | None
    chunk_digest: str

    def fields(self) -> dict:
        """As WeightFile's fields (sha256, chunks, chunk_bytes, chunk_digest)."""
        return {"sha256": self.sha256, "chunks": self.chunks, "chunk_bytes": self.chunk_bytes,
                "chunk_digest": self.chunk_digest}


def pinned_digests(path: str | os.PathLike, chunk_bytes: int | None = None, algorithm: str | None = None) -> Pinned:
    """How to pin a weights file: its whole sha256, and its chunks (default: pin_piece_bytes(), by
    pin_piece_hash()) hashed beside the whole-file stream, so they cost no time of their own."""
    from concurrent.futures import ThreadPoolExecutor

    chunk_bytes = chunk_bytes or pin_piece_bytes()
    algorithm = algorithm or pin_piece_hash()
    key = os.path.abspath(os.fspath(path))
    before = os.stat(key)
    entry = _memo_entry(key, before)
    if before.st_size <= chunk_bytes:
        return Pinned(checked_sha256(key)[0].removeprefix("sha256:"), [], None, "sha256")  # no pieces: the default
    if "sha256" in entry and _same_pieces(entry, chunk_bytes, algorithm) and "chunks" in entry:
        return Pinned(entry["sha256"].removeprefix("sha256:"), list(entry["chunks"]), chunk_bytes, algorithm)
    started_ns = time.time_ns()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(chunk_digests, key, chunk_bytes, algorithm)
        digest, _ = (entry["sha256"], 0) if "sha256" in entry else sha256_file(key)
        chunks = pending.result()
    _remember(key, before, started_ns, sha256=digest, chunks=chunks, chunk_bytes=chunk_bytes, chunk_digest=algorithm)
    return Pinned(digest.removeprefix("sha256:"), chunks, chunk_bytes, algorithm)


def _same_pieces(entry: dict, chunk_bytes: int, algorithm: str) -> bool:
    """Whether a memo entry's chunks are pieces of this size by this hash (entries from before the hash was
    recorded are sha256's)."""
    return entry.get("chunk_bytes") == chunk_bytes and entry.get("chunk_digest", "sha256") == algorithm


def pin_in_background(paths: list[str]) -> Callable[[], None]:
    """Pin the files that exist (pinned_digests, remembered) on a thread of their own, e.g. while an engine starts
    cold: a capture then finds the whole-file stream done. Returns wait(). A file that changes meanwhile is not
    remembered, and is hashed again when it is pinned for real."""
    todo = [p for p in paths if os.path.isfile(p)]
    if not todo:
        return lambda: None

    def run() -> None:
        for p in todo:
            with suppress(OSError):  # gone or unreadable now: pinning it for real says so
                pinned_digests(p)

    thread = threading.Thread(target=run, name="pin-ahead", daemon=True)
    thread.start()
    return thread.join


def checked_chunks(path: str | os.PathLike, chunks: list[str], chunk_bytes: int, algorithm: str = "sha256") -> bool:
    """Whether the file's pieces hash to `chunks` by `algorithm` (remembered like checked_sha256)."""
    key = os.path.abspath(os.fspath(path))
    before = os.stat(key)
    if before.st_size > len(chunks) * chunk_bytes or before.st_size <= (len(chunks) - 1) * chunk_bytes:
        return False
    entry = _memo_entry(key, before)
    if _same_pieces(entry, chunk_bytes, algorithm) and entry.get("chunks") == chunks:
        return True
    started_ns = time.time_ns()
    actual = chunk_digests(key, chunk_bytes, algorithm)
    if actual != chunks:
        return False
    _remember(key, before, started_ns, chunks=actual, chunk_bytes=chunk_bytes, chunk_digest=algorithm)
    return True


def file_sha256(path: str | os.PathLike) -> str:
    """The file's sha256 as 64 hex digits (how weight files are pinned); checked_sha256's memo applies."""
    return checked_sha256(path)[0].removeprefix("sha256:")
