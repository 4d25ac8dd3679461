"""fetch: a restore that names a registry reference (HOST[:PORT]/REPO@sha256:…) pulls the capsule first, unless
the store has it. The capsule's own blobs come first; its CRIU images unpack into the staging area on a thread
while the weights payload streams in, so the first restore on a node waits for the larger of the two, not both.
The pulled capsule then goes through admission and staging like any other (stage finds its images unpacked)."""

from __future__ import annotations

import threading
import time

from coldsnap.base.paths import settings
from coldsnap.base.progress import Progress
from coldsnap.capsule import CapsuleStore
from coldsnap.contracts import RestoreRequest


def is_registry_reference(ref: str) -> bool:
    """HOST[:PORT]/REPO… : the first component names a host (a dot, a port or localhost), as docker reads it."""
    head = ref.split("@", 1)[0]
    if "/" not in head or head.startswith(("/", ".")):
        return False
    host = head.split("/", 1)[0]
    return "." in host or ":" in host or host == "localhost"


def insecure_registries() -> set[str]:
    """HOST[:PORT]s this node pulls from over plain HTTP: COLDSNAP_INSECURE_REGISTRIES, comma-separated. The node's
    operator sets it (as docker's insecure-registries), not a request: a container's annotations cannot ask for
    HTTP. Digests are verified either way; HTTP gives up the transport's privacy and its server identity."""
    return set(settings().insecure_registries)


def local_digest(store: CapsuleStore, ref: str) -> str | None:
    """The digest of a pinned registry reference whose capsule the store already has (the digest pins the content;
    where it came from is recorded at its pull)."""
    _, _, digest = ref.partition("@")
    if digest and store.has_blob(digest) and any(m.get("digest") == digest for m in store.index()):
        return digest
    return None


def fetch(request: RestoreRequest, progress: Progress) -> tuple[RestoreRequest, dict]:
    """The request with its capsule named by digest in the local store, pulled when it is not there; and what the
    pull did (the receipt's `pull`)."""
    from coldsnap.capsule.registry import pull
    from coldsnap.flows.staging import unpack_ahead

    store = CapsuleStore(settings().store)
    ref = request.capsule
    if (digest := local_digest(store, ref)) is not None:
        return request.model_copy(update={"capsule": digest}), {"from": ref, "pulled": False}
    ahead: dict = {}

    def unpack(digest: str, manifest: dict) -> None:
        start = time.monotonic()
        try:
            unpack_ahead(store, digest, manifest)
            ahead["unpacked_s"] = round(time.monotonic() - start, 4)
        except Exception as e:  # noqa: BLE001 - staging unpacks again and reports it with its own error
            ahead["unpack_error"] = f"{type(e).__name__}: {e}"[:200]

    def on_blobs(digest: str, manifest: dict) -> None:
        progress(f"capsule {digest[:19]}… is here; unpacking its images while the weights arrive")
        ahead["thread"] = threading.Thread(target=unpack, args=(digest, manifest), name="unpack-ahead", daemon=True)
        ahead["thread"].start()

    shown = [0.0]

    def bytes_progress(blob: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - shown[0] >= 2.0:
            shown[0] = now
            progress(f"pulling {blob[:19]}…: {done / 2**20:.0f} of {total / 2**20:.0f} MiB")

    progress(f"pulling {ref}")
    try:
        insecure = request.insecure_registry or ref.split("/", 1)[0] in insecure_registries()
        # a display that draws transfers (the CLI's bars on a terminal) gets the bytes; else a sentence every 2 s
        transfer = getattr(progress, "transfer", None) or bytes_progress
        result = pull(store, ref, insecure=insecure, allow_unpinned=request.policy.allow_unpinned,
                      progress=transfer, on_blobs=on_blobs)
    finally:
        if "thread" in ahead:
            ahead.pop("thread").join()
    facts = {"from": ref, "pulled": True, "digest": str(result), "bytes": result.bytes_transferred,
             "seconds": result.seconds, **ahead}
    return request.model_copy(update={"capsule": str(result)}), facts
