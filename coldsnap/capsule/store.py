"""The local capsule store: an OCI image layout (oci-layout, index.json, blobs/sha256/<hex>).

Writes are atomic (temp file + fsync + rename; index.json replaced under a lock), so a capsule is either
wholly visible or not at all. Every digest is verified before a blob is used. Files are 0600, dirs 0700:
capsules hold process memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from coldsnap.base.digests import checked_sha256, sha256_file
from coldsnap.base.files import atomic_write, private_dir
from coldsnap.base.locks import locked
from coldsnap.contracts import CapsuleProfile, ColdSnapError, ErrorCode
from coldsnap.contracts import capsule as mt
from coldsnap.contracts.parse import short, strict_json

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
MAX_INDEX_BYTES = 64 << 20


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] | None = None

    def to_json(self) -> dict:
        d = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Descriptor":
        """A descriptor as a manifest holds it; a malformed one raises ValueError (callers say whose)."""
        if not isinstance(d, dict):
            raise ValueError("a descriptor must be an object")
        media_type, digest, size, ann = d.get("mediaType"), d.get("digest"), d.get("size"), d.get("annotations")
        if not isinstance(media_type, str) or not isinstance(digest, str) or not DIGEST_RE.match(digest):
            raise ValueError(f"descriptor {short(digest)}: mediaType and a sha256 digest are required")
        if type(size) is not int or size < 0:
            raise ValueError(f"descriptor {digest}: size must be a non-negative integer")
        if ann is not None and (not isinstance(ann, dict) or
                                not all(isinstance(k, str) and isinstance(v, str) for k, v in ann.items())):
            raise ValueError(f"descriptor {digest}: annotations must map strings to strings")
        return cls(media_type, digest, size, ann)


@dataclass(frozen=True)
class LoadedCapsule:
    digest: str  # manifest digest: the capsule's identity
    manifest: dict
    profile: CapsuleProfile
    layers: list[Descriptor]

    def layer(self, media_type: str) -> Descriptor | None:
        return next((d for d in self.layers if d.media_type == media_type), None)

    def layers_of(self, media_type: str) -> list[Descriptor]:
        """Its layers of that media type, in order (the CRIU images may be several: coldsnap.capsule.pack_parts)."""
        return [d for d in self.layers if d.media_type == media_type]

    @property
    def annotations(self) -> dict[str, str]:
        return manifest_annotations(self.manifest)

    @property
    def payload(self) -> str | None:
        """The digest of its weights payload, when its weights travel apart from the images."""
        return self.annotations.get(mt.ANNOTATION_PAYLOAD) or None

    @property
    def template(self) -> str | None:
        """The digest of the template capsule captured with it (--snapshot-driver both)."""
        return self.annotations.get(mt.ANNOTATION_TEMPLATE) or None

    @property
    def env_names(self) -> list[str]:
        """The names (never the values) of the variables its workload was started with."""
        return [n for n in self.annotations.get(mt.ANNOTATION_ENV_NAMES, "").split(",") if n]


def manifest_annotations(manifest: dict) -> dict[str, str]:
    """A manifest's annotations, the one way they are read: string values only (whatever else a manifest from
    elsewhere holds is not ours to trust)."""
    value = manifest.get("annotations") if isinstance(manifest, dict) else None
    return {k: v for k, v in value.items() if isinstance(v, str)} if isinstance(value, dict) else {}


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,254}$")  # a local tag or a registry repository[:tag]


def _looks_like_digest(ref: str) -> bool:
    """ALGORITHM:ENCODED meant as a digest (sha512:…, SHA256:…, or 32+ hex digits after the colon), not NAME:TAG."""
    algorithm, _, encoded = ref.partition(":")
    return bool(encoded) and bool(re.fullmatch(r"(sha|blake)\d*", algorithm, re.I)
                                  or re.fullmatch(r"[0-9a-fA-F]{32,}", encoded))


def parse_reference(ref: str) -> tuple[str | None, str | None]:
    """(name, digest). Pinned forms: 'sha256:…' and 'NAME@sha256:…'; 'NAME' or 'NAME:TAG' are unpinned. A digest
    that is not sha256:<64 lowercase hex> (63 digits, uppercase, sha512:…) is an invalid reference, not an unpinned
    one."""
    if not isinstance(ref, str) or not ref or len(ref) > 512:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"capsule reference {short(ref)}: not a reference")
    name: str | None  # None: a bare digest
    name, sep, digest = ref.rpartition("@") if "@" in ref else (ref, "", "")
    if not sep and _looks_like_digest(ref):
        name, digest = None, ref
    if digest and not DIGEST_RE.match(digest):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"capsule reference {short(ref)}: digest must be "
                            "sha256:<64 lowercase hex digits>")
    if name is not None and not NAME_RE.match(name):
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"capsule reference {short(ref)}: {short(name)} is not a "
                            "name (letters, digits and ._/:- only)")
    return name, digest or None


def reuse(blob: Path) -> bool:
    """Whether the blob is there already; if so its age starts again, so that gc's grace period protects a blob a
    new capsule is about to reference. (A blob hard-linked to a weight file keeps its times: touching it would touch
    the user's file; the journal of the capture that reuses it protects it from gc.)"""
    try:
        if blob.stat().st_nlink == 1:
            os.utime(blob)
        return True
    except FileNotFoundError:
        return False


def tag_of(entry: dict) -> str | None:
    ann = entry.get("annotations")
    return ann.get(mt.ANNOTATION_REF_NAME) if isinstance(ann, dict) else None


class CapsuleStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.blobs = self.root / "blobs" / "sha256"
        self.written: list[str] = []  # digests of the blobs this instance wrote (not reused): see discard()

    # --- layout ---------------------------------------------------------------------------------------------
    def init(self) -> "CapsuleStore":
        for path in (self.root, self.root / "blobs", self.blobs, self.root / "tmp"):
            private_dir(path)
        layout = self.root / "oci-layout"
        if not layout.exists():
            atomic_write(layout, json.dumps({"imageLayoutVersion": "1.0.0"}).encode(), 0o600)
        if not (self.root / "index.json").exists():
            self._write_index([])
        return self

    def _write_index(self, manifests: list[dict]) -> None:
        data = json.dumps({"schemaVersion": 2, "mediaType": mt.INDEX_MEDIA_TYPE, "manifests": manifests},
                          indent=1, sort_keys=True).encode()
        atomic_write(self.root / "index.json", data, 0o600)

    def _locked(self):
        return locked(self.root / ".lock")

    def index(self) -> list[dict]:
        """The store's index.json manifests (descriptor dicts), read strictly: a damaged index is one line."""
        try:
            raw = (self.root / "index.json").read_bytes()
        except FileNotFoundError:
            return []
        doc = strict_json(raw, f"{self.root}/index.json", max_bytes=MAX_INDEX_BYTES, code=ErrorCode.CAPSULE_CORRUPT)
        manifests = doc.get("manifests") if isinstance(doc, dict) else None
        if not isinstance(manifests, list) or not all(
                isinstance(m, dict) and isinstance(m.get("digest"), str) for m in manifests):
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"{self.root}/index.json is not an OCI image index")
        return manifests

    # --- blobs ----------------------------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        if not DIGEST_RE.match(digest):
            raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"not a sha256 digest: {digest!r}")
        return self.blobs / digest.split(":", 1)[1]

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).exists()

    def put_bytes(self, data: bytes, media_type: str, annotations: dict | None = None) -> Descriptor:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        dest = self.blob_path(digest)
        if not reuse(dest):
            atomic_write(dest, data, 0o600)
            self.written.append(digest)
        return Descriptor(media_type, digest, len(data), annotations)

    def put_file(self, src: Path, media_type: str, annotations: dict | None = None, move: bool = False) -> Descriptor:
        """Hash then move/copy into the store; the blob appears under its digest only when complete."""
        digest, size = sha256_file(src)
        dest = self.blob_path(digest)
        if not reuse(dest):
            tmp = (src.parent if move else self.root / "tmp") / f".{digest.split(':')[1]}.{os.getpid()}"
            if move:
                os.replace(src, tmp) if src.stat().st_dev == tmp.parent.stat().st_dev else shutil.move(src, tmp)
            else:
                shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o600)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)
            self.written.append(digest)
        elif move:
            src.unlink()
        return Descriptor(media_type, digest, size, annotations)

    def verify_blob(self, desc: Descriptor) -> Path:
        path = self.blob_path(desc.digest)
        if not path.exists():
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"blob {desc.digest} ({desc.media_type}) is missing")
        digest, size = checked_sha256(path)  # hashed unless unchanged since its last check (coldsnap.base.digests)
        if digest != desc.digest or size != desc.size:
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT,
                                f"blob {desc.digest} ({desc.media_type}) fails verification: content hashes to "
                                f"{digest}, {size} bytes (expected {desc.size})")
        return path

    def read_verified(self, desc: Descriptor) -> bytes:
        return self.verify_blob(desc).read_bytes()

    # --- capsules -------------------------------------------------------------------------------------------
    def write_capsule(self, profile: CapsuleProfile, layers: list[Descriptor], annotations: dict[str, str],
                      tag: str | None = None) -> str:
        """Write config + manifest and add it to index.json, under the store's lock (gc, which takes it too, never
        sees a manifest without its config, nor an unindexed manifest). Layers must already be in the store."""
        with self._locked():
            config = self.put_bytes(profile.model_dump_json(indent=1).encode(), mt.CONFIG_MEDIA_TYPE)
            manifest = {
                "schemaVersion": 2,
                "mediaType": mt.MANIFEST_MEDIA_TYPE,
                "artifactType": mt.ARTIFACT_TYPE,
                "config": config.to_json(),
                "layers": [d.to_json() for d in layers],
                "annotations": {mt.ANNOTATION_CREATED: datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                **annotations},
            }
            mdesc = self.put_bytes(json.dumps(manifest, indent=1, sort_keys=True).encode(), mt.MANIFEST_MEDIA_TYPE)
            self._index_add(mdesc, tag)
        return mdesc.digest

    def add_to_index(self, mdesc: Descriptor, tag: str | None) -> None:
        with self._locked():
            self._index_add(mdesc, tag)

    def _index_add(self, mdesc: Descriptor, tag: str | None) -> None:
        entry = {"mediaType": mt.MANIFEST_MEDIA_TYPE, "digest": mdesc.digest, "size": mdesc.size,
                 "artifactType": mt.ARTIFACT_TYPE}
        if tag:
            entry["annotations"] = {mt.ANNOTATION_REF_NAME: tag}
        manifests = [m for m in self.index() if not (m["digest"] == mdesc.digest and tag_of(m) == tag)]
        if tag:  # a tag names one capsule: move it
            manifests = [m for m in manifests if tag_of(m) != tag]
        manifests.append(entry)
        self._write_index(manifests)

    def resolve(self, ref: str, allow_unpinned: bool = False) -> str:
        """Reference → manifest digest. Unpinned references (a tag) are refused unless asked for; NAME@sha256:…
        must be a capsule that name tags."""
        name, digest = parse_reference(ref)
        if digest:
            if not self.has_blob(digest):
                raise ColdSnapError(ErrorCode.CAPSULE_NOT_FOUND, f"capsule {digest} is not in the store {self.root}")
            if name is not None and not any(m.get("digest") == digest and tag_of(m) == name for m in self.index()):
                raise ColdSnapError(ErrorCode.CAPSULE_NOT_FOUND, f"capsule {digest} is not tagged {short(name)} in "
                                    f"the store {self.root}")
            return digest
        if not allow_unpinned:
            raise ColdSnapError(ErrorCode.CAPSULE_UNPINNED,
                                f"capsule reference {short(ref)} is not pinned by digest; use NAME@sha256:… "
                                f"or pass --allow-unpinned")
        for m in reversed(self.index()):
            if tag_of(m) == name:
                return m["digest"]
        raise ColdSnapError(ErrorCode.CAPSULE_NOT_FOUND, f"no capsule tagged {short(name)} in the store {self.root}")

    def load(self, digest: str) -> LoadedCapsule:
        """Manifest and profile, both verified against their digests."""
        mpath = self.blob_path(digest)
        if not mpath.exists():
            raise ColdSnapError(ErrorCode.CAPSULE_NOT_FOUND, f"capsule {digest} is not in the store {self.root}")
        raw = mpath.read_bytes()
        actual = "sha256:" + hashlib.sha256(raw).hexdigest()
        if actual != digest:
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"manifest {digest} fails verification (hashes to {actual})")
        return self.loaded(digest, strict_json(raw, f"manifest {digest}", code=ErrorCode.CAPSULE_CORRUPT))

    def loaded(self, digest: str, manifest) -> LoadedCapsule:
        """The capsule of a manifest already verified against `digest` (store.load's, or a pull's before the store
        lists it): its profile read from the store, verified against the manifest's config descriptor."""
        if not isinstance(manifest, dict) or manifest.get("artifactType") != mt.ARTIFACT_TYPE:
            kind = manifest.get("artifactType") if isinstance(manifest, dict) else type(manifest).__name__
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"{digest} is not a ColdSnap capsule manifest "
                                f"(artifactType {short(kind)})")
        try:
            config = Descriptor.from_json(manifest["config"])
            layers = [Descriptor.from_json(d) for d in manifest["layers"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"manifest {digest}: malformed descriptor "
                                f"({short(str(e))})") from None
        try:
            profile = CapsuleProfile.model_validate_json(self.read_verified(config))
        except ValueError as e:
            raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"capsule profile does not validate: "
                                f"{short(str(e), 200)}") from None
        return LoadedCapsule(digest, manifest, profile, layers)

    def verify(self, capsule: LoadedCapsule) -> None:
        """Every layer's digest, but the weights': their pins are checked where they are used (staging's
        materialize and verify_weights, on every core), not hashed again as one stream of many GB."""
        for desc in capsule.layers:
            if desc.media_type != mt.LAYER_WEIGHTS:
                self.verify_blob(desc)

    def list(self) -> list[dict]:
        return self.index()
