"""A workload's name, claimed: the check that no workload of that name runs or is being made in this home, and the
record that this operation makes it, taken as one step under the home's claims lock.

The record is a journal entry of its own (kind "claim"), owned by this process. It holds from admission until the
workload's state file is written — from then on the state file and its live process hold the name — and goes on
every way out of the block. A claim whose owner dies (SIGKILL) holds nothing: the journal knows its owner by PID
and start time, and recovery removes the entry. Host-wide names (network namespaces, addresses, veths) are chosen
and made under the host's network lock (coldsnap.net), so two homes never collide on them."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from coldsnap.base import journal as journals
from coldsnap.base.locks import locked
from coldsnap.base.paths import settings
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.workload.state import refuse_running

CLAIM = "claim"


def claimant(name: str) -> journals.Journal | None:
    """The live operation that holds this name now, if one does."""
    return next((j for j in journals.entries()
                 if j.kind == CLAIM and j.about.get("workload") == name and j.owner_alive()), None)


@contextmanager
def claimed(name: str, operation: str) -> Iterator[None]:
    """The name is this operation's for the block; RESOURCE_BUSY (exit 6), touching nothing, when a live workload
    or another live operation has it."""
    with locked(settings().run / "workloads" / ".claims.lock"):
        refuse_running(name)
        holder = claimant(name)
        if holder is not None:
            raise ColdSnapError(ErrorCode.RESOURCE_BUSY,
                                f"workload {name!r} is being made by another {holder.about.get('operation')} "
                                f"(pid {holder.owner.get('pid')}): wait for it, or choose another --name")
        claim = journals.Journal.begin(CLAIM, workload=name, operation=operation)
    try:
        yield
    finally:
        claim.close()
