"""Capsule assembly: the one writer of the capsule format, shared by process and container captures.

A capsule is an OCI image manifest in the store: the CRIU images (one layer, or several of about equal bytes that a
pull fetches and unpacks side by side), the files the tree held open
outside them (files.tar.zst), the weights manifest, the weight files when they travel apart from the images (one
layer each, coldsnap.capsule.payload), and annotations (engine, model, environment names, the template it was
captured with). Its config blob is the CapsuleProfile. Every blob is reached through its manifest's descriptors, so
any OCI tool copies a capsule whole by its tag or its digest."""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from coldsnap.base.files import copy_sparse, private_dir
from coldsnap.base.journal import Blob, Dir, Journal
from coldsnap.base.paths import settings
from coldsnap.capsule import trust
from coldsnap.capsule.gc import discard
from coldsnap.capsule.pack import pack_dir, pack_parts
from coldsnap.capsule.payload import put_weights
from coldsnap.capsule.store import CapsuleStore, Descriptor
from coldsnap.contracts import (
    CapsuleProfile,
    CapturedFile,
    CaptureRequest,
    ColdSnapError,
    EngineRelease,
    ErrorCode,
    HostProfile,
)
from coldsnap.contracts import capsule as mt
from coldsnap.contracts.profile import SnapshotDriver


@dataclass
class PackedCapsule:
    digest: str
    size: int  # the bytes of its layers but the weights (shared by every capsule of the model)
    weights_apart: bool
    signed_by: str  # this host's key


def capsule_profile(driver: SnapshotDriver, request: CaptureRequest, host: HostProfile, expected_text: str, *,
                    criu_options: list[str], engine_version: str | None, **fields) -> CapsuleProfile:
    """The profile of a capsule, process or container: what both captures record alike, plus their own fields."""
    return CapsuleProfile(
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        snapshot_driver=driver,
        host=host,
        engine=request.engine,
        engine_version=engine_version,
        validation=request.validation.model_copy(update={"expected_text": expected_text}),
        expected_text=expected_text,
        criu_options=criu_options,
        **fields,
    )


def weights_travel_apart(profile: CapsuleProfile, released: EngineRelease | None) -> bool:
    """Whether the weights travel apart from the images, as layers of their own: pinned files (recovery) or the
    engine's own save of its native weights. Otherwise (native weights kept in memory) they are in the images."""
    return profile.weights_mode == "recovery" or bool(released and released.saved_weights)


IMAGES_LAYERS = 4  # at most: fewer than a pull fetches at once (coldsnap.capsule.registry.BLOB_STREAMS)


def images_layers(images: Path) -> int:
    """How many layers the CRIU images go in: one per COLDSNAP_IMAGES_LAYER_MIB (64: smaller ones gain nothing
    from going side by side), at most IMAGES_LAYERS."""
    raw = settings().images_layer_mib
    try:
        per_layer = max(1, int(raw)) << 20
    except ValueError:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, "COLDSNAP_IMAGES_LAYER_MIB must be a whole number of MiB, "
                            f"not {raw[:40]!r}") from None
    total = sum(f.stat().st_size for f in images.iterdir() if f.is_file() and not f.is_symlink())
    return max(1, min(IMAGES_LAYERS, -(-total // per_layer)))


def _images_title(i: int, count: int) -> str:
    return "criu-images" if count == 1 else f"criu-images-{i + 1}-of-{count}"  # oras names pulled files by title


def pack_capsule(store: CapsuleStore, images: Path, files: list[CapturedFile], profile: CapsuleProfile,
                 tag: str | None, *, weights_apart: bool, sources: dict[str, str] | None = None,
                 journal: Journal | None = None, template_capsule: str | None = None) -> PackedCapsule:
    """Pack, index and sign the capsule. Its layers are written in a scratch directory of the store (journaled: a
    pack killed midway leaves nothing once someone looks), the blobs it writes or reuses are protected from gc while
    the capture lives, and a failed pack removes what it wrote that nothing else uses (room for the next try)."""
    scratch = store.root / "tmp" / f"pack-{uuid.uuid4().hex}"
    entry = journal.add(Dir(str(scratch))) if journal else None
    try:
        digest = _write(store, private_dir(scratch), files, images, profile, tag, sources, weights_apart, journal,
                        template_capsule)
    except BaseException:
        discard(store, store.written, journal)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if journal and entry:
            journal.drop(entry)
    size = sum(int(layer["size"]) for layer in json.loads(store.blob_path(digest).read_text())["layers"]
               if layer["mediaType"] != mt.LAYER_WEIGHTS)
    return PackedCapsule(digest=digest, size=size, weights_apart=weights_apart,
                         signed_by=trust.adopt_capture(store, digest))  # how a restore on this host knows it


def _write(store: CapsuleStore, scratch: Path, files: list[CapturedFile], images: Path, profile: CapsuleProfile,
           tag: str | None, sources: dict[str, str] | None, payload: bool, journal: Journal | None,
           template_capsule: str | None) -> str:
    """The capsule's layers packed in scratch, moved into the store as blobs, then its manifest indexed."""
    def keep(desc: Descriptor) -> Descriptor:
        if journal:  # gc spares a blob an in-flight capture wrote or reuses, until it is indexed
            journal.add(Blob(desc.digest))
        return desc

    parts = pack_parts(images, scratch / "criu", images_layers(images), skip=("dump.log",))
    layers = [keep(store.put_file(part, mt.LAYER_CRIU, {mt.ANNOTATION_TITLE: _images_title(i, len(parts))},
                                  move=True)) for i, part in enumerate(parts)]
    if files:
        staging = private_dir(scratch / "files")
        for i, f in enumerate(files):
            # Only the bytes that existed at the dump: restore truncates to this size anyway.
            # sparse: shm queues are hundreds of MB of holes
            copy_sparse((sources or {}).get(f.path, f.path), staging / str(i), f.size)
        files_tar = scratch / "files.tar.zst"
        pack_dir(staging, files_tar)
        layers.append(keep(store.put_file(files_tar, mt.LAYER_FILES, {mt.ANNOTATION_TITLE: "captured-files"},
                                          move=True)))
    weights_manifest = {"mode": profile.weights_mode,
                        "files": [w.model_dump() for w in (profile.model.weights if profile.model else [])]}
    layers.append(keep(store.put_bytes(json.dumps(weights_manifest, sort_keys=True).encode(),
                                       mt.LAYER_WEIGHTS_MANIFEST, {mt.ANNOTATION_TITLE: "weights-manifest"})))
    annotations: dict[str, str] = {mt.ANNOTATION_ENGINE: profile.engine.name}
    # Names only, never values: so that whoever restores the capsule can see that a token travelled in its memory.
    env_names = profile.container.env_names if profile.container else sorted(profile.launch.env)
    if env_names:
        annotations[mt.ANNOTATION_ENV_NAMES] = ",".join(env_names)
    if payload and profile.model and profile.model.weights:
        # The weight files as layers of their own beside the images: restores on a host that lacks them pull them
        # once, and capsules of the same weights share their blobs.
        layers += put_weights(store, profile.model.weights, keep=keep, scratch=scratch)
    if profile.model:
        annotations[mt.ANNOTATION_MODEL] = f"{profile.model.id}@{profile.model.revision}"
    if template_capsule:
        annotations[mt.ANNOTATION_TEMPLATE] = template_capsule
    return store.write_capsule(profile, layers, annotations, tag)
