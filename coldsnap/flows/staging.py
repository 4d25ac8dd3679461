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
from coldsnap.capsule import CapsuleStore, LoadedCapsule, unpack_layer
from coldsnap.capsule import staged as staged_area
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


def stage(capsule: LoadedCapsule, weights_arrive: Callable[[], None] | None = None) -> StagedForRestore:
    """Verify every blob digest, check pinned weights, unpack CRIU images (cached per capsule digest), put back
    the CUDA code files the capsule's processes map. Each part is timed (StagedForRestore.parts, which receipts carry as
    `stage_parts`), so a receipt says which of them a first restore on a node waited for. weights_arrive (a streamed
    pull): the weights are still moving; their part (the wait included) is left to StagedForRestore.weights_later."""
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
            _unpack(store, capsule, root)
        except OSError:  # a concurrent restore of the same capsule removed or published the directory under us
            _unpack(store, capsule, root)
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


def _unpack(store: CapsuleStore, capsule: LoadedCapsule, root: Path) -> None:
    criu, files = capsule.layer(mt.LAYER_CRIU), capsule.layer(mt.LAYER_FILES)
    if criu is None:
        raise ColdSnapError(ErrorCode.CAPSULE_CORRUPT, f"capsule {capsule.digest} has no CRIU images layer")
    _unpack_layers(store, capsule.digest, criu.digest, files.digest if files else None, root)


def _unpack_layers(store: CapsuleStore, digest: str, criu: str, files: str | None, root: Path) -> None:
    """A capsule's CRIU images and files under root, published whole (root/.complete) or not at all."""
    done = root / ".complete"
    if done.exists():
        return
    shutil.rmtree(root, ignore_errors=True)
    tmp = root.with_name(root.name + f".tmp{os.getpid()}.{threading.get_ident()}")
    journal = Journal.begin("stage", capsule=digest)  # a stager killed midway leaves no temp dir for long
    journal.add(Dir(str(tmp)))
    private_dir(tmp)
    try:
        unpack_layer(store.blob_path(criu), tmp / "images")
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
        raise out_of_room(e, tmp.parent, store.blob_path(criu)) from None
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
