"""Listing, untagging and garbage collection of the local capsule store.

`remove` only drops index.json entries; blobs stay until `gc`, which deletes every blob not reachable from an
index.json manifest (the manifest, its config, its layers, and whatever its `io.coldsnap.payload` annotation
names, followed transitively when that is itself a manifest). gc runs under the store's lock and leaves alone:
blobs whose per-blob lock is held (a pull in flight), blobs younger than `grace_s` (a capture writes its blobs
before its manifest is indexed), `.partial` downloads whose lock is live, and tmp files younger than 1 h.
With code_dir, gc also deletes the CUDA code files there (coldsnap.gpu.codestash) that no indexed capsule's profile
lists and no live process maps, once older than `grace_s`.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path
from typing import Any

from coldsnap.base import journal
from coldsnap.base.paths import settings
from coldsnap.capsule import staged
from coldsnap.capsule.bloblocks import acquire_blob_lock, lock_path, release_blob_lock
from coldsnap.capsule.store import DIGEST_RE, CapsuleStore, manifest_annotations, parse_reference, tag_of
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.contracts import capsule as mt
from coldsnap.gpu import codestash

TMP_MAX_AGE_S = 3600.0
DEFAULT_GRACE_S = 600.0
_MANIFEST_TYPES = {mt.MANIFEST_MEDIA_TYPE, mt.INDEX_MEDIA_TYPE,
                   "application/vnd.docker.distribution.manifest.v2+json",
                   "application/vnd.docker.distribution.manifest.list.v2+json"}
_DIGEST_IN_TEXT = re.compile(r"sha256:[0-9a-f]{64}")
_HEX = re.compile(r"^[0-9a-f]{64}$")


def _json_blob(store: CapsuleStore, digest: str, limit: int = 4 << 20) -> dict | None:
    try:
        path = store.blob_path(digest)
        if path.stat().st_size > limit:
            return None
        doc = json.loads(path.read_bytes())
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, ColdSnapError):
        return None


def reachable(store: CapsuleStore) -> set[str]:
    seen: set[str] = set()
    todo = [(m["digest"], True) for m in store.index() if DIGEST_RE.match(m.get("digest", ""))]
    while todo:
        digest, walk = todo.pop()
        if digest in seen:
            continue
        seen.add(digest)
        doc = _json_blob(store, digest) if walk else None
        if not doc or "schemaVersion" not in doc:
            continue
        blobs = [(d, False) for d in [doc.get("config"), *(doc.get("layers") or [])]]
        manifests = [(d, True) for d in [*(doc.get("manifests") or []), doc.get("subject")]]
        for d, manifest in blobs + manifests:
            if isinstance(d, dict) and DIGEST_RE.match(str(d.get("digest", ""))):
                todo.append((d["digest"], manifest or d.get("mediaType") in _MANIFEST_TYPES))
        # io.coldsnap.payload: a digest, a list, or JSON holding digests
        payload = manifest_annotations(doc).get(mt.ANNOTATION_PAYLOAD, "")
        todo.extend((p, True) for p in _DIGEST_IN_TEXT.findall(payload))
    return seen


def list_capsules(store: CapsuleStore) -> list[dict]:
    """One row per capsule in index.json: digest, tag, created, engine, size (bytes of manifest+config+layers but
    the weights), weights_bytes (its weights layers, shared by every capsule of the model), complete (every blob
    present) and staged_bytes (its unpacked images, 0 when not staged)."""
    rows = []
    unpacked = {e.digest: e.bytes for e in staged.entries()}
    for entry in store.index():
        digest = entry.get("digest")
        manifest = _json_blob(store, digest) if digest else None
        if manifest is not None and manifest.get("artifactType") != mt.ARTIFACT_TYPE:
            continue  # another tool's artifact in the layout (a signature, an image): not a capsule
        row = {"digest": digest, "tag": tag_of(entry), "created": None, "engine": None, "size": None,
               "weights_bytes": 0, "complete": False, "staged_bytes": unpacked.get(digest, 0) if digest else 0}
        if manifest:
            ann = manifest_annotations(manifest)
            row["created"] = ann.get(mt.ANNOTATION_CREATED)
            row["engine"] = ann.get(mt.ANNOTATION_ENGINE)
            descs = [manifest.get("config") or {}] + list(manifest.get("layers") or [])
            weights = [d for d in descs if d.get("mediaType") == mt.LAYER_WEIGHTS]
            weights_bytes = sum(int(d.get("size", 0)) for d in weights)
            row["weights_bytes"] = weights_bytes
            row["size"] = int(entry.get("size", 0)) + sum(int(d.get("size", 0)) for d in descs) - weights_bytes
            row["complete"] = all(store.has_blob(d["digest"]) for d in descs if DIGEST_RE.match(d.get("digest", "")))
            if row["engine"] is None and (cfg := _json_blob(store, (manifest.get("config") or {}).get("digest", ""))):
                engine = cfg.get("engine")
                row["engine"] = engine.get("name") if isinstance(engine, dict) else engine
        rows.append(row)
    return rows


def remove(store: CapsuleStore, ref: str) -> list[str]:
    """Drop index.json entries: by tag ('NAME'), digest ('sha256:…') or both ('NAME@sha256:…').

    Returns the digests untagged. Blobs stay until gc()."""
    name, digest = parse_reference(ref)
    with store._locked():
        entries = store.index()

        def hit(e: dict) -> bool:  # without a digest, ref is a name
            return (not digest or e.get("digest") == digest) and (name is None or tag_of(e) == name)

        gone = [e["digest"] for e in entries if hit(e)]
        if not gone:
            raise ColdSnapError(ErrorCode.CAPSULE_NOT_FOUND, f"no capsule {ref!r} in the store {store.root}")
        left = [e for e in entries if not hit(e)]
        store._write_index(left)
    for digest in set(gone) - {e["digest"] for e in left}:  # its unpacked images go with it (blobs: at gc)
        staged.remove(digest)
    return gone


def in_flight_blobs(but: "journal.Journal | None" = None) -> set[str]:
    """Blobs an operation that still runs (other than `but`) has written or reused for a capsule it has not indexed
    yet (its journal names them: coldsnap.base.journal)."""
    return {t.digest for j in journal.entries() if j.owner_alive() and (but is None or j.path != but.path)
            for t in j.of(journal.Blob)}


def discard(store: CapsuleStore, digests: list[str], mine: "journal.Journal | None" = None) -> int:
    """Remove blobs a failed operation (whose journal is `mine`) wrote, unless a capsule or another operation in
    flight uses them now (on a full disk they are the room the next attempt needs). Returns the bytes freed."""
    freed = 0
    with store._locked():
        used = reachable(store) | in_flight_blobs(but=mine)
        for digest in digests:
            path = store.blob_path(digest)
            if digest not in used and path.exists():
                freed += path.stat().st_size
                path.unlink()
    return freed


def _age(st, now: float) -> float:
    return now - max(st.st_mtime, st.st_ctime)  # ctime: a rename/chmod into the store counts as new


def _locked_elsewhere(store: CapsuleStore, hexd: str) -> bool:
    path = lock_path(store, "sha256:" + hexd)
    if not path.exists():
        return False
    fd = acquire_blob_lock(path, blocking=False)
    if fd is not None:
        release_blob_lock(path, fd)
    return fd is None


def code_files_in_use(store: CapsuleStore, live: set[str]) -> set[str]:
    """CUDA code files that a reachable capsule's profile lists (its config blob's files), or a process maps."""
    used = set()
    for digest in live:
        profile = _json_blob(store, digest)
        if not profile or "snapshot_driver" not in profile:  # not a capsule's config
            continue
        for f in profile.get("files") or []:
            if isinstance(f, dict) and codestash.is_code_file(str(f.get("path", ""))):
                used.add(str(f["path"]))
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            used.update(line.split(None, 5)[5].strip() for line in maps.read_text().splitlines()
                        if line.count(" ") >= 5 and ".cubin" in line)
    return used


def _gc_code_files(code_dir: Path, used: set[str], grace_s: float, now: float, out: dict) -> None:
    for path in sorted(code_dir.iterdir()) if code_dir.is_dir() else []:
        if not codestash.is_code_file(str(path)) or str(path) in used:
            continue
        st = path.stat()
        if _age(st, now) >= grace_s:
            path.unlink(missing_ok=True)
            out["code_removed"] += 1
            out["freed_bytes"] += st.st_size


def gc(store: CapsuleStore, grace_s: float = DEFAULT_GRACE_S, tmp_max_age_s: float = TMP_MAX_AGE_S,
       code_dir: Path | None = None) -> dict:
    """Delete unreachable blobs, stale tmp files and (with code_dir) unused CUDA code files. Returns counts and
    freed bytes."""
    now = time.time()
    out: dict[str, Any] = {"freed_bytes": 0, "removed_blobs": [], "kept_blobs": 0, "kept_young": 0,
                           "kept_in_flight": 0, "tmp_removed": 0, "tmp_freed_bytes": 0, "code_removed": 0,
                           "staged_removed": [], "staged_freed_bytes": 0}
    with store._locked():
        live = reachable(store) | in_flight_blobs()
        indexed = {m["digest"] for m in store.index()}
        if store.root.resolve() == settings().store.resolve():  # gc of a copy or a mirror leaves staging alone
            for entry in staged.entries():  # unpacked capsules no index entry names any more
                if entry.digest not in indexed and (freed := staged.remove(entry.digest)):
                    out["staged_removed"].append(entry.digest)
                    out["staged_freed_bytes"] += freed
            before = {e.digest: e.bytes for e in staged.entries()}
            for digest in staged.evict():
                out["staged_removed"].append(digest)
                out["staged_freed_bytes"] += before.get(digest, 0)
        if code_dir is not None:
            _gc_code_files(code_dir, code_files_in_use(store, live), grace_s, now, out)
        if store.blobs.is_dir():
            for path in store.blobs.iterdir():
                st = path.stat()
                if not _HEX.match(path.name):  # an interrupted atomic write
                    if now - st.st_mtime > tmp_max_age_s:
                        path.unlink(missing_ok=True)
                        out["tmp_removed"] += 1
                        out["tmp_freed_bytes"] += st.st_size
                    continue
                if "sha256:" + path.name in live:
                    out["kept_blobs"] += 1
                elif _age(st, now) < grace_s:
                    out["kept_young"] += 1
                elif _locked_elsewhere(store, path.name):
                    out["kept_in_flight"] += 1
                else:
                    path.unlink(missing_ok=True)
                    out["removed_blobs"].append("sha256:" + path.name)
                    out["freed_bytes"] += st.st_size
        tmp = store.root / "tmp"
        for path in sorted(tmp.iterdir()) if tmp.is_dir() else []:
            hexd, _, suffix = path.name.partition(".")
            if suffix in ("partial", "lock") and _HEX.match(hexd):
                lock = lock_path(store, "sha256:" + hexd)
                fd = acquire_blob_lock(lock, blocking=False)
                if fd is None:
                    continue  # a pull holds it
                try:
                    partial = path.stat() if path.exists() else None
                    if suffix == "partial" and partial and now - partial.st_mtime > tmp_max_age_s:
                        path.unlink()
                        out["tmp_removed"] += 1
                        out["tmp_freed_bytes"] += partial.st_size
                finally:
                    release_blob_lock(lock, fd)  # an unheld lock file is garbage
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            owner = path.name.rsplit(".", 1)[-1]  # CapsuleStore.put_file stages as <hex>.<pid>
            if owner.isdigit() and Path(f"/proc/{owner}").exists():
                continue
            if path.is_file() and now - st.st_mtime > tmp_max_age_s:
                path.unlink(missing_ok=True)
                out["tmp_removed"] += 1
                out["tmp_freed_bytes"] += st.st_size
    out["freed_bytes"] += out["tmp_freed_bytes"] + out["staged_freed_bytes"]
    return out
