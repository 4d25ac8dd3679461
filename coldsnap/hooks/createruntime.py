"""createRuntime: at a restore, runc runs this hook when CRIU has made the container's namespaces and before it
restores their sockets (CRIU's setup-namespaces notification). A network namespace runc makes itself (no path in
the spec: ctr, plain runc) then has `lo` down, and CRIU cannot reconnect an established loopback connection
(SGLang's and vLLM's own TCP connections to 127.0.0.1): "Can't connect inet socket back: Network is unreachable".
So the hook brings `lo` up there. A namespace the spec names (a pod's, docker's) is left alone: its owner set it
up. At a cold create runc has already brought `lo` up; doing it again changes nothing. Standard library only: it
runs inside `runc restore`, on every container restore's clock."""

from __future__ import annotations

import json
import os
import sys

from coldsnap.net.loopback import loopback_up_in
from coldsnap.oci.spec import netns_path


def own_network_namespace(spec: dict) -> bool:
    """Whether the container gets a network namespace the runtime makes for it (not a path the spec names)."""
    namespaces = (spec.get("linux") or {}).get("namespaces") or []
    return any(ns.get("type") == "network" for ns in namespaces) and netns_path(spec) is None


def create_runtime(state: dict) -> int:
    try:
        with open(os.path.join(state.get("bundle") or "", "config.json")) as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        print(f"coldsnap-hook: createRuntime: cannot read the bundle's config.json: {e}", file=sys.stderr)
        return 1
    pid = state.get("pid")
    if not own_network_namespace(spec) or not isinstance(pid, int) or pid <= 0:
        return 0
    try:
        loopback_up_in(pid)  # this hook's own process enters the namespace: it ends right after
    except OSError as e:
        print(f"coldsnap-hook: createRuntime: cannot bring lo up for pid {pid}: {e}", file=sys.stderr)
        return 1
    return 0
