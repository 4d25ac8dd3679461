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
from dataclasses import dataclass, field
from pathlib import Path

from coldsnap.base.files import atomic_write, private_dir
from coldsnap.base.paths import settings


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
    now = start_time(pid)
    if now != started:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def ops_dir() -> Path:
    return settings().run / "ops"


@dataclass
class Journal:
    path: Path
    kind: str
    owner: dict
    things: list[dict] = field(default_factory=list)
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
            return cls(path=path, kind=str(data["kind"]), owner=dict(data["owner"]), things=list(data["things"]),
                       about=dict(data.get("about") or {}))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write(self) -> None:
        atomic_write(self.path, json.dumps({"kind": self.kind, "owner": self.owner, "about": self.about,
                                            "things": self.things}, indent=1).encode())

    def add(self, kind: str, **thing) -> dict:
        """Record a thing before making it (written to disk before this returns)."""
        entry = {"kind": kind, **thing}
        self.things.append(entry)
        self._write()
        return entry

    def update(self, entry: dict, **more) -> None:
        """Add what became known about a thing (e.g. the PID of a process once it started)."""
        entry.update(more)
        self._write()

    def drop(self, entry: dict) -> None:
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
    out = []
    for path in sorted(root.glob("*.json")) if root.is_dir() else []:
        journal = Journal.load(path)
        if journal is not None:
            out.append(journal)
    return out
