"""Admission: load the capsule a request names and compare it with what restores it (snapshot driver, image) and
with this host; admit or refuse with reasons. One implementation for process and container restores."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from coldsnap.base.paths import settings
from coldsnap.base.soon import Soon
from coldsnap.capsule import CapsuleStore, LoadedCapsule
from coldsnap.contracts import ColdSnapError, ContainerLaunch, Distributed, ErrorCode, HostProfile, Policy
from coldsnap.criu import CriuDriver
from coldsnap.host.profile import host_profile
from coldsnap.oci.spec import annotations_of, netns_path


@dataclass
class Admission:
    admitted: bool
    differences: list[str] = field(default_factory=list)  # each one a sentence saying what differs
    warnings: list[str] = field(default_factory=list)
    untrusted: bool = False  # refused by the restore policy (who may restore it), not by the host
    # seconds it took (the receipt's admit_parts): trust, the policy and signatures; host, this host's profile
    # (looked up, or waited for where a pull started the look beside it); host_criu and host_rest, what the look's
    # steps took where it ran (CRIU's version; the CPU and the GPUs through NVML), beside a pull or not
    parts: dict[str, float] = field(default_factory=dict)

    def sentence(self) -> str:
        return "; ".join(self.differences) or "compatible"

    def refusal(self) -> ColdSnapError:
        if self.untrusted:
            return ColdSnapError(ErrorCode.UNTRUSTED, f"restore policy refused the capsule: {self.sentence()}")
        return ColdSnapError(ErrorCode.INCOMPATIBLE, f"capsule refused on this host: {self.sentence()}")


def _major_minor(v: str | None) -> str:
    return ".".join((v or "").split(".")[:2])


def admit(captured: HostProfile, host: HostProfile, strictness: str = "strict",
          distributed: Distributed | None = None, device_state: bool = True) -> Admission:
    """strict: everything the capsule recorded must match. relaxed: only what is known to break a restore.
    A distributed capsule (several ranks, one GPU each) needs the same GPU count and the same links between them:
    each rank's CUDA state names its device, and NCCL chose its paths for the topology it found.
    device_state False (a criu-template capsule: captured before the device was touched): the GPU model, driver and
    CUDA version need not match, only the GPU count and the architecture family (compute capability major)."""
    blocking: list[str] = []
    soft: list[str] = []

    def check(ok: bool, what: str, strict_only: bool) -> None:
        if not ok:
            (soft if strict_only and strictness == "relaxed" else blocking).append(what)

    check(captured.arch == host.arch, f"architecture {captured.arch} vs {host.arch} here", False)
    missing = sorted(set(captured.cpu_flags) - set(host.cpu_flags))
    check(not missing, f"CPU lacks flags the captured process may use: {', '.join(missing[:8])}"
          + ("…" if len(missing) > 8 else ""), False)
    check(captured.cpu_model == host.cpu_model, f"CPU {captured.cpu_model!r} vs {host.cpu_model!r} here", True)
    check(captured.kernel == host.kernel, f"kernel {captured.kernel} vs {host.kernel} here", True)
    check(_major_minor(captured.criu_version) == _major_minor(host.criu_version),
          f"CRIU {captured.criu_version} vs {host.criu_version} here", True)
    if captured.gpus or host.gpus:
        check(len(captured.gpus) <= len(host.gpus),
              f"{len(captured.gpus)} GPU(s) captured, {len(host.gpus)} here", False)
        for cg, hg in zip(captured.gpus, host.gpus):
            if not device_state:
                family = str(cg.compute_capability).split(".")[0] == str(hg.compute_capability).split(".")[0]
                check(family, f"GPU {cg.index} architecture family (compute capability {cg.compute_capability}) "
                      f"vs {hg.compute_capability} here", False)
                continue
            check(cg.name == hg.name, f"GPU {cg.index} {cg.name} vs {hg.name} here", False)
            check(cg.compute_capability == hg.compute_capability,
                  f"GPU {cg.index} compute capability {cg.compute_capability} vs {hg.compute_capability}", False)
        if captured.gpus and device_state:
            check(captured.driver_version == host.driver_version,
                  f"NVIDIA driver {captured.driver_version} vs {host.driver_version} here", True)
            check((captured.driver_version or "").split(".")[0] == (host.driver_version or "").split(".")[0],
                  f"NVIDIA driver branch {captured.driver_version} vs {host.driver_version} here", False)
            check(captured.cuda_version == host.cuda_version,
                  f"CUDA {captured.cuda_version} vs {host.cuda_version} here", False)
    if distributed is not None and distributed.backend == "nccl":
        check(len(captured.gpus) == len(host.gpus),
              f"captured with {distributed.world_size} ranks on a host of {len(captured.gpus)} GPU(s), "
              f"this host has {len(host.gpus)}", False)
        check(captured.gpu_links == host.gpu_links,
              f"GPU topology {', '.join(captured.gpu_links) or 'unknown'} vs {', '.join(host.gpu_links) or 'none'} "
              "here", False)
    return Admission(admitted=not blocking, differences=blocking, warnings=soft)


# this host's profile, being found ahead of the next admission
_looked: list[Soon[tuple[HostProfile, dict[str, float]]]] = []


def look_at_this_host_soon() -> None:
    """Start finding this host's profile (CRIU's version, the GPUs through NVML: ~0.1 s) on a thread of its own,
    for a restore that waits on the network meanwhile (its pull); the next admission takes it."""
    _looked.append(Soon(_look, "coldsnap-host-profile"))
    # the restore's CRIU library, loaded meanwhile too (nobody waits for it here; the restore's first use does)
    threading.Thread(target=_load_pycriu, name="coldsnap-pycriu", daemon=True).start()


def _load_pycriu() -> None:
    from coldsnap.criu.driver import _pycriu

    try:
        _pycriu()
    except ColdSnapError:  # not importable here: the restore says so
        pass


def _look() -> tuple[HostProfile, dict[str, float]]:
    """This host's profile, and what its steps took (host_criu, host_rest)."""
    t = time.monotonic()
    criu = CriuDriver().version()
    t1 = time.monotonic()
    here = host_profile(criu)
    return here, {"host_criu": round(t1 - t, 4), "host_rest": round(time.monotonic() - t1, 4)}


def _this_host() -> tuple[HostProfile, dict[str, float]]:
    while _looked:
        try:
            found = _looked.pop().result()
        except Exception:  # noqa: BLE001 - looked at again below, which says what is wrong
            continue
        _looked.clear()
        return found
    return _look()


def load_capsule(ref: str, allow_unpinned: bool) -> LoadedCapsule:
    """The capsule a reference names, from the local store (its manifest and profile parsed, blobs not yet hashed)."""
    store = CapsuleStore(settings().store)
    return store.load(store.resolve(ref, allow_unpinned=allow_unpinned))


def container_differences(captured: ContainerLaunch, spec: dict) -> list[str]:
    """What the new container lacks that the captured one had, first difference first: CRIU rebuilds the captured
    mount tree and namespaces, and cannot where a mount or a namespace is missing ("No mapping for … mountpoint")."""
    mounts = {os.path.normpath(str(m.get("destination", ""))) for m in spec.get("mounts") or [] if isinstance(m, dict)}
    out = [f"{m.destination} was mounted ({m.type}) at capture and is not in this container"
           for m in captured.mounts if m.destination not in mounts]
    types = {ns.get("type") for ns in (spec.get("linux") or {}).get("namespaces") or [] if isinstance(ns, dict)}
    out += [f"the captured container had its own {t} namespace and this one has none"
            for t in captured.namespaces if t not in types]
    network = "host" if "network" not in types else ("path" if netns_path(spec) else "own")
    where = {"host": "the host's network", "own": "a network namespace of its own", "path": "a named network namespace"}
    if network != captured.network and "host" in (network, captured.network):
        out.append(f"the captured container ran in {where[captured.network]} and this one in {where[network]}")
    return out


def admit_capsule(capsule: LoadedCapsule, policy: Policy, driver: str, image_digest: str | None = None,
                  spec: dict | None = None) -> Admission:
    """Whether this host may restore the capsule with `driver` (criu-process for a process restore, criu-runc for a
    container; spec: the new container's config.json), the first refusal first."""
    profile = capsule.profile
    if profile.snapshot_driver != driver:
        return Admission(admitted=False, differences=[
            f"capsule {capsule.digest} was captured with the {profile.snapshot_driver} driver; this restore needs "
            f"{driver}"])
    t = time.monotonic()
    from coldsnap.capsule import trust

    annotations = annotations_of(spec) if spec is not None else None
    verdict = trust.check(capsule, CapsuleStore(settings().store), annotations, image_digest)
    parts = {"trust": round(time.monotonic() - t, 4)}
    if verdict.refusal:
        return Admission(admitted=False, differences=[verdict.refusal], untrusted=True, parts=parts)
    if image_digest and profile.image_digest and image_digest != profile.image_digest:
        return Admission(admitted=False, differences=[
            f"container image {image_digest} differs from the captured image {profile.image_digest}"])
    if spec is not None and profile.container is not None:
        differences = container_differences(profile.container, spec)
        if differences:
            return Admission(admitted=False, differences=differences[:1])
    t = time.monotonic()
    here, took = _this_host()
    parts["host"] = round(time.monotonic() - t, 4)
    parts.update(took)
    admission = admit(profile.host, here, policy.compatibility, profile.distributed,
                      device_state=profile.snapshot_driver != "criu-template")
    admission.parts = parts
    return admission
