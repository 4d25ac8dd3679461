"""CUDA device code moved out of anonymous memory into content-addressed files (coldsnap.gpu.codestash): the process
sees the same bytes at the same address, a real CRIU dump no longer carries those pages, and the restore maps the
file. On the H200 the reference engine stashes NCCL's and torch's decompressed kernels this way at every capture
(packaging/device/tp-bench.sh); here a process holds an image shaped like theirs."""

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import CRIU_PREFIX, kill_and_reap, needs_root_criu

from coldsnap.contracts import CapturedFile, ColdSnapError
from coldsnap.criu import CriuDriver, CriuOptions
from coldsnap.gpu import codestash
from coldsnap.workload.hostfiles import extra_files, put_back_file
from coldsnap_bench.criu_account import account

MIB = 1 << 20

# 24 MiB of anonymous memory starting like a malloc'd decompressed cubin (a 16-byte chunk header, then a 64-bit ELF
# for EM_CUDA), then random bytes; 12 MiB of other random anonymous memory. argv: report file, stash dir or "-".
# On SIGUSR1 the process writes the digest of both areas and where the first one lives to its report file.
HOLDER = r"""
import ctypes, hashlib, mmap, os, signal, sys, time
sys.path.insert(0, os.environ["COLDSNAP_SRC"])
from coldsnap.gpu.codestash import stash_code
report, stash_dir = sys.argv[1], sys.argv[2]
P = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
other = mmap.mmap(-1, 12 << 20, flags=P); other[:] = os.urandom(12 << 20)
above = mmap.mmap(-1, 4096, flags=P, prot=mmap.PROT_READ)  # read-only neighbours: no merging with other memory
code = mmap.mmap(-1, 24 << 20, flags=P)
below = mmap.mmap(-1, 4096, flags=P, prot=mmap.PROT_READ)
header = bytearray(64); header[:5] = b"\x7fELF\x02"; header[18:20] = (190).to_bytes(2, "little")
chunk = bytes(8) + ((24 << 20) | 2).to_bytes(8, "little")  # as glibc's malloc heads a chunk it mmapped
code[:16 + 64] = chunk + bytes(header)
code[4096:] = hashlib.shake_256(b"kernels").digest(len(code) - 4096)
addr = ctypes.addressof(ctypes.c_char.from_buffer(code))
stashed = stash_code(stash_dir) if stash_dir != "-" else {}
def dump_digest(*_):
    d = hashlib.sha256(bytes(code) + bytes(other)).hexdigest()
    with open(report, "w") as f: f.write(f"{d} {addr:x} {stashed.get('files', 0)}")
signal.signal(signal.SIGUSR1, dump_digest)
dump_digest()
while True: time.sleep(0.1)
"""


def report_of(pid, report, timeout=10.0):
    if pid is not None:
        os.unlink(report)
        os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(report) and os.path.getsize(report) > 64:
            digest, addr, files = open(report).read().split()
            return digest, int(addr, 16), int(files)
        time.sleep(0.05)
    raise AssertionError("no report from the process")


def start_holder(tmp_path, stash_dir):
    report = tmp_path / "report"
    env = dict(os.environ, COLDSNAP_SRC=os.path.dirname(os.path.dirname(os.path.abspath(codestash.__file__))))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(report), str(stash_dir)], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    return proc, report


def mapped_path(pid, addr):
    for line in open(f"/proc/{pid}/maps"):
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= addr < hi:
            return parts[5] if len(parts) > 5 else None
    raise AssertionError(f"{addr:#x} is not mapped in {pid}")


def test_cuda_code_is_recognised_only_by_its_elf_header():
    head = bytes(16) + b"\x7fELF\x02" + bytes(13) + (190).to_bytes(2, "little") + bytes(32)
    assert codestash.holds_cuda_code(head)
    assert not codestash.holds_cuda_code(head.replace((190).to_bytes(2, "little"), (62).to_bytes(2, "little")))
    assert not codestash.holds_cuda_code(bytes(64)) and not codestash.holds_cuda_code(bytes(64 << 10) + head)
    assert codestash.holds_cuda_code(bytes(9000) + head)  # after a chunk header, a fatbin's headers, ...
    assert codestash.holds_cuda_code(bytes(16) + codestash.FATBIN_MAGIC + bytes(44))
    maps = ("7f0000000000-7f0001000000 rw-p 00000000 00:00 0 \n"
            "7f0002000000-7f0002100000 rw-p 00000000 00:00 0 \n"  # 1 MiB: too small
            "7f0003000000-7f0004000000 rw-p 00000000 00:00 0          [heap]\n"
            "7f0005000000-7f0006000000 r--p 00000000 00:00 0 \n")
    assert [(lo, hi) for lo, hi, _ in codestash.candidate_mappings(maps)] == [(0x7f0000000000, 0x7f0001000000)]



def chunk(size: int, body: bytes) -> bytes:
    """A glibc mmapped chunk of `size` bytes: its 16-byte header, then body, zero-padded."""
    return (bytes(8) + (size | 2).to_bytes(8, "little") + body).ljust(size, b"\0")


def test_each_mmapped_chunk_holding_cuda_code_is_one_range():
    elf = b"\x7fELF\x02" + bytes(13) + (190).to_bytes(2, "little") + bytes(42)
    # As found in a tensor-parallel rank: one 200 MiB mapping, malloc's chunks in a row; here 3 chunks of which
    # the middle one holds a GPU ELF image deep inside (after the runtime's own header), then something else.
    mem = chunk(MIB, os.urandom(1000)) + chunk(2 * MIB, bytes(300_000) + elf) + chunk(MIB, b"x" * 100) + bytes(4096)
    base = 0x7f0000000000

    def read(addr, n):
        return mem[addr - base: addr - base + n]

    assert codestash.code_ranges(read, base, base + len(mem)) == [(base + MIB, base + 3 * MIB)]
    # a mapping that is not malloc's: all of it when it starts with CUDA code, none of it otherwise
    plain = bytes(100) + elf + bytes(MIB)
    assert codestash.code_ranges(lambda a, n: plain[a:a + n], 0, len(plain)) == [(0, len(plain))]
    assert codestash.code_ranges(lambda a, n: bytes(n), 0, MIB) == []
    assert codestash.mmapped_chunk_bytes(bytes(8) + ((8 * MIB) | 6).to_bytes(8, "little"), 24 * MIB) == 0  # arena
    assert codestash.mmapped_chunk_bytes(bytes(8) + ((48 * MIB) | 2).to_bytes(8, "little"), 24 * MIB) == 0  # too big


def test_stashed_code_leaves_the_dump_and_restores_from_its_file(tmp_path, monkeypatch):
    needs_root_criu()
    monkeypatch.setenv("COLDSNAP_CRIU_PREFIX", CRIU_PREFIX)
    stash = tmp_path / "code"
    proc, report = start_holder(tmp_path, stash)
    restored = None
    try:
        digest, addr, files = report_of(None, str(report), timeout=20)
        assert files == 1, proc.stderr.read().decode() if proc.poll() is not None else files
        (code_file,) = stash.iterdir()
        assert codestash.is_code_file(str(code_file)) and oct(code_file.stat().st_mode & 0o777) == "0o600"
        assert code_file.name == f"sha256-{hashlib.sha256(code_file.read_bytes()).hexdigest()}.cubin"
        assert mapped_path(proc.pid, addr) == str(code_file)
        assert report_of(proc.pid, str(report))[0] == digest  # the same bytes after the move

        images = tmp_path / "images"
        criu = CriuDriver()
        criu.dump(proc.pid, images, CriuOptions(network_lock="skip"), None)
        proc.wait(timeout=10)
        mappings = [m for p in account(images)["processes"] for m in p["mappings"]]
        # The 12 MiB of other memory is in the dump, no page of the 24 MiB of code is.
        assert any(m["bytes"] == 12 * MIB and m["name"].startswith("anon 12 MiB") for m in mappings), mappings
        assert not [m for m in mappings if "sha256-" in m["name"] or m["name"].startswith("anon 24 MiB")], mappings
        assert [f.path for f in extra_files(images)] == [str(code_file)]

        restored, _ = criu.restore(images, tmp_path / "work", CriuOptions(network_lock="skip"), None)
        assert report_of(restored, str(report))[0] == digest
        assert mapped_path(restored, addr) == str(code_file)
    finally:
        kill_and_reap(proc.pid, restored)


def test_a_second_process_with_the_same_code_shares_the_file(tmp_path):
    stash = tmp_path / "code"
    procs = []
    for i in range(2):
        (tmp_path / str(i)).mkdir()
        procs.append(start_holder(tmp_path / str(i), stash))
    try:
        reports = [report_of(None, str(r), timeout=20) for _, r in procs]
        assert [r[2] for r in reports] == [1, 1]
        assert len(list(stash.iterdir())) == 1
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()


def test_a_code_file_is_put_back_only_when_missing_and_only_with_matching_bytes(tmp_path):
    data = b"cubin" * 1000
    name = tmp_path / "code" / f"sha256-{hashlib.sha256(data).hexdigest()}.cubin"
    src = tmp_path / "packed"
    src.write_bytes(data)
    f = CapturedFile(path=str(name), size=len(data), mode=0o600)
    put_back_file(src, f)
    assert name.read_bytes() == data and oct(name.stat().st_mode & 0o777) == "0o600"
    src.write_bytes(b"x" * len(data))
    put_back_file(src, f)  # already there at its size: left alone
    assert name.read_bytes() == data
    name.unlink()
    with pytest.raises(ColdSnapError, match="do not match"):
        put_back_file(src, f)
    assert not name.exists() and os.listdir(name.parent) == []  # no half-written file left
    with pytest.raises(ColdSnapError, match="lacks"):
        put_back_file(None, f)
