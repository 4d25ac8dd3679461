"""Weights payloads: the safetensors files of one model revision as their own content-addressed OCI artifact,
referenced from capsules by the `io.coldsnap.payload` annotation. Every capsule of the same weights shares the
same payload and blobs, so a second capsule of a model moves no weight bytes; the capsule itself never holds them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..contracts import ColdSnapError, ErrorCode, WeightFile
from ..contracts import capsule as mt
from .store import CapsuleStore, Descriptor, sha256_file

EMPTY_CONFIG = b"{}"


def write_payload(store: CapsuleStore, weights: list[WeightFile]) -> str:
    """Add the weight files to the store (hard-linked when on the same filesystem: they are immutable and pinned by
    digest) and write a payload manifest. Returns its digest (not indexed: capsules reference it)."""
    layers = []
    for wf in weights:
        digest = "sha256:" + wf.sha256
        dest = store.blob_path(digest)
        size = os.path.getsize(wf.path)
        if not dest.exists():
            tmp = store.root / "tmp" / f"{wf.sha256}.{os.getpid()}.payload"
            try:
                os.link(wf.path, tmp)
            except OSError:
                shutil.copyfile(wf.path, tmp)
            actual, size = sha256_file(tmp)
            if actual != digest:
                tmp.unlink(missing_ok=True)
                raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"weight file {wf.path} changed: it hashes to {actual}")
            os.replace(tmp, dest)
        layers.append(Descriptor(mt.LAYER_WEIGHTS, digest, size,
                                 {mt.ANNOTATION_TITLE: Path(wf.path).name, mt.ANNOTATION_PATH: wf.path}))
    config = store.put_bytes(EMPTY_CONFIG, "application/vnd.oci.empty.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": mt.MANIFEST_MEDIA_TYPE, "artifactType": mt.PAYLOAD_ARTIFACT_TYPE,
                "config": config.to_json(), "layers": [d.to_json() for d in layers]}
    return store.put_bytes(json.dumps(manifest, indent=1, sort_keys=True).encode(), mt.MANIFEST_MEDIA_TYPE).digest


def materialize(store: CapsuleStore, payload_digest: str, weights: list[WeightFile]) -> list[str]:
    """Put missing (or different) weight files back at their pinned paths from the payload's verified blobs."""
    placed = []
    for wf in weights:
        if os.path.exists(wf.path) and os.path.getsize(wf.path) > 0:
            continue  # verify_weights checks its digest
        desc = Descriptor(mt.LAYER_WEIGHTS, "sha256:" + wf.sha256, wf.size or os.path.getsize(
            store.blob_path("sha256:" + wf.sha256)) if store.has_blob("sha256:" + wf.sha256) else 0)
        if not store.has_blob(desc.digest):
            raise ColdSnapError(ErrorCode.INCOMPATIBLE, f"weight file {wf.path} is missing and payload "
                                f"{payload_digest} does not hold it")
        src = store.verify_blob(desc)
        Path(wf.path).parent.mkdir(parents=True, exist_ok=True)
        tmp = wf.path + ".coldsnap-tmp"
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, wf.path)
        placed.append(wf.path)
    return placed
