"""fetch: a restore that names a registry reference (HOST[:PORT]/REPO@sha256:…) pulls the capsule first, unless
the store has it. The capsule's own blobs come first (profile, CRIU images, manifest, signatures); the restore then
admits it and stages its images while its weights stream in, so a first restore on a node waits for the larger of
the two, not both. CRIU restores once the weights are in place: the restored processes hold the weight files open.
The capsule is listed in the store only once every blob is in and verified."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Callable

from coldsnap.base.paths import settings
from coldsnap.base.progress import Progress
from coldsnap.capsule import CapsuleStore, LoadedCapsule
from coldsnap.capsule.pieces import Arrivals, blob_fetcher_count
from coldsnap.contracts import RestoreRequest
from coldsnap.flows.staging import UnpackingEarly

# The GIL's hand-over interval while a pull runs. Its many threads (blob streams, their hashing and writing, the
# images' unpack, admission beside them) each wait for the GIL after every system call; whenever one thread
# computes, Python's default (5 ms) makes them wait that long. Measured with 4 blob streams and one busy thread
# (packaging/device/pull-gil.py): 0.33 GB/s at 5 ms against 0.64 at 0.5 ms, 0.72 with no busy thread (CPU machine).
PULL_SWITCH_INTERVAL_S = 0.0005


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
    pieces: Arrivals  # the weights blobs' partial files and the pieces checked so far (those fetched by pieces)
    early: UnpackingEarly | None = None  # the CRIU images, unpacked while they arrived (stage publishes them)

    def wait(self) -> None:
        """Until the weights are in the store, verified and the capsule listed; raises what failed the pull."""
        self.pieces.allow_sync()  # whoever waits for the pull's end lets it make them durable
        self.thread.join()
        if "error" in self.outcome:
            raise self.outcome["error"]
        result = self.outcome["result"]
        self.facts.update(bytes=result.bytes_transferred, seconds=result.seconds,
                          **({"spooled": len(self.pieces.spooled)} if self.pieces.spooled else {}),
                          **({"direct_offered": len(self.pieces.offered)} if self.pieces.offered else {}),
                          **({"pieces_s": max(self.pieces.took.values())} if self.pieces.took else {}),
                          **({"steps_s": dict(self.pieces.marks)} if self.pieces.marks else {}))

    def checked(self, digests: list[str]) -> None:
        """Until every piece of these blobs (fetched by pieces) is checked against its pin: their bytes are all
        there and right, while the disk and the store's listing may still be catching up (wait). Raises what
        failed the pull."""
        for digest in digests:
            if not self.pieces.whole(digest):
                self.wait()  # the pull ended without them: its error, or they came whole some other way

    def filed(self, digests: list[str]) -> None:
        """Until the partial files of these blobs hold every piece (checked pieces land in memory first, for the
        prefetchers, and reach the files once someone asks or the restore is past its first token): for an engine
        that reads its files itself. Raises what failed the pull."""
        for digest in digests:
            if not self.pieces.filed(digest):
                self.wait()

    def failed(self) -> BaseException | None:
        """What ended the pull, if it has ended that way: a refused pull takes the capsule's blobs with it, so
        whatever else fails meanwhile reads them missing; this is the cause to report."""
        return None if self.thread.is_alive() else self.outcome.get("error")

    def settle(self) -> None:
        """On the way out of a restore, whatever happened to it: the pull ends before the restore does, and an
        early unpack that staging did not take goes."""
        self.pieces.allow_sync()
        self.thread.join()
        if self.early is not None:
            self.early.discard()


def fetch(request: RestoreRequest, progress: Progress, meanwhile: Callable[[], None] | None = None,
          on_profile: Callable[[LoadedCapsule, Arrivals], None] | None = None
          ) -> tuple[RestoreRequest, dict, Arriving | None]:
    """The request with its capsule named by digest in the local store, pulled when it is not there; what the pull
    did (the receipt's `pull`); and the weights still arriving, if they are: fetch returns as soon as the capsule's
    own blobs, manifest and signatures are in, so that it admits and its images stage while its weights stream in.
    Whoever needs the weights waits for them (Arriving.wait). meanwhile: called once the pull is on its way (its
    library loaded first, on a GIL nobody else wants yet), for work done while the pull waits on the registry.
    on_profile: called on the pull's thread with the capsule once its profile is in (verified, not yet trusted),
    where the weights move beside the images (registry.pull's on_profile); it must not raise."""
    arrivals = Arrivals()  # its clock starts here: the receipt's pull.steps_s
    from coldsnap.capsule.registry import pull

    store = CapsuleStore(settings().store)
    ref = request.capsule
    if (digest := local_digest(store, ref)) is not None:
        return request.model_copy(update={"capsule": digest}), {"from": ref, "pulled": False}, None
    here = threading.Event()
    outcome: dict = {}

    def on_manifest(digest: str, manifest: dict) -> None:  # the images unpack while they arrive
        outcome["early"] = UnpackingEarly.start(digest, manifest, arrivals)

    def profile_in(digest: str, manifest: dict) -> None:
        assert on_profile is not None
        on_profile(store.loaded(digest, manifest), arrivals)

    def on_blobs(digest: str, manifest: dict) -> None:
        outcome["digest"] = digest
        progress(f"capsule {digest[:19]}… is here; admitting and staging it while its weights arrive")
        here.set()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, PULL_SWITCH_INTERVAL_S))

    def run() -> None:
        arrivals.mark("started")
        # its fetching processes start now, beside the manifest's request: ready (~0.1 s) before the images move
        threading.Thread(target=arrivals.start_fetchers, kwargs={"blobs": blob_fetcher_count()},
                         name="pull-fetchers", daemon=True).start()
        insecure = request.insecure_registry or ref.split("/", 1)[0] in insecure_registries()
        transfer = getattr(progress, "transfer", None)  # a display that shows transfers (the CLI's) gets the bytes
        try:
            outcome["result"] = pull(store, ref, insecure=insecure, allow_unpinned=request.policy.allow_unpinned,
                                     progress=transfer, on_blobs=on_blobs, arrivals=arrivals,
                                     on_manifest=on_manifest, on_profile=profile_in if on_profile else None)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            outcome["error"] = e
        finally:
            sys.setswitchinterval(switch)
            arrivals.end()
            here.set()

    progress(f"pulling {ref}")
    puller = threading.Thread(target=run, name="pull", daemon=True)
    puller.start()
    if meanwhile is not None:
        meanwhile()
    here.wait()
    facts = {"from": ref, "pulled": True}
    arriving = Arriving(puller, outcome, facts, arrivals, outcome.get("early"))
    if "digest" in outcome and puller.is_alive():
        facts.update(digest=outcome["digest"], streamed=True)
        return request.model_copy(update={"capsule": outcome["digest"]}), facts, arriving
    try:
        arriving.wait()  # it ended: nothing to stream (the weights are in the images), or it failed
    finally:
        arriving.settle()  # a head start staging will not take (rare: the pull ends as its weights begin)
    facts["digest"] = str(outcome["result"])
    return request.model_copy(update={"capsule": facts["digest"]}), facts, None
