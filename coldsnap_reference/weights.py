"""Weights of the reference model: seeded generation into a safetensors file, and loading.

Generation is deterministic and portable: the same config and seed give a byte-identical file on any
machine, since the values come from numpy's PCG64 streams (one per piece of a tensor, keyed by seed, tensor and
piece, so the pieces generate in parallel) mapped to uniform floats, not from a library's normal sampler.

load_weights(mode="mmap") maps the file MAP_PRIVATE and hands out tensors that are views over it, so
the weights stay clean file-backed pages: CRIU leaves such pages out of its images and the restored
process maps the file again. mode="copy" puts them in ordinary anonymous memory instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

from coldsnap.base.files import atomic_file, atomic_write, pread_full

# Imported now, not at resume: a restored engine's resume is on the clock (they are light: ctypes and sockets).
from coldsnap.gpu.prefetch import DTYPES, PrefetchError, Session, packed_layout, plan_digest, read_header
from coldsnap.gpu.vmm import DeviceRegion, Driver, imported
from coldsnap_reference.shapes import ModelConfig, local_shape, param_specs

ALIGN = 64  # bytes: where the data section and each tensor of a generated file start

# Kept alive for as long as the process runs: the tensors of load_weights(mode="mmap") point into them.
_MAPS: list[mmap.mmap] = []


def sidecar(path: str | os.PathLike) -> Path:
    """The JSON file next to the weights that holds the model config."""
    return Path(f"{os.fspath(path)}.json")


def _atomic_write(path: Path, data: bytes) -> None:
    atomic_write(path, data, 0o644)  # weights and their config are not secrets; other users may read them


PIECE = 8 << 20  # values per generated piece: each piece has its own stream, so the pieces generate in parallel


def _layout(config: ModelConfig, seed: int) -> tuple[bytes, int, list[tuple[int, int, int, float]]]:
    """(header, file size, [(file offset, values, tensor index, std)]) of the generated file.

    The data section starts 64-byte aligned (the header is padded with spaces, as the format allows) and every
    tensor stays aligned within it: the mmap'd tensors are then as aligned as freshly allocated ones."""
    meta = {
        "format": "pt",
        "generator": "coldsnap.reference",
        "seed": str(seed),
        "config": json.dumps(config.to_dict(), sort_keys=True),
    }
    header: dict[str, Any] = {"__metadata__": meta}
    offset, places = 0, []
    for index, (name, shape, std) in enumerate(sorted(param_specs(config))):
        n = int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + 4 * n]}
        places.append((offset, n, index, std))
        offset += 4 * n
        offset += -offset % ALIGN  # keep the next tensor aligned
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    head = struct.pack("<Q", len(raw)) + raw
    return head, len(head) + offset, [(len(head) + at, n, index, std) for at, n, index, std in places]


def _piece(seed: int, index: int, first: int, count: int, std: float) -> np.ndarray:
    """Values [first, first + count) of tensor `index`: uniform in ±std·√3 (all ones for std 0), from a PCG64
    stream keyed by (seed, tensor, piece), so the bytes do not depend on the order the pieces run in."""
    if std == 0.0:
        return np.ones(count, dtype="<f4")
    out = np.random.Generator(np.random.PCG64([seed, index, first // PIECE])).random(count, dtype=np.float32)
    out *= np.float32(2.0)
    out -= np.float32(1.0)
    out *= np.float32(std * np.sqrt(3.0))
    return out.astype("<f4", copy=False)


def write_weights(path: str | os.PathLike, config: ModelConfig, seed: int = 0) -> int:
    """Generate the seeded weights of config into a safetensors file at path (atomically); return its size.

    Pieces are generated and written on all cores (numpy and pwrite release the GIL), so the 31 GB of the large
    GPU workload take seconds where one stream took minutes."""
    from concurrent.futures import ThreadPoolExecutor

    head, size, places = _layout(config, seed)
    with atomic_file(path, 0o644, sync=False) as f:  # weights are not secrets; a crash loses the file, never a use
        fd = f.fileno()
        os.ftruncate(fd, size)
        os.pwrite(fd, head, 0)

        def write(at: int, index: int, first: int, count: int, std: float) -> None:
            data = memoryview(_piece(seed, index, first, count, std)).cast("B")
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], at + 4 * first + done)

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            jobs = [pool.submit(write, at, index, first, min(PIECE, n - first), std)
                    for at, n, index, std in places for first in range(0, n, PIECE)]
            for job in jobs:
                job.result()
    return size


def check_shapes(path: str | os.PathLike, config: ModelConfig) -> None:
    _, header = read_header(path)
    for name, shape, _ in param_specs(config):
        info = header.get(name)
        if info is None:
            raise ValueError(f"{path}: no tensor {name}; the file was made for another model config")
        if tuple(info["shape"]) != shape:
            raise ValueError(
                f"{path}: tensor {name} has shape {tuple(info['shape'])}, the config wants {shape}; "
                f"the file was made for another model config"
            )


def read_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The config in the sidecar JSON, or None when there is none."""
    try:
        return json.loads(sidecar(path).read_text())["config"]
    except FileNotFoundError:
        return None


def ensure_weights(path: str | os.PathLike, config: ModelConfig, seed: int = 0) -> str:
    """Make sure the weights file exists (generating it if missing); return its absolute path.

    An existing file is not rewritten, but must fit the config. The sidecar <path>.json holds the config. Nothing
    is hashed here: a serving engine does not hash its weights at start (ColdSnap pins them at capture)."""
    p = Path(os.path.abspath(os.fspath(path)))
    if p.exists():
        check_shapes(p, config)
    else:
        write_weights(p, config, seed)
    side = {"config": config.to_dict(), "seed": seed, "size": p.stat().st_size}
    s = sidecar(p)
    try:
        current = json.loads(s.read_text())
    except (FileNotFoundError, ValueError):
        current = None
    if current != side:
        _atomic_write(s, (json.dumps(side, indent=2, sort_keys=True) + "\n").encode())
    return str(p)


def save_tensors(path: str | os.PathLike, tensors: dict[str, "torch.Tensor"], metadata: dict[str, str],
                 mode: int = 0o600) -> int:
    """Write tensors (any device, any of the dtypes above) as a safetensors file laid out like write_weights()'s:
    64-byte aligned data, names sorted. Written beside the target and renamed over it; returns the file's size.
    The bytes are the tensors as they are in memory, so load_into() puts back exactly what was saved."""
    import torch

    names = {v[0]: k for k, v in DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": names[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes + (-nbytes % ALIGN)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    # private by default: a model's tuned weights can be what it protects
    with atomic_file(path, mode, sync=False) as f:  # its digest is checked before any restore uses it
        f.write(struct.pack("<Q", len(raw)) + raw)
        base = f.tell()
        for name in sorted(tensors):
            f.seek(base + header[name]["data_offsets"][0])
            flat = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).cpu()
            # Through the raw pointer, not .numpy(): numpy sharing a storage makes it unresizable for good, and
            # release() then shrinks it to nothing.
            f.write(memoryview((ctypes.c_char * flat.numel()).from_address(flat.data_ptr())))
        f.truncate(base + offset)
    return base + offset


def _slice(t, shard):
    """This rank's part of a full tensor (a view; contiguous when the split is along dim 0)."""
    return t if shard is None else t.narrow(shard.dim, shard.start, shard.stop - shard.start)


def load_weights(path: str | os.PathLike, device: str = "cpu", mode: str = "mmap",
                 shards: dict[str, Any] | None = None) -> dict[str, "torch.Tensor"]:
    """Tensors of a safetensors file (with shards: only each sharded tensor's part, see model.shards).

    mode "mmap" on CPU: views over a private (copy-on-write) mapping of the file, no copy made (a part split along
    dim 1 is not contiguous in the file, so it is copied out).
    mode "copy" on CPU: the same values in anonymous memory.
    device cuda: tensors on the GPU (read through the mapping either way).
    """
    import torch

    if mode not in ("mmap", "copy"):
        raise ValueError(f"weights load mode must be mmap or copy, not {mode!r}")
    dev = torch.device(device)
    base, header = read_header(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    size = len(mm)
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype_name, itemsize = DTYPES[info["dtype"]]
        dtype = getattr(torch, dtype_name)
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = (end - start) // itemsize
        if base + end > size or count != int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{path}: tensor {name} lies outside the file or has the wrong size")
        if count == 0:
            t = torch.empty(shape, dtype=dtype)
        elif (base + start) % itemsize:  # misaligned in someone else's file: copy it out
            t = torch.frombuffer(bytearray(mm[base + start : base + end]), dtype=dtype).view(shape)
        else:
            t = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + start).view(shape)
        t = _slice(t, (shards or {}).get(name))
        if dev.type != "cpu":
            t = t.to(dev)
        elif mode == "copy" or not t.is_contiguous():
            t = t.contiguous() if not t.is_contiguous() else t.clone()
        out[name] = t
    if dev.type == "cpu" and mode == "mmap":
        _MAPS.append(mm)
    else:
        del mm  # the tensors were copied; the mapping goes once nothing points into it
    return out


def load_into(path: str | os.PathLike, params: dict[str, "torch.Tensor"], shards: dict[str, Any] | None = None,
              chunk_bytes: int = 128 << 20, threads: int | None = None) -> dict[str, float]:
    """Hydrate tensors in place from a safetensors file at full speed: the page cache is read by `threads`
    parallel preads straight into pinned staging buffers (two, so reading one chunk overlaps the device copy of
    the other), then copied to the device on a side stream. The tensors keep their addresses, so nothing that
    points at them (CUDA graphs) needs to know. With shards, each sharded tensor gets only its part (a part split
    along dim 1 is gathered row block by row block through the mapping). Works for CPU tensors too (no pinning)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch

    t0 = time.perf_counter()
    base, header = read_header(path)
    cuda = any(p.device.type == "cuda" for p in params.values())
    threads = threads or max(1, min(8, os.cpu_count() or 1))
    chunk = chunk_bytes
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    views = [memoryview(b.numpy()) for b in bufs]
    stream = torch.cuda.Stream() if cuda else None
    done = [torch.cuda.Event() for _ in range(2)] if cuda else []
    fd = os.open(path, os.O_RDONLY)
    mm = None
    moved, i = 0, 0
    pool = ThreadPoolExecutor(threads, thread_name_prefix="coldsnap-hydrate")

    def parallel_read(view: memoryview, offset: int) -> None:
        step = -(-len(view) // threads)
        step += -step % 4096
        jobs = [pool.submit(pread_full, fd, view[a:a + step], offset + a) for a in range(0, len(view), step)]
        for j in jobs:
            j.result()

    def parallel_gather(dst: "torch.Tensor", part: "torch.Tensor") -> None:
        # Row ranges copied side by side out of the mapping (torch drops the GIL while it copies).
        step = -(-part.shape[0] // threads)
        jobs = [pool.submit(dst[r:r + step].copy_, part[r:r + step]) for r in range(0, part.shape[0], step)]
        for j in jobs:
            j.result()

    def next_buffer() -> int:
        k = i % 2
        if cuda:
            done[k].synchronize()  # that buffer's previous device copy has finished
        return k

    def to_device(k: int, dst_bytes: "torch.Tensor", n: int) -> None:
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            dst_bytes.copy_(bufs[k][:n], non_blocking=cuda)
            if cuda:
                done[k].record(stream)

    try:
        for name, dst in params.items():
            info = header[name]
            start, end = info["data_offsets"]
            shape = tuple(info["shape"])
            itemsize = DTYPES[info["dtype"]][1]
            shard = (shards or {}).get(name)
            want = int(np.prod(local_shape(shape, shard), dtype=np.int64)) * itemsize
            if want != dst.numel() * dst.element_size():
                raise ValueError(f"{path}: tensor {name} has {want} bytes here, the model expects "
                                 f"{dst.numel() * dst.element_size()}")
            out = dst.view(-1).view(torch.uint8)
            if shard is None or shard.dim == 0:  # one contiguous byte range of the file
                row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
                lo = base + start + (shard.start * row if shard else 0)
                for off in range(0, want, chunk):
                    n = min(chunk, want - off)
                    k = next_buffer()
                    parallel_read(views[k][:n], lo + off)
                    to_device(k, out[off:off + n], n)
                    i += 1
                    moved += n
            else:  # split along dim 1: whole rows are not ours, gather our columns block by block
                if mm is None:
                    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                    src = torch.frombuffer(mm, dtype=torch.uint8)
                full = src[base + start: base + end].view(getattr(torch, DTYPES[info["dtype"]][0])).view(shape)
                part = _slice(full, shard)
                row = want // shape[0]
                rows = max(1, chunk // row)
                for r in range(0, shape[0], rows):
                    block = part[r:r + rows]
                    n = block.numel() * itemsize
                    k = next_buffer()
                    parallel_gather(bufs[k][:n].view(block.dtype).view(block.shape), block)
                    to_device(k, out[r * row:r * row + n], n)
                    i += 1
                    moved += n
                del full, part
        if cuda:
            stream.synchronize()
    finally:
        pool.shutdown()
        os.close(fd)
        if mm is not None:
            del src
            mm.close()
    seconds = time.perf_counter() - t0
    return {"bytes": moved, "seconds": seconds, "gb_per_s": moved / seconds / 1e9 if seconds else 0.0,
            "threads": threads}


def tensor_piece(info: dict[str, Any], shard) -> tuple[int, int, int, int]:
    """The piece of the data section (coldsnap.gpu.prefetch: offset, width, rows, pitch) holding a tensor's part:
    split along dim d, its rows are everything before d and each holds the shard's slice of dims d on."""
    start, end = info["data_offsets"]
    if shard is None:
        return (start, end - start, 1, end - start)
    shape, itemsize = info["shape"], DTYPES[info["dtype"]][1]
    inner = int(np.prod(shape[shard.dim + 1:], dtype=np.int64)) * itemsize  # bytes of one index along dim d
    rows = int(np.prod(shape[:shard.dim], dtype=np.int64))
    return (start + shard.start * inner, (shard.stop - shard.start) * inner, rows, shape[shard.dim] * inner)


def plan_of(header: dict[str, Any], names: list[str], shards: dict[str, Any] | None) -> list:
    """The pieces of the data section that hold these tensors' parts, in this order: what a restore's prefetcher
    loads for this rank (recorded at capture)."""
    return [tensor_piece(header[n], (shards or {}).get(n)) for n in names]


def prefetch_plan(path: str | os.PathLike, names: list[str], shards: dict[str, Any] | None) -> list:
    return plan_of(read_header(path)[1], names, shards)


def packed_parts(whole, header: dict[str, Any], names: list[str], shards: dict[str, Any] | None) -> dict:
    """{name: tensor part} as views of prefetched memory `whole` (uint8) that holds prefetch_plan's pieces, packed."""
    import torch

    pieces = plan_of(header, names, shards)
    out = {}
    for name, (_, width, rows, _), at in zip(names, pieces, packed_layout(pieces)[0]):
        info = header[name]
        shape = local_shape(tuple(info["shape"]), (shards or {}).get(name))
        out[name] = whole[at:at + width * rows].view(getattr(torch, DTYPES[info["dtype"]][0])).view(shape)
    return out


def load_prefetched(path: str | os.PathLike, params: dict[str, "torch.Tensor"], sock_path: str,
                    shards: dict[str, Any] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """Hydrate CUDA tensors in place from the file's data section that coldsnap.gpu.prefetch already put on this
    GPU: map the memory it hands over, copy each tensor (its shard) out device to device. Raises PrefetchError (or
    a CUDA error) when that can't be done; the caller then reloads from the file."""
    import time

    import torch

    t0 = time.perf_counter()
    took: dict[str, float] = {}  # where the hand-over's time goes: waiting for the prefetcher, mapping, copying
    path = os.fspath(path)
    base, header = read_header(path)
    session = Session(sock_path, path, timeout)
    message = session.message
    took["wait"] = time.perf_counter() - t0
    try:
        try:
            device = next(iter(params.values())).device
            if device.type != "cuda":
                raise PrefetchError(f"prefetched weights are GPU memory; these tensors are on {device}")
            if message.get("offset") != base:
                raise PrefetchError(f"the prefetcher's data section starts at {message.get('offset')}, not {base}")
            ordinal = device.index if device.index is not None else torch.cuda.current_device()
            driver = Driver()
            driver.use_primary_context(ordinal)
        except BaseException:
            os.close(session.fd)  # imported() below closes it otherwise
            raise
        moved = 0
        t = time.perf_counter()
        with imported(driver, session.fd, int(message["alloc_bytes"]), ordinal) as ptr:
            took["map"] = time.perf_counter() - t
            t = time.perf_counter()
            whole = torch.as_tensor(DeviceRegion(ptr, int(message["bytes"])), device=torch.device("cuda", ordinal))
            names = list(params)
            if "plan" in message:  # only this rank's parts, packed
                if message["plan"] != plan_digest(plan_of(header, names, shards)):
                    raise PrefetchError("the prefetcher loaded other parts of the file than this rank's")
                parts = packed_parts(whole, header, names, shards)
            else:
                parts = {}
                for name in names:
                    info = header[name]
                    start, end = info["data_offsets"]
                    dtype = getattr(torch, DTYPES[info["dtype"]][0])
                    parts[name] = _slice(whole[start:end].view(dtype).view(tuple(info["shape"])),
                                         (shards or {}).get(name))
            with torch.no_grad():
                for name, dst in params.items():
                    part = parts[name]
                    if tuple(part.shape) != tuple(dst.shape) or part.dtype != dst.dtype:
                        raise PrefetchError(f"tensor {name} is {tuple(part.shape)} {part.dtype} in the file, the "
                                            f"model expects {tuple(dst.shape)} {dst.dtype}")
                    dst.copy_(part)
                    moved += dst.numel() * dst.element_size()
            torch.cuda.synchronize(ordinal)
            del whole, parts
            took["copy"] = time.perf_counter() - t
            t = time.perf_counter()
        took["unmap"] = time.perf_counter() - t
    finally:
        session.close()
    seconds = time.perf_counter() - t0
    return {"bytes": moved, "seconds": seconds, "gb_per_s": moved / seconds / 1e9 if seconds else 0.0,
            "prefetched": True, "took_s": {k: round(v, 4) for k, v in took.items()}}
