"""fetch: a restore that names a registry reference (HOST[:PORT]/REPO@sha256:…) pulls the capsule first, unless
the store has it. The capsule's own blobs come first (profile, CRIU images, manifest, signatures); a restore
(streamed) then admits, stages and restores it with CRIU while its weights stream in, and waits for them only when
its engine takes them, so a first restore on a node waits for the larger of the two, not both. A prepare unpacks
the images on a thread while the weights arrive and returns when all is here. The capsule is listed in the store
only once every blob is in and verified."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

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


@dataclass
class Arriving:
    """The rest of a streamed pull, still moving on a thread of its own: the capsule's weights."""
    thread: threading.Thread
    outcome: dict  # "result" (a PullResult) or "error", once the thread ends
    facts: dict  # the receipt's `pull`, completed when it ends

    def wait(self) -> None:
        """Until the weights are in the store, verified and the capsule listed; raises what failed the pull."""
        self.thread.join()
        if "error" in self.outcome:
            raise self.outcome["error"]
        result = self.outcome["result"]
        self.facts.update(bytes=result.bytes_transferred, seconds=result.seconds)

    def failed(self) -> BaseException | None:
        """What ended the pull, if it has ended that way: a refused pull takes the capsule's blobs with it, so
        whatever else fails meanwhile reads them missing; this is the cause to report."""
        return None if self.thread.is_alive() else self.outcome.get("error")

    def settle(self) -> None:
        """On the way out of a restore, whatever happened to it: the pull ends before the restore does."""
        self.thread.join()


def fetch(request: RestoreRequest, progress: Progress, stream: bool = False
          ) -> tuple[RestoreRequest, dict, Arriving | None]:
    """The request with its capsule named by digest in the local store, pulled when it is not there; what the pull
    did (the receipt's `pull`); and, with stream, the weights still arriving: fetch returns as soon as the capsule's
    own blobs, manifest and signatures are in (it admits and its images stage and restore meanwhile), and the
    restore waits for the weights (Arriving.wait) only when its engine needs them. Without stream the images
    unpack on a thread while the weights arrive, and fetch returns when all is here."""
    from coldsnap.capsule.registry import pull
    from coldsnap.flows.staging import unpack_ahead

    store = CapsuleStore(settings().store)
    ref = request.capsule
    if (digest := local_digest(store, ref)) is not None:
        return request.model_copy(update={"capsule": digest}), {"from": ref, "pulled": False}, None
    ahead: dict = {}
    here = threading.Event()

    def unpack(digest: str, manifest: dict) -> None:
        start = time.monotonic()
        try:
            unpack_ahead(store, digest, manifest)
            ahead["unpacked_s"] = round(time.monotonic() - start, 4)
        except Exception as e:  # noqa: BLE001 - staging unpacks again and reports it with its own error
            ahead["unpack_error"] = f"{type(e).__name__}: {e}"[:200]

    def on_blobs(digest: str, manifest: dict) -> None:
        ahead["digest"] = digest
        if stream:
            progress(f"capsule {digest[:19]}… is here; restoring it while its weights arrive")
            here.set()
            return
        progress(f"capsule {digest[:19]}… is here; unpacking its images while the weights arrive")
        ahead["thread"] = threading.Thread(target=unpack, args=(digest, manifest), name="unpack-ahead", daemon=True)
        ahead["thread"].start()

    shown = [0.0]

    def bytes_progress(blob: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - shown[0] >= 2.0:
            shown[0] = now
            progress(f"pulling {blob[:19]}…: {done / 2**20:.0f} of {total / 2**20:.0f} MiB")

    outcome: dict = {}

    def run() -> None:
        insecure = request.insecure_registry or ref.split("/", 1)[0] in insecure_registries()
        # a display that draws transfers (the CLI's bars on a terminal) gets the bytes; else a sentence every 2 s
        transfer = getattr(progress, "transfer", None) or bytes_progress
        try:
            outcome["result"] = pull(store, ref, insecure=insecure, allow_unpinned=request.policy.allow_unpinned,
                                     progress=transfer, on_blobs=on_blobs)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            outcome["error"] = e
        finally:
            here.set()

    progress(f"pulling {ref}")
    puller = threading.Thread(target=run, name="pull", daemon=True)
    puller.start()
    here.wait()
    if stream and "digest" in ahead and puller.is_alive():
        facts = {"from": ref, "pulled": True, "digest": ahead["digest"], "streamed": True}
        return request.model_copy(update={"capsule": ahead["digest"]}), facts, Arriving(puller, outcome, facts)
    puller.join()
    if "thread" in ahead:
        ahead.pop("thread").join()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    ahead.pop("digest", None)
    facts = {"from": ref, "pulled": True, "digest": str(result), "bytes": result.bytes_transferred,
             "seconds": result.seconds, **ahead}
    return request.model_copy(update={"capsule": str(result)}), facts, None
