"""Layers as tar + zstd, streamed (never a whole layer in memory)."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import zstandard

from coldsnap.contracts import ColdSnapError, ErrorCode


def pack_dir(src: Path, dest: Path, level: int = 1, skip: tuple[str, ...] = ()) -> None:
    """tar.zst of src's contents; level 1 because restore latency, not capsule size, is what users wait on."""
    cctx = zstandard.ZstdCompressor(level=level, threads=-1)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as raw, cctx.stream_writer(raw, closefd=False) as zw:
        with tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for entry in sorted(src.iterdir()):
                if entry.name in skip:
                    continue
                tar.add(entry, arcname=entry.name)


def unpack_layer(layer: Path, dest: Path) -> None:
    """Extract a tar.zst layer into dest, refusing members that would escape it."""
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    dctx = zstandard.ZstdDecompressor()
    with open(layer, "rb") as raw, dctx.stream_reader(raw) as zr:
        with tarfile.open(fileobj=zr, mode="r|") as tar:
            for member in tar:
                target = (dest / member.name).resolve()
                if not str(target).startswith(str(dest.resolve()) + os.sep):
                    raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"layer member escapes its directory: {member.name}")
                if not (member.isfile() or member.isdir()):
                    raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"unexpected layer member type: {member.name}")
                tar.extract(member, dest, set_attrs=False)
