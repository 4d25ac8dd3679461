"""The shim's record of a container it handled: /run/coldsnap/shim/<id>.json (COLDSNAP_RUN moves it).

It says whether `create` restored the container (then `start` is answered without runc, since a restored
container is already running and was validated at create) or fell back to a cold start, and the line the
poststart hook prints. Stdlib only."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any


class Outcome(str, Enum):
    """What `create` did with the container."""

    RESTORING = "restoring"  # runc restore under way (its shim alive), or interrupted (its shim gone)
    RESTORED = "restored"  # running as restored, validated at create
    FELL_BACK = "fell-back"  # started cold by runc (the reason says why)


@dataclass
class Owner:
    pid: int
    start: int | None  # its start time (a PID alone can be reused)


@dataclass
class ShimRecord:
    """The record of one container the shim handled (stdlib only: the shim's start and delete read it)."""

    outcome: Outcome
    id: str
    root: str
    bundle: str
    runc: str = ""
    owner: Owner | None = None  # the shim that restores it (restoring)
    capsule: str = ""
    pid: int | None = None  # host PID of the restored init
    work_dir: str | None = None  # runc's and CRIU's logs of the restore
    started: bool = False
    validated: bool = False  # restored: served the completion validated at capture (at create)
    reason: str | None = None  # fell-back: why
    receipt: str | None = None
    summary: str | None = None  # restored: the line the poststart hook prints

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ShimRecord":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["outcome"] = Outcome(values["outcome"])
        if isinstance(values.get("owner"), dict):
            values["owner"] = Owner(pid=int(values["owner"]["pid"]), start=values["owner"].get("start"))
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["outcome"] = self.outcome.value
        return data

# Host-global markers, one per container the shim keeps a record of (wherever COLDSNAP_RUN puts the records): the
# coldsnap-runc launcher sends `start` and `delete` of a marked container to the shim, all others straight to runc.
# A marker is named <FNV-1a 64 of the runc root's real path>-<id> (ids are unique per root, not per host).
MARKERS = "/run/coldsnap-shim"


def root_key(root: str) -> str:
    h = 0xCBF29CE484222325
    for byte in os.path.realpath(root).encode():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def marker_path(root: str, container_id: str) -> str:
    return os.path.join(MARKERS, f"{root_key(root)}-{container_id}")


def _mark(root: str | None, container_id: str, present: bool) -> None:
    if not root:
        return
    path = marker_path(root, container_id)
    try:
        if present:
            os.makedirs(MARKERS, mode=0o700, exist_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        else:
            os.unlink(path)
    except OSError:
        pass  # a missing marker only sends the call through the shim's slower door


def state_dir() -> str:
    # COLDSNAP_RUN read here, not through base.paths.settings(): the shim's start and delete import nothing but oci/
    return os.path.join(os.environ.get("COLDSNAP_RUN", "/run/coldsnap"), "shim")


def _checked(container_id: str) -> str:
    if not container_id or "/" in container_id or container_id.startswith("."):
        raise ValueError(f"unusable container id {container_id!r}")
    return container_id


def state_path(container_id: str) -> str:
    return os.path.join(state_dir(), f"{_checked(container_id)}.json")


def work_dir_path(container_id: str) -> str:
    """Where a restore of this container keeps runc's and CRIU's logs (removed with the record)."""
    return os.path.join(state_dir(), "work", _checked(container_id))


def load(container_id: str | None) -> ShimRecord | None:
    """The container's record; None when there is none or it cannot be read."""
    if not container_id:
        return None
    try:
        with open(state_path(container_id), encoding="utf-8") as f:
            return ShimRecord.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(container_id: str, record: ShimRecord) -> str:
    from coldsnap.base.files import write_run_state  # not on the pass-through path

    path = state_path(container_id)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    _mark(record.root, container_id, True)  # first: a marker without a record only costs a call the shim's start
    write_run_state(path, json.dumps(record.to_json(), indent=1).encode("utf-8"))
    return path


def belongs(record: ShimRecord | None, root: str) -> bool:
    """A record applies only to the runc root it was made under (ids are unique per root, not per host)."""
    return record is not None and os.path.realpath(record.root) == os.path.realpath(root)


def forget(container_id: str) -> None:
    """The container is gone: its record goes, and the work directory the record names. (Not the work directory
    of a restore in progress, which has no record yet: runc runs the poststop hook when a restore fails, and the
    shim keeps CRIU's log from it before it cleans up.)"""
    import shutil

    record = load(container_id)
    if record is not None and record.work_dir:
        shutil.rmtree(record.work_dir, ignore_errors=True)
    try:
        os.unlink(state_path(container_id))
    except (ValueError, FileNotFoundError):
        pass
    _mark(record.root if record else None, container_id, False)
