"""Network namespaces for workloads: a named netns with lo up and a veth pair with fixed addresses."""

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
