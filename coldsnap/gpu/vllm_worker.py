"""Runs inside vLLM's GPU worker (its `--worker-extension-cls`): the weights of a recovery restore reloaded through
the prefetcher's parallel pinned-buffer reads instead of vLLM's own loader.

vLLM's `reload_weights` reads each safetensors tensor into pageable host memory on one thread and copies it to the
GPU from there. Here each file's data section goes onto the GPU first, as coldsnap.gpu.prefetch fills its memory
(`fill_buffered`: threads reading into pinned buffers, each copying on its own stream), then the tensors are handed
to vLLM's `reload_weights` as views of that GPU copy: its weight loaders (fused QKV, gate/up, layerwise reload) run
unchanged and copy device to device into the parameters the restored CUDA graphs point at. One file at a time, so
the extra GPU memory is one shard's size.

Imported by the engine's own interpreter (torch, vLLM): stdlib, torch and ColdSnap's GPU part only, nothing that
needs ColdSnap's own dependencies. The restore calls it over vLLM's dev endpoint:
POST /collective_rpc {"method": "coldsnap_reload_weights", "args": ["<json: {\"threads\": N}>"]}.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any, Iterator

from coldsnap.gpu.prefetch import fill_buffered, whole_section
from coldsnap.gpu.vmm import Driver

EXTENSION = f"{__name__}.ColdSnapWorker"  # what --worker-extension-cls names
METHOD = "coldsnap_reload_weights"
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files vLLM loads from a model directory: those its index maps tensors to, else all."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(d.glob("*.safetensors"))


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, the tensors' header entries) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def tensors_on_gpu(files: list[Path], device: int, threads: int, stats: dict[str, float]) -> Iterator[tuple]:
    """(name, CUDA tensor) for every tensor of the files, each file's data section copied onto the GPU in one go
    first; a file's copy is released once its tensors have been taken. stats gets bytes and seconds spent filling."""
    import torch

    driver = Driver()
    for path in files:
        base, header = read_header(path)
        length = path.stat().st_size - base
        t = time.perf_counter()
        section = torch.empty(length, dtype=torch.uint8, device=torch.device("cuda", device))
        fd = os.open(path, os.O_RDONLY)
        try:
            fill_buffered(driver, device, section.data_ptr(), fd, base, whole_section(length), threads)
        finally:
            os.close(fd)
        stats["fill_s"] += time.perf_counter() - t
        stats["bytes"] += length
        for name, info in header.items():
            start, end = info["data_offsets"]
            dtype = getattr(torch, DTYPES[info["dtype"]])
            yield name, section[start:end].view(dtype).view(tuple(info["shape"]))
        del section


class ColdSnapWorker:
    """Mixed into vLLM's Worker by --worker-extension-cls; `self` is the worker (model_runner, model_config)."""

    def coldsnap_reload_weights(self, options: str = "{}") -> dict[str, Any]:
        import torch

        opts = json.loads(options)
        t0 = time.perf_counter()
        device = torch.cuda.current_device()
        files = weight_files(self.model_config.model)  # type: ignore[attr-defined]
        if not files:
            raise FileNotFoundError(f"no safetensors files in {self.model_config.model}")  # type: ignore[attr-defined]
        stats: dict[str, float] = {"fill_s": 0.0, "bytes": 0}
        weights = tensors_on_gpu(files, device, int(opts.get("threads", 8)), stats)
        self.model_runner.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the last shard's copy: room for the KV cache woken next
        total = time.perf_counter() - t0
        return {"files": len(files), "bytes": int(stats["bytes"]), "fill_s": round(stats["fill_s"], 3),
                "total_s": round(total, 3), "gb_per_s": round(stats["bytes"] / total / 1e9, 2)}
