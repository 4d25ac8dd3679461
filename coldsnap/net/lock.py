"""CRIU's network lock, where a capture left it in a network namespace.

A container capture with requests in flight (policy.quiesce "none") dumps with CRIU's nftables network lock: a
table `inet CRIU-<id>` whose chains drop every packet but CRIU's own. CRIU leaves it in the container's network
namespace after the dump, so clients meet silence (their TCP retransmits) rather than resets, and a restore into
that namespace removes it once the sockets are back. When no restore comes (the shim refused or failed it and
starts the container cold there), the lock must go first, or the cold start would serve nobody.
Only nftables tables are handled: that is the lock ColdSnap asks CRIU for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from coldsnap.contracts import ColdSnapError, ErrorCode

LOCK_TABLE_PREFIX = "CRIU-"


def _nft(netns: str, *args: str) -> subprocess.CompletedProcess:
    nft = shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft") if os.access(p, os.X_OK)), None)
    if not nft:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, "nft not found: cannot inspect the network lock in " + netns)
    return subprocess.run(["nsenter", f"--net={netns}", nft, *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=30)


def criu_lock_tables(netns: str) -> list[tuple[str, str]]:
    """(family, name) of the CRIU lock tables in the network namespace at path netns."""
    r = _nft(netns, "-j", "list", "tables")
    if r.returncode != 0:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"nft list tables in {netns} failed: {r.stderr.strip()[-200:]}")
    try:
        items = json.loads(r.stdout or "{}").get("nftables", [])
    except ValueError:
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"nft printed no JSON for {netns}") from None
    tables = [i["table"] for i in items if isinstance(i, dict) and "table" in i]
    return [(t["family"], t["name"]) for t in tables if str(t.get("name", "")).startswith(LOCK_TABLE_PREFIX)]


def remove_criu_locks(netns: str) -> list[str]:
    """Delete CRIU's lock tables from the network namespace at path netns; returns what was removed."""
    removed = []
    for family, name in criu_lock_tables(netns):
        r = _nft(netns, "delete", "table", family, name)
        if r.returncode != 0:
            raise ColdSnapError(ErrorCode.ENVIRONMENT, f"cannot remove CRIU's network lock {family} {name} from "
                                f"{netns}: {r.stderr.strip()[-200:]}")
        removed.append(f"{family} {name}")
    return removed
