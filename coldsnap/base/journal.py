"""The journal of operations in flight: <run>/ops/<id>.json (0600), one per capture, restore, staging or container
create, the way runc and containerd keep state directories.

An operation opens its entry before it touches the host and adds each thing it is about to make (a network, a
workload's process tree, a directory, a file, a container) before making it: write-ahead, so a SIGKILL at any
point leaves a record of everything that might exist. Handing a thing over (a workload now owned by its state file)
removes it from the entry; the entry goes when the operation ends. The owner is the process that opened the entry,
known by PID and start time (a PID alone can be reused): while it lives nobody else touches its things; once it is
gone, coldsnap.flows.recovery undoes them.

Stdlib only: the shim's paths use it too."""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar, dataclass_transform

from coldsnap.base.files import private_dir, write_run_state
from coldsnap.base.paths import settings
from coldsnap.base.procfs import alive


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def same_process(pid: int | None, started: int | None) -> bool:
    """Whether pid still names the process that had this start time (not a later one given the same PID)."""
    if not pid or started is None:
        return False
    return start_time(pid) == started and alive(pid)


THINGS: dict[str, type[Thing]] = {}


# --- what an operation records, kind by kind (the file says each one's kind; recovery reads them by type) ---------
@dataclass_transform(eq_default=False)
@dataclass(eq=False)
class Thing:
    """Each kind is a dataclass compared by identity (drop() and `in`), registered in THINGS under its kind."""

    kind: ClassVar[str] = ""

    def __init_subclass__(cls, kind: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind = kind
        dataclass(eq=False)(cls)
        THINGS[kind] = cls


class Dir(Thing, kind="dir"):
    """A work, staging or scratch directory (workload_dir: the workload's run directory, kept with a kept workload)."""

    path: str
    workload_dir: bool = False


class Network(Thing, kind="network"):
    """A network namespace with its veth and addresses: a NetworkPlan's JSON (pydantic stays off this floor)."""

    plan: dict[str, Any]


class Workload(Thing, kind="workload"):
    """A workload's process tree in its network namespace; pid and start once it runs."""

    name: str
    netns: str
    pid: int | None = None
    start: int | None = None


class Validated(Thing, kind="validated"):
    """The capture's workload answered its validation: a --leave-running workload is kept from here on."""


class Released(Thing, kind="released"):
    """An engine released for the dump: resumed if the operation dies (container_pid: a container's engine)."""

    engine: str
    weights_mode: str
    port: int
    host: str | None = None
    container_pid: int | None = None


class ShmFiles(Thing, kind="files"):
    """Host /dev/shm files a dumped tree used (with_workload: they go with the workload)."""

    paths: list[str]
    with_workload: bool = False


class Linked(Thing, kind="linked"):
    """Weight files linked at their pinned paths to blobs still streaming in: removed if the operation dies before
    the whole blobs took their place."""

    paths: list[str]


class CudaTree(Thing, kind="cuda"):
    """A process tree whose CUDA state the driver checkpointed: restored if the operation dies."""

    root: int


class Blob(Thing, kind="blob"):
    """A store blob a capture wrote or reuses: gc spares it until the capsule is indexed."""

    digest: str


def _thing_of(data: dict[str, Any]) -> Thing | None:
    """A thing from its JSON; None for a kind this version does not know."""
    cls = THINGS.get(data.get("kind", ""))
    if cls is None:
        return None
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


T = TypeVar("T", bound=Thing)


def ops_dir() -> Path:
    return settings().run / "ops"


@dataclass
class Journal:
    path: Path
    kind: str
    owner: dict
    things: list[Thing] = field(default_factory=list)
    about: dict = field(default_factory=dict)

    @classmethod
    def begin(cls, kind: str, **about) -> "Journal":
        """Open the entry of an operation this process runs."""
        pid = os.getpid()
        journal = cls(path=private_dir(ops_dir()) / f"{kind}-{uuid.uuid4().hex[:12]}.json", kind=kind,
                      owner={"pid": pid, "start": start_time(pid)}, about=about)
        journal._write()
        return journal

    @classmethod
    def load(cls, path: Path) -> "Journal | None":
        try:
            data = json.loads(path.read_text())
            things = [t for t in (_thing_of(x) for x in data["things"]) if t is not None]
            return cls(path=path, kind=str(data["kind"]), owner=dict(data["owner"]), things=things,
                       about=dict(data.get("about") or {}))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write(self) -> None:
        things = [{"kind": t.kind, **asdict(t)} for t in self.things]
        write_run_state(self.path, json.dumps({"kind": self.kind, "owner": self.owner, "about": self.about,
                                               "things": things}, indent=1).encode())

    def add(self, thing: T) -> T:
        """Record a thing before making it (written to disk before this returns)."""
        self.things.append(thing)
        self._write()
        return thing

    def update(self, thing: Thing, **more: Any) -> None:
        """Add what became known about a thing (e.g. the PID of a process once it started)."""
        for name, value in more.items():
            if not hasattr(thing, name):
                raise AttributeError(f"a {thing.kind} has no {name}")
            setattr(thing, name, value)
        self._write()

    def of(self, kind: type[T]) -> list[T]:
        return [t for t in self.things if isinstance(t, kind)]

    def drop(self, entry: Thing) -> None:
        """The thing is gone, or handed over to its next owner (a workload's state file)."""
        self.things = [t for t in self.things if t is not entry]
        self._write()

    def close(self) -> None:
        """The operation ended: whatever it made is gone or owned by someone else now."""
        self.path.unlink(missing_ok=True)

    def owner_alive(self) -> bool:
        return same_process(self.owner.get("pid"), self.owner.get("start"))


def entries() -> list[Journal]:
    root = ops_dir()
    journals = [Journal.load(path) for path in sorted(root.glob("*.json"))] if root.is_dir() else []
    return [j for j in journals if j is not None]
