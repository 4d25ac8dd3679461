"""Capsules as OCI artifacts in real registries: push and pull through the OCI distribution API (spoken through
coldsnap.capsule.remote: references, authentication, the registry's errors). Blob bodies never pass whole through
memory. push uploads missing blobs in chunks, then the stored manifest bytes unchanged,
so the registry's manifest digest is the local one. pull verifies the manifest (pinned by digest unless
allow_unpinned), then streams only missing blobs into store/tmp/<hex>.partial, hashing, and checks digest and size
before anything enters blobs/; an interrupted pull is resumed with a Range request. Per-blob fcntl locks
(store/tmp/<hex>.lock) make concurrent pulls safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests

from coldsnap.base.digests import (
    checked_chunks,
    checked_sha256,
    known_by_pieces_only,
    remember_hashed,
    remember_pieces,
)
from coldsnap.base.files import WriteBehind
from coldsnap.base.files import fsync_dir as _fsync_dir
from coldsnap.base.paths import settings
from coldsnap.base.progress import TransferProgress
from coldsnap.base.soon import Soon
from coldsnap.capsule import pieces, referrers, trust
from coldsnap.capsule.bloblocks import blob_locks as _blob_locks
from coldsnap.capsule.bloblocks import partial_path
from coldsnap.capsule.growing import Growing
from coldsnap.capsule.remote import (
    MANIFEST_LIMIT,
    Client,
    RemoteRef,
    parse_remote,
    registry_error,
    registry_said,
    short_error,
)
from coldsnap.capsule.store import DIGEST_RE, CapsuleStore, Descriptor, manifest_annotations
from coldsnap.contracts import CapsuleProfile, ColdSnapError, ErrorCode, WeightFile
from coldsnap.contracts import capsule as mt
from coldsnap.contracts.parse import strict_json

UPLOAD_CHUNK = 16 << 20  # PATCH size of a chunked upload
READ_CHUNK = 1 << 20  # download read/hash/write granularity
DOWNLOAD_ATTEMPTS = 3  # connection drops inside one pull are resumed this many times


def _corrupt(msg: str) -> ColdSnapError:
    return ColdSnapError(ErrorCode.CAPSULE_CORRUPT, msg)


# --- push -----------------------------------------------------------------------------------------------------
def _read_local_manifest(store: CapsuleStore, digest: str) -> tuple[bytes, dict]:
    path = store.blob_path(digest)
    if not path.exists():
        raise ColdSnapError(ErrorCode.CAPSULE_NOT_FOUND, f"capsule {digest} is not in the store {store.root}")
    raw = path.read_bytes()
    if "sha256:" + hashlib.sha256(raw).hexdigest() != digest:
        raise _corrupt(f"manifest {digest} in {store.root} fails verification")
    manifest = json.loads(raw)
    if manifest.get("artifactType") not in (mt.ARTIFACT_TYPE, mt.PAYLOAD_ARTIFACT_TYPE):
        raise _corrupt(f"{digest} is not a ColdSnap capsule (artifactType {manifest.get('artifactType')!r})")
    return raw, manifest


def _descriptors(manifest: dict, where: str) -> list[Descriptor]:
    try:
        descs = [Descriptor.from_json(manifest["config"])] + [Descriptor.from_json(d) for d in manifest["layers"]]
    except (KeyError, TypeError, ValueError):
        raise _corrupt(f"manifest {where} lacks a valid config/layers list") from None
    unique: dict[str, Descriptor] = {}
    for d in descs:
        if not DIGEST_RE.match(d.digest) or d.size < 0:
            raise _corrupt(f"manifest {where} lists an invalid blob {d.digest!r}")
        unique.setdefault(d.digest, d)
    return list(unique.values())


def _upload_blob(client: Client, path: Path, desc: Descriptor, progress: TransferProgress | None) -> int:
    r = client.request("POST", f"{client.base}/blobs/uploads/", ok=(202,), what=f"starting upload of {desc.digest}",
                       headers={"Content-Length": "0"})
    url = client.location(r)
    done = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(UPLOAD_CHUNK):
                r = client.request("PATCH", url, ok=(202,), what=f"uploading {desc.digest} at byte {done}", data=chunk,
                                   headers={"Content-Type": "application/octet-stream",
                                            "Content-Range": f"{done}-{done + len(chunk) - 1}",
                                            "Content-Length": str(len(chunk))})
                url = client.location(r)
                done += len(chunk)
                del chunk
                if progress:
                    progress(desc.digest, done, desc.size)
        if done != desc.size:
            raise _corrupt(f"blob {desc.digest} in the store is {done} bytes, its manifest says {desc.size}")
        sep = "&" if "?" in url else "?"
        r = client._send("PUT", f"{url}{sep}digest={desc.digest}", headers={"Content-Length": "0"})
        if r.status_code == 400 and "DIGEST_INVALID" in r.text:
            raise _corrupt(f"blob {desc.digest} in the store does not hash to its digest (the registry refused it)")
        if r.status_code != 201:
            raise client.refused(r, f"finishing upload of {desc.digest}", registry_said(r))
        url = ""
    finally:
        if url:  # abandoned: let the registry drop the session (best effort)
            with contextlib.suppress(ColdSnapError):
                client._send("DELETE", url)
    return done


def push(store: CapsuleStore, digest: str, ref: str, insecure: bool = False,
         progress: TransferProgress | None = None) -> dict:
    """Push the local capsule `digest` (config, layers, then its manifest bytes unchanged) to `ref`."""
    t0 = time.monotonic()
    remote = parse_remote(ref)
    if not remote.tag and not remote.digest:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"registry reference {ref!r} needs a :TAG (or @digest)")
    digest = store.resolve(digest)
    if remote.digest and remote.digest != digest:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"{ref} names {remote.digest}, but the capsule is {digest}")
    raw, manifest = _read_local_manifest(store, digest)
    annotations = manifest_annotations(manifest)
    payload, template = annotations.get(mt.ANNOTATION_PAYLOAD), annotations.get(mt.ANNOTATION_TEMPLATE)
    # The weights payload goes first, by digest: a capsule in a registry never points at nothing. The template a
    # refused restore falls to travels with its full capsule, by digest, before it.
    payload_result = push(store, payload, f"{remote.name}@{payload}", insecure, progress) if payload else None
    template_result = None
    if template and store.has_blob(template):
        template_result = push(store, template, f"{remote.name}@{template}", insecure, progress)
    elif template:
        template_result = {"digest": template, "skipped": "not in this store: a restore refused the full capsule "
                           "where this one is pulled will start cold"}
    descs = _descriptors(manifest, digest)
    for d in descs:
        path = store.blob_path(d.digest)
        if not path.exists():
            raise _corrupt(f"blob {d.digest} of capsule {digest} is missing")
        if (size := path.stat().st_size) != d.size:
            raise _corrupt(f"blob {d.digest} of capsule {digest} is {size} bytes, its manifest says {d.size}")
    client = Client(remote, insecure)
    sent, uploaded, present = 0, [], []
    for d in descs:
        r = client.request("HEAD", f"{client.base}/blobs/{d.digest}", ok=(200, 404), what=f"checking {d.digest}")
        if r.status_code == 200:
            present.append(d.digest)
            continue
        sent += _upload_blob(client, store.blob_path(d.digest), d, progress)
        uploaded.append(d.digest)
    r = client.request("PUT", f"{client.base}/manifests/{remote.tag or digest}", ok=(201,),
                       what=f"pushing manifest {digest}", data=raw,
                       headers={"Content-Type": manifest.get("mediaType", mt.MANIFEST_MEDIA_TYPE)})
    echoed = r.headers.get("Docker-Content-Digest")
    if echoed and echoed != digest:
        raise registry_error(f"registry {remote.host} stored the manifest as {echoed}, not {digest}: it rewrote "
                              "the manifest")
    # a weights payload (pushed by digest beside its capsule) carries no signatures of its own
    is_payload = manifest.get("artifactType") == mt.PAYLOAD_ARTIFACT_TYPE
    signatures = referrers.push(client, store, digest, len(raw)) if not is_payload else 0
    return {"digest": digest, "signatures": signatures, "ref": f"{remote.tagged}@{digest}",
            "bytes_transferred": sent + sum((r or {}).get("bytes_transferred", 0)
                                            for r in (payload_result, template_result)),
            "manifest_bytes": len(raw), "blobs_uploaded": uploaded, "blobs_present": present,
            "payload": payload_result, "template": template_result, "seconds": round(time.monotonic() - t0, 3)}


# --- pull -----------------------------------------------------------------------------------------------------
class PullResult(str):
    """The manifest digest (a str), carrying what the pull moved."""

    bytes_transferred: int
    blobs_fetched: list[str]
    blobs_present: list[str]
    resumed_bytes: int
    seconds: float
    tag: str | None
    manifest_written: str | None  # the manifest blob, when this pull wrote it (not there before)
    payload_bytes: int  # the capsule's weights moved (part of bytes_transferred)
    signatures: int  # signature bundles pulled along with the capsule
    template: dict | None = None  # a full capsule's template: {digest, pulled} (False: not in the registry)

    def __new__(cls, digest: str, **attrs) -> PullResult:
        self = super().__new__(cls, digest)
        vars(self).update(attrs)
        return self

    def as_dict(self) -> dict:
        return {"digest": str(self), "tag": self.tag, "bytes_transferred": self.bytes_transferred,
                "blobs_fetched": self.blobs_fetched, "blobs_present": self.blobs_present,
                "resumed_bytes": self.resumed_bytes, "seconds": self.seconds,
                "signatures": getattr(self, "signatures", 0), "template": self.template}


def _hash_prefix(path: Path, length: int):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while length > 0 and (chunk := f.read(min(4 << 20, length))):
            h.update(chunk)
            length -= len(chunk)
    return h


class _Sink:
    """Hash and write received chunks in two threads (both release the GIL) so receiving, hashing and writing
    overlap; at most 2 x 8 chunks in flight. WriteBehind keeps the final fsync down to the last windows (durable
    False: no final fsync now, so nothing written back meanwhile either)."""

    def __init__(self, h, f, offset: int, growing: Growing | None = None, durable: bool = True):
        behind = WriteBehind(f.fileno(), offset) if durable else None
        at = [offset]

        def write(chunk: bytes) -> None:
            f.write(chunk)
            f.flush()
            if behind is not None:
                behind.wrote(len(chunk))
            at[0] += len(chunk)
            if growing is not None:  # readable from the file now
                growing.wrote(at[0])

        self.error: BaseException | None = None
        self.queues: list[queue.Queue[bytes | None]] = [queue.Queue(8), queue.Queue(8)]  # None: the end
        self.threads = [threading.Thread(target=self._run, args=(q, fn), daemon=True)
                        for q, fn in zip(self.queues, (h.update, write))]
        for t in self.threads:
            t.start()

    def _run(self, q: queue.Queue[bytes | None], fn) -> None:
        while (chunk := q.get()) is not None:
            if self.error is None:
                try:
                    fn(chunk)
                except BaseException as e:  # noqa: BLE001 - re-raised in the receiving thread
                    self.error = e

    def put(self, chunk: bytes) -> None:
        if self.error is not None:
            raise self.error
        for q in self.queues:
            q.put(chunk)

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join()
        if self.error is not None:
            raise self.error


def _download(client: Client, desc: Descriptor, part: Path, progress: TransferProgress | None,
              growing: Growing | None = None, durable: bool = True) -> tuple[int, int, bool]:
    """Bring part up to desc.size bytes, resuming what is there: (received, resumed, matches size and digest).
    growing: told how far the file is written, for a reader that follows it (any restart stops the reader).
    durable False: not fsynced (the caller makes it durable later: _make_durable)."""
    try:
        received, resumed, ok = _download_into(client, desc, part, progress, growing, durable)
    except BaseException:
        if growing is not None:
            growing.broke()
        raise
    if growing is not None:
        growing.ended(ok)
    return received, resumed, ok


def _download_into(client: Client, desc: Descriptor, part: Path, progress: TransferProgress | None,
                   growing: Growing | None, durable: bool = True) -> tuple[int, int, bool]:
    url = f"{client.base}/blobs/{desc.digest}"
    received = attempts = 0
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as f:
        offset = f.seek(0, os.SEEK_END)
        if offset > desc.size:
            f.truncate(0)
            offset = 0
        resumed = offset
        if growing is not None:
            growing.started(part, desc.size, offset)
        h = _hash_prefix(part, offset) if offset else hashlib.sha256()
        while offset < desc.size:
            headers = {"Range": f"bytes={offset}-"} if offset else {}
            r = client.request("GET", url, ok=(200, 206, 416), what=f"fetching blob {desc.digest}", headers=headers,
                               stream=True, not_found=ErrorCode.CAPSULE_NOT_FOUND)
            with r:
                if offset and (r.status_code != 206 or
                               not r.headers.get("Content-Range", "").startswith(f"bytes {offset}-")):
                    # Range ignored (200), refused (416) or answered oddly: start again from byte 0
                    if growing is not None:
                        growing.broke()
                    f.truncate(0)
                    offset = resumed = 0
                    h = hashlib.sha256()
                    if r.status_code != 200:
                        continue
                sink = _Sink(h, f, offset, growing, durable)
                try:
                    try:
                        for chunk in r.iter_content(READ_CHUNK):
                            room = desc.size + 1 - offset  # read at most one byte too many: enough to know
                            if len(chunk) > room:
                                chunk = chunk[:room]
                            sink.put(chunk)
                            offset += len(chunk)
                            received += len(chunk)
                            if progress:
                                progress(desc.digest, offset, desc.size)
                            if offset > desc.size:
                                break
                    finally:
                        sink.close()  # everything handed over is hashed and written, also on the way out
                    break  # complete, short or long: verification decides
                except (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError,
                        requests.exceptions.Timeout) as e:
                    f.flush()
                    offset = f.tell()
                    if growing is not None:  # resumed on another connection: not one straight run
                        growing.broke()
                    h = _hash_prefix(part, offset)  # what reached the file, exactly
                    attempts += 1
                    if attempts >= DOWNLOAD_ATTEMPTS:
                        raise registry_error(f"connection to {client.ref.host} broke while "
                                            f"fetching {desc.digest} at byte {offset} ({short_error(e)}); the partial "
                                            "download is kept and the next pull resumes it") from None
        ok = offset == desc.size and "sha256:" + h.hexdigest() == desc.digest
        if ok:
            f.flush()
            if durable:
                os.fsync(f.fileno())
    return received, resumed, ok


def _download_by_fetcher(fetcher: pieces.Fetcher, client: Client, desc: Descriptor, part: Path,
                         progress: TransferProgress | None, growing: Growing,
                         durable: bool = True) -> tuple[int, bool] | None:
    """desc's blob streamed into a new partial file by a fetching process started ahead of it (pieces.Fetcher: a
    GIL of its own, so the restore's threads neither slow it nor wait for it), growing told as it is written:
    (bytes received, whether they match the digest and size). None when it did not bring the blob (a partial was
    there already, the connection broke, the registry answered something else, the process failed): the caller
    then fetches the rest itself, which says what went wrong."""
    url = f"{client.base}/blobs/{desc.digest}"
    try:
        fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:  # an earlier pull's partial: resumed on this process's thread
        fetcher.close()
        return None
    try:
        try:
            _, authorization = pieces.probe(client, url, f"fetching blob {desc.digest}")
            fetcher.give({"url": url, "authorization": authorization, "blob": desc.size, "every": READ_CHUNK}, [fd])
        except BaseException:
            fetcher.close(at_once=True)
            raise
        growing.started(part, desc.size, 0)
        at, whole = 0, None
        assert fetcher.proc.stdout is not None
        for raw in fetcher.proc.stdout:
            word, *rest = raw.decode(errors="replace").split() or [""]
            if word == "at" and rest and rest[0].isdigit():
                at = int(rest[0])
                growing.wrote(at)
                if progress:
                    progress(desc.digest, at, desc.size)
            elif word == "whole" and len(rest) == 2 and rest[0].isdigit():
                at, whole = int(rest[0]), int(rest[0]) == desc.size and f"sha256:{rest[1]}" == desc.digest
            elif word == "long":
                at, whole = desc.size + 1, False
        fetcher.ended()
        if whole is None:
            growing.broke()
            return None
        if whole and durable:
            os.fsync(fd)
        growing.ended(whole)
        return at, whole
    except BaseException:
        growing.broke()
        raise
    finally:
        os.close(fd)


def _fetch_blob(client: Client, store: CapsuleStore, desc: Descriptor, progress: TransferProgress | None,
                growing: Growing | None = None, fetcher: pieces.Fetcher | None = None,
                durable: bool = True) -> tuple[int, int]:
    """Bring one blob into its partial file, verified: by a fetching process started for it (a blob someone follows
    while it arrives), else, or for what that one did not bring, on this thread. durable False: not fsynced."""
    part = partial_path(store, desc.digest)
    got = _download_by_fetcher(fetcher, client, desc, part, progress, growing, durable) \
        if fetcher is not None and growing is not None else None
    if got is not None:
        received, ok = got
        resumed = 0
    else:
        received, resumed, ok = _download(client, desc, part, progress, growing, durable)
    if not ok and resumed:  # a resumed partial may have been bad locally: one clean retry
        part.unlink(missing_ok=True)
        more, more_resumed, ok = _download(client, desc, part, progress, durable=durable)
        received, resumed = received + more, resumed + more_resumed
    if not ok:
        part.unlink(missing_ok=True)
        raise _corrupt(f"blob {desc.digest} ({desc.media_type}) from {client.ref.host}/{client.ref.repository} "
                       f"does not match its digest/size ({desc.size} bytes): refused, nothing kept")
    os.chmod(part, 0o600)
    return received, resumed


def _fetch_pieces(client: Client, store: CapsuleStore, desc: Descriptor, wf: WeightFile,
                  progress: TransferProgress | None, arrivals: pieces.Arrivals | None = None) -> tuple[int, int] | None:
    """(received, resumed) of a blob fetched by pieces, or None when the registry does not answer ranges."""
    try:
        return pieces.fetch_by_pieces(lambda: Client(client.ref, client.scheme == "http"),
                                      f"{client.base}/blobs/{desc.digest}", partial_path(store, desc.digest),
                                      desc.size, wf, f"fetching blob {desc.digest}",
                                      (lambda done, total: progress(desc.digest, done, total)) if progress else None,
                                      arrivals, desc.digest)
    except pieces.NoRanges:
        partial_path(store, desc.digest).unlink(missing_ok=True)
        return None


def _the_capsule_listed(client: "Client", listed: list) -> str | None:
    """The digest of the one ColdSnap capsule among an index's manifests (each fetched and hashed), or None when
    there is not exactly one (or the index lists too many to look at)."""
    digests = [d for d in listed if isinstance(d, str) and DIGEST_RE.match(d)]
    if not digests or len(digests) > 8:
        return None
    found = []
    for d in digests:
        raw, _ = client.manifest(d, f"manifest {d}")
        if len(raw) > MANIFEST_LIMIT or "sha256:" + hashlib.sha256(raw).hexdigest() != d:
            raise _corrupt(f"manifest {d} does not hash to its digest")
        doc = strict_json(raw, f"manifest {d}", code=ErrorCode.CAPSULE_CORRUPT)
        if isinstance(doc, dict) and doc.get("artifactType") == mt.ARTIFACT_TYPE:
            found.append(d)
    return found[0] if len(found) == 1 else None


def pull(store: CapsuleStore, ref: str, insecure: bool = False, allow_unpinned: bool = False,
         progress: TransferProgress | None = None, artifact_type: str = mt.ARTIFACT_TYPE,
         on_blobs: Callable[[str, dict], None] | None = None, pins: dict[str, WeightFile] | None = None,
         arrivals: pieces.Arrivals | None = None, on_manifest: Callable[[str, dict], None] | None = None,
         on_profile: Callable[[str, dict], None] | None = None) -> PullResult:
    """Fetch the capsule `ref` into `store`; returns its manifest digest (a PullResult: .bytes_transferred …).
    For a capsule whose weights travel apart, on_blobs(digest, manifest) is called once the capsule's own blobs, its
    manifest, provenance and signatures are in the store (verified): it loads and admits from then on, before the
    weights move, and is listed only once they are in. Weights blobs that the
    capsule pins piece by piece (from its verified profile; `pins` for an earlier capsule's payload) are fetched
    and checked by pieces; `arrivals` hears of each piece checked (a restore that streams them onward), and of
    how far each blob it follows is written (Arrivals.follow: a restore unpacking the images as they arrive);
    on_manifest(digest, manifest) is called before the capsule's own blobs move (the manifest checked, not yet
    trusted: for a head start on work that is published only once they are verified); on_profile(digest, manifest)
    once its profile is in the store too (verified, not yet trusted), where the weights move beside the images
    (pieces.weights_ahead): a restore's direct prefetch takes its orders then."""
    t0 = time.monotonic()
    remote = parse_remote(ref)
    if not remote.digest and not allow_unpinned:
        raise ColdSnapError(ErrorCode.CAPSULE_UNPINNED, f"registry reference {ref!r} is not pinned by digest; "
                            "use HOST/REPO@sha256:… or pass --allow-unpinned")
    if not remote.tag and not remote.digest:
        raise ColdSnapError(ErrorCode.INVALID_REQUEST, f"registry reference {ref!r} needs a :TAG or @digest")
    store.init()
    client = Client(remote, insecure)
    # An index is accepted too, so that a tag naming one is answered for what it is, not as "not found".
    raw, r = client.manifest(str(remote.digest or remote.tag), f"capsule {remote}")
    if len(raw) > MANIFEST_LIMIT:
        raise _corrupt(f"manifest of {remote} is larger than {MANIFEST_LIMIT} bytes")
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    expected = remote.digest or r.headers.get("Docker-Content-Digest") or digest
    if digest != expected:
        raise _corrupt(f"manifest of {remote} hashes to {digest}, expected {expected}")
    manifest = strict_json(raw, f"manifest {digest} of {remote}", code=ErrorCode.CAPSULE_CORRUPT)
    if not isinstance(manifest, dict):
        raise _corrupt(f"manifest {digest} of {remote} is not a JSON object")
    if manifest.get("artifactType") == mt.INDEX_ARTIFACT_TYPE and artifact_type == mt.ARTIFACT_TYPE:
        # a tag of a capsule with a payload (or a pin of that index): the capsule it lists, by digest
        capsule = next((m.get("digest") for m in manifest.get("manifests") or [] if isinstance(m, dict)
                        and m.get("artifactType") == mt.ARTIFACT_TYPE and DIGEST_RE.match(str(m.get("digest")))),
                       None)
        if capsule is None:
            raise _corrupt(f"{remote} is a ColdSnap index that lists no capsule")
        return pull(store, f"{remote.tagged}@{capsule}", insecure, True, progress, artifact_type, on_blobs, pins,
                    arrivals, on_manifest, on_profile)
    if manifest.get("mediaType") == mt.INDEX_MEDIA_TYPE or "manifests" in manifest:
        listed = [m.get("digest") for m in manifest.get("manifests") or [] if isinstance(m, dict)]
        # A copy tool that rewrites the index (skopeo copy --all) drops its artifactType markers, keeping the
        # manifests as they are: the one capsule among them is still the capsule this tag names.
        capsule = _the_capsule_listed(client, listed) if artifact_type == mt.ARTIFACT_TYPE else None
        if capsule is not None:
            return pull(store, f"{remote.tagged}@{capsule}", insecure, True, progress, artifact_type, on_blobs, pins,
                        arrivals, on_manifest, on_profile)
        raise _corrupt(f"{remote} names an OCI image index of {len(listed)} manifest(s) "
                       f"({', '.join(str(d) for d in listed[:3])}{'…' if len(listed) > 3 else ''}), not a capsule: "
                       "pull a capsule by its own digest")
    if manifest.get("artifactType") != artifact_type:
        kind = "capsule" if artifact_type == mt.ARTIFACT_TYPE else "payload"
        raise _corrupt(f"{remote} is not a ColdSnap {kind} (artifactType {manifest.get('artifactType')!r})")
    annotations = manifest_annotations(manifest) if artifact_type == mt.ARTIFACT_TYPE else {}
    payload, template = annotations.get(mt.ANNOTATION_PAYLOAD), annotations.get(mt.ANNOTATION_TEMPLATE)
    pulled: list[PullResult] = []  # what this pull brought before the capsule itself
    early = _Fetched()
    ahead: _WeightsAhead | None = None  # the weights, moving while the images do
    signatures: int | None = None  # pulled with the capsule's own blobs, when someone admits it early
    provenance: Soon[int] | None = None
    descs = _descriptors(manifest, digest)
    own = [d for d in descs if d.media_type != mt.LAYER_WEIGHTS]
    try:
        if artifact_type == mt.ARTIFACT_TYPE and (payload or len(own) < len(descs)):
            # The capsule's own blobs first (its profile and CRIU images, small): a restore that pulls can unpack
            # the images while the weights stream in (on_blobs). The capsule is listed only once all is here.
            if arrivals is not None:
                arrivals.mark("manifest")
            if on_manifest is not None:
                on_manifest(digest, manifest)
            # where the capsule came from and who signed it, asked beside its blobs (admission waits for both)
            provenance = Soon(lambda: _provenance(Client(client.ref, client.scheme == "http"), store, remote, digest),
                              "pull-provenance") if on_blobs is not None else None
            weights_missing = payload or any(not store.has_blob(d.digest) for d in descs if d not in own)
            # a restore uses these before the pull ends (on_blobs): their fsync waits for its first token
            used_early = on_blobs is not None and arrivals is not None and settings().pull_sync_later
            with _blob_locks(store, [d.digest for d in own]):
                if (arrivals is not None and weights_missing and not payload
                        and pieces.weights_ahead(choosing=on_profile is not None)):
                    # the profile first (it pins the weights' pieces), then the weights move beside the images
                    config = own[:1]  # _descriptors puts the config first
                    early = _fetch_missing(store, client, config, progress, arrivals=arrivals, sync_later=used_early)
                    if on_profile is not None:
                        on_profile(digest, manifest)
                    ahead = _WeightsAhead(store, client, manifest, [d for d in descs if d not in own], progress,
                                          arrivals)
                    early.add(_fetch_missing(store, client, own[1:], progress, arrivals=arrivals,
                                             sync_later=used_early))
                else:
                    early = _fetch_missing(store, client, own, progress, arrivals=arrivals, sync_later=used_early)
            if arrivals is not None:
                arrivals.mark("own_blobs")
            if on_blobs is not None:
                # What admission needs before the weights move: the manifest (stored, not listed), where the capsule
                # came from and who signed it. A refused pull discards the manifest with the rest.
                if not store.has_blob(digest):
                    store.put_bytes(raw, manifest.get("mediaType", mt.MANIFEST_MEDIA_TYPE))
                    early.digests.append(digest)
                assert provenance is not None
                signatures = provenance.result()
                if arrivals is not None:
                    arrivals.mark("provenance")
                on_blobs(digest, manifest)
            # then the shared weights, fetched and checked by the pieces its verified profile pins: only their
            # missing blobs move (those moving ahead already: waited for)
            pins = _weight_pins(store, manifest)
            if ahead is not None:
                early.add(ahead.join())
                ahead = None
        if payload:  # an earlier capsule: its weights are a payload artifact of their own
            pulled.append(pull(store, f"{remote.name}@{payload}", insecure, True, progress,
                               artifact_type=mt.PAYLOAD_ARTIFACT_TYPE, pins=pins, arrivals=arrivals))
        if template:  # pinned by this manifest; verified and trusted as a capsule of its own
            got = _pull_template(store, f"{remote.name}@{template}", insecure, progress)
            pulled += [got] if got is not None else []
            template_found = got is not None
        result = _pull_capsule(store, client, remote, raw, digest, manifest, artifact_type, progress,
                               pulled[0] if payload else None, t0, early, pins, signatures, arrivals)
    except BaseException as e:
        if provenance is not None:  # nothing of this pull goes on behind its failure
            with contextlib.suppress(BaseException):
                provenance.result()
        if ahead is not None:  # failed while the weights moved: they end first (nothing will read them)
            if arrivals is not None:
                arrivals.allow_sync()
            early.add(ahead.join(quiet=True))
        if isinstance(e, ColdSnapError) and e.code == ErrorCode.CAPSULE_CORRUPT and (pulled or early.digests):
            from coldsnap.capsule.gc import discard  # a refused pull keeps nothing

            discard(store, [d for p in pulled for d in (*p.blobs_fetched, p.manifest_written) if d] + early.digests)
        raise
    if template:
        result.template = {"digest": template, "pulled": template_found}
    return result


def _pull_template(store: CapsuleStore, ref: str, insecure: bool, progress) -> "PullResult | None":
    """A full capsule's template, when its registry has it: without one, a refused restore starts cold."""
    try:
        return pull(store, ref, insecure, True, progress)
    except ColdSnapError as e:
        if e.code != ErrorCode.CAPSULE_NOT_FOUND:
            raise
        return None


@dataclass
class _Fetched:
    """What fetching a manifest's missing blobs moved."""
    received: int = 0
    resumed: int = 0
    digests: list[str] = field(default_factory=list)
    unsynced: list[str] = field(default_factory=list)  # of digests: listed before their bytes were durable

    def add(self, more: "_Fetched") -> None:
        self.received += more.received
        self.resumed += more.resumed
        self.digests += more.digests
        self.unsynced += more.unsynced


class _WeightsAhead:
    """A capsule's weights blobs fetched on a thread of their own (and its own connection) while the rest of its
    blobs come: by the pieces its profile pins (in the store, verified, before this starts), so that a restore's
    weights move beside its CRIU images instead of after them."""

    def __init__(self, store: CapsuleStore, client: "Client", manifest: dict, weights: list[Descriptor], progress,
                 arrivals: pieces.Arrivals) -> None:
        self.fetched: _Fetched | None = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                own = Client(client.ref, client.scheme == "http")  # a session is not shared between threads
                with _blob_locks(store, [d.digest for d in weights]):
                    self.fetched = _fetch_missing(store, own, weights, progress, _weight_pins(store, manifest),
                                                  arrivals)
            except BaseException as e:  # noqa: BLE001 - raised by join
                self.error = e

        self.thread = threading.Thread(target=run, name="coldsnap-weights", daemon=True)
        self.thread.start()

    def join(self, quiet: bool = False) -> _Fetched:
        """What it fetched, once it ends; raises what failed it (quiet: what it fetched, if anything)."""
        self.thread.join()
        if self.error is not None and not quiet:
            raise self.error
        return self.fetched or _Fetched()


def _weight_pins(store: CapsuleStore, manifest: dict) -> dict[str, WeightFile]:
    """The capsule's weight files pinned piece by piece, by blob digest, from its (already verified) profile."""
    try:
        profile = CapsuleProfile.model_validate_json(store.read_verified(Descriptor.from_json(manifest["config"])))
    except (ColdSnapError, KeyError, TypeError, ValueError):
        return {}  # the capsule's own pull says what is wrong with it
    weights = profile.model.weights if profile.model else []
    return {"sha256:" + wf.sha256: wf for wf in weights if wf.chunks and wf.chunk_bytes}


def _present_for(store: CapsuleStore, d: Descriptor, wf: WeightFile | None) -> bool:
    """Whether the store's blob d serves this capsule. A blob fetched by pieces was checked only against the pins
    of the capsule that fetched it: others check their own pins, or the whole digest if they pin none. When pins
    differ the digest decides: a blob that is its digest makes these pins wrong (refused); else it is refetched."""
    if not store.has_blob(d.digest):
        return False
    path = store.blob_path(d.digest)
    # trusted by its digest (pins without pieces: the same): one only ever checked by pieces is hashed whole first
    if wf is None or wf.chunk_bytes is None:
        if d.media_type != mt.LAYER_WEIGHTS:  # the capsule's own: checked now (memoized), fetched again if torn
            return checked_sha256(path)[0] == d.digest
        return not known_by_pieces_only(path) or checked_sha256(path)[0] == d.digest
    if checked_chunks(path, wf.chunks, wf.chunk_bytes, wf.chunk_digest):
        return True
    if checked_sha256(path)[0] == d.digest:
        raise _corrupt(f"the capsule pins the pieces of weights blob {d.digest}, but they are not that blob's "
                       "pieces: refused")
    return False


BLOB_STREAMS = 6  # blobs fetched at once (the CRIU images' layers side by side; a weights blob by pieces has its own)


def _fetch_missing(store: CapsuleStore, client: "Client", descs: list[Descriptor], progress,
                   pins: dict[str, WeightFile] | None = None, arrivals: pieces.Arrivals | None = None,
                   sync_later: bool = False) -> _Fetched:
    """Fetch the blobs the store lacks, up to BLOB_STREAMS at once, then publish them once every one verified (a
    refused one: none, and no partial kept). A weights blob in `pins` is fetched and checked piece by piece. The
    caller holds their locks. sync_later: a restore uses these blobs before the pull ends (the capsule's own,
    ahead of its weights): those fetched whole are listed before they are durable (got.unsynced: the pull makes
    them durable past the restore's first token, before it lists the capsule), so that writing them back does not
    hold up admission, the images' unpack and CRIU; weights are durable before they are listed, as always."""
    got = _Fetched()

    def durable(d: Descriptor) -> bool:
        return not sync_later or d.media_type == mt.LAYER_WEIGHTS
    missing = [(d, (pins or {}).get(d.digest)) for d in descs]
    missing = [(d, wf) for d, wf in missing if not _present_for(store, d, wf)]
    by_pieces: dict[str, WeightFile] = {}
    clients = [client]  # one per thread (a session is not shared between threads); the first is the caller's
    local = threading.local()

    def fetch(item: tuple[Descriptor, WeightFile | None]) -> tuple[int, int]:
        if not hasattr(local, "client"):
            with _clients_lock:
                local.client = clients.pop() if clients else None
            local.client = local.client or Client(client.ref, client.scheme == "http")
        d, wf = item
        if wf is not None and pieces.wanted() and pieces.covers(wf, d.size) and \
                (got_pieces := _fetch_pieces(local.client, store, d, wf, progress, arrivals)):
            by_pieces[d.digest] = wf
            return got_pieces
        return _fetch_blob(local.client, store, d, progress, arrivals.followed(d.digest) if arrivals else None,
                           arrivals.take_blob_fetcher(d.digest) if arrivals else None, durable(d))

    outcomes: list[tuple[int, int] | BaseException] = []
    with ThreadPoolExecutor(max(1, min(BLOB_STREAMS, len(missing))), thread_name_prefix="coldsnap-blob") as pool:
        for future in [pool.submit(fetch, item) for item in missing]:
            try:
                outcomes.append(future.result())
            except BaseException as e:  # noqa: BLE001 - raised below, once every fetch has ended
                outcomes.append(e)
    failed = [e for e in outcomes if isinstance(e, BaseException)]
    fetched = [d for (d, _), out in zip(missing, outcomes) if not isinstance(out, BaseException)]
    if failed:
        corrupt = [e for e in failed if isinstance(e, ColdSnapError) and e.code == ErrorCode.CAPSULE_CORRUPT]
        if corrupt:  # a refused pull leaves the store as it was
            for d in fetched:
                partial_path(store, d.digest).unlink(missing_ok=True)
        raise (corrupt or failed)[0]
    for d, out in zip(fetched, outcomes):
        assert not isinstance(out, BaseException)
        got.received += out[0]
        got.resumed += out[1]
        got.digests.append(d.digest)
    for d in fetched:
        os.replace(partial_path(store, d.digest), store.blob_path(d.digest))
        if wf := by_pieces.get(d.digest):  # its pieces checked as they came in; its whole digest never computed
            assert wf.chunk_bytes is not None  # pieces.covers held for it
            remember_pieces(store.blob_path(d.digest), wf.chunks, wf.chunk_bytes, wf.chunk_digest)
        else:  # hashed while it streamed in: not read again
            remember_hashed(store.blob_path(d.digest), d.digest, durable(d))
            if not durable(d):
                got.unsynced.append(d.digest)
    if len(got.unsynced) < len(fetched):  # the unsynced ones' entries wait for _make_durable
        _fsync_dir(store.blobs)
    return got


def _make_durable(store: CapsuleStore, digests: list[str], arrivals: pieces.Arrivals | None) -> None:
    """Blobs a restore's pull listed before their bytes were on the disk (_fetch_missing), made durable once the
    restore is past its first token (or over), before the capsule is listed; remembered durable then (until
    now the digest memo trusted them in this boot only)."""
    if not digests:
        return
    if arrivals is not None:
        arrivals.end()  # nothing more arrives: whoever waits for a blob it did not bring by pieces waits for the
        arrivals.wait_sync_allowed()  # pull's end instead, which allows this
    for digest in digests:
        fd = os.open(store.blob_path(digest), os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(store.blobs)
    for digest in digests:
        remember_hashed(store.blob_path(digest), digest)


_clients_lock = threading.Lock()


def _provenance(client: "Client", store: CapsuleStore, remote: RemoteRef, digest: str) -> int:
    """Where the capsule came from and who vouches for it (the restore policy's input); returns the signatures
    pulled."""
    trust.record(store, digest, "pull", remote.tagged)
    return referrers.pull(client, store, digest)


def _pull_capsule(store: CapsuleStore, client: "Client", remote: RemoteRef, raw: bytes, digest: str, manifest: dict,
                  artifact_type: str, progress, payload_result, t0: float, early: _Fetched,
                  pins: dict[str, WeightFile] | None = None, signatures: int | None = None,
                  arrivals: pieces.Arrivals | None = None) -> PullResult:
    descs = _descriptors(manifest, digest)
    tag = f"{remote.name}:{remote.tag}" if remote.tag else None
    # Lock every blob of the capsule, present or not: gc leaves locked blobs alone, and a concurrent pull of a
    # shared blob waits here and then finds it present.
    with _blob_locks(store, [d.digest for d in descs] + [digest]):
        got = _fetch_missing(store, client, descs, progress, pins, arrivals)
        _make_durable(store, early.unsynced + got.unsynced, arrivals)
        # Every blob here, verified and durable: the manifest, then the tag.
        had_manifest = store.has_blob(digest)
        mdesc = store.put_bytes(raw, manifest.get("mediaType", mt.MANIFEST_MEDIA_TYPE))
        indexed = any(m.get("digest") == digest for m in store.index())
        # payloads are reached through their capsules, not listed; a capsule pulled again by digest is listed once
        if artifact_type == mt.ARTIFACT_TYPE and (tag or not indexed):
            store.add_to_index(mdesc, tag)
    fetched = early.digests + got.digests
    if signatures is None:
        signatures = _provenance(client, store, remote, digest) if artifact_type == mt.ARTIFACT_TYPE else 0
    moved = early.received + got.received
    if payload_result:  # an earlier capsule: its weights came with its payload artifact
        payload_bytes = payload_result.bytes_transferred
        moved += payload_bytes
    else:  # the weights layers among what moved here
        payload_bytes = sum(d.size for d in descs if d.media_type == mt.LAYER_WEIGHTS and d.digest in fetched)
    return PullResult(digest, payload_bytes=payload_bytes, bytes_transferred=moved, blobs_fetched=fetched,
                      blobs_present=[d.digest for d in descs if d.digest not in fetched],
                      resumed_bytes=early.resumed + got.resumed, seconds=round(time.monotonic() - t0, 3), tag=tag,
                      manifest_written=None if had_manifest else digest, signatures=signatures)
