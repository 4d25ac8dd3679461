"""Diagnosis (device runs): run one `coldsnap capture` with the CLI's own arguments, and just before the CUDA
checkpoint print each process of the workload's tree with its large mappings (size, resident, VmFlags: `dc` is
MADV_DONTFORK, what the CUDA driver sets on host memory it pins; `lo` is locked), and malloc's heap walked chunk by
chunk (in-use bytes by chunk size, the largest chunks and what they hold). Then the capture goes on.
Usage: python3 packaging/device/tree-maps.py capture --device cuda ... (the same arguments as coldsnap)."""
import os
import sys

from coldsnap.cli.main import main
from coldsnap.gpu import steps as gpu_steps

MIN = int(os.environ.get("MAPS_MIN_MIB", "16")) << 20


def tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def show(pid: int) -> None:
    cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")[:100].decode(errors="replace")
    print(f"pid {pid}: {cmd}", file=sys.stderr)
    entry = None
    for line in open(f"/proc/{pid}/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            entry = {"start": lo, "size": hi - lo, "name": " ".join(head[5:]) or "anon"}
        elif head[0] == "Rss:":
            entry["rss"] = int(head[1]) << 10
        elif head[0] == "VmFlags:" and entry and entry["size"] >= MIN:
            print(f"   {entry['start']:#14x} {entry['size'] >> 20:6d} MiB  rss {entry['rss'] >> 20:6d} MiB  "
                  f"{entry['name'][:60]:60s}  "
                  f"{' '.join(head[1:])}", file=sys.stderr)
            if entry["name"] == "anon" and entry["rss"] >= MIN:
                print(f"      {sample(pid, entry['start'], entry['size'])}", file=sys.stderr)
            if entry["name"] == "[heap]":
                print(heap_summary(pid, entry["start"], entry["size"]), file=sys.stderr)


def read_mem(pid: int, start: int, size: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(start)
        return f.read(size)


def sample(pid: int, start: int, size: int) -> str:
    """What a mapping holds, as a hint to whose it is: over the whole mapping (up to 512 MiB), the share of zero
    bytes, how many ELF headers and CUDA code markers it holds, and its first printable strings."""
    import re

    try:
        data = read_mem(pid, start, min(size, 512 << 20))
    except OSError as e:
        return f"unreadable: {e}"
    marks = {m: data.count(m) for m in (b"\x7fELF", b"nccl", b"NCCL", b".nv.info", b"sm_90", b"ncclDevKernel")}
    strings = [s.decode() for s in re.findall(rb"[ -~]{16,}", data[: 64 << 20])[:8]]
    mid = data[len(data) // 2: len(data) // 2 + 32]
    return (f"sample: {data.count(0) / max(1, len(data)):.0%} zero bytes, markers {marks}, "
            f"middle {mid.hex(' ')}, strings {strings}")


def heap_summary(pid: int, start: int, size: int, top: int = 12) -> str:
    """What malloc's main heap holds: its chunks walked by their size fields (glibc: 8 bytes prev_size, 8 bytes size
    with flag bits; a chunk is in use when the next one's PREV_INUSE bit is set), in-use bytes by chunk size class,
    and the largest in-use chunks with what they hold (zero share, CUDA code markers, first strings)."""
    import re
    import struct

    try:
        data = read_mem(pid, start, min(size, 1 << 30))
    except OSError as e:
        return f"      heap unreadable: {e}"
    classes = {"<4K": [0, 0], "4K-64K": [0, 0], "64K-1M": [0, 0], ">=1M": [0, 0]}
    chunks, p = [], 0
    while p + 16 <= len(data):
        n = struct.unpack_from("<Q", data, p + 8)[0] & ~7
        if n < 32 or p + n > len(data):
            break  # the top chunk (or a walk gone wrong: reported below)
        inuse = p + n + 16 <= len(data) and struct.unpack_from("<Q", data, p + n + 8)[0] & 1
        if inuse:
            cls = "<4K" if n < 4096 else "4K-64K" if n < 65536 else "64K-1M" if n < (1 << 20) else ">=1M"
            classes[cls][0] += 1
            classes[cls][1] += n
            chunks.append((n, p))
        p += n
    lines = [f"      heap walk: {p >> 20} of {len(data) >> 20} MiB walked, in-use by chunk size: " + ", ".join(
        f"{k} {c} chunks {b >> 20} MiB" for k, (c, b) in classes.items())]
    for n, at in sorted(chunks, reverse=True)[:top]:
        body = data[at + 16:at + n]
        marks = {name: body.count(m) for name, m in (("ELF", b"\x7fELF"), (".nv.info", b".nv.info"),
                                                      ("nccl", b"nccl"), ("fatbin", b"\x50\xed\x55\xba"))}
        strings = [s.decode()[:40] for s in re.findall(rb"[ -~]{12,}", body[:1 << 20])[:3]]
        lines.append(f"        {n / (1 << 20):7.2f} MiB at +{at:#x}: {body.count(0) / max(1, len(body)):.0%} zero, "
                     f"{marks}, {strings}")
    return "\n".join(lines)


def gpu_apps() -> None:
    import subprocess

    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout
    print("GPU memory by process:\n" + out, file=sys.stderr)


_checkpoint = gpu_steps.checkpoint_tree


def checkpoint_tree(root_pid: int):
    gpu_apps()
    for pid in tree(root_pid):
        try:
            show(pid)
        except OSError as e:
            print(f"pid {pid}: {e}", file=sys.stderr)
    sys.stderr.flush()
    return _checkpoint(root_pid)


gpu_steps.checkpoint_tree = checkpoint_tree
sys.exit(main(sys.argv[1:]))
