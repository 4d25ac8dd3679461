"""poststop: the container is gone; so is the shim's record of it (and its restore work directory)."""

from __future__ import annotations

from coldsnap.oci import records


def poststop(state: dict) -> int:
    records.forget(state["id"])
    return 0
