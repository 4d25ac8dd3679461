"""pyroute2-backed network namespaces. Addresses are fixed at capture and recreated exactly at restore,
because restored sockets remember the addresses they were bound and connected to (a restore under another
workload name takes a slot of its own: a listening socket does not care).

Addresses come from the link-local range 169.254.237.0/24 in /30 slots: host side .4N+1, workload side .4N+2.
Traffic never leaves the machine: the host end of the veth is the only peer. Namespaces, addresses and veths are
host-global, whatever COLDSNAP_HOME or COLDSNAP_RUN say: every ColdSnap on the host chooses and creates them under
one lock (/run/coldsnap-net.lock), and a refusal removes nothing it did not make.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from pyroute2 import IPRoute, netns

from coldsnap.base.locks import locked
from coldsnap.contracts import ColdSnapError, ErrorCode, NetworkPlan
from coldsnap.net.setns import CLONE_NEWNET, check_rc, libc, setns

BASE = "169.254.237."
MAX_SLOTS = 63
NETNS_DIR = Path("/run/netns")
HOST_LOCK = Path("/run/coldsnap-net.lock")


def _on_a_thread(fn: Callable[[], object]) -> object:
    """fn's result, run on a short-lived thread of its own. unshare and setns of CLONE_NEWNET act on the calling
    thread only, so a thread enters a namespace without forking. (pyroute2's netns.create and NetNS fork a child
    for it, and a child forked from a process with other threads can wait forever on a lock one of them held: seen
    in the suite, five such children in a row gave no answer.)"""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name="coldsnap-netns")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def create_namespace(name: str) -> None:
    """A new named network namespace (/run/netns/NAME, as `ip netns add` makes it)."""
    def make() -> None:
        check_rc(libc.unshare(CLONE_NEWNET), f"unshare of a network namespace for {name}")
        # attach bind-mounts /proc/PID/ns/net at /run/netns/NAME; this thread's own is /proc/PID/task/TID/ns/net
        netns.attach(name, f"{os.getpid()}/task/{threading.get_native_id()}")
    _on_a_thread(make)


def namespace_route(name: str) -> IPRoute:
    """An rtnetlink handle inside the named network namespace (its socket is made on a thread that entered it)."""
    def enter() -> int:
        setns(netns_path(name), f"entering network namespace {name}")
        return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, socket.NETLINK_ROUTE).detach()
    return IPRoute(fileno=_on_a_thread(enter))


def netns_path(name: str) -> str:
    return str(NETNS_DIR / name)


def netns_inode(name: str) -> int:
    return os.stat(netns_path(name)).st_ino


def _host_addresses() -> set[str]:
    with IPRoute() as ipr:
        return {a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(family=2)}


def _host_links() -> set[str]:
    with IPRoute() as ipr:
        return {link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}


def _free_plan(name: str, port: int) -> NetworkPlan:
    """The first network namespace name for this workload (coldsnap-NAME, then coldsnap-NAME-2, …: two homes may
    use one name) and the first slot whose addresses and veth are free on this host."""
    addresses, links, names = _host_addresses(), _host_links(), set(netns.listnetns())
    netns_name = next(n for n in (f"coldsnap-{name}", *(f"coldsnap-{name}-{i}" for i in range(2, 1000)))
                      if n not in names)
    for slot in range(MAX_SLOTS):
        plan = NetworkPlan(netns=netns_name, host_veth=f"csh{slot}", workload_veth="eth0", prefix_len=30, port=port,
                           host_address=f"{BASE}{4 * slot + 1}", workload_address=f"{BASE}{4 * slot + 2}")
        if plan.host_address not in addresses and plan.host_veth not in links:
            return plan
    raise ColdSnapError(ErrorCode.RESOURCE_BUSY, f"all {MAX_SLOTS} workload network slots are in use")


def allocate_plan(name: str, port: int) -> NetworkPlan:
    """A plan that is free now (another ColdSnap may take it before it exists: new_network chooses and creates
    under the host lock)."""
    with locked(HOST_LOCK):
        return _free_plan(name, port)


def new_network(name: str, port: int, before: Callable[[NetworkPlan], object] = lambda plan: None) -> NetworkPlan:
    """Choose a free plan and create it, under the host lock; before(plan) runs between the two (a journal records
    the plan there, before it exists)."""
    with locked(HOST_LOCK):
        plan = _free_plan(name, port)
        before(plan)
        _create(plan)
        return plan


def create_network(plan: NetworkPlan) -> None:
    """Create netns + veth exactly as planned (a restore's captured plan), under the host lock; refuse
    (RESOURCE_BUSY) if any part is taken, and then touch nothing."""
    with locked(HOST_LOCK):
        _create(plan)


def _create(plan: NetworkPlan) -> None:
    if plan.netns in netns.listnetns():
        raise ColdSnapError(ErrorCode.RESOURCE_BUSY, f"network namespace {plan.netns} already exists "
                            f"(is the workload still running? `coldsnap stop` it first)")
    if plan.host_address in _host_addresses():
        raise ColdSnapError(ErrorCode.RESOURCE_BUSY, f"address {plan.host_address} is already in use on this host")
    if plan.host_veth in _host_links():
        raise ColdSnapError(ErrorCode.RESOURCE_BUSY, f"interface {plan.host_veth} already exists on this host")
    create_namespace(plan.netns)
    veth_made = False
    try:
        with IPRoute() as ipr:
            ipr.link("add", ifname=plan.host_veth, kind="veth",
                     peer={"ifname": plan.workload_veth, "net_ns_fd": plan.netns})
            veth_made = True
            idx = ipr.link_lookup(ifname=plan.host_veth)[0]
            ipr.addr("add", index=idx, address=plan.host_address, prefixlen=plan.prefix_len)
            ipr.link("set", index=idx, state="up")
        with namespace_route(plan.netns) as ns:
            lo = ns.link_lookup(ifname="lo")[0]
            ns.link("set", index=lo, state="up")
            idx = ns.link_lookup(ifname=plan.workload_veth)[0]
            ns.addr("add", index=idx, address=plan.workload_address, prefixlen=plan.prefix_len)
            ns.link("set", index=idx, state="up")
            ns.route("add", dst="default", gateway=plan.host_address)
    except Exception as e:
        # only what this call made: a veth of that name that existed already is someone else's
        destroy_network(plan if veth_made else plan.model_copy(update={"host_veth": ""}))
        if isinstance(e, OSError) and e.errno == errno.EEXIST:
            raise ColdSnapError(ErrorCode.RESOURCE_BUSY, f"network for {plan.netns} is in use: {e}") from None
        raise ColdSnapError(ErrorCode.ENVIRONMENT, f"could not create network {plan.netns}: {e}") from None


def destroy_network(plan: NetworkPlan) -> None:
    """Remove veth and netns; idempotent (a missing part is not an error)."""
    with suppress(Exception), IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=plan.host_veth) if plan.host_veth else []
        if idx:
            ipr.link("del", index=idx[0])
    with suppress(Exception):
        if plan.netns in netns.listnetns():
            netns.remove(plan.netns)
