"""stage: verify every blob digest of an admitted capsule, check its pinned weights (materialising a weights
payload), unpack its CRIU images and files once per capsule digest in the staging area (coldsnap.capsule.staged),
and put back the CUDA code files its processes map. Shared by process and container restores; `restore
--prepare-only` stops here."""

from __future__ import annotations

import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from coldsnap.base.files import private_dir
from coldsnap.base.journal import Dir, Journal
from coldsnap.base.paths import settings
from coldsnap.capsule import CapsuleStore, LoadedCapsule, unpack_layer, unpack_layers
from coldsnap.capsule import staged as staged_area
from coldsnap.capsule.growing import Growing
from coldsnap.capsule.payload import materialize, pinned_modes
from coldsnap.capsule.pieces import Arrivals
from coldsnap.capsule.pinned import verify_weights
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.contracts import capsule as mt
from coldsnap.flows.resources import out_of_room
from coldsnap.gpu import codestash
from coldsnap.workload import hostfiles


@dataclass
class StagedForRestore:
    capsule: LoadedCapsule
    images: Path
    files: Path | None
    parts: dict[str, float] = field(default_factory=dict)  # seconds of verify, weights, unpack, code: in "stage"
    # The weights still arriving (a streamed pull): wait for the pull and put them in place (replacing the links
    # link_arriving made, if it did), before CRIU restores or, linked, behind the first token. None once done.
    weights_later: Callable[..., None] | None = None


class UnpackingEarly:
    """A pulled capsule's CRIU images, unpacked while their blobs arrive (coldsnap.capsule.growing), all of their
    layers side by side, into a private directory: stage() publishes it once every blob is in the store and
    verified, and discards it otherwise (a refused capsule, a blob that failed its digest, a stream that did not
    come in one run: stage then unpacks the verified blobs as usual). The directory is journaled, as any staging's."""

    def __init__(self, capsule: str, criu: list[str], growing: list[Growing]) -> None:
        self.capsule, self.criu, self.growing = capsule, criu, growing
        self.tmp: Path | None = None
        self.journal: Journal | None = None
        self.failed: BaseException | None = None
        self.seconds: float | None = None  # how long it took, once it did (the receipt's stage_parts.unpack_early)
        self.taken = False
        self.thread = threading.Thread(target=self._run, name="coldsnap-unpack-early", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, capsule: str, manifest: dict, arrivals: Arrivals) -> UnpackingEarly | None:
        """Follow the capsule's CRIU images blobs (called with its checked manifest, before the blobs move); None
        where there is nothing to gain: the capsule is staged already, or a blob of its images is in the store."""
        listed = [d.get("digest") for d in manifest.get("layers") or []
                  if isinstance(d, dict) and d.get("mediaType") == mt.LAYER_CRIU]
        criu = [d for d in listed if isinstance(d, str)]
        store = CapsuleStore(settings().store)
        if not criu or len(set(criu)) < len(listed) or (staged_area.path_of(capsule) / ".complete").exists() \
                or any(store.has_blob(d) for d in criu):
            return None
        return cls(capsule, criu, [arrivals.follow(d) for d in criu])

    def _run(self) -> None:
        paths = [g.wait_started(timeout=120.0) for g in self.growing]
        if any(path is None for path in paths):
            for g in self.growing:  # nobody follows the others either: no stream waits on a reader that left
                g.broke()
            return
        private_dir(staged_area.root())
        root = staged_area.path_of(self.capsule)
        tmp = root.with_name(root.name + f".early{os.getpid()}.{threading.get_ident()}")
        self.journal = Journal.begin("stage", capsule=self.capsule)
        self.journal.add(Dir(str(tmp)))
        self.tmp = private_dir(tmp)
        t0 = time.monotonic()
        store = CapsuleStore(settings().store)
        # listed already (a small blob on a fast link): the same file, in the store
        files = [p if p is not None and p.exists() else store.blob_path(d) for p, d in zip(paths, self.criu)]
        try:
            unpack_layers(files, tmp / "images", following=self.growing)
            self.seconds = round(time.monotonic() - t0, 6)
        except Exception as e:  # noqa: BLE001 - only a head start lost: stage unpacks the verified blobs
            self.failed = e

    def take(self, capsule: str, criu: list[str]) -> tuple[Path, Journal] | None:
        """The directory with the images unpacked, and its journal, once the blobs they came from are verified (the
        caller publishes it); None: unpack as usual."""
        self.thread.join()
        if (capsule, criu) != (self.capsule, self.criu) or self.failed is not None or self.tmp is None \
                or self.journal is None or not all(g.verified(timeout=0) for g in self.growing):
            return None
        taken, self.tmp = (self.tmp, self.journal), None
        self.journal, self.taken = None, True
        return taken

    def discard(self) -> None:
        """Whatever was not taken goes (also on a restore's way out)."""
        self.thread.join()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self.journal is not None:
            self.journal.close()
            self.journal = None


def stage(capsule: LoadedCapsule, weights_arrive: Callable[[], None] | None = None,
          early: UnpackingEarly | None = None) -> StagedForRestore:
    """Verify every blob digest, check pinned weights, unpack CRIU images (cached per capsule digest), put back
    the CUDA code files the capsule's processes map. Each part is timed (StagedForRestore.parts, which receipts carry as
    `stage_parts`), so a receipt says which of them a first restore on a node waited for. weights_arrive (a streamed
    pull): the weights are still moving; their part (the wait included) is left to StagedForRestore.weights_later.
    early: the images unpacked while their blob arrived (a pull), published here once it is verified."""
    parts: dict[str, float] = {}
    store = CapsuleStore(settings().store)
    with _timed(parts, "verify"):
        store.verify(capsule)
    profile = capsule.profile
    later = None
    if reloads_weights(capsule):
        model = profile.model
        assert model is not None  # reloads_weights: there is a model

        def put_weights_in_place() -> None:
            with _timed(parts, "weights"):
                if weights_travel(capsule):
                    materialize(store, capsule, model.weights)
                verify_weights(model.weights)

        if weights_arrive is None:
            put_weights_in_place()
        else:
            def later(linked: list[str] | tuple = ()) -> None:
                with _timed(parts, "arrive"):
                    weights_arrive()
                for path in linked:  # the partial's links: the listed blob goes in their place, remembered verified
                    Path(path).unlink(missing_ok=True)
                put_weights_in_place()
    private_dir(staged_area.root())
    root = staged_area.path_of(capsule.digest)
    with _timed(parts, "unpack"):
        try:
            _unpack(store, capsule, root, early)
        except OSError:  # a concurrent restore of the same capsule removed or published the directory under us
            _unpack(store, capsule, root)
    if early is not None and early.taken and early.seconds is not None:
        parts["unpack_early"] = early.seconds  # while the images arrived: the unpack above only published them
    staged_area.used(capsule.digest)
    staged_area.evict(keep=frozenset({capsule.digest}))  # the area stays within its cap
    files = root / "files"
    staged = StagedForRestore(capsule=capsule, images=root / "images", files=files if files.exists() else None,
                              parts=parts, weights_later=later)
    with _timed(parts, "code"):  # big, and the same for every restore: here, off the restore's clock
        put_back_files(staged, only_code=True)
    return staged


def link_arriving(staged: StagedForRestore, arrivals: Arrivals, record: Callable[[list[str]], None],
                  timeout: float = 60.0) -> list[str] | None:
    """Weights still streaming in (staged.weights_later pending): each missing weight file linked at its pinned
    path to its blob's partial file, which has its full size from the start, so that CRIU can restore the
    processes that map it while its pieces arrive. Returns the paths linked ([]: every file is in place); None when
    a file cannot be linked (its blob comes as one stream): CRIU waits for the weights then. Nothing reads a linked
    file before every piece of it is checked against its pin (fetch.Arriving.checked); weights_later puts the listed
    blob in the link's place once the pull is over. record(paths) journals the paths before each is linked; the
    caller removes them if the restore ends before that."""
    model = staged.capsule.profile.model
    modes = pinned_modes(CapsuleStore(settings().store), staged.capsule)
    linked: list[str] = []
    try:
        for wf in model.weights if model else []:
            if os.path.exists(wf.path) and os.path.getsize(wf.path) > 0:
                continue
            if not wf.chunks:  # pinned whole: it comes as one stream, its partial growing as it does
                raise FileNotFoundError(wf.path)
            partial = arrivals.partial("sha256:" + wf.sha256, timeout)
            if partial is None:
                raise FileNotFoundError(wf.path)
            Path(wf.path).parent.mkdir(parents=True, exist_ok=True)
            os.chmod(partial, modes.get("sha256:" + wf.sha256, 0o644))  # as captured (CRIU checks); blobs/ is 0700
            linked.append(wf.path)
            record(list(linked))
            tmp = wf.path + ".coldsnap-tmp"
            os.link(partial, tmp)  # FileNotFoundError: listed meanwhile; weights_later finds it whole
            os.replace(tmp, wf.path)
    except OSError:
        unlink_all(linked)
        return None
    return linked


def linked_blobs(staged: StagedForRestore, paths: list[str]) -> dict[str, str]:
    """{path: digest of the weights blob} of the paths link_arriving linked."""
    model = staged.capsule.profile.model
    return {wf.path: "sha256:" + wf.sha256 for wf in (model.weights if model else []) if wf.path in paths}


def unlink_all(paths: list[str]) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)


@contextmanager
def _timed(parts: dict[str, float], name: str) -> Iterator[None]:
    start = time.monotonic()
    try:
        yield
    finally:
        parts[name] = round(time.monotonic() - start, 6)


def _unpack(store: CapsuleStore, capsule: LoadedCapsule, root: Path, early: UnpackingEarly | None = None) -> None:
    criu = [d.digest for d in capsule.layers_of(mt.LAYER_CRIU)]
    files = capsule.layer(mt.LAYER_FILES)
    if not criu:
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"capsule {capsule.digest} has no CRIU images layer")
    try:
        _unpack_layers(store, capsule.digest, criu, files.digest if files else None, root,
                       early.take(capsule.digest, criu) if early is not None else None)
    finally:
        if early is not None:
            early.discard()


def _unpack_layers(store: CapsuleStore, digest: str, criu: list[str], files: str | None, root: Path,
                   unpacked: tuple[Path, Journal] | None = None) -> None:
    """A capsule's CRIU images (its layers side by side) and files under root, published whole (root/.complete) or
    not at all. unpacked: a directory whose images/ an early unpack filled from the verified blobs
    (UnpackingEarly.take), and its journal."""
    done = root / ".complete"
    if done.exists():
        if unpacked is not None:  # a concurrent restore published it first
            shutil.rmtree(unpacked[0], ignore_errors=True)
            unpacked[1].close()
        return
    shutil.rmtree(root, ignore_errors=True)
    if unpacked is not None:
        tmp, journal = unpacked
    else:
        tmp = root.with_name(root.name + f".tmp{os.getpid()}.{threading.get_ident()}")
        journal = Journal.begin("stage", capsule=digest)  # a stager killed midway leaves no temp dir for long
        journal.add(Dir(str(tmp)))
        private_dir(tmp)
    try:
        if unpacked is None:
            unpack_layers([store.blob_path(d) for d in criu], tmp / "images")
        if files:
            unpack_layer(store.blob_path(files), tmp / "files")
        (tmp / ".complete").write_text(digest)
        try:
            os.replace(tmp, root)
        except OSError:
            if not done.exists():  # not a concurrent stager that finished first
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise out_of_room(e, tmp.parent, store.blob_path(criu[0])) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        journal.close()


def reloads_weights(capsule: LoadedCapsule) -> bool:
    """Whether the restored engine reloads its weights from files (recovery's pinned files, or native weights that
    travel as a payload), rather than finding them in its restored memory."""
    return bool(capsule.profile.model) and (weights_travel(capsule) or capsule.profile.weights_mode == "recovery")


def weights_travel(capsule: LoadedCapsule) -> bool:
    """Its weight files travel with it (layers of their own, or an earlier capsule's payload)."""
    return bool(capsule.payload) or capsule.layer(mt.LAYER_WEIGHTS) is not None


def put_back_files(staged: StagedForRestore, only_code: bool = False) -> None:
    """Files the process held open must look as they did at the dump (CRIU checks their size): the run dir's log,
    host /dev/shm state, CUDA code files (only those with only_code). Sparse, atomic, with their recorded mode."""
    for i, f in enumerate(staged.capsule.profile.files):
        if not only_code or codestash.is_code_file(f.path):
            hostfiles.put_back_file(staged.files / str(i) if staged.files else None, f)
