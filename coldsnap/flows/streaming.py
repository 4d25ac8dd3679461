"""Weights that arrive while a restore goes on (a streamed pull: coldsnap.flows.fetch): what a restore does with
them, one owner for process and container restores alike.

  link_or_wait   each missing weight file linked at its path to its blob's partial file (journaled first), so that
                 CRIU restores the processes that map it while its pieces arrive; where a file comes as one stream,
                 the weights are waited for and put in place before CRIU instead (span "weights")
  for_prefetch   the prefetchers take each piece as it is checked against its pin, from memory (the spool); or,
                 direct (Arrivals.goes_direct), fetch the pieces from the registry themselves, checking each
  PrefetchAhead  direct, one file onto one GPU: its prefetcher (started on standby while the pull waits) is given
                 its orders as soon as the capsule's profile is in, so the weights stream onto the GPU while the
                 images arrive and the restore admits and stages; admission still decides, and nothing reaches an
                 engine before it has
  before_resume  every piece checked; the engine may resume before its files hold them only when every prefetcher
                 says it holds its weights; otherwise the files are written first
  check_taken    an engine resumed ahead of its files must have taken the prefetched copy, or it does not serve
  settle         after the first token: the listed blob in the links' place, remembered checked
  undo           a restore that ends before that removes its links (its journal does, if it is killed)

Nothing unverified reaches a serving engine: the links' pieces are read only once checked."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from coldsnap.base.files import private_dir
from coldsnap.base.journal import Journal, Linked
from coldsnap.base.paths import settings
from coldsnap.capsule import LoadedCapsule
from coldsnap.capsule.pieces import Arrivals
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.engines import get_adapter
from coldsnap.flows.fetch import Arriving
from coldsnap.flows.spans import Timeline
from coldsnap.flows.staging import StagedForRestore, link_arriving, linked_blobs, reloads_weights, unlink_all
from coldsnap.gpu.steps import Prefetch, Standby, Streaming, start_prefetch_soon

DIRECT_WAIT_S = 150.0  # a direct prefetcher's whole life (its watchdog ends it 30 s past its 120 s timeout)


@dataclass
class ArrivingWeights:
    staged: StagedForRestore
    arriving: Arriving
    journal: Journal
    linked: Linked  # the journal's entry: the paths linked to partial files
    blobs: dict[str, str]  # {linked path: digest of its blob}
    ahead_of_files: bool = False  # the engine resumes with its weights on its GPUs, its files still being written
    wait_s: float | None = None  # what the engine's resume waited for them (the receipt's hydrate.weights_wait_s)

    def for_prefetch(self) -> dict[str, Streaming] | None:
        """The prefetchers' view of the files still arriving: the ranges checked so far, and the memory they land
        in (or, direct, the pieces the pull offers a prefetcher to fetch itself); None when every file was in place
        already."""
        return _streams(self.arriving.pieces, self.blobs, self.arriving.pieces.goes_direct()) or None

    def before_resume(self, prefetch: Prefetch) -> None:
        """Until the engine may take its weights: every piece checked, and on its GPUs (every prefetcher loaded)
        or else in its files. Raises what failed the pull."""
        if not self.blobs:
            return
        t = time.monotonic()
        digests = list(self.blobs.values())
        if prefetch.direct:  # its prefetcher fetched and checked them itself; the pull fetches them after the token
            # and the files' heads, which the engine reads its headers from (the pull fetched them meanwhile)
            self.ahead_of_files = prefetch.loaded(timeout=DIRECT_WAIT_S) and all(
                self.arriving.pieces.head_in(d, timeout=DIRECT_WAIT_S) for d in digests)
            if not self.ahead_of_files:
                self.arriving.filed(digests)  # asks the pull for them now; raises what failed it
            self.wait_s = round(time.monotonic() - t, 4)
            return
        self.arriving.checked(digests)
        self.ahead_of_files = prefetch.loaded(timeout=60.0)
        if not self.ahead_of_files:
            self.arriving.filed(digests)
        self.wait_s = round(time.monotonic() - t, 4)

    def check_taken(self, adapter, resumed) -> None:
        """An engine resumed ahead of its files that read them instead of the prefetched copy read pieces not yet
        written: it must not serve."""
        if self.ahead_of_files and adapter.prefetch_taken(resumed) is False:
            why = adapter.prefetch_error(resumed)
            raise ColdSnapError(ErrorCode.GPU_FAILED, "the engine read its weights files instead of the prefetched "
                                "copy while the files were still arriving: not let serve"
                                + (f" (it could not take the copy: {why})" if why else ""))

    def settle(self) -> None:
        """After the first token: the pull's end waited for, and the listed blob put in the links' place."""
        assert self.staged.weights_later is not None
        self.staged.weights_later(self.linked.paths)
        self.staged.weights_later = None
        self.journal.drop(self.linked)

    def undo(self) -> None:
        """A restore that ends before settle: the links go (the partial's: nothing may read them later); the
        weights, if someone still needs them (a cold start), come through staged.weights_later."""
        if self.linked in self.journal.things:
            unlink_all(self.linked.paths)
            self.journal.drop(self.linked)


def _streams(pieces: Arrivals, blobs: dict[str, str], direct: bool) -> dict[str, Streaming]:
    """{path: Streaming} of the files arriving as the blobs of `blobs` ({path: digest})."""
    return {path: Streaming(pieces.pieces(digest, timeout=120.0), None if direct else pieces.spool(digest),
                            direct=(lambda d=digest: pieces.direct(d, timeout=120.0)) if direct else None,  # type: ignore[misc]
                            decline=pieces.file_now if direct else None)
            for path, digest in blobs.items()}


class PrefetchAhead:
    """A direct pull's prefetch, ordered as early as it can be: its standby prefetcher (started while the pull waits
    on the registry) takes its orders once the capsule's profile is in (the pull's on_profile, the weights' head
    moving beside the images), or at the latest once its own blobs are (taken, at admission). Whichever of the
    standby and the profile comes second gives them; the restore takes the prefetch instead of starting its own."""

    def __init__(self, gpu_map: dict[str, str]) -> None:
        self._gpu_map = gpu_map
        self._lock = threading.Lock()
        self._standby: Standby | None = None
        self._known: tuple[LoadedCapsule, Arrivals] | None = None
        self._started: Callable[[], Prefetch] | None = None
        self._ordered = False  # once: orders given, or the standby dismissed

    def stand_by(self, standby: Standby) -> None:
        """The standby prefetcher, started (the restore's thread, while the pull waits)."""
        with self._lock:
            self._standby = standby
            self._order()

    def profile_in(self, capsule: LoadedCapsule, arrivals: Arrivals) -> None:
        """The capsule's profile is in the store, verified, not yet trusted (the pull's thread, before the weights
        move): the direct way is chosen where one prefetcher takes its weights, else they are spooled."""
        arrivals.choose_direct(direct_fits(capsule))
        with self._lock:
            self._known = (capsule, arrivals)
            self._order()

    def taken(self, capsule: LoadedCapsule, arriving: Arriving | None) -> Callable[[], Prefetch] | None:
        """At admission: the prefetch started for the pulled capsule (now, if its profile came no sooner); None,
        the standby dismissed, where none applies. Whoever takes it reaps it."""
        with self._lock:
            if self._known is None and arriving is not None:
                self._known = (capsule, arriving.pieces)
            self._order()
            if not self._ordered and self._standby is not None:
                self._standby.dismiss()
            self._ordered = True
            return self._started

    def _order(self) -> None:
        if self._ordered or self._standby is None or self._known is None:
            return
        self._ordered = True
        capsule, arrivals = self._known
        self._started = prefetch_ahead(capsule, arrivals, self._gpu_map, self._standby)


def direct_fits(capsule: LoadedCapsule) -> bool:
    """Whether one prefetcher can take the capsule's weights from the registry: one file, pinned by pieces, not on
    this node yet, for a process restore onto one GPU of an engine that reloads its weights and takes them
    prefetched."""
    profile = capsule.profile
    weights = profile.model.weights if profile.model else []
    if (len(weights) != 1 or not weights[0].chunks or len(profile.gpus_used) != 1 or profile.prefetch_plans
            or profile.snapshot_driver != "criu-process" or not reloads_weights(capsule)):
        return False
    if os.path.exists(weights[0].path) and os.path.getsize(weights[0].path) > 0:
        return False
    try:
        return get_adapter(profile.engine.name).supports_prefetch
    except ColdSnapError:  # an engine this host does not know: admission says so
        return False


def prefetch_ahead(capsule: LoadedCapsule, arrivals: Arrivals, gpu_map: dict[str, str],
                   standby: Standby) -> Callable[[], Prefetch] | None:
    """A direct pull of one weights file for one GPU: the prefetch started now, the standby prefetcher taking the
    weights' pieces from the registry as soon as the pull offers them. None where that does not apply (the standby
    is dismissed; the restore's prefetch starts as usual)."""
    if not (arrivals.goes_direct() and direct_fits(capsule)):
        standby.dismiss()
        return None
    profile = capsule.profile
    weights = profile.model.weights  # type: ignore[union-attr]  # direct_fits: one file
    streams = _streams(arrivals, {weights[0].path: "sha256:" + weights[0].sha256}, direct=True)
    return start_prefetch_soon(profile, True, gpu_map, private_dir(settings().run / "prefetch"),
                               by_file=get_adapter(profile.engine.name).prefetch_by_file, arrivals=streams,
                               standby=standby)


def link_or_wait(staged: StagedForRestore, arriving: Arriving | None, journal: Journal,
                 tl: Timeline) -> ArrivingWeights | None:
    """Weights still streaming in: linked at their paths, so that CRIU restores while they arrive; or, where some
    file comes as one stream (or nothing streams), waited for and put in place first (span "weights"). None:
    nothing is linked, every weight file is in place."""
    if staged.weights_later is None:
        return None
    if arriving is not None:
        entry = journal.add(Linked([]))
        paths = link_arriving(staged, arriving.pieces, lambda p: journal.update(entry, paths=p))
        if paths is not None:
            return ArrivingWeights(staged, arriving, journal, entry, linked_blobs(staged, paths))
        journal.drop(entry)
    with tl.span("weights"):
        staged.weights_later()
        staged.weights_later = None
    return None
