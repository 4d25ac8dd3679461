"""The last step of every capture, process or container: thin the dump, pack the capsule (coldsnap.capsule.assemble),
and say what the receipt says of it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from coldsnap.base.journal import Journal
from coldsnap.base.paths import settings
from coldsnap.base.progress import Progress
from coldsnap.capsule import CapsuleStore
from coldsnap.capsule.assemble import pack_capsule, weights_travel_apart
from coldsnap.contracts import CapsuleProfile, CapturedFile, EngineRelease, Receipt
from coldsnap.contracts.results import CaptureFacts, ZeroPages
from coldsnap.criu import drop_zero_pages
from coldsnap.flows.resources import out_of_room
from coldsnap.flows.spans import Timeline


@dataclass
class CaptureResult:
    capsule: str
    profile: CapsuleProfile
    receipt: Receipt


def thin_and_pack(images: Path, files: list[CapturedFile], profile: CapsuleProfile, tag: str | None,
                  released: EngineRelease | None, tl: Timeline, progress: Progress, *,
                  sources: dict[str, str] | None = None, journal: Journal | None = None,
                  template_capsule: str | None = None, **facts) -> CaptureFacts:
    """Drop the dump's zero pages, pack the capsule; returns the capture's result: what the capsule is, with the
    capture's own facts."""
    with tl.span("thin"):
        thinned = drop_zero_pages(images)
    progress(thinned.summary)
    store = CapsuleStore(settings().store).init()
    with tl.span("pack"):
        progress("packing the capsule")
        try:
            packed = pack_capsule(store, images, files, profile, tag,
                                  weights_apart=weights_travel_apart(profile, released), sources=sources,
                                  journal=journal, template_capsule=template_capsule)
        except OSError as e:
            raise out_of_room(e, store.root / "tmp", images) from None
    progress(f"capsule {packed.digest} ({packed.size / 2**20:.1f} MiB), signed by this host's key "
             f"{packed.signed_by[:12]}…")
    return CaptureFacts(capsule=packed.digest, capsule_bytes=packed.size, weights_apart=packed.weights_apart,
                        signed_by=packed.signed_by, zero_pages=ZeroPages(**thinned.as_dict()), tag=tag, **facts)
