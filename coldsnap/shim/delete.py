"""`delete` of a container the shim handled: runc deletes it, then the shim forgets it (its record and work dir).
runc's poststop hooks (coldsnap-hook poststop among them) run inside runc's delete as usual."""

from __future__ import annotations

import os

from coldsnap.oci import records
from coldsnap.oci.argv import RuncArgv
from coldsnap.oci.runtime import Runc


def delete(runc: str, parsed: RuncArgv) -> int:
    rc = Runc(runc).call(parsed.argv)
    cid = parsed.id
    if rc == 0 or not os.path.exists(os.path.join(parsed.root, cid)):  # deleted, or runc never knew it
        records.forget(cid)
    return rc
