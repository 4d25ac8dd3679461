"""Network namespaces and the launcher (a PID and a mount namespace of its own), against the real kernel."""

import os
import time
import urllib.request

import pytest

from coldsnap.base.procfs import alive
from coldsnap.contracts import ColdSnapError, ErrorCode
from coldsnap.net import allocate_plan, create_network, destroy_network
from coldsnap.net.netns import _host_links
from coldsnap.workload.process import kill_tree, start_in_namespaces

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network and PID namespaces")


@pytest.fixture
def plan():
    p = allocate_plan("pytest-net", 8123)
    yield p
    destroy_network(p)


def test_create_and_destroy(plan):
    create_network(plan)
    assert os.path.exists(f"/run/netns/{plan.netns}")
    assert plan.host_veth in _host_links()
    destroy_network(plan)
    assert not os.path.exists(f"/run/netns/{plan.netns}")
    assert plan.host_veth not in _host_links()
    destroy_network(plan)  # idempotent


def test_busy_network_is_refused(plan):
    create_network(plan)
    with pytest.raises(ColdSnapError) as e:
        create_network(plan)
    assert e.value.code == ErrorCode.RESOURCE_BUSY
    # the same name again (another COLDSNAP_HOME's workload, say) gets a namespace and a slot of its own
    again = allocate_plan("pytest-net", 8123)
    assert again.netns == f"{plan.netns}-2" and again.host_address != plan.host_address
    assert again.host_veth != plan.host_veth
    other = allocate_plan("pytest-other", 8123)
    assert other.host_address != plan.host_address


def test_a_refused_create_removes_nothing_it_did_not_make(plan):
    """Two creates of one plan at once: the loser must not delete the winner's namespace or veth."""
    from coldsnap.net import netns_inode

    create_network(plan)
    inode = netns_inode(plan.netns)
    for _ in range(3):
        with pytest.raises(ColdSnapError) as e:
            create_network(plan)
        assert e.value.code == ErrorCode.RESOURCE_BUSY
    assert netns_inode(plan.netns) == inode and plan.host_veth in _host_links()


def test_workload_runs_as_namespace_init_reachable_from_host(plan, tmp_path):
    create_network(plan)
    (tmp_path / "hello.txt").write_text("hi")
    pid = start_in_namespaces(["python3", "-m", "http.server", "--bind", "0.0.0.0", str(plan.port), "-d",
                               str(tmp_path)], {}, plan, tmp_path / "log")
    try:
        nspid = [line for line in open(f"/proc/{pid}/status") if line.startswith("NSpid")][0].split()
        assert nspid[-1] == "1"  # init of its own PID namespace
        assert os.getsid(pid) == pid  # session leader
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")  # a mount namespace too
        with open(f"/proc/{pid}/mountinfo") as f:  # its own /proc, and no other workload's network namespace
            mounts = f.read()
        fstypes = [line.split(" - ")[1].split()[0] for line in mounts.splitlines()]
        assert "nsfs" not in fstypes and fstypes.count("proc") >= 1, mounts
        deadline = time.time() + 15
        while True:
            try:
                body = urllib.request.urlopen(f"http://{plan.workload_address}:{plan.port}/hello.txt", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)
        assert body == b"hi"
    finally:
        kill_tree(pid)
    assert not alive(pid)


def test_a_workload_that_exits_at_once_is_a_workload_failure(plan, tmp_path):
    """Whatever moment the workload dies in (before, during or after setsid), starting it either returns a session
    leader or says the workload failed: never another error (a /proc read of a vanished process is ESRCH)."""
    create_network(plan)
    for i in range(20):
        try:
            pid = start_in_namespaces(["python3", "-c", f"import sys; sys.exit({i % 3})"], {}, plan,
                                      tmp_path / "log")
        except ColdSnapError as e:
            assert e.code == ErrorCode.WORKLOAD_FAILED, e
            assert "exited at once" in e.message
        else:
            kill_tree(pid)
            assert not alive(pid)


def test_kill_tree_removes_the_socket_files_the_tree_bound(plan, tmp_path):
    """A SIGKILLed engine leaves its ZMQ ipc:// socket files behind; kill_tree removes those the tree bound, and
    nothing else."""
    create_network(plan)
    mine, other = tmp_path / "engine.sock", tmp_path / "someone-elses.sock"
    import socket

    theirs = socket.socket(socket.AF_UNIX)
    theirs.bind(str(other))
    code = ("import socket, time, os; s = socket.socket(socket.AF_UNIX); s.bind(os.environ['SOCK']); s.listen(); "
            "open(os.environ['SOCK'] + '.ready', 'w').close(); time.sleep(600)")
    pid = start_in_namespaces(["python3", "-c", code], {"SOCK": str(mine)}, plan, tmp_path / "log")
    try:
        deadline = time.time() + 15
        while not (tmp_path / "engine.sock.ready").exists():
            assert time.time() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.05)
        assert mine.is_socket()
    finally:
        kill_tree(pid)
    assert not mine.exists()
    assert other.is_socket()  # not the tree's
    theirs.close()



def test_namespaces_are_made_and_entered_without_forking(monkeypatch):
    """A child forked from a process with other threads can wait forever on a lock one of them held (pyroute2's
    netns.create and NetNS fork one each; seen in the suite). ColdSnap's own make and enter the namespace on a
    thread instead: with fork forbidden they still work, and the caller stays in the host's namespace."""
    from pyroute2 import netns

    from coldsnap.net.netns import create_namespace, namespace_route, netns_path

    def no_fork():
        raise AssertionError("forked a child")

    monkeypatch.setattr(os, "fork", no_fork)
    name = f"cstest-thr-{os.getpid()}"
    host = os.readlink("/proc/self/ns/net")
    try:
        create_namespace(name)
        with namespace_route(name) as ns:
            links = [link.get_attr("IFLA_IFNAME") for link in ns.get_links()]
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
            assert ns.get_links(ns.link_lookup(ifname="lo")[0])[0]["flags"] & 1  # IFF_UP
        assert links == ["lo"]  # a namespace of its own, not the host's
        assert os.readlink("/proc/self/ns/net") == host
        assert os.stat(netns_path(name)).st_ino != os.stat("/proc/self/ns/net").st_ino
    finally:
        netns.remove(name)
