"""Network namespaces for workloads: a named netns with lo up and a veth pair with fixed addresses.

Its names load coldsnap.net.netns (pyroute2, pydantic) on first use, not on import of the package: runc's
createRuntime hook imports coldsnap.net.loopback alone, inside every container restore."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coldsnap.net.netns import (
        NetworkPlan,
        allocate_plan,
        create_network,
        destroy_network,
        netns_inode,
        netns_path,
        new_network,
    )

__all__ = ["NetworkPlan", "allocate_plan", "create_network", "destroy_network", "netns_inode", "netns_path",
           "new_network"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from coldsnap.net import netns

        return getattr(netns, name)
    raise AttributeError(f"module 'coldsnap.net' has no attribute {name!r}")
