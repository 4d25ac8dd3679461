"""Capsule signatures in a registry, where cosign keeps them.

cosign 3 stores a signature as an OCI artifact (a Sigstore bundle as its one layer) whose `subject` is the signed
manifest, found through the referrers API or, on registries without it (distribution 2.8), through the fallback
tag `sha256-<hex>`: an image index listing the referrers. cosign 2 kept a simple-signing manifest at the tag
`sha256-<hex>.sig`. `push` publishes ColdSnap's bundles the cosign 3 way; `pull` gathers both kinds."""

from __future__ import annotations

import base64
import hashlib
import json

from coldsnap.capsule import signing
from coldsnap.capsule.store import CapsuleStore
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.contracts import capsule as mt

EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
SIGNATURE_LIMIT = 1 << 20  # a bundle is a few KB; anything near this is not one
MAX_REFERRERS = 32  # looked at per capsule
ACCEPT = f"{mt.INDEX_MEDIA_TYPE}, {mt.MANIFEST_MEDIA_TYPE}"


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _put_blob(client, data: bytes) -> str:
    digest = _digest(data)
    r = client.request("HEAD", f"{client.base}/blobs/{digest}", ok=(200, 404), what=f"checking {digest}")
    if r.status_code == 200:
        return digest
    r = client.request("POST", f"{client.base}/blobs/uploads/", ok=(202,), what="starting a signature upload",
                       headers={"Content-Length": "0"})
    url = client.location(r)
    sep = "&" if "?" in url else "?"
    client.request("PUT", f"{url}{sep}digest={digest}", ok=(201,), what=f"uploading {digest}", data=data,
                   headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(data))})
    return digest


def _get(client, path: str, what: str, accept: str | None = None) -> bytes | None:
    """A small document from the registry; None when it has none there."""
    r = client.request("GET", f"{client.base}/{path}", ok=(200, 404), what=what, stream=True,
                       headers={"Accept": accept} if accept else None)
    with r:
        if r.status_code == 404:
            return None
        data = r.raw.read(SIGNATURE_LIMIT + 1, decode_content=True)
    if len(data) > SIGNATURE_LIMIT:
        raise ColdSnapError(ErrorCode.REGISTRY, f"{what}: larger than {SIGNATURE_LIMIT} bytes")
    return data


def _json(data: bytes | None) -> dict | None:
    try:
        value = json.loads(data) if data else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def push(client, store: CapsuleStore, digest: str, manifest_size: int) -> int:
    """Publish the capsule's saved Sigstore bundles as referrers of its manifest (and in the fallback tag's index).
    Returns how many were published."""
    bundles = [s["bundle"] for s in signing.saved_signatures(store.root, digest) if isinstance(s.get("bundle"), dict)]
    if not bundles:
        return 0
    tag = digest.replace(":", "-")
    index = _json(_get(client, f"manifests/{tag}", f"referrers of {digest}", ACCEPT)) or {}
    listed = [m for m in index.get("manifests") or [] if isinstance(m, dict)]
    empty = _put_blob(client, EMPTY)
    for bundle in bundles:
        data = json.dumps(bundle, separators=(",", ":")).encode()
        layer = _put_blob(client, data)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": mt.MANIFEST_MEDIA_TYPE, "artifactType": signing.BUNDLE_MEDIA_TYPE,
            "config": {"mediaType": EMPTY_MEDIA_TYPE, "size": len(EMPTY), "digest": empty},
            "layers": [{"mediaType": signing.BUNDLE_MEDIA_TYPE, "size": len(data), "digest": layer}],
            "annotations": {"dev.sigstore.bundle.content": "dsse-envelope",
                            "dev.sigstore.bundle.predicateType": signing.PREDICATE_TYPE},
            "subject": {"mediaType": mt.MANIFEST_MEDIA_TYPE, "size": manifest_size, "digest": digest},
        }, separators=(",", ":")).encode()
        mdigest = _digest(manifest)
        client.request("PUT", f"{client.base}/manifests/{mdigest}", ok=(201,), what="pushing a signature",
                       data=manifest, headers={"Content-Type": mt.MANIFEST_MEDIA_TYPE})
        if not any(m.get("digest") == mdigest for m in listed):
            listed.append({"mediaType": mt.MANIFEST_MEDIA_TYPE, "size": len(manifest), "digest": mdigest,
                           "artifactType": signing.BUNDLE_MEDIA_TYPE})
    body = json.dumps({"schemaVersion": 2, "mediaType": mt.INDEX_MEDIA_TYPE, "manifests": listed},
                      separators=(",", ":")).encode()
    client.request("PUT", f"{client.base}/manifests/{tag}", ok=(201,), what=f"listing the signatures of {digest}",
                   data=body, headers={"Content-Type": mt.INDEX_MEDIA_TYPE})
    return len(bundles)


def pull(client, store: CapsuleStore, digest: str) -> int:
    """Save the signatures the registry holds for `digest` (cosign 3 bundles, cosign 2 simple signing). Returns
    how many were found; a registry with none is not an error (the restore policy decides)."""
    found = 0
    tag = digest.replace(":", "-")
    referrers = []
    for path in (f"referrers/{digest}", f"manifests/{tag}"):  # the referrers API, then the fallback tag
        index = _json(_get(client, path, f"referrers of {digest}", ACCEPT))
        if index:  # every listed referrer is looked at: cosign lists its own under its config's media type
            referrers += [m for m in index.get("manifests") or [] if isinstance(m, dict)]
    unique = {m.get("digest"): m for m in referrers if isinstance(m.get("digest"), str)}
    for ref in list(unique.values())[:MAX_REFERRERS]:
        manifest = _json(_get(client, f"manifests/{ref['digest']}", f"signature {ref['digest']}", ACCEPT))
        if not manifest or (manifest.get("subject") or {}).get("digest") != digest:
            continue
        for layer in manifest.get("layers") or []:
            if isinstance(layer, dict) and layer.get("mediaType") == signing.BUNDLE_MEDIA_TYPE:
                data = _get(client, f"blobs/{layer.get('digest')}", "a signature bundle")
                bundle = _json(data) if data is not None and _digest(data) == layer.get("digest") else None
                if bundle:
                    signing.save_signature(store.root, digest, {"bundle": bundle})
                    found += 1
    legacy = _json(_get(client, f"manifests/{tag}.sig", f"cosign signatures of {digest}", mt.MANIFEST_MEDIA_TYPE))
    for layer in (legacy or {}).get("layers") or []:
        if not isinstance(layer, dict) or layer.get("mediaType") != signing.SIMPLESIGNING_MEDIA_TYPE:
            continue
        sig = (layer.get("annotations") or {}).get(signing.SIMPLESIGNING_ANNOTATION)
        data = _get(client, f"blobs/{layer.get('digest')}", "a cosign signature payload")
        if sig and data is not None and _digest(data) == layer.get("digest"):
            signing.save_signature(store.root, digest, {"simplesigning": {
                "payload": base64.b64encode(data).decode(), "signature": sig}})
            found += 1
    return found
