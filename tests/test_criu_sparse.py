"""Zero pages dropped from a real CRIU dump restore the same bytes (anonymous memory) and keep file-backed pages."""

import os
import signal
import subprocess
import sys
import time

from conftest import CRIU_PREFIX, kill_and_reap, needs_root_criu

from coldsnap.criu import CriuDriver, CriuOptions
from coldsnap.criu.sparse import drop_zero_pages
from coldsnap_bench.criu_account import account

MIB = 1 << 20

# 16 MiB of random bytes, 32 MiB of written zeros, and a private file mapping whose non-zero file bytes were
# overwritten with zeros (those zero pages must stay in the dump: a missing page there would read back the file).
# On SIGUSR1 the process writes a digest of all three to its report file.
HOLDER = r"""
import hashlib, mmap, os, signal, sys, time
report, backing = sys.argv[1], sys.argv[2]
P = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
rand = mmap.mmap(-1, 16 << 20, flags=P); rand[:] = os.urandom(16 << 20)
rand.madvise(mmap.MADV_DONTFORK)  # as the CUDA driver marks the host memory it pins: the account names it
zeros = mmap.mmap(-1, 32 << 20, flags=P)
for at in range(0, len(zeros), 1 << 20): zeros[at:at + (1 << 20)] = bytes(1 << 20)
fd = os.open(backing, os.O_RDONLY)
filemap = mmap.mmap(fd, 8 << 20, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
filemap[:] = bytes(8 << 20)
def dump_digest(*_):
    d = hashlib.sha256(bytes(rand) + bytes(zeros) + bytes(filemap)).hexdigest()
    with open(report, "w") as f: f.write(d)
signal.signal(signal.SIGUSR1, dump_digest)
dump_digest()
while True: time.sleep(0.1)
"""


def digest_of(pid, report, timeout=10.0):
    os.unlink(report)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(report) and os.path.getsize(report) == 64:
            return open(report).read()
        time.sleep(0.05)
    raise AssertionError("no digest from the process")


def test_zero_pages_are_dropped_and_restore_the_same_bytes(tmp_path, monkeypatch):
    needs_root_criu()
    monkeypatch.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
    backing = tmp_path / "backing"
    backing.write_bytes(b"\x5a" * (8 * MIB))
    report = tmp_path / "digest"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(report), str(backing)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    restored = None
    try:
        deadline = time.monotonic() + 20
        while not (report.exists() and report.stat().st_size == 64):
            assert time.monotonic() < deadline and proc.poll() is None, "holder did not start"
            time.sleep(0.05)
        before = digest_of(proc.pid, str(report))
        images = tmp_path / "images"
        criu = CriuDriver()
        criu.dump(proc.pid, images, CriuOptions(network_lock="skip"), None)
        proc.wait(timeout=10)

        pages_before = account(images, zeros=True)
        thinned = drop_zero_pages(images)
        pages_after = account(images, zeros=True)
        # The 32 MiB of written zeros go; the file mapping's zero pages stay.
        assert thinned.dropped >= 32 * MIB, thinned.as_dict()
        assert pages_after["total_bytes"] == thinned.bytes_after == pages_before["total_bytes"] - thinned.dropped
        file_zeros = [m for p in pages_after["processes"] for m in p["mappings"] if m["name"].endswith("backing")]
        assert file_zeros and file_zeros[0]["zero_bytes"] >= 8 * MIB
        marked = [m for p in pages_after["processes"] for m in p["mappings"] if m["name"].endswith("[dontfork]")]
        assert len(marked) == 1 and marked[0]["bytes"] == 16 * MIB and " at 0x" in marked[0]["name"], marked

        restored, _ = criu.restore(images, tmp_path / "work", CriuOptions(network_lock="skip"), None)
        assert digest_of(restored, str(report)) == before
        # Idempotent: nothing left to drop.
        assert drop_zero_pages(images).dropped == 0
    finally:
        kill_and_reap(proc.pid, restored)


def test_a_dump_with_a_parent_is_left_alone(tmp_path):
    (tmp_path / "parent").symlink_to(tmp_path)
    assert drop_zero_pages(tmp_path).as_dict()["processes"] == 0


def test_criu_says_its_version_on_the_command_line_as_its_rpc_does(monkeypatch, tmp_path):
    """Admission asks CRIU's version with `criu --version` (~10 ms, no pycriu): the same as the RPC's answer;
    a binary that prints no version is asked by RPC instead."""
    needs_root_criu()
    monkeypatch.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
    from coldsnap.criu.driver import criu_version

    driver = CriuDriver()
    said = criu_version(driver.binary)
    assert said is not None and said == driver._rpc_version() == driver.version()
    mute = tmp_path / "criu"
    mute.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && {{ echo 'criu, some build'; exit 0; }}\n"
                    f"exec {driver.binary} \"$@\"\n")
    mute.chmod(0o755)
    assert criu_version(str(mute)) is None and CriuDriver(str(mute)).version() == said
