"""Weights that travel apart from the CRIU images: the safetensors files of one model revision as blobs of their
own, content-addressed, listed as layers of the capsule's manifest (media type LAYER_WEIGHTS, each with its path and
mode). Every capsule of the same weights names the same blobs, so a second capsule of a model moves no weight bytes
(a registry keeps one copy of a blob across manifests and repositories), and any tool that copies the capsule by tag
or digest copies its weights with it.

Capsules written before kept them in a payload artifact of their own, named by the `io.coldsnap.payload`
annotation (tests/old_capsules.py writes one): those still stage (materialize) and pull."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from coldsnap.base.digests import remember_hashed, remember_pieces
from coldsnap.capsule.pinned import mismatch
from coldsnap.capsule.store import CapsuleStore, Descriptor, LoadedCapsule, reuse
from coldsnap.contracts import ColdSnapError, ErrorCode, WeightFile
from coldsnap.contracts import capsule as mt


def put_weights(store: CapsuleStore, weights: list[WeightFile],
                keep: Callable[[Descriptor], Descriptor] = lambda d: d, scratch: Path | None = None
                ) -> list[Descriptor]:
    """Add the weight files to the store (hard-linked when on the same filesystem: they are immutable and pinned by
    digest); returns their layer descriptors. keep(descriptor) is told of every blob written or reused (a capture
    journals them, so gc spares them until they are indexed)."""
    layers = []
    for wf in weights:
        digest = "sha256:" + wf.sha256
        dest = store.blob_path(digest)
        size = os.path.getsize(wf.path)
        if not reuse(dest):
            tmp = (scratch or store.root / "tmp") / f".{wf.sha256}.{os.getpid()}.payload"
            try:
                try:
                    os.link(wf.path, tmp)
                except OSError:
                    shutil.copyfile(wf.path, tmp)
                if why := mismatch(tmp, wf):  # the link, not the path: what the store keeps is what was checked
                    raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"weight file {wf.path} changed since it was "
                                        f"pinned: it {why}")
                size = os.path.getsize(tmp)
                os.replace(tmp, dest)
                store.written.append(digest)
            finally:
                tmp.unlink(missing_ok=True)  # a partial copy never stays (on a full disk it is all the room)
        # The mode travels too: a restored process that maps the file finds it as it was (CRIU checks the mode).
        mode = oct(os.stat(wf.path).st_mode & 0o7777)
        layers.append(keep(Descriptor(mt.LAYER_WEIGHTS, digest, size,
                                      {mt.ANNOTATION_TITLE: Path(wf.path).name, mt.ANNOTATION_PATH: wf.path,
                                       mt.ANNOTATION_MODE: mode})))
    return layers


def weight_layers(store: CapsuleStore, capsule: LoadedCapsule) -> list[Descriptor]:
    """The capsule's weights layers: in its own manifest, or (earlier capsules) in its payload's."""
    if not capsule.payload:
        return [d for d in capsule.layers if d.media_type == mt.LAYER_WEIGHTS]
    try:
        manifest = json.loads(store.blob_path(capsule.payload).read_bytes())
        return [Descriptor.from_json(d) for d in manifest.get("layers", [])]
    except (OSError, ValueError, AttributeError):
        return []


def pinned_modes(store: CapsuleStore, capsule: LoadedCapsule) -> dict[str, int]:
    """Each weights blob's file mode as captured (CRIU restores a process that maps the file only if it matches)."""
    return {d.digest: int((d.annotations or {}).get(mt.ANNOTATION_MODE, "0o644"), 8)
            for d in weight_layers(store, capsule)}


def materialize(store: CapsuleStore, capsule: LoadedCapsule, weights: list[WeightFile]) -> list[str]:
    """Put missing weight files back at their pinned paths (and modes) from the capsule's verified weights blobs."""
    placed = []
    source = f"payload {capsule.payload}" if capsule.payload else f"capsule {capsule.digest}"
    modes = pinned_modes(store, capsule)
    for wf in weights:
        if os.path.exists(wf.path) and os.path.getsize(wf.path) > 0:
            continue  # verify_weights checks its digest
        desc = Descriptor(mt.LAYER_WEIGHTS, "sha256:" + wf.sha256, wf.size or os.path.getsize(
            store.blob_path("sha256:" + wf.sha256)) if store.has_blob("sha256:" + wf.sha256) else 0)
        if not store.has_blob(desc.digest):
            raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"weight file {wf.path} is missing and {source} "
                                "does not hold it")
        if wf.chunks and wf.chunk_bytes:  # pinned by pieces: checked by pieces, on every core (a pull may never
            src = store.blob_path(desc.digest)  # have computed its whole digest: coldsnap.capsule.pieces)
            if why := mismatch(src, wf):
                raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"blob {desc.digest} of {source} "
                                    f"{why}")
        else:
            src = store.verify_blob(desc)
        Path(wf.path).parent.mkdir(parents=True, exist_ok=True)
        tmp = wf.path + ".coldsnap-tmp"
        mode = modes.get(desc.digest, 0o644)
        try:
            st = os.stat(src)
            if st.st_mode & 0o7777 != mode:
                if st.st_nlink > 1:  # another pinned path shares this inode, with its own mode: keep it as it is
                    raise OSError("mode differs: copy instead of sharing the inode")
                # a pulled blob only the store holds: it takes the pinned file's mode, as a captured one has it
                # (blobs/ is 0700 either way), and is linked, not copied (31 GB on a node's first restore)
                os.chmod(src, mode)
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
            os.chmod(tmp, mode)
        os.replace(tmp, wf.path)
        if os.path.samefile(src, wf.path):  # the verified blob's own inode: what was checked holds
            if wf.chunks and wf.chunk_bytes:
                remember_pieces(wf.path, wf.chunks, wf.chunk_bytes, wf.chunk_digest)
            else:
                remember_hashed(wf.path, desc.digest)
        placed.append(wf.path)
    return placed
